"""A tokenizer-server in a process of its own, on a loopback port: the one launcher of tests, benchmarks
and `tokenizer-bench`; `metric_total` reads a sum out of its /metrics.

`ServerProcess(args).start()` picks a free port (or keeps the one it had, so a restarted server comes
back on the same URL), runs `python -m tokenizer_service` (or another module that takes `--host`/`--port`) in a
session of its own with its output in a log file, and waits until `/readyz` answers 200; `stop()` sends
SIGTERM and waits (SIGKILL past the timeout), `kill()` SIGKILLs the whole process group, worker
processes included, as an OOM kill or a lost node would.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

import httpx

ROOT = Path(__file__).resolve().parents[2]  # the checkout: app/tools/launcher.py
READY_TIMEOUT_SECONDS = 60.0


def metric_total(url: str, name: str, **labels: str) -> float:
    """The sum of the samples named `name` (with these labels) in a server's /metrics (for tests, benchmarks)."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(key) == value for key, value in labels.items()):
                total += sample.value
    return total


def _children(pid: int) -> list[int]:
    try:
        return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:  # gone, or no /proc
        return []


def _command(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def worker_pids(pid: int) -> list[int]:
    """The worker processes under the server process `pid` (for tests, benchmarks; Linux): those forked from its
    zygote (children of multiprocessing's fork server) and those spawned (a worker, or with --frontends a
    front-end), not the fork server itself nor multiprocessing's resource tracker."""
    found = []
    for child in _children(pid):
        command = _command(child)
        if b"spawn_main" in command:
            found.append(child)
        elif b"multiprocessing.forkserver" in command:  # the zygote: its children are the workers
            found.extend(_children(child))
    return found


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class ServerNotReady(RuntimeError):
    """The server exited, or did not answer /readyz in time; the message carries its log."""


def wait_ready(url: str, process: subprocess.Popen[bytes], log: Path, timeout: float = READY_TIMEOUT_SECONDS) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ServerNotReady(f"tokenizer-server exited with {process.returncode}:\n{log.read_text()}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{url}/readyz", timeout=1.0).status_code == 200:
                return
        time.sleep(0.1)
    process.kill()
    raise ServerNotReady(f"tokenizer-server not ready after {timeout}s:\n{log.read_text()}")


def wait_listening(
    port: int, process: subprocess.Popen[bytes], log: Path, timeout: float = READY_TIMEOUT_SECONDS
) -> None:
    """Until something listens on 127.0.0.1:`port` (another server than ours: moto's S3, for tests and
    benchmarks); ServerNotReady with its log if `process` exits or `timeout` passes first (it is killed then)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if process.poll() is not None:
                raise ServerNotReady(f"{process.args!r} exited with {process.returncode}:\n{log.read_text()}") from None
            if time.monotonic() > deadline:
                process.kill()
                raise ServerNotReady(f"{process.args!r} not listening after {timeout}s:\n{log.read_text()}") from None
            time.sleep(0.1)


def stop(process: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    """SIGTERM (the server drains and stops its workers), then SIGKILL past `timeout`."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class ServerProcess:
    def __init__(
        self,
        args: Sequence[str] = (),
        *,
        env: Mapping[str, str] | None = None,
        log: Path | None = None,
        port: int | None = None,
        host: str = "127.0.0.1",
        module: str = "tokenizer_service",
        clean_env: bool = False,
    ) -> None:
        """`env` adds to (with `clean_env`, replaces the TOKENIZER_* variables of) this process's environment."""
        self.args = list(args)
        self.host = host
        self.port = port or free_port(host)
        self.module = module
        self.log = log or Path(tempfile.mkstemp(prefix="tokenizer-server-", suffix=".log")[1])
        base = {k: v for k, v in os.environ.items() if not (clean_env and k.startswith("TOKENIZER_"))}
        self.env = {
            **base,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), base.get("PYTHONPATH")])),
            **(env or {}),
        }
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, wait: bool = True, timeout: float = READY_TIMEOUT_SECONDS) -> ServerProcess:
        self.starts += 1
        command = [sys.executable, "-m", self.module, "--host", self.host, "--port", str(self.port), *self.args]
        mode = "ab" if self.starts > 1 else "wb"
        with self.log.open(mode) as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=self.env, start_new_session=True
            )
        if wait:
            self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = READY_TIMEOUT_SECONDS) -> None:
        assert self.process is not None
        wait_ready(self.url, self.process, self.log, timeout)

    def stop(self, timeout: float = 30.0) -> None:
        """Stop gracefully, and leave no worker process behind."""
        if self.process is None:
            return
        stop(self.process, timeout)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)

    def kill(self) -> None:
        """SIGKILL the server and its worker processes at once."""
        assert self.process is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def __enter__(self) -> ServerProcess:
        if self.process is None:
            self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
