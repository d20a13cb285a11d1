"""Every Prometheus metric the server exports, defined once, in a registry of the app's own.

With several front-end processes (`--frontends`), prometheus_client's multiprocess mode adds their
values up (`PROMETHEUS_MULTIPROC_DIR`, set by tokenizer_service.frontends): `exposition()` then reads every
front-end's values, so /metrics is complete whichever front-end answers the scrape.

Workers never touch these: they send timings back with their answers and the server process
records them, so /metrics is complete whatever the number of worker processes.
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

MULTIPROCESS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
TEXT_COUNT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
RATIO_BUCKETS = (0.0, 0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0)


REJECT_REASONS = ("queue", "concurrency", "connections")
CANCEL_REASONS = ("timeout", "disconnect", "slow_body")
# The `endpoint` of what is answered before a request reaches a route: a connection over --max-connections (503),
# a head too large (431) or too slow (408), malformed HTTP (400) (tokenizer_service.http.connections).
CONNECTION_ENDPOINT = "connection"


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "tokenizer_requests",
            "HTTP requests answered, by route and status code.",
            ["endpoint", "status"],
            registry=r,
        )
        self.request_duration = Histogram(
            "tokenizer_request_duration_seconds",
            "Time from request start to response, by route.",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "tokenizer_queue_wait_seconds",
            "Time a job waited for a worker process to start it.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.worker_seconds = Counter(
            "tokenizer_worker_seconds", "Time worker processes spent tokenizing, by model.", ["model"], registry=r
        )
        self.batch_size = Histogram(
            "tokenizer_batch_size_texts", "Texts per request.", buckets=TEXT_COUNT_BUCKETS, registry=r
        )
        self.texts = Counter("tokenizer_texts", "Texts tokenized or detokenized, by model.", ["model"], registry=r)
        self.tokens = Counter("tokenizer_tokens", "Tokens produced or consumed, by model.", ["model"], registry=r)
        self.inflight = Gauge(
            "tokenizer_inflight_requests", "Requests being handled right now.", registry=r, multiprocess_mode="livesum"
        )
        self.workers = Gauge(
            "tokenizer_workers", "Worker processes in the pool.", registry=r, multiprocess_mode="livesum"
        )
        self.worker_restarts = Counter(
            "tokenizer_worker_restarts", "Worker processes restarted after one died.", registry=r
        )
        self.pack_padding_ratio = Histogram(
            "tokenizer_pack_padding_ratio",
            "Fraction of packed tokens that are padding, per /v1/pack request.",
            buckets=RATIO_BUCKETS,
            registry=r,
        )
        self.model_info = Gauge(
            "tokenizer_model_info",
            "Served models (value 1), with the library that defines them and what encodes them.",
            ["model", "sha256", "vocab_size", "library", "encoder"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.ready = Gauge(
            "tokenizer_ready", "1 when models are loaded and the pool answers.", registry=r, multiprocess_mode="livemin"
        )
        # Reliability: backpressure, cancellation, worker crashes and poison input.
        self.queued_bytes = Gauge(
            "tokenizer_queued_bytes",
            "Body bytes of /v1 requests admitted and not yet answered (bounded by --max-queued-bytes).",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.rejected_requests = Counter(
            "tokenizer_rejected_requests",
            "Requests answered 503 at once because the server was full, by reason (queue, concurrency).",
            ["reason"],
            registry=r,
        )
        self.cancelled_requests = Counter(
            "tokenizer_cancelled_requests",
            "Requests abandoned before their answer, by reason (timeout, disconnect).",
            ["reason"],
            registry=r,
        )
        self.cancelled_chunks = Counter(
            "tokenizer_cancelled_chunks",
            "Jobs withdrawn before a worker ran them, because their request was abandoned.",
            registry=r,
        )
        self.chunk_retries = Counter(
            "tokenizer_chunk_retries", "Jobs run again because their worker died while running them.", registry=r
        )
        self.worker_stalls = Counter(
            "tokenizer_worker_stalls", "Jobs that ran past their deadline; their workers were killed.", registry=r
        )
        self.poison_inputs = Counter(
            "tokenizer_poison_inputs", "Requests refused (422) because a text killed or stalled a worker.", registry=r
        )
        for reason in REJECT_REASONS:  # exported at 0 from the start, so rate() and alerts see them
            self.rejected_requests.labels(reason)
        for reason in CANCEL_REASONS:
            self.cancelled_requests.labels(reason)
        # Shadow verification (tokenizer_service.core.shadow): texts a fast encoder encoded, encoded again by the
        # reference library; any mismatch makes the model fall back to the reference library (alert on it).
        self.shadow_checks = Counter(
            "tokenizer_shadow_checks",
            "Texts encoded by a fast encoder that were encoded again by the reference library, by model.",
            ["model"],
            registry=r,
        )
        self.shadow_mismatches = Counter(
            "tokenizer_shadow_mismatches",
            "Texts a fast encoder encoded otherwise than the reference library, by model (it then falls back).",
            ["model"],
            registry=r,
        )
        self.rebuild_seconds = Histogram(
            "tokenizer_worker_rebuild_seconds",
            "Time from a worker's death until its replacement answers.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )

    def exposition(self) -> bytes:
        """The Prometheus text of every metric: this process's, or every front-end's in multiprocess mode."""
        if os.environ.get(MULTIPROCESS_DIR_ENV):
            registry = CollectorRegistry()
            MultiProcessCollector(registry)
            return generate_latest(registry)
        return generate_latest(self.registry)
