"""Memory is bounded by bytes: the server's process tree stays under the documented peak at maximum load.

docs/operations.md ("Memory") states the worst case for the default flags with 2 workers as
1.5 GiB; deploy/k8s/deployment.yaml and docker-compose.yml give the container 2 GiB. Clients here
send maximum-size bodies as fast as they are answered; everything beyond the byte budget must be
refused at once with 503 + Retry-After, never queued.
"""

from __future__ import annotations

import collections
import contextlib
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import orjson
import psutil
import pytest

from tests.conftest import start_server, stop_server

pytestmark = pytest.mark.slow

DOCUMENTED_PEAK_BYTES = 1536 * 2**20
MAX_REQUEST_BYTES = 32 * 2**20  # the default


def body_of(documents: list[str], size: int, emoji: bool, text_bytes: int = 8192) -> bytes:
    """At most `size` bytes of texts of about `text_bytes` (4,096 of 8 KB in 32 MiB, within --max-texts)."""
    texts: list[str] = []
    current = ""
    total = len(b'{"texts":[]}')
    for position in range(10**9):
        current = f"{current}\n{documents[position % len(documents)]}"
        if len(current) < text_bytes:
            continue
        text = f"\U0001f600 {current}" if emoji else current
        current = ""
        grown = len(orjson.dumps(text)) + 1
        if total + grown > size:
            break
        texts.append(text)
        total += grown
    return orjson.dumps({"texts": texts})


def tree_rss(process: psutil.Process) -> int:
    total = 0
    for member in [process, *process.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            total += member.memory_info().rss
    return total


def peak_rss(server: psutil.Process, seconds: float) -> int:
    """The largest resident set of the server's process tree, sampled every 20 ms for `seconds`."""
    peak = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        peak = max(peak, tree_rss(server))
        time.sleep(0.02)
    return peak


def peak_rss_while(
    server: psutil.Process,
    seconds: float,
    client: Callable[[], None],
    clients: int,
    stop: threading.Event,
    join_timeout: float,
) -> tuple[int, bool]:
    """The peak RSS of the server tree over `seconds` while `clients` threads run `client` (each until `stop`
    is set, which it is then), and whether one of them was still running `join_timeout` seconds later."""
    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for thread in threads:
        thread.start()
    peak = peak_rss(server, seconds)
    stop.set()
    for thread in threads:
        thread.join(timeout=join_timeout)
    return peak, any(thread.is_alive() for thread in threads)


def peak_under_load(url: str, server: psutil.Process, body: bytes, clients: int, seconds: float):
    statuses: collections.Counter[int] = collections.Counter()
    retry_after: set[str | None] = set()
    stop = threading.Event()

    def client() -> None:
        with httpx.Client(timeout=120) as http:
            while not stop.is_set():
                answer = http.post(
                    f"{url}/v1/tokenize",
                    content=body,
                    headers={"content-type": "application/json", "accept": "application/x-tokenizer-arrays"},
                )
                statuses[answer.status_code] += 1
                if answer.status_code == 503:
                    retry_after.add(answer.headers.get("retry-after"))
                    time.sleep(0.2)

    peak, hung = peak_rss_while(server, seconds, client, clients, stop, join_timeout=120)
    assert not hung, "a client hung"
    return peak, statuses, retry_after


@pytest.mark.parametrize(
    ("clients", "size", "emoji"),
    [(8, MAX_REQUEST_BYTES, False), (128, 4 * 2**20, False), (128, 4 * 2**20, True)],
    ids=["8x32MiB", "128x4MiB", "128x4MiB-emoji"],
)
def test_peak_memory_stays_under_the_documented_bound(tmp_path: Path, documents, clients, size, emoji):
    body = body_of(documents, size, emoji)
    assert size - 64 * 1024 < len(body) <= size
    url, process = start_server(["--workers", "2", "--log-level", "warning"], tmp_path / "server.log")
    try:
        server = psutil.Process(process.pid)
        peak, statuses, retry_after = peak_under_load(url, server, body, clients, seconds=6.0)
        kind = f"{clients} x {len(body) / 2**20:.1f} MiB{' emoji' if emoji else ''}"
        print(f"\n{kind}: peak {peak / 2**20:,.0f} MiB, {dict(statuses)}")
        assert process.poll() is None, "the server died"
        assert set(statuses) <= {200, 503} and statuses[200] >= 1, statuses
        assert retry_after <= {"1"}
        assert peak <= DOCUMENTED_PEAK_BYTES, f"peak {peak / 2**20:.0f} MiB"
        assert httpx.get(f"{url}/healthz", timeout=10).status_code == 200
    finally:
        stop_server(process)


def held_uploads(url: str, server: psutil.Process, clients: int, seconds: float, chunked: bool) -> tuple[int, int]:
    """`clients` raw connections each uploading a 32 MiB body: chunked as fast as the server reads it, or
    declared with Content-Length and trickled a byte at a time (a slow sender). Returns (peak RSS of the
    tree, connections the server answered). Each stops sending once it is answered."""
    host, port = url.removeprefix("http://").split(":")
    stop = threading.Event()
    answered = []

    def upload() -> None:
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {MAX_REQUEST_BYTES}"
            sock.sendall(
                f"POST /v1/tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{framing}\r\n\r\n".encode()
            )
            piece = b'{"texts": ["' + b"a" * (1 << 20)
            chunk = b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else b"{"
            sent = 0
            sock.settimeout(0.05 if chunked else 0.5)
            while not stop.is_set() and sent < MAX_REQUEST_BYTES:
                try:
                    if sock.recv(1, socket.MSG_PEEK):  # an answer: this upload is over
                        answered.append(1)
                        return
                    return  # closed by the server
                except (TimeoutError, BlockingIOError):
                    pass
                except OSError:
                    return
                try:
                    sock.sendall(chunk)
                except OSError:
                    return
                sent += len(chunk)

    peak, _ = peak_rss_while(server, seconds, upload, clients, stop, join_timeout=30)
    return peak, len(answered)


@pytest.mark.parametrize("chunked", [True, False], ids=["64-chunked-uploads", "64-slow-senders"])
def test_held_uploads_stay_under_the_documented_bound_and_others_are_served(tmp_path: Path, documents, chunked):
    """Chunked bodies count in the byte budget as they arrive; declared lengths not sent hold nothing."""
    url, process = start_server(["--workers", "2", "--log-level", "warning"], tmp_path / "server.log")
    try:
        server = psutil.Process(process.pid)
        served = []

        def ordinary() -> None:  # meanwhile, a normal request every half second
            with httpx.Client(timeout=30) as http:
                for _ in range(8):
                    answer = http.post(f"{url}/v1/tokenize", json={"texts": documents[:20]})
                    served.append(answer.status_code)
                    time.sleep(0.5)

        thread = threading.Thread(target=ordinary, daemon=True)
        thread.start()
        peak, answered = held_uploads(url, server, 64, seconds=6.0, chunked=chunked)
        thread.join(timeout=60)
        print(f"\n{'chunked' if chunked else 'slow'}: peak {peak / 2**20:,.0f} MiB, {answered} answered, {served}")
        assert process.poll() is None, "the server died"
        assert peak <= DOCUMENTED_PEAK_BYTES, f"peak {peak / 2**20:.0f} MiB"
        if not chunked:  # slow senders hold no budget: ordinary requests are served meanwhile
            assert served.count(200) >= 1, served
        assert httpx.get(f"{url}/healthz", timeout=10).status_code == 200
    finally:
        stop_server(process)
