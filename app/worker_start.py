"""How a server's worker process starts: deaf to Ctrl-C, models checked, then loaded.

Ctrl-C in a terminal sends SIGINT to the whole process group. The server drains and then stops its
workers itself; a worker that died of KeyboardInterrupt first would only look like a crash and
trigger a pointless rebuild in the middle of the shutdown.

Workers started after a crash load the model files again. A file replaced on disk meanwhile would
give ids from another model than the one whose sha256 the server announces, so a worker refuses to
start on a file whose sha256 changed (the pool then answers 503 until the server is restarted).
"""

from __future__ import annotations

import hashlib
import signal
from pathlib import Path

from app import worker


class ModelChanged(RuntimeError):
    """A model file no longer holds the bytes the server announced at startup."""


def check_models(paths: dict[str, str], sha256: dict[str, str]) -> None:
    for name, expected in sha256.items():
        actual = hashlib.sha256(Path(paths[name]).read_bytes()).hexdigest()
        if actual != expected:
            raise ModelChanged(
                f"model {name!r}: {paths[name]} changed since the server started (sha256 {actual}, "
                f"announced {expected}); restart the server to serve the new file"
            )


def start(paths: dict[str, str], sha256: dict[str, str] | None = None) -> None:
    """Pool initializer."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sha256:
        check_models(paths, sha256)
    worker.load_models(paths)
