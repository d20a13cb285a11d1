"""What one request costs on this machine before any tokenizing: the floor under the service's figures.

A bare ASGI app under uvicorn (httptools and uvloop, as the service runs; started by the launcher the
benchmarks use) that reads the body and answers as many fixed bytes as the request's `x-answer-bytes`
header asks (16 without it), called through the same httpx transport TokenizerClient uses
(`HTTPTransport.handle_request`). Its server CPU, client CPU and p50 are the least a request to a
Python HTTP service costs here:

- single texts, answered with 16 bytes: the floor under the single-text figures;
- 256-document bodies, answered with as many bytes as the service's binary answer to each: the least
  the server process can spend moving a batch's bytes in and out, so worker CPU / this is the highest
  serial ceiling any server built on uvicorn could reach (bench.serving prints both).

    python -m bench.floor [--requests 3000]      # prints the single-text floor alone
"""

from __future__ import annotations

import statistics
import time

import httpx
import psutil
from starlette.types import Receive, Scope, Send

from tokenizer_service.tools.launcher import ServerProcess

ANSWER_HEADER = b"x-answer-bytes"
_answers: dict[int, bytes] = {}


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    """Read the whole body, answer the bytes asked for: an HTTP round trip and nothing else."""
    if scope["type"] != "http":
        return
    more = True
    while more:
        message = await receive()
        more = message.get("more_body", False)
    size = next((int(value) for name, value in scope["headers"] if name == ANSWER_HEADER), 16)
    answer = _answers.get(size)
    if answer is None:  # made once per size: the floor moves bytes, it does not make them
        answer = _answers[size] = b"0123456789abcdef" * (size // 16) + b"0" * (size % 16)
    headers = [(b"content-type", b"application/octet-stream"), (b"content-length", str(size).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": answer})


def measure_floor(bodies: list[bytes], answers: list[int] | None = None) -> dict[str, float]:
    """p50 (ms), server CPU (ms) and client CPU (ms) per request, one request at a time, over `bodies`;
    answers[i] is the size of body i's answer (16 bytes each without it)."""
    options = ["--log-level", "warning", "--no-access-log", "--http", "httptools", "--loop", "uvloop"]
    # The launcher waits for /readyz to answer 200, which the app answers as it answers any path.
    floor = ServerProcess(["bench.floor:app", *options], module="uvicorn").start()
    assert floor.process is not None
    url = f"{floor.url}/v1/tokenize"
    transport = httpx.HTTPTransport()
    try:
        sizes = answers or [16] * len(bodies)

        def call(body: bytes, size: int) -> None:
            headers = {"content-type": "application/json", ANSWER_HEADER.decode(): str(size)}
            request = httpx.Request("POST", url, content=body, headers=headers)
            response = transport.handle_request(request)
            response.read()
            response.close()

        for body, size in list(zip(bodies, sizes, strict=True))[:200]:
            call(body, size)
        server = psutil.Process(floor.process.pid)
        before = sum(server.cpu_times()[:2])
        client = time.process_time()
        latencies = []
        for body, size in zip(bodies, sizes, strict=True):
            began = time.perf_counter()
            call(body, size)
            latencies.append(time.perf_counter() - began)
        count = len(bodies)
        return {
            "p50_ms": statistics.median(latencies) * 1e3,
            "server_ms": (sum(server.cpu_times()[:2]) - before) / count * 1e3,
            "client_ms": (time.process_time() - client) / count * 1e3,
        }
    finally:
        transport.close()
        floor.stop()


def main() -> None:
    import argparse

    import orjson

    from bench.inputs import default_corpus, load_documents

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=3000, help="single-text requests, one at a time")
    args = parser.parse_args()
    if args.requests < 1:
        parser.error("--requests must be at least 1")
    docs = load_documents(default_corpus(), args.requests)
    floor = measure_floor([orjson.dumps({"texts": [doc]}) for doc in docs])
    print(", ".join(f"{key} {value:.3f}" for key, value in floor.items()))


if __name__ == "__main__":
    main()
