"""What TokenizerClient and AsyncTokenizerClient share, with no I/O: the httpx shape.

`BaseClient` holds the replicas, the retry policy, the API key, the model fingerprints and the
outage log; it builds every exchange (the call to send, and how to read its reply) and decides what
follows each attempt. The two clients in tokenizer_client.clients add only I/O: sending a call to one replica
(`_send`), and the retry loop around it (`_request`), which differ in how they wait (time.sleep,
asyncio.sleep).
"""

from __future__ import annotations

import numbers
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import httpx
import numpy as np

from tokenizer_client._answers import (
    batch_from_response,
    models_document,
    packed_from_response,
    raise_for_error,
    read_json,
    texts_from_document,
)
from tokenizer_client._fingerprints import ModelFingerprints
from tokenizer_client._outage import OutageLog
from tokenizer_client._requests import (
    MODELS,
    Call,
    Format,
    PackOptions,
    RequestBuilder,
    TokenizeOptions,
    chunked,
    detokenize_payload,
    post,
    resolve_api_key,
)
from tokenizer_client._retry import NO_RETRY, Attempt, Replicas, RetryPolicy
from tokenizer_client.batches import PackedBatch, TokenizedBatch
from tokenizer_client.errors import TokenizerConnectionError, TokenizerError
from tokenizer_client.urls import DEFAULT_URL, parse_urls

T = TypeVar("T")
P = TypeVar("P")


@dataclass(frozen=True)
class Reply:
    """A successful response, the replica that gave it, and what it took to get it."""

    response: httpx.Response
    source: str
    attempts: int
    seconds: float


@dataclass(frozen=True)
class Exchange(Generic[T]):
    """A call to send and how to read the reply to it: what each public method asks its client's I/O to do."""

    call: Call
    read: Callable[[Reply], T]


class Retrying:
    """One request's way through its attempts: the replica to try next, what follows a failure or a success."""

    def __init__(self, client: BaseClient, call: Call, attempt: Attempt) -> None:
        self._client = client
        self._request = str(call)
        self._attempt = attempt
        self._started = time.perf_counter()

    def next_replica(self) -> int:
        return self._attempt.next_replica()

    def failed(self, replica: int, exc: TokenizerError) -> float:
        """Seconds to wait before the next attempt (0: another replica at once); raises when giving up."""
        delay = self._attempt.failed(replica, exc)
        self._client._outage.retrying(self._attempt, self._request, exc)
        return delay

    def reply(self, replica: int, response: httpx.Response) -> Reply:
        self._attempt.succeeded(replica)
        source = self._client.urls[replica]
        self._client._outage.answered(self._request, source)
        return Reply(response, source, self._attempt.attempts, time.perf_counter() - self._started)


class PackStream:
    """`pack_stream`'s requests without I/O: chunks of texts, and the carry threaded from each answer to the next."""

    def __init__(self, texts: Iterable[str], texts_per_request: int) -> None:
        self.chunks = chunked(texts, texts_per_request)
        self.carry: np.ndarray | None = None
        self.starts: np.ndarray | None = None

    def keep(self, packed: PackedBatch) -> PackedBatch:
        """`packed`, after taking its leftover as the next request's carry."""
        self.carry, self.starts = packed.leftover, packed.leftover_document_starts
        return packed


