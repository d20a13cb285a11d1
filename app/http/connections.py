"""uvicorn's httptools protocol with the limits a server facing hostile connections needs.

uvicorn (0.3x) bounds neither the size of request headers nor the time a client takes to send
them, and accepts connections until the process runs out of file descriptors. Measured against
the server before this: a 64 MiB header was answered 200 after stalling the event loop for
seconds (httptools grows its buffers quadratically), and 1,100 connections trickling a byte a
second made every legitimate request fail with a reset. This subclass, passed to uvicorn as its
`http` protocol class, adds:

- a cap on the bytes of a request's head (request line and headers): 431 and close beyond it,
  before the parser sees the excess. Only bytes the parser reads as a head count: a body (also one
  left unread by a refused request, also one of a pipelined request) never does;
- a deadline for the head, from its first byte until the headers are complete: 408 and close past
  it (uvicorn's keep-alive timeout only covers idle connections between requests, and stops as soon
  as one byte arrives);
- a cap on open connections: the one beyond it gets 503 with `Retry-After` and is closed at once,
  so its file descriptor is free again, and the process raises its soft descriptor limit to the
  hard one at start (`raise_file_limit`);
- one answer per request, whatever the request left unread: a request answered before its body
  has arrived (refused: 503, 413, 401, 408) is answered with `Connection: close`, and the connection
  then closes *lingering* (RFC 9112 section 9.6): the server half-closes, reads and discards what the
  client still sends for at most `linger_seconds` and `linger_bytes`, then closes. The client reads
  its answer instead of a reset, and the rest of the body is never parsed as a next request;
- malformed HTTP (Content-Length with chunked, a bad or duplicate length, a bad chunk, an unknown
  method, ...) answered with the service's JSON error body (400 `invalid_request`), never a second
  answer after one already being written on the same connection;
- an upgrade the server does not speak (`Upgrade: h2c` from `curl --http2`; `Upgrade: websocket`, uvicorn runs
  with `ws="none"`) ignored: the request is served over HTTP/1.1 with its body, as RFC 9110 section 7.8 allows
  (the edge answers a WebSocket handshake, a GET, with a JSON 400).

It uses uvicorn's protocol callbacks (`on_message_begin`, `on_headers_complete`, `on_body`,
`on_message_complete`, `on_response_complete`) and its RequestResponseCycle (`more_body`, `body`,
`message_event`, `response_started`, `keep_alive`, `transport`); tests/test_connections.py and
tests/test_hardening_http.py hold every limit to its behaviour, so an uvicorn upgrade that changes
them fails there, not in production.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from typing import Any

import httptools
import orjson
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from tokenizer_service.metrics import CONNECTION_ENDPOINT, Metrics
from tokenizer_service.settings import Settings

logger = logging.getLogger("tokenizer.connections")

HEAD_END = b"\r\n\r\n"


def raise_file_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit; return the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


def _answer(status: int, reason: str, message: str, extra: bytes = b"") -> bytes:
    body = orjson.dumps({"error": {"type": reason, "message": message}})
    return (
        f"HTTP/1.1 {status} {_REASONS[status]}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n".encode()
        + extra
        + b"\r\n"
        + body
    )


_REASONS = {
    400: "Bad Request",
    408: "Request Timeout",
    431: "Request Header Fields Too Large",
    503: "Service Unavailable",
}


class _Refusals:
    """Counts refused connections and says so at most every LOG_EVERY seconds (an attack must not flood the log)."""

    LOG_EVERY = 10.0

    def __init__(self) -> None:
        self.count = 0
        self.logged_at = float("-inf")

    def note(self, open_connections: int) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self.logged_at >= self.LOG_EVERY:
            logger.warning(
                "%d connections open, the most this server takes: refused %d since the last report",
                open_connections,
                self.count,
            )
            self.count, self.logged_at = 0, now


_refusals = _Refusals()


class _GuardedCycle(RequestResponseCycle):
    """uvicorn's request/response cycle, but an answer started before the body is whole closes the connection.

    Without this, uvicorn keeps the connection alive and goes on parsing the unread body, which a
    client that is still sending it then sees answered as if it were a next request.
    """

    async def send(self, message: Any) -> None:
        if not self.response_started and self.more_body and message.get("type") == "http.response.start":
            self.keep_alive = False  # uvicorn adds `connection: close` and closes (lingering) after the answer
        await super().send(message)


class _AnswerTransport:
    """What a cycle writes its answer to: the connection's transport, but closing it lingers."""

    __slots__ = ("_protocol", "_transport")

    def __init__(self, protocol: GuardedProtocol, transport: asyncio.Transport) -> None:
        self._protocol = protocol
        self._transport = transport

    def write(self, data: bytes) -> None:
        self._transport.write(data)

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def close(self) -> None:
        self._protocol.close_lingering()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class GuardedProtocol(HttpToolsProtocol):
    """HttpToolsProtocol with head, connection and linger limits, JSON 400s, upgrades ignored (see the module)."""

    max_head_bytes = 64 * 1024
    head_timeout = 10.0
    max_connections = 4096
    linger_seconds = 5.0
    linger_bytes = 64 * 1024 * 1024
    metrics: Metrics | None = None  # where what this protocol answers itself is counted (endpoint "connection")

    @classmethod
    def configure(
        cls,
        *,
        max_head_bytes: int,
        head_timeout: float,
        max_connections: int,
        linger_seconds: float | None = None,
        linger_bytes: int | None = None,
        metrics: Metrics | None = None,
    ) -> type[GuardedProtocol]:
        """A subclass with these limits (uvicorn takes a class, and instantiates it per connection), counting what it
        answers itself in `metrics` (the app's)."""
        limits: dict[str, Any] = {
            "max_head_bytes": max_head_bytes,
            "head_timeout": head_timeout,
            "max_connections": max_connections,
            "metrics": metrics,
        }
        if linger_seconds is not None:
            limits["linger_seconds"] = linger_seconds
        if linger_bytes is not None:
            limits["linger_bytes"] = linger_bytes
        return type("GuardedProtocol", (cls,), limits)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True  # the parser is between messages or inside a head: what arrives is head
        self._message_done = True  # the parser has read the whole of the last message (its body too)
        self._head_bytes = 0
        self._tail = b""
        self._head_timer: asyncio.TimerHandle | None = None
        self._refused = False
        self._failed = False  # a parse error or a head limit: nothing more of this connection is parsed
        self._deferred: bytes | None = None  # an error answer waiting for an earlier answer to finish
        self._lingering = False
        self._lingered = 0
        self._linger_timer: asyncio.TimerHandle | None = None
        self._linger_limits = (self.linger_seconds, self.linger_bytes)
        self._synthetic = False  # feeding the parser a head of our own (after an ignored upgrade)

    # -- connection ----------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.max_connections:
            self._refused = True
            _refusals.note(len(self.connections))
            if self.metrics is not None:
                self.metrics.rejected_requests.labels("connections").inc()
            refusal = self._answer(503, "overloaded", "too many open connections; retry later", b"retry-after: 1\r\n")
            transport.write(refusal)
            transport.close()
            return
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._refused:
            return
        self._disarm()
        if self._linger_timer is not None:
            self._linger_timer.cancel()
            self._linger_timer = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._lingering or self._failed:
            self._discard(len(data))
            return
        if self._in_head:
            if self._head_timer is None:
                self._arm()
            before = self._head_bytes
            self._head_bytes += len(data)
            if self._head_bytes > self.max_head_bytes:
                # Over the cap, unless the head ends within it (the rest of `data` is body).
                window = self._tail + data
                end = window.find(HEAD_END)
                if end < 0 or before - len(self._tail) + end + len(HEAD_END) > self.max_head_bytes:
                    self._fail(431, "headers_too_large", f"request headers exceed {self.max_head_bytes} bytes")
                    return
            self._tail = data[-(len(HEAD_END) - 1) :]
        self._feed(data)

    def _feed(self, data: bytes) -> None:
        """uvicorn's data_received, with errors answered in JSON and upgrades it cannot serve ignored."""
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(400, "invalid_request", f"malformed HTTP request: {_parser_message(exc)}")
        except httptools.HttpParserUpgrade as exc:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._ignore_upgrade(data[int(exc.args[0]) if exc.args else len(data) :])

    def _ignore_upgrade(self, rest: bytes) -> None:
        """Serve a request that offered an upgrade (h2c) over HTTP/1.1: its body is what follows its head.

        httptools stops at the head of such a request and calls it complete; a fresh parser is told
        the request's framing by a head of our own (not seen by uvicorn) and reads the body from there.
        """
        cycle = self.cycle
        framing = [(name, value) for name, value in self.headers if name in (b"content-length", b"transfer-encoding")]
        self.parser = httptools.HttpRequestParser(self)
        self.parser.set_dangerous_leniencies(lenient_data_after_close=True)  # as uvicorn does
        has_body = any(name == b"transfer-encoding" or value.strip() not in (b"", b"0") for name, value in framing)
        if cycle is not None and cycle.scope is self.scope and has_body and not cycle.response_started:
            cycle.more_body = True
            self._message_done = False
            self._in_head = False
            head = b"POST / HTTP/1.1\r\n" + b"".join(name + b": " + value + b"\r\n" for name, value in framing)
            self._synthetic = True
            try:
                self.parser.feed_data(head + b"\r\n")
            finally:
                self._synthetic = False
        if rest:
            self.data_received(rest)

    # -- uvicorn's parser callbacks -----------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self._synthetic:
            return
        self._message_done = False
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        if not self._synthetic:
            super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._synthetic:
            super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._disarm()
        if self._synthetic:
            return
        previous = self.cycle
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and cycle is not previous and type(cycle) is RequestResponseCycle:
            cycle.__class__ = _GuardedCycle
            cycle.transport = _AnswerTransport(self, self.transport)  # type: ignore[assignment]

    def on_body(self, body: bytes) -> None:
        """uvicorn's, less two copies of each body: a chunk waits as the bytes the parser made, which the cycle's
        `receive` hands on as they are (uvicorn's appends it to a bytearray, then copies that into new bytes when
        the app reads it: a 700 KB body cost 0.1 ms more of the server process). Chunks that pile up before the app
        reads are still appended, and reading pauses past uvicorn's high-water mark, as there."""
        cycle = self.cycle
        if (self.parser.should_upgrade() and self._should_upgrade()) or cycle.response_complete:
            return
        waiting = cycle.body
        if not waiting:
            cycle.body = body  # type: ignore[assignment]  # bytes(body) in receive() is body itself: no copy
        else:
            if type(waiting) is not bytearray:
                waiting = cycle.body = bytearray(waiting)
            waiting += body
        if len(cycle.body) > HIGH_WATER_LIMIT:
            self.flow.pause_reading()
        cycle.message_event.set()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        # What follows is the next request's head (pipelined, or after this one is answered); its
        # deadline starts with its first byte (uvicorn's keep-alive timeout covers the wait for it).
        self._message_done = True
        self._in_head = True
        self._head_bytes = 0
        self._tail = b""

    def on_response_complete(self) -> None:
        if self._lingering:  # that answer said `connection: close`: nothing more is read or started
            self.server_state.total_requests += 1
            return
        if self._deferred is not None and not self.pipeline:
            self.server_state.total_requests += 1
            answer, self._deferred = self._deferred, None
            self.transport.write(answer)
            self.close_lingering()
            return
        super().on_response_complete()
        if self._in_head and self._head_bytes and self._head_timer is None:
            self._arm()  # a pipelined head begun while the answer was written: its deadline starts now

    # -- refusing a connection's request -------------------------------------------------------

    def _answer_pending(self) -> bool:
        """Whether an answer is still owed on this connection to a request whose message was read whole."""
        if self.pipeline:
            return True
        cycle = self.cycle
        return cycle is not None and self._message_done and not cycle.response_complete

    def _fail(self, status: int, kind: str, message: str) -> None:
        """Answer the message being parsed with an error and close; after any answer owed before it.

        A head over its limits (431, 408) lingers briefly and for few bytes: its sender is the kind
        of client the limits are for."""
        if status in (408, 431):
            self._linger_limits = (min(self.linger_seconds, 1.0), self.max_head_bytes)
        self._disarm()
        self._in_head = False
        self._failed = True
        cycle = self.cycle
        if cycle is not None and not self._message_done:  # the body of a request already handed to the app
            if cycle.response_started:  # it is answering already: that is its one answer, then close
                cycle.keep_alive = False
                return
            was_queued = any(queued is cycle for queued, _ in self.pipeline)
            if was_queued:
                self.pipeline = type(self.pipeline)(item for item in self.pipeline if item[0] is not cycle)
            cycle.disconnected = True  # its app stops reading, and anything it sends is dropped
            cycle.message_event.set()
            if was_queued or self.pipeline:
                self._deferred = self._answer(status, kind, message)
                return
        elif self._answer_pending():
            self._deferred = self._answer(status, kind, message)
            self.flow.pause_reading()
            return
        self.transport.write(self._answer(status, kind, message))
        self.close_lingering()

    def _answer(self, status: int, kind: str, message: str, headers: bytes = b"") -> bytes:
        """An answer this protocol writes itself, counted in tokenizer_requests_total (endpoint "connection")."""
        if self.metrics is not None:
            self.metrics.requests.labels(CONNECTION_ENDPOINT, str(status)).inc()
        return _answer(status, kind, message, headers)

    def send_400_response(self, msg: str) -> None:  # uvicorn's own 400, in the service's JSON
        self._fail(400, "invalid_request", msg)

    # -- lingering close (RFC 9112 section 9.6) ------------------------------------------------------

    def close_lingering(self) -> None:
        """Half-close, then read and drop what the client still sends (bounded), then close."""
        transport = self.transport
        if self._lingering or transport is None or transport.is_closing():
            return
        self._lingering = True
        self._disarm()
        self._unset_keepalive_if_required()
        if not transport.can_write_eof():
            transport.close()
            return
        transport.write_eof()  # after what is buffered: the client reads its answer, then end of stream
        self.flow.resume_reading()
        self._linger_timer = self.loop.call_later(self._linger_limits[0], self._end_linger)

    def _discard(self, size: int) -> None:
        self._lingered += size
        if self._lingered > self._linger_limits[1] and not self.transport.is_closing():
            self.transport.close()

    def _end_linger(self) -> None:
        self._linger_timer = None
        if not self.transport.is_closing():
            self.transport.close()

    # -- the head deadline ----------------------------------------------------------------------------

    def _arm(self) -> None:
        self._disarm()
        self._head_timer = self.loop.call_later(self.head_timeout, self._head_timed_out)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self._in_head or self.transport is None or self.transport.is_closing() or self._lingering:
            return
        if self._answer_pending():  # the client waits for an earlier answer: its next head's clock restarts after
            return
        self._fail(408, "timeout", f"request headers not received within {self.head_timeout:g} seconds")


