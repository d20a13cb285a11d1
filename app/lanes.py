"""One supervised ProcessPoolExecutor: bounded dispatch, deadlines, and one rebuild per breakage.

A ProcessPoolExecutor cannot say which task killed a worker: when one dies, every task in flight
fails with BrokenProcessPool and the executor is unusable for good. A Lane

- keeps at most `depth` tasks in the executor (by default one running and one ready to go per
  worker: fewer leaves workers idle while a result makes its way back through the event loop);
  the rest wait here, in order, where withdrawing a cancelled one is free;
- notices the breakage and replaces the executor exactly once, however many tasks saw it break
  (a generation number tells late observers that the replacement is already under way);
- kills the workers of a task that runs past its deadline, which turns a stall into a breakage;
- never cancels a future it gave the executor (CPython 3.11 breaks its manager thread if a
  cancelled future is still pending when a worker dies): callers that give up just stop waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import time
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from multiprocessing.connection import wait as wait_for_sentinels
from typing import Any, TypeVar

from app import worker
from app.errors import Unavailable
from app.metrics import Metrics

logger = logging.getLogger("tokenizer.pool")

Result = TypeVar("Result")

WARM_UP_TIMEOUT_SECONDS = 120.0
REBUILD_BACKOFF_SECONDS = (0.5, 10.0)


class WorkerCrashed(Exception):
    """The executor broke while the task was in flight: some worker died, maybe not the task's own."""

    def __init__(self, message: str, progress: int = -1) -> None:
        super().__init__(message)
        self.progress = progress


class WorkerStalled(WorkerCrashed):
    """The task ran past its deadline, so the lane killed its workers."""


def _unavailable(message: str) -> Unavailable:
    return Unavailable(message, headers={"Retry-After": "1"})


