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
import itertools
import threading
import time
import weakref
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator, Callable, Coroutine, Iterable, Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import numpy as np

from client._packing import Block, ConcatPacker, Position, RowRegrouper
from client._protocol import PackedBatch, TokenizedBatch
from client._retry import RetryPolicy
from client.errors import PrefetchError, TokenizerError, TokenizerServiceError

if TYPE_CHECKING:
    from client._async import AsyncTokenizerClient

Batch = TokenizedBatch | PackedBatch
Result = TypeVar("Result")

STATE_FORMAT = "tokenizer-prefetch"
STATE_VERSION = 1
STATS_WINDOW = 10_000
STOP_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class PackSpec:
    """Pack the stream into batches of ``rows`` rows of exactly ``seq_len`` tokens.

    ``concat`` (no padding; documents run across rows and batches) or ``best_fit`` (whole documents,
    pieces of at most ``seq_len``, padded; each request of ``batch_size`` texts packs on its own).
    ``add_eos``/``add_bos`` mark document boundaries in the ids; ``mask_document_start`` sets the
    label of each document's first token to -100.
    """

    seq_len: int
    rows: int
    strategy: Literal["concat", "best_fit"] = "concat"
    add_eos: bool = True
    add_bos: bool = False
    mask_document_start: bool = False

    def __post_init__(self) -> None:
        if self.seq_len < 2:
            raise ValueError(f"seq_len must be at least 2, got {self.seq_len}")
        if self.rows < 1:
            raise ValueError(f"rows must be at least 1, got {self.rows}")
        if self.strategy not in ("concat", "best_fit"):
            raise ValueError(f"strategy must be 'concat' or 'best_fit', got {self.strategy!r}")


@dataclass(frozen=True)
class PrefetchOptions:
    """Everything that decides what a prefetcher requests and hands out (validated once)."""

    batch_size: int
    depth: int
    model: str | None
    add_bos: bool
    add_eos: bool
    max_length: int | None
    sample: dict[str, Any] | None
    pack: PackSpec | None
    as_torch: bool
    pin_memory: bool
    retry: RetryPolicy

    @classmethod
    def build(
        cls,
        *,
        batch_size: int,
        depth: int,
        model: str | None,
        add_bos: bool,
        add_eos: bool,
        max_length: int | None,
        sample: dict[str, Any] | None,
        pack: PackSpec | None,
        as_torch: bool,
        pin_memory: bool,
        retry: RetryPolicy,
    ) -> PrefetchOptions:
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        if depth < 1:
            raise ValueError(f"depth must be at least 1, got {depth}")
        if pack is not None:
            if add_bos or add_eos or max_length is not None or sample is not None:
                raise ValueError(
                    "with pack=, set add_bos/add_eos on the PackSpec; max_length and sample do not apply to packing"
                )
            add_bos, add_eos = pack.add_bos, pack.add_eos
        if pin_memory and not as_torch:
            raise ValueError("pin_memory=True needs as_torch=True")
        if as_torch:
            from client._torch import check_torch

            pin_memory = check_torch(pin_memory)
        return cls(batch_size, depth, model, add_bos, add_eos, max_length, sample, pack, as_torch, pin_memory, retry)

    @property
    def mode(self) -> str:
        return "ragged" if self.pack is None else self.pack.strategy

    def fingerprint(self) -> dict[str, Any]:
        """The options a resumed run must repeat to produce the same ids."""
        options: dict[str, Any] = {
            "model": self.model,
            "add_bos": self.add_bos,
            "add_eos": self.add_eos,
            "max_length": self.max_length,
            "sample": self.sample,
        }
        if self.pack is not None:
            options.update(seq_len=self.pack.seq_len, mask_document_start=self.pack.mask_document_start)
        if self.mode == "best_fit":
            options["batch_size"] = self.batch_size  # best-fit rows depend on which texts share a request
        return options


@dataclass(frozen=True)
class PrefetchStats:
    """What the training script logs: how much the consumer waited, how the service answered.

    ``wait_*`` is time spent inside ``next()`` (blocked on data, or reading texts); ``elapsed_s``
    runs from the first ``next()`` call to now (or to the end of the stream); ``wait_fraction`` is
    ``wait_s / elapsed_s``. Percentiles cover the last 10,000 batches and requests.
    """

    batches: int
    texts: int
    tokens: int
    requests: int
    retries: int
    wait_s: float
    wait_p50_s: float
    wait_p99_s: float
    request_p50_s: float
    request_p99_s: float
    elapsed_s: float
    wait_fraction: float

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


