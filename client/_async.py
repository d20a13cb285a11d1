"""AsyncTokenizerClient: the TokenizerClient API for asyncio code.

The calls and answers are BaseClient's (client._base); this module adds the asyncio I/O.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Sequence
from types import TracebackType
from typing import Any

import httpx
import numpy as np

from client._base import MODELS, READY, Answer, BaseClient, Call
from client._options import PackSpec, PrefetchOptions
from client._protocol import (
    DEFAULT_URL,
    Format,
    PackedBatch,
    PackOptions,
    Strategy,
    TokenizedBatch,
    TokenizeOptions,
    check_replica_models,
    chunked,
    detokenize_payload,
)
from client._retry import RetryPolicy
from client.errors import TokenizerConnectionError, TokenizerError, TokenizerServiceError
from client.prefetch import AsyncPrefetcher

__all__ = ["Answer", "AsyncTokenizerClient"]


class AsyncTokenizerClient(BaseClient):
    """Client of one tokenizer-service or several replicas, for asyncio; ``async with`` it, or ``await aclose()``.

    Same options and methods as TokenizerClient, each a coroutine; ``prefetch`` returns an
    AsyncPrefetcher for ``async for``.
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
        self._transport = transport or httpx.AsyncHTTPTransport()
        self._prefetchers: weakref.WeakSet[AsyncPrefetcher] = weakref.WeakSet()

    async def __aenter__(self) -> AsyncTokenizerClient:
        self._ensure_open()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connection pool and every prefetcher this client started (as TokenizerClient.close)."""
        if not self._closed:
            self._closed = True
            for prefetcher in list(self._prefetchers):
                await prefetcher.aclose()
            await self._transport.aclose()

    async def _send(self, replica: int, call: Call) -> httpx.Response:
        """One call to one replica; TokenizerConnectionError or TokenizerServiceError on failure."""
        try:
            response = await self._transport.handle_async_request(self._http_request(replica, call))
            try:
                await response.aread()
            finally:
                await response.aclose()
        except httpx.TransportError as exc:
            raise self._connection_error(self.urls[replica], call, exc) from exc
        return self._checked(response)

    async def _request(self, call: Call, policy: RetryPolicy | None = None) -> Answer:
        """Send with failover and retries (`policy`, else this client's); cancellation stops it at once."""
        attempt = self._attempt(policy)
        started = time.perf_counter()
        while True:
            replica = attempt.next_replica()
            try:
                response = await self._send(replica, call)
            except TokenizerError as exc:
                delay = attempt.failed(replica, exc)
                self._outage.retrying(attempt, call, exc)
                if delay:
                    await asyncio.sleep(delay)
                continue
            attempt.succeeded(replica)
            self._outage.answered(call, self.urls[replica])
            return Answer(response, self.urls[replica], attempt.attempts, time.perf_counter() - started)

    async def _tokenize_answer(
        self,
        texts: Sequence[str],
        options: TokenizeOptions,
        format: Format = "binary",
        policy: RetryPolicy | None = None,
    ) -> tuple[TokenizedBatch, Answer]:
        payload = options.payload(texts)
        answer = await self._request(self._post("/v1/tokenize", payload, format), policy)
        return self._read_tokenize(answer, options.model, len(payload["texts"])), answer

    async def _pack_answer(
        self,
        texts: Sequence[str],
        options: PackOptions,
        carry: Sequence[int] | np.ndarray | None = None,
        carry_document_starts: Sequence[int] | np.ndarray | None = None,
        format: Format = "binary",
        policy: RetryPolicy | None = None,
    ) -> tuple[PackedBatch, Answer]:
        call = self._post("/v1/pack", options.payload(texts, carry, carry_document_starts), format)
        answer = await self._request(call, policy)
        return self._read_pack(answer, options.model, options.seq_len), answer

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
        return (await self._tokenize_answer(texts, options, format))[0]

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
        return (await self._tokenize_answer(texts, options, format))[0].to_list()

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
        return (await self._pack_answer(texts, options, carry, carry_document_starts, format))[0]

    async def pack_stream(
        self, texts: Iterable[str], seq_len: int, *, texts_per_request: int = 256, **options: Any
    ) -> AsyncIterator[PackedBatch]:
        """`TokenizerClient.pack_stream` for asyncio: concat over several requests, carry threaded through."""
        carry: np.ndarray | None = None
        starts: np.ndarray | None = None
        for chunk in chunked(texts, texts_per_request):
            packed = await self.pack(
                chunk, seq_len, strategy="concat", carry=carry, carry_document_starts=starts, **options
            )
            carry, starts = packed.leftover, packed.leftover_document_starts
            yield packed

    async def detokenize(
        self, ids: Sequence[Sequence[int]] | Sequence[np.ndarray], *, model: str | None = None
    ) -> list[str]:
        payload = detokenize_payload(ids, model)
        return self._read_texts(await self._request(self._post("/v1/detokenize", payload)), len(payload["ids"]))

    async def models(self) -> dict[str, Any]:
        """The server's /v1/models answer: default name and each model's ids and sha256."""
        return self._read_document((await self._request(MODELS)).response)

    async def check_replicas(self) -> dict[str, Any]:
        """Ask every replica for /v1/models and raise ModelMismatchError unless they all serve the same files."""
        self._ensure_open()
        asked = [self._send(replica, MODELS) for replica in range(len(self.urls))]
        responses = await asyncio.gather(*asked)
        answers = [(url, self._read_document(response)) for url, response in zip(self.urls, responses, strict=True)]
        return check_replica_models(self._fingerprints, answers)

    async def ready(self) -> bool:
        """Whether any replica says it is ready; one probe each, no retry."""
        self._ensure_open()
        for replica in range(len(self.urls)):
            try:
                if (await self._send(replica, READY)).status_code == 200:
                    return True
            except (TokenizerConnectionError, TokenizerServiceError):
                continue
        return False

    def prefetch(
        self,
        texts: Iterable[str] | AsyncIterable[str],
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
    ) -> AsyncPrefetcher:
        """``async for batch in client.prefetch(texts, ...)``: as TokenizerClient.prefetch, in this event loop.

        `texts` may be a sync or an async iterable.
        """
        self._ensure_open()
        options = PrefetchOptions.build(
            batch_size=batch_size,
            depth=depth,
            tokenize=TokenizeOptions(model, add_bos, add_eos, max_length, sample, parse_special_tokens),
            pack=pack,
            as_torch=as_torch,
            pin_memory=pin_memory,
            retry=retry or self.retry or RetryPolicy(),
        )
        prefetcher = AsyncPrefetcher(self, texts, options, state)
        self._prefetchers.add(prefetcher)
        return prefetcher
