"""`tokenizer-server`: flags and TOKENIZER_* variables -> Settings -> models checked -> uvicorn.

Exit status: 0 stopped (SIGTERM or Ctrl-C after the drain, as `docker compose down` and Kubernetes
stop it), 2 cannot start as configured (one line per mistake on stderr; `--log-level debug` adds the
traceback), 3 the worker processes could not start (uvicorn's startup failure, with its log), 1 failed
while serving.
"""

from __future__ import annotations

import argparse
import errno
import logging
import logging.handlers
import os
import signal
import socket
import sys
from typing import Any

import uvicorn
from pydantic import ValidationError
from pydantic_settings import CliSettingsSource

from tokenizer_service.core import zygote
from tokenizer_service.core.libraries import CACHE_DIR_ENV
from tokenizer_service.core.models import ModelLoadError
from tokenizer_service.core.registry import ModelRegistry
from tokenizer_service.entry import USAGE_ERROR, ArgumentParser
from tokenizer_service.http.connections import uvicorn_options
from tokenizer_service.settings import BUNDLED, MODEL_DIRECTORIES, MODEL_FILES, ConfigError, Settings, describe_error

PROG = "tokenizer-server"
EPILOG = """\
Every flag is also an environment variable: --max-texts N is TOKENIZER_MAX_TEXTS=N; repeatable flags
take comma-separated values there (TOKENIZER_MODEL=a=a.model,b=b.model). A flag wins over its variable.
With no --model and no --models-dir the bundled model is served as 'default'.
Exit status: 0 stopped by SIGTERM or Ctrl-C, 1 failed while serving, 2 cannot start as configured,
3 the worker processes could not start.
"""


def _add_argument(parser: argparse.ArgumentParser, *names: str, **kwargs: Any) -> Any:
    """pydantic-settings' argparse hook: our metavars, and no type names or `(default: null)` in --help."""
    field = Settings.model_fields.get(kwargs.get("dest") or "")
    if field is not None:
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        kwargs["metavar"] = extra.get("metavar", kwargs.get("metavar"))
        text = field.description or ""
        if field.default_factory is None and field.default is not None and "(default" not in text:
            text += f" (default: {field.default})"
        kwargs["help"] = text.replace("%", "%%")
    return parser.add_argument(*names, **kwargs)


