"""The server's worker processes, each on a socket pair of its own, grouped in lanes.

A `Worker` is one process and its channel (tokenizer_service.core.channel). The server keeps at most `DEPTH` jobs on
a worker's socket: one running and one ready, so a worker never waits for the event loop between
jobs. Because a worker answers its jobs in order, the oldest unanswered one is the one it runs:

- a worker that dies (its socket reads end-of-file) fails exactly that job (`WorkerCrashed`); the
  jobs queued behind it go back to the front of the lane's queue, unharmed;
- a job that runs past its deadline (the clock starts when the job reaches the head, not when it
  was queued) gets its worker killed: `WorkerCrashed(stalled=True)`;
- only the dead worker restarts; the others go on serving.

A `Lane` is a set of interchangeable workers (the tokenizers; the seeded sampler) and the queue of
jobs waiting for one of them: a job goes to the least busy worker, and a cancelled job still
waiting is dropped for free. The lane raises domain errors only (tokenizer_service.core.errors).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import socket
import time
from collections import deque
from collections.abc import Callable, Sequence

from tokenizer_service.core import channel, process, zygote
from tokenizer_service.core.errors import Unavailable
from tokenizer_service.core.poison import POISON_MEMORY
from tokenizer_service.core.protocol import read_result_head
from tokenizer_service.metrics import Metrics
from tokenizer_service.settings import usable_cpus

logger = logging.getLogger("tokenizer.pool")

DEPTH = 2
SOCKET_BUFFER_BYTES = 4 * 1024 * 1024  # capped by net.core.wmem_max / rmem_max
START_TIMEOUT_SECONDS = 120.0
RESTART_BACKOFF_SECONDS = (0.25, 5.0)

Buffer = bytes | bytearray | memoryview


class WorkerCrashed(Exception):
    """The worker running the job died (or was killed for stalling) before it answered."""

    def __init__(self, message: str, *, progress: int = -1, stalled: bool = False) -> None:
        super().__init__(message)
        self.progress = progress
        self.stalled = stalled


# -- the server's side ----------------------------------------------------------------------------------


class Job:
    """One message for a worker, and the future its reply settles."""

    __slots__ = ("deadline", "future", "interim", "kind", "number", "parts", "queued_at", "sent", "stamp", "units")

    def __init__(
        self,
        kind: int,
        parts: Sequence[Buffer],
        units: int,
        future: asyncio.Future[tuple[int, Buffer]],
        stamp: Callable[[int], Buffer] | None = None,
        deadline: float | None = None,
        interim: Callable[[Buffer], None] | None = None,
    ) -> None:
        self.kind = kind
        self.interim = interim  # takes a SHARE the worker sends while it runs the job
        self.deadline = deadline  # seconds it may run; None: the lane's stall deadline for its units
        self.parts = parts
        self.stamp = stamp  # builds parts[0] at hand-off from the number of idle workers then
        self.units = units
        self.future = future
        self.number = 0
        self.sent = False
        self.queued_at = time.monotonic()


class _Protocol(asyncio.BufferedProtocol):
    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.reader = channel.FrameReader()

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.reader.buffer()

    def buffer_updated(self, nbytes: int) -> None:
        for number, kind, payload in self.reader.advance(nbytes):
            self.worker.replied(number, kind, payload)

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.worker.lost()


class WorkerState(enum.Enum):
    """Where a worker process is in its life: only `SERVING` takes jobs; all but `GONE` take poison texts."""

    STARTING = "starting"  # the process runs; its first ping is answered once its models are loaded
    SERVING = "serving"
    STALLED = "stalled"  # a serving one killed for running past a deadline; its socket has not closed yet
    GONE = "gone"  # its socket closed (it died, was killed or was stopped), or it failed to start


class Worker:
    """One worker process, its socket, and the jobs on it (oldest first: the one it runs)."""

    def __init__(self, lane: Lane, slot: int) -> None:
        self.lane = lane
        self.slot = slot
        self.inflight: deque[Job] = deque()
        self.state = WorkerState.STARTING
        self._numbers = 0
        self._timer: asyncio.TimerHandle | None = None
        self._transport: asyncio.Transport | None = None
        context = zygote.context()  # forked from the zygote that loaded the models, where one started
        self.progress = context.RawValue("q", -1)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        for end in (ours, theirs):  # a whole answer in one write and one read where the system allows
            for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                end.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)
        self.process = context.Process(
            target=process.serve,
            args=(theirs, lane.startup, self.progress),
            name=f"tokenizer-{lane.name}-{slot}",
            daemon=True,
        )
        try:
            self.process.start()
        finally:
            theirs.close()
        self._socket = ours

    async def connect(self) -> None:
        loop = asyncio.get_running_loop()
        self._socket.setblocking(False)
        transport, _ = await loop.connect_accepted_socket(lambda: _Protocol(self), self._socket)
        self._transport = transport

    @property
    def serving(self) -> bool:
        return self.state is WorkerState.SERVING

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def send(self, job: Job) -> None:
        assert self._transport is not None
        self._numbers = (self._numbers + 1) & 0xFFFFFFFF
        job.number = self._numbers
        job.sent = True
        self.inflight.append(job)
        if len(self.inflight) == 1:
            self._start_clock(job)
        self._transport.writelines(channel.frame_parts(job.number, job.kind, job.parts))

    def fall_back(self, payload: bytes, kind: int = channel.FALLBACK) -> None:
        """A FALLBACK (or a PROMOTE): the encoder of one model changes."""
        if self._transport is not None and self.state is not WorkerState.GONE:
            self._transport.writelines(channel.frame(0, kind, payload))

    def poison(self, payload: bytes) -> None:
        if self._transport is not None and self.state is not WorkerState.GONE:  # a starting one too (Lane._ready)
            self._transport.writelines(channel.frame(0, channel.POISON, payload))

    def _start_clock(self, job: Job) -> None:
        if self._timer is not None:
            self._timer.cancel()
        deadline = self.lane.deadline(job.units) if job.deadline is None else job.deadline
        self._timer = self.lane.loop.call_later(deadline, self._stall, job)

    def _stall(self, job: Job) -> None:
        if self.state is WorkerState.GONE or not self.inflight or self.inflight[0] is not job:
            return
        if self.state is WorkerState.SERVING:  # one still starting fails its first ping: its starter retries
            self.state = WorkerState.STALLED
        self.lane.metrics.worker_stalls.inc()
        logger.error(
            "%s worker %s: a job ran past its %.1fs deadline; killing it",
            self.lane.name,
            self.pid,
            self.lane.deadline(job.units) if job.deadline is None else job.deadline,
        )
        self.process.kill()

    def replied(self, number: int, kind: int, payload: Buffer) -> None:
        if kind == channel.VERIFIED:  # unsolicited, between replies: shadow verification's findings
            if self.lane.on_verified is not None:
                self.lane.on_verified(payload)
            return
        if not self.inflight or self.inflight[0].number != number:
            logger.error("%s worker %s answered job %d out of turn; restarting it", self.lane.name, self.pid, number)
            self.process.kill()
            return
        if kind == channel.SHARE:  # the job goes on: its reply comes later
            job = self.inflight[0]
            if job.interim is not None and not job.future.done():
                job.interim(payload)
            return
        job = self.inflight.popleft()
        if self.inflight:
            self._start_clock(self.inflight[0])
        elif self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if kind == channel.DONE or kind == channel.PART:
            started = read_result_head(payload).started
            self.lane.metrics.queue_wait.observe(max(started - job.queued_at, 0.0))
        if not job.future.done():
            job.future.set_result((kind, payload))
        self.lane.pump()

    def lost(self) -> None:
        """The socket closed: the process died, was killed, or is being stopped."""
        if self.state is WorkerState.GONE:
            return
        was = self.state
        self.state = WorkerState.GONE
        if self._timer is not None:
            self._timer.cancel()
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5.0)
        jobs = list(self.inflight)
        self.inflight.clear()
        self.lane.worker_lost(self, jobs, was)

    def close(self) -> None:
        """Stop: end-of-file on its socket tells the process to exit when it is between jobs.

        The shutdown is immediate; closing the transport alone would wait for the event loop, which
        the caller may be blocking while it waits for the process to exit.
        """
        with contextlib.suppress(OSError):
            self._socket.shutdown(socket.SHUT_RDWR)
        if self._transport is not None:
            self._transport.close()
        else:
            self._socket.close()


class Lane:
    """Interchangeable workers and the jobs waiting for one of them."""

    def __init__(
        self,
        name: str,
        size: int,
        startup: process.Startup,
        metrics: Metrics,
        *,
        stall_timeout: float,
        stall_seconds_per_unit: float,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self.name = name
        self.size = size
        self.startup = startup
        self.metrics = metrics
        self.stall_timeout = stall_timeout
        self.stall_seconds_per_unit = stall_seconds_per_unit
        self.workers: list[Worker | None] = [None] * size
        self.waiting: deque[Job] = deque()
        self.failing = False  # the last start of a worker failed and none serves: refuse at once
        self.closed = False
        self._on_change = on_change
        self._restarts: dict[int, asyncio.Task[None]] = {}
        self._poison: list[bytes] = []
        # models whose encoder changed since the workers were announced them, in order: (PROMOTE or FALLBACK, payload)
        self._fallbacks: list[tuple[int, bytes]] = []
        self.on_verified: Callable[[Buffer], None] | None = None  # takes a worker's VERIFIED
        self._loop: asyncio.AbstractEventLoop | None = None
        self.cores = usable_cpus()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop, looked up once: asyncio.get_running_loop() costs a getpid() per call on 3.11."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop

    def deadline(self, units: int) -> float:
        return self.stall_timeout + units * self.stall_seconds_per_unit

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start every worker and wait until each has loaded the models; raise if one cannot."""
        workers = [Worker(self, slot) for slot in range(self.size)]
        self.workers = list(workers)
        try:
            await asyncio.wait_for(asyncio.gather(*(self._ready(worker) for worker in workers)), START_TIMEOUT_SECONDS)
        except BaseException:
            self.close(grace=0.0)
            raise

    async def _ready(self, worker: Worker) -> None:
        """Connect, ping, and put the worker to work once it answers.

        The first ping is answered once the worker has imported the libraries and loaded every model (with
        the fast encoder's check): seconds for large tokenizer.json files, more on a busy machine. It is
        bounded by the start timeout, not the stall deadline of a job."""
        await worker.connect()
        future: asyncio.Future[tuple[int, Buffer]] = self.loop.create_future()
        worker.send(Job(channel.PING, [b""], 0, future, deadline=START_TIMEOUT_SECONDS))
        kind, _ = await future
        if kind != channel.PONG:
            raise RuntimeError(f"{self.name} worker {worker.pid} answered its first ping with kind {kind}")
        for payload in self._poison:
            worker.poison(payload)
        for kind, payload in self._fallbacks:
            worker.fall_back(payload, kind)
        worker.state = WorkerState.SERVING
        self.failing = False
        self._changed()
        self.pump()

    def close(self, grace: float = 2.0) -> None:
        """Stop every worker: `grace` seconds to finish the job it runs, then SIGKILL. Blocks."""
        self.closed = True
        for task in self._restarts.values():
            task.cancel()
        workers = [worker for worker in self.workers if worker is not None]
        for worker in workers:
            worker.close()
        deadline = time.monotonic() + grace
        for worker in workers:
            worker.process.join(timeout=max(0.0, deadline - time.monotonic()))
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join(timeout=5.0)
        self._fail_waiting(Unavailable("the server is shutting down"))

    @property
    def serving(self) -> int:
        return sum(1 for worker in self.workers if worker is not None and worker.serving)

    def pids(self) -> list[int]:
        return [worker.pid for worker in self.workers if worker is not None and worker.pid is not None]

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change()

    # -- dispatch --------------------------------------------------------------------------------

    def submit(
        self,
        kind: int,
        parts: Sequence[Buffer],
        units: int,
        stamp: Callable[[int], Buffer] | None = None,
        interim: Callable[[Buffer], None] | None = None,
    ) -> asyncio.Future[tuple[int, Buffer]]:
        """Queue a job; the future settles with (reply kind, payload) or a WorkerCrashed/Unavailable.

        `stamp(idle)`, if given, builds the job's first buffer when a worker takes it, knowing how
        many workers are idle then (it is how a large request decides how far to split);
        `interim(payload)` takes a SHARE the worker sends before the reply.
        """
        if self.closed:
            raise Unavailable("the server is shutting down")
        if self.failing and not self.serving:
            raise Unavailable("the tokenizer workers are restarting; retry")
        future: asyncio.Future[tuple[int, Buffer]] = self.loop.create_future()
        job = Job(kind, parts, units, future, stamp, interim=interim)
        self.waiting.append(job)
        self.pump()
        if not job.sent:
            future.add_done_callback(lambda _: self._withdraw(job))
        return future

    def _spare(self) -> int:
        """Idle workers with a free core each: splitting a request wider only adds overhead."""
        idle = busy = 0
        for worker in self.workers:
            if worker is not None and worker.serving:
                if worker.inflight:
                    busy += 1
                else:
                    idle += 1
        return max(1, min(idle, self.cores - busy))

    def _withdraw(self, job: Job) -> None:
        """A waiting job whose request gave up (timeout, hang-up) leaves the queue at once."""
        if job.sent or not job.future.cancelled():
            return
        try:
            self.waiting.remove(job)
        except ValueError:
            return
        self.metrics.cancelled_chunks.inc()

    def pump(self) -> None:
        """Hand waiting jobs to the least busy workers, up to DEPTH each; drop withdrawn ones."""
        waiting = self.waiting
        while waiting:
            best: Worker | None = None
            for worker in self.workers:
                if (
                    worker is not None
                    and worker.serving
                    and len(worker.inflight) < DEPTH
                    and (best is None or len(worker.inflight) < len(best.inflight))
                ):
                    best = worker
                    if not worker.inflight:
                        break
            if best is None:
                return
            job = waiting.popleft()
            if job.future.done():  # settled while it waited (the lane failed it)
                continue
            if job.stamp is not None:
                job.parts = [job.stamp(self._spare()), *job.parts[1:]]
            best.send(job)

    def worker_lost(self, worker: Worker, jobs: list[Job], was: WorkerState) -> None:
        """A worker died: fail the job it ran, requeue the rest in order, restart it.

        One that died while starting failed its first ping: whoever started it tries again.
        """
        if jobs:
            head, rest = jobs[0], jobs[1:]
            if not head.future.done():
                progress = int(worker.progress.value)
                head.future.set_exception(
                    WorkerCrashed(
                        f"{self.name} worker {worker.pid} died running a job",
                        progress=progress,
                        stalled=was is WorkerState.STALLED,
                    )
                )
            self.waiting.extendleft(reversed(rest))
        if self.closed or was is WorkerState.STARTING:
            return
        self.metrics.worker_restarts.inc()
        logger.warning(
            "%s worker %s died (exit code %s); restarting it", self.name, worker.pid, worker.process.exitcode
        )
        self._changed()
        self._restart(worker.slot)

    def _restart(self, slot: int) -> None:
        task = self.loop.create_task(self._restart_loop(slot))
        self._restarts[slot] = task
        task.add_done_callback(lambda _: self._restarts.pop(slot, None))

    async def _restart_loop(self, slot: int) -> None:
        started = time.monotonic()
        delay = RESTART_BACKOFF_SECONDS[0]
        while not self.closed:
            worker: Worker | None = None
            try:
                worker = Worker(self, slot)
                self.workers[slot] = worker
                await asyncio.wait_for(self._ready(worker), START_TIMEOUT_SECONDS)
            except asyncio.CancelledError:
                raise
            except Exception:  # a model file gone or changed, the machine out of memory: keep trying
                if worker is not None:
                    worker.state = WorkerState.GONE
                    worker.close()
                    if worker.process.is_alive():
                        worker.process.kill()
                    worker.process.join(timeout=5.0)
                code = None if worker is None else worker.process.exitcode
                logger.error("%s worker failed to start (exit code %s); next try in %.2fs", self.name, code, delay)
                if not self.serving:
                    self.failing = True
                    self._fail_waiting(Unavailable("the tokenizer workers are restarting; retry"))
                    self._changed()
                await asyncio.sleep(delay)
                delay = min(delay * 2, RESTART_BACKOFF_SECONDS[1])
                continue
            elapsed = time.monotonic() - started
            self.metrics.rebuild_seconds.observe(elapsed)
            logger.warning("%s worker %d serving again after %.2fs, pid %s", self.name, slot, elapsed, worker.pid)
            return

    def _fail_waiting(self, error: Exception) -> None:
        while self.waiting:
            job = self.waiting.popleft()
            if not job.future.done():
                job.future.set_exception(error)

    def broadcast_poison(self, payload: bytes) -> None:
        self._poison = [*self._poison[-POISON_MEMORY + 1 :], payload]
        for worker in self.workers:
            if worker is not None and worker.serving:
                worker.poison(payload)

    def broadcast_fallback(self, payload: bytes, kind: int = channel.FALLBACK) -> None:
        """Every worker, and every one started later, encodes the model with its reference library (FALLBACK),
        or with fastokens (PROMOTE: its gate passed in the background)."""
        self._fallbacks.append((kind, payload))
        for worker in self.workers:
            if worker is not None and worker.state is not WorkerState.GONE:
                worker.fall_back(payload, kind)
