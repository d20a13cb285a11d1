"""Several front-end processes on one port (--frontends): each serves, /metrics adds them up, SIGTERM stops all."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
import sentencepiece as spm

from tests.conftest import ROOT, start_server, stop_server
from tokenizer_service.frontends import shares, shortfall
from tokenizer_service.tools.launcher import ServerProcess, metric_total

pytestmark = pytest.mark.slow  # several server processes; part of .ci/run's slow stage


def test_workers_are_shared_out_evenly():
    assert shares(8, 3) == [3, 3, 2]
    assert shares(2, 2) == [1, 1]
    assert shares(1, 2) == [1, 1]  # every front-end gets a worker, and the supervisor says so
    assert shortfall(1, 2) is not None and "so 2 workers run" in shortfall(1, 2)  # type: ignore[operator]
    assert shortfall(2, 2) is None and shortfall(8, 3) is None


def test_two_frontends_share_the_port_and_the_metrics(tmp_path, model_files, documents):
    url, process = start_server(
        ["--frontends", "2", "--workers", "2", "--model", f"uni={model_files['uni']}"], tmp_path / "server.log"
    )
    try:
        children = psutil.Process(process.pid).children()
        frontends = [child for child in children if "spawn_main" in " ".join(child.cmdline())]  # not the tracker
        assert len(frontends) == 2
        cpu_before = {frontend.pid: sum(frontend.cpu_times()[:2]) for frontend in frontends}
        sp = spm.SentencePieceProcessor(model_file=str(model_files["uni"]))
        for start in range(0, 400, 10):  # a new connection each time: the kernel spreads them
            texts = documents[start : start + 10]
            answer = httpx.post(f"{url}/v1/tokenize", json={"texts": texts, "model": "uni"}, timeout=30)
            assert answer.status_code == 200 and answer.json()["ids"] == sp.encode(texts)
        grew = [sum(frontend.cpu_times()[:2]) - cpu_before[frontend.pid] for frontend in frontends]
        assert all(seconds > 0 for seconds in grew), grew  # both front-ends served
        # /metrics adds every front-end up, whichever one answers the scrape.
        assert metric_total(url, "tokenizer_requests_total", endpoint="/v1/tokenize", status="200") == 40
        assert metric_total(url, "tokenizer_workers") == 2
        assert metric_total(url, "tokenizer_ready") == 1
        workers = [child.pid for child in psutil.Process(process.pid).children(recursive=True)]
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
        deadline = time.monotonic() + 10
        while any(psutil.pid_exists(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(psutil.pid_exists(pid) for pid in workers), "a process outlived the server"
    finally:
        stop_server(process)


def test_frontends_need_a_fixed_port():
    result = subprocess.run(
        [sys.executable, "-m", "tokenizer_service", "--frontends", "2", "--port", "0"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert result.returncode == 2
    assert "needs a fixed --port" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("flag", ["--frontends"])
def test_the_flag_is_documented(flag):
    help_text = subprocess.run(
        [sys.executable, "-m", "tokenizer_service", "--help"], capture_output=True, text=True, cwd=ROOT, timeout=60
    ).stdout
    assert flag in help_text


# -- a stop asked for during start-up, and what a killed supervisor leaves behind (issue 36) ---------------


def frontend_children(pid: int) -> list[int]:
    """The supervisor's children that run a front-end (spawn_main; not multiprocessing's resource tracker),
    from the moment each has started Python (read from /proc: a few microseconds a look)."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return []
    found = []
    for child in children:
        try:
            command = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in command:
            found.append(int(child))
    return found


def listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def test_sigterm_while_the_first_frontend_starts_stops_every_frontend(tmp_path):
    """The signal is sent the moment the first front-end process exists: those started after it kept
    serving (3 of 3 tries), and the supervisor waited for them forever."""
    args = ["--frontends", "3", "--workers", "3"]
    server = ServerProcess(args, log=tmp_path / "server.log", env={"TMPDIR": str(tmp_path)})
    server.start(wait=False)
    assert server.process is not None
    try:
        deadline = time.monotonic() + 60
        while not frontend_children(server.process.pid):
            assert server.process.poll() is None and time.monotonic() < deadline, server.log.read_text()[-2000:]
            time.sleep(0.0005)
        server.process.send_signal(signal.SIGTERM)
        first = frontend_children(server.process.pid)
        assert server.process.wait(timeout=60) == 0, server.log.read_text()[-3000:]
        # every front-end is gone and nothing serves the port (any started after the signal would, 20 s on)
        deadline = time.monotonic() + 15
        while listening(server.port) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not listening(server.port), "a front-end serves after the supervisor stopped"
        while any(psutil.pid_exists(pid) for pid in first) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(psutil.pid_exists(pid) for pid in first), "a front-end outlived its supervisor"
        assert "Traceback" not in server.log.read_text()
        assert not list(tmp_path.glob("tokenizer-metrics-*")), "the supervisor's metrics directory is left behind"
    finally:
        server.stop()


def test_a_killed_supervisors_metrics_directory_is_removed_by_the_next_one(tmp_path):
    """kill -9 leaves the supervisor's tokenizer-metrics-* directory in the temp dir; the next start removes
    those whose supervisor is gone, and only those."""
    environment = {"TMPDIR": str(tmp_path)}
    first = ServerProcess(["--frontends", "2", "--workers", "2"], log=tmp_path / "first.log", env=environment).start()
    assert first.process is not None
    try:
        left = list(tmp_path.glob("tokenizer-metrics-*"))
        assert len(left) == 1
        frontends = frontend_children(first.process.pid)
        first.process.kill()  # the supervisor alone: its front-ends exit with it, its directory stays
        first.process.wait(timeout=10)
        deadline = time.monotonic() + 15
        while any(psutil.pid_exists(pid) for pid in frontends) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert left[0].is_dir()
    finally:
        first.stop()
    alive = tmp_path / f"tokenizer-metrics-{os.getpid()}-live"  # a running supervisor's (this test's pid)
    alive.mkdir()
    unnamed = tmp_path / "tokenizer-metrics-abc123de"  # no pid in the name: whose it is cannot be told
    unnamed.mkdir()
    second = ServerProcess(["--frontends", "2", "--workers", "2"], log=tmp_path / "second.log", env=environment).start()
    try:
        assert not left[0].exists(), "the killed supervisor's metrics directory was not removed"
        assert alive.is_dir() and unnamed.is_dir()
        # start() saw one front-end's /readyz; tokenizer_ready (livemin) is 1 once every front-end is ready
        deadline = time.monotonic() + 30
        while metric_total(second.url, "tokenizer_ready") != 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert metric_total(second.url, "tokenizer_ready") == 1  # the new one's own directory serves /metrics
    finally:
        second.stop()
    assert sorted(path.name for path in tmp_path.glob("tokenizer-metrics-*")) == [alive.name, unnamed.name]
