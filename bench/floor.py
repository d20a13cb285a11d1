"""What one request costs on this machine before any tokenizing: the floor under the service's figures.

A bare ASGI app under uvicorn (httptools and uvloop, as the service runs; started by the launcher the
benchmarks use) that reads the body and answers as many fixed bytes as the request's `x-answer-bytes`
header asks (16 without it), called through the same httpx transport TokenizerClient uses
(`HTTPTransport.handle_request`). Its server CPU, client CPU and p50 are the least a request to a
Python HTTP service costs here:

- single texts, answered with 16 bytes: the floor under the single-text figures;
- 256-document bodies, answered with as many bytes as the service's binary answer to each: the least
  the server process can spend moving a batch's bytes in and out, so worker CPU / this is the highest
  serial ceiling any server built on uvicorn could reach (bench.serving prints both);
- the same bodies through `relay_app`, which also does what the service's server process must do with
  each: write the body to a worker process over a UNIX socket (two workers, as many as the service's
  benchmark runs) and read the answer's bytes back from it (the worker writes bytes it made once, and
  does nothing else). That is the least a server process that hands bodies to workers can spend, so
  worker CPU / this is the highest serial ceiling the service's design could reach.

    python -m bench.floor [--requests 3000]      # prints the single-text floor alone
"""

from __future__ import annotations

import asyncio
import multiprocessing
import socket
import statistics
import struct
import time
from concurrent.futures import ThreadPoolExecutor

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
    await _body(receive)
    await _answer(send, answer_of(_asked(scope)))


async def _body(receive: Receive) -> list[bytes]:
    """The request's body, as the chunks it arrived in."""
    chunks, more = [], True
    while more:
        message = await receive()
        if body := message.get("body"):
            chunks.append(body)
        more = message.get("more_body", False)
    return chunks


def _asked(scope: Scope) -> int:
    """The size of answer the request asks for (`x-answer-bytes`), 16 bytes without it."""
    return next((int(value) for name, value in scope["headers"] if name == ANSWER_HEADER), 16)


