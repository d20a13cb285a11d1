"""What can go wrong, in the service's own terms: no HTTP here (tokenizer_service.http.status maps these to statuses).

Each error has a machine-readable `type`, a message for people, and where known the request
field and the index of the text (or id row) at fault. Worker processes send them to the server
as `as_dict()` and the server rebuilds them with `from_dict()`, by `type`: every subclass is registered
under its `type` as it is defined; one that shares its parent's `type` (SlowBody, a RequestTimeout
the edge alone raises) comes back as that parent.
"""

from __future__ import annotations

from typing import Any

_KINDS: dict[str, type[ServiceError]] = {}


class ServiceError(Exception):
    """An error the client caused or should know about."""

    type = "internal_error"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _KINDS.setdefault(cls.type, cls)

    def __init__(self, message: str, *, field: str | None = None, index: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        self.index = index

    def as_dict(self) -> dict[str, Any]:
        error: dict[str, Any] = {"type": self.type, "message": self.message}
        if self.field is not None:
            error["field"] = self.field
        if self.index is not None:
            error["index"] = self.index
        return error

    @staticmethod
    def from_dict(error: dict[str, Any]) -> ServiceError:
        kind = _KINDS.get(error.get("type", ""), ServiceError)
        return kind(error.get("message", ""), field=error.get("field"), index=error.get("index"))


class InvalidJSON(ServiceError):
    """The body is not JSON, or not UTF-8."""

    type = "invalid_json"


class InvalidField(ServiceError):
    type = "invalid_field"


class ModelNotFound(ServiceError):
    type = "model_not_found"


class PayloadTooLarge(ServiceError):
    type = "payload_too_large"


class UnsupportedEncoding(ServiceError):
    """A compressed request body (Content-Encoding): the service reads bodies as they are sent."""

    type = "unsupported_encoding"


class Unauthorized(ServiceError):
    """No API key, or one that is not configured; the body says which, never what the keys are."""

    type = "unauthorized"

    def __init__(
        self, message: str, *, field: str | None = None, index: int | None = None, invalid_token: bool = False
    ) -> None:
        super().__init__(message, field=field, index=index)
        self.invalid_token = invalid_token


class PoisonInput(ServiceError):
    """A text (or id row) that killed or stalled a tokenizer worker twice, the second time on its own."""

    type = "poison_input"


class Unavailable(ServiceError):
    """The workers are restarting, or the server is shutting down: retry soon, maybe elsewhere."""

    type = "unavailable"


class Overloaded(ServiceError):
    """More work is waiting than the server accepts (`--max-queued-bytes`, `--max-concurrent-requests`)."""

    type = "overloaded"


class RequestTimeout(ServiceError):
    """The request ran past `--request-timeout`; the work it had queued is withdrawn."""

    type = "timeout"


class SlowBody(RequestTimeout):
    """A request body that arrived slower than `--min-body-rate`: cut, and its bytes released."""

    type = "timeout"
