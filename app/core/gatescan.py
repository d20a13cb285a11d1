"""The fast encoder's gate, run beside the work: nothing waits for it, nothing trusts fastokens before it passes.

A process that announces models (the server, the pre-tokenizer's parent) reads each one's cached gate
verdict (tokenizer_service.core.libraries.announced_gate). A model with none is announced with its
reference library, served or pre-tokenized with it at once, and scanned here: one process, at the lowest
CPU priority (nice 19), runs the whole gate of each such model in turn (libraries.gate_verdict: the check
set, every code point and special-token string; its verdict cached, a refusal too) and reports each
verdict as it is settled. The announcing process then promotes a model that passed to fastokens in every
worker (the server: a PROMOTE frame, tokenizer_service.core.pool; the pre-tokenizer: its next chunks) and
logs a refusal once.

The scan process ends with its parent: a server stopped, or a pre-tokenizer run that finished, before its
scan did leaves no verdict, and the next start scans again (`python -m tokenizer_service.core.gatescan
MODEL...` settles verdicts ahead, in the foreground).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from tokenizer_service.core.models import ModelInfo

logger = logging.getLogger("tokenizer")

# Tests only: a path; the scan process holds each verdict until that file exists before it reports (and
# caches) it, so a test can see the reference library serve first, then the promotion. Never set it in production.
HOLD_ENV = "TOKENIZER_TEST_GATE_HOLD"

# the model's index, what differs (None: passed), seconds scanned, the fast encoder's route chosen (passed)
Verdict = tuple[int, str | None, float, str | None]


class GateScan:
    """One low-priority process scanning the models given (index, announcement), reporting each verdict."""

    def __init__(self, models: Sequence[tuple[int, ModelInfo]]) -> None:
        self.models = list(models)
        self.process: multiprocessing.process.BaseProcess | None = None
        self.connection: Connection | None = None
        self.pending = {index for index, _ in self.models}
        self._thread: threading.Thread | None = None

    def start(self) -> GateScan:
        context = multiprocessing.get_context("spawn")  # the announcing process may have threads (Rust, asyncio)
        receiving, sending = context.Pipe(duplex=False)
        self.process = context.Process(
            target=_main, args=(sending, self.models), name="tokenizer-gate-scan", daemon=True
        )
        self.process.start()
        sending.close()
        self.connection = receiving
        names = ", ".join(repr(info.name) for _, info in self.models)
        logger.info(
            "fast encoder's gate: scanning %s in the background (nice 19); the reference library serves meanwhile",
            names,
        )
        return self

    def poll(self) -> list[Verdict]:
        """Verdicts that arrived since the last call, without waiting."""
        found: list[Verdict] = []
        connection = self.connection
        try:
            while connection is not None and connection.poll(0):
                found.append(self._received(connection.recv()))
        except (EOFError, OSError):
            self._gone()
        return found

    def follow(self, on_verdict: Callable[[Verdict], None]) -> None:
        """Call `on_verdict` (from a thread of its own) with each verdict as it arrives, until the scan ends."""

        def run() -> None:
            connection = self.connection
            while connection is not None and self.pending:
                try:
                    verdict = self._received(connection.recv())
                except (EOFError, OSError):
                    self._gone()
                    return
                on_verdict(verdict)

        self._thread = threading.Thread(target=run, name="tokenizer-gate-follow", daemon=True)
        self._thread.start()

    def _received(self, message: Any) -> Verdict:
        index, differs, seconds, route = message
        self.pending.discard(index)
        return int(index), differs, float(seconds), route

    def _gone(self) -> None:
        if self.pending and self.process is not None and self.process.exitcode not in (None, 0, -15, -9):
            logger.warning(
                "fast encoder's gate: the scan process ended (exit %s); the reference library serves",
                self.process.exitcode,
            )
        self.pending.clear()

    def close(self) -> None:
        """Stop the scan if it still runs (its unfinished verdicts are not cached)."""
        process = self.process
        if process is not None and process.exitcode is None:
            process.kill()
            process.join(5)
        if self.connection is not None:
            self.connection.close()
            self.connection = None
        self.pending.clear()


def _main(connection: Connection, models: Sequence[tuple[int, ModelInfo]]) -> None:
    """The scan process: lowest priority, bound to its parent, each model's gate in turn."""
    import signal

    from tokenizer_service.core.process import exit_with_parent

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group: the parent ends this process
    exit_with_parent()
    with contextlib.suppress(OSError):
        os.nice(19)
    for index, info in models:
        sent: list[bool] = []

        def send(
            differs: str | None, seconds: float, route: str | None, index: int = index, sent: list[bool] = sent
        ) -> None:
            connection.send((index, differs, seconds, route))  # before the verdict is cached: the run hears it first
            sent.append(True)

        try:
            differs, seconds, route = settle(info, send=send)
            if not sent:
                connection.send((index, differs, seconds, route))
        except (BrokenPipeError, OSError):
            return