def _source(argv: list[str]) -> CliSettingsSource[Settings]:
    parser = ArgumentParser(
        prog=PROG,
        description=(
            "Serve tokenization (SentencePiece, tokenizer.json, tiktoken, tekken.json) over HTTP on a pool of worker "
            "processes."
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # --work is not --workers: an error names the flag as written
    )
    return CliSettingsSource(Settings, root_parser=parser, add_argument_method=_add_argument)(args=argv)


ADDRESS_HINTS = {
    errno.EADDRINUSE: "another process listens there (another tokenizer-server?): stop it, or choose another --port",
    errno.EADDRNOTAVAIL: "no interface of this machine has that address: --host 127.0.0.1 (this machine only) "
    "or 0.0.0.0 (every interface)",
    errno.EACCES: "a port below 1024 needs privileges: choose another --port, such as 8000",
}


def check_address(host: str, port: int) -> str | None:
    """Why the server could not listen on host:port, found before any worker starts; None if it can.

    Binds as asyncio's create_server (uvicorn) does: every address the host resolves to, IPv6 ones
    v6-only, an empty host meaning every interface; it is enough that one of them binds.
    """
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return f"--host {host!r}: {exc.strerror}"
    except UnicodeError:  # an empty label ("not..a..host"), or one over 63 characters: no name at all
        return f"--host {host!r} is no host name nor address: --host 127.0.0.1 (this machine only) or 0.0.0.0"
    failure: OSError | None = None
    for family, kind, proto, _, address in infos:
        try:
            with socket.socket(family, kind, proto) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind(address)
                return None
        except OSError as exc:
            failure = failure or exc
    assert failure is not None
    hint = ADDRESS_HINTS.get(failure.errno or 0, "")
    return f"cannot listen on {host}:{port}: {failure.strerror}" + (f"; {hint}" if hint else "")


def _stopped(signum: int, frame: object) -> None:
    """SIGTERM or Ctrl-C outside uvicorn's own handling: while starting, stop; after uvicorn has drained
    (it re-raises the signal that stopped it), exit. A stop asked for is exit 0, not death by signal."""
    raise SystemExit(0)


def main(argv: list[str] | None = None) -> int:
    """The command. SIGTERM or Ctrl-C at any moment of start-up is a stop asked for (exit 0): `_stopped`
    from the first line on, until uvicorn (one server) or the supervisor (`--frontends`) takes them over;
    the handlers before are restored on the way out (tests call this in-process)."""
    previous = {signum: signal.signal(signum, _stopped) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        return _main(argv)
    finally:
        for signum, handler in previous.items():
            if handler is not None:  # None: a handler not installed from Python, which cannot be put back
                signal.signal(signum, handler)


def _log_to_stderr(level: str, held: logging.handlers.MemoryHandler) -> None:
    """The server's log, on stderr from now on, after what `held` kept while the models loaded."""
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    held.setTarget(logging.getLogger().handlers[0])
    held.flush()
    held.close()


def _main(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        settings = Settings(_cli_settings_source=_source(argv))
    except ValidationError as exc:
        for error in exc.errors(include_url=False):
            print(f"{PROG}: {describe_error(error, argv)}", file=sys.stderr)
        return USAGE_ERROR
    if settings.cache_dir is not None:  # the gate's verdicts, descriptions, outlines (tokenizer_service.core.cache)
        os.environ[CACHE_DIR_ENV] = str(settings.cache_dir.expanduser())
    if (problem := check_address(settings.host, settings.port)) is not None:  # before any model is read
        print(f"{PROG}: {problem}", file=sys.stderr)
        return USAGE_ERROR
    # What loading the models logs (which file each is, skipped entries) is held until they all load: a start
    # refused is the one line that says why, not that line after the models that did load.
    held = logging.handlers.MemoryHandler(capacity=1 << 16, flushLevel=logging.CRITICAL + 1, flushOnClose=False)
    logging.basicConfig(level=settings.log_level.upper(), handlers=[held])
    try:  # every model read once here, so a wrong path is one line and not a failed lifespan
        paths = settings.model_paths()
        templates = settings.chat_template_paths(paths)
        if settings.frontends == 1:  # its workers' models load in the zygote meanwhile, on another core
            zygote.start(paths, settings.encoder, templates)
        registry = ModelRegistry.from_paths(paths, settings.default_model, settings.encoder, templates)
    except (ConfigError, ModelLoadError) as exc:
        zygote.stop()
        logging.getLogger().removeHandler(held)
        if settings.log_level in ("debug", "trace"):
            _log_to_stderr(settings.log_level, held)
            logging.getLogger("tokenizer").exception("cannot start")
        print(f"{PROG}: {exc}", file=sys.stderr)
        return USAGE_ERROR
    logging.getLogger().removeHandler(held)
    _log_to_stderr(settings.log_level, held)
    if settings.models_dir is not None and paths == BUNDLED:
        logging.getLogger("tokenizer").warning(
            "no model in %s (%s, or %s): serving the bundled model as 'default' (--empty-models-dir bundled)",
            settings.models_dir,
            MODEL_FILES,
            MODEL_DIRECTORIES,
        )
    if settings.frontends > 1:
        from tokenizer_service.frontends import supervise

        return supervise(settings)
    from tokenizer_service.http.factory import create_app
    from tokenizer_service.metrics import Metrics

    metrics = Metrics()  # the app's, where the connections' own refusals are counted too
    app = create_app(settings, registry, metrics)
    uvicorn.run(app, host=settings.host, port=settings.port, **uvicorn_options(settings, metrics))
    return 0


if __name__ == "__main__":
    sys.exit(main())
