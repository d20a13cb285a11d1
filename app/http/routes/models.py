"""GET /v1/models: what this server serves (behind API keys when they are configured)."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.responses import Response

from tokenizer_service.http.negotiation import json_response
from tokenizer_service.http.openapi import GUARDED_ERRORS, ModelsAnswer, answer, error_responses
from tokenizer_service.http.state import ServiceDep

router = APIRouter(prefix="/v1", tags=["models"])


@router.get("/models", responses={**answer(ModelsAnswer, sha256=False), **error_responses(*GUARDED_ERRORS)})
async def models(service: ServiceDep) -> Response:
    registry = service.registry
    return json_response({"default": registry.default, "models": [info.as_dict() for info in registry.models.values()]})
