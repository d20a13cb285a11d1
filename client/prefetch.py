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
  raises :class:`PrefetchError` once the batches before it have been handed out.
* ``break``, ``close()``, the end of a ``with`` block, the end of the stream or garbage collection
  stop the background work: requests in flight are cancelled, connections closed, the thread joined.
* ``stats`` says how long the consumer waited in ``next()``; ``state_dict()`` says where to resume.

With ``pack=PackSpec(seq_len, rows)`` the batches are :class:`PackedBatch` of exactly ``rows`` rows of
``seq_len`` tokens (the last one may have fewer rows). ``concat`` tokenizes windows with /v1/tokenize,
any number in flight, and cuts the rows here in stream order (see client._packing: a /v1/pack request
with ``carry`` needs the previous one's leftover, which would allow only one request in flight).
``best_fit`` packs each window of ``batch_size`` texts on the server (/v1/pack; no carry) and
regroups the rows.

:class:`AsyncPrefetcher` is the same for asyncio code (``AsyncTokenizerClient.prefetch``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import threading
import time
import weakref
from collections import deque
from collections.abc import AsyncIterable, Callable, Coroutine, Iterable
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from client._stats import PrefetchStats, StatsRecorder
from client._stream import (
    Assembler,
    AsyncTextReader,
    Batch,
    Delivery,
    PackSpec,
    PrefetchOptions,
    Resume,
    TextReader,
    Window,
    failure,
    state_dict,
)
from client.errors import TokenizerError

if TYPE_CHECKING:
    from client._async import AsyncTokenizerClient

__all__ = ["AsyncPrefetcher", "PackSpec", "PrefetchOptions", "PrefetchStats", "Prefetcher"]

Result = TypeVar("Result")

STOP_TIMEOUT_S = 10.0


class _Pipeline:
    """Lives on one event loop: fetches windows concurrently and assembles their answers strictly in order.

    Each window's task awaits its predecessor before assembling, so the assembler sees answers in
    stream order whatever order they arrive in.
    """

    def __init__(self, client: AsyncTokenizerClient, options: PrefetchOptions, resume: Resume) -> None:
        self.client = client
        self.options = options
        self.assembler = Assembler(options, resume)
        self.recorder = StatsRecorder()
        self.tasks: set[asyncio.Task[Any]] = set()
        self._last: asyncio.Task[Any] | None = None
        if resume.model is not None and resume.model_sha256 is not None:
            client._fingerprints.expect(resume.model, resume.model_sha256, "the saved prefetch state")

    def _enter(self) -> asyncio.Task[Any] | None:
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        previous, self._last = self._last, task
        return previous

    async def window(self, window: Window) -> list[Delivery]:
        previous = self._enter()
        answer = await self._fetch(window)
        await self._after(previous)
        return self._convert(self.assembler.feed(window, answer))

    async def finish(self) -> list[Delivery]:
        previous = self._enter()
        await self._after(previous)
        return self._convert(self.assembler.finish())

    async def _after(self, previous: asyncio.Task[Any] | None) -> None:
        if previous is not None:
            await asyncio.wait([previous])
            if previous.cancelled() or previous.exception() is not None:
                # The consumer meets the earlier failure first and stops there; this answer is never handed out.
                raise asyncio.CancelledError("an earlier window failed")

    async def _fetch(self, window: Window) -> Batch:
        options, pack = self.options, self.options.pack
        answer: Batch
        if pack is not None and pack.strategy == "best_fit":
            answer, meta = await self.client._pack_answer(
                window.texts,
                pack.seq_len,
                "best_fit",
                options.model,
                pack.add_bos,
                pack.add_eos,
                None,
                pack.mask_document_start,
                policy=options.retry,
            )
        else:
            answer, meta = await self.client._tokenize_answer(
                window.texts,
                options.model,
                options.add_bos,
                options.add_eos,
                options.max_length,
                options.sample,
                policy=options.retry,
            )
        self.recorder.answered(meta.seconds, meta.attempts)
        return answer

    def _convert(self, deliveries: list[Delivery]) -> list[Delivery]:
        if not self.options.as_torch:
            return deliveries
        from client._torch import to_torch

        pin = self.options.pin_memory
        return [dataclasses.replace(d, batch=to_torch(d.batch, pin_memory=pin)) for d in deliveries]

    async def cancel(self) -> None:
        """Cancel every task and wait until they are gone (their outcomes concern nobody any more)."""
        tasks = list(self.tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class _LoopThread:
    """One daemon thread running an event loop that owns the prefetcher's async client and pipeline.

    Holds no reference to the Prefetcher, so that garbage collection of an abandoned prefetcher
    reaches its finalizer, which calls close().
    """

    def __init__(
        self, make_client: Callable[[], AsyncTokenizerClient], options: PrefetchOptions, resume: Resume
    ) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="tokenizer-prefetch", daemon=True)
        self._thread.start()
        self._closed = False
        try:
            self.pipeline: _Pipeline = self.call(self._open(make_client, options, resume)).result()
        except BaseException:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            raise

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
        finally:
            self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            self._loop.close()

    @staticmethod
    async def _open(
        make_client: Callable[[], AsyncTokenizerClient], options: PrefetchOptions, resume: Resume
    ) -> _Pipeline:
        return _Pipeline(make_client(), options, resume)

    def call(self, coroutine: Coroutine[Any, Any, Result]) -> concurrent.futures.Future[Result]:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)

    async def _shutdown(self, stop: bool) -> None:
        try:
            if hasattr(self, "pipeline"):
                await self.pipeline.cancel()
                await self.pipeline.client.aclose()
        finally:
            if stop:
                self._loop.stop()

    def close(self) -> None:
        """Cancel requests in flight, close the connections, stop the loop and join the thread."""
        if self._closed:
            return
        self._closed = True
        if not self._thread.is_alive():
            return
        if threading.current_thread() is self._thread:  # collected on the loop thread itself: cannot wait here
            self._loop.create_task(self._shutdown(stop=True))
            return
        try:
            self.call(self._shutdown(stop=False)).result(timeout=STOP_TIMEOUT_S)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=STOP_TIMEOUT_S)
        if self._thread.is_alive():
            raise RuntimeError(f"the prefetch thread did not stop within {STOP_TIMEOUT_S}s")


