"""Error types and the handlers that turn them into `{"error": {...}}` JSON bodies."""

from __future__ import annotations

import logging
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

logger = logging.getLogger("tokenizer.errors")


class ServiceError(Exception):
    """An error with an HTTP status that the client caused or should know about."""

    status = 500
    type = "internal_error"

    def __init__(
        self,
        message: str,
        *,
        field: str | None = None,
        index: int | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        self.index = index
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        error: dict[str, Any] = {"type": self.type, "message": self.message}
        if self.field is not None:
            error["field"] = self.field
        if self.index is not None:
            error["index"] = self.index
        return {"error": error}


class InvalidJSON(ServiceError):
    status = 400
    type = "invalid_json"


class InvalidField(ServiceError):
    status = 422
    type = "invalid_field"


class ModelNotFound(ServiceError):
    status = 404
    type = "model_not_found"


class PayloadTooLarge(ServiceError):
    status = 413
    type = "payload_too_large"


class Unauthorized(ServiceError):
    """No API key, or one that is not configured; the body says which, never what the keys are."""

    status = 401
    type = "unauthorized"


class PoisonInput(ServiceError):
    """A text (or id row) that killed or stalled a tokenizer worker twice, the second time on its own."""

    status = 422
    type = "poison_input"


class Unavailable(ServiceError):
    status = 503
    type = "unavailable"


class Overloaded(ServiceError):
    """More work is waiting than the server accepts (`--max-queued-texts`, `--max-concurrent-requests`)."""

    status = 503
    type = "overloaded"


class RequestTimeout(ServiceError):
    """The request ran past `--request-timeout`; the work it had queued is withdrawn."""

    status = 504
    type = "timeout"


def error_response(status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(body), status_code=status, headers=headers, media_type="application/json")


async def send_error(error: ServiceError, scope: Scope, receive: Receive, send: Send) -> None:
    """Answer with `error` from plain ASGI middleware, which runs outside FastAPI's handlers."""
    await error_response(error.status, error.body(), error.headers)(scope, receive, send)


async def _service_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ServiceError)
    return error_response(exc.status, exc.body(), exc.headers)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    headers = dict(exc.headers) if exc.headers else None
    return error_response(exc.status_code, {"error": {"type": kind, "message": str(exc.detail)}}, headers)


async def _validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    body = {"error": {"type": InvalidField.type, "message": first.get("msg", "invalid"), "field": ".".join(location)}}
    return error_response(422, body)


async def _client_disconnect(request: Request, exc: Exception) -> Response:
    """The client hung up while sending its body: nobody will read an answer (nginx's 499)."""
    logger.info("client hung up during %s %s", request.method, request.url.path)
    return Response(status_code=499)


async def _unexpected_error(request: Request, exc: Exception) -> Response:
    logger.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(500, {"error": {"type": "internal_error", "message": "internal server error"}})


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ServiceError, _service_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(ClientDisconnect, _client_disconnect)
    app.add_exception_handler(Exception, _unexpected_error)