def settle(
    info: ModelInfo, hold: bool = True, send: Callable[[str | None, float, str | None], None] | None = None
) -> tuple[str | None, float, str | None]:
    """The gate's verdict on the announced model's files (cached, or scanned here and cached): what differs,
    seconds scanned, the route chosen (among the candidates `info.select` allows)."""
    from tokenizer_service.core import libraries
    from tokenizer_service.core.models import ModelLoadError, find_model_files

    try:
        files = find_model_files(info.name, info.path, info.chat_template_path)
    except ModelLoadError as exc:
        return f"cannot read the model again: {exc}", 0.0, None
    if files.sha256 != info.sha256:
        return f"{info.path} changed since it was announced (sha256 {files.sha256[:12]}…)", 0.0, None
    library = libraries.load(files, libraries.REFERENCE)
    found: list[tuple[str | None, float, str | None]] = []

    def report(differs: str | None, seconds: float, route: str | None) -> None:
        held = os.environ.get(HOLD_ENV) if hold else None
        while held and not Path(held).exists():
            time.sleep(0.05)
        found.append((differs, seconds, route))
        if send is not None:
            send(differs, seconds, route)

    _, differs, route = libraries.gate_verdict(library, report=report, encoder=getattr(info, "select", "fast"))
    return found[0] if found else (differs, 0.0, route)


def main(argv: list[str] | None = None) -> int:
    """`python -m tokenizer_service.core.gatescan MODEL...`: settle each model's verdict now, in the foreground."""
    import argparse

    from tokenizer_service.core.models import ModelLoadError
    from tokenizer_service.core.registry import inspect_model

    parser = argparse.ArgumentParser(
        prog="python -m tokenizer_service.core.gatescan",
        description="Settle the fast encoder's gate for each model now (its verdict cached, as a server would "
        "cache it), so that servers and pre-tokenizer runs start on the fast encoder. Exit 1 if one is refused.",
    )
    parser.add_argument("models", nargs="+", metavar="MODEL_PATH", help="a tokenizer.json, snapshot or ranks file")
    paths = parser.parse_args(argv).models
    from tokenizer_service.core import libraries

    where = libraries.cache_dir()
    try:  # its only purpose is the cached verdict: a cache it cannot write is said before any scan, not after
        where.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=where, prefix=".probe-"):
            pass
    except OSError as exc:
        print(
            f"{parser.prog}: cannot keep verdicts in {where} ({exc.strerror or exc}): set {libraries.CACHE_DIR_ENV} to "
            "a writable directory",
            file=sys.stderr,
        )
        return 2
    status = 0
    for given in paths:
        path = Path(given).expanduser()
        try:
            info = inspect_model(path.name if path.is_dir() else path.stem, path)
        except ModelLoadError as exc:
            print(f"{parser.prog}: {exc}", file=sys.stderr)
            return 2
        if info.gate is None:  # SentencePiece: no fast encoder stands in front of it
            print(f"{path}: no gate: {info.library} encodes it, no fast encoder stands in for it")
            continue
        started = time.monotonic()
        differs, _, route = settle(info, hold=False)
        verdict = f"passed: {route}" if differs is None else f"refused: {differs}"
        print(f"{path}: {verdict} ({time.monotonic() - started:.1f}s)")
        status = status or (differs is not None)
    return int(status)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # mid-scan: no verdict is kept for the model being scanned
        print("interrupted: the verdicts printed above are kept, the model being scanned has none", file=sys.stderr)
        sys.exit(130)