class _StatsRecorder:
    """Counters written by the consumer thread and the event loop thread; read as a PrefetchStats snapshot."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.batches = self.texts = self.tokens = self.requests = self.retries = 0
        self.wait_s = 0.0
        self._waits: deque[float] = deque(maxlen=STATS_WINDOW)
        self._latencies: deque[float] = deque(maxlen=STATS_WINDOW)
        self._first_call: float | None = None
        self._ended: float | None = None

    def call_started(self, now: float) -> None:
        if self._first_call is None:
            self._first_call = now

    def delivered(self, texts: int, tokens: int, wait: float) -> None:
        with self._lock:
            self.batches += 1
            self.texts += texts
            self.tokens += tokens
            self.wait_s += wait
            self._waits.append(wait)

    def answered(self, seconds: float, attempts: int) -> None:
        with self._lock:
            self.requests += 1
            self.retries += attempts - 1
            self._latencies.append(seconds)

    def ended(self) -> None:
        if self._ended is None:
            self._ended = time.perf_counter()

    def snapshot(self) -> PrefetchStats:
        with self._lock:
            waits = np.fromiter(self._waits, dtype=np.float64)
            latencies = np.fromiter(self._latencies, dtype=np.float64)
            counts = (self.batches, self.texts, self.tokens, self.requests, self.retries, self.wait_s)
        end = self._ended or time.perf_counter()
        elapsed = end - self._first_call if self._first_call is not None else 0.0

        def percentile(values: np.ndarray, q: float) -> float:
            return float(np.percentile(values, q)) if values.size else 0.0

        return PrefetchStats(
            *counts,
            wait_p50_s=percentile(waits, 50),
            wait_p99_s=percentile(waits, 99),
            request_p50_s=percentile(latencies, 50),
            request_p99_s=percentile(latencies, 99),
            elapsed_s=elapsed,
            wait_fraction=counts[5] / elapsed if elapsed > 0 else 0.0,
        )


@dataclass(frozen=True)
class Window:
    """One request's texts: stream indices ``start`` to ``start + len(texts)``."""

    start: int
    texts: list[str]

    @property
    def stop(self) -> int:
        return self.start + len(self.texts)


@dataclass(frozen=True)
class Delivery:
    """A batch ready for the consumer, with the state to save once it has been handed out."""

    batch: Batch
    state: dict[str, Any]
    texts: int
    tokens: int


@dataclass(frozen=True)
class Resume:
    """Where a prefetcher starts: a position in the stream and the number of batches already handed out."""

    position: Position
    batches: int
    model: str | None
    model_sha256: str | None

    @classmethod
    def from_state(cls, state: dict[str, Any] | None, options: PrefetchOptions) -> Resume:
        if state is None:
            return cls(Position(0, 0), 0, None, None)
        if state.get("format") != STATE_FORMAT or state.get("version") != STATE_VERSION:
            raise ValueError(f"not a prefetch state of version {STATE_VERSION}: {state!r:.200}")
        if state["mode"] != options.mode:
            raise ValueError(f"the state is of a {state['mode']!r} prefetch, this one is {options.mode!r}")
        if state["options"] != options.fingerprint():
            raise ValueError(f"the state was saved with options {state['options']}, not {options.fingerprint()}")
        position = Position(int(state["text"]), int(state["skip"]))
        return cls(position, int(state["batches"]), state["model"], state["sha256"])


def _state(
    options: PrefetchOptions, position: Position, batches: int, model: str | None, sha256: str | None
) -> dict[str, Any]:
    return {
        "format": STATE_FORMAT,
        "version": STATE_VERSION,
        "mode": options.mode,
        "text": position.text,
        "skip": position.skip,
        "batches": batches,
        "model": model,
        "sha256": sha256,
        "options": options.fingerprint(),
    }