class _Prefetching:
    """What Prefetcher and AsyncPrefetcher share: where the stream stands, what is ready, what they report."""

    _pipeline: _Pipeline

    def __init__(self, options: PrefetchOptions, resume: Resume) -> None:
        self.options = options
        self._state = state_dict(options, resume.position, resume.batches, resume.model, resume.model_sha256)
        self._next_index = resume.batches
        self._ready: deque[Delivery] = deque()
        self._source_error: BaseException | None = None
        self._exhausted = False
        self._closed = False

    def _hand_out(self, delivery: Delivery, started: float) -> Batch:
        self._state = delivery.state
        self._next_index += 1
        self._pipeline.recorder.delivered(delivery.texts, delivery.tokens, time.perf_counter() - started)
        return delivery.batch

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
        return dict(self._state)


class Prefetcher(_Prefetching):
    """Iterator over batches tokenized in the background, in stream order; a context manager.

    Made by ``TokenizerClient.prefetch``: see the module docstring. ``TokenizedBatch`` (ragged) or
    ``PackedBatch`` (with ``pack=``) items, each with ``index`` (its number in the stream) and
    ``start`` (the stream index of its first text). ``state_dict()`` after a batch, passed back as
    ``prefetch(same_texts_from_the_start, ..., state=saved)``, continues with the next batch.
    """

    def __init__(
        self,
        make_client: Callable[[], AsyncTokenizerClient],
        texts: Iterable[str],
        options: PrefetchOptions,
        state: dict[str, Any] | None = None,
    ) -> None:
        resume = Resume.from_state(state, options)
        super().__init__(options, resume)
        self._reader = TextReader(texts, options.batch_size, resume.position.text)
        self._pending: deque[tuple[Window | None, concurrent.futures.Future[list[Delivery]]]] = deque()
        self._engine = _LoopThread(make_client, options, resume)
        self._pipeline = self._engine.pipeline
        self._finalizer = weakref.finalize(self, self._engine.close)
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
        """Read and send windows until `depth` are outstanding (or the texts end)."""
        while not self._exhausted and len(self._pending) < self.options.depth:
            try:
                window = self._reader.next_window()
            except Exception as exc:  # raised from next() once the batches before it are handed out
                self._source_error, self._exhausted = exc, True
                return
            if window is None:
                self._exhausted = True
                self._pending.append((None, self._engine.call(self._pipeline.finish())))
                return
            self._pending.append((window, self._engine.call(self._pipeline.window(window))))

    def __next__(self) -> Batch:
        if self._closed:
            raise StopIteration
        started = time.perf_counter()
        self._pipeline.recorder.call_started(started)
        try:
            while not self._ready:
                if not self._pending:
                    if self._source_error is not None:
                        raise self._source_error
                    raise StopIteration
                window, future = self._pending.popleft()
                try:
                    deliveries = future.result()
                except TokenizerError as exc:
                    if window is None:
                        raise
                    raise failure(window, exc, self._next_index) from exc
                self._ready.extend(deliveries)
                self._fill()
            delivery = self._ready.popleft()
        except BaseException:
            self.close()
            raise
        return self._hand_out(delivery, started)

    def close(self) -> None:
        """Stop the background work now: cancel requests in flight, close connections, join the thread."""
        if self._closed:
            return
        self._closed = True
        for _, future in self._pending:
            future.cancel()
        self._pending.clear()
        self._ready.clear()
        self._pipeline.recorder.ended()
        self._finalizer()


