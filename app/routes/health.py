"""Liveness, readiness, the model list and Prometheus metrics."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import Response

from app.responses import json_response
from app.state import ServiceDep

router = APIRouter()

READINESS_TIMEOUT_SECONDS = 5.0


@router.get("/healthz", tags=["health"])
async def healthz() -> Response:
    """The process is alive and its event loop answers."""
    return json_response({"status": "ok"})


@router.get("/readyz", tags=["health"])
async def readyz(service: ServiceDep) -> Response:
    """Models are loaded and the worker pool answers a round trip."""
    ready = service.ready
    if ready:
        try:
            ready = await asyncio.wait_for(service.pool.ping(), READINESS_TIMEOUT_SECONDS)
        except Exception:
            ready = False
    service.metrics.ready.set(1 if ready else 0)
    if not ready:
        return json_response({"status": "not ready"}, {"Retry-After": "1"}, status_code=503)
    return json_response({"status": "ready", "models": sorted(service.registry.models)})


@router.get("/v1/models", tags=["models"])
async def models(service: ServiceDep) -> Response:
    registry = service.registry
    return json_response({"default": registry.default, "models": [info.as_dict() for info in registry.models.values()]})


@router.get("/metrics", tags=["health"])
async def metrics(service: ServiceDep) -> Response:
    return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)
