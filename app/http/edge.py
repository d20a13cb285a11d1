"""The HTTP edge: plain ASGI in front of FastAPI, serving the hot routes itself.

`POST /v1/tokenize`, `/v1/detokenize` and `/v1/pack` never reach FastAPI's router, dependency
injection or middleware stack: here a request costs the server process a constant amount of work,
whatever its number of texts and tokens and the number of workers:

    API key -> concurrency and byte budget (503) -> read the body, charging the budget as it arrives
    (413, 503; 408 when it arrives slower than the minimum rate) -> hand the bytes to the pool
    -> wait, with a deadline (504) and an ear for a client that hangs up (499) -> write the answer's
    bytes -> count it in the metrics.

Every other route (models, probes, metrics, docs) goes to FastAPI, with the same API-key check
and request metrics. Errors are the pool's domain errors, mapped to statuses by tokenizer_service.http.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any

import orjson
from prometheus_client import Counter
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenizer_client import wire
from tokenizer_service.core import memory
from tokenizer_service.core.errors import (
    Overloaded,
    PayloadTooLarge,
    RequestTimeout,
    ServiceError,
    SlowBody,
    Unauthorized,
    Unavailable,
    UnsupportedEncoding,
)
from tokenizer_service.core.join import Answer
from tokenizer_service.core.models import ModelInfo
from tokenizer_service.core.protocol import ROUTES
from tokenizer_service.core.readiness import Readiness, ServiceState
from tokenizer_service.http.admission import Admission
from tokenizer_service.http.auth import OPEN_PATHS, ApiKeys, bearer_token, route_path
from tokenizer_service.http.negotiation import MODEL_SHA256_HEADER, wants_binary
from tokenizer_service.http.status import CLIENT_CLOSED_REQUEST, send_error, send_json
from tokenizer_service.metrics import Metrics

logger = logging.getLogger("tokenizer.edge")

# Listen for a client hanging up only once a request has waited this long: most answer sooner,
# and listening costs a task.
LISTEN_AFTER_SECONDS = 0.1
# A joined answer up to this size is copied once into one write: each write costs the server a send
# through uvicorn and a system call, and the client a wake-up and a read.
JOIN_ANSWER_BYTES = 4 * 1024 * 1024
MAX_BODY_PARTS = 64  # a body that came in more chunks (trickled in small reads) is joined: one part to the worker
JSON_TYPE = b"application/json"
BINARY_TYPE = wire.MEDIA_TYPE.encode()
SHA256_HEADER = MODEL_SHA256_HEADER.lower().encode()


class _Abandoned:
    """Why a request's wait was cut short: timeout, slow body or disconnect (None: the server cancelled it).

    Also what its body has brought so far (`received`, the bytes charged to the byte budget), and
    the check that the body keeps arriving at the minimum rate: by `grace` seconds plus one second
    per `rate` bytes received since the head, the next bytes must have come.
    """

    __slots__ = ("listener", "rate_timer", "reason", "received", "task")

    def __init__(self, task: asyncio.Task[Any]) -> None:
        self.task = task
        self.reason: str | None = None
        self.listener: asyncio.Task[None] | None = None
        self.received = 0
        self.rate_timer: asyncio.TimerHandle | None = None

    def expire(self, reason: str = "timeout") -> None:
        if self.reason is None:
            self.reason = reason
            self.task.cancel()

    def watch_rate(self, loop: asyncio.AbstractEventLoop, grace: float, rate: float) -> None:
        started = loop.time()

        def check() -> None:
            due = started + grace + self.received / rate
            if loop.time() >= due:
                self.rate_timer = None
                self.expire("slow_body")
            else:
                self.rate_timer = loop.call_at(due, check)

        self.rate_timer = loop.call_at(started + grace, check)

    def body_done(self) -> None:
        if self.rate_timer is not None:
            self.rate_timer.cancel()
            self.rate_timer = None

    def listen(self, loop: asyncio.AbstractEventLoop, receive: Receive) -> None:
        self.listener = loop.create_task(self._listen(receive))

    async def _listen(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        if self.reason is None:
            self.reason = "disconnect"
            self.task.cancel()


class Edge:
    """The ASGI app uvicorn runs: hot routes here, the rest to `app` (FastAPI)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        state: ServiceState,
        metrics: Metrics,
        keys: ApiKeys | None,
        max_request_bytes: int,
        max_queued_bytes: int,
        max_concurrent: int,
        timeout: float,
        paths: frozenset[str],
        min_body_rate: float = 0.0,
        body_grace: float = 10.0,
    ) -> None:
        self.app = app
        self.state = state  # readiness, and the pool once the lifespan has started it
        self.metrics = metrics
        self.keys = keys
        self.max_request_bytes = max_request_bytes
        self.admission = Admission(max_queued_bytes, metrics)
        self.max_concurrent = max_concurrent
        self.timeout = timeout
        self.min_body_rate = min_body_rate  # bytes a second a body must average after `body_grace` (0: no check)
        self.body_grace = body_grace
        self.paths = paths
        self.active = 0
        self._trim = False
        self._counters: dict[tuple[str, int], Counter] = {}
        self._durations = {path: metrics.request_duration.labels(path) for path in paths}
        self._sha256: list[bytes] = []
        self._per_model: list[tuple[Any, Any, Any]] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    def open(self, models: list[ModelInfo]) -> None:
        """Prepare the per-model answers and metrics (the hot routes answer once `state` says ready)."""
        self._sha256 = [info.sha256.encode() for info in models]
        metrics = self.metrics
        self._per_model = [
            (
                metrics.texts.labels(info.name),
                metrics.tokens.labels(info.name),
                metrics.worker_seconds.labels(info.name),
            )
            for info in models
        ]
        self._loop = asyncio.get_running_loop()  # once: get_running_loop() costs a getpid() per call on 3.11

    # -- every request ---------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = route_path(scope)
        route = ROUTES.get(path) if scope["method"] == "POST" else None  # a hot route, served here
        endpoint = path if path in self.paths else "unmatched"  # FastAPI declares the hot routes too
        started = time.perf_counter()
        status = CLIENT_CLOSED_REQUEST  # a request that ends without an answer: its client hung up
        metrics = self.metrics
        counted = path != "/metrics"  # requests in flight: not the scrape that reads the gauge
        if counted:
            metrics.inflight.inc()
        try:
            if scope["method"] == "GET" and asks_for_websocket(scope["headers"]):
                await send_json(send, 400, no_websocket(path))
                status = 400
            elif self.keys is not None and path not in OPEN_PATHS and (refusal := self._refuse(scope)) is not None:
                status = await send_error(send, refusal)
            elif route is not None:
                status = await self._serve(route, scope, receive, send)
            else:
                status = await self._delegate(scope, receive, send)
        except Exception:
            status = 500
            raise
        finally:
            if counted:
                metrics.inflight.dec()
            self._count(endpoint, status)
            duration = self._durations.get(endpoint)
            if duration is None:
                duration = metrics.request_duration.labels(endpoint)
            duration.observe(time.perf_counter() - started)
            if self._trim and not self.active:  # after a large request, once idle (its buffers are freed)
                self._trim = False
                memory.trim()

    def _count(self, endpoint: str, status: int) -> None:
        key = (endpoint, status)
        counter = self._counters.get(key)
        if counter is None:
            counter = self._counters[key] = self.metrics.requests.labels(endpoint, str(status))
        counter.inc()

    def _refuse(self, scope: Scope) -> Unauthorized | None:
        assert self.keys is not None
        authorization = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                authorization = value.decode("latin-1")
                break
        token = bearer_token(authorization)
        if token is None:
            return Unauthorized("this endpoint needs an API key: send `Authorization: Bearer <key>`")
        if not self.keys.accepts(token):
            return Unauthorized("the API key is not valid", invalid_token=True)
        return None

    async def _delegate(self, scope: Scope, receive: Receive, send: Send) -> int:
        status = CLIENT_CLOSED_REQUEST

        async def send_with_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        await self.app(scope, receive, send_with_status)
        return status

    # -- the hot routes ------------------------------------------------------------------------------------

    async def _serve(self, route: int, scope: Scope, receive: Receive, send: Send) -> int:
        phase = self.state.phase  # while rebuilding, requests wait for a worker (or get the pool's 503)
        if phase is not Readiness.READY:
            return await send_error(send, starting() if phase is Readiness.STARTING else shutting_down())
        if self.active >= self.max_concurrent:
            self.metrics.rejected_requests.labels("concurrency").inc()
            overloaded = Overloaded(
                f"{self.active} requests are in progress, the most this server takes at once; retry later"
            )
            return await send_error(send, overloaded)
        declared, accept, encoding = None, None, None
        for name, value in scope["headers"]:
            if name == b"content-length":
                declared = value
            elif name == b"accept":
                accept = value
            elif name == b"content-encoding":
                encoding = value
        if encoding is not None and encoding.strip().lower() not in (b"", b"identity"):
            shown = encoding.decode("latin-1")[:40]
            refused = UnsupportedEncoding(
                f"Content-Encoding {shown!r}: request bodies are read as sent; send it uncompressed"
            )
            return await send_error(send, refused)
        self.active += 1
        loop = self._loop
        assert loop is not None
        task = asyncio.current_task(loop)
        assert task is not None
        # One deadline for the whole request, the body's arrival included (a body trickled in
        # slowly is cut off like a slow answer), and a minimum rate for the body.
        abandoned = _Abandoned(task)
        timer = loop.call_later(self.timeout, abandoned.expire)
        ear: asyncio.TimerHandle | None = None
        try:
            if declared is not None and declared.isdigit():
                if int(declared) > self.max_request_bytes:
                    raise PayloadTooLarge(
                        f"request body of {int(declared)} bytes exceeds the limit of {self.max_request_bytes} bytes"
                    )
                # Refused at once when it could not fit now; charged as its bytes arrive, so a body
                # that is declared but not sent holds nothing.
                self.admission.check(int(declared))
            if self.min_body_rate > 0:
                abandoned.watch_rate(loop, self.body_grace, self.min_body_rate)
            body = await self._read_body(receive, abandoned)
            abandoned.body_done()
            if body is None:
                return CLIENT_CLOSED_REQUEST
            ear = loop.call_later(LISTEN_AFTER_SECONDS, abandoned.listen, loop, receive)
            pool = self.state.pool
            assert pool is not None
            answer = await pool.request(route, body, wants_binary(accept))
        except ServiceError as error:
            return await send_error(send, error)
        except asyncio.CancelledError:
            if abandoned.reason is None:  # the server is stopping (drain timeout): say so, not a reset
                logger.info("a /v1 request was cancelled: shutting down")
                return await send_error(send, shutting_down())
            if (uncancel := getattr(task, "uncancel", None)) is not None:  # Python 3.11+
                uncancel()
            self.metrics.cancelled_requests.labels(abandoned.reason).inc()
            if abandoned.reason == "timeout":
                timeout = RequestTimeout(f"the request took longer than the server's limit of {self.timeout:g}s")
                return await send_error(send, timeout)
            if abandoned.reason == "slow_body":
                slow = SlowBody(
                    f"the request body arrived slower than the server's minimum of {self.min_body_rate:g} bytes "
                    f"a second (after {self.body_grace:g}s): {abandoned.received} bytes received"
                )
                return await send_error(send, slow)
            return CLIENT_CLOSED_REQUEST
        finally:
            timer.cancel()
            abandoned.body_done()
            if ear is not None:
                ear.cancel()
            if abandoned.listener is not None:
                abandoned.listener.cancel()
            self.active -= 1
            if abandoned.received:
                self.admission.release(abandoned.received)
                if abandoned.received >= memory.TRIM_AFTER_BYTES:
                    self._trim = True
        self._record(answer)
        await self._send_answer(send, answer)
        return 200

    async def _read_body(self, receive: Receive, request: _Abandoned) -> list[bytes] | None:
        """The whole body as the chunks it arrived in (the worker's socket takes them as they are; more than
        MAX_BODY_PARTS are joined into one), or None if the client hung up.

        Each chunk is charged to the byte budget as it arrives, whatever the framing (503 when it
        would exceed it), and the body is refused (413) as soon as it passes the size limit.
        """
        chunks: list[bytes] = []
        limit = self.max_request_bytes
        admission = self.admission
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            if chunk:
                if request.received + len(chunk) > limit:
                    raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
                admission.admit(len(chunk), held=request.received)
                request.received += len(chunk)
                chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return chunks if len(chunks) <= MAX_BODY_PARTS else [b"".join(chunks)]

    def _record(self, answer: Answer) -> None:
        metrics = self.metrics
        texts, tokens, worker_seconds = self._per_model[answer.model]
        metrics.batch_size.observe(answer.texts)
        texts.inc(answer.texts)
        tokens.inc(answer.tokens)
        worker_seconds.inc(sum(work.seconds for work in answer.work))
        if not math.isnan(answer.padding):
            metrics.pack_padding_ratio.observe(answer.padding)

    async def _send_answer(self, send: Send, answer: Answer) -> None:
        headers = [
            (b"content-type", BINARY_TYPE if answer.binary else JSON_TYPE),
            (b"content-length", str(answer.size).encode()),
            (SHA256_HEADER, self._sha256[answer.model]),
        ]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        parts = answer.body
        if len(parts) > 1 and answer.size <= JOIN_ANSWER_BYTES:  # a split request's parts: one write, not several
            parts = [b"".join(parts)]
        last = len(parts) - 1
        for position, part in enumerate(parts):
            await send({"type": "http.response.body", "body": part, "more_body": position < last})