class Lane:
    """`size` worker processes behind a bounded dispatch queue, rebuilt when a worker dies."""

    def __init__(
        self,
        name: str,
        size: int,
        initializer: Callable[..., None],
        initargs: tuple[Any, ...],
        metrics: Metrics,
        *,
        depth: int | None = None,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self.name = name
        self.size = size
        self.depth = depth or 2 * size
        self._initializer = initializer
        self._initargs = initargs
        self._metrics = metrics
        self._on_change = on_change
        self._slots = asyncio.Semaphore(self.depth)
        self._executor: ProcessPoolExecutor | None = None
        self._generation = 0
        # Pending while (re)building, done once serving, failed while a rebuild keeps failing.
        self._healthy: asyncio.Future[None] | None = None
        self._build_task: asyncio.Task[None] | None = None
        self._stalled: set[Future[Any]] = set()
        self._closed = False

    # -- lifecycle -------------------------------------------------------------------------------

    def _new_executor(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(
            max_workers=self.size,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=self._initializer,
            initargs=self._initargs,
        )

    async def _warm_up(self, executor: ProcessPoolExecutor) -> None:
        """Start every worker (one ping each spawns one) and wait until each has loaded the models."""
        loop = asyncio.get_running_loop()
        pings = [_watch(executor.submit(worker.ping), loop) for _ in range(self.size)]
        await asyncio.wait_for(asyncio.gather(*pings), WARM_UP_TIMEOUT_SECONDS)

    async def start(self) -> None:
        """Build the executor now and wait for its workers; raise if they cannot start."""
        loop = asyncio.get_running_loop()
        self._healthy = loop.create_future()
        executor = self._new_executor()
        try:
            await self._warm_up(executor)
        except BaseException:
            _dispose(executor, grace=0.0)
            self._healthy.cancel()
            self._healthy = None
            raise
        self._executor = executor
        self._healthy.set_result(None)

    def close(self, grace: float = 2.0) -> None:
        """Stop the workers: `grace` seconds to finish what they run, then SIGKILL. Blocks."""
        self._closed = True
        if self._build_task is not None:
            self._build_task.cancel()
        executor, self._executor = self._executor, None
        if self._healthy is not None and not self._healthy.done():
            self._healthy.set_exception(_unavailable("the server is shutting down"))
            self._healthy.exception()  # retrieved: nobody may be waiting
        if executor is not None:
            _dispose(executor, grace)

    def worker_pids(self) -> list[int]:
        processes = getattr(self._executor, "_processes", None) or {}
        return sorted(processes)

    def check(self) -> bool:
        """Serving right now? Also notices a worker that died while the lane was idle."""
        if self._closed or self._executor is None or not _succeeded(self._healthy):
            return False
        if getattr(self._executor, "_broken", False):  # the executor's own flag, set by its manager thread
            self._begin_rebuild(self._generation)
            return False
        return True

    def _begin_rebuild(self, generation: int, *, restart: bool = True) -> None:
        """Replace the executor of `generation`, unless that was done or is under way already."""
        if self._closed or generation != self._generation:
            return
        self._generation += 1
        broken, self._executor = self._executor, None
        self._healthy = asyncio.get_running_loop().create_future()
        if restart:
            self._metrics.worker_restarts.inc()
            logger.warning("%s workers: a worker died; rebuilding the pool", self.name)
        self._build_task = asyncio.ensure_future(self._rebuild(broken, restart))
        self._build_task.add_done_callback(self._rebuild_ended)
        self._changed()

    def _rebuild_ended(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and (error := task.exception()) is not None:  # a bug: say so, loudly
            logger.error("%s workers: the rebuild stopped: %r", self.name, error, exc_info=error)

    async def _rebuild(self, broken: ProcessPoolExecutor | None, restart: bool) -> None:
        started = time.monotonic()
        if broken is not None:
            await asyncio.to_thread(_dispose, broken, 0.0)
        delay = REBUILD_BACKOFF_SECONDS[0]
        while not self._closed and self._healthy is not None:
            healthy = self._healthy
            executor: ProcessPoolExecutor | None = None
            try:
                executor = self._new_executor()
                await self._warm_up(executor)
            except asyncio.CancelledError:
                if executor is not None:
                    _dispose(executor, grace=0.0)
                raise
            except Exception as exc:  # a model file gone, the machine out of memory: keep trying
                if executor is not None:
                    await asyncio.to_thread(_dispose, executor, 0.0)
                logger.error("%s workers: restart failed (%r); next try in %.1fs", self.name, exc, delay)
                healthy.set_exception(_unavailable("the tokenizer workers are restarting; retry"))
                healthy.exception()  # retrieved: waiters, if any, got it already
                await asyncio.sleep(delay)
                delay = min(delay * 2, REBUILD_BACKOFF_SECONDS[1])
                self._healthy = asyncio.get_running_loop().create_future()
                continue
            self._executor = executor
            healthy.set_result(None)
            elapsed = time.monotonic() - started
            if restart:
                self._metrics.rebuild_seconds.observe(elapsed)
            logger.warning("%s workers: serving after %.2fs, pids %s", self.name, elapsed, self.worker_pids())
            self._changed()
            return

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change()

    # -- dispatch --------------------------------------------------------------------------------

    async def _serving(self) -> tuple[ProcessPoolExecutor, int]:
        while True:
            if self._closed:
                raise _unavailable("the server is shutting down")
            if self._healthy is None:  # a lane that starts on first use
                self._begin_rebuild(self._generation, restart=False)
            healthy = self._healthy
            if _succeeded(healthy) and self._executor is not None:
                return self._executor, self._generation
            if healthy is None or healthy.done():
                raise _unavailable("the tokenizer workers are restarting; retry")
            await asyncio.shield(healthy)

    async def call(self, function: Callable[[], Result], deadline: float, *, progress: Any | None = None) -> Result:
        """Run `function` on a worker within `deadline` seconds of handing it over.

        Raises WorkerCrashed when the executor broke meanwhile (retrying is the caller's choice),
        WorkerStalled when this task ran past its deadline, Unavailable while the lane cannot serve.
        `progress`, a shared counter the task writes, is reset before and read into the exception.
        """
        loop = asyncio.get_running_loop()
        try:
            await self._slots.acquire()
        except asyncio.CancelledError:
            self._metrics.cancelled_chunks.inc()
            raise
        try:
            executor, generation = await self._serving()
            if progress is not None:
                progress.value = -1
            future = executor.submit(function)
        except BrokenProcessPool:
            self._slots.release()
            self._begin_rebuild(generation)
            raise WorkerCrashed(f"{self.name} workers: the pool broke") from None
        except RuntimeError as exc:  # "cannot schedule new futures after shutdown"
            self._slots.release()
            raise _unavailable("the server is shutting down") from exc
        except asyncio.CancelledError:
            self._slots.release()
            self._metrics.cancelled_chunks.inc()
            raise
        except BaseException:
            self._slots.release()
            raise
        waiter: asyncio.Future[Result] = loop.create_future()
        timer = loop.call_later(deadline, self._on_deadline, future, generation, deadline)

        def finished(_: Future[Any]) -> None:
            with contextlib.suppress(RuntimeError):  # the event loop is closed: nobody is waiting any more
                loop.call_soon_threadsafe(self._finish, future, waiter, timer, generation, progress)

        future.add_done_callback(finished)
        return await waiter

    def _finish(
        self,
        future: Future[Result],
        waiter: asyncio.Future[Result],
        timer: asyncio.TimerHandle,
        generation: int,
        progress: Any | None,
    ) -> None:
        timer.cancel()
        self._slots.release()
        stalled = future in self._stalled
        self._stalled.discard(future)
        error = _unavailable("the server is shutting down") if future.cancelled() else future.exception()
        if isinstance(error, BrokenProcessPool):
            self._begin_rebuild(generation)
            kind = WorkerStalled if stalled else WorkerCrashed
            error = kind(f"{self.name} workers: the pool broke", -1 if progress is None else int(progress.value))
        if waiter.done():  # the caller gave up
            return
        if error is None:
            waiter.set_result(future.result())
        else:
            waiter.set_exception(error)

    def _on_deadline(self, future: Future[Any], generation: int, deadline: float) -> None:
        executor = self._executor
        if future.done() or generation != self._generation or executor is None:
            return
        self._stalled.add(future)
        self._metrics.worker_stalls.inc()
        logger.error("%s workers: a chunk ran past its %.1fs deadline; killing the workers", self.name, deadline)
        for process in list((getattr(executor, "_processes", None) or {}).values()):
            process.kill()


def _succeeded(future: asyncio.Future[None] | None) -> bool:
    return future is not None and future.done() and not future.cancelled() and future.exception() is None


def _watch(future: Future[Result], loop: asyncio.AbstractEventLoop) -> asyncio.Future[Result]:
    """An asyncio view of an executor future that, unlike asyncio.wrap_future, never cancels it."""
    waiter: asyncio.Future[Result] = loop.create_future()

    def settle(_: Future[Result]) -> None:
        if waiter.done():
            return
        if future.cancelled():
            waiter.set_exception(_unavailable("the server is shutting down"))
        elif (error := future.exception()) is not None:
            waiter.set_exception(error)
        else:
            waiter.set_result(future.result())

    def finished(_: Future[Result]) -> None:
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(settle, future)

    future.add_done_callback(finished)
    return waiter


def _dispose(executor: ProcessPoolExecutor, grace: float) -> None:
    """Shut an executor down and make sure none of its processes outlives this call."""
    try:
        processes = list((getattr(executor, "_processes", None) or {}).values())
        manager = getattr(executor, "_executor_manager_thread", None)
        executor.shutdown(wait=False, cancel_futures=False)
        alive = [process for process in processes if process.exitcode is None]
        if alive and grace > 0:
            wait_for_sentinels([process.sentinel for process in alive], timeout=grace)
        for process in processes:
            if process.exitcode is None:
                process.kill()
        for process in processes:
            process.join(timeout=5.0)
        if manager is not None:
            manager.join(timeout=5.0)
            if manager.is_alive():
                logger.error("an executor manager thread did not stop")
    except Exception:  # logged, not raised: disposing of the old pool must not stop the new one
        logger.exception("could not shut a worker pool down cleanly")
