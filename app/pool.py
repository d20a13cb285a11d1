"""The pool of SentencePiece worker processes: split a request over workers, reassemble in order.

Reliability lives here too, as policy over app.lanes: a chunk whose worker died is run once more on
the rebuilt pool; a chunk that fails again, or stalls, goes to quarantine, a process of its own
that runs it text by text and so names the poison text (422) if there is one. Everyone else's
chunks are retried, not failed.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

import numpy as np

from app import quarantine, worker, worker_start
from app.admission import Admission, PoisonMemory
from app.errors import PoisonInput, Unavailable
from app.lanes import Lane, WorkerCrashed, WorkerStalled
from app.metrics import Metrics
from client.wire import split_ragged

logger = logging.getLogger("tokenizer.pool")

Result = TypeVar("Result")

# A chunk may run this long per character (or id) on top of --stall-timeout before it counts as
# stalled: 50 times what BPE needs on a busy core, so only a real hang ever reaches it.
STALL_SECONDS_PER_UNIT = 10e-6
DEFAULT_STALL_TIMEOUT = 15.0
WATCHDOG_SECONDS = 0.5


@dataclass(frozen=True)
class Batch:
    """Ragged ids of a whole request, in request order."""

    ids: np.ndarray  # int32
    offsets: np.ndarray  # int64, len(texts) + 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def rows(self) -> list[np.ndarray]:
        return split_ragged(self.ids, self.offsets)


def chunk_bounds(sizes: np.ndarray, max_chunks: int, min_chunk_size: int) -> list[tuple[int, int]]:
    """Split items with these sizes into at most `max_chunks` contiguous runs of similar total size.

    A run is never smaller than `min_chunk_size` (unless it is the only one), so small requests stay
    on one worker and pay one process round trip.
    """
    count = len(sizes)
    if count == 0:
        return []
    total = int(sizes.sum())
    chunks = max(1, min(max_chunks, count, total // max(min_chunk_size, 1)))
    if chunks == 1:
        return [(0, count)]
    cumulative = np.cumsum(sizes)
    targets = total * np.arange(1, chunks) / chunks
    cuts = np.searchsorted(cumulative, targets, side="left") + 1
    edges = sorted({0, count, *(int(c) for c in cuts if 0 < c < count)})
    return list(itertools.pairwise(edges))


def concat_batches(parts: list[worker.Encoded]) -> Batch:
    if len(parts) == 1:
        return Batch(parts[0].ids, parts[0].offsets)
    ids = np.concatenate([part.ids for part in parts])
    offsets = np.empty(sum(len(part.offsets) - 1 for part in parts) + 1, dtype=np.int64)
    offsets[0] = 0
    row, base = 1, 0
    for part in parts:
        rows = len(part.offsets) - 1
        offsets[row : row + rows] = part.offsets[1:] + base
        row += rows
        base += int(part.offsets[-1])
    return Batch(ids, offsets)


class WorkerPool:
    """Worker processes that each hold every model; the event loop only schedules and supervises.

    Three lanes: `workers` processes for ordinary work; one for seeded sampling (sentencepiece
    0.2.3 mixes per-process random state into its sampler, so a seed reproduces ids only within one
    process); and quarantine, started on first need, which runs suspect chunks one at a time.
    """

    def __init__(
        self,
        model_paths: dict[str, str],
        workers: int,
        metrics: Metrics,
        min_chunk_chars: int,
        *,
        max_queued_texts: int | None = None,
        stall_timeout: float = DEFAULT_STALL_TIMEOUT,
        model_sha256: dict[str, str] | None = None,
    ) -> None:
        """`model_sha256`: what each model file must still hold whenever a worker (re)starts."""
        self.model_paths = model_paths
        self.size = workers
        self.metrics = metrics
        self.min_chunk_chars = min_chunk_chars
        self.stall_timeout = stall_timeout
        self.admission = Admission(max_queued_texts, metrics)
        self.poison = PoisonMemory()
        startup = (model_paths, model_sha256)
        self._main = Lane("tokenizer", workers, worker_start.start, startup, metrics, on_change=self._changed)
        self._seeded_sampler = Lane("seeded-sampler", 1, worker_start.start, startup, metrics, on_change=self._changed)
        # Which text the quarantine process is on: shared memory it writes and the server reads.
        self._progress = multiprocessing.get_context("spawn").RawValue("q", -1)
        self._watchdog: asyncio.Future[None] | None = None
        self._quarantine = Lane("quarantine", 1, quarantine.start, (*startup, self._progress), metrics, depth=1)

    async def start(self) -> None:
        """Start every worker and wait until each has loaded the models."""
        try:
            await asyncio.gather(self._main.start(), self._seeded_sampler.start())
        except BaseException:
            self.close()
            raise
        self.metrics.workers.set(self.size)
        self._watchdog = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        """Notice a worker that died while its pool was idle, and rebuild before anyone needs it."""
        while True:
            await asyncio.sleep(WATCHDOG_SECONDS)
            try:
                self.check()
            except Exception:  # keep watching; a failure here is a bug worth a log line, not a dead watchdog
                logger.exception("worker pool watchdog")

    def close(self, grace: float = 2.0) -> None:
        """Stop every worker process: `grace` seconds to finish running chunks, then SIGKILL."""
        if self._watchdog is not None:
            self._watchdog.cancel()
        for lane in (self._main, self._seeded_sampler, self._quarantine):
            lane.close(grace)
        self.metrics.workers.set(0)

    def check(self) -> bool:
        """Both lanes serve (none is rebuilding); a lane whose worker died while idle starts its rebuild."""
        return all([self._main.check(), self._seeded_sampler.check()])

    @property
    def ready(self) -> bool:
        return self.check()

    def _changed(self) -> None:
        self.metrics.ready.set(1 if self.check() else 0)

    def _deadline(self, units: int) -> float:
        return self.stall_timeout + units * STALL_SECONDS_PER_UNIT

    async def _supervised(
        self, lane: Lane, ordinary: Callable[[], Result], isolated: Callable[[], Result], units: int
    ) -> tuple[Result | None, int]:
        """Run a chunk: on `lane`, once more there if a worker died, else in quarantine.

        Returns (result, -1), or (None, position) for the item in the chunk that killed or stalled
        the quarantine process.
        """
        deadline = self._deadline(units)
        for attempt in (1, 2):
            try:
                return await lane.call(ordinary, deadline), -1
            except WorkerStalled:
                logger.warning("a chunk stalled its worker; running it in quarantine")
                break
            except WorkerCrashed:
                if attempt == 2:
                    logger.warning("a chunk was in flight in two pool crashes; running it in quarantine")
                    break
                self.metrics.chunk_retries.inc()
        try:
            return await self._quarantine.call(isolated, deadline, progress=self._progress), -1
        except WorkerCrashed as failure:
            if failure.progress < 0:  # the process died between texts: nothing to blame
                raise Unavailable("a tokenizer worker died; retry", headers={"Retry-After": "1"}) from None
            self.metrics.poison_inputs.inc()
            return None, failure.progress

    async def encode(self, model: str, texts: list[str], options: worker.EncodeOptions) -> Batch:
        """Tokenize texts over all workers, in chunks of similar size, and reassemble them in order."""
        if (known := self.poison.find(model, texts)) is not None:
            self.metrics.poison_inputs.inc()
            raise _poison("texts", known, "was found earlier to crash or hang a tokenizer worker")
        sizes = np.fromiter((len(text) for text in texts), dtype=np.int64, count=len(texts))
        seeded = options.sample_seed is not None
        bounds = chunk_bounds(sizes, 1 if seeded else self.size, self.min_chunk_chars)
        if not bounds:
            return Batch(np.zeros(0, dtype=np.int32), np.zeros(1, dtype=np.int64))
        lane = self._seeded_sampler if seeded else self._main
        with self.admission.holding(len(texts)) as held:
            submitted = time.monotonic()

            async def chunk(start: int, end: int) -> worker.Encoded:
                part = texts[start:end]
                try:
                    result, position = await self._supervised(
                        lane,
                        partial(worker.encode_chunk, model, part, options, start),
                        partial(quarantine.encode_each, model, part, options, start),
                        int(sizes[start:end].sum()),
                    )
                finally:
                    held.release(end - start)
                if result is None:
                    self.poison.add(model, texts[start + position])
                    raise _poison("texts", start + position, "crashed or hung a tokenizer worker twice")
                return result

            parts = await _all_or_none([chunk(start, end) for start, end in bounds])
        for part in parts:
            self.metrics.record_work(model, part.started - submitted, part.seconds)
        return concat_batches(parts)

    async def decode(self, model: str, ids: np.ndarray, offsets: np.ndarray) -> list[str]:
        lengths = np.diff(offsets)
        bounds = chunk_bounds(lengths, self.size, self.min_chunk_chars // 4)
        if not bounds:
            return []
        with self.admission.holding(len(lengths)) as held:
            submitted = time.monotonic()

            async def chunk(start: int, end: int) -> worker.Decoded:
                part_ids = ids[offsets[start] : offsets[end]]
                part_offsets = offsets[start : end + 1] - offsets[start]
                try:
                    result, position = await self._supervised(
                        self._main,
                        partial(worker.decode_chunk, model, part_ids, part_offsets),
                        partial(quarantine.decode_each, model, part_ids, part_offsets),
                        len(part_ids),
                    )
                finally:
                    held.release(end - start)
                if result is None:
                    raise _poison("ids", start + position, "crashed or hung a tokenizer worker twice")
                return result

            parts = await _all_or_none([chunk(start, end) for start, end in bounds])
        texts: list[str] = []
        for part in parts:
            self.metrics.record_work(model, part.started - submitted, part.seconds)
            texts.extend(part.texts)
        return texts


def _poison(field: str, index: int, what: str) -> PoisonInput:
    return PoisonInput(f"{field}[{index}] {what}; it is refused", field=field, index=index)


async def _all_or_none(chunks: list[Awaitable[Result]]) -> list[Result]:
    """Await every chunk; on the first failure (or cancellation) withdraw the others."""
    if len(chunks) == 1:
        return [await chunks[0]]
    tasks = [asyncio.ensure_future(chunk) for chunk in chunks]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        raise
