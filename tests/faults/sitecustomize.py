"""Fault injection for the reliability tests, loaded only into a test server's own processes.

A test starts a server with this directory on PYTHONPATH; Python imports `sitecustomize` at start,
in the server and in every worker process it spawns. In worker processes only, SentencePiece's
encode then misbehaves on a text that starts with a marker:

    FAULT:kill       SIGKILL the worker, as a segfault or the OOM killer would
    FAULT:hang       sleep for an hour: a stall
    FAULT:sleep:S    sleep S seconds, then tokenize as usual: a slow worker
    FAULT:spin:S     keep the CPU busy for S seconds, then tokenize as usual: a busy worker
    FAULT:raise      raise RuntimeError: an unexpected exception inside the worker

The service itself has no such hook: nothing here is reachable unless a test puts this directory
on the server's PYTHONPATH.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import sentencepiece

MARKER = "FAULT:"


def _misbehave(text: str) -> None:
    command = text[len(MARKER) :].split()[0] if len(text) > len(MARKER) else ""
    if command == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif command == "hang":
        time.sleep(3600)
    elif command.startswith("sleep:"):
        time.sleep(float(command.split(":", 1)[1]))
    elif command.startswith("spin:"):
        until = time.monotonic() + float(command.split(":", 1)[1])
        while time.monotonic() < until:
            pass
    elif command == "raise":
        raise RuntimeError("injected fault: secret internal detail")


def _faulty(encode):  # type: ignore[no-untyped-def]
    def faulty_encode(self, input, *args, **kwargs):  # type: ignore[no-untyped-def]
        # Decided per call: at interpreter start a spawned worker does not know its parent yet.
        if multiprocessing.parent_process() is not None:
            for text in [input] if isinstance(input, str) else input:
                if isinstance(text, str) and text.startswith(MARKER):
                    _misbehave(text)
        return encode(self, input, *args, **kwargs)

    return faulty_encode


_patched = _faulty(sentencepiece.SentencePieceProcessor.Encode)
sentencepiece.SentencePieceProcessor.Encode = _patched
sentencepiece.SentencePieceProcessor.encode = _patched