class _Assembler:
    """Turns answers, fed in stream order, into deliveries; runs only on the event loop, in order."""

    def __init__(self, options: PrefetchOptions, resume: Resume) -> None:
        self.options = options
        self.batches = resume.batches
        self.position = resume.position
        self.model = resume.model
        self.sha256 = resume.model_sha256
        self.leftover = np.empty(0, np.int32)
        pack = options.pack
        self._packer: ConcatPacker | None = None
        self._regrouper: RowRegrouper | None = None
        if pack is not None and pack.strategy == "concat":
            self._packer = ConcatPacker(pack.seq_len, pack.rows, pack.mask_document_start, resume.position)
        elif pack is not None:
            self._regrouper = RowRegrouper(pack.seq_len, pack.rows, resume.position)

    def feed(self, window: Window, answer: Batch) -> list[Delivery]:
        self.model, self.sha256 = answer.model, answer.model_sha256
        if isinstance(answer, TokenizedBatch) and self._packer is None:
            batch = dataclasses.replace(answer, index=self.batches, start=window.start)
            return [self._deliver(batch, Position(window.stop, 0), len(window.texts), answer.num_tokens)]
        if isinstance(answer, TokenizedBatch):
            assert self._packer is not None
            self._packer.feed(np.asarray(answer.ids), np.asarray(answer.offsets), window.start)
            return self._drain(self._packer.take)
        assert self._regrouper is not None
        self._regrouper.feed(
            answer.input_ids, answer.labels, answer.position_ids, answer.cu_seqlens, window.start, window.stop
        )
        return self._drain(self._regrouper.take)

    def finish(self) -> list[Delivery]:
        """The last, partial block at the end of the stream (packing), and the leftover tokens."""
        if self._packer is not None:
            block, self.leftover = self._packer.finish()
            return [self._packed(block, self.leftover)] if block is not None else []
        if self._regrouper is not None:
            block = self._regrouper.finish()
            return [self._packed(block, self.leftover)] if block is not None else []
        return []

    def _drain(self, take: Callable[[], Block | None]) -> list[Delivery]:
        deliveries = []
        while (block := take()) is not None:
            deliveries.append(self._packed(block, np.empty(0, np.int32)))
        return deliveries

    def _packed(self, block: Block, leftover: np.ndarray) -> Delivery:
        pack = self.options.pack
        assert pack is not None
        batch = PackedBatch(
            input_ids=block.input_ids,
            labels=block.labels,
            position_ids=block.position_ids,
            cu_seqlens=block.cu_seqlens,
            leftover=leftover,
            stats=block.stats,
            model=self.model or "",
            seq_len=pack.seq_len,
            strategy=pack.strategy,
            model_sha256=self.sha256,
            index=self.batches,
            start=block.start,
        )
        return self._deliver(batch, block.after, block.after.text - self.position.text, int(block.stats["tokens"]))

    def _deliver(self, batch: Batch, after: Position, texts: int, tokens: int) -> Delivery:
        self.batches += 1
        self.position = after
        return Delivery(batch, _state(self.options, after, self.batches, self.model, self.sha256), texts, tokens)


class _Pipeline:
    """Lives on one event loop: fetches windows concurrently and assembles their answers strictly in order.

    Each window's task awaits its predecessor before assembling, so the assembler sees answers in
    stream order whatever order they arrive in.
    """

    def __init__(self, client: AsyncTokenizerClient, options: PrefetchOptions, resume: Resume) -> None:
        self.client = client
        self.options = options
        self.assembler = _Assembler(options, resume)
        self.recorder = _StatsRecorder()
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


def _failure(window: Window, exc: TokenizerError, batch_index: int) -> PrefetchError:
    text_index = None
    if isinstance(exc, TokenizerServiceError) and exc.field == "texts" and exc.index is not None:
        text_index = window.start + exc.index
    return PrefetchError(
        f"batch {batch_index} (texts {window.start} to {window.stop - 1}) failed: {exc}",
        batch_index=batch_index,
        text_start=window.start,
        text_stop=window.stop,
        text_index=text_index,
    )


