"""Several replicas, retries, backpressure and API keys, against real servers; the retry arithmetic on its own."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from client import (
    AsyncTokenizerClient,
    ModelMismatchError,
    PrefetchError,
    RetryPolicy,
    TokenizerClient,
    TokenizerConnectionError,
    TokenizerServiceError,
)
from client._retry import Attempt, Replicas
from tests.client_servers import GaugedServer, dead_url, gauged_server, numbered_texts
from tests.conftest import Server

API_KEY = "replica-test-key"


@pytest.fixture(scope="module")
def guarded(model_files: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    """A replica of the session server's models that wants an API key and takes one request at a time."""
    env = {
        "TOKENIZER_API_KEYS": API_KEY,
        "TOKENIZER_MAX_CONCURRENT_REQUESTS": "1",
        "TOKENIZER_DEFAULT_MODEL": "default",
    }
    server = gauged_server(model_files, tmp_path_factory.mktemp("guarded"), env=env)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def impostor(model_files: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    """Serves the BPE model file under the name `uni` (and nothing else, so `uni` is also its default)."""
    server = gauged_server({"uni": model_files["bpe"]}, tmp_path_factory.mktemp("impostor"))
    yield server
    server.stop()


def tokenize_requests(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "tokenizer_requests_total" and sample.labels.get("endpoint") == "/v1/tokenize"
    )


def test_requests_go_round_robin_over_replicas(server: Server, guarded: GaugedServer, documents):
    texts = list(numbered_texts(documents, 400))
    before_session, before_guarded = tokenize_requests(server.url), guarded.gauge()["total"]
    with TokenizerClient([server.url, guarded.url], api_key=API_KEY) as client:
        singles = [client.tokenize(texts[i : i + 10], model="uni") for i in range(0, 100, 10)]
        batches = list(client.prefetch(texts, batch_size=20, depth=1, model="uni"))
    sp = server.processor("uni")
    assert [row.tolist() for batch in singles for row in batch] == sp.encode(texts[:100])
    assert [row.tolist() for batch in batches for row in batch.to_list()] == sp.encode(texts)
    to_session = tokenize_requests(server.url) - before_session
    to_guarded = guarded.gauge()["total"] - before_guarded
    # 30 answered requests; a few more if the guarded replica (one request at a time) still counted
    # the previous request as running when the next arrived, answered 503, and the client failed over.
    assert 30 <= to_session + to_guarded <= 36
    assert 10 <= to_session <= 25 and 10 <= to_guarded <= 25


def test_a_replica_that_is_down_is_failed_over(server: Server, documents):
    texts = list(numbered_texts(documents, 300))
    sp = server.processor("bpe")
    with TokenizerClient([dead_url(), server.url, dead_url()]) as client:  # no retry policy: failover only
        for start in range(0, 60, 10):
            assert [row.tolist() for row in client.tokenize(texts[start : start + 10], model="bpe")] == sp.encode(
                texts[start : start + 10]
            )
        with client.prefetch(texts, batch_size=25, depth=4, model="bpe") as batches:
            got = [row.tolist() for batch in batches for row in batch.to_list()]
            stats = batches.stats
    assert got == sp.encode(texts)
    assert stats.requests == 12 and stats.retries <= 12  # a dead replica is tried last for a while


def test_replicas_serving_different_files_under_one_name_raise(server: Server, impostor: GaugedServer, documents):
    with TokenizerClient([server.url, impostor.url]) as client:
        with pytest.raises(ModelMismatchError, match="sha256"):
            for _ in range(2):
                client.tokenize(["a text"], model="uni")
        with pytest.raises(ModelMismatchError, match="sha256"):
            client.check_replicas()

    async def check_asynchronously() -> None:
        async with AsyncTokenizerClient([server.url, impostor.url]) as client:
            await client.check_replicas()

    with pytest.raises(ModelMismatchError, match="sha256"):
        asyncio.run(check_asynchronously())
    with TokenizerClient([server.url, impostor.url]) as client:
        with pytest.raises(PrefetchError) as caught:
            list(client.prefetch(documents[:200], batch_size=20, model="uni"))
        assert isinstance(caught.value.cause, ModelMismatchError)
    with TokenizerClient([server.url, impostor.url]) as client, pytest.raises(ModelMismatchError, match="default"):
        for _ in range(2):
            client.tokenize(["no model named"])


def test_503_answers_are_retried_after_retry_after(server: Server, guarded: GaugedServer, documents):
    texts = list(numbered_texts(documents, 80))
    started = time.perf_counter()
    with (
        TokenizerClient(guarded.url, api_key=API_KEY) as client,
        client.prefetch(texts, batch_size=20, depth=3, model="uni") as batches,  # the server takes 1 at once
    ):
        got = [row.tolist() for batch in batches for row in batch.to_list()]
        stats = batches.stats
    assert got == server.processor("uni").encode(texts)
    assert stats.retries > 0
    assert time.perf_counter() - started >= 1.0  # Retry-After: 1 was honoured


def test_api_key_from_the_argument_or_the_environment(guarded: GaugedServer, monkeypatch):
    with TokenizerClient(guarded.url) as client:
        started = time.perf_counter()
        with pytest.raises(TokenizerServiceError) as caught:
            client.tokenize(["no key"])
        assert caught.value.status == 401 and not caught.value.retryable
        with pytest.raises(PrefetchError) as caught:
            next(client.prefetch(["no key"] * 5))
        assert caught.value.cause.status == 401
        assert time.perf_counter() - started < 2  # not retried
    with TokenizerClient(guarded.url, api_key=API_KEY) as client:
        assert client.tokenize(["with a key"], model="uni")
    assert guarded.gauge()["authorization"] == f"Bearer {API_KEY}"
    monkeypatch.setenv("TOKENIZER_API_KEY", API_KEY)
    with TokenizerClient(guarded.url) as client:
        assert client.tokenize(["key from the environment"], model="uni")


def test_single_calls_retry_with_a_policy_and_give_up_after_the_budget():
    with TokenizerClient(dead_url(), retry=RetryPolicy(budget_s=0.6)) as client:
        started = time.perf_counter()
        with pytest.raises(TokenizerConnectionError, match="attempts"):
            client.tokenize(["x"])
        assert 0.55 < time.perf_counter() - started < 3


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
