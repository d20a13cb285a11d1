"""Console entry points. Each imports its command only when run, so a missing extra is one line.

A plain ``pip install tokenizer-service`` is the client (numpy and httpx); the server and the tools
come with extras. Started without theirs, a command says which extra to install and exits 2, instead
of ending in ``ModuleNotFoundError``. This module imports nothing beyond the standard library.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable

# Exit status of every command when it cannot start as asked (a bad flag, a missing extra or model).
USAGE_ERROR = 2


def _command(name: str, module: str, extra: str) -> Callable[[], None]:
    def run() -> None:
        try:
            main = importlib.import_module(module).main
        except ModuleNotFoundError as exc:
            missing = (exc.name or "").partition(".")[0]
            if not missing or missing in ("tokenizer_service", "tokenizer_client"):
                raise
            print(
                f"{name}: the Python package {missing!r} is missing; {name} needs the {extra!r} extra: "
                f"pip install 'tokenizer-service[{extra}]'",
                file=sys.stderr,
            )
            sys.exit(USAGE_ERROR)
        sys.exit(main())

    run.__name__ = name.replace("-", "_")
    run.__doc__ = f"`{name}`: {module}.main, or one line naming the extra to install."
    return run


server = _command("tokenizer-server", "tokenizer_service.cli", "server")
pretokenize = _command("tokenizer-pretokenize", "tokenizer_service.tools.pretokenize.cli", "tools")
shards = _command("tokenizer-shards", "tokenizer_service.tools.pretokenize.shards_cli", "tools")
bench = _command("tokenizer-bench", "tokenizer_service.tools.bench", "tools")