class AsyncPrefetcher(_Prefetching):
    """``async for`` over batches tokenized ahead on the running event loop; ``async with`` closes it.

    Made by ``AsyncTokenizerClient.prefetch``; same behaviour, batches, stats and state as Prefetcher.
    Its tasks run on the loop that first iterates it; the client stays open after ``aclose()``.
    """

    def __init__(
        self,
        client: AsyncTokenizerClient,
        texts: Iterable[str] | AsyncIterable[str],
        options: PrefetchOptions,
        state: dict[str, Any] | None = None,
    ) -> None:
        resume = Resume.from_state(state, options)
        super().__init__(options, resume)
        self._reader = AsyncTextReader(texts, options.batch_size, resume.position.text)
        self._pipeline = _Pipeline(client, options, resume)
        self._pending: deque[tuple[Window | None, asyncio.Task[list[Delivery]]]] = deque()
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
        while not self._exhausted and len(self._pending) < self.options.depth:
            try:
                window = await self._reader.next_window_async()
            except Exception as exc:  # raised from __anext__ once the batches before it are handed out
                self._source_error, self._exhausted = exc, True
                return
            if window is None:
                self._exhausted = True
                self._pending.append((None, asyncio.ensure_future(self._pipeline.finish())))
                return
            self._pending.append((window, asyncio.ensure_future(self._pipeline.window(window))))

    async def __anext__(self) -> Batch:
        if self._closed:
            raise StopAsyncIteration
        started = time.perf_counter()
        self._pipeline.recorder.call_started(started)
        try:
            if not self._started:
                self._started = True
                loop = asyncio.get_running_loop()
                weakref.finalize(self, _cancel_pending, loop, self._pending)
                await self._fill()
            while not self._ready:
                if not self._pending:
                    if self._source_error is not None:
                        raise self._source_error
                    raise StopAsyncIteration
                window, task = self._pending.popleft()
                try:
                    deliveries = await task
                except TokenizerError as exc:
                    if window is None:
                        raise
                    raise failure(window, exc, self._next_index) from exc
                self._ready.extend(deliveries)
                await self._fill()
            delivery = self._ready.popleft()
        except BaseException:
            await self.aclose()
            raise
        return self._hand_out(delivery, started)

    async def aclose(self) -> None:
        """Cancel the requests in flight and wait until they are gone."""
        if self._closed:
            return
        self._closed = True
        tasks = [task for _, task in self._pending]  # some may not have started yet
        for task in tasks:
            task.cancel()
        self._pending.clear()
        self._ready.clear()
        self._pipeline.recorder.ended()
        await self._pipeline.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _cancel_pending(
    loop: asyncio.AbstractEventLoop, pending: deque[tuple[Window | None, asyncio.Task[list[Delivery]]]]
) -> None:
    """Finalizer of an AsyncPrefetcher dropped without aclose(): cancel its tasks on their loop."""
    if loop.is_closed():
        return
    for _, task in list(pending):
        loop.call_soon_threadsafe(task.cancel)
    pending.clear()
