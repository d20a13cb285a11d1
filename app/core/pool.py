"""The worker pool: a request's body in, its answer's bytes out, with crashes and stalls survived.

Two lanes of worker processes (tokenizer_service.core.lanes): `workers` tokenizers, and one seeded sampler
(sentencepiece 0.2.3 mixes per-process random state into its sampler, so a seed reproduces ids
only within one process), started only when a SentencePiece model is served. A request goes to a
tokenizer as raw bytes; the worker splits a large one into chunks when other workers are idle:
it shares the others (SHARE), which run on the least busy workers, while it runs the first
(tokenizer_service.core.handler); the parts are joined here (tokenizer_service.core.join).

Supervision, per job: a job whose worker died runs once more; one that dies again, or stalls,
runs *carefully* (one text at a time, its position in shared memory), and if that worker dies
too, the text it was on is poison: refused with its index (PoisonInput), remembered by every
worker, and refused at once when sent again. Everyone else's jobs are retried, not failed.
Only domain errors leave this module (tokenizer_service.core.errors); tokenizer_service.http.edge maps them to HTTP.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar

import orjson

from tokenizer_client import wire
from tokenizer_service.core import channel
from tokenizer_service.core.errors import PoisonInput, ServiceError, Unavailable
from tokenizer_service.core.handler import Limits
from tokenizer_service.core.join import (
    Answer,
    ChunkResult,
    join_detokenize,
    join_tokenize,
    read_chunk_result,
    read_done,
)
from tokenizer_service.core.lanes import Lane, WorkerCrashed
from tokenizer_service.core.libraries import is_fast, refusal_line
from tokenizer_service.core.models import SENTENCEPIECE, ModelInfo
from tokenizer_service.core.poison import text_digest
from tokenizer_service.core.process import Startup
from tokenizer_service.core.protocol import (
    DETOKENIZE,
    PACK,
    Split,
    chunk_head,
    fallback_payload,
    finish_payload,
    load_chunk,
    poison_payload,
    promotion_payload,
    read_split,
    read_verified,
    request_head,
)
from tokenizer_service.core.requests import texts_document
from tokenizer_service.metrics import Metrics

logger = logging.getLogger("tokenizer.pool")

T = TypeVar("T")
Buffer = bytes | bytearray | memoryview
Culprit = tuple[str, int | None, str | None]  # field, model index, text

# A job may run this long per character (or id) on top of --stall-timeout before it counts as
# stalled: 50 times what BPE needs on a busy core, so only a real hang ever reaches it.
STALL_SECONDS_PER_UNIT = 10e-6
DEFAULT_STALL_TIMEOUT = 15.0


class WorkerPool:
    def __init__(
        self,
        models: Sequence[ModelInfo],
        default: str,
        workers: int,
        metrics: Metrics,
        limits: Limits,
        *,
        stall_timeout: float = DEFAULT_STALL_TIMEOUT,
    ) -> None:
        self.models = list(models)
        self.default = default
        self.size = workers
        self.metrics = metrics
        self.on_change: Callable[[], None] = _nothing  # called when `ready` may have changed
        startup = Startup(tuple(models), default, limits)
        common = {"stall_timeout": stall_timeout, "stall_seconds_per_unit": STALL_SECONDS_PER_UNIT}
        self.tokenizers = Lane("tokenizer", workers, startup, metrics, on_change=self._changed, **common)
        # Only SentencePiece samples (a seeded request for another model is refused while it is parsed):
        # without a SentencePiece model there is no sampler process at all.
        self.sampler: Lane | None = None
        if any(info.library == SENTENCEPIECE for info in models):
            self.sampler = Lane("seeded-sampler", 1, startup, metrics, on_change=self._changed, **common)
        self.lanes = [lane for lane in (self.tokenizers, self.sampler) if lane is not None]
        # shadow verification: a mismatch falls the model back to its reference library in every worker; the
        # background gate (tokenizer_service.core.gatescan): a pass promotes it to fastokens in every worker
        self.on_fallback: Callable[[ModelInfo], None] = _ignore  # called with the model's new announcement
        self.fallen: set[int] = set()
        for lane in self.lanes:
            lane.on_verified = self._verified
        for info in models:  # exported at 0 from the start, so alerts and rate() see the first mismatch
            if is_fast(info.encoder):
                metrics.shadow_checks.labels(info.name)
                metrics.shadow_mismatches.labels(info.name)

    async def start(self) -> None:
        try:
            await asyncio.gather(*(lane.start() for lane in self.lanes))
        except BaseException:
            self.close(grace=0.0)
            raise
        self.metrics.workers.set(self.size)

    def close(self, grace: float = 2.0) -> None:
        for lane in self.lanes:
            lane.close(grace)
        self.metrics.workers.set(0)

    @property
    def ready(self) -> bool:
        """Tokenizers serve, and the seeded sampler (if any) serves or is restarting (not failing)."""
        tokenizers, sampler = self.tokenizers, self.sampler
        sampler_down = sampler is not None and sampler.failing and not sampler.serving
        return bool(tokenizers.serving) and not tokenizers.closed and not sampler_down

    def _changed(self) -> None:
        self.on_change()

    def _verified(self, payload: Buffer) -> None:
        """A worker's shadow verification: count its checks; on a mismatch, log it once and fall the model
        back to its reference library in every worker, now and after any restart."""
        model, checks, mismatch = read_verified(payload)
        info = self.models[model]
        self.metrics.shadow_checks.labels(info.name).inc(checks)
        if mismatch is None:
            return
        self.metrics.shadow_mismatches.labels(info.name).inc()
        if model in self.fallen:
            return
        self.fallen.add(model)
        logger.error(
            "model %r: %s encoded a text otherwise than %s (shadow verification): %s; every worker now "
            "encodes it with %s",
            info.name,
            info.encoder,
            info.library,
            mismatch,
            info.library,
        )
        for lane in self.lanes:
            lane.broadcast_fallback(fallback_payload(model))
        self.models[model] = dataclasses.replace(info, encoder=info.library)
        self.on_fallback(self.models[model])

    def gate_verdict(self, model: int, differs: str | None, seconds: float, route: str | None = "fastokens") -> None:
        """The background scan's verdict on a model announced with its reference library: a pass promotes it to
        the fast encoder's `route` the gate chose in every worker, now and after any restart (PROMOTE), and the
        announcement says so; a refusal is logged once and changes nothing."""
        route = route or "fastokens"
        info = self.models[model]
        if differs is not None:
            logger.warning("%s", refusal_line(info.path, info.library, differs))
            self.models[model] = dataclasses.replace(info, gate="refused")
            return
        if model in self.fallen or is_fast(info.encoder):
            return
        logger.info(
            "model %r: the fast encoder's gate passed (%.1fs of scan); every worker now encodes it with %s",
            info.name,
            seconds,
            route,
        )
        for lane in self.lanes:
            lane.broadcast_fallback(promotion_payload(model, route), channel.PROMOTE)
        self.metrics.shadow_checks.labels(info.name)  # exported at 0 from now on, as for a model fast from the start
        self.metrics.shadow_mismatches.labels(info.name)
        self.models[model] = dataclasses.replace(info, encoder=route, gate="passed")
        self.on_fallback(self.models[model])

    def pids(self) -> list[int]:
        return sorted(pid for lane in self.lanes for pid in lane.pids())

    # -- requests --------------------------------------------------------------------------------

    async def request(self, route: int, body: Sequence[bytes], binary: bool) -> Answer:
        """The answer to one /v1 request body, given as the chunks it arrived in (the worker's socket takes them as
        they are); raises ServiceError (bad input, poison, unavailable).

        A large request is split over the workers idle when it is handed over (the one taking it
        and every idle other): under load nothing is split and nothing travels twice, while a lone
        large request still runs on every core. The worker that takes it parses it once, shares
        the other chunks (they start on the other workers at once) and runs the first itself.
        """

        def head(careful: bool) -> Callable[[int], bytes]:
            return lambda idle: request_head(route, binary, max(idle, 1), careful)

        shared = _Shared(self)
        try:
            kind, payload = await self._supervised(
                self.tokenizers,
                channel.REQUEST,
                head,
                body,
                sum(len(chunk) for chunk in body),
                lambda index: self._text_at(b"".join(body), route, index),
                interim=shared,
            )
            if kind == channel.DONE:
                return read_done(payload)
            if kind == channel.PART and shared.split is not None:
                others = await _all_or_none(shared.tasks)
                return await self._join(shared.split, [(kind, payload), *others], binary)
            if kind == channel.SPLIT:
                split = read_split(payload)
                lane = self.sampler if split.seeded and self.sampler is not None else self.tokenizers
                replies = await _all_or_none([self._chunk(lane, chunk, size) for chunk, size in split.jobs()])
                return await self._join(split, replies, binary)
            raise _failure(kind, payload)
        finally:
            shared.cancel()  # a request that failed or was cancelled withdraws its chunks (done ones: no-op)

    def _chunk(self, lane: Lane, chunk: memoryview, size: int) -> Coroutine[Any, Any, tuple[int, Buffer]]:
        return self._supervised(
            lane, channel.CHUNK, _chunk_head, [chunk], size, lambda index: _chunk_text(chunk, index)
        )

    async def _join(self, split: Split, replies: list[tuple[int, Buffer]], binary: bool) -> Answer:
        """The answer of a split request from its chunks' replies, in order."""
        model, route, context = split.model, split.route, split.context
        for kind, reply in replies:
            if kind != channel.PART:
                raise _failure(kind, reply)
        name = self.models[model].name
        if route == DETOKENIZE:
            return join_detokenize(model, name, [read_chunk_result(reply, blobs=False) for _, reply in replies])
        parts = [read_chunk_result(reply) for _, reply in replies]
        if route == PACK:
            return await self._finish(context, parts)
        return join_tokenize(model, name, parts, binary)

    async def _finish(self, context: Buffer, parts: list[ChunkResult]) -> Answer:
        """Pack a split /v1/pack request's parts on one worker."""
        payload = finish_payload(context, [part.payload for part in parts])
        units = sum(part.tokens for part in parts)
        kind, reply = await self._supervised(
            self.tokenizers, channel.FINISH, _no_head, payload, units, lambda index: ("texts", None, None)
        )
        if kind != channel.DONE:
            raise _failure(kind, reply)
        answer = read_done(reply)
        answer.work = [part.work for part in parts]  # the packing job's own seconds are counted in its parts
        return answer

    # -- supervision -------------------------------------------------------------------------------

    async def _supervised(
        self,
        lane: Lane,
        kind: int,
        head: Callable[[bool], Callable[[int], bytes]],
        body: Sequence[Buffer],
        units: int,
        culprit: Callable[[int], Culprit],
        interim: _Shared | None = None,
    ) -> tuple[int, Buffer]:
        """Run a job: once more if its worker died, then carefully; a text that kills that is poison.

        `culprit(index)` names the field, model and text at `index`; it runs (in a thread) only
        when a careful run died, so the hot path never looks at texts. `interim` takes what the
        job shares before it replies (withdrawn when its worker dies: the job runs again whole).
        """
        for attempt in (1, 2):
            try:
                return await lane.submit(kind, [b"", *body], units, head(False), interim)
            except WorkerCrashed as crash:
                if interim is not None:
                    interim.cancel()
                if crash.stalled:
                    logger.warning("a job stalled its worker; running it carefully")
                    break
                if attempt == 2:
                    logger.warning("a job was running in two worker crashes; running it carefully")
                    break
                self.metrics.chunk_retries.inc()
        try:
            return await lane.submit(kind, [b"", *body], units, head(True))  # careful: never split, shares nothing
        except WorkerCrashed as crash:
            if crash.progress < 0:  # the worker died between texts: nothing to blame
                raise Unavailable("a tokenizer worker died; retry") from None
            index = crash.progress
        self.metrics.poison_inputs.inc()
        field, model, text = await asyncio.to_thread(culprit, index)
        if model is not None and text is not None:
            self._remember(model, text)
        raise PoisonInput(
            f"{field}[{index}] crashed or hung a tokenizer worker twice; it is refused", field=field, index=index
        )

    def _remember(self, model: int, text: str) -> None:
        payload = poison_payload(model, len(text), text_digest(text))
        for lane in self.lanes:
            lane.broadcast_poison(payload)

    def _text_at(self, body: bytes, route: int, index: int) -> Culprit:
        """Slow path, only after a careful run died: the request's text at `index`, parsed here."""
        if route == DETOKENIZE:
            return "ids", None, None
        try:
            # a binary body (its texts as a frame of UTF-8) or JSON: the request the worker parsed
            document = texts_document(body, 1 << 62) if body[: len(wire.MAGIC)] == wire.MAGIC else orjson.loads(body)
            name = document.get("model") or self.default
            model = next(position for position, info in enumerate(self.models) if info.name == name)
            return "texts", model, document["texts"][index]
        except Exception:
            return "texts", None, None


