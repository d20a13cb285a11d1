"""`tokenizer-server`: flags and TOKENIZER_* variables -> Settings -> uvicorn."""

from __future__ import annotations

import logging
import sys

import uvicorn

from app.frontends import supervise
from app.main import create_app
from app.settings import Settings


def main(argv: list[str] | None = None) -> None:
    settings = Settings(_cli_parse_args=sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if settings.frontends > 1:
        sys.exit(supervise(settings))
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=False,
        # SIGTERM: stop accepting, let in-flight requests finish for this long, then cancel them;
        # the lifespan then stops every worker process.
        timeout_graceful_shutdown=settings.drain_timeout,
    )


if __name__ == "__main__":
    main()
