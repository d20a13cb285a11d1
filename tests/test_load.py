"""A bounded load test on loopback: 32 concurrent clients for 15 s against the shared test server.

Every answer is checked against in-process sentencepiece; the only error status allowed is a
declared 503 (with Retry-After). Latency percentiles and throughput are printed (`pytest -s`), not
asserted: timings on a shared machine are reported, never used as pass/fail.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field

import httpx
import numpy as np
import pytest

from tests.conftest import Server
from tokenizer_client import wire

pytestmark = pytest.mark.slow  # load; part of .ci/run's slow stage

CLIENTS = 32
SECONDS = 15.0
MODELS = ("uni", "bpe")


@dataclass
class Tally:
    latencies: list[float] = field(default_factory=list)
    statuses: dict[int, int] = field(default_factory=dict)
    wrong: list[str] = field(default_factory=list)
    texts: int = 0
    tokens: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, status: int, seconds: float, texts: int = 0, tokens: int = 0) -> None:
        with self.lock:
            self.latencies.append(seconds)
            self.statuses[status] = self.statuses.get(status, 0) + 1
            self.texts += texts
            self.tokens += tokens


def expected_ids(server: Server, documents: list[str]) -> dict[str, list[list[int]]]:
    return {name: server.processor(name).encode(documents) for name in MODELS}


def client_loop(
    server: Server, documents: list[str], expected: dict[str, list[list[int]]], seed: int, until: float, tally: Tally
) -> None:
    rng = random.Random(seed)
    special = {name: (server.processor(name).bos_id(), server.processor(name).eos_id()) for name in MODELS}
    with httpx.Client(base_url=server.url, timeout=60) as client:
        while time.monotonic() < until:
            model = rng.choice(MODELS)
            picks = [rng.randrange(len(documents)) for _ in range(rng.randint(1, 32))]
            started = time.perf_counter()
            if rng.random() < 0.1:  # some detokenize traffic too
                rows = [expected[model][i] for i in picks]
                response = client.post("/v1/detokenize", json={"ids": rows, "model": model})
                tally.record(response.status_code, time.perf_counter() - started, len(picks))
                if response.status_code == 200:
                    decoder = server.processor(model)
                    if response.json()["texts"] != [decoder.decode(expected[model][i]) for i in picks]:
                        tally.wrong.append(f"detokenize {model} {picks}")
                continue
            add_bos, add_eos, binary = rng.random() < 0.5, rng.random() < 0.5, rng.random() < 0.5
            body = {"texts": [documents[i] for i in picks], "model": model, "add_bos": add_bos, "add_eos": add_eos}
            headers = {"Accept": wire.MEDIA_TYPE} if binary else {}
            response = client.post("/v1/tokenize", json=body, headers=headers)
            elapsed = time.perf_counter() - started
            if response.status_code != 200:
                tally.record(response.status_code, elapsed)
                if response.status_code == 503 and not response.headers.get("retry-after"):
                    tally.wrong.append("503 without Retry-After")
                continue
            if binary:
                frame = wire.decode(response.content)
                rows = [row.tolist() for row in wire.split_ragged(frame["ids"], frame["offsets"])]
            else:
                rows = response.json()["ids"]
            bos, eos = special[model]
            want = [[bos] * add_bos + expected[model][i] + [eos] * add_eos for i in picks]
            if rows != want:
                tally.wrong.append(f"tokenize {model} {picks} bos={add_bos} eos={add_eos} binary={binary}")
            tally.record(200, elapsed, len(picks), sum(len(row) for row in rows))


def test_32_clients_for_15_seconds(server, documents):
    expected = expected_ids(server, documents)
    tally = Tally()
    started = time.monotonic()
    until = started + SECONDS
    threads = [
        threading.Thread(target=client_loop, args=(server, documents, expected, seed, until, tally), daemon=True)
        for seed in range(CLIENTS)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=SECONDS + 120)
    elapsed = time.monotonic() - started
    assert not any(thread.is_alive() for thread in threads), "a client hung"
    assert not tally.wrong, tally.wrong[:5]
    assert set(tally.statuses) <= {200, 503}, tally.statuses
    assert tally.statuses.get(200, 0) > CLIENTS
    latencies = np.array(tally.latencies) * 1000
    p50, p95, p99 = np.percentile(latencies, [50, 95, 99])
    print(
        f"\nload: {CLIENTS} clients, {elapsed:.1f}s, {len(latencies)} requests ({len(latencies) / elapsed:.0f}/s), "
        f"{tally.texts / elapsed:.0f} texts/s, {tally.tokens / elapsed / 1e6:.2f} M tokens/s, "
        f"statuses {tally.statuses}; "
        f"latency ms p50 {p50:.1f} p95 {p95:.1f} p99 {p99:.1f} max {latencies.max():.1f}"
    )