def _parser_message(error: Exception) -> str:
    """httptools' reason, e.g. 'Content-Length can't be present with Transfer-Encoding'."""
    text = str(error).strip() or type(error).__name__
    return text.rstrip(".")


DEFAULT_MAX_CONNECTIONS = 4096
RESERVED_FILES = 256  # for workers' sockets, model files, logs


def uvicorn_options(settings: Settings, metrics: Metrics | None = None) -> dict[str, Any]:
    """What uvicorn runs with, for one server or each front-end: limits on connections included, what they refuse
    counted in `metrics` (the app's: `create_app(..., metrics=)`)."""
    files = raise_file_limit()
    max_connections = settings.max_connections or max(16, min(DEFAULT_MAX_CONNECTIONS, files - RESERVED_FILES))
    return {
        "log_level": settings.log_level,
        "access_log": False,
        # SIGTERM: stop accepting, let in-flight requests finish for this long, then cancel them;
        # the lifespan then stops every worker process.
        "timeout_graceful_shutdown": settings.drain_timeout,
        # The service speaks no WebSocket. With uvicorn's default ("auto": `websockets` when installed) a request
        # with `Upgrade: websocket` went to uvicorn's WebSocket protocol, which answers a bare 403 without the app
        # having said a word (and a POST offering that upgrade hung). With none, it stays HTTP on this protocol and
        # its limits: the edge answers a WebSocket handshake with the service's JSON 400.
        "ws": "none",
        "http": GuardedProtocol.configure(
            max_head_bytes=settings.max_header_bytes,
            head_timeout=settings.header_timeout,
            max_connections=max_connections,
            metrics=metrics,
        ),
    }
