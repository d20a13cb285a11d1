"""Says, through logging ("tokenizer.client"), that requests are failing and being retried: once per outage.

A request that retries (a ``RetryPolicy`` with a budget, as ``prefetch`` always has) can wait up to
the whole budget (30 s by default) before it raises. So that such a wait is not silent, the first
request whose round over every replica fails logs a warning: what failed, and how long it keeps
retrying. Nothing more is logged while the outage lasts, however many requests are retrying; the
next request that gets an answer logs one info line, and a later outage warns again.
"""

from __future__ import annotations

import logging
import threading
import time

from tokenizer_client._retry import Attempt
from tokenizer_client.errors import TokenizerError

logger = logging.getLogger("tokenizer.client")


class OutageLog:
    """One client's outage: whether it has been announced, and since when. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._since: float | None = None  # time.monotonic() of the warning, while the outage lasts

    def retrying(self, attempt: Attempt, request: str, exc: TokenizerError) -> None:
        """After a failed attempt of `request` ("POST /v1/tokenize") that `attempt` will retry: warns if it
        ended a round over every replica and no warning is out yet."""
        replicas = len(attempt.replicas)
        if attempt.attempts % replicas:  # failing over within a round: not every replica has failed yet
            return
        with self._lock:
            if self._since is not None:
                return
            self._since = now = time.monotonic()
        left = max(0.0, attempt.started + attempt.policy.budget_s - now)
        until = time.strftime("%H:%M:%S", time.localtime(time.time() + left))
        logger.warning(
            "%s failed on %s %s (last error: %s); retrying for up to %.1f s more (RetryPolicy budget_s=%g, until "
            "about %s), then raising; not logged again until a request gets through",
            request,
            "replica" if replicas == 1 else f"all {replicas} replicas",
            ", ".join(attempt.replicas.urls),
            exc,
            left,
            attempt.policy.budget_s,
            until,
        )

    def answered(self, request: str, source: str) -> None:
        """After a success: the info line that ends an announced outage (one attribute read otherwise)."""
        if self._since is None:
            return
        with self._lock:
            since, self._since = self._since, None
        if since is not None:
            seconds = time.monotonic() - since
            logger.info("%s answered by %s: requests get through again after %.1f s", request, source, seconds)
