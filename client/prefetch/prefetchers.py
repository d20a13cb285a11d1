"""Prefetcher and AsyncPrefetcher: each only its way of waiting around the one pipeline
(see tokenizer_client.prefetch)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
import warnings
import weakref
from collections.abc import AsyncIterable, Callable, Coroutine, Iterable
from typing import Any, Generic, TypeVar

import numpy as np

from tokenizer_client._lifecycle import AsyncClosing, Closing
from tokenizer_client.batches import Batch
from tokenizer_client.errors import TokenizerError
from tokenizer_client.prefetch.assembler import Delivery
from tokenizer_client.prefetch.loop import LoopThread
from tokenizer_client.prefetch.options import PrefetchOptions
from tokenizer_client.prefetch.pipeline import Lookahead, Pipeline, PrefetchClient
from tokenizer_client.prefetch.resume import Resume
from tokenizer_client.prefetch.stats import PrefetchStats
from tokenizer_client.prefetch.texts import TextReader, open_texts

__all__ = ["AsyncPrefetcher", "Prefetcher"]

H = TypeVar("H", asyncio.Task[list[Delivery]], concurrent.futures.Future[list[Delivery]])


class _Prefetching(Generic[H]):
    """What both prefetchers report: where the stream stands, the stats, the leftover."""

    options: PrefetchOptions
    _pipeline: Pipeline
    _lookahead: Lookahead[H]
    _closed: bool

    def _start(self, client: PrefetchClient, options: PrefetchOptions, resume: Resume) -> None:
        self.options = options
        self._pipeline = Pipeline(client, options, resume)
        self._lookahead = Lookahead(options, resume, self._pipeline.recorder)
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def stats(self) -> PrefetchStats:
        return self._pipeline.recorder.snapshot()

    @property
    def leftover(self) -> np.ndarray:
        """Concat packing: the stream's last tokens that fill no row, once the stream has ended (else empty)."""
        return self._pipeline.assembler.leftover

    @property
    def leftover_loss_mask(self) -> np.ndarray | None:
        """Concat packing of conversations or records: the loss mask of ``leftover`` (None for texts)."""
        return self._pipeline.assembler.leftover_loss_mask

    def state_dict(self) -> dict[str, Any]:
        """JSON-able position after the last batch handed out; pass as ``state=`` to continue from there."""
        return dict(self._lookahead.state)

    def _say_why_empty(self) -> None:
        """At the end of a stream that gave no batch: a warning that says why (in the consumer's thread)."""
        reason = self._pipeline.assembler.empty_reason
        if reason is not None:
            self._pipeline.assembler.empty_reason = None
            warnings.warn(f"prefetch delivered no batch: {reason}", UserWarning, stacklevel=3)


class Prefetcher(Closing, _Prefetching[concurrent.futures.Future[list[Delivery]]]):
    """Iterator over batches tokenized in the background, in stream order; a context manager.

    Made by ``TokenizerClient.prefetch``: see the module docstring. ``TokenizedBatch`` (ragged) or
    ``PackedBatch`` (with ``pack=``) items, each with ``index`` (its number in the stream) and
    ``start`` (the stream index of its first text). ``state_dict()`` after a batch, passed back as
    ``prefetch(same_texts_from_the_start, ..., state=saved)``, continues with the next batch.

    Its requests go through the async client ``make_client()`` returns (``TokenizerClient.async_client``,
    which says what that client shares with its parent), on an event loop thread of its own.
    """

    def __init__(
        self,
        make_client: Callable[[], PrefetchClient],
        texts: Iterable[str],
        options: PrefetchOptions,
        state: dict[str, Any] | None = None,
    ) -> None:
        resume = Resume.from_state(state, options)
        self._reader = TextReader(texts, options.batch_size, *resume.reading_from(), inputs=options.inputs)
        client = make_client()
        self._loop = LoopThread("tokenizer-prefetch")
        self._start(client, options, resume)
        # Holds no reference to self, so that garbage collection of an abandoned prefetcher closes it.
        self._finalizer = weakref.finalize(self, self._loop.close, _closer(self._pipeline, client))
        try:
            self._fill()
        except BaseException:
            self.close()
            raise

    def __iter__(self) -> Prefetcher:
        return self

    def _fill(self) -> None:
        """Read windows, in this thread, and send them until ``depth`` are outstanding (or the texts end)."""
        while self._lookahead.wants_window():
            try:
                window = self._reader.read()
            except Exception as exc:  # raised from next() once the batches before it are handed out
                self._lookahead.unreadable(exc)
                return
            self._lookahead.sent(window, self._loop.submit(self._pipeline.request(window)))

    def __next__(self) -> Batch:
        if self._closed:
            raise StopIteration
        started = time.perf_counter()
        self._pipeline.recorder.call_started(started)
        try:
            while not self._lookahead.ready:
                request = self._lookahead.next_answer()
                if request is None:
                    self._say_why_empty()
                    raise StopIteration
                try:
                    deliveries = request.result()
                except TokenizerError as exc:
                    self._lookahead.failed(exc)
                self._lookahead.answered(deliveries)
                self._fill()
        except BaseException:
            self.close()
            raise
        return self._lookahead.take(started)

    def close(self) -> None:
        """Stop the background work now: cancel requests in flight, close connections, join the thread."""
        if self._closed:
            return
        self._closed = True
        for request in self._lookahead.close():
            request.cancel()
        self._finalizer()


