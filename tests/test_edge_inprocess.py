"""The HTTP edge in this process: the ASGI app create_app() builds, driven through httpx.ASGITransport.

No uvicorn and no port: the lifespan runs here and starts the real worker pool (its processes are the
only ones), so auth, Accept, the error bodies (400/401/404/413/422/503), readiness and the metrics are
checked in milliseconds each. What needs a real server (connections, signals, faults, memory) is in
the other test files.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import sentencepiece as spm

from tests.test_libraries import Reference
from tokenizer_client import wire
from tokenizer_service.http.factory import create_app
from tokenizer_service.settings import BUNDLED_MODELS_DIR, Settings

MODEL = BUNDLED_MODELS_DIR / "default.model"
KEY = "edge-test-key"


@contextlib.asynccontextmanager
async def lifespan(app: Any, state: dict[str, Any]) -> AsyncIterator[None]:
    """Run the app's lifespan as uvicorn does: startup before the first request, shutdown after the last;
    what the lifespan yields lands in `state`, which uvicorn copies into each request's scope."""
    inbox: asyncio.Queue[dict[str, str]] = asyncio.Queue()
    outbox: asyncio.Queue[dict[str, str]] = asyncio.Queue()
    scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": state}
    task = asyncio.ensure_future(app(scope, inbox.get, outbox.put))
    await inbox.put({"type": "lifespan.startup"})
    started = await outbox.get()
    assert started["type"] == "lifespan.startup.complete", started
    try:
        yield
    finally:
        await inbox.put({"type": "lifespan.shutdown"})
        assert (await outbox.get())["type"] == "lifespan.shutdown.complete"
        await task


