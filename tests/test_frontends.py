"""Several front-end processes on one port (--frontends): each serves, /metrics adds them up, SIGTERM stops all."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest
import sentencepiece as spm

from tokenizer_service.frontends import shares
from tokenizer_service.tools.launcher import metric_total
from tests.conftest import ROOT, start_server, stop_server

pytestmark = pytest.mark.slow  # several server processes; part of .ci/run's slow stage


def test_workers_are_shared_out_evenly():
    assert shares(8, 3) == [3, 3, 2]
    assert shares(2, 2) == [1, 1]
    assert shares(1, 2) == [1, 1]  # every front-end gets a worker


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
