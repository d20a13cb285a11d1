"""Liveness, readiness and Prometheus metrics: open even when API keys are configured."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import Response

from tokenizer_service.core.readiness import Readiness
from tokenizer_service.http.negotiation import json_response
from tokenizer_service.http.openapi import HealthAnswer, ReadinessAnswer, error_responses
from tokenizer_service.http.state import ServiceDep

router = APIRouter(tags=["health"])

NOT_READY: dict[int | str, dict[str, Any]] = {
    503: {
        "model": ReadinessAnswer,
        "description": "Starting, shutting down, or rebuilding the worker pool after a worker died.",
        "headers": error_responses(503)[503]["headers"],
    }
}


NOT_READY_BECAUSE = {
    Readiness.STARTING: "the workers are loading the models",
    Readiness.REBUILDING: "no worker is up; the pool is starting new ones",
    Readiness.STOPPING: "the server is stopping",
}


@router.api_route("/healthz", methods=["GET", "HEAD"], responses={200: {"model": HealthAnswer, "description": "OK"}})
async def healthz() -> Response:
    """The process is alive and its event loop answers."""
    return json_response({"status": "ok"})


@router.api_route(
    "/readyz", methods=["GET", "HEAD"], responses={200: {"model": ReadinessAnswer, "description": "Ready"}, **NOT_READY}
)
async def readyz(service: ServiceDep) -> Response:
    """Models are loaded and the worker pool serves: not-ready only while starting, rebuilding or stopping."""
    readiness = service.state.readiness
    if readiness is not Readiness.READY:
        why = {"type": "unavailable", "message": f"not ready: {NOT_READY_BECAUSE[readiness]}"}
        return json_response({"status": "not ready", "error": why}, {"Retry-After": "1"}, status_code=503)
    return json_response({"status": "ready", "models": sorted(service.registry.models)})


PROMETHEUS_TEXT = {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}}


@router.get("/metrics", responses={200: PROMETHEUS_TEXT})
async def metrics(service: ServiceDep) -> Response:
    return Response(service.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)
