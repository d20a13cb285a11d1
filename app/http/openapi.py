"""What the OpenAPI document says about answers: success bodies, every error status, auth.

Routes answer with plain `Response`s (orjson, or the binary frame), so FastAPI cannot infer their
bodies: these models exist for the schema only, and tests (schemathesis) hold the server to them.
"""

from __future__ import annotations

from typing import Any, Literal, get_type_hints

from fastapi import FastAPI
from pydantic import BaseModel, Field, create_model

from tokenizer_client.packing import PackStats
from tokenizer_client.wire import MEDIA_TYPE as BINARY_MEDIA_TYPE
from tokenizer_service.core.models import SERVER_ONLY, ModelInfo
from tokenizer_service.http.auth import OPEN_PATHS
from tokenizer_service.http.negotiation import MODEL_SHA256_HEADER


class ErrorDetail(BaseModel):
    type: str = Field(description="machine-readable kind, e.g. invalid_field, overloaded, timeout")
    message: str = Field(description="what went wrong, for people")
    field: str | None = Field(None, description="the request field at fault, when there is one")
    index: int | None = Field(None, description="the text (or id row) at fault, when there is one")


class ErrorBody(BaseModel):
    error: ErrorDetail


class TokenizeAnswer(BaseModel):
    model: str
    ids: list[list[int]]
    lengths: list[int]
    num_tokens: int


class DetokenizeAnswer(BaseModel):
    model: str
    texts: list[str]


class PackAnswer(BaseModel):
    model: str
    seq_len: int
    strategy: Literal["concat", "best_fit"]
    input_ids: list[list[int]]
    labels: list[list[int]]
    position_ids: list[list[int]]
    cu_seqlens: list[list[int]]
    leftover: list[int]
    leftover_document_starts: list[int]
    stats: PackStats


# /v1/models describes each model as ModelInfo.as_dict() does: ModelInfo's fields but its path.
ModelDescription = create_model(
    "ModelDescription",
    **{name: (kind, ...) for name, kind in get_type_hints(ModelInfo).items() if name not in SERVER_ONLY},  # type: ignore[call-overload]
)


class ModelsAnswer(BaseModel):
    default: str
    models: list[ModelDescription]


class HealthAnswer(BaseModel):
    status: str


class ReadinessAnswer(BaseModel):
    status: str
    models: list[str] | None = None
    error: ErrorDetail | None = Field(None, description="not ready: why (`unavailable`), as every error says it")


ERRORS: dict[int, str] = {
    400: "The body is not JSON, or not UTF-8 (`invalid_json`).",
    401: "API keys are configured and the request carries none of them (`unauthorized`).",
    404: "`model` is not served here (`model_not_found`).",
    413: "The body is over the byte limit, or holds more texts or id rows than the server takes (`payload_too_large`).",
    422: "A field is invalid (`invalid_field`), or a text crashed or hung a tokenizer worker twice "
    "(`poison_input`); `field` and `index` say which.",
    503: "Too much work is waiting (`overloaded`) or the workers are restarting (`unavailable`): "
    "retry after `Retry-After` seconds.",
    504: "The request took longer than the server's request timeout (`timeout`); its queued work was "
    "withdrawn. Safe to retry.",
}

_HEADERS: dict[int, dict[str, Any]] = {
    401: {"WWW-Authenticate": {"description": "`Bearer`", "required": True, "schema": {"type": "string"}}},
    503: {"Retry-After": {"description": "seconds to wait", "required": True, "schema": {"type": "string"}}},
}

_SHA256_HEADER = {
    MODEL_SHA256_HEADER: {
        "description": "sha256 of the model file that answered",
        "required": True,
        "schema": {"type": "string"},
    }
}

GUARDED_ERRORS = (401, 503, 504)
BODY_ERRORS = (400, 401, 404, 413, 422, 503, 504)


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    responses: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        response: dict[str, Any] = {"model": ErrorBody, "description": ERRORS[status]}
        if status in _HEADERS:
            response["headers"] = _HEADERS[status]
        responses[status] = response
    return responses


def answer(model: type[BaseModel], *, binary: bool = False, sha256: bool = True) -> dict[int | str, dict[str, Any]]:
    """The 200 response: a JSON body, and the binary frame too where the route offers it."""
    response: dict[str, Any] = {"model": model, "description": "OK"}
    if binary:
        response["description"] = f"JSON, or with `Accept: {BINARY_MEDIA_TYPE}` the binary frame (see docs/api.md)"
        response["content"] = {BINARY_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}}
    if sha256:
        response["headers"] = _SHA256_HEADER
    return {200: response}


# The list field of each /v1 body that --max-texts bounds.
_ITEMS = {"/v1/tokenize": "texts", "/v1/detokenize": "ids", "/v1/pack": "texts"}


def publish(app: FastAPI, *, bearer_auth: bool, max_texts: int | None = None, max_seq_len: int | None = None) -> None:
    """Finish the generated document: body schemas that routes carry in `x-components`, limits, and auth.

    Routes that parse their own body carry its schemas in `x-components`; they move to
    `components/schemas`. --max-seq-len becomes `seq_len`'s maximum, so the schema admits what the
    server takes. (--max-texts is not a `maxItems`: beyond it the answer is 413, not a 4xx for an
    invalid body.)
    With API keys configured, /v1 operations declare the bearer scheme.
    """
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = generate()
            components = schema.setdefault("components", {})
            schemas = components.setdefault("schemas", {})
            for path, operations in schema.get("paths", {}).items():
                for operation in operations.values():
                    schemas.update(operation.pop("x-components", {}))
                    _constrain(operation, max_seq_len)
                    if bearer_auth and path not in OPEN_PATHS:
                        operation["security"] = [{"bearer": []}]
            if bearer_auth:
                components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        return app.openapi_schema  # type: ignore[return-value]

    app.openapi = openapi  # type: ignore[method-assign]


def _constrain(operation: dict[str, Any], max_seq_len: int | None) -> None:
    body = operation.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema", {})
    properties = body.get("properties", {})
    if max_seq_len is not None and (seq_len := properties.get("seq_len")) is not None:
        seq_len["maximum"] = max_seq_len
