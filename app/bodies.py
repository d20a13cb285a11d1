"""Parsing request bodies (in the workers): orjson on the fast path, errors that say where."""

from __future__ import annotations

import json
from typing import Any, TypeVar

import orjson
from pydantic import BaseModel, ValidationError

from app.errors import InvalidField, InvalidJSON, PayloadTooLarge

Body = TypeVar("Body", bound=BaseModel)

JSON_MAX_DEPTH = 1024  # orjson's limit; the stdlib fallback never sees a deeper body


def parse_request(raw: bytes | bytearray | memoryview, model: type[Body], items: str, max_items: int) -> Body:
    """Parse and validate a body whose list field `items` (texts, id rows) is capped at `max_items`.

    Runs in a worker process; the server checked the byte limit. Every refusal says where: 413 over
    the item limit, 400 for bad JSON, 422 with the field and index (a lone surrogate in a text
    included, which SentencePiece cannot take).
    """
    document, lenient = parse_json(raw)
    check_item_count(document, items, max_items)
    body = validate(model, document)
    texts = getattr(body, "texts", None)
    if lenient and texts is not None and (found := find_lone_surrogate(texts)) is not None:
        index, position = found
        raise InvalidField(
            f"texts[{index}] has a lone surrogate at character {position}; text must be valid Unicode",
            field="texts",
            index=index,
        )
    return body


def check_item_count(document: object, field: str, limit: int) -> None:
    """413 before validation, so an oversized list costs no per-item work."""
    if isinstance(document, dict):
        items = document.get(field)
        if isinstance(items, list) and len(items) > limit:
            raise PayloadTooLarge(f"{len(items)} {field} in one request exceed the limit of {limit}", field=field)


def parse_json(raw: bytes | bytearray | memoryview) -> tuple[Any, bool]:
    """Parse with orjson; fall back to the stdlib only to explain what orjson refused.

    Returns the document and whether it came from the fallback (which, unlike orjson, lets lone
    surrogates through as str, so the caller must look for them). The body must be UTF-8: the
    stdlib would also take UTF-16 and UTF-32, which the API does not. JSON nested deeper than
    orjson's limit (1,024 levels) is refused as such, never parsed by a recursive fallback.
    """
    try:
        return orjson.loads(raw), False
    except orjson.JSONDecodeError as fast_error:
        if "depth limit" in str(fast_error):
            raise InvalidJSON(f"request body nests deeper than {JSON_MAX_DEPTH} levels") from None
        try:
            text = bytes(raw).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidJSON(f"request body is not valid UTF-8 (byte {exc.start})") from exc
        try:
            return json.loads(text), True
        except RecursionError:
            raise InvalidJSON(f"request body nests deeper than {JSON_MAX_DEPTH} levels") from None
        except ValueError:
            raise InvalidJSON(f"request body is not valid JSON: {fast_error}") from fast_error


def _field_path(location: tuple[int | str, ...]) -> tuple[str, int | None]:
    names = [str(part) for part in location if isinstance(part, str)]
    indices = [part for part in location if isinstance(part, int)]
    return ".".join(names), (indices[0] if indices else None)


def validate(model: type[Body], document: Any) -> Body:
    """Validate a parsed document, turning the first pydantic error into a 422 naming field and index."""
    if not isinstance(document, dict):
        raise InvalidField(f"request body must be a JSON object, not {type(document).__name__}")
    try:
        return model.model_validate(document)
    except ValidationError as exc:
        error = exc.errors(include_url=False)[0]
        field, index = _field_path(tuple(error["loc"]))
        message = error["msg"]
        if index is not None:
            message = f"{field}[{index}]: {message}"
        elif field:
            message = f"{field}: {message}"
        raise InvalidField(message, field=field or None, index=index) from None


def find_lone_surrogate(texts: list[str]) -> tuple[int, int] | None:
    """(text index, character index) of the first lone surrogate, which SentencePiece cannot take."""
    for index, text in enumerate(texts):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            return index, exc.start
    return None
