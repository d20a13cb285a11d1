"""What the lifespan builds and the FastAPI routes read: models, readiness (and the pool), metrics, settings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from app.core.readiness import ServiceState
from app.core.registry import ModelRegistry
from app.metrics import Metrics
from app.settings import Settings


@dataclass
class Service:
    settings: Settings
    registry: ModelRegistry
    metrics: Metrics
    state: ServiceState


async def get_service(request: Request) -> Service:
    """Async, so FastAPI calls it on the event loop rather than on a thread-pool thread."""
    service: Service = request.state.service
    return service


ServiceDep = Annotated[Service, Depends(get_service)]
