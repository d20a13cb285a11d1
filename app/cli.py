"""`tokenizer-server`: flags and TOKENIZER_* variables -> Settings -> uvicorn."""

from __future__ import annotations

import logging
import sys

import uvicorn
from pydantic import ValidationError

from app.connections import uvicorn_options
from app.settings import Settings


def main(argv: list[str] | None = None) -> None:
    try:
        settings = Settings(_cli_parse_args=sys.argv[1:] if argv is None else argv)
    except ValidationError as exc:  # a flag or TOKENIZER_* variable out of range: one line each, no traceback
        for error in exc.errors(include_url=False):
            flag = "--" + "-".join(str(part) for part in error["loc"]).replace("_", "-")
            print(f"tokenizer-server: {flag}: {error['msg']}", file=sys.stderr)
        sys.exit(2)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if settings.frontends > 1:
        from app.frontends import supervise

        sys.exit(supervise(settings))
    from app.main import create_app

    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, **uvicorn_options(settings))


if __name__ == "__main__":
    main()
