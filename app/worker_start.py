"""How a worker process starts: deaf to Ctrl-C, bound to its parent's life, models checked, then loaded.

Ctrl-C in a terminal sends SIGINT to the whole process group. The server drains and then stops its
workers itself; a worker that died of KeyboardInterrupt first would only look like a crash and
trigger a pointless rebuild in the middle of the shutdown.

An idle `ProcessPoolExecutor` worker waits on its call queue forever: if its parent is killed
(`kill -9`, the OOM killer), it would live on, orphaned, holding every model in memory. A daemon
thread waits on the parent's sentinel and ends the worker when the parent is gone.

Workers started after a crash load the model files again. A file replaced on disk meanwhile would
give ids from another model than the one whose sha256 the server announces, so a worker refuses to
start on a file whose sha256 changed (the pool then answers 503 until the server is restarted).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
from collections.abc import Callable, Sequence

from app import worker
from app.core.models import ModelInfo


def _exit_now() -> None:
    os._exit(1)


def exit_with_parent(leave: Callable[[], None] = _exit_now) -> None:
    """Call `leave` (by default: exit at once) in a daemon thread when the parent process is gone."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()
        leave()

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def start(models: Sequence[ModelInfo]) -> None:
    """Pool initializer, for the server's pools and the pre-tokenizer's."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_with_parent()
    worker.load_models(models)
