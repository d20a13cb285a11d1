"""Servers of the client tests' own: on a fixed port (so a restarted one comes back on the same URL),
in a process group of their own (so SIGKILL takes the worker processes too), wrapped in an ASGI gauge
that counts the /v1/ requests being handled at once, where they are handled: in the server.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import sentencepiece as spm

from tests.conftest import ROOT, free_port, stop_server, wait_ready

GAUGED_SERVER = '''
"""tokenizer-service (create_app, settings from TOKENIZER_*) behind a gauge of concurrent /v1/ requests."""
import json
import sys

import uvicorn

from app.main import create_app
from app.settings import Settings


class ConcurrencyGauge:
    """Plain ASGI: counts /v1/ requests from the call into the app until the last byte of the answer is sent.

    GET /_gauge answers {"now", "peak", "total", "authorization"} and resets the peak to "now".
    """

    def __init__(self, app):
        self.app = app
        self.now = self.peak = self.total = 0
        self.authorization = None

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] == "/_gauge":
            body = json.dumps(
                {"now": self.now, "peak": self.peak, "total": self.total, "authorization": self.authorization}
            ).encode()
            self.peak = self.now
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": body})
            return
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        self.authorization = (headers.get(b"authorization") or b"").decode() or None
        self.now += 1
        self.total += 1
        self.peak = max(self.peak, self.now)
        done = False

        async def send_and_count(message):
            # The answer is complete once its last body chunk is in the socket; the client may send its
            # next request from then on, while the app still runs its own bookkeeping. uvicorn does not
            # yield between writing that chunk and returning here, so no request can be counted between.
            nonlocal done
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body") and not done:
                done = True
                self.now -= 1

        try:
            await self.app(scope, receive, send_and_count)
        finally:
            if not done:
                self.now -= 1


if __name__ == "__main__":  # worker processes are spawned: they import this file under another name
    app = ConcurrencyGauge(create_app(Settings()))
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
'''


@dataclass
class GaugedServer:
    """A tokenizer-server of one test module's own: kill() it, start() it again on the same port."""

    port: int
    models: dict[str, Path]
    directory: Path
    workers: int = 1
    env: dict[str, str] = field(default_factory=dict)
    process: subprocess.Popen[bytes] | None = None
    starts: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, wait: bool = True) -> None:
        script = self.directory / "gauged_server.py"
        script.write_text(GAUGED_SERVER)
        self.starts += 1
        log = self.directory / f"server-{self.starts}.log"
        env = {
            **{name: value for name, value in os.environ.items() if not name.startswith("TOKENIZER_")},
            "PYTHONPATH": str(ROOT),
            "TOKENIZER_MODEL": ",".join(f"{name}={path}" for name, path in self.models.items()),
            "TOKENIZER_WORKERS": str(self.workers),
            **self.env,
        }
        self.process = subprocess.Popen(
            [sys.executable, str(script), str(self.port)],
            stdout=log.open("wb"),
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env=env,
            start_new_session=True,
        )
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        assert self.process is not None
        wait_ready(self.url, self.process, self.directory / f"server-{self.starts}.log")

    def kill(self) -> None:
        """SIGKILL the server and its worker processes, as an OOM kill or a lost node would."""
        assert self.process is not None
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def stop(self) -> None:
        if self.process is not None:
            stop_server(self.process)
            with contextlib.suppress(ProcessLookupError):  # worker processes left behind, if any
                os.killpg(self.process.pid, signal.SIGKILL)

    def gauge(self) -> dict[str, object]:
        document: dict[str, object] = json.loads(httpx.get(f"{self.url}/_gauge", timeout=10).content)
        return document


def gauged_server(
    models: dict[str, Path], directory: Path, workers: int = 1, env: dict[str, str] | None = None
) -> GaugedServer:
    """Start one; `env` adds TOKENIZER_* settings (TOKENIZER_API_KEYS, TOKENIZER_MAX_CONCURRENT_REQUESTS, ...)."""
    server = GaugedServer(port=free_port(), models=models, directory=directory, workers=workers, env=env or {})
    server.start()
    return server


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
