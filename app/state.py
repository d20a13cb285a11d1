"""What the lifespan builds and every handler reads: models, pool, metrics, settings."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request

from app.errors import ModelNotFound
from app.metrics import Metrics
from app.pool import WorkerPool
from app.registry import ModelInfo, ModelRegistry
from app.settings import Settings


@dataclass
class Service:
    settings: Settings
    registry: ModelRegistry
    metrics: Metrics
    pool: WorkerPool
    ready: bool = field(default=False)

    def model(self, name: str | None) -> ModelInfo:
        info = self.registry.get(name)
        if info is None:
            raise ModelNotFound(
                f"model {name!r} is not served here; served models: {sorted(self.registry.models)}", field="model"
            )
        return info


def get_service(request: Request) -> Service:
    service: Service = request.state.service
    return service


ServiceDep = Annotated[Service, Depends(get_service)]
