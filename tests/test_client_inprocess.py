"""The client's own behaviour, in this process: no server, no socket; httpx.MockTransport answers.

Both clients take ``transport=`` (an ``httpx.MockTransport`` serves either). `Service` plays the
tokenizer-service: each text's ids are its UTF-8 bytes, /v1/pack packs them with tokenizer_client.packing, and
a test can make a replica refuse connections, answer an error, or change its model's sha256. What
needs worker processes (the ids of real models, backpressure, a killed server) stays in the tests
that start servers (test_client_replicas, test_prefetch, test_async_client).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import ssl
import time
from collections.abc import Callable
from typing import Any

import httpx
import numpy as np
import orjson
import pytest

from tests.bodies import sent_body
from tests.packed_rows import assert_same_rows
from tokenizer_client import (
    AsyncTokenizerClient,
    MalformedAnswerError,
    ModelMismatchError,
    PackedBatch,
    PrefetchError,
    RetryPolicy,
    TokenizerClient,
    TokenizerConnectionError,
    TokenizerProtocolError,
    TokenizerServiceError,
    _transports,
    wire,
)
from tokenizer_client._retry import Attempt, Replicas
from tokenizer_client.packing import pack_best_fit, pack_concat

A, B = "http://replica-a:8000", "http://replica-b:8000"
SHA = "a" * 64


def byte_ids(texts: list[str]) -> list[list[int]]:
    return [list(text.encode()) for text in texts]


def error(status: int, kind: str, message: str, headers: dict[str, str] | None = None, **where: Any) -> httpx.Response:
    body = {"error": {"type": kind, "message": message, **where}}
    return httpx.Response(
        status, content=orjson.dumps(body), headers={"content-type": "application/json", **(headers or {})}
    )


class Service:
    """A well-behaved tokenizer-service per replica, until a test says otherwise; it records every request."""

    def __init__(self, sha256: dict[str, str] | None = None, default: str = "bytes") -> None:
        self.requests: list[httpx.Request] = []
        self.down: set[str] = set()  # replicas (base URLs) that refuse connections
        self.sha256 = sha256 or {}  # per replica; SHA where not given
        self.default = default
        self.override: Callable[[httpx.Request], httpx.Response | None] = lambda request: None

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    def handle(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        replica = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        if replica in self.down:
            raise httpx.ConnectError("[Errno 111] Connection refused", request=request)
        response = self.override(request)
        if response is not None:
            return response
        sha256 = self.sha256.get(replica, SHA)
        headers = {"x-tokenizer-model-sha256": sha256}
        path = request.url.path
        if request.method == "GET":
            if path == "/readyz":
                return httpx.Response(200, json={"ready": True})
            return httpx.Response(200, json={"default": self.default, "models": [{"name": "bytes", "sha256": sha256}]})
        body = sent_body(request.content)
        model = body.get("model") or self.default
        binary = wire.MEDIA_TYPE in request.headers.get("accept", "")
        if path == "/v1/detokenize":
            texts = [bytes(row).decode("utf-8", "replace") for row in body["ids"]]
            return httpx.Response(200, json={"model": model, "texts": texts}, headers=headers)
        rows = byte_ids(body["texts"])
        lengths = np.array([len(row) for row in rows], dtype=np.int64)
        ids = np.array([i for row in rows for i in row], dtype=np.int32)
        offsets = wire.ragged_offsets(lengths)
        if path == "/v1/tokenize":
            if binary:
                frame = wire.encode({"ids": ids, "offsets": offsets}, {"model": model})
                return httpx.Response(200, content=frame, headers={**headers, "content-type": wire.MEDIA_TYPE})
            return httpx.Response(200, json={"model": model, "ids": rows, "num_tokens": int(ids.size)}, headers=headers)
        return self.pack(body, ids, offsets, model, binary, headers)

    @staticmethod
    def pack(
        body: dict[str, Any], ids: np.ndarray, offsets: np.ndarray, model: str, binary: bool, headers: dict[str, str]
    ) -> httpx.Response:
        seq_len, strategy = body["seq_len"], body["strategy"]
        if strategy == "concat":
            packed = pack_concat(
                ids, offsets, seq_len, carry=body.get("carry"), carry_document_starts=body.get("carry_document_starts")
            )
        else:
            packed = pack_best_fit(ids, offsets, seq_len, pad_id=0)
        meta = {"model": model, "seq_len": seq_len, "strategy": strategy, "stats": packed.stats.as_dict()}
        arrays = packed.arrays()
        if binary:
            return httpx.Response(
                200, content=wire.encode(arrays, meta), headers={**headers, "content-type": wire.MEDIA_TYPE}
            )
        document = {
            **meta,
            **{
                name: arrays[name].tolist()
                for name in ("input_ids", "labels", "position_ids", "leftover", "leftover_document_starts")
            },
            "cu_seqlens": [packed.row_cu_seqlens(row).tolist() for row in range(packed.num_rows)],
        }
        return httpx.Response(200, json=document, headers=headers)


def run(coroutine: Any) -> Any:
    return asyncio.run(coroutine)


@pytest.fixture
def service() -> Service:
    return Service()


# -- answers, binary and JSON --------------------------------------------------------------------------

TEXTS = ["héllo", "", "wörld 🌍", "a"]


@pytest.mark.parametrize("format", ["binary", "json"])
def test_tokenize_answers_are_read_alike_from_either_format(service, format):
    with TokenizerClient(A, transport=service.transport()) as client:
        batch = client.tokenize_batch(TEXTS, format=format)
        rows = client.tokenize(TEXTS, format=format)
    accept = wire.MEDIA_TYPE if format == "binary" else "application/json"
    assert service.requests[0].headers["accept"] == accept
    # texts go as a binary frame with binary answers (docs/api.md, "Binary request bodies"), else as JSON
    assert service.requests[0].headers["content-type"] == (
        wire.MEDIA_TYPE if format == "binary" else "application/json"
    )
    assert [row.tolist() for row in batch.to_list()] == byte_ids(TEXTS) == [row.tolist() for row in rows]
    assert batch.ids.dtype == np.int32 and batch.offsets.dtype == np.int64
    assert (batch.model, batch.model_sha256, len(batch), batch.num_tokens) == ("bytes", SHA, 4, 18)

    async def main() -> list[list[int]]:
        async with AsyncTokenizerClient(A, transport=service.transport()) as client:
            return [row.tolist() for row in await client.tokenize(TEXTS, format=format)]

    assert run(main()) == byte_ids(TEXTS)


@pytest.mark.parametrize("strategy", ["concat", "best_fit"])
def test_pack_answers_are_read_alike_from_either_format(service, strategy):
    with TokenizerClient(A, transport=service.transport()) as client:
        binary = client.pack(TEXTS * 3, 8, strategy=strategy, format="binary")
        document = client.pack(TEXTS * 3, 8, strategy=strategy, format="json")
    ids = [i for row in byte_ids(TEXTS * 3) for i in row]
    offsets = wire.ragged_offsets(np.array([len(row) for row in byte_ids(TEXTS * 3)]))
    expected = pack_concat(ids, offsets, 8) if strategy == "concat" else pack_best_fit(ids, offsets, 8, pad_id=0)
    for packed in (binary, document):
        assert isinstance(packed, PackedBatch) and (packed.seq_len, packed.strategy, packed.model) == (
            8,
            strategy,
            "bytes",
        )
        assert_same_rows(packed, expected)
        assert packed.input_ids.dtype == np.int32


def test_pack_stream_threads_the_carry_through_its_requests(service):
    texts = [f"text number {i}" for i in range(10)]
    with TokenizerClient(A, transport=service.transport()) as client:
        batches = list(client.pack_stream(texts, 16, texts_per_request=3))
    ids = [i for row in byte_ids(texts) for i in row]
    whole = pack_concat(ids, wire.ragged_offsets(np.array([len(row) for row in byte_ids(texts)])), 16)
    np.testing.assert_array_equal(np.concatenate([b.input_ids for b in batches]), whole.input_ids)
    np.testing.assert_array_equal(batches[-1].leftover, whole.leftover)
    carries = [sent_body(request.content).get("carry") for request in service.requests]
    assert carries[0] is None and carries[1] == batches[0].leftover.tolist()


def test_detokenize_models_and_ready(service):
    with TokenizerClient(A, transport=service.transport()) as client:
        assert client.detokenize([list(b"abc"), np.array([104, 105])]) == ["abc", "hi"]
        assert client.models()["default"] == "bytes"
        assert client.ready()
        service.override = lambda request: error(503, "not_ready", "loading")
        assert not client.ready()

    async def main() -> tuple[list[str], bool]:
        async with AsyncTokenizerClient([A, B], transport=service.transport()) as client:
            service.down = {A}
            service.override = lambda request: None
            return await client.detokenize([[111, 107]]), await client.ready()

    assert run(main()) == (["ok"], True)


# -- error bodies to exceptions ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "kind", "where"),
    [
        (400, "invalid_request", {}),
        (404, "model_not_found", {}),
        (413, "payload_too_large", {}),
        (422, "invalid_text", {"field": "texts", "index": 2}),
    ],
)
def test_an_error_status_is_a_service_error_raised_at_once(service, status, kind, where):
    service.override = lambda request: error(status, kind, f"what {status} says", **where)
    retrying = TokenizerClient([A, B], transport=service.transport(), retry=RetryPolicy())
    with retrying as client, pytest.raises(TokenizerServiceError) as caught:
        client.tokenize(["a", "b", "c"])
    raised = caught.value
    assert (raised.status, raised.error_type, raised.message) == (status, kind, f"what {status} says")
    assert (raised.field, raised.index) == (where.get("field"), where.get("index"))
    assert not raised.retryable and raised.retry_after is None
    assert len(service.requests) == 1, "retrying cannot fix it, failing over neither"
    assert str(raised).startswith(f"{A}/v1/tokenize: {status} {kind}: what {status} says")  # the URL requested
    assert raised.url == f"{A}/v1/tokenize"


def test_a_503_carries_its_retry_after_and_a_retry_waits_that_long(service, monkeypatch):
    answers = iter([error(503, "overloaded", "busy", {"retry-after": "2.5"})])
    service.override = lambda request: next(answers, None)
    with TokenizerClient(A, transport=service.transport()) as client:
        with pytest.raises(TokenizerServiceError) as caught:
            client.tokenize(["x"])
        assert (caught.value.status, caught.value.retry_after, caught.value.retryable) == (503, 2.5, True)

    waits: list[float] = []
    monkeypatch.setattr(time, "sleep", waits.append)
    answers = iter([error(503, "overloaded", "busy", {"retry-after": "2.5"}), error(503, "overloaded", "busy")])
    with TokenizerClient(A, transport=service.transport(), retry=RetryPolicy(jitter=0.0)) as client:
        assert [row.tolist() for row in client.tokenize(["x"])] == [[120]]
    assert waits == [2.5, 0.1], "Retry-After first, then the policy's backoff (0.05 * 2)"


def test_an_error_body_that_is_not_json_is_still_an_error(service):
    service.override = lambda request: httpx.Response(502, text="<html>bad gateway</html>")
    with TokenizerClient(A, transport=service.transport()) as client, pytest.raises(TokenizerServiceError) as caught:
        client.tokenize(["x"])
    assert (caught.value.status, caught.value.error_type, caught.value.retryable) == (502, "http_error", True)
    assert "bad gateway" in caught.value.message


# -- retries and replicas ------------------------------------------------------------------------------


def test_a_replica_that_is_down_is_failed_over_and_tried_last(service):
    service.down = {A}
    with TokenizerClient([A, B], transport=service.transport(), replica_cooldown_s=60) as client:  # no retry policy
        got = [client.tokenize([f"text {i}"])[0].tolist() for i in range(6)]
    assert got == byte_ids([f"text {i}" for i in range(6)])
    tried = [request.url.host for request in service.requests]
    assert tried[:2] == ["replica-a", "replica-b"] and tried[2:] == ["replica-b"] * 5, "A cools down, tried last"

    async def main() -> tuple[list[int | None], int, int]:
        async with AsyncTokenizerClient([A, B], transport=service.transport()) as client:
            texts = [f"text {i}" for i in range(100)]
            async with client.prefetch(texts, batch_size=25, depth=4) as prefetcher:
                starts = [batch.start async for batch in prefetcher]
                return starts, prefetcher.stats.requests, prefetcher.stats.retries

    starts, requests, retries = run(main())
    assert starts == [0, 25, 50, 75] and requests == 4 and retries <= 4


def test_single_calls_retry_with_a_policy_and_give_up_after_the_budget(service):
    service.down = {A}
    with TokenizerClient(A, transport=service.transport(), retry=RetryPolicy(budget_s=0.6)) as client:
        started = time.perf_counter()
        with pytest.raises(TokenizerConnectionError, match="attempts") as caught:
            client.tokenize(["x"])
        assert 0.55 < time.perf_counter() - started < 3
    assert isinstance(caught.value.__cause__, TokenizerConnectionError)
    assert len(service.requests) > 2
    with TokenizerClient(A, transport=service.transport()) as client, pytest.raises(TokenizerConnectionError) as once:
        client.tokenize(["no policy: one try"])
    assert "ConnectError" in str(once.value) and "attempts" not in str(once.value)


def test_an_outage_is_logged_once_and_so_is_its_end(service, caplog):
    caplog.set_level(logging.INFO, logger="tokenizer.client")
    refusals = iter(range(12))  # the four requests in flight each fail several rounds before any gets through

    def refuse_first(request: httpx.Request) -> httpx.Response | None:
        if next(refusals, None) is not None:
            raise httpx.ConnectError("[Errno 111] Connection refused", request=request)
        return None

    service.override = refuse_first
    policy = RetryPolicy(budget_s=30, initial_backoff_s=0.01, max_backoff_s=0.02)

    async def main() -> int:
        async with AsyncTokenizerClient(A, transport=service.transport()) as client:
            prefetcher = client.prefetch([f"t{i}" for i in range(40)], batch_size=5, depth=4, retry=policy)
            return sum([len(batch) async for batch in prefetcher])

    assert run(main()) == 40
    records = [record for record in caplog.records if record.name == "tokenizer.client"]
    assert [record.levelname for record in records] == ["WARNING", "INFO"]
    assert records[0].getMessage().startswith(f"POST /v1/tokenize failed on replica {A} (last error:")
    assert f"answered by {A}: requests get through again after" in records[1].getMessage()


def test_async_prefetch_fails_over_and_reports_errors_with_their_position(service):
    texts = [f"text {i}" for i in range(80)]
    texts[45] = "unreadable"

    def invalid_text(request: httpx.Request) -> httpx.Response | None:
        sent = sent_body(request.content)["texts"] if request.method == "POST" else []
        if "unreadable" in sent:
            return error(422, "invalid_text", "not valid UTF-8", field="texts", index=sent.index("unreadable"))
        return None

    service.down, service.override = {A}, invalid_text

    async def main() -> None:
        async with AsyncTokenizerClient([A, B], transport=service.transport()) as client:
            prefetcher = client.prefetch(texts, batch_size=15, depth=3)
            assert [(await prefetcher.__anext__()).start for _ in range(3)] == [0, 15, 30]
            with pytest.raises(PrefetchError) as caught:
                await prefetcher.__anext__()
            error = caught.value
            assert (error.batch_index, error.text_start, error.text_stop, error.text_index) == (3, 45, 60, 45)
            assert error.cause.status == 422 and prefetcher.closed

    run(main())


# -- the retry arithmetic on its own (tokenizer_client._retry) ------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def overloaded(retry_after: float | None = None) -> TokenizerServiceError:
    return TokenizerServiceError(503, {"error": {"type": "overloaded", "message": "busy"}}, retry_after)


def test_backoff_grows_with_jitter_and_honours_retry_after():
    policy = RetryPolicy(initial_backoff_s=0.1, max_backoff_s=1.0, jitter=0.5)
    rng = random.Random(7)
    for round in range(8):
        cap = min(1.0, 0.1 * 2**round)
        delays = [policy.backoff(round, None, rng) for _ in range(200)]
        assert all(cap * 0.5 <= d <= cap for d in delays) and max(delays) - min(delays) > cap * 0.3
    assert policy.backoff(0, 3.0, rng) == 3.0


def test_attempts_fail_over_within_a_round_then_back_off_until_the_budget():
    clock = FakeClock()
    replicas = Replicas(["http://a", "http://b", "http://c"], cooldown_s=5.0, clock=clock)
    attempt = Attempt(RetryPolicy(budget_s=10.0, jitter=0.0), replicas, clock=clock)
    first = attempt.next_replica()
    assert attempt.failed(first, TokenizerConnectionError("refused")) == 0.0  # straight to the next replica
    second = attempt.next_replica()
    assert second != first
    assert attempt.failed(second, overloaded(retry_after=1.0)) == 0.0
    third = attempt.next_replica()
    assert {first, second, third} == {0, 1, 2}
    assert attempt.failed(third, overloaded(retry_after=1.0)) == 1.0  # a round failed: wait, at least Retry-After
    clock.now += 1.0
    order = [attempt.next_replica() for _ in range(3)]
    assert order[-1] == first  # the unreachable one is tried last while it cools down
    clock.now = 9.5
    with pytest.raises(TokenizerServiceError):
        attempt.failed(order[-1], overloaded(retry_after=1.0))  # the wait would pass the budget


def test_errors_retrying_cannot_fix_are_raised_at_once():
    attempt = Attempt(RetryPolicy(), Replicas(["http://a", "http://b"]))
    for status in (400, 401, 404, 413, 422):
        error = TokenizerServiceError(status, None)
        with pytest.raises(TokenizerServiceError):
            attempt.failed(attempt.next_replica(), error)


def test_requests_start_round_robin():
    replicas = Replicas(["http://a", "http://b", "http://c"])
    assert [replicas.round()[0] for _ in range(6)] == [0, 1, 2, 0, 1, 2]


def test_the_last_wait_ends_with_the_budget_for_one_last_attempt():
    clock = FakeClock()
    policy = RetryPolicy(budget_s=1.0, initial_backoff_s=0.8, jitter=0.0)
    attempt = Attempt(policy, Replicas(["http://a"], clock=clock), clock=clock)
    assert attempt.failed(attempt.next_replica(), TokenizerConnectionError("refused")) == 0.8
    clock.now = 0.8
    assert attempt.failed(attempt.next_replica(), TokenizerConnectionError("refused")) == pytest.approx(0.2)
    clock.now = 1.0
    with pytest.raises(TokenizerConnectionError, match="3 attempts"):
        attempt.failed(attempt.next_replica(), TokenizerConnectionError("refused"))


# -- model files -----------------------------------------------------------------------------------------


def test_replicas_serving_different_files_under_one_name_raise():
    service = Service(sha256={B: "b" * 64})
    with TokenizerClient([A, B], transport=service.transport()) as client:
        with pytest.raises(ModelMismatchError, match="sha256"):
            for _ in range(2):
                client.tokenize(["a text"], model="bytes")
        with pytest.raises(ModelMismatchError, match="sha256"):
            client.check_replicas()

    async def check_asynchronously() -> None:
        async with AsyncTokenizerClient([A, B], transport=service.transport()) as client:
            await client.check_replicas()

    with pytest.raises(ModelMismatchError, match="sha256"):
        run(check_asynchronously())

    async def prefetch() -> None:
        async with AsyncTokenizerClient([A, B], transport=service.transport()) as client:
            _ = [batch async for batch in client.prefetch([f"t{i}" for i in range(200)], batch_size=20, model="bytes")]

    with pytest.raises(PrefetchError) as caught:
        run(prefetch())
    assert isinstance(caught.value.cause, ModelMismatchError)


def test_replicas_with_different_default_models_raise(service):
    defaults = iter(["bytes", "other"])

    def default_model(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"model": next(defaults), "ids": [[1]]})

    service.override = default_model
    with (
        TokenizerClient([A, B], transport=service.transport()) as client,
        pytest.raises(ModelMismatchError, match="default"),
    ):
        for _ in range(2):
            client.tokenize(["no model named"])


# -- API key ---------------------------------------------------------------------------------------------


def test_the_api_key_comes_from_the_argument_or_the_environment(service, monkeypatch):
    monkeypatch.delenv("TOKENIZER_API_KEY", raising=False)
    with TokenizerClient(A, transport=service.transport()) as client:
        client.tokenize(["no key"])
    with TokenizerClient(A, transport=service.transport(), api_key="from-argument") as client:
        client.tokenize(["key"])
    monkeypatch.setenv("TOKENIZER_API_KEY", "from-environment")
    with TokenizerClient(A, transport=service.transport()) as client:
        client.tokenize(["key from the environment"])
    sent = [request.headers.get("authorization") for request in service.requests]
    assert sent == [None, "Bearer from-argument", "Bearer from-environment"]


def test_a_401_is_not_retried(service):
    service.override = lambda request: error(401, "unauthorized", "a valid API key is needed")
    retrying = TokenizerClient([A, B], transport=service.transport(), retry=RetryPolicy())
    with retrying as client, pytest.raises(TokenizerServiceError) as caught:
        client.tokenize(["no key"])
    assert caught.value.status == 401 and not caught.value.retryable and len(service.requests) == 1

    async def prefetch() -> None:
        async with AsyncTokenizerClient(A, transport=service.transport()) as client:
            await client.prefetch(["no key"] * 5).__anext__()

    with pytest.raises(PrefetchError) as failed:
        run(prefetch())
    assert failed.value.cause.status == 401 and len(service.requests) == 2


# -- malformed answers ------------------------------------------------------------------------------------

MALFORMED = {
    "fewer texts (JSON)": (json.dumps({"model": "m", "ids": [[1]]}).encode(), "application/json", MalformedAnswerError),
    "a float id": (json.dumps({"model": "m", "ids": [[1.5], [2]]}).encode(), "application/json", MalformedAnswerError),
    "offsets past the ids (binary)": (
        wire.encode({"ids": np.array([1], np.int32), "offsets": np.array([0, 1, 3])}, {"model": "m"}),
        wire.MEDIA_TYPE,
        MalformedAnswerError,
    ),
    "lengths that are not the ids' (JSON)": (
        json.dumps({"model": "m", "ids": [[1], [2]], "lengths": [7, 9], "num_tokens": 2}).encode(),
        "application/json",
        MalformedAnswerError,
    ),
    "num_tokens that is not the ids' (JSON)": (
        json.dumps({"model": "m", "ids": [[1], [2]], "lengths": [1, 1], "num_tokens": 99}).encode(),
        "application/json",
        MalformedAnswerError,
    ),
    "not a frame": (b"TKNX" + bytes(20), wire.MEDIA_TYPE, TokenizerProtocolError),
    "not JSON": (b"{", "application/json", TokenizerProtocolError),
    "no ids": (b"{}", "application/json", TokenizerProtocolError),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_answer_is_raised_never_returned(service, case):
    content, content_type, kind = MALFORMED[case]
    service.override = lambda request: httpx.Response(200, content=content, headers={"content-type": content_type})
    with TokenizerClient(A, transport=service.transport()) as client, pytest.raises(kind):
        client.tokenize(["a", "b"])


def test_a_pack_answer_of_another_seq_len_and_a_short_detokenize_answer_are_raised(service):
    def wrong(request: httpx.Request) -> httpx.Response | None:
        if request.url.path == "/v1/detokenize":
            return httpx.Response(200, json={"model": "bytes", "texts": ["one"]})
        body = sent_body(request.content)
        return Service.pack({**body, "seq_len": body["seq_len"] * 2}, *ragged(body["texts"]), "bytes", False, {})

    service.override = wrong
    with TokenizerClient(A, transport=service.transport()) as client:
        with pytest.raises(MalformedAnswerError, match="seq_len 16 answered, 8 asked for"):
            client.pack(TEXTS, 8, format="json")
        with pytest.raises(MalformedAnswerError, match="1 texts answered, 2 id rows were sent"):
            client.detokenize([[1], [2]])


def ragged(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    rows = byte_ids(texts)
    ids = np.array([i for row in rows for i in row], dtype=np.int32)
    return ids, wire.ragged_offsets(np.array([len(row) for row in rows], dtype=np.int64))


@pytest.mark.parametrize(
    "given",
    [
        {"budget_s": float("nan")},
        {"initial_backoff_s": float("nan")},
        {"max_backoff_s": float("inf")},
        {"multiplier": float("nan")},
        {"jitter": float("nan")},
    ],
)
def test_a_retry_policy_refuses_nan_and_infinite_backoffs(given):
    """NaN compares false to everything: RetryPolicy(budget_s=nan) passed its checks, and a client retried a dead
    URL forever."""
    with pytest.raises(ValueError, match=r"NaN|finite"):
        RetryPolicy(**given)
    assert RetryPolicy(budget_s=float("inf")).budget_s == float("inf")  # retrying for ever is a choice one can make


def test_clients_without_a_transport_share_one_verifying_ssl_context() -> None:
    """Every transport a client opens for itself (sync, async, the prefetcher's clone) holds the one SSL context
    of the process, made once, with certificates and host names verified; a client's own transport= is kept."""
    _transports.ssl_context.cache_clear()
    shared = _transports.ssl_context()
    assert _transports.ssl_context() is shared
    assert shared.verify_mode == ssl.CERT_REQUIRED and shared.check_hostname

    def context_of(client: TokenizerClient | AsyncTokenizerClient) -> ssl.SSLContext:
        return client._transport._pool._ssl_context  # httpcore's pool keeps the context its connections use

    sync = TokenizerClient("http://127.0.0.1:9")
    other = TokenizerClient(["http://127.0.0.1:9", "https://127.0.0.1:10"])
    clone = sync.async_client()  # what prefetch() opens
    async_client = AsyncTokenizerClient("https://127.0.0.1:10")
    mocked = TokenizerClient("http://127.0.0.1:9", transport=httpx.MockTransport(lambda request: httpx.Response(200)))
    try:
        assert all(context_of(client) is shared for client in (sync, other, clone, async_client))
        assert isinstance(mocked._transport, httpx.MockTransport)
    finally:
        for client in (sync, other, mocked):
            client.close()
        asyncio.run(clone.aclose())
        asyncio.run(async_client.aclose())
