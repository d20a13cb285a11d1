"""Servers of the client tests' own (tokenizer_service.tools.launcher.ServerProcess: a fixed port, so a
restarted one comes back on the same URL; a process group of its own, so SIGKILL takes the worker processes
too), running tests/gauged_server.py, which counts the /v1/ requests being handled at once, where they are handled.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import numpy as np
import sentencepiece as spm

from tokenizer_service.tools.launcher import ServerProcess, free_port


class GaugedServer(ServerProcess):
    """A tokenizer-server of one test module's own: kill() it, start() it again on the same port."""

    def __init__(self, models: dict[str, Path], directory: Path, workers: int = 1, env: dict[str, str] | None = None):
        settings = {
            "TOKENIZER_MODEL": ",".join(f"{name}={path}" for name, path in models.items()),
            "TOKENIZER_WORKERS": str(workers),
            **(env or {}),
        }
        super().__init__(module="tests.gauged_server", env=settings, log=directory / "server.log", clean_env=True)
        self.models = models

    def gauge(self) -> dict[str, object]:
        document: dict[str, object] = json.loads(httpx.get(f"{self.url}/_gauge", timeout=10).content)
        return document


def gauged_server(
    models: dict[str, Path], directory: Path, workers: int = 1, env: dict[str, str] | None = None
) -> GaugedServer:
    """Start one; `env` adds TOKENIZER_* settings (TOKENIZER_API_KEYS, TOKENIZER_MAX_CONCURRENT_REQUESTS, ...)."""
    return GaugedServer(models, directory, workers, env).start()  # type: ignore[return-value]


def dead_url() -> str:
    """A loopback URL where nothing listens."""
    return f"http://127.0.0.1:{free_port()}"


def numbered_texts(documents: list[str], count: int):
    """A generator of `count` distinct real texts: Botchan documents with their stream index in front."""
    for i in range(count):
        yield f"{i}: {documents[i % len(documents)]}"


def ragged(sp: spm.SentencePieceProcessor, texts: list[str], **options: object) -> tuple[np.ndarray, np.ndarray]:
    """In-process sentencepiece ids of texts as flat ids and offsets (the reference everything is compared to)."""
    encoded = sp.encode(texts, **options)
    lengths = np.array([len(row) for row in encoded], dtype=np.int64)
    offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return np.array([i for row in encoded for i in row], dtype=np.int32), offsets
