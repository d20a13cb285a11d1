"""Faults and overload against real servers: killed and hung workers, poison texts, timeouts,
disconnects, backpressure, API keys, CORS and graceful shutdown.

Faults are injected from outside the service: `tests/faults/sitecustomize.py` on a test server's
PYTHONPATH makes its worker processes crash, hang or sleep on texts that start with `FAULT:`, and
`kill -9` is the real thing. Every answer is checked against in-process sentencepiece.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson
import psutil
import pytest
import sentencepiece as spm

from tests.conftest import start_server, stop_server
from tokenizer_service.settings import Settings
from tokenizer_service.tools.launcher import metric_total, worker_pids

pytestmark = pytest.mark.slow  # faults: workers killed, stalled, signals; part of .ci/run's slow stage

FAULTS = Path(__file__).parent / "faults"
API_KEYS = ("first-key-0123456789", "second-key-abcdefghij")
ALLOWED_ORIGIN = "https://notebook.example"


@dataclass
class Running:
    url: str
    process: subprocess.Popen[bytes]
    sp: spm.SentencePieceProcessor
    log: Path
    headers: dict[str, str] = field(default_factory=dict)

    def post(self, path: str, document: object, timeout: float = 60.0) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", json=document, headers=self.headers, timeout=timeout)

    def tokenize(self, texts: list[str], timeout: float = 60.0, **options: object) -> httpx.Response:
        return self.post("/v1/tokenize", {"texts": texts, "model": "uni", **options}, timeout=timeout)

    def metric(self, name: str, **labels: str) -> float:
        return metric_total(self.url, name, **labels)

    def wait_for_metric(self, name: str, check: Callable[[float], bool], timeout: float = 15.0) -> float:
        deadline = time.monotonic() + timeout
        while True:
            value = self.metric(name)
            if check(value) or time.monotonic() > deadline:
                return value
            time.sleep(0.02)

    def workers(self) -> list[psutil.Process]:
        """The server's worker processes (every lane), not multiprocessing's resource tracker."""
        return [psutil.Process(pid) for pid in worker_pids(self.process.pid)]


def fault_env() -> dict[str, str]:
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(FAULTS), os.environ.get("PYTHONPATH")]))}


@pytest.fixture(scope="module")
def uni_args(model_files: dict[str, Path]) -> list[str]:
    return ["--model", f"uni={model_files['uni']}", "--log-level", "warning"]


def launch(
    tmp_path_factory: pytest.TempPathFactory,
    name: str,
    args: list[str],
    model_files: dict[str, Path],
    env: dict[str, str] | None = None,
) -> Running:
    log = tmp_path_factory.mktemp(name) / "server.log"
    url, process = start_server(args, log, env={**fault_env(), **(env or {})})
    return Running(url, process, spm.SentencePieceProcessor(model_file=str(model_files["uni"])), log)


@pytest.fixture(scope="module")
def faulty(tmp_path_factory, model_files, uni_args) -> Iterator[Running]:
    """Two workers; a chunk that runs 2 s past its deadline counts as stalled."""
    server = launch(tmp_path_factory, "faulty", [*uni_args, "--workers", "2", "--stall-timeout", "2"], model_files)
    yield server
    stop_server(server.process)


def body_size(texts: list[str]) -> int:
    return len(orjson.dumps({"texts": texts, "model": "uni"}))


def queue_budget(documents: list[str]) -> int:
    """Room for a small request, 600 documents and 300 more, but not for 600 twice."""
    return body_size(documents[:600]) + body_size(documents[:300]) + 1000


@pytest.fixture(scope="module")
def guarded(tmp_path_factory, model_files, uni_args, documents) -> Iterator[Running]:
    """One worker, tight limits, API keys and CORS."""
    args = [
        *uni_args,
        "--workers", "1",
        "--request-timeout", "3",
        "--max-queued-bytes", str(queue_budget(documents)),
        "--max-concurrent-requests", "4",
        "--cors-origins", ALLOWED_ORIGIN,
    ]  # fmt: skip
    server = launch(tmp_path_factory, "guarded", args, model_files, env={"TOKENIZER_API_KEYS": ",".join(API_KEYS)})
    server.headers = {"Authorization": f"Bearer {API_KEYS[1]}"}
    yield server
    stop_server(server.process)


def in_background(function: Callable[[], object]) -> tuple[threading.Thread, list[object]]:
    """Run `function` in a thread; its result, or the exception it raised, lands in the list."""
    result: list[object] = []

    def run() -> None:
        try:
            result.append(function())
        except Exception as exc:
            result.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def busiest_worker(server: Running, load: Callable[[], object]) -> psutil.Process:
    """The worker whose CPU time grows most while `load` runs: tells the lanes apart from outside."""
    workers = server.workers()
    before = {worker.pid: sum(worker.cpu_times()[:2]) for worker in workers}
    load()
    return max(workers, key=lambda worker: sum(worker.cpu_times()[:2]) - before[worker.pid])


def check_answer(server: Running, texts: list[str], response: httpx.Response) -> None:
    assert response.status_code == 200, response.text
    assert response.json()["ids"] == server.sp.encode(texts)


class Load:
    """Client threads that tokenize random batches until stopped, recording every outcome."""

    def __init__(
        self, server: Running, documents: list[str], clients: int, *, batch: int = 64, **options: object
    ) -> None:
        self.server, self.documents, self.options, self.batch = server, documents, options, batch
        self.outcomes: list[tuple[int, bool]] = []
        self._answered = threading.Condition()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(seed,), daemon=True) for seed in range(clients)]

    def _run(self, seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(timeout=60, headers=self.server.headers) as client:
            while not self._stop.is_set():
                texts = rng.sample(self.documents, rng.randint(1, self.batch))
                body = {"texts": texts, "model": "uni", **self.options}
                response = client.post(f"{self.server.url}/v1/tokenize", json=body)
                if response.status_code != 200:
                    self.outcomes.append((response.status_code, False))
                elif self.options.get("sample"):  # sampled ids differ from run to run: check they spell the text
                    decoded = self.server.sp.decode(response.json()["ids"])
                    self.outcomes.append((200, decoded == self.server.sp.decode(self.server.sp.encode(texts))))
                else:
                    self.outcomes.append((200, response.json()["ids"] == self.server.sp.encode(texts)))
                with self._answered:
                    self._answered.notify_all()

    def wait_for(self, more: int, timeout: float = 60.0) -> None:
        """Until `more` answers beyond those received so far have come back (the load is really on)."""
        target = len(self.outcomes) + more
        with self._answered:
            assert self._answered.wait_for(lambda: len(self.outcomes) >= target, timeout), "the load stopped"

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=60)
        assert not any(thread.is_alive() for thread in self._threads), "a client hung"


# -- worker crashes ---------------------------------------------------------------------------------


def test_kill_9_under_load_rebuilds_once_and_every_answer_is_right(faulty, documents):
    restarts = faulty.metric("tokenizer_worker_restarts_total")
    rebuilds = faulty.metric("tokenizer_worker_rebuild_seconds_count")
    # Texts that keep a worker's CPU busy for 0.2 s, four at a time, keep every worker running a
    # job (small ones take microseconds), so the victim dies holding one: that job is retried, the
    # one queued behind it moves to another worker.
    spinning = ["FAULT:spin:0.2 then tokenized"]
    with Load(faulty, documents, clients=6) as load, Load(faulty, spinning, clients=4, batch=1) as heavy:
        victim = busiest_worker(faulty, lambda: time.sleep(1.0))
        victim.send_signal(signal.SIGKILL)
        faulty.wait_for_metric("tokenizer_worker_restarts_total", lambda value: value > restarts)
        faulty.wait_for_metric("tokenizer_worker_rebuild_seconds_count", lambda value: value > rebuilds)
        load.wait_for(20)  # answers after the pool is whole again
        heavy.wait_for(2)
    assert len(load.outcomes) > 20 and len(heavy.outcomes) > 2
    assert all(outcome == (200, True) for outcome in load.outcomes + heavy.outcomes), set(load.outcomes)
    assert faulty.metric("tokenizer_worker_restarts_total") == restarts + 1  # only the dead worker restarts
    assert faulty.metric("tokenizer_chunk_retries_total") >= 1
    assert victim.pid not in {worker.pid for worker in faulty.workers()}
    assert httpx.get(f"{faulty.url}/readyz").status_code == 200
    rebuilds = faulty.metric("tokenizer_worker_rebuild_seconds_count")
    print(f"\nrebuild after kill -9: {faulty.metric('tokenizer_worker_rebuild_seconds_sum') / rebuilds:.2f}s mean")


def test_kill_9_of_the_seeded_sampler(faulty, documents):
    sample = {"alpha": 0.1, "seed": 7}
    restarts = faulty.metric("tokenizer_worker_restarts_total")
    rebuilds = faulty.metric("tokenizer_worker_rebuild_seconds_count")
    with Load(faulty, documents, clients=2, sample=sample) as load:
        victim = busiest_worker(faulty, lambda: time.sleep(1.0))
        victim.send_signal(signal.SIGKILL)
        faulty.wait_for_metric("tokenizer_worker_restarts_total", lambda value: value > restarts)
        faulty.wait_for_metric("tokenizer_worker_rebuild_seconds_count", lambda value: value > rebuilds)
        load.wait_for(5)  # answers after the sampler is back
    assert len(load.outcomes) > 5
    assert all(outcome == (200, True) for outcome in load.outcomes), set(load.outcomes)
    assert faulty.metric("tokenizer_worker_restarts_total") == restarts + 1
    first = faulty.tokenize(documents[:3], sample=sample).json()["ids"]
    assert faulty.tokenize(documents[:3], sample=sample).json()["ids"] == first  # reproducible again


def test_a_worker_that_dies_idle_is_replaced_while_the_others_serve(faulty):
    """Only the dead worker restarts: the pool stays ready and answers throughout."""
    assert httpx.get(f"{faulty.url}/readyz").status_code == 200
    restarts = faulty.metric("tokenizer_worker_restarts_total")
    before = {worker.pid for worker in faulty.workers()}
    victim = faulty.workers()[0]
    victim.send_signal(signal.SIGKILL)  # an idle pool: nobody is waiting on it
    statuses = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        statuses.append(httpx.get(f"{faulty.url}/readyz").status_code)
        check_answer(faulty, ["still answering"], faulty.tokenize(["still answering"]))
        now = {worker.pid for worker in faulty.workers()}
        if len(now) == len(before) and victim.pid not in now:
            break
        time.sleep(0.01)
    assert set(statuses) == {200}
    assert faulty.metric("tokenizer_worker_restarts_total") == restarts + 1
    assert len(before - {worker.pid for worker in faulty.workers()}) == 1  # the others kept their pid


# -- poison input -----------------------------------------------------------------------------------


def test_a_text_that_kills_workers_is_refused_by_index_and_others_are_served(faulty, documents):
    texts = documents[:40]
    poisoned = [*texts[:17], "FAULT:kill", *texts[17:]]
    poison_count = faulty.metric("tokenizer_poison_inputs_total")
    with Load(faulty, documents, clients=3) as load:
        load.wait_for(3)  # the others' load is on
        started = time.monotonic()
        response = faulty.tokenize(poisoned)
        print(f"\nkilling poison text answered 422 after {time.monotonic() - started:.2f}s")
        load.wait_for(3)  # and others are still served after it
    assert response.status_code == 422, response.text
    assert response.json()["error"] == {
        "type": "poison_input",
        "message": "texts[17] crashed or hung a tokenizer worker twice; it is refused",
        "field": "texts",
        "index": 17,
    }
    assert all(outcome == (200, True) for outcome in load.outcomes), set(load.outcomes)
    assert faulty.metric("tokenizer_poison_inputs_total") == poison_count + 1
    # Sent again, it is refused at once from memory, without crashing anything.
    restarts = faulty.metric("tokenizer_worker_restarts_total")
    again = faulty.tokenize(["fine", "FAULT:kill"])
    assert again.status_code == 422 and again.json()["error"]["index"] == 1
    assert faulty.metric("tokenizer_worker_restarts_total") == restarts
    check_answer(faulty, texts, faulty.tokenize(texts))


def test_a_killing_text_in_a_binary_body_is_remembered_as_in_json(faulty, documents):
    """The client's default body is a frame of UTF-8 (docs/api.md, "Binary request bodies"): the text that killed
    the workers is found in it as in JSON, remembered, and refused from memory the next time."""
    from tokenizer_client import wire
    from tokenizer_client._requests import texts_frame

    headers = {**faulty.headers, "content-type": wire.MEDIA_TYPE}
    text = "FAULT:kill from a binary body"
    body = texts_frame({"texts": [*documents[:5], text], "model": "uni"})
    assert body is not None
    response = httpx.post(f"{faulty.url}/v1/tokenize", content=body, headers=headers, timeout=60)
    assert response.status_code == 422 and response.json()["error"]["index"] == 5, response.text
    restarts = faulty.metric("tokenizer_worker_restarts_total")
    again = texts_frame({"texts": ["fine", text], "model": "uni"})
    answer = httpx.post(f"{faulty.url}/v1/tokenize", content=again, headers=headers, timeout=60)
    assert answer.status_code == 422 and answer.json()["error"]["index"] == 1, answer.text
    assert faulty.metric("tokenizer_worker_restarts_total") == restarts  # refused from memory: nothing crashed


@pytest.mark.parametrize("position", [20, 350], ids=["kept chunk", "shared chunk"])
def test_a_killing_text_in_a_lone_split_request_is_refused_by_index(faulty, documents, position):
    """A lone large request is split over both idle workers: the one that parsed it keeps the first chunk and
    shares the second. Whichever part holds the text, the worker running it dies twice (the shared chunk is
    withdrawn when the first worker dies), the text is named, and the same request without it is answered."""
    texts = documents[:400]
    assert sum(map(len, texts)) >= 2 * Settings.model_fields["min_chunk_chars"].default  # two chunks of at least that
    poisoned = [*texts[:position], f"FAULT:kill in the request's {position}", *texts[position:]]
    restarts = faulty.metric("tokenizer_worker_restarts_total")
    # Both workers serve (every restart so far is back), so both are idle when the request arrives.
    rebuilt = faulty.wait_for_metric("tokenizer_worker_rebuild_seconds_count", lambda value: value >= restarts)
    assert rebuilt >= restarts, "a restarted worker did not come back"
    response = faulty.tokenize(poisoned)
    assert response.status_code == 422, response.text
    assert response.json()["error"]["index"] == position
    assert faulty.metric("tokenizer_worker_restarts_total") >= restarts + 2
    check_answer(faulty, texts, faulty.tokenize(texts))
    assert httpx.get(f"{faulty.url}/readyz").status_code == 200


def test_a_text_that_hangs_a_worker_is_refused_by_index(faulty, documents):
    stalls = faulty.metric("tokenizer_worker_stalls_total")
    started = time.monotonic()
    response = faulty.tokenize([*documents[:5], "FAULT:hang"])
    elapsed = time.monotonic() - started
    print(f"\nhanging poison text answered 422 after {elapsed:.2f}s (stall timeout 2 s)")
    assert response.status_code == 422, response.text
    assert response.json()["error"]["index"] == 5
    assert faulty.metric("tokenizer_worker_stalls_total") == stalls + 2  # once as usual, once run carefully
    assert elapsed < 30
    check_answer(faulty, documents[:5], faulty.tokenize(documents[:5]))


def test_a_worker_exception_leaks_nothing(faulty):
    response = faulty.tokenize(["FAULT:raise"])
    assert response.status_code == 500
    assert response.json() == {"error": {"type": "internal_error", "message": "internal server error"}}
    assert "secret" not in response.text and "Traceback" not in response.text
    check_answer(faulty, ["still fine"], faulty.tokenize(["still fine"]))


# -- timeouts, disconnects, backpressure ----------------------------------------------------------


def raw_post(server: Running, body: dict[str, object]) -> socket.socket:
    """Send a whole POST /v1/tokenize on a raw socket and return it unread, to hang up on later."""
    payload = orjson.dumps(body)
    head = (
        f"POST /v1/tokenize HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        f"Authorization: {server.headers['Authorization']}\r\nContent-Length: {len(payload)}\r\n\r\n"
    )
    host, port = server.url.removeprefix("http://").split(":")
    connection = socket.create_connection((host, int(port)))
    connection.sendall(head.encode() + payload)
    return connection


def test_timeout_answers_504_and_withdraws_queued_work(guarded, documents):
    timeouts = guarded.metric("tokenizer_cancelled_requests_total", reason="timeout")
    withdrawn = guarded.metric("tokenizer_cancelled_chunks_total")
    # The only worker sleeps 5 s; one more chunk waits in the process pool, a third one here.
    blocker, _ = in_background(lambda: guarded.tokenize(["FAULT:sleep:5"]))
    guarded.wait_for_metric("tokenizer_queued_bytes", lambda value: value >= 1)
    started = time.monotonic()
    second, second_answer = in_background(lambda: guarded.tokenize(documents[:100]))
    third, third_answer = in_background(lambda: guarded.tokenize(documents[100:400]))
    for thread in (second, third):
        thread.join(timeout=30)
    elapsed = time.monotonic() - started
    for answer in (second_answer[0], third_answer[0]):
        assert isinstance(answer, httpx.Response)
        assert answer.status_code == 504
        assert answer.json()["error"] == {
            "type": "timeout",
            "message": "the request took longer than the server's limit of 3s",
        }
    assert 2.5 < elapsed < 10
    blocker.join(timeout=30)
    assert guarded.metric("tokenizer_cancelled_requests_total", reason="timeout") == timeouts + 3
    assert guarded.metric("tokenizer_cancelled_chunks_total") >= withdrawn + 1
    assert guarded.wait_for_metric("tokenizer_queued_bytes", lambda value: value == 0) == 0
    check_answer(guarded, documents[:10], guarded.tokenize(documents[:10]))


def test_a_client_that_hangs_up_has_its_queued_work_withdrawn(guarded, documents):
    disconnects = guarded.metric("tokenizer_cancelled_requests_total", reason="disconnect")
    withdrawn = guarded.metric("tokenizer_cancelled_chunks_total")
    blocker, blocked = in_background(lambda: guarded.tokenize(["FAULT:sleep:2"]))
    first = guarded.wait_for_metric("tokenizer_queued_bytes", lambda value: value >= 1)
    in_pool, _ = in_background(lambda: guarded.tokenize(["next in line"]))
    both = guarded.wait_for_metric("tokenizer_queued_bytes", lambda value: value > first)
    assert both == body_size(["FAULT:sleep:2"]) + body_size(["next in line"])
    connection = raw_post(guarded, {"texts": documents[:500], "model": "uni"})
    queued = both + body_size(documents[:500])
    assert guarded.wait_for_metric("tokenizer_queued_bytes", lambda value: value >= queued) == queued
    connection.close()
    # Withdrawn at once, while the worker is still asleep.
    assert guarded.wait_for_metric("tokenizer_queued_bytes", lambda value: value <= both, timeout=1.5) <= both
    assert blocker.is_alive()
    blocker.join(timeout=30)
    in_pool.join(timeout=30)
    assert isinstance(blocked[0], httpx.Response) and blocked[0].status_code == 200
    assert guarded.metric("tokenizer_cancelled_requests_total", reason="disconnect") == disconnects + 1
    assert guarded.metric("tokenizer_cancelled_chunks_total") == withdrawn + 1
    assert guarded.metric("tokenizer_requests_total", endpoint="/v1/tokenize", status="499") >= 1


def test_a_full_queue_answers_503_at_once(guarded, documents):
    blocker, _ = in_background(lambda: guarded.tokenize(["FAULT:sleep:1.5"]))
    first = guarded.wait_for_metric("tokenizer_queued_bytes", lambda value: value >= 1)
    waiting, waited = in_background(lambda: guarded.tokenize(documents[:600]))
    guarded.wait_for_metric("tokenizer_queued_bytes", lambda value: value >= first + body_size(documents[:600]))
    started = time.monotonic()
    refused = guarded.tokenize(documents[:600])
    assert time.monotonic() - started < 1.0
    assert refused.status_code == 503
    assert refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["type"] == "overloaded"
    assert f"limit of {queue_budget(documents)}" in refused.json()["error"]["message"]
    fits = guarded.tokenize(documents[:300])  # small + 600 + 300 fit the budget: admitted, and waits its turn
    check_answer(guarded, documents[:300], fits)
    for thread in (blocker, waiting):
        thread.join(timeout=30)
    check_answer(guarded, documents[:600], waited[0])  # type: ignore[arg-type]
    check_answer(guarded, documents[:600], guarded.tokenize(documents[:600]))
    assert guarded.metric("tokenizer_rejected_requests_total", reason="queue") >= 1


def test_too_many_requests_at_once_answers_503(guarded):
    host, port = guarded.url.removeprefix("http://").split(":")
    stalled = []
    for _ in range(4):  # headers sent, body never finished: each holds a request slot
        connection = socket.create_connection((host, int(port)))
        connection.sendall(
            f"POST /v1/tokenize HTTP/1.1\r\nHost: t\r\nAuthorization: {guarded.headers['Authorization']}\r\n"
            "Content-Length: 1000\r\n\r\n{".encode()
        )
        stalled.append(connection)
    try:
        guarded.wait_for_metric("tokenizer_inflight_requests", lambda value: value >= 4)  # the scrape not counted
        refused = guarded.tokenize(["one too many"])
        assert refused.status_code == 503 and refused.json()["error"]["type"] == "overloaded"
        assert refused.headers["retry-after"] == "1"
        assert httpx.get(f"{guarded.url}/healthz").status_code == 200  # only /v1 is capped
    finally:
        for connection in stalled:
            connection.close()
    guarded.wait_for_metric("tokenizer_inflight_requests", lambda value: value == 0)
    check_answer(guarded, ["room again"], guarded.tokenize(["room again"]))


# -- API keys and CORS ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "authorization",
    [None, "Bearer wrong-key", f"Basic {API_KEYS[0]}", "Bearer", f"Bearer {API_KEYS[0]}x", API_KEYS[0]],
)
def test_v1_needs_a_configured_key(guarded, authorization):
    headers = {} if authorization is None else {"Authorization": authorization}
    for method, path in (
        ("POST", "/v1/tokenize"),
        ("POST", "/v1/detokenize"),
        ("POST", "/v1/pack"),
        ("GET", "/v1/models"),
        ("GET", "/v1/nothing"),
        ("GET", "/nothing"),
    ):
        response = httpx.request(method, f"{guarded.url}{path}", json={"texts": ["x"]}, headers=headers)
        assert response.status_code == 401, (path, response.text)
        assert response.headers["www-authenticate"].startswith("Bearer")
        assert response.json()["error"]["type"] == "unauthorized"
        assert API_KEYS[0] not in response.text


def test_refusals_before_routing_are_counted_under_their_route(guarded):
    before = guarded.metric("tokenizer_requests_total", endpoint="/v1/pack", status="401")
    assert httpx.post(f"{guarded.url}/v1/pack", json={"texts": ["x"], "seq_len": 8}).status_code == 401
    assert guarded.metric("tokenizer_requests_total", endpoint="/v1/pack", status="401") == before + 1


def test_every_configured_key_works_and_probes_stay_open(guarded):
    for key in API_KEYS:
        answer = httpx.post(
            f"{guarded.url}/v1/tokenize",
            json={"texts": ["key"], "model": "uni"},
            headers={"Authorization": f"bearer {key}"},
        )
        check_answer(guarded, ["key"], answer)
    for path in ("/healthz", "/readyz", "/metrics", "/openapi.json", "/docs"):
        assert httpx.get(f"{guarded.url}{path}").status_code == 200
    # Refused before the body is read: an unauthenticated client cannot make the server buffer anything.
    huge = httpx.post(f"{guarded.url}/v1/tokenize", content=b"x" * (8 << 20), timeout=30)
    assert huge.status_code == 401
    schema = httpx.get(f"{guarded.url}/openapi.json").json()
    assert schema["components"]["securitySchemes"] == {"bearer": {"type": "http", "scheme": "bearer"}}
    assert schema["paths"]["/v1/tokenize"]["post"]["security"] == [{"bearer": []}]
    assert "security" not in schema["paths"]["/healthz"]["get"]


def test_cors_only_for_configured_origins(guarded, server):
    preflight = {"Origin": ALLOWED_ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}  # fmt: skip
    allowed = httpx.options(f"{guarded.url}/v1/tokenize", headers=preflight)
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    other = httpx.options(f"{guarded.url}/v1/tokenize", headers={**preflight, "Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in other.headers
    # A server without --cors-origins answers no CORS at all.
    plain = httpx.options(f"{server.url}/v1/tokenize", headers=preflight)
    assert "access-control-allow-origin" not in plain.headers
    answer = httpx.post(f"{server.url}/v1/tokenize", json={"texts": ["x"]}, headers={"Origin": ALLOWED_ORIGIN})
    assert answer.status_code == 200 and "access-control-allow-origin" not in answer.headers


# -- graceful shutdown ------------------------------------------------------------------------------


def gone(pids: list[int]) -> bool:
    return not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in pids)


def assert_gone(pids: list[int], message: str, timeout: float = 10.0) -> None:
    """Every one of these processes exits (a zombie counts as gone) within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not gone(pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone(pids), message


def test_sigterm_finishes_in_flight_requests_and_leaves_no_worker(tmp_path_factory, model_files, uni_args):
    server = launch(tmp_path_factory, "drain", [*uni_args, "--workers", "2", "--drain-timeout", "20"], model_files)
    try:
        assert len(server.workers()) == 3  # two workers and the seeded sampler
        pids = [child.pid for child in psutil.Process(server.process.pid).children(recursive=True)]
        texts = ["FAULT:sleep:2 then tokenized", "and another text"]
        request, answer = in_background(lambda: server.tokenize(texts))
        server.wait_for_metric("tokenizer_queued_bytes", lambda value: value >= 1)
        server.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # until the listening socket is closed: no longer accepting
            try:
                httpx.get(f"{server.url}/healthz", timeout=2)
            except httpx.ConnectError:
                break
            except httpx.ReadError:  # reset: the kernel queued it as the listening socket closed; look again
                pass
            time.sleep(0.02)
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{server.url}/healthz", timeout=2)
        request.join(timeout=30)
        check_answer(server, texts, answer[0])  # type: ignore[arg-type]
        # uvicorn re-raises the signal it handled once it has shut down cleanly.
        assert server.process.wait(timeout=30) in (0, -signal.SIGTERM)
        assert "Traceback" not in server.log.read_text()
        assert_gone(pids, "a worker process outlived the server")
    finally:
        stop_server(server.process)


def test_workers_exit_when_the_server_is_killed(tmp_path_factory, model_files, uni_args):
    """kill -9 of the server process alone (no process group): its workers must not live on, orphaned."""
    server = launch(tmp_path_factory, "orphans", [*uni_args, "--workers", "2"], model_files)
    try:
        pids = [worker.pid for worker in server.workers()]
        assert len(pids) == 3  # two workers and the seeded sampler
        server.process.kill()
        server.process.wait(timeout=10)
        assert_gone(pids, "a worker process outlived its killed server")
    finally:
        for pid in pids:
            with contextlib.suppress(psutil.NoSuchProcess):
                psutil.Process(pid).kill()
        stop_server(server.process)


def test_drain_timeout_bounds_shutdown_even_with_a_hung_worker(tmp_path_factory, model_files, uni_args):
    args = [*uni_args, "--workers", "1", "--drain-timeout", "1", "--stall-timeout", "600"]
    server = launch(tmp_path_factory, "hung", args, model_files)
    try:
        pids = [child.pid for child in psutil.Process(server.process.pid).children(recursive=True)]
        request, answer = in_background(lambda: server.tokenize(["FAULT:hang"], timeout=30))
        server.wait_for_metric("tokenizer_queued_bytes", lambda value: value >= 1)
        started = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        server.process.wait(timeout=30)
        assert time.monotonic() - started < 15
        request.join(timeout=30)
        assert isinstance(answer[0], httpx.Response), answer  # answered, not dropped
        assert answer[0].status_code == 503 and answer[0].headers["retry-after"] == "1"
        assert answer[0].json()["error"]["type"] == "unavailable"
        assert "Traceback" not in server.log.read_text()
        assert_gone(pids, "the hung worker outlived the server")
    finally:
        stop_server(server.process)


def test_a_model_file_replaced_on_disk_is_never_served(tmp_path_factory, model_files, documents):
    """A worker restarted after a crash is a fork of the zygote, which holds the model announced at startup:
    it serves that model, whatever the file holds now. One that loads the file itself (the zygote gone too)
    checks the file still holds the bytes announced at startup, and refuses to start on it."""
    directory = tmp_path_factory.mktemp("swap")
    served = directory / "uni.model"
    shutil.copyfile(model_files["uni"], served)
    server = launch(tmp_path_factory, "swap", ["--model", f"uni={served}", "--workers", "1"], model_files)
    try:
        check_answer(server, ["before the swap"], server.tokenize(["before the swap"]))
        shutil.copyfile(model_files["bpe"], served)  # another model under the same name
        restarts = server.metric("tokenizer_worker_restarts_total")
        victim = busiest_worker(server, lambda: [server.tokenize(documents[:500]) for _ in range(3)])
        victim.send_signal(signal.SIGKILL)  # idle by now: the pool's watchdog notices
        server.wait_for_metric("tokenizer_worker_restarts_total", lambda value: value > restarts)
        check_answer(server, ["after the swap"], server.tokenize(["after the swap"]))  # the announced model's ids
        (zygote,) = [
            child
            for child in psutil.Process(server.process.pid).children()
            if "multiprocessing.forkserver" in " ".join(child.cmdline())
        ]
        victims = server.workers()  # found through the zygote: once it is gone, they are no children of it
        zygote.send_signal(signal.SIGKILL)  # multiprocessing starts another fork server, which holds no model
        deadline = time.monotonic() + 10
        while zygote.is_running() and zygote.status() != psutil.STATUS_ZOMBIE:  # dead; its parent reaps it later
            assert time.monotonic() < deadline, "the zygote outlived SIGKILL"
            time.sleep(0.02)
        restarts = server.metric("tokenizer_worker_restarts_total")
        assert victims
        for victim in victims:
            victim.send_signal(signal.SIGKILL)
        server.wait_for_metric("tokenizer_worker_restarts_total", lambda value: value > restarts)
        refused = server.tokenize(["after the swap"])
        assert refused.status_code == 503, refused.text  # never ids from the other file
        assert refused.json()["error"]["type"] == "unavailable" and refused.headers["retry-after"] == "1"
        assert httpx.get(f"{server.url}/readyz").status_code == 503
        assert "changed since the server started" in server.log.read_text()
        shutil.copyfile(model_files["uni"], served)  # the announced file back: the next try serves
        deadline = time.monotonic() + 30
        while httpx.get(f"{server.url}/readyz").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        check_answer(server, ["after the swap"], server.tokenize(["after the swap"]))
    finally:
        stop_server(server.process)


def test_a_process_that_never_closes_its_pool_still_exits(tmp_path):
    """multiprocessing's exit handler SIGTERMs daemon children and joins them: workers must not ignore it
    (they keep out of a signal to the server's process group by having a group of their own instead)."""
    program = tmp_path / "leave.py"
    program.write_text(
        "import asyncio\n"
        "from tokenizer_service.core.handler import Limits\n"
        "from tokenizer_service.metrics import Metrics\n"
        "from tokenizer_service.core.pool import WorkerPool\n"
        "from tokenizer_service.core.registry import ModelRegistry\n"
        "from tokenizer_service.settings import BUNDLED\n\n"
        "async def main():\n"
        "    registry = ModelRegistry.from_paths(dict(BUNDLED))\n"
        "    limits = Limits(max_texts=8, max_seq_len=8, min_chunk_chars=8, max_request_bytes=1024)\n"
        "    pool = WorkerPool(list(registry.models.values()), registry.default, 1, Metrics(), limits)\n"
        "    await pool.start()\n"
        "    print('started', flush=True)\n\n"
        "if __name__ == '__main__':\n"
        "    asyncio.run(main())\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    result = subprocess.run([sys.executable, str(program)], capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 0 and result.stdout.strip() == "started", result.stderr