async def _answer(send: Send, answer: bytes | memoryview) -> None:
    headers = [(b"content-type", b"application/octet-stream"), (b"content-length", str(len(answer)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": answer})


def answer_of(size: int) -> bytes:
    answer = _answers.get(size)
    if answer is None:  # made once per size: the floor moves bytes, it does not make them
        answer = _answers[size] = b"0123456789abcdef" * (size // 16) + b"0" * (size % 16)
    return answer


# -- the relay floor: the body to a worker process and its answer back, as the service's server process does ------

RELAY_WORKERS = 2
_RELAY_HEAD = struct.Struct("<QQ")  # the body's length, the answer's


def _echo(connection: socket.socket) -> None:
    """A relay worker: read each body whole, write back as many bytes as asked (made once per size)."""
    buffer = bytearray(1 << 20)
    head = bytearray(_RELAY_HEAD.size)
    while True:
        if connection.recv_into(head, len(head), socket.MSG_WAITALL) < len(head):
            return
        length, size = _RELAY_HEAD.unpack(head)
        if length > len(buffer):
            buffer = bytearray(length)
        view, got = memoryview(buffer), 0
        while got < length:
            count = connection.recv_into(view[got:length])
            if not count:
                return
            got += count
        connection.sendall(answer_of(size))


class _Answer(asyncio.BufferedProtocol):
    """The server's end of a relay worker's socket: each answer read into a buffer of its own (no copy)."""

    def __init__(self) -> None:
        self.buffer = memoryview(bytearray(0))
        self.filled = 0
        self.spare = memoryview(bytearray(64))
        self.done: asyncio.Future[memoryview] | None = None

    def expect(self, size: int) -> asyncio.Future[memoryview]:
        self.buffer, self.filled = memoryview(bytearray(size)), 0
        self.done = asyncio.get_running_loop().create_future()
        if not size:
            self.done.set_result(self.buffer)
        return self.done

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.filled < len(self.buffer):
            return self.buffer[self.filled :]
        return self.spare  # no answer expected (the loop asks before every read): never empty

    def buffer_updated(self, nbytes: int) -> None:
        if self.filled == len(self.buffer):
            return  # bytes no exchange asked for: a relay worker writes none
        self.filled += nbytes
        if self.filled == len(self.buffer) and self.done is not None and not self.done.done():
            self.done.set_result(self.buffer)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_exception(ConnectionError("a relay worker is gone"))


class _Relay:
    """Two relay workers; a request takes an idle one (or waits for one) and gives it back with its answer."""

    def __init__(self) -> None:
        self.idle: asyncio.Queue[tuple[asyncio.Transport, _Answer]] = asyncio.Queue()

    async def start(self) -> None:
        context = multiprocessing.get_context("fork")
        for _ in range(RELAY_WORKERS):
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            context.Process(target=_echo, args=(theirs,), daemon=True).start()
            theirs.close()
            transport, protocol = await asyncio.get_running_loop().connect_accepted_socket(_Answer, ours)
            self.idle.put_nowait((transport, protocol))

    async def exchange(self, chunks: list[bytes], size: int) -> memoryview:
        transport, protocol = await self.idle.get()
        try:
            done = protocol.expect(size)
            transport.writelines([_RELAY_HEAD.pack(sum(len(chunk) for chunk in chunks), size), *chunks])
            answer = await done
        except BaseException:  # cancelled or gone with an answer on its way: that worker is not reused
            transport.close()
            raise
        self.idle.put_nowait((transport, protocol))
        return answer


_relay: asyncio.Task[_Relay] | None = None


async def _started() -> _Relay:
    relay = _Relay()
    await relay.start()
    return relay


async def relay_app(scope: Scope, receive: Receive, send: Send) -> None:
    """`app`, but the body goes to a worker process and the answer is what that worker wrote back."""
    global _relay
    if scope["type"] != "http":
        return
    if _relay is None:  # started once, by the first request; the others arriving meanwhile wait for it
        _relay = asyncio.ensure_future(_started())
    relay = await asyncio.shield(_relay)
    chunks = await _body(receive)
    await _answer(send, await relay.exchange(chunks, _asked(scope)))


def measure_floor(
    bodies: list[bytes], answers: list[int] | None = None, relay: bool = False, in_flight: int = 1
) -> dict[str, float]:
    """p50 (ms), server CPU (ms) and client CPU (ms) per request over `bodies`, `in_flight` requests at a time (each
    from a thread and a connection of its own, as the service's benchmarks send theirs); answers[i] is the size of
    body i's answer (16 bytes each without it). The server CPU is its main process's (with `relay`, not its relay
    workers')."""
    options = ["--log-level", "warning", "--no-access-log", "--http", "httptools", "--loop", "uvloop"]
    # The launcher waits for /readyz to answer 200, which the app answers as it answers any path.
    floor = ServerProcess([f"bench.floor:{'relay_app' if relay else 'app'}", *options], module="uvicorn").start()
    assert floor.process is not None
    url = f"{floor.url}/v1/tokenize"
    transports = [httpx.HTTPTransport() for _ in range(in_flight)]
    try:
        sizes = answers or [16] * len(bodies)
        calls = list(zip(bodies, sizes, strict=True))

        def run(lane: int, calls: list[tuple[bytes, int]]) -> list[float]:
            latencies = []
            for body, size in calls:
                headers = {"content-type": "application/json", ANSWER_HEADER.decode(): str(size)}
                began = time.perf_counter()
                response = transports[lane].handle_request(httpx.Request("POST", url, content=body, headers=headers))
                response.read()
                response.close()
                latencies.append(time.perf_counter() - began)
            return latencies

        def run_all(calls: list[tuple[bytes, int]]) -> list[float]:
            if in_flight == 1:
                return run(0, calls)
            with ThreadPoolExecutor(in_flight) as pool:
                lanes = pool.map(run, range(in_flight), [calls[lane::in_flight] for lane in range(in_flight)])
                return [latency for latencies in lanes for latency in latencies]

        run_all(calls[:200])
        server = psutil.Process(floor.process.pid)
        before = sum(server.cpu_times()[:2])
        client = time.process_time()
        latencies = run_all(calls)
        count = len(bodies)
        return {
            "p50_ms": statistics.median(latencies) * 1e3,
            "server_ms": (sum(server.cpu_times()[:2]) - before) / count * 1e3,
            "client_ms": (time.process_time() - client) / count * 1e3,
        }
    finally:
        for transport in transports:
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
