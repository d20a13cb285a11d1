"""POST /v1/pack: tokenize on the worker pool, pack into fixed-length rows off the event loop."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from starlette.responses import Response

from app.bodies import read_request
from app.errors import InvalidField
from app.openapi import BODY_ERRORS, PackAnswer, answer, error_responses
from app.registry import ModelInfo
from app.responses import MODEL_SHA256_HEADER, binary_response, json_response, wants_binary
from app.schemas import PackRequest, openapi_body
from app.state import ServiceDep
from app.worker import EncodeOptions
from client.packing import PackedRows, pack_best_fit, pack_concat
from client.wire import split_ragged

router = APIRouter(prefix="/v1", tags=["pack"])


def check_pack_request(body: PackRequest, info: ModelInfo, max_seq_len: int) -> np.ndarray | None:
    if not 2 <= body.seq_len <= max_seq_len:
        raise InvalidField(f"seq_len must be between 2 and {max_seq_len}, got {body.seq_len}", field="seq_len")
    check_carry_starts(body)
    if body.carry is None:
        return None
    if body.strategy != "concat":
        raise InvalidField("carry is only meaningful with strategy 'concat'", field="carry")
    for position, token in enumerate(body.carry):
        if not 0 <= token < info.vocab_size:
            raise InvalidField(
                f"carry[{position}] is {token}, outside the vocabulary [0, {info.vocab_size})",
                field="carry",
                index=position,
            )
    return np.asarray(body.carry, dtype=np.int32)


def check_carry_starts(body: PackRequest) -> None:
    """Positions in the carry where documents begin: what makes many requests pack like one."""
    starts = body.carry_document_starts
    if starts is None:
        return
    if body.strategy != "concat":
        raise InvalidField(
            "carry_document_starts is only meaningful with strategy 'concat'", field="carry_document_starts"
        )
    if body.carry is None:
        raise InvalidField("carry_document_starts needs the carry it describes", field="carry_document_starts")
    previous = -1
    for position, start in enumerate(starts):
        if not previous < start < len(body.carry):
            raise InvalidField(
                f"carry_document_starts[{position}] is {start}: starts must increase and lie in the carry "
                f"[0, {len(body.carry)})",
                field="carry_document_starts",
                index=position,
            )
        previous = start


def packed_content(info: ModelInfo, body: PackRequest, packed: PackedRows) -> dict[str, Any]:
    return {
        "model": info.name,
        "seq_len": body.seq_len,
        "strategy": body.strategy,
        "input_ids": packed.input_ids,
        "labels": packed.labels,
        "position_ids": packed.position_ids,
        "cu_seqlens": split_ragged(packed.cu_seqlens, packed.cu_seqlens_offsets),
        "leftover": packed.leftover,
        "leftover_document_starts": packed.leftover_document_starts,
        "stats": packed.stats.as_dict(),
    }


@router.post(
    "/pack",
    openapi_extra=openapi_body(PackRequest),
    responses={**answer(PackAnswer, binary=True), **error_responses(*BODY_ERRORS)},
)
async def pack(request: Request, service: ServiceDep) -> Response:
    settings = service.settings
    body = await read_request(request, PackRequest, "texts", settings.max_request_bytes, settings.max_texts)
    info = service.model(body.model)
    carry = check_pack_request(body, info, settings.max_seq_len)
    service.metrics.batch_size.observe(len(body.texts))
    batch = await service.pool.encode(info.name, body.texts, EncodeOptions(add_bos=body.add_bos, add_eos=body.add_eos))
    if body.strategy == "concat":
        eos_id = info.eos_id if body.add_eos and info.eos_id >= 0 else None
        packed = await asyncio.to_thread(
            pack_concat,
            batch.ids,
            batch.offsets,
            body.seq_len,
            carry=carry,
            carry_document_starts=body.carry_document_starts,
            eos_id=eos_id,
            mask_document_start=body.mask_document_start,
        )
    else:
        packed = await asyncio.to_thread(
            pack_best_fit,
            batch.ids,
            batch.offsets,
            body.seq_len,
            pad_id=info.padding_id,
            mask_document_start=body.mask_document_start,
        )
    service.metrics.texts.labels(info.name).inc(len(body.texts))
    service.metrics.tokens.labels(info.name).inc(int(batch.offsets[-1]))
    if packed.stats.rows:
        service.metrics.pack_padding_ratio.observe(packed.stats.padding_fraction)
    headers = {MODEL_SHA256_HEADER: info.sha256}
    if wants_binary(request):
        arrays = {
            "input_ids": packed.input_ids,
            "labels": packed.labels,
            "position_ids": packed.position_ids,
            "cu_seqlens": packed.cu_seqlens,
            "cu_seqlens_offsets": packed.cu_seqlens_offsets,
            "leftover": packed.leftover,
            "leftover_document_starts": packed.leftover_document_starts,
        }
        meta = {"model": info.name, "seq_len": body.seq_len, "strategy": body.strategy, "stats": packed.stats.as_dict()}
        return binary_response(arrays, meta, headers)
    return json_response(packed_content(info, body, packed), headers)
