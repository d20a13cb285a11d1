"""Every /v1 request: a bound on how many run at once, a deadline, and cancellation on hang-up.

Plain ASGI middleware. The request runs in a task of its own, so that when its deadline passes
(504) or its client disconnects, cancelling that task withdraws the chunks it still has waiting
for a worker. uvicorn does not cancel a handler whose client went away: it only answers
`http.disconnect` to the next `receive()`, which this middleware listens for once the body is read.
"""

from __future__ import annotations

import asyncio
import logging

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.admission import RETRY_AFTER_SECONDS
from app.auth import route_path
from app.errors import Overloaded, RequestTimeout, Unavailable, send_error
from app.metrics import Metrics

logger = logging.getLogger("tokenizer.guard")

GUARDED_PREFIX = "/v1/"


def shutting_down() -> Unavailable:
    return Unavailable(
        "the server is shutting down; retry, another replica may answer", headers={"Retry-After": RETRY_AFTER_SECONDS}
    )


class RequestGuard:
    def __init__(self, app: ASGIApp, *, max_concurrent: int, timeout: float, metrics: Metrics) -> None:
        self.app = app
        self.max_concurrent = max_concurrent
        self.timeout = timeout
        self.metrics = metrics
        self.active = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not route_path(scope).startswith(GUARDED_PREFIX):
            await self.app(scope, receive, send)
            return
        if self.active >= self.max_concurrent:
            self.metrics.rejected_requests.labels("concurrency").inc()
            error = Overloaded(
                f"{self.active} requests are in progress, the most this server takes at once; retry later",
                headers={"Retry-After": RETRY_AFTER_SECONDS},
            )
            await send_error(error, scope, receive, send)
            return
        self.active += 1
        try:
            await self._guarded(scope, receive, send)
        finally:
            self.active -= 1

    async def _guarded(self, scope: Scope, receive: Receive, send: Send) -> None:
        loop = asyncio.get_running_loop()
        hung_up: asyncio.Future[None] = loop.create_future()
        listener: asyncio.Task[None] | None = None
        response_started = False

        def note_hang_up(message: Message) -> None:
            if message["type"] == "http.disconnect" and not hung_up.done():
                hung_up.set_result(None)

        async def listen() -> None:
            note_hang_up(await receive())

        async def receive_body() -> Message:
            nonlocal listener
            message = await receive()
            note_hang_up(message)
            if message["type"] == "http.request" and not message.get("more_body", False) and listener is None:
                listener = asyncio.ensure_future(listen())
            return message

        async def send_response(message: Message) -> None:
            nonlocal response_started
            if message["type"] == "http.response.start":
                response_started = True
            await send(message)

        handler = asyncio.ensure_future(self.app(scope, receive_body, send_response))
        try:
            try:
                done, _ = await asyncio.wait(
                    {handler, hung_up}, timeout=self.timeout, return_when=asyncio.FIRST_COMPLETED
                )
            except asyncio.CancelledError:
                # uvicorn cancels what is still running when --drain-timeout runs out: say so, and end
                # quietly, so the client can retry elsewhere instead of finding its connection dropped.
                handler.cancel()
                if response_started:
                    raise
                logger.info("%s %s cancelled: shutting down", scope["method"], scope["path"])
                await send_error(shutting_down(), scope, receive, send)
                return
            if handler in done:
                handler.result()  # the handler's own exception, if any, goes on to the error middleware
                return
            # Timed out, or the client hung up: withdraw what the request still has queued.
            reason = "disconnect" if hung_up.done() else "timeout"
            if response_started:  # too late to answer differently: let it finish
                await handler
                return
            handler.cancel()
            await asyncio.wait({handler})
            if not handler.cancelled() and handler.exception() is not None:
                logger.warning("a cancelled request failed on its way out: %r", handler.exception())
            self.metrics.cancelled_requests.labels(reason).inc()
            logger.info("%s %s cancelled: %s", scope["method"], scope["path"], reason)
            if reason == "timeout":
                error = RequestTimeout(f"the request took longer than the server's limit of {self.timeout:g}s")
                await send_error(error, scope, receive, send)
        finally:
            if listener is not None:
                listener.cancel()
            if not handler.done():  # this task itself was cancelled (shutdown past its drain timeout)
                handler.cancel()
            if not hung_up.done():
                hung_up.cancel()
