"""The one in-order bounded pipeline both prefetchers run; each only adds its way of waiting (.prefetchers).

Two halves, one per side of the wait:

* :class:`Pipeline` lives on an event loop: one request per window, any number in flight, each
  answer assembled (tokenizer_client.prefetch.assembler) strictly in stream order, whatever order they arrive in.
* :class:`Lookahead` lives with the consumer and does no I/O and no waiting: which windows to read
  and send (at most ``depth`` outstanding), which answer comes next, what is ready to hand out, the
  errors in stream order, the state and stats after each batch. ``H`` is how the consumer holds an
  outstanding request: an asyncio.Task (AsyncPrefetcher) or a concurrent.futures.Future
  (Prefetcher, whose loop runs on a thread of its own).

This module knows no client class: a pipeline's client is anything that answers like
AsyncTokenizerClient (:class:`PrefetchClient`).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, Generic, NoReturn, Protocol, TypeVar

from tokenizer_client._fingerprints import ModelFingerprints
from tokenizer_client._requests import PackOptions, TokenizeOptions
from tokenizer_client._retry import RetryPolicy
from tokenizer_client.batches import Batch, PackedBatch, TokenizedBatch
from tokenizer_client.errors import PrefetchError, TokenizerError, TokenizerServiceError
from tokenizer_client.prefetch.assembler import Assembler, Delivery
from tokenizer_client.prefetch.options import PrefetchOptions
from tokenizer_client.prefetch.resume import Resume
from tokenizer_client.prefetch.stats import StatsRecorder
from tokenizer_client.prefetch.texts import Window

H = TypeVar("H")


class ReplyTiming(Protocol):
    """What the pipeline reads of a client's reply besides the batch: what it took to get it."""

    @property
    def attempts(self) -> int: ...

    @property
    def seconds(self) -> float: ...


class PrefetchClient(Protocol):
    """What a prefetcher needs of its client; AsyncTokenizerClient is one.

    Its answers to /v1/tokenize and /v1/pack (best_fit), retried under ``policy``; the model
    fingerprints, which a resumed prefetch pins before the first answer; and ``aclose``, for
    Prefetcher, which owns its client.
    """

    _fingerprints: ModelFingerprints

    async def _tokenize_answer(
        self, texts: Sequence[str], options: TokenizeOptions, *, policy: RetryPolicy | None = None
    ) -> tuple[TokenizedBatch, ReplyTiming]: ...

    async def _pack_answer(
        self, texts: Sequence[str], options: PackOptions, *, policy: RetryPolicy | None = None
    ) -> tuple[PackedBatch, ReplyTiming]: ...

    async def aclose(self) -> None: ...


