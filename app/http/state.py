"""What the lifespan builds and the FastAPI routes read: models, readiness (and the pool), metrics, settings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from tokenizer_service.core.readiness import ServiceState
from tokenizer_service.core.registry import ModelRegistry
from tokenizer_service.metrics import Metrics
from tokenizer_service.settings import Settings


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