class _TextReader:
    """Reads windows of texts from the caller's iterable, skipping the texts a saved state delivered."""

    def __init__(self, texts: Iterable[str], batch_size: int, start: int) -> None:
        if isinstance(texts, (str, bytes)):
            raise TypeError("texts must be an iterable of str (a list, a generator, a file...), not one string")
        self._iterator: Iterator[str] = iter(texts)
        self._batch_size = batch_size
        self._start = start
        self._position = 0

    def _skip(self) -> None:
        if self._position < self._start:
            skipped = sum(1 for _ in itertools.islice(self._iterator, self._start - self._position))
            self._position += skipped
            if self._position < self._start:
                raise ValueError(f"the stream ended at text {self._position}, before the saved position {self._start}")

    def next_window(self) -> Window | None:
        self._skip()
        texts = list(itertools.islice(self._iterator, self._batch_size))
        return self._window(texts)

    def _window(self, texts: list[str]) -> Window | None:
        if set(map(type, texts)) - {str}:  # one pass in C; then look closer (str subclasses are fine)
            for i, text in enumerate(texts):
                if not isinstance(text, str):
                    raise TypeError(f"text {self._position + i} is a {type(text).__name__}, not a str")
        if not texts:
            return None
        window = Window(self._position, texts)
        self._position += len(texts)
        return window


class _AsyncTextReader(_TextReader):
    """The same over a sync or an async iterable (a sync one is read on the event loop)."""

    def __init__(self, texts: Iterable[str] | AsyncIterable[str], batch_size: int, start: int) -> None:
        self._async: AsyncIterator[str] | None = None
        if isinstance(texts, AsyncIterable):
            self._async = texts.__aiter__()
            texts = ()
        super().__init__(texts, batch_size, start)

    async def _next(self) -> tuple[bool, str]:
        assert self._async is not None
        try:
            return True, await self._async.__anext__()
        except StopAsyncIteration:
            return False, ""

    async def next_window_async(self) -> Window | None:
        if self._async is None:
            return self.next_window()
        while self._position < self._start:
            more, _ = await self._next()
            if not more:
                raise ValueError(f"the stream ended at text {self._position}, before the saved position {self._start}")
            self._position += 1
        texts: list[str] = []
        while len(texts) < self._batch_size:
            more, text = await self._next()
            if not more:
                break
            texts.append(text)
        return self._window(texts)


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

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()


class Prefetcher:
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
        self.options = options
        self._reader = _TextReader(texts, options.batch_size, resume.position.text)
        self._state = _state(options, resume.position, resume.batches, resume.model, resume.model_sha256)
        self._next_index = resume.batches
        self._pending: deque[tuple[Window | None, concurrent.futures.Future[list[Delivery]]]] = deque()
        self._ready: deque[Delivery] = deque()
        self._source_error: BaseException | None = None
        self._exhausted = False
        self._closed = False
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
                    raise _failure(window, exc, self._next_index) from exc
                self._ready.extend(deliveries)
                self._fill()
            delivery = self._ready.popleft()
        except BaseException:
            self.close()
            raise
        self._state = delivery.state
        self._next_index += 1
        self._pipeline.recorder.delivered(delivery.texts, delivery.tokens, time.perf_counter() - started)
        return delivery.batch

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


class AsyncPrefetcher:
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
        self.options = options
        self._reader = _AsyncTextReader(texts, options.batch_size, resume.position.text)
        self._state = _state(options, resume.position, resume.batches, resume.model, resume.model_sha256)
        self._next_index = resume.batches
        self._pipeline = _Pipeline(client, options, resume)
        self._pending: deque[tuple[Window | None, asyncio.Task[list[Delivery]]]] = deque()
        self._ready: deque[Delivery] = deque()
        self._source_error: BaseException | None = None
        self._exhausted = False
        self._started = False
        self._closed = False

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
                    raise _failure(window, exc, self._next_index) from exc
                self._ready.extend(deliveries)
                await self._fill()
            delivery = self._ready.popleft()
        except BaseException:
            await self.aclose()
            raise
        self._state = delivery.state
        self._next_index += 1
        self._pipeline.recorder.delivered(delivery.texts, delivery.tokens, time.perf_counter() - started)
        return delivery.batch

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

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def stats(self) -> PrefetchStats:
        return self._pipeline.recorder.snapshot()

    @property
    def leftover(self) -> np.ndarray:
        return self._pipeline.assembler.leftover

    def state_dict(self) -> dict[str, Any]:
        return dict(self._state)


def _cancel_pending(
    loop: asyncio.AbstractEventLoop, pending: deque[tuple[Window | None, asyncio.Task[list[Delivery]]]]
) -> None:
    """Finalizer of an AsyncPrefetcher dropped without aclose(): cancel its tasks on their loop."""
    if loop.is_closed():
        return
    for _, task in list(pending):
        loop.call_soon_threadsafe(task.cancel)
    pending.clear()