class Pipeline:
    """Lives on one event loop: fetches windows concurrently and assembles their answers strictly in order.

    Each request's task awaits its predecessor before assembling, so the assembler sees answers in
    stream order whatever order they arrive in.
    """

    def __init__(self, client: PrefetchClient, options: PrefetchOptions, resume: Resume) -> None:
        self.client = client
        self.options = options
        self.assembler = Assembler(options, resume)
        self.recorder = StatsRecorder()
        self.tasks: set[asyncio.Task[Any]] = set()
        self._last: asyncio.Task[Any] | None = None
        if resume.model is not None and resume.model_sha256 is not None:
            client._fingerprints.expect(resume.model, resume.model_sha256, "the saved prefetch state")

    async def request(self, window: Window | None) -> list[Delivery]:
        """The deliveries of `window`'s answer; for None (the texts have ended), the last rows and the leftover."""
        previous = self._enter()
        if window is None:
            await self._after(previous)
            return self._convert(self.assembler.finish())
        answer = await self._fetch(window)
        await self._after(previous)
        return self._convert(self.assembler.feed(window, answer))

    def _enter(self) -> asyncio.Task[Any] | None:
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        previous, self._last = self._last, task
        return previous

    async def _after(self, previous: asyncio.Task[Any] | None) -> None:
        if previous is not None:
            await asyncio.wait([previous])
            if previous.cancelled() or previous.exception() is not None:
                # The consumer meets the earlier failure first and stops there; this answer is never handed out.
                raise asyncio.CancelledError("an earlier window failed")

    async def _fetch(self, window: Window) -> Batch:
        options = self.options
        answer: Batch
        if options.mode == "best_fit":
            answer, meta = await self.client._pack_answer(window.texts, options.pack_options(), policy=options.retry)
        else:
            answer, meta = await self.client._tokenize_answer(window.texts, options.tokenize, policy=options.retry)
        self.recorder.answered(meta.seconds, meta.attempts)
        return answer

    def _convert(self, deliveries: list[Delivery]) -> list[Delivery]:
        """Torch tensors, when asked for, made here on the loop rather than in the consumer's ``next()``."""
        if not self.options.as_torch:
            return deliveries
        pin = self.options.pin_memory
        return [Delivery(d.batch._to_torch(pin), d.state, d.texts, d.tokens) for d in deliveries]

    async def cancel(self) -> None:
        """Cancel every task and wait until they are gone (their outcomes concern nobody any more)."""
        tasks = list(self.tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class Lookahead(Generic[H]):
    """Where the stream stands on the consumer's side: requests out, batches ready, the state handed out.

    The consumer drives it in this order: ``wants_window`` / ``sent`` (or ``unreadable``) to fill up to
    ``depth``; ``next_answer`` while nothing is ``ready``, then ``answered`` (or ``failed``) once it has
    waited for that answer; ``take`` to hand out the next batch; ``close``.
    """

    def __init__(self, options: PrefetchOptions, resume: Resume, recorder: StatsRecorder) -> None:
        self.depth = options.depth
        self.inputs = options.inputs
        self.recorder = recorder
        self.state = resume.state_dict(options)
        self._next_index = resume.batches
        self._pending: deque[tuple[Window | None, H]] = deque()
        self._ready: deque[Delivery] = deque()
        self._source_error: Exception | None = None
        self._exhausted = False

    def wants_window(self) -> bool:
        """Whether to read another window and send it: the texts go on and fewer than ``depth`` are out."""
        return not self._exhausted and len(self._pending) < self.depth

    def sent(self, window: Window | None, request: H) -> None:
        """`request` is out for `window`; None (the texts have ended) asks for the stream's last rows."""
        self._pending.append((window, request))
        if window is None:
            self._exhausted = True

    def unreadable(self, exc: Exception) -> None:
        """The texts raised `exc`: it is raised by ``next_answer`` once the batches before it are handed out."""
        self._source_error, self._exhausted = exc, True

    @property
    def ready(self) -> bool:
        return bool(self._ready)

    def next_answer(self) -> H | None:
        """The request to wait for next (it stays outstanding until answered); None at the end of the stream."""
        if not self._pending:
            if self._source_error is not None:
                raise self._source_error
            return None
        return self._pending[0][1]

    def answered(self, deliveries: list[Delivery]) -> None:
        """What the request ``next_answer`` gave came back with."""
        self._pending.popleft()
        self._ready.extend(deliveries)

    def failed(self, exc: TokenizerError) -> NoReturn:
        """The request ``next_answer`` gave failed for good: raise PrefetchError, which says where."""
        window, _ = self._pending.popleft()
        if window is None:
            raise exc
        text_index = None
        items = ("texts", "conversations", "records")
        if isinstance(exc, TokenizerServiceError) and exc.field in items and exc.index is not None:
            text_index = window.start + exc.index
        raise PrefetchError(
            f"batch {self._next_index} ({self.inputs} {window.start} to {window.stop - 1}) failed: {exc}",
            batch_index=self._next_index,
            text_start=window.start,
            text_stop=window.stop,
            text_index=text_index,
        ) from exc

    def take(self, started: float) -> Batch:
        """Hand out the next ready batch; the consumer asked for it at `started` (time.perf_counter())."""
        delivery = self._ready.popleft()
        self.state = delivery.state
        self._next_index += 1
        self.recorder.delivered(delivery.texts, delivery.tokens, time.perf_counter() - started)
        return delivery.batch

    def close(self) -> list[H]:
        """Forget everything outstanding and ready; the requests still out, for the consumer to cancel."""
        requests = [request for _, request in self._pending]  # some may not have started yet
        self._pending.clear()
        self._ready.clear()
        self.recorder.ended()
        return requests

    def outstanding(self) -> list[H]:
        """The requests out (for a finalizer that must cancel them without closing)."""
        return [request for _, request in self._pending]
