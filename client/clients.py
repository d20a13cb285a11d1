"""TokenizerClient and AsyncTokenizerClient: one httpx connection pool over one or more replicas, binary
answers, typed errors.

Everything that does no I/O is BaseClient's (tokenizer_client._base): the calls, the replies read and checked,
retries and failover decided. The two classes here only send (blocking, or with asyncio) and wait.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator, Sequence
from contextlib import aclosing, closing
from typing import Any, TypeVar

import httpx
import numpy as np

from tokenizer_client import _transports
from tokenizer_client._answers import models_document
from tokenizer_client._base import BaseClient, Exchange, PackStream, Reply
from tokenizer_client._fingerprints import check_replica_models
from tokenizer_client._lifecycle import AsyncClosing, Closing
from tokenizer_client._requests import MODELS, READY, Call, Format, PackOptions, Strategy, TokenizeOptions, TrainOn
from tokenizer_client._retry import RetryPolicy
from tokenizer_client.batches import PackedBatch, TokenizedBatch
from tokenizer_client.errors import TokenizerConnectionError, TokenizerError, TokenizerServiceError
from tokenizer_client.prefetch import AsyncPrefetcher, PackSpec, Prefetcher, PrefetchOptions
from tokenizer_client.prefetch.texts import detect_inputs
from tokenizer_client.urls import DEFAULT_URL

__all__ = ["AsyncTokenizerClient", "TokenizerClient"]

T = TypeVar("T")
UNREADY = (TokenizerConnectionError, TokenizerServiceError)  # what a readiness probe counts as "not ready"


class TokenizerClient(Closing, BaseClient):
    """Client of one tokenizer-service, or of several replicas of it. Use as a context manager, or call close().

    ``url`` is one base URL, a list of them, or a comma-separated string: requests go round robin
    over the replicas and fail over to the next when one cannot be reached or is overloaded. All
    replicas must serve the same model files (else ModelMismatchError). ``api_key`` (default: the
    TOKENIZER_API_KEY environment variable) is sent as ``Authorization: Bearer``.

    ``retry`` is the policy of single calls (tokenize, pack, detokenize, models); by default they try
    each replica once and raise. ``prefetch`` retries by default (RetryPolicy(): a 30 s budget).
    ``transport`` replaces the httpx transport (``httpx.MockTransport`` in tests).
    """

    def __init__(
        self,
        url: str | Sequence[str] = DEFAULT_URL,
        *,
        timeout: float = 60.0,
        transport: httpx.BaseTransport | None = None,
        api_key: str | None = None,
        retry: RetryPolicy | None = None,
        replica_cooldown_s: float = 1.0,
    ) -> None:
        super().__init__(url, timeout=timeout, api_key=api_key, retry=retry, replica_cooldown_s=replica_cooldown_s)
        self._transport = transport or _transports.sync_transport()

    def __enter__(self) -> TokenizerClient:
        self._ensure_open()
        return self

    def close(self) -> None:
        """Close the connection pool and every prefetcher this client started."""
        if not self._closed:
            self._closed = True
            for prefetcher in list(self._prefetchers):
                prefetcher.close()
            self._transport.close()

    def _send(self, replica: int, call: Call) -> httpx.Response:
        """One call to one replica; TokenizerConnectionError or TokenizerServiceError on failure."""
        with self._translating(replica, call):
            response = self._transport.handle_request(self._http_request(replica, call))
            with closing(response):
                response.read()
        return self._checked(response, replica, call)

    def _request(self, call: Call, policy: RetryPolicy | None = None) -> Reply:
        """Send with failover and retries (`policy`, else this client's)."""
        retrying = self._retrying(call, policy)
        while True:
            replica = retrying.next_replica()
            try:
                return retrying.reply(replica, self._send(replica, call))
            except TokenizerError as exc:
                time.sleep(retrying.failed(replica, exc))

    def _run(self, exchange: Exchange[T]) -> T:
        return exchange.read(self._request(exchange.call))

    def tokenize_batch(
        self,
        texts: Sequence[str],
        *,
        model: str | None = None,
        add_bos: bool = False,
        add_eos: bool = False,
        max_length: int | None = None,
        sample: dict[str, Any] | None = None,
        parse_special_tokens: bool = False,
        format: Format = "binary",
    ) -> TokenizedBatch:
        """Tokenize into one flat ids array plus offsets (the cheapest form to consume)."""
        options = TokenizeOptions(model, add_bos, add_eos, max_length, sample, parse_special_tokens)
        return self._run(self._tokenize(texts, options, format))

    def tokenize(
        self,
        texts: Sequence[str],
        *,
        model: str | None = None,
        add_bos: bool = False,
        add_eos: bool = False,
        max_length: int | None = None,
        sample: dict[str, Any] | None = None,
        parse_special_tokens: bool = False,
        format: Format = "binary",
    ) -> list[np.ndarray]:
        """Token ids of each text (int32 arrays), exactly as the model's library encodes them in-process."""
        options = TokenizeOptions(model, add_bos, add_eos, max_length, sample, parse_special_tokens)
        return self._run(self._tokenize(texts, options, format)).to_list()

    def tokenize_conversations(
        self,
        conversations: Sequence[Sequence[dict[str, Any]]],
        *,
        model: str | None = None,
        train_on: TrainOn = "assistant",
        parse_special_tokens: bool = False,
        format: Format = "binary",
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """(ids, loss_mask) of each conversation (int32, uint8): the model's chat template rendered as transformers
        renders it, the mask 1 on the assistant's output (``train_on="last"``: the final turn's only; a message's
        ``"train": false``/``true`` overrides). Special-token strings in the content are text unless
        ``parse_special_tokens``."""
        options = TokenizeOptions(
            model, parse_special_tokens=parse_special_tokens, inputs="conversations", train_on=train_on
        )
        return self._run(self._tokenize(conversations, options, format)).masked_list()

    def tokenize_records(
        self,
        records: Sequence[dict[str, str]],
        *,
        model: str | None = None,
        parse_special_tokens: bool = False,
        format: Format = "binary",
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """(ids, completion mask) of each ``{"prompt", "completion"}`` record, as TRL's SFT trainer tokenizes
        prompt-completion data (the completion and the EOS appended to it trained)."""
        options = TokenizeOptions(model, parse_special_tokens=parse_special_tokens, inputs="records")
        return self._run(self._tokenize(records, options, format)).masked_list()

    def pack(
        self,
        texts: Sequence[str],
        seq_len: int,
        *,
        strategy: Strategy = "concat",
        model: str | None = None,
        add_bos: bool = False,
        add_eos: bool = True,
        carry: Sequence[int] | np.ndarray | None = None,
        carry_document_starts: Sequence[int] | np.ndarray | None = None,
        mask_document_start: bool = False,
        parse_special_tokens: bool = False,
        format: Format = "binary",
    ) -> PackedBatch:
        """Tokenize and pack texts into rows of exactly `seq_len` tokens (see /v1/pack)."""
        options = PackOptions(seq_len, strategy, model, add_bos, add_eos, mask_document_start, parse_special_tokens)
        return self._run(self._pack(texts, options, carry, carry_document_starts, format))

    def pack_stream(
        self, texts: Iterable[str], seq_len: int, *, texts_per_request: int = 256, **options: Any
    ) -> Iterator[PackedBatch]:
        """Pack a long stream of texts with concat over several requests, threading the carry through.

        One request at a time (each needs the previous one's leftover); ``prefetch(pack=PackSpec(...))``
        keeps several in flight. Each yielded batch's `leftover` is what the stream holds beyond its
        rows so far; after the last batch it is the stream's remainder, shorter than one row.
        """
        stream = PackStream(texts, texts_per_request)
        for chunk in stream.chunks:
            yield stream.keep(
                self.pack(
                    chunk,
                    seq_len,
                    strategy="concat",
                    carry=stream.carry,
                    carry_document_starts=stream.starts,
                    **options,
                )
            )

    def detokenize(self, ids: Sequence[Sequence[int]] | Sequence[np.ndarray], *, model: str | None = None) -> list[str]:
        return self._run(self._detokenize(ids, model))

    def models(self) -> dict[str, Any]:
        """The server's /v1/models answer: default name and each model's ids and sha256."""
        return self._run(self._models())

    def check_replicas(self) -> dict[str, Any]:
        """Ask every replica for /v1/models and raise ModelMismatchError unless they all serve the same files.

        Requests only ever meet the replicas they are sent to; this checks all of them up front.
        Returns the first replica's /v1/models answer.
        """
        self._ensure_open()
        answers = [(url, models_document(self._send(replica, MODELS), url)) for replica, url in enumerate(self.urls)]
        return check_replica_models(self._fingerprints, answers)

    def ready(self) -> bool:
        """Whether any replica says it is ready (models loaded, workers answering); one probe each, no retry."""
        self._ensure_open()
        return any(self._probe(replica) for replica in range(len(self.urls)))

    def _probe(self, replica: int) -> bool:
        try:
            return self._send(replica, READY).status_code == 200
        except UNREADY:
            return False

    def async_client(self) -> AsyncTokenizerClient:
        """An AsyncTokenizerClient with this client's URLs, API key, timeout, retry policy and replica cooldown.

        It shares this client's model fingerprints (a model file that changes is caught across both)
        and outage log (one warning per outage), not its connections: ``transport=`` is not carried
        over, since a sync httpx transport cannot serve an async client, so the clone opens its own
        ``httpx.AsyncHTTPTransport``. ``prefetch`` makes its prefetcher's client here, and only here.
        """
        clone = AsyncTokenizerClient(
            self.urls,
            timeout=self.timeout,
            api_key=self._api_key,
            retry=self.retry,
            replica_cooldown_s=self.replica_cooldown_s,
        )
        clone._fingerprints = self._fingerprints
        clone._outage = self._outage
        return clone

    def prefetch(
        self,
        texts: Iterable[Any],
        *,
        batch_size: int = 64,
        depth: int = 4,
        model: str | None = None,
        add_bos: bool = False,
        add_eos: bool = False,
        max_length: int | None = None,
        sample: dict[str, Any] | None = None,
        parse_special_tokens: bool = False,
        pack: PackSpec | None = None,
        state: dict[str, Any] | None = None,
        as_torch: bool = False,
        pin_memory: bool = False,
        retry: RetryPolicy | None = None,
        conversations: bool | None = None,
        records: bool | None = None,
        train_on: TrainOn = "assistant",
    ) -> Prefetcher:
        """Tokenize `texts` in the background, up to `depth` requests ahead, and iterate the batches in order.

        See tokenizer_client.prefetch.Prefetcher. `retry` defaults to this client's policy, else RetryPolicy(). The
        requests go through a client of the prefetcher's own, made by ``async_client()`` (not through
        this client's ``transport=``).

        `texts` may also be an iterable of conversations (lists of OpenAI messages; ``conversations=True``, or
        detected from the first item) or of ``{"prompt", "completion"}`` records (``records=True``, or detected):
        ragged batches then carry ``loss_mask``, packed batches' ``labels`` are -100 wherever it is 0, and
        ``train_on`` ("assistant" or "last") says which assistant turns of a conversation are trained.
        """
        retry = self._prefetch_retry(retry)  # raises if this client is closed
        inputs, texts = detect_inputs(texts, conversations, records)
        tokenize = TokenizeOptions(model, add_bos, add_eos, max_length, sample, parse_special_tokens, inputs, train_on)
        options = PrefetchOptions.build(batch_size, depth, tokenize, pack, as_torch, pin_memory, retry)
        return self._started(Prefetcher(self.async_client, texts, options, state))


class AsyncTokenizerClient(AsyncClosing, BaseClient):
    """Client of one tokenizer-service or several replicas, for asyncio; ``async with`` it, or ``await aclose()``.

    Same options and methods as TokenizerClient, each a coroutine; ``prefetch`` returns an
    AsyncPrefetcher for ``async for``. ``transport`` takes an ``httpx.AsyncBaseTransport``.
    """

    def __init__(
        self,
        url: str | Sequence[str] = DEFAULT_URL,
        *,
        timeout: float = 60.0,
        transport: httpx.AsyncBaseTransport | None = None,
        api_key: str | None = None,
        retry: RetryPolicy | None = None,
        replica_cooldown_s: float = 1.0,
    ) -> None:
        super().__init__(url, timeout=timeout, api_key=api_key, retry=retry, replica_cooldown_s=replica_cooldown_s)
        self._transport = transport or _transports.async_transport()

    async def __aenter__(self) -> AsyncTokenizerClient:
        self._ensure_open()
        return self

    async def aclose(self) -> None:
        """Close the connection pool and every prefetcher this client started (as TokenizerClient.close)."""
        if not self._closed:
            self._closed = True
            for prefetcher in list(self._prefetchers):
                await prefetcher.aclose()
            await self._transport.aclose()

    async def _send(self, replica: int, call: Call) -> httpx.Response:
        """One call to one replica; TokenizerConnectionError or TokenizerServiceError on failure."""
        with self._translating(replica, call):
            response = await self._transport.handle_async_request(self._http_request(replica, call))
            async with aclosing(response):
                await response.aread()
        return self._checked(response, replica, call)

    async def _request(self, call: Call, policy: RetryPolicy | None = None) -> Reply:
        """Send with failover and retries (`policy`, else this client's); cancellation stops it at once."""
        retrying = self._retrying(call, policy)
        while True:
            replica = retrying.next_replica()
            try:
                return retrying.reply(replica, await self._send(replica, call))
            except TokenizerError as exc:
                if delay := retrying.failed(replica, exc):
                    await asyncio.sleep(delay)

    async def _exchange(self, exchange: Exchange[T], policy: RetryPolicy | None = None) -> tuple[T, Reply]:
        reply = await self._request(exchange.call, policy)
        return exchange.read(reply), reply

    async def _run(self, exchange: Exchange[T]) -> T:
        return (await self._exchange(exchange))[0]

    async def _tokenize_answer(
        self, texts: Sequence[str], options: TokenizeOptions, *, policy: RetryPolicy | None = None
    ) -> tuple[TokenizedBatch, Reply]:
        """A prefetcher's /v1/tokenize request (tokenizer_client.prefetch.pipeline.PrefetchClient)."""
        return await self._exchange(self._tokenize(texts, options), policy)

    async def _pack_answer(
        self, texts: Sequence[str], options: PackOptions, *, policy: RetryPolicy | None = None
    ) -> tuple[PackedBatch, Reply]:
        """A prefetcher's best_fit /v1/pack request (tokenizer_client.prefetch.pipeline.PrefetchClient)."""
        return await self._exchange(self._pack(texts, options), policy)

    async def tokenize_batch(
        self,
        texts: Sequence[str],
        *,
        model: str | None = None,
        add_bos: bool = False,
        add_eos: bool = False,
        max_length: int | None = None,
        sample: dict[str, Any] | None = None,
        parse_special_tokens: bool = False,
        format: Format = "binary",
    ) -> TokenizedBatch:
        """Tokenize into one flat ids array plus offsets (the cheapest form to consume)."""
        options = TokenizeOptions(model, add_bos, add_eos, max_length, sample, parse_special_tokens)
        return await self._run(self._tokenize(texts, options, format))

    async def tokenize(
        self,
        texts: Sequence[str],
        *,
        model: str | None = None,
        add_bos: bool = False,
        add_eos: bool = False,
        max_length: int | None = None,
        sample: dict[str, Any] | None = None,
        parse_special_tokens: bool = False,
        format: Format = "binary",
    ) -> list[np.ndarray]:
        """Token ids of each text (int32 arrays), exactly as the model's library encodes them in-process."""
        options = TokenizeOptions(model, add_bos, add_eos, max_length, sample, parse_special_tokens)
        return (await self._run(self._tokenize(texts, options, format))).to_list()

    async def tokenize_conversations(
        self,
        conversations: Sequence[Sequence[dict[str, Any]]],
        *,
        model: str | None = None,
        train_on: TrainOn = "assistant",
        parse_special_tokens: bool = False,
        format: Format = "binary",
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """(ids, loss_mask) of each conversation (int32, uint8): the model's chat template rendered as transformers
        renders it, the mask 1 on the assistant's output (``train_on="last"``: the final turn's only; a message's
        ``"train": false``/``true`` overrides). Special-token strings in the content are text unless
        ``parse_special_tokens``."""
        options = TokenizeOptions(
            model, parse_special_tokens=parse_special_tokens, inputs="conversations", train_on=train_on
        )
        return (await self._run(self._tokenize(conversations, options, format))).masked_list()

    async def tokenize_records(
        self,
        records: Sequence[dict[str, str]],
        *,
        model: str | None = None,
        parse_special_tokens: bool = False,
        format: Format = "binary",
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """(ids, completion mask) of each ``{"prompt", "completion"}`` record, as TRL's SFT trainer tokenizes
        prompt-completion data (the completion and the EOS appended to it trained)."""
        options = TokenizeOptions(model, parse_special_tokens=parse_special_tokens, inputs="records")
        return (await self._run(self._tokenize(records, options, format))).masked_list()

    async def pack(
        self,
        texts: Sequence[str],
        seq_len: int,
        *,
        strategy: Strategy = "concat",
        model: str | None = None,
        add_bos: bool = False,
        add_eos: bool = True,
        carry: Sequence[int] | np.ndarray | None = None,
        carry_document_starts: Sequence[int] | np.ndarray | None = None,
        mask_document_start: bool = False,
        parse_special_tokens: bool = False,
        format: Format = "binary",
    ) -> PackedBatch:
        """Tokenize and pack texts into rows of exactly `seq_len` tokens (see /v1/pack)."""
        options = PackOptions(seq_len, strategy, model, add_bos, add_eos, mask_document_start, parse_special_tokens)
        return await self._run(self._pack(texts, options, carry, carry_document_starts, format))

    async def pack_stream(
        self, texts: Iterable[str], seq_len: int, *, texts_per_request: int = 256, **options: Any
    ) -> AsyncIterator[PackedBatch]:
        """`TokenizerClient.pack_stream` for asyncio: concat over several requests, carry threaded through."""
        stream = PackStream(texts, texts_per_request)
        for chunk in stream.chunks:
            yield stream.keep(
                await self.pack(
                    chunk,
                    seq_len,
                    strategy="concat",
                    carry=stream.carry,
                    carry_document_starts=stream.starts,
                    **options,
                )
            )

    async def detokenize(
        self, ids: Sequence[Sequence[int]] | Sequence[np.ndarray], *, model: str | None = None
    ) -> list[str]:
        return await self._run(self._detokenize(ids, model))

    async def models(self) -> dict[str, Any]:
        """The server's /v1/models answer: default name and each model's ids and sha256."""
        return await self._run(self._models())

    async def check_replicas(self) -> dict[str, Any]:
        """Ask every replica for /v1/models and raise ModelMismatchError unless they all serve the same files."""
        self._ensure_open()
        responses = await asyncio.gather(*(self._send(replica, MODELS) for replica in range(len(self.urls))))
        answers = [(url, models_document(response, url)) for url, response in zip(self.urls, responses, strict=True)]
        return check_replica_models(self._fingerprints, answers)

    async def ready(self) -> bool:
        """Whether any replica says it is ready; one probe each, no retry."""
        self._ensure_open()
        for replica in range(len(self.urls)):
            try:
                if (await self._send(replica, READY)).status_code == 200:
                    return True
            except UNREADY:
                continue
        return False

    def prefetch(
        self,
        texts: Iterable[Any] | AsyncIterable[Any],
        *,
        batch_size: int = 64,
        depth: int = 4,
        model: str | None = None,
        add_bos: bool = False,
        add_eos: bool = False,
        max_length: int | None = None,
        sample: dict[str, Any] | None = None,
        parse_special_tokens: bool = False,
        pack: PackSpec | None = None,
        state: dict[str, Any] | None = None,
        as_torch: bool = False,
        pin_memory: bool = False,
        retry: RetryPolicy | None = None,
        conversations: bool | None = None,
        records: bool | None = None,
        train_on: TrainOn = "assistant",
    ) -> AsyncPrefetcher:
        """``async for batch in client.prefetch(texts, ...)``: as TokenizerClient.prefetch, in this event loop.

        `texts` may be a sync or an async iterable (of conversations or records too; an async iterable of them
        needs ``conversations=True`` or ``records=True``: it cannot be looked into before the first batch).
        """
        retry = self._prefetch_retry(retry)  # raises if this client is closed
        inputs, texts = detect_inputs(texts, conversations, records)
        tokenize = TokenizeOptions(model, add_bos, add_eos, max_length, sample, parse_special_tokens, inputs, train_on)
        options = PrefetchOptions.build(batch_size, depth, tokenize, pack, as_torch, pin_memory, retry)
        return self._started(AsyncPrefetcher(self, texts, options, state))