class Edge:
    """One app, its lifespan and an httpx client on an event loop of its own, for synchronous tests."""

    def __init__(self, models: dict[str, Path] | None = None, **settings: Any) -> None:
        served = [f"{name}={path}" for name, path in (models or {"default": MODEL}).items()]
        self.app = create_app(Settings(model=served, workers=1, **settings))
        self.state: dict[str, Any] = {}
        self.loop = asyncio.new_event_loop()
        self._lifespan = lifespan(self.app, self.state)
        self.loop.run_until_complete(self._lifespan.__aenter__())
        transport = httpx.ASGITransport(app=self.with_state)
        self.client = httpx.AsyncClient(transport=transport, base_url="http://edge.test")

    async def with_state(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        await self.app({**scope, "state": dict(self.state)}, receive, send)

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        return self.loop.run_until_complete(self.client.request(method, path, **kwargs))

    def close(self) -> None:
        self.loop.run_until_complete(self.client.aclose())
        self.loop.run_until_complete(self._lifespan.__aexit__(None, None, None))
        self.loop.close()


@pytest.fixture(scope="module")
def edge() -> Iterator[Edge]:
    served = Edge(max_texts=4, max_request_bytes=4096)
    yield served
    served.close()


@pytest.fixture(scope="module")
def guarded() -> Iterator[Edge]:
    served = Edge(api_keys=[KEY])
    yield served
    served.close()


def error_of(answer: httpx.Response, status: int) -> dict[str, Any]:
    assert answer.status_code == status, answer.text
    assert answer.headers["content-type"].startswith("application/json")
    error: dict[str, Any] = answer.json()["error"]
    assert error["message"]
    return error


def test_tokenize_answers_sentencepieces_ids_in_json_and_binary(edge: Edge) -> None:
    texts = ["Hello, world.", "", "Ünïcödé and emoji 🚀"]
    expected = spm.SentencePieceProcessor(model_file=str(MODEL)).encode(texts)
    answer = edge.request("POST", "/v1/tokenize", json={"texts": texts})
    assert answer.status_code == 200 and answer.json()["ids"] == expected
    assert len(answer.headers["x-tokenizer-model-sha256"]) == 64
    binary = edge.request("POST", "/v1/tokenize", json={"texts": texts}, headers={"Accept": wire.MEDIA_TYPE})
    assert binary.headers["content-type"] == wire.MEDIA_TYPE
    frame = wire.decode(binary.content)
    assert [row.tolist() for row in wire.split_ragged(frame["ids"], frame["offsets"])] == expected


def test_accept_picks_the_format_and_an_unknown_one_gets_json(edge: Edge) -> None:
    for accept in ("application/json", "*/*", "text/html", f"application/json;q=0.5, {wire.MEDIA_TYPE}"):
        answer = edge.request("POST", "/v1/tokenize", json={"texts": ["a"]}, headers={"Accept": accept})
        binary = wire.MEDIA_TYPE in accept
        assert answer.status_code == 200
        assert answer.headers["content-type"].startswith(wire.MEDIA_TYPE if binary else "application/json")


@pytest.mark.parametrize(
    ("body", "status", "kind", "field"),
    [
        (b"{not json", 400, "invalid_json", None),
        (b'{"texts": "a string"}', 422, "invalid_field", "texts"),
        (b'{"texts": ["a"], "model": "nope"}', 404, "model_not_found", "model"),
        (b'{"texts": ["a", "b", "c", "d", "e"]}', 413, "payload_too_large", "texts"),
        (b'{"texts": ["' + b"a" * 5000 + b'"]}', 413, "payload_too_large", None),
        (b'{"texts": ["a"], "surprise": 1}', 422, "invalid_field", "surprise"),
    ],
    ids=["bad-json", "texts-not-a-list", "unknown-model", "too-many-texts", "body-too-large", "unknown-field"],
)
def test_bad_requests_get_a_json_error_saying_what_and_where(edge: Edge, body, status, kind, field) -> None:
    answer = edge.request("POST", "/v1/tokenize", content=body, headers={"Content-Type": "application/json"})
    error = error_of(answer, status)
    assert error["type"] == kind
    assert error.get("field") == field or field is None
    assert edge.request("POST", "/v1/tokenize", json={"texts": ["still here"]}).status_code == 200


def test_a_wrong_id_names_its_row_and_position(edge: Edge) -> None:
    error = error_of(edge.request("POST", "/v1/detokenize", json={"ids": [[1, 2], [3, 10**9]]}), 422)
    assert error["type"] == "invalid_field" and error["field"] == "ids" and error["index"] == 1


def test_unknown_routes_and_methods(edge: Edge) -> None:
    assert edge.request("GET", "/v1/nothing").status_code == 404
    assert edge.request("GET", "/v1/tokenize").status_code == 405


def test_probes_models_and_metrics(edge: Edge) -> None:
    assert edge.request("GET", "/healthz").status_code == 200
    ready = edge.request("GET", "/readyz")
    assert ready.status_code == 200 and ready.json() == {"status": "ready", "models": ["default"]}
    models = edge.request("GET", "/v1/models").json()
    assert [model["name"] for model in models["models"]] == ["default"]
    metrics = edge.request("GET", "/metrics").text
    assert "tokenizer_ready 1.0" in metrics
    assert "\ntokenizer_inflight_requests 0.0\n" in metrics  # the scrape is not a request in flight (issue 36)
    assert 'tokenizer_requests_total{endpoint="/v1/tokenize",status="200"}' in metrics


def test_api_keys_guard_v1_and_leave_the_probes_open(guarded: Edge) -> None:
    missing = guarded.request("POST", "/v1/tokenize", json={"texts": ["a"]})
    assert error_of(missing, 401)["type"] == "unauthorized"
    assert "Bearer" in missing.headers["www-authenticate"]
    wrong = guarded.request("POST", "/v1/tokenize", json={"texts": ["a"]}, headers={"Authorization": "Bearer no"})
    assert error_of(wrong, 401)["type"] == "unauthorized"
    assert 'error="invalid_token"' in wrong.headers["www-authenticate"]
    assert KEY not in wrong.text
    assert guarded.request("GET", "/v1/models").status_code == 401
    right = guarded.request("POST", "/v1/tokenize", json={"texts": ["a"]}, headers={"Authorization": f"Bearer {KEY}"})
    assert right.status_code == 200
    for path in ("/healthz", "/readyz", "/metrics"):
        assert guarded.request("GET", path).status_code == 200


def test_before_the_lifespan_has_started_the_pool_v1_work_gets_503_with_retry_after() -> None:
    app = create_app(Settings(model=[f"default={MODEL}"], workers=1))

    async def ask() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://edge.test") as client:
            return await client.post("/v1/tokenize", json={"texts": ["a"]})

    answer = asyncio.run(ask())
    assert error_of(answer, 503)["type"] == "unavailable"
    assert "starting" in answer.json()["error"]["message"]
    assert answer.headers["retry-after"] == "1"


def test_beyond_the_concurrency_limit_v1_work_gets_503_at_once() -> None:
    served = Edge(max_concurrent_requests=1)
    try:
        big = {"texts": ["word " * 20000] * 4}

        async def two_at_once() -> list[httpx.Response]:
            return list(
                await asyncio.gather(
                    served.client.post("/v1/tokenize", json=big), served.client.post("/v1/tokenize", json=big)
                )
            )

        answers = served.loop.run_until_complete(two_at_once())
        statuses = sorted(answer.status_code for answer in answers)
        assert statuses == [200, 503]
        refused = next(answer for answer in answers if answer.status_code == 503)
        assert refused.json()["error"]["type"] == "overloaded" and refused.headers["retry-after"] == "1"
    finally:
        served.close()


def test_tokenizer_json_and_tiktoken_models_are_served_with_their_librarys_ids(library_models, multilingual) -> None:
    """The served path of the other libraries (every kind, split requests, over a real server: test_tokenizer_kinds)."""
    served = Edge({"hfbpe": library_models["hfbpe"], "tt": library_models["tt"]})
    try:
        texts = [*multilingual[:40], "<|endoftext|> is text unless parsed", ""]
        for name in ("hfbpe", "tt"):
            reference = Reference(library_models[name])
            for parse in (False, True):
                body = {"texts": texts, "model": name, "parse_special_tokens": parse}
                answer = served.request("POST", "/v1/tokenize", json=body)
                assert answer.status_code == 200, answer.text
                assert answer.json()["ids"] == [reference.encode(text, parse) for text in texts]
            rows = [reference.encode(text) for text in texts]
            decoded = served.request("POST", "/v1/detokenize", json={"ids": rows, "model": name})
            assert decoded.json()["texts"] == [reference.decode(row) for row in rows]
        sampled = {"texts": ["a"], "model": "hfbpe", "sample": {"alpha": 0.1, "seed": 1}}
        assert error_of(served.request("POST", "/v1/tokenize", json=sampled), 422)["field"] == "sample"
        pool = served.state["service"].state.pool
        assert pool.sampler is None and len(pool.pids()) == 1  # no SentencePiece model: no sampler process
    finally:
        served.close()


@pytest.mark.parametrize("readiness", ["STARTING", "REBUILDING", "STOPPING"])
def test_readyz_not_ready_says_why_in_the_error_shape(readiness):
    """A probe's: the 503 was {"status": "not ready"}, not the documented {"error": {"type", "message"}}."""
    import asyncio
    import json
    from types import SimpleNamespace

    from tokenizer_service.core.readiness import Readiness
    from tokenizer_service.http.routes.health import readyz

    service = SimpleNamespace(state=SimpleNamespace(readiness=Readiness[readiness]))
    answer = asyncio.run(readyz(service))  # type: ignore[arg-type]
    body = json.loads(answer.body)
    assert answer.status_code == 503 and answer.headers["retry-after"] == "1"
    assert body["status"] == "not ready" and body["error"]["type"] == "unavailable"
    assert body["error"]["message"].startswith("not ready: ")
