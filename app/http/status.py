"""The HTTP edge's one mapping from service errors to statuses, headers and JSON bodies.

Everything that answers an error (the hot path in tokenizer_service.http.edge, FastAPI's handlers for the other
routes) goes through `error_status` and `error_headers`: one place for `Retry-After`.
"""

from __future__ import annotations

import logging

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.types import Send

from tokenizer_service.core.errors import (
    InvalidField,
    InvalidJSON,
    ModelNotFound,
    Overloaded,
    PayloadTooLarge,
    PoisonInput,
    RequestTimeout,
    ServiceError,
    SlowBody,
    Unauthorized,
    Unavailable,
    UnsupportedEncoding,
)

logger = logging.getLogger("tokenizer.errors")

RETRY_AFTER_SECONDS = "1"
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that hung up before its answer

STATUS: dict[type[ServiceError], int] = {
    InvalidJSON: 400,
    Unauthorized: 401,
    ModelNotFound: 404,
    SlowBody: 408,
    PayloadTooLarge: 413,
    UnsupportedEncoding: 415,
    InvalidField: 422,
    PoisonInput: 422,
    Unavailable: 503,
    Overloaded: 503,
    RequestTimeout: 504,
}

INTERNAL_ERROR = {"error": {"type": "internal_error", "message": "internal server error"}}


def error_status(error: ServiceError) -> int:
    """The status of the nearest class in the error's MRO that has one (a subclass keeps its parent's)."""
    for kind in type(error).__mro__:
        status = STATUS.get(kind)
        if status is not None:
            return status
    return 500


def error_headers(error: ServiceError) -> dict[str, str]:
    if isinstance(error, (Overloaded, Unavailable)):
        return {"Retry-After": RETRY_AFTER_SECONDS}
    if isinstance(error, Unauthorized):
        return {"WWW-Authenticate": 'Bearer error="invalid_token"' if error.invalid_token else "Bearer"}
    return {}


def error_body(error: ServiceError) -> bytes:
    if error_status(error) == 500:
        return orjson.dumps(INTERNAL_ERROR)
    return orjson.dumps({"error": error.as_dict()})


async def send_json(send: Send, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
    """A whole JSON answer as two ASGI messages."""
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw.extend((name.lower().encode(), value.encode()) for name, value in (headers or {}).items())
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


async def send_error(send: Send, error: ServiceError) -> int:
    """Answer `error` from plain ASGI code; returns the status sent."""
    status = error_status(error)
    await send_json(send, status, error_body(error), error_headers(error))
    return status


def json_response(status: int, body: bytes, headers: dict[str, str] | None = None) -> Response:
    return Response(body, status_code=status, headers=headers, media_type="application/json")


async def _service_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ServiceError)
    return json_response(error_status(exc), error_body(exc), error_headers(exc))


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    headers = dict(exc.headers) if exc.headers else None
    body = orjson.dumps({"error": {"type": kind, "message": str(exc.detail)}})
    return json_response(exc.status_code, body, headers)


async def _validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    body = {"error": {"type": InvalidField.type, "message": first.get("msg", "invalid"), "field": ".".join(location)}}
    return json_response(422, orjson.dumps(body))


async def _client_disconnect(request: Request, exc: Exception) -> Response:
    logger.info("client hung up during %s %s", request.method, request.url.path)
    return Response(status_code=CLIENT_CLOSED_REQUEST)


async def _unexpected_error(request: Request, exc: Exception) -> Response:
    logger.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return json_response(500, orjson.dumps(INTERNAL_ERROR))


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ServiceError, _service_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(ClientDisconnect, _client_disconnect)
    app.add_exception_handler(Exception, _unexpected_error)
