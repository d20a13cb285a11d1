"""POST /v1/tokenize and /v1/detokenize: parse, hand to the pool, encode the answer."""

from __future__ import annotations

import numpy as np
from fastapi import APIRouter, Request
from starlette.responses import Response

from app.bodies import read_request
from app.errors import InvalidField
from app.openapi import BODY_ERRORS, DetokenizeAnswer, TokenizeAnswer, answer, error_responses
from app.responses import MODEL_SHA256_HEADER, binary_response, json_response, wants_binary
from app.schemas import DetokenizeRequest, TokenizeRequest, openapi_body
from app.state import ServiceDep
from app.worker import EncodeOptions
from client.wire import ragged_offsets

router = APIRouter(prefix="/v1", tags=["tokenize"])


@router.post(
    "/tokenize",
    openapi_extra=openapi_body(TokenizeRequest),
    responses={**answer(TokenizeAnswer, binary=True), **error_responses(*BODY_ERRORS)},
)
async def tokenize(request: Request, service: ServiceDep) -> Response:
    settings = service.settings
    body = await read_request(request, TokenizeRequest, "texts", settings.max_request_bytes, settings.max_texts)
    info = service.model(body.model)
    sample = body.sample
    options = EncodeOptions(
        add_bos=body.add_bos,
        add_eos=body.add_eos,
        max_length=body.max_length,
        sample_alpha=None if sample is None else float(sample.alpha),
        sample_nbest_size=-1 if sample is None else sample.nbest_size,
        sample_seed=None if sample is None else sample.seed,
    )
    service.metrics.batch_size.observe(len(body.texts))
    batch = await service.pool.encode(info.name, body.texts, options)
    num_tokens = int(batch.offsets[-1])
    service.metrics.texts.labels(info.name).inc(len(body.texts))
    service.metrics.tokens.labels(info.name).inc(num_tokens)
    headers = {MODEL_SHA256_HEADER: info.sha256}
    if wants_binary(request):
        meta = {"model": info.name, "num_tokens": num_tokens}
        return binary_response({"ids": batch.ids, "offsets": batch.offsets}, meta, headers)
    content = {"model": info.name, "ids": batch.rows(), "lengths": batch.lengths, "num_tokens": num_tokens}
    return json_response(content, headers)


def flatten_ids(rows: list[list[int]], vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Ragged int32 ids from JSON rows, refusing (422, with the row) any id outside the vocabulary."""
    arrays = []
    for index, row in enumerate(rows):
        try:
            array = np.asarray(row, dtype=np.int64)
        except OverflowError:
            array = None
        if array is None or (len(array) and (array.min() < 0 or array.max() >= vocab_size)):
            bad = next(i for i in row if not 0 <= i < vocab_size)
            raise InvalidField(
                f"ids[{index}] holds {bad}, outside the vocabulary [0, {vocab_size})", field="ids", index=index
            )
        arrays.append(array)
    lengths = np.fromiter((len(array) for array in arrays), dtype=np.int64, count=len(arrays))
    flat = np.concatenate(arrays).astype(np.int32) if arrays else np.zeros(0, dtype=np.int32)
    return flat, ragged_offsets(lengths)


@router.post(
    "/detokenize",
    openapi_extra=openapi_body(DetokenizeRequest),
    responses={**answer(DetokenizeAnswer), **error_responses(*BODY_ERRORS)},
)
async def detokenize(request: Request, service: ServiceDep) -> Response:
    settings = service.settings
    body = await read_request(request, DetokenizeRequest, "ids", settings.max_request_bytes, settings.max_texts)
    info = service.model(body.model)
    ids, offsets = flatten_ids(body.ids, info.vocab_size)
    service.metrics.batch_size.observe(len(body.ids))
    texts = await service.pool.decode(info.name, ids, offsets)
    service.metrics.texts.labels(info.name).inc(len(texts))
    service.metrics.tokens.labels(info.name).inc(len(ids))
    return json_response({"model": info.name, "texts": texts}, {MODEL_SHA256_HEADER: info.sha256})
