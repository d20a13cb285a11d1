"""Answers of the FastAPI routes (orjson), and which format a client asked for (`Accept`)."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.responses import Response

from tokenizer_client import wire

MODEL_SHA256_HEADER = "X-Tokenizer-Model-SHA256"
_BINARY = wire.MEDIA_TYPE.lower()
_JSON_RANGES = ("application/json", "application/*", "*/*")


def json_response(content: Any, headers: dict[str, str] | None = None, status_code: int = 200) -> Response:
    body = orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)
    return Response(body, status_code=status_code, headers=headers, media_type="application/json")


def _quality(parameters: list[str]) -> float:
    for parameter in parameters:
        name, _, value = parameter.partition("=")
        if name.strip().lower() == "q":
            try:
                return min(max(float(value.strip()), 0.0), 1.0)
            except ValueError:
                return 0.0
    return 1.0


def wants_binary(accept: bytes | str | None) -> bool:
    """True when `Accept` prefers the binary frame to JSON (RFC 9110 media ranges, q-values, any case).

    The binary type must be named exactly (no wildcard picks it) with q > 0, and no JSON range may
    carry a higher q; anything else is answered in JSON.
    """
    if not accept:
        return False
    text = accept.decode("latin-1") if isinstance(accept, bytes) else accept
    if _BINARY not in text.lower():
        return False
    binary = json = 0.0
    for entry in text.split(","):
        media, *parameters = entry.split(";")
        media = media.strip().lower()
        if media == _BINARY:
            binary = max(binary, _quality(parameters))
        elif media in _JSON_RANGES:
            json = max(json, _quality(parameters))
    return binary > 0 and binary >= json
