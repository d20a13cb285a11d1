"""`tokenizer-server`: flags and TOKENIZER_* variables -> Settings -> uvicorn."""

from __future__ import annotations

import logging
import sys
from typing import Any

import uvicorn

from app.connections import GuardedProtocol, raise_file_limit
from app.settings import Settings

DEFAULT_MAX_CONNECTIONS = 4096
RESERVED_FILES = 256  # for workers' sockets, model files, logs


def uvicorn_options(settings: Settings) -> dict[str, Any]:
    """What uvicorn runs with, for one server or each front-end: limits on connections included."""
    files = raise_file_limit()
    max_connections = settings.max_connections or max(16, min(DEFAULT_MAX_CONNECTIONS, files - RESERVED_FILES))
    return {
        "log_level": settings.log_level,
        "access_log": False,
        # SIGTERM: stop accepting, let in-flight requests finish for this long, then cancel them;
        # the lifespan then stops every worker process.
        "timeout_graceful_shutdown": settings.drain_timeout,
        "http": GuardedProtocol.configure(
            max_head_bytes=settings.max_header_bytes,
            head_timeout=settings.header_timeout,
            max_connections=max_connections,
        ),
    }


def main(argv: list[str] | None = None) -> None:
    settings = Settings(_cli_parse_args=sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if settings.frontends > 1:
        from app.frontends import supervise

        sys.exit(supervise(settings))
    from app.main import create_app

    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, **uvicorn_options(settings))


if __name__ == "__main__":
    main()
