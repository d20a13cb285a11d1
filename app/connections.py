"""uvicorn's httptools protocol with the limits a server facing hostile connections needs.

uvicorn (0.3x) bounds neither the size of request headers nor the time a client takes to send
them, and accepts connections until the process runs out of file descriptors. Measured against
the server before this: a 64 MiB header was answered 200 after stalling the event loop for
seconds (httptools grows its buffers quadratically), and 1,100 connections trickling a byte a
second made every legitimate request fail with a reset. This subclass, passed to uvicorn as its
`http` protocol class, adds:

- a cap on the bytes of a request's head (request line and headers): 431 and close beyond it,
  before the parser sees the excess;
- a deadline for the head, from the connection's first byte (or the previous response) until
  the headers are complete: 408 and close past it (uvicorn's keep-alive timeout only covers idle
  connections between requests, and stops as soon as one byte arrives);
- a cap on open connections: the one beyond it gets 503 with `Retry-After` and is closed at once,
  so its file descriptor is free again, and the process raises its soft descriptor limit to the
  hard one at start (`raise_file_limit`).

It uses uvicorn's protocol callbacks (`on_message_begin`, `on_headers_complete`,
`on_response_complete`); tests/test_connections.py holds every limit to its behaviour, so an
uvicorn upgrade that changes them fails there, not in production.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from app.settings import Settings

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
    body = ('{"error":{"type":"%s","message":"%s"}}' % (reason, message)).encode()  # noqa: UP031
    return (
        f"HTTP/1.1 {status} {_REASONS[status]}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n".encode()
        + extra
        + b"\r\n"
        + body
    )


_REASONS = {408: "Request Timeout", 431: "Request Header Fields Too Large", 503: "Service Unavailable"}


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


class GuardedProtocol(HttpToolsProtocol):
    """HttpToolsProtocol with a head size cap, a head deadline and a connection cap (see the module)."""

    max_head_bytes = 64 * 1024
    head_timeout = 10.0
    max_connections = 4096

    @classmethod
    def configure(cls, *, max_head_bytes: int, head_timeout: float, max_connections: int) -> type[GuardedProtocol]:
        """A subclass with these limits (uvicorn takes a class, and instantiates it per connection)."""
        limits = {"max_head_bytes": max_head_bytes, "head_timeout": head_timeout, "max_connections": max_connections}
        return type("GuardedProtocol", (cls,), limits)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True
        self._head_bytes = 0
        self._tail = b""
        self._head_timer: asyncio.TimerHandle | None = None
        self._refused = False

    # -- connection ----------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.max_connections:
            self._refused = True
            _refusals.note(len(self.connections))
            transport.write(_answer(503, "overloaded", "too many open connections; retry later", b"retry-after: 1\r\n"))
            transport.close()
            return
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._refused:
            return
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
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
                    self._close_with(431, "headers_too_large", f"request headers exceed {self.max_head_bytes} bytes")
                    return
            self._tail = data[-(len(HEAD_END) - 1) :]
        super().data_received(data)

    # -- uvicorn's parser callbacks -----------------------------------------------------------------

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._disarm()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # The next request's head starts now; its deadline starts with its first byte (uvicorn's
        # keep-alive timeout covers the wait for it).
        self._in_head = True
        self._head_bytes = 0
        self._tail = b""

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
        if self._in_head and self.transport is not None and not self.transport.is_closing():
            self._close_with(408, "timeout", f"request headers not received within {self.head_timeout:g} seconds")

    def _close_with(self, status: int, kind: str, message: str) -> None:
        self._disarm()
        self._in_head = False
        self.transport.write(_answer(status, kind, message))
        self.transport.close()


DEFAULT_MAX_CONNECTIONS = 4096
RESERVED_FILES = 256  # for workers' sockets, model files, logs


def uvicorn_options(settings: Settings) -> dict[str, Any]:
    """What uvicorn runs with, for one server or each front-end: limits on connections included."""
    files = raise_file_limit()
    max_connections = settings.max_connections or max(16, min(DEFAULT_MAX_CONNECTIONS, files - RESERVED_FILES))
    return {
        "log_level": settings.log_level,
        "access_log": False,
        # SIGTERM: stop accepting, let in-flight requests finish for this long, then cancel them;
        # the lifespan then stops every worker process.
        "timeout_graceful_shutdown": settings.drain_timeout,
        "http": GuardedProtocol.configure(
            max_head_bytes=settings.max_header_bytes,
            head_timeout=settings.header_timeout,
            max_connections=max_connections,
        ),
    }
