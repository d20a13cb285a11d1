"""Assemble the app: the lifespan builds registry, metrics and pool; routers do the rest."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.routing import APIRoute
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app import __version__
from app.auth import ApiKeyMiddleware, ApiKeys
from app.errors import install_error_handlers
from app.guard import RequestGuard
from app.metrics import Metrics
from app.openapi import publish
from app.pool import WorkerPool
from app.registry import ModelRegistry
from app.responses import MODEL_SHA256_HEADER
from app.routes import health, models, pack, tokenize
from app.settings import Settings
from app.state import Service

logger = logging.getLogger("tokenizer")

CLIENT_CLOSED_REQUEST = 499


class RequestMetricsMiddleware:
    """Counts and times every HTTP request by route template (bounded labels), plain ASGI."""

    def __init__(self, app: ASGIApp, metrics: Metrics, paths: frozenset[str]) -> None:
        self.app = app
        self.metrics = metrics
        self.paths = paths  # every route's path: none has parameters, so the path is the template

    def endpoint(self, scope: Scope) -> str:
        """The route template; also for a request refused (401, 503) before routing ran."""
        route = scope.get("route")
        if route is not None:
            return str(route.path)
        return scope["path"] if scope["path"] in self.paths else "unmatched"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # A request that ends without an answer had its client hang up: nginx's 499. One that
        # raises is answered 500 further out.
        status = CLIENT_CLOSED_REQUEST
        started = time.perf_counter()

        async def send_with_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        self.metrics.inflight.inc()
        try:
            await self.app(scope, receive, send_with_status)
        except Exception:
            status = 500
            raise
        finally:
            self.metrics.inflight.dec()
            endpoint = self.endpoint(scope)
            self.metrics.requests.labels(endpoint, str(status)).inc()
            self.metrics.request_duration.labels(endpoint).observe(time.perf_counter() - started)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    metrics = Metrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Service]]:
        registry = ModelRegistry.from_paths(settings.model_paths(), settings.default_model)
        for info in registry.models.values():
            metrics.model_info.labels(info.name, info.sha256, str(info.vocab_size)).set(1)
        pool = WorkerPool(
            registry.paths(),
            settings.workers,
            metrics,
            settings.min_chunk_chars,
            max_queued_texts=settings.queued_texts_limit,
            stall_timeout=settings.stall_timeout,
            model_sha256={name: info.sha256 for name, info in registry.models.items()},
        )
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
    routers = (tokenize.router, pack.router, models.router, health.router)
    for router in routers:
        app.include_router(router)
    paths = frozenset(route.path for router in routers for route in router.routes if isinstance(route, APIRoute))
    # Innermost first: the last middleware added sees a request first.
    app.add_middleware(
        RequestGuard,
        max_concurrent=settings.max_concurrent_requests,
        timeout=settings.request_timeout,
        metrics=metrics,
    )
    if settings.api_keys:
        keys = ApiKeys([key.get_secret_value() for key in settings.api_keys])
        app.add_middleware(ApiKeyMiddleware, keys=keys)
    app.add_middleware(RequestMetricsMiddleware, metrics=metrics, paths=paths)
    if settings.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.cors_origins,
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type", "Accept"],
            expose_headers=[MODEL_SHA256_HEADER, "Retry-After"],
            max_age=600,
        )
    publish(app, bearer_auth=bool(settings.api_keys))
    return app
