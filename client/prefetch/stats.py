"""What a training script logs about its prefetcher: how long it waited for data, how the service answered."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

STATS_WINDOW = 10_000


@dataclass(frozen=True)
class PrefetchStats:
    """What the training script logs: how much the consumer waited, how the service answered.

    ``wait_*`` is time spent inside ``next()`` (blocked on data, or reading texts); ``elapsed_s``
    runs from the first ``next()`` call to now (or to the end of the stream); ``wait_fraction`` is
    ``wait_s / elapsed_s``. Percentiles cover the last 10,000 batches and requests.
    """

    batches: int
    texts: int
    tokens: int
    requests: int
    retries: int
    wait_s: float
    wait_p50_s: float
    wait_p99_s: float
    request_p50_s: float
    request_p99_s: float
    elapsed_s: float
    wait_fraction: float

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


class StatsRecorder:
    """Counters written by the consumer thread and the event loop thread; read as a PrefetchStats snapshot."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.batches = self.texts = self.tokens = self.requests = self.retries = 0
        self.wait_s = 0.0
        self._waits: deque[float] = deque(maxlen=STATS_WINDOW)
        self._latencies: deque[float] = deque(maxlen=STATS_WINDOW)
        self._first_call: float | None = None
        self._ended: float | None = None

    def call_started(self, now: float) -> None:
        if self._first_call is None:
            self._first_call = now

    def delivered(self, texts: int, tokens: int, wait: float) -> None:
        with self._lock:
            self.batches += 1
            self.texts += texts
            self.tokens += tokens
            self.wait_s += wait
            self._waits.append(wait)

    def answered(self, seconds: float, attempts: int) -> None:
        with self._lock:
            self.requests += 1
            self.retries += attempts - 1
            self._latencies.append(seconds)

    def ended(self) -> None:
        if self._ended is None:
            self._ended = time.perf_counter()

    def snapshot(self) -> PrefetchStats:
        with self._lock:
            waits = np.fromiter(self._waits, dtype=np.float64)
            latencies = np.fromiter(self._latencies, dtype=np.float64)
            counts = (self.batches, self.texts, self.tokens, self.requests, self.retries, self.wait_s)
        end = self._ended or time.perf_counter()
        elapsed = end - self._first_call if self._first_call is not None else 0.0

        def percentile(values: np.ndarray, q: float) -> float:
            return float(np.percentile(values, q)) if values.size else 0.0

        return PrefetchStats(
            *counts,
            wait_p50_s=percentile(waits, 50),
            wait_p99_s=percentile(waits, 99),
            request_p50_s=percentile(latencies, 50),
            request_p99_s=percentile(latencies, 99),
            elapsed_s=elapsed,
            wait_fraction=counts[5] / elapsed if elapsed > 0 else 0.0,
        )
