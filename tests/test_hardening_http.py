"""HTTP framing from outside, on raw loopback sockets: one answer per request, whatever it left unread.

Refused uploads (413, 503, `Expect: 100-continue`), pipelined requests, an h2c upgrade offer,
malformed HTTP, chunked bodies against the byte budget and the size limit, bodies declared but
not sent, and bodies trickled slower than the minimum rate. Every test waits on something it can
observe (an answer, end of stream, the `tokenizer_queued_bytes` gauge), never on a sleep.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import orjson
import pytest

from tests.conftest import start_server, stop_server

pytestmark = pytest.mark.slow  # raw connections to a uvicorn server with limits of its own; .ci/run's slow stage

MAX_REQUEST_BYTES = 4 * 1024 * 1024
MAX_QUEUED_BYTES = 6 * 1024 * 1024
HEADER_TIMEOUT = 3.0  # also the grace before a body's minimum rate (64 KiB/s by default) applies


@pytest.fixture(scope="module")
def url(tmp_path_factory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("hardening-http") / "server.log"
    args = [
        "--workers",
        "1",
        "--max-request-bytes",
        str(MAX_REQUEST_BYTES),
        "--max-queued-bytes",
        str(MAX_QUEUED_BYTES),
        "--header-timeout",
        str(HEADER_TIMEOUT),
    ]
    address, process = start_server(args, log)
    yield address
    stop_server(process)


# -- raw HTTP ----------------------------------------------------------------------------------------


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    def error(self) -> dict[str, object]:
        assert self.headers.get("content-type", "").startswith("application/json"), self
        return orjson.loads(self.body)["error"]


@dataclass
class Stream:
    """Everything a connection received, read to its end; `reset` if it ended with a reset."""

    answers: list[Answer] = field(default_factory=list)
    reset: bool = False
    rest: bytes = b""


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    connection = socket.create_connection((host, int(port)))
    connection.settimeout(20)
    return connection


def parse(data: bytes) -> tuple[list[Answer], bytes]:
    answers = []
    while True:
        end = data.find(b"\r\n\r\n")
        if end < 0:
            return answers, data
        lines = data[:end].decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        length = int(headers.get("content-length", "0"))
        if len(data) < end + 4 + length:
            return answers, data
        answers.append(Answer(status, headers, data[end + 4 : end + 4 + length]))
        data = data[end + 4 + length :]


def read_to_end(connection: socket.socket) -> Stream:
    """Read until the server ends the stream (EOF or reset); the answers in it, parsed."""
    chunks, reset = [], False
    try:
        while chunk := connection.recv(1 << 16):
            chunks.append(chunk)
    except ConnectionResetError:
        reset = True
    answers, rest = parse(b"".join(chunks))
    return Stream(answers, reset, rest)


def read_one(connection: socket.socket) -> Answer:
    """Read until one whole answer has come (the connection may stay open)."""
    data = b""
    while True:
        answers, _ = parse(data)
        if answers:
            return answers[0]
        chunk = connection.recv(1 << 16)
        assert chunk, f"the server closed the connection before a whole answer: {data[:300]!r}"
        data += chunk


def head(path: str = "/v1/tokenize", *lines: str, method: str = "POST") -> bytes:
    return (
        f"{method} {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        + "".join(line + "\r\n" for line in lines)
        + "\r\n"
    ).encode()


def send_in_background(connection: socket.socket, data: bytes, chunk: int = 1 << 16) -> threading.Thread:
    """Send `data` from a thread (as a client uploading while it waits for its answer); errors are kept."""

    def run() -> None:
        try:
            view = memoryview(data)
            for start in range(0, len(view), chunk):
                connection.sendall(view[start : start + chunk])
        except OSError as exc:
            thread.error = exc  # type: ignore[attr-defined]

    thread = threading.Thread(target=run, daemon=True)
    thread.error = None  # type: ignore[attr-defined]
    thread.start()
    return thread


def chunk(data: bytes) -> bytes:
    return b"%x\r\n" % len(data) + data + b"\r\n"


def queued_bytes(url: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("tokenizer_queued_bytes "):
            return float(line.split()[1])
    raise AssertionError("no tokenizer_queued_bytes in /metrics")


def wait_for_queued(url: str, predicate, timeout: float = 15.0) -> float:
    deadline = time.monotonic() + timeout
    while True:
        value = queued_bytes(url)
        if predicate(value):
            return value
        assert time.monotonic() < deadline, f"tokenizer_queued_bytes stayed at {value}"
        time.sleep(0.02)  # polling an observable, not a guess at how long something takes


def tokenize(url: str, texts: list[str]) -> list[list[int]]:
    answer = httpx.post(f"{url}/v1/tokenize", json={"texts": texts}, timeout=30)
    assert answer.status_code == 200, answer.text
    return answer.json()["ids"]


# -- 1. refused uploads --------------------------------------------------------------------------------


def test_a_refused_upload_gets_one_answer_then_a_lingering_close(url):
    connection = connect(url)
    size = 32 * 1024 * 1024
    connection.sendall(head("/v1/tokenize", f"Content-Length: {size}"))
    sender = send_in_background(connection, b"x" * size)
    stream = read_to_end(connection)
    sender.join(30)
    connection.close()
    assert not stream.reset, "the connection was reset instead of closed after the answer"
    assert [answer.status for answer in stream.answers] == [413], stream
    assert stream.rest == b""
    assert stream.answers[0].headers.get("connection") == "close"
    assert stream.answers[0].error()["type"] == "payload_too_large"
    assert sender.error is None, sender.error  # the whole upload was read (and dropped), not reset
    assert tokenize(url, ["still serving"])


def test_an_upload_refused_over_the_byte_budget_gets_one_503_with_retry_after(url):
    holder = connect(url)
    held = 3 * 1024 * 1024
    holder.sendall(head("/v1/tokenize", "Transfer-Encoding: chunked") + chunk(b"x" * held))
    try:
        wait_for_queued(url, lambda value: value >= held)
        connection = connect(url)
        connection.sendall(head("/v1/tokenize", f"Content-Length: {MAX_REQUEST_BYTES}"))
        sender = send_in_background(connection, b"y" * MAX_REQUEST_BYTES)
        stream = read_to_end(connection)
        sender.join(30)
        connection.close()
        assert not stream.reset
        assert [answer.status for answer in stream.answers] == [503], stream
        assert stream.answers[0].headers.get("retry-after") == "1"
        assert stream.answers[0].error()["type"] == "overloaded"
    finally:
        holder.close()
    wait_for_queued(url, lambda value: value == 0)


def test_expect_100_continue_refused_gets_the_final_status_not_100(url):
    connection = connect(url)
    connection.sendall(head("/v1/tokenize", "Content-Length: 33554432", "Expect: 100-continue"))
    answer = read_one(connection)
    assert answer.status == 413 and answer.headers.get("connection") == "close"
    stream = read_to_end(connection)  # the server half-closed: end of stream, no body asked for
    connection.close()
    assert stream.answers == [] and not stream.reset


# -- 2. pipelined requests ---------------------------------------------------------------------------


def test_pipelined_requests_are_answered_in_order(url, documents):
    joined = " ".join(documents) * 8
    texts = [joined[start : start + 2000] for start in range(0, 2_100_000, 2000)]  # about 2 MB in 1,050 texts
    first = orjson.dumps({"texts": texts})
    second = orjson.dumps({"texts": ["the second request"]})
    assert 2_000_000 < len(first) < MAX_REQUEST_BYTES
    data = (
        head("/v1/tokenize", f"Content-Length: {len(first)}")
        + first
        + head("/v1/tokenize", f"Content-Length: {len(second)}", "Connection: close")
        + second
    )
    connection = connect(url)
    sender = send_in_background(connection, data)
    stream = read_to_end(connection)
    sender.join(30)
    connection.close()
    assert [answer.status for answer in stream.answers] == [200, 200], stream.answers[:2]
    assert not stream.reset and stream.rest == b""
    assert len(orjson.loads(stream.answers[0].body)["ids"]) == len(texts)
    assert orjson.loads(stream.answers[1].body)["ids"] == tokenize(url, ["the second request"])


# -- 3. an h2c upgrade offer -------------------------------------------------------------------------


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_an_h2c_upgrade_offer_is_ignored_and_the_body_served(url, framing):
    body = orjson.dumps({"texts": ["upgrade me not", "second text"]})
    upgrade = ("Connection: Upgrade, HTTP2-Settings", "Upgrade: h2c", "HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA")
    if framing == "chunked":
        request = head("/v1/tokenize", *upgrade, "Transfer-Encoding: chunked") + chunk(body) + b"0\r\n\r\n"
    else:
        request = head("/v1/tokenize", *upgrade, f"Content-Length: {len(body)}") + body
    connection = connect(url)
    connection.sendall(request + head("/healthz", "Connection: close", method="GET"))  # then one more request
    stream = read_to_end(connection)
    connection.close()
    assert [answer.status for answer in stream.answers] == [200, 200], stream
    assert orjson.loads(stream.answers[0].body)["ids"] == tokenize(url, ["upgrade me not", "second text"])


# -- 4. malformed HTTP -------------------------------------------------------------------------------


MALFORMED = {
    "length-and-chunked": head("/v1/tokenize", "Content-Length: 5", "Transfer-Encoding: chunked") + b"0\r\n\r\n",
    "duplicate-length": head("/v1/tokenize", "Content-Length: 2", "Content-Length: 3") + b"{}",
    "negative-length": head("/v1/tokenize", "Content-Length: -1") + b"{}",
    "bad-chunk-size": head("/v1/tokenize", "Transfer-Encoding: chunked") + b"zz\r\n{}\r\n0\r\n\r\n",
    "lf-only": b"POST /v1/tokenize HTTP/1.1\nHost: test\nContent-Length: 2\n\n{}",
    "unknown-method": b"BREW /healthz HTTP/1.1\r\nHost: test\r\n\r\n",
}


@pytest.mark.parametrize("request_bytes", list(MALFORMED.values()), ids=list(MALFORMED))
def test_malformed_http_gets_one_json_400(url, request_bytes):
    connection = connect(url)
    connection.sendall(request_bytes)
    stream = read_to_end(connection)
    connection.close()
    assert [answer.status for answer in stream.answers] == [400], stream
    error = stream.answers[0].error()
    assert error["type"] == "invalid_request" and error["message"].startswith("malformed HTTP request"), error
    assert stream.rest == b""


# -- 5. chunked bodies against the budget and the size limit ----------------------------------------


def test_a_chunked_body_is_413_as_soon_as_it_passes_the_limit(url):
    connection = connect(url)
    connection.sendall(head("/v1/tokenize", "Transfer-Encoding: chunked"))
    piece = b"z" * (1 << 16)
    for _ in range(MAX_REQUEST_BYTES // len(piece)):
        connection.sendall(chunk(piece))
    connection.sendall(chunk(b"!"))  # one byte past the limit; the body never ends
    answer = read_one(connection)
    connection.close()
    assert answer.status == 413 and answer.error()["type"] == "payload_too_large"
    assert answer.headers.get("connection") == "close"
    wait_for_queued(url, lambda value: value == 0)


def test_chunked_bytes_count_in_the_budget_as_they_arrive(url):
    first = connect(url)
    second = connect(url)
    try:
        first.sendall(head("/v1/tokenize", "Transfer-Encoding: chunked") + chunk(b"a" * (3 * 1024 * 1024)))
        wait_for_queued(url, lambda value: value >= 3 * 1024 * 1024)  # counted while the body is incomplete
        second.sendall(head("/v1/tokenize", "Transfer-Encoding: chunked"))
        piece = b"b" * (1 << 16)
        answer = None
        for _ in range(MAX_REQUEST_BYTES // len(piece)):
            try:
                second.sendall(chunk(piece))
            except (BrokenPipeError, ConnectionResetError):
                break
        answer = read_one(second)
        assert answer.status == 503 and answer.headers.get("retry-after") == "1", answer
        assert answer.error()["type"] == "overloaded"
        assert queued_bytes(url) <= MAX_QUEUED_BYTES
    finally:
        first.close()
        second.close()
    wait_for_queued(url, lambda value: value == 0)


# -- 6. bodies declared but not sent, and slow bodies -------------------------------------------------


def test_bodies_declared_but_not_sent_hold_no_budget(url):
    idle = [connect(url) for _ in range(4)]
    try:
        for connection in idle:
            connection.sendall(head("/v1/tokenize", f"Content-Length: {MAX_REQUEST_BYTES}") + b"{")
        wait_for_queued(url, lambda value: value == 4)  # one byte each, not 4 x 4 MiB
        assert tokenize(url, ["served while four uploads stall"])
    finally:
        for connection in idle:
            connection.close()
    wait_for_queued(url, lambda value: value == 0)


def test_a_body_slower_than_the_minimum_rate_is_cut_with_408(url):
    connection = connect(url)
    started = time.monotonic()
    connection.sendall(head("/v1/tokenize", f"Content-Length: {MAX_REQUEST_BYTES}") + b'{"texts": [')
    answer = read_one(connection)
    elapsed = time.monotonic() - started
    stream = read_to_end(connection)
    connection.close()
    assert answer.status == 408, answer
    assert answer.error()["type"] == "timeout" and "minimum" in answer.error()["message"]
    assert answer.headers.get("connection") == "close"
    assert stream.answers == [] and not stream.reset
    assert HEADER_TIMEOUT - 0.5 < elapsed < HEADER_TIMEOUT + 5, elapsed
    wait_for_queued(url, lambda value: value == 0)


# -- one bound for every integer field; the OpenAPI document states the real constraints ----------------


@pytest.mark.parametrize("huge", [10**30, 10**310, 2**31], ids=["1e30", "1e310", "2**31"])
@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/tokenize", lambda n: {"texts": ["a"], "max_length": n}, "max_length"),
        ("/v1/pack", lambda n: {"texts": ["a"], "seq_len": n}, "seq_len"),
        ("/v1/pack", lambda n: {"texts": ["a"], "seq_len": 8, "carry": [n]}, "carry"),
        ("/v1/detokenize", lambda n: {"ids": [[1, n]]}, "ids"),
    ],
    ids=["max_length", "seq_len", "carry", "detokenize-ids"],
)
def test_every_integer_field_has_one_bound(url, path, body, field, huge):
    answer = httpx.post(
        f"{url}{path}", content=json.dumps(body(huge)), headers={"content-type": "application/json"}, timeout=30
    )
    assert answer.status_code == 422, answer.text
    assert answer.json()["error"]["field"] == field


def test_the_openapi_document_states_the_limits_the_server_enforces(url):
    document = httpx.get(f"{url}/openapi.json", timeout=10).json()

    def body(path: str) -> dict:
        return document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]

    pack = body("/v1/pack")
    assert pack["properties"]["seq_len"]["minimum"] == 2 and pack["properties"]["seq_len"]["maximum"] == 131072
    assert pack["then"]["properties"]["carry"] == {"type": "null"}  # no carry with best_fit
    assert pack["dependentRequired"] == {"carry_document_starts": ["carry"]}
    assert body("/v1/tokenize")["properties"]["max_length"]["anyOf"][0]["maximum"] == 2**31 - 1
