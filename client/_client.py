"""TokenizerClient: one httpx connection pool over one or more replicas, binary answers, typed errors.

The calls and answers are BaseClient's (client._base); this module adds the blocking I/O.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterable, Iterator, Sequence
from types import TracebackType
from typing import Any

import httpx
import numpy as np

from client._async import AsyncTokenizerClient
from client._base import MODELS, READY, Answer, BaseClient, Call
from client._options import PackSpec, PrefetchOptions
from client._protocol import (
    DEFAULT_URL,
    MODEL_SHA256_HEADER,
    Format,
    ModelFingerprints,
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
from client.prefetch import Prefetcher

__all__ = [
    "DEFAULT_URL",
    "MODEL_SHA256_HEADER",
    "ModelFingerprints",
    "PackedBatch",
    "TokenizedBatch",
    "TokenizerClient",
]


class TokenizerClient(BaseClient):
    """Client of one tokenizer-service, or of several replicas of it. Use as a context manager, or call close().

    ``url`` is one base URL, a list of them, or a comma-separated string: requests go round robin
    over the replicas and fail over to the next when one cannot be reached or is overloaded. All
    replicas must serve the same model files (else ModelMismatchError). ``api_key`` (default: the
    TOKENIZER_API_KEY environment variable) is sent as ``Authorization: Bearer``.

    ``retry`` is the policy of single calls (tokenize, pack, detokenize, models); by default they try
    each replica once and raise. ``prefetch`` retries by default (RetryPolicy(): a 30 s budget).
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
        self._transport = transport or httpx.HTTPTransport()
        self._prefetchers: weakref.WeakSet[Prefetcher] = weakref.WeakSet()

    def __enter__(self) -> TokenizerClient:
        self._ensure_open()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection pool and every prefetcher this client started."""
        if not self._closed:
            self._closed = True
            for prefetcher in list(self._prefetchers):
                prefetcher.close()
            self._transport.close()

    def _send(self, replica: int, call: Call) -> httpx.Response:
        """One call to one replica; TokenizerConnectionError or TokenizerServiceError on failure."""
        try:
            response = self._transport.handle_request(self._http_request(replica, call))
            try:
                response.read()
            finally:
                response.close()
        except httpx.TransportError as exc:
            raise self._connection_error(self.urls[replica], call, exc) from exc
        return self._checked(response)

    def _request(self, call: Call, policy: RetryPolicy | None = None) -> Answer:
        """Send with failover and retries (`policy`, else this client's)."""
        attempt = self._attempt(policy)
        started = time.perf_counter()
        while True:
            replica = attempt.next_replica()
            try:
                response = self._send(replica, call)
            except TokenizerError as exc:
                delay = attempt.failed(replica, exc)
                self._outage.retrying(attempt, call, exc)
                time.sleep(delay)
                continue
            attempt.succeeded(replica)
            self._outage.answered(call, self.urls[replica])
            return Answer(response, self.urls[replica], attempt.attempts, time.perf_counter() - started)

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
        payload = options.payload(texts)
        answer = self._request(self._post("/v1/tokenize", payload, format))
        return self._read_tokenize(answer, model, len(payload["texts"]))

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
        batch = self.tokenize_batch(
            texts,
            model=model,
            add_bos=add_bos,
            add_eos=add_eos,
            max_length=max_length,
            sample=sample,
            parse_special_tokens=parse_special_tokens,
            format=format,
        )
        return batch.to_list()

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
        call = self._post("/v1/pack", options.payload(texts, carry, carry_document_starts), format)
        return self._read_pack(self._request(call), model, options.seq_len)

    def pack_stream(
        self, texts: Iterable[str], seq_len: int, *, texts_per_request: int = 256, **options: Any
    ) -> Iterator[PackedBatch]:
        """Pack a long stream of texts with concat over several requests, threading the carry through.

        One request at a time (each needs the previous one's leftover); ``prefetch(pack=PackSpec(...))``
        keeps several in flight. Each yielded batch's `leftover` is what the stream holds beyond its
        rows so far; after the last batch it is the stream's remainder, shorter than one row.
        """
        carry: np.ndarray | None = None
        starts: np.ndarray | None = None
        for chunk in chunked(texts, texts_per_request):
            packed = self.pack(chunk, seq_len, strategy="concat", carry=carry, carry_document_starts=starts, **options)
            carry, starts = packed.leftover, packed.leftover_document_starts
            yield packed

    def detokenize(self, ids: Sequence[Sequence[int]] | Sequence[np.ndarray], *, model: str | None = None) -> list[str]:
        payload = detokenize_payload(ids, model)
        return self._read_texts(self._request(self._post("/v1/detokenize", payload)), len(payload["ids"]))

    def models(self) -> dict[str, Any]:
        """The server's /v1/models answer: default name and each model's ids and sha256."""
        return self._read_document(self._request(MODELS).response)

    def check_replicas(self) -> dict[str, Any]:
        """Ask every replica for /v1/models and raise ModelMismatchError unless they all serve the same files.

        Requests only ever meet the replicas they are sent to; this checks all of them up front.
        Returns the first replica's /v1/models answer.
        """
        self._ensure_open()
        answers = [(url, self._read_document(self._send(replica, MODELS))) for replica, url in enumerate(self.urls)]
        return check_replica_models(self._fingerprints, answers)

    def ready(self) -> bool:
        """Whether any replica says it is ready (models loaded, workers answering); one probe each, no retry."""
        self._ensure_open()
        for replica in range(len(self.urls)):
            try:
                if self._send(replica, READY).status_code == 200:
                    return True
            except (TokenizerConnectionError, TokenizerServiceError):
                continue
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
        texts: Iterable[str],
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
    ) -> Prefetcher:
        """Tokenize `texts` in the background, up to `depth` requests ahead, and iterate the batches in order.

        See client.prefetch.Prefetcher. `retry` defaults to this client's policy, else RetryPolicy(). The
        requests go through a client of the prefetcher's own, made by ``async_client()`` (not through
        this client's ``transport=``).
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
        prefetcher = Prefetcher(self.async_client, texts, options, state)
        self._prefetchers.add(prefetcher)
        return prefetcher
