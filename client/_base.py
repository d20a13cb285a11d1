"""What TokenizerClient and AsyncTokenizerClient share, with no I/O: the httpx shape.

`BaseClient` holds the replicas, the retry policy, the API key and the model fingerprints; it builds
every call (`Call`: method, path, body, headers) and reads every answer. The two clients add only
I/O: sending a call to one replica (`_send`) and the retry loop around it (`_request`), which differ
in how they wait (time.sleep, asyncio.sleep).
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, get_args

import httpx

from client._outage import OutageLog
from client._protocol import (
    DEFAULT_URL,
    Format,
    ModelFingerprints,
    PackedBatch,
    Requests,
    TokenizedBatch,
    accept_header,
    batch_from_response,
    dumps,
    loads,
    packed_from_response,
    parse_urls,
    raise_for_error,
    resolve_api_key,
    texts_from_document,
)
from client._retry import NO_RETRY, Attempt, Replicas, RetryPolicy
from client.errors import TokenizerConnectionError, TokenizerProtocolError

JSON_HEADERS = {"content-type": "application/json"}
FORMATS = get_args(Format)


@dataclass(frozen=True)
class Call:
    """One HTTP call, as either client sends it to whichever replica it picks."""

    method: str
    path: str
    content: bytes | None = None
    headers: dict[str, str] | None = None


MODELS = Call("GET", "/v1/models")
READY = Call("GET", "/readyz")


@dataclass(frozen=True)
class Answer:
    """A successful response, the replica that gave it, and what it took to get it."""

    response: httpx.Response
    source: str
    attempts: int
    seconds: float


def _positive(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and value > 0  # False for nan too


class BaseClient:
    """Replicas, retries, calls and answers; no I/O (see the module)."""

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
        self._requests = Requests(self._api_key, timeout)
        self._fingerprints = ModelFingerprints()
        self._outage = OutageLog()  # one warning an outage, whichever call meets it first
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def _ensure_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"this {type(self).__name__} is closed")

    # -- building calls ------------------------------------------------------------------------------

    @staticmethod
    def _post(path: str, payload: dict[str, Any], format: Format | None = None) -> Call:
        """A JSON body to `path`, asking for the binary frame or JSON as `format` says (None: JSON only)."""
        if format is not None and format not in FORMATS:
            raise ValueError(f"format must be one of {', '.join(map(repr, FORMATS))}, not {format!r}")
        headers = JSON_HEADERS if format is None else {**JSON_HEADERS, "accept": accept_header(format)}
        return Call("POST", path, dumps(payload), headers)

    def _http_request(self, replica: int, call: Call) -> httpx.Request:
        return self._requests.build(call.method, f"{self.urls[replica]}{call.path}", call.content, call.headers)

    def _attempt(self, policy: RetryPolicy | None = None) -> Attempt:
        self._ensure_open()
        return Attempt(policy or self.retry or NO_RETRY, self._replicas)

    # -- reading answers -----------------------------------------------------------------------------

    @staticmethod
    def _checked(response: httpx.Response) -> httpx.Response:
        raise_for_error(response)
        return response

    @staticmethod
    def _connection_error(replica_url: str, call: Call, exc: Exception) -> TokenizerConnectionError:
        return TokenizerConnectionError(f"{call.method} {replica_url}{call.path} failed: {exc!r}")

    def _read_tokenize(self, answer: Answer, requested: str | None, texts: int | None = None) -> TokenizedBatch:
        """The answer to a request of `texts` texts, checked against it (MalformedAnswerError if it does not fit)."""
        batch = batch_from_response(answer.response, texts)
        self._fingerprints.check(batch.model, batch.model_sha256, answer.source, requested=requested)
        return batch

    def _read_pack(self, answer: Answer, requested: str | None, seq_len: int | None = None) -> PackedBatch:
        packed = packed_from_response(answer.response, seq_len)
        self._fingerprints.check(packed.model, packed.model_sha256, answer.source, requested=requested)
        return packed

    @staticmethod
    def _read_texts(answer: Answer, rows: int | None = None) -> list[str]:
        try:
            document = loads(answer.response.content)
        except ValueError as exc:
            raise TokenizerProtocolError(f"unreadable detokenize answer: {exc}") from exc
        return texts_from_document(document, rows)

    @staticmethod
    def _read_document(response: httpx.Response) -> dict[str, Any]:
        document: dict[str, Any] = loads(response.content)
        return document
