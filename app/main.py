"""Assemble the app: the lifespan builds registry, metrics and pool; routers do the rest."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app import __version__
from app.errors import install_error_handlers
from app.metrics import Metrics
from app.pool import WorkerPool
from app.registry import ModelRegistry
from app.routes import health, pack, tokenize
from app.settings import Settings
from app.state import Service

logger = logging.getLogger("tokenizer")


class RequestMetricsMiddleware:
    """Counts and times every HTTP request by route template (bounded labels), plain ASGI."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500
        started = time.perf_counter()

        async def send_with_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        self.metrics.inflight.inc()
        try:
            await self.app(scope, receive, send_with_status)
        finally:
            self.metrics.inflight.dec()
            route = scope.get("route")
            endpoint = getattr(route, "path", None) or "unmatched"
            self.metrics.requests.labels(endpoint, str(status)).inc()
            self.metrics.request_duration.labels(endpoint).observe(time.perf_counter() - started)


def _move_body_schemas_to_components(app: FastAPI) -> None:
    """Routes that parse their own body carry their schemas in `x-components`; publish them properly."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = generate()
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for path in schema.get("paths", {}).values():
                for operation in path.values():
                    components.update(operation.pop("x-components", {}))
        return app.openapi_schema  # type: ignore[return-value]

    app.openapi = openapi  # type: ignore[method-assign]


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    metrics = Metrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Service]]:
        registry = ModelRegistry.from_paths(settings.model_paths(), settings.default_model)
        for info in registry.models.values():
            metrics.model_info.labels(info.name, info.sha256, str(info.vocab_size)).set(1)
        pool = WorkerPool(registry.paths(), settings.workers, metrics, settings.min_chunk_chars)
        service = Service(settings=settings, registry=registry, metrics=metrics, pool=pool)
        started = time.perf_counter()
        await pool.start()
        service.ready = True
        metrics.ready.set(1)
        logger.info(
            "serving models %s (default %r) on %d workers, ready in %.2fs",
            sorted(registry.models),
            registry.default,
            settings.workers,
            time.perf_counter() - started,
        )
        try:
            yield {"service": service}
        finally:
            service.ready = False
            metrics.ready.set(0)
            pool.close()

    app = FastAPI(
        title="tokenizer-service",
        version=__version__,
        description="Batched SentencePiece tokenization for LLM training.",
        lifespan=lifespan,
    )
    install_error_handlers(app)
    app.include_router(tokenize.router)
    app.include_router(pack.router)
    app.include_router(health.router)
    app.add_middleware(RequestMetricsMiddleware, metrics=metrics)
    _move_body_schemas_to_components(app)
    return app