def _nothing() -> None:
    pass


def _ignore(info: ModelInfo) -> None:
    pass


class _Shared:
    """The chunks a worker shared out of the request it runs (SHARE), running on other workers meanwhile."""

    __slots__ = ("pool", "split", "tasks")

    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool
        self.split: Split | None = None
        self.tasks: list[asyncio.Task[tuple[int, Buffer]]] = []

    def __call__(self, payload: Buffer) -> None:
        """Called by the lane as the SHARE arrives: start its chunks now, on the least busy workers."""
        self.cancel()
        pool = self.pool
        lane = pool.tokenizers
        self.split = split = read_split(payload)
        self.tasks = [lane.loop.create_task(pool._chunk(lane, chunk, size)) for chunk, size in split.jobs()]
        for task in self.tasks:
            task.add_done_callback(_retrieved)

    def cancel(self) -> None:
        for task in self.tasks:
            task.cancel()
        self.tasks = []
        self.split = None


def _retrieved(task: asyncio.Task[object]) -> None:
    """A chunk's failure is raised to its request (or moot once the request failed): never 'never retrieved'."""
    if not task.cancelled():
        task.exception()


def _chunk_head(careful: bool) -> Callable[[int], bytes]:
    head = chunk_head(careful)
    return lambda idle: head


def _no_head(careful: bool) -> Callable[[int], bytes]:
    return lambda idle: b""


def _failure(kind: int, payload: Buffer) -> ServiceError:
    if kind == channel.FAILED:
        return ServiceError.from_dict(orjson.loads(payload))
    return ServiceError(f"a worker answered with message kind {kind}")


def _chunk_text(chunk: memoryview, index: int) -> Culprit:
    item = load_chunk(chunk)
    if item.texts is None:
        return "ids", None, None
    return "texts", item.model, item.texts[index - item.first_index]


async def _all_or_none(jobs: Sequence[Awaitable[T]]) -> list[T]:
    """Await every job; on the first failure (or cancellation) withdraw the others."""
    if len(jobs) == 1:
        return [await jobs[0]]
    tasks = [asyncio.ensure_future(job) for job in jobs]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        raise
