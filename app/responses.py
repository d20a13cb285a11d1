"""Answers in JSON (orjson, numpy arrays serialized natively) or in the binary wire format."""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson
from starlette.requests import Request
from starlette.responses import Response

from client import wire

MODEL_SHA256_HEADER = "X-Tokenizer-Model-SHA256"


def wants_binary(request: Request) -> bool:
    return wire.MEDIA_TYPE in request.headers.get("accept", "")


def json_response(content: Any, headers: dict[str, str] | None = None, status_code: int = 200) -> Response:
    body = orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)
    return Response(body, status_code=status_code, headers=headers, media_type="application/json")


def binary_response(arrays: dict[str, np.ndarray], meta: dict[str, Any], headers: dict[str, str]) -> Response:
    return Response(wire.encode(arrays, meta), headers=headers, media_type=wire.MEDIA_TYPE)