def _positive(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and float(value) > 0  # False for nan too


class BaseClient:
    """Replicas, retries, exchanges and replies; no I/O (see the module)."""

    def __init__(
        self,
        url: str | Sequence[str] = DEFAULT_URL,
        *,
        timeout: float = 60.0,
        api_key: str | None = None,
        retry: RetryPolicy | None = None,
        replica_cooldown_s: float = 1.0,
    ) -> None:
        self.urls = parse_urls(url)
        if not (timeout is None or isinstance(timeout, httpx.Timeout) or _positive(timeout)):
            raise ValueError(f"timeout is in seconds, a number above 0 (or None, or an httpx.Timeout); got {timeout!r}")
        self.url = self.urls[0]
        self.timeout = timeout
        self.retry = retry
        self.replica_cooldown_s = replica_cooldown_s
        self._api_key = resolve_api_key(api_key)
        self._replicas = Replicas(self.urls, replica_cooldown_s)
        self._requests = RequestBuilder(self._api_key, timeout)
        self._fingerprints = ModelFingerprints()
        self._outage = OutageLog()  # one warning an outage, whichever call meets it first
        self._prefetchers: weakref.WeakSet[Any] = weakref.WeakSet()
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def _ensure_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"this {type(self).__name__} is closed")

    # -- sending: what to send where, and what follows each attempt -------------------------------------

    def _http_request(self, replica: int, call: Call) -> httpx.Request:
        return self._requests.build(self.urls[replica], call)

    def _prefetch_retry(self, retry: RetryPolicy | None) -> RetryPolicy:
        """A prefetch's policy: `retry`, else this client's, else RetryPolicy() (a prefetch always retries)."""
        self._ensure_open()
        return retry or self.retry or RetryPolicy()

    def _started(self, prefetcher: P) -> P:
        """`prefetcher`, remembered so that closing this client closes it."""
        self._prefetchers.add(prefetcher)
        return prefetcher

    def _retrying(self, call: Call, policy: RetryPolicy | None = None) -> Retrying:
        """The bookkeeping of one request under `policy`, else this client's (else no retry)."""
        self._ensure_open()
        return Retrying(self, call, Attempt(policy or self.retry or NO_RETRY, self._replicas))

    @contextmanager
    def _translating(self, replica: int, call: Call) -> Iterator[None]:
        """httpx's transport errors, raised inside, as TokenizerConnectionError."""
        try:
            yield
        except httpx.TransportError as exc:
            raise TokenizerConnectionError(f"{call.method} {self.urls[replica]}{call.path} failed: {exc!r}") from exc

    def _checked(
        self, response: httpx.Response, replica: int | None = None, call: Call | None = None
    ) -> httpx.Response:
        """`response`, or its error status raised as a TokenizerServiceError naming the URL requested."""
        if replica is None or call is None:
            raise_for_error(response)
        else:
            raise_for_error(response, self.urls[replica], call.path)
        return response

    # -- exchanges: each endpoint's call and the reading of its reply -----------------------------------

    def _tokenize(
        self, texts: Sequence[str], options: TokenizeOptions, format: Format = "binary"
    ) -> Exchange[TokenizedBatch]:
        payload = options.payload(texts)
        count = len(payload[options.inputs])
        return Exchange(
            post("/v1/tokenize", payload, format), lambda reply: self._read_tokenize(reply, options.model, count)
        )

    def _pack(
        self,
        texts: Sequence[str],
        options: PackOptions,
        carry: Sequence[int] | np.ndarray | None = None,
        carry_document_starts: Sequence[int] | np.ndarray | None = None,
        format: Format = "binary",
    ) -> Exchange[PackedBatch]:
        call = post("/v1/pack", options.payload(texts, carry, carry_document_starts), format)
        return Exchange(call, lambda reply: self._read_pack(reply, options.model, options.seq_len))

    def _detokenize(
        self, ids: Sequence[Sequence[int]] | Sequence[np.ndarray], model: str | None
    ) -> Exchange[list[str]]:
        payload = detokenize_payload(ids, model)
        rows = len(payload["ids"])
        return Exchange(
            post("/v1/detokenize", payload),
            lambda reply: texts_from_document(read_json(reply.response, "detokenize"), rows),
        )

    def _models(self) -> Exchange[dict[str, Any]]:
        return Exchange(MODELS, lambda reply: models_document(reply.response, reply.source))

    def _read_tokenize(self, reply: Reply, requested: str | None, texts: int | None = None) -> TokenizedBatch:
        """The reply to a request of `texts` texts, checked against it (MalformedAnswerError if it does not fit)."""
        batch = batch_from_response(reply.response, texts)
        self._fingerprints.check(batch.model, batch.model_sha256, reply.source, requested=requested)
        return batch

    def _read_pack(self, reply: Reply, requested: str | None, seq_len: int | None = None) -> PackedBatch:
        packed = packed_from_response(reply.response, seq_len)
        self._fingerprints.check(packed.model, packed.model_sha256, reply.source, requested=requested)
        return packed
