"""How a server's worker process starts: deaf to Ctrl-C, then every model loaded.

Ctrl-C in a terminal sends SIGINT to the whole process group. The server drains and then stops its
workers itself; a worker that died of KeyboardInterrupt first would only look like a crash and
trigger a pointless rebuild in the middle of the shutdown.
"""

from __future__ import annotations

import signal

from app import worker


def start(paths: dict[str, str]) -> None:
    """Pool initializer."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    worker.load_models(paths)
