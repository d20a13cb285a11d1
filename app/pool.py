"""The pool of SentencePiece worker processes: split a request over workers, reassemble in order."""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import numpy as np

from app import worker
from app.errors import Unavailable
from app.metrics import Metrics
from client.wire import split_ragged

logger = logging.getLogger("tokenizer.pool")

Result = TypeVar("Result")


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
    """A ProcessPoolExecutor whose workers each hold every model; the event loop only schedules."""

    def __init__(self, model_paths: dict[str, str], workers: int, metrics: Metrics, min_chunk_chars: int) -> None:
        self.model_paths = model_paths
        self.size = workers
        self.metrics = metrics
        self.min_chunk_chars = min_chunk_chars
        self._executor: ProcessPoolExecutor | None = None
        # sentencepiece 0.2.3 mixes per-process random state into its sampling generator, so a
        # seed reproduces its ids only within one process: seeded sampling has a process of its own.
        self._seeded_sampler: ProcessPoolExecutor | None = None

    def _new_executor(self, workers: int) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(
            max_workers=workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=worker.load_models,
            initargs=(self.model_paths,),
        )

    async def start(self) -> None:
        """Start every worker and wait until each has loaded the models."""
        self._executor = self._new_executor(self.size)
        self._seeded_sampler = self._new_executor(1)
        await asyncio.gather(self._run(worker.ping, seeded=True), *(self._run(worker.ping) for _ in range(self.size)))
        self.metrics.workers.set(self.size)

    def close(self) -> None:
        for executor in (self._executor, self._seeded_sampler):
            if executor is not None:
                executor.shutdown(wait=True, cancel_futures=True)
        self._executor = self._seeded_sampler = None
        self.metrics.workers.set(0)

    def worker_pids(self) -> list[int]:
        processes = getattr(self._executor, "_processes", None) or {}
        return sorted(processes)

    async def _run(self, function: Callable[..., Result], *args: Any, seeded: bool = False) -> Result:
        executor = self._seeded_sampler if seeded else self._executor
        if executor is None:
            raise Unavailable("worker pool is not running", headers={"Retry-After": "1"})
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(executor, partial(function, *args))
        except BrokenProcessPool as exc:
            raise Unavailable("a tokenizer worker died; retry", headers={"Retry-After": "1"}) from exc

    async def ping(self) -> bool:
        return await self._run(worker.ping) == len(self.model_paths)

    async def encode(self, model: str, texts: list[str], options: worker.EncodeOptions) -> Batch:
        """Tokenize texts over all workers, in chunks of similar size, and reassemble them in order."""
        sizes = np.fromiter((len(text) for text in texts), dtype=np.int64, count=len(texts))
        seeded = options.sample_seed is not None
        bounds = chunk_bounds(sizes, 1 if seeded else self.size, self.min_chunk_chars)
        if not bounds:
            return Batch(np.zeros(0, dtype=np.int32), np.zeros(1, dtype=np.int64))
        submitted = time.monotonic()
        parts = await asyncio.gather(
            *(
                self._run(worker.encode_chunk, model, texts[start:end], options, start, seeded=seeded)
                for start, end in bounds
            )
        )
        for part in parts:
            self.metrics.record_work(model, part.started - submitted, part.seconds)
        return concat_batches(parts)

    async def decode(self, model: str, ids: np.ndarray, offsets: np.ndarray) -> list[str]:
        lengths = np.diff(offsets)
        bounds = chunk_bounds(lengths, self.size, self.min_chunk_chars // 4)
        submitted = time.monotonic()
        parts = await asyncio.gather(
            *(
                self._run(
                    worker.decode_chunk,
                    model,
                    ids[offsets[start] : offsets[end]],
                    offsets[start : end + 1] - offsets[start],
                )
                for start, end in bounds
            )
        )
        texts: list[str] = []
        for part in parts:
            self.metrics.record_work(model, part.started - submitted, part.seconds)
            texts.extend(part.texts)
        return texts
