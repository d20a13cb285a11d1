"""Several real replicas: round robin and backpressure (503 + Retry-After). What needs no server (failover,
retry arithmetic, API keys, model mismatches) is in test_client_inprocess."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.client_servers import GaugedServer, gauged_server, numbered_texts
from tests.conftest import Server
from tokenizer_client import (
    TokenizerClient,
)
from tokenizer_service.tools.launcher import metric_total

pytestmark = pytest.mark.slow  # replicas as real servers (the rest: test_client_inprocess.py); .ci/run's slow stage

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


def tokenize_requests(url: str) -> float:
    return metric_total(url, "tokenizer_requests_total", endpoint="/v1/tokenize")


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
