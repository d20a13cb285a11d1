"""POST /v1/tokenize, /v1/detokenize and /v1/pack, as the OpenAPI document describes them.

These three are served by tokenizer_service.http.edge, which answers them before FastAPI's router sees them: the
declarations here give the API description its operations, body schemas and answers, and give
other methods on these paths FastAPI's usual 405.
"""

from __future__ import annotations

from fastapi import APIRouter
from starlette.responses import Response

from tokenizer_service.core.requests import DetokenizeRequest, PackRequest, TokenizeRequest, openapi_body
from tokenizer_service.http.openapi import (
    BODY_ERRORS,
    DetokenizeAnswer,
    PackAnswer,
    TokenizeAnswer,
    answer,
    error_responses,
)

router = APIRouter(prefix="/v1", tags=["tokenize"])


def _served_by_the_edge() -> Response:
    raise RuntimeError("POST /v1/tokenize, /v1/detokenize and /v1/pack are answered by tokenizer_service.http.edge")


@router.post(
    "/tokenize",
    openapi_extra=openapi_body(TokenizeRequest),
    responses={**answer(TokenizeAnswer, binary=True), **error_responses(*BODY_ERRORS)},
)
async def tokenize() -> Response:
    """Tokenize texts: ids exactly as in-process sentencepiece gives them, in JSON or the binary frame."""
    return _served_by_the_edge()


@router.post(
    "/detokenize",
    openapi_extra=openapi_body(DetokenizeRequest),
    responses={**answer(DetokenizeAnswer), **error_responses(*BODY_ERRORS)},
)
async def detokenize() -> Response:
    """Turn rows of ids back into texts."""
    return _served_by_the_edge()


@router.post(
    "/pack",
    tags=["pack"],
    openapi_extra=openapi_body(PackRequest),
    responses={**answer(PackAnswer, binary=True), **error_responses(*BODY_ERRORS)},
)
async def pack() -> Response:
    """Tokenize texts and pack them into fixed-length rows (concat with carry, or best fit)."""
    return _served_by_the_edge()