class AsyncPrefetcher(AsyncClosing, _Prefetching[asyncio.Task[list[Delivery]]]):
    """``async for`` over batches tokenized ahead on the running event loop; ``async with`` closes it.

    Made by ``AsyncTokenizerClient.prefetch``; same behaviour, batches, stats and state as Prefetcher.
    Its tasks run on the loop that first iterates it; the client stays open after ``aclose()``.
    """

    def __init__(
        self,
        client: PrefetchClient,
        texts: Iterable[str] | AsyncIterable[str],
        options: PrefetchOptions,
        state: dict[str, Any] | None = None,
    ) -> None:
        resume = Resume.from_state(state, options)
        self._reader = open_texts(texts, options.batch_size, *resume.reading_from(), inputs=options.inputs)
        self._start(client, options, resume)
        self._started = False

    def __aiter__(self) -> AsyncPrefetcher:
        return self

    async def _fill(self) -> None:
        """Read windows and send them until ``depth`` are outstanding (or the texts end)."""
        while self._lookahead.wants_window():
            try:
                window = await self._reader.next_window()
            except Exception as exc:  # raised from __anext__ once the batches before it are handed out
                self._lookahead.unreadable(exc)
                return
            self._lookahead.sent(window, asyncio.ensure_future(self._pipeline.request(window)))

    async def __anext__(self) -> Batch:
        if self._closed:
            raise StopAsyncIteration
        started = time.perf_counter()
        self._pipeline.recorder.call_started(started)
        try:
            if not self._started:
                self._started = True
                weakref.finalize(self, _cancel_outstanding, asyncio.get_running_loop(), self._lookahead)
                await self._fill()
            while not self._lookahead.ready:
                request = self._lookahead.next_answer()
                if request is None:
                    self._say_why_empty()
                    raise StopAsyncIteration
                try:
                    deliveries = await request
                except TokenizerError as exc:
                    self._lookahead.failed(exc)
                self._lookahead.answered(deliveries)
                await self._fill()
        except BaseException:
            await self.aclose()
            raise
        return self._lookahead.take(started)

    async def aclose(self) -> None:
        """Cancel the requests in flight and wait until they are gone."""
        if self._closed:
            return
        self._closed = True
        requests = self._lookahead.close()
        for request in requests:
            request.cancel()
        await self._pipeline.cancel()
        await asyncio.gather(*requests, return_exceptions=True)


def _closer(pipeline: Pipeline, client: PrefetchClient) -> Callable[[], Coroutine[Any, Any, None]]:
    """Prefetcher's last words on its loop: cancel the requests in flight, then close the client it owns."""

    async def close() -> None:
        try:
            await pipeline.cancel()
        finally:
            await client.aclose()

    return close


def _cancel_outstanding(loop: asyncio.AbstractEventLoop, lookahead: Lookahead[asyncio.Task[list[Delivery]]]) -> None:
    """Finalizer of an AsyncPrefetcher dropped without aclose(): cancel its tasks on their loop."""
    if loop.is_closed():
        return
    for task in lookahead.outstanding():
        loop.call_soon_threadsafe(task.cancel)
