"""Prefetch: tokenize a stream of texts ahead of a training loop, so that the loop never waits on tokenization.

``client.prefetch(texts, ...)`` returns a :class:`Prefetcher`, an iterator of batches in stream order:

* ``texts`` is any iterable of str (an endless generator too). It is read lazily, in the thread that
  calls ``next()``, never more than ``depth`` requests of ``batch_size`` texts ahead.
* Up to ``depth`` requests are in flight, on one background thread that runs an event loop with its
  own connection pool. Batches come out in input order; memory holds at most ``depth`` answers plus
  the batches cut from the one being handed out.
* A failed request is retried (``RetryPolicy``: connection errors, 429/502/503/504 honouring
  Retry-After, failover to another replica) with the same texts, so no text is lost or repeated.
  Past the retry budget, or on an error that retrying cannot fix (401, 404, 413, 422), ``next()``
  raises :class:`PrefetchError` once the batches before it have been handed out. While requests
  retry, the logger "tokenizer.client" says so, once per outage (client._outage).
* ``break``, ``close()``, the end of a ``with`` block, the end of the stream or garbage collection
  stop the background work: requests in flight are cancelled, connections closed, the thread joined.
* ``stats`` says how long the consumer waited in ``next()``; ``state_dict()`` says where to resume.

With ``pack=PackSpec(seq_len, rows)`` the batches are :class:`PackedBatch` of exactly ``rows`` rows of
``seq_len`` tokens (the last one may have fewer rows). ``concat`` tokenizes windows with /v1/tokenize,
any number in flight, and cuts the rows in the client, in stream order (see client._packing: a /v1/pack request
with ``carry`` needs the previous one's leftover, which would allow only one request in flight).
``best_fit`` packs each window of ``batch_size`` texts on the server (/v1/pack; no carry) and
regroups the rows.

:class:`AsyncPrefetcher` is the same for asyncio code (``AsyncTokenizerClient.prefetch``).

Both run the one pipeline of client._pipeline: its requests and in-order assembly on an event loop
(the caller's, or for Prefetcher one on a thread of its own, client._loop), its bound, order, errors,
state and stats on the consumer's side. The two classes here only wait: AsyncPrefetcher awaits, and
Prefetcher blocks in ``next()`` only while the answer it needs is not in yet, so that handing out a
batch whose answer has arrived never waits on the loop thread. The pieces without I/O:
client._options (PackSpec, PrefetchOptions), client._texts (windows of texts), client._assembler
(answers to batches), client._resume (state_dict and resume), client._stats (PrefetchStats).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
import warnings
import weakref
from collections.abc import AsyncIterable, Callable, Coroutine, Iterable
from types import TracebackType
from typing import Any, Generic, TypeVar

import numpy as np

from client._assembler import Delivery
from client._loop import LoopThread
from client._options import PackSpec, PrefetchOptions
from client._pipeline import Lookahead, Pipeline, PrefetchClient
from client._protocol import Batch
from client._resume import Resume
from client._stats import PrefetchStats
from client._texts import TextReader, open_texts
from client.errors import TokenizerError

__all__ = ["AsyncPrefetcher", "PackSpec", "PrefetchOptions", "PrefetchStats", "Prefetcher"]

H = TypeVar("H", asyncio.Task[list[Delivery]], concurrent.futures.Future[list[Delivery]])


class _Prefetching(Generic[H]):
    """What both prefetchers report: where the stream stands, the stats, the leftover."""

    _pipeline: Pipeline
    _lookahead: Lookahead[H]
    _closed: bool

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

    def state_dict(self) -> dict[str, Any]:
        """JSON-able position after the last batch handed out; pass as ``state=`` to continue from there."""
        return dict(self._lookahead.state)

    def _say_why_empty(self) -> None:
        """At the end of a stream that gave no batch: a warning that says why (in the consumer's thread)."""
        reason = self._pipeline.assembler.empty_reason
        if reason is not None:
            self._pipeline.assembler.empty_reason = None
            warnings.warn(f"prefetch delivered no batch: {reason}", UserWarning, stacklevel=3)


class Prefetcher(_Prefetching[concurrent.futures.Future[list[Delivery]]]):
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
        self.options = options
        self._reader = TextReader(texts, options.batch_size, resume.position.text, resume.position.skip > 0)
        client = make_client()
        self._loop = LoopThread("tokenizer-prefetch")
        self._pipeline = Pipeline(client, options, resume)
        self._lookahead = Lookahead(options, resume, self._pipeline.recorder)
        self._closed = False
        # Holds no reference to self, so that garbage collection of an abandoned prefetcher closes it.
        self._finalizer = weakref.finalize(self, self._loop.close, _closer(self._pipeline, client))
        try:
            self._fill()
        except BaseException:
            self.close()
            raise

    def __iter__(self) -> Prefetcher:
        return self

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

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


class AsyncPrefetcher(_Prefetching[asyncio.Task[list[Delivery]]]):
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
        self.options = options
        self._reader = open_texts(texts, options.batch_size, resume.position.text, resume.position.skip > 0)
        self._pipeline = Pipeline(client, options, resume)
        self._lookahead = Lookahead(options, resume, self._pipeline.recorder)
        self._closed = False
        self._started = False

    def __aiter__(self) -> AsyncPrefetcher:
        return self

    async def __aenter__(self) -> AsyncPrefetcher:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

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
