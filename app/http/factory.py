"""Assemble the app: the edge serves the hot routes, FastAPI the rest; the lifespan starts the pool."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.routing import APIRoute
from starlette.middleware.cors import CORSMiddleware

from tokenizer_service import __version__
from tokenizer_service.core import memory
from tokenizer_service.core.gatescan import GateScan
from tokenizer_service.core.handler import Limits
from tokenizer_service.core.models import ModelInfo
from tokenizer_service.core.pool import WorkerPool
from tokenizer_service.core.readiness import ServiceState
from tokenizer_service.core.registry import ModelRegistry
from tokenizer_service.http.auth import ApiKeys
from tokenizer_service.http.docs_ui import install_docs
from tokenizer_service.http.edge import Edge
from tokenizer_service.http.negotiation import MODEL_SHA256_HEADER
from tokenizer_service.http.openapi import publish
from tokenizer_service.http.routes import health, models, tokenize
from tokenizer_service.http.state import Service
from tokenizer_service.http.status import install_error_handlers
from tokenizer_service.metrics import Metrics
from tokenizer_service.settings import Settings

logger = logging.getLogger("tokenizer")


def create_app(
    settings: Settings | None = None, registry: ModelRegistry | None = None, metrics: Metrics | None = None
) -> Any:
    """The ASGI app uvicorn runs: Edge(FastAPI), in CORS when origins are configured.

    `registry`: the models as tokenizer-server already read them to check its configuration; without
    it the lifespan reads them. `metrics`: the app's, where uvicorn's protocol counts what it refuses itself too
    (`uvicorn_options(..., metrics)`)."""
    settings = settings or Settings()
    metrics = metrics or Metrics()
    state = ServiceState(metrics)
    if settings.max_queued_texts is not None:
        logger.warning("--max-queued-texts is deprecated and ignored: the server bounds bytes (--max-queued-bytes)")
    memory.keep_freed_memory()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Service]]:
        models = registry or ModelRegistry.from_paths(
            settings.model_paths(), settings.default_model, settings.encoder, settings.chat_template_paths()
        )
        for info in models.models.values():
            metrics.model_info.labels(info.name, info.sha256, str(info.vocab_size), info.library, info.encoder).set(1)
        limits = Limits(
            max_texts=settings.max_texts,
            max_seq_len=settings.max_seq_len,
            min_chunk_chars=settings.min_chunk_chars,
            max_request_bytes=settings.max_request_bytes,
            shadow_rate=settings.shadow_rate,
            shadow_interval=settings.shadow_interval_seconds,
        )
        served = list(models.models.values())
        pool = WorkerPool(
            served, models.default, settings.workers, metrics, limits, stall_timeout=settings.stall_timeout
        )
        service = Service(settings=settings, registry=models, metrics=metrics, state=state)

        def fallen_back(
            info: ModelInfo,
        ) -> None:  # fastokens found wrong (shadow) or promoted (gate): /v1/models says so
            before = models.models[info.name]
            metrics.model_info.remove(
                before.name, before.sha256, str(before.vocab_size), before.library, before.encoder
            )
            metrics.model_info.labels(info.name, info.sha256, str(info.vocab_size), info.library, info.encoder).set(1)
            models.models[info.name] = info

        pool.on_fallback = fallen_back
        started = time.perf_counter()
        await pool.start()
        edge.open(served)
        state.serving(pool)
        scan = None
        if pending := models.pending():  # no cached gate verdict: the reference library serves while it runs
            loop = asyncio.get_running_loop()
            scan = GateScan(pending).start()

            def arrived(verdict: tuple[int, str | None, float]) -> None:
                with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: the server stopped
                    loop.call_soon_threadsafe(pool.gate_verdict, *verdict)

            scan.follow(arrived)
        logger.info(
            "serving models %s (default %r) on %d workers, ready in %.2fs",
            sorted(models.models),
            models.default,
            settings.workers,
            time.perf_counter() - started,
        )
        try:
            yield {"service": service}
        finally:
            state.stopping()
            if scan is not None:
                scan.close()
            pool.close()

    app = FastAPI(
        title="tokenizer-service",
        version=__version__,
        description="Batched tokenization for LLM training: SentencePiece, tokenizer.json, tiktoken and tekken.json.",
        lifespan=lifespan,
        docs_url=None,  # /docs and /redoc with their assets served here, not from a CDN: install_docs
        redoc_url=None,
    )
    install_docs(app)
    install_error_handlers(app)
    routers = (tokenize.router, models.router, health.router)
    for router in routers:
        app.include_router(router)
    # every route's template is an `endpoint` label (the API pages and their assets too: a bounded set)
    declared = [route for router in routers for route in router.routes if isinstance(route, APIRoute)]
    pages = [route for route in app.routes if isinstance(getattr(route, "path", None), str)]  # docs, openapi.json
    paths = frozenset(route.path for route in [*declared, *pages])
    publish(app, bearer_auth=bool(settings.api_keys), max_seq_len=settings.max_seq_len)
    keys = ApiKeys([key.get_secret_value() for key in settings.api_keys]) if settings.api_keys else None
    edge = Edge(
        app,
        state=state,
        metrics=metrics,
        keys=keys,
        max_request_bytes=settings.max_request_bytes,
        max_queued_bytes=settings.queued_bytes_limit,
        max_concurrent=settings.max_concurrent_requests,
        timeout=settings.request_timeout,
        paths=paths,
        min_body_rate=settings.min_body_rate,
        body_grace=settings.header_timeout,
    )
    if not settings.cors_origins:
        return edge
    return CORSMiddleware(
        edge,
        allow_origins=settings.cors_origins,
        allow_methods=["GET", "POST"],
        allow_headers=["Authorization", "Content-Type", "Accept"],
        expose_headers=[MODEL_SHA256_HEADER, "Retry-After"],
        max_age=600,
    )
