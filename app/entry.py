"""Console entry points. Each imports its command only when run, so a missing extra is one line.

A plain ``pip install tokenizer-service`` is the client (numpy and httpx); the server and the tools
come with extras. Started without theirs, a command says which extra to install and exits 2, instead
of ending in ``ModuleNotFoundError``. This module imports nothing beyond the standard library.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import gc
import importlib
import os
import sys
from collections.abc import Callable, Iterable
from typing import Any, NoReturn, TextIO

# Exit status of every command when it cannot start as asked (a bad flag, a missing extra or model).
USAGE_ERROR = 2
# Exit status when the reader of stdout went away (`tokenizer-shards info DS | head -1`): what a command
# killed by SIGPIPE reports in a shell, 128 + 13, as `cat` or `seq` would. Quiet, as theirs is: the reader
# chose to stop reading, nothing failed.
CLOSED_PIPE = 141
# Exit status when stdout could not be written (`> /dev/full`, a disk or quota full, an I/O error): the
# commands' "failed", with one line on stderr saying so.
STDOUT_FAILED = 1

_STDOUT_ERRORS = {
    errno.ENOSPC: "the device is full (No space left on device); free space there, or send stdout elsewhere",
    errno.EDQUOT: "the disk quota is used up (Disk quota exceeded); free space there, or send stdout elsewhere",
}


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, refusing a command line in one line: what was wrong, and where the help is. (argparse's
    own puts the whole usage first: 14 lines of tokenizer-pretokenize's flags above the line that matters.) Its
    subcommands' parsers are of this class too (`add_subparsers` makes them of the parser's own)."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _CommandStdout:
    """sys.stdout for a command: a write or flush that fails ends the command, in one line at most.

    Its reader gone (BrokenPipeError): quietly, CLOSED_PIPE. Any other failure (ENOSPC on `> /dev/full`, EIO,
    EDQUOT): one line on stderr saying stdout could not be written and why, STDOUT_FAILED. Either way stdout
    is first pointed at devnull, so nothing left in its buffer is written at exit (the recipe in the Python
    docs' signal module; Python's own flush at exit would print "Exception ignored", exit 120), and the
    command ends with SystemExit: no OSError, so neither a command's own `except OSError` (which would
    describe it as a failure of its output directory) nor argparse's (which swallows one from --help,
    exit 0) takes it for one of theirs. A BrokenPipeError anywhere else (a worker's pipe, a socket) is
    raised as it was.
    """

    def __init__(self, stream: TextIO, name: str) -> None:
        self._stream = stream
        self._name = name

    def _failed(self, exc: OSError) -> NoReturn:
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)
        except (OSError, ValueError):  # no file descriptor (a stream of a test): nothing to redirect
            pass
        if isinstance(exc, BrokenPipeError):
            raise SystemExit(CLOSED_PIPE)
        why = _STDOUT_ERRORS.get(exc.errno or 0) or exc.strerror or str(exc)
        with contextlib.suppress(OSError, ValueError):  # stderr unwritable too: the exit status is all that is left
            print(f"{self._name}: cannot write stdout: {why}", file=sys.stderr)
        raise SystemExit(STDOUT_FAILED)

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as exc:
            self._failed(exc)

    def writelines(self, lines: Iterable[str]) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as exc:
            self._failed(exc)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _run_main(main: Callable[[], int | str | None], name: str) -> int | str | None:
    """main(), with stdout flushed before the exit (a failure there would be "Exception ignored", exit 120)."""
    if sys.stdout is not None and not isinstance(sys.stdout, _CommandStdout):
        sys.stdout = _CommandStdout(sys.stdout, name)  # type: ignore[assignment]
    try:
        status = main()
    except SystemExit as exit_:  # argparse's --help and refusals, and a failed stdout: flushed below too
        status = exit_.code
    if sys.stdout is not None:
        try:
            sys.stdout.flush()
        except SystemExit as exit_:
            status = exit_.code
    return status


INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command Ctrl-C stopped


def _command(name: str, module: str, extra: str) -> Callable[[], None]:
    def run() -> None:
        try:
            code = _imported_and_run()
            # Python's last collection at exit would visit every object the command made, to free memory the process
            # is about to give back anyway: 10 ms of a 0.11 s export, 30-40 ms of a 1 s pre-tokenizer run. Frozen,
            # they are left to the exit (the command closed its files; objects are still freed by their counts).
            gc.freeze()
            sys.exit(code)
        except KeyboardInterrupt:  # before the command's own handling (its imports), or where it has none
            stopped = name == "tokenizer-server"  # a server Ctrl-C stops is a clean stop (docs/operations.md)
            print(f"{name}: {'stopped' if stopped else 'interrupted'}", file=sys.stderr)
            sys.exit(0 if stopped else INTERRUPTED)

    def _imported_and_run() -> int | str | None:
        # No command multiplies matrices, but numpy's OpenBLAS starts a thread per core in every process that
        # imports it, which spin a moment: 0.1 CPU-s a process on 2 cores (a pre-tokenizer run of 20 documents
        # cost 0.95 CPU-s with them, 0.81 without). Its workers inherit this; a user's own setting stands.
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
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
        return _run_main(main, name)

    run.__name__ = name.replace("-", "_")
    run.__doc__ = f"`{name}`: {module}.main, or one line naming the extra to install."
    return run


server = _command("tokenizer-server", "tokenizer_service.cli", "server")
pretokenize = _command("tokenizer-pretokenize", "tokenizer_service.tools.pretokenize.cli", "tools")
shards = _command("tokenizer-shards", "tokenizer_service.tools.pretokenize.shards_cli", "tools")
bench = _command("tokenizer-bench", "tokenizer_service.tools.bench", "tools")