def asks_for_websocket(headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether a request is a WebSocket handshake (RFC 6455 section 4.1: a GET with `Upgrade: websocket` and
    `Connection: upgrade`); uvicorn runs with `ws="none"`, so it reaches the app as plain HTTP."""
    upgrade = connection = False
    for name, value in headers:
        if name == b"upgrade":
            upgrade = upgrade or any(token.strip().lower() == b"websocket" for token in value.split(b","))
        elif name == b"connection":
            connection = connection or any(token.strip().lower() == b"upgrade" for token in value.split(b","))
    return upgrade and connection


def no_websocket(path: str) -> bytes:
    """The answer to a WebSocket handshake: 400 (RFC 6455 section 4.2.2 refuses one with an HTTP error; 426 would
    ask the client to upgrade to what the server names, and it names nothing but the HTTP/1.1 it speaks)."""
    message = (
        f"this server does not speak WebSocket, on {path} or anywhere: send plain HTTP requests "
        "(POST /v1/tokenize, /v1/detokenize or /v1/pack with a JSON body; see /docs)"
    )
    return orjson.dumps({"error": {"type": "invalid_request", "message": message}})


def starting() -> Unavailable:
    return Unavailable("the server is starting; retry")


def shutting_down() -> Unavailable:
    return Unavailable("the server is shutting down; retry, another replica may answer")
