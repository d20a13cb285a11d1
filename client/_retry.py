"""Retries and replicas without I/O: which URL to try next, and how long to wait before trying again.

Both clients run the same loop around their own send and sleep::

    attempt = Attempt(policy, replicas)
    while True:
        replica = attempt.next_replica()
        try:
            return send(replica)
        except TokenizerError as exc:
            sleep(attempt.failed(replica, exc))   # raises when retrying cannot help or the budget is spent

A failure moves on at once to the next replica not yet tried in this round (failover); once every
replica has failed in a round, the loop sleeps (exponential backoff with jitter, at least what
Retry-After asked) and starts a new round, until the policy's time budget is spent: the last wait
is cut short to end with the budget, and one last round is tried then.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tokenizer_client.errors import TokenizerConnectionError, TokenizerError, TokenizerServiceError

Clock = Callable[[], float]


@dataclass(frozen=True)
class RetryPolicy:
    """How long a request keeps trying after connection errors and 429/502/503/504 answers.

    The default budget of 30 s rides out a server restart of 10 s with room to spare. Each wait is
    ``initial_backoff_s * multiplier ** round`` capped at ``max_backoff_s``, scaled by a random factor
    in ``[1 - jitter, 1]`` so that many clients do not retry in lockstep, and never shorter than the
    server's Retry-After. ``RetryPolicy(budget_s=0)`` tries each replica once.
    """

    budget_s: float = 30.0
    initial_backoff_s: float = 0.05
    max_backoff_s: float = 2.0
    multiplier: float = 2.0
    jitter: float = 0.5

    def __post_init__(self) -> None:
        fields = (self.budget_s, self.initial_backoff_s, self.max_backoff_s, self.multiplier, self.jitter)
        if any(math.isnan(value) for value in fields):  # NaN compares false: a NaN budget retried forever
            raise ValueError("budget_s, initial_backoff_s, max_backoff_s, multiplier and jitter must not be NaN")
        if not all(math.isfinite(value) for value in fields[1:]):
            raise ValueError("initial_backoff_s, max_backoff_s, multiplier and jitter must be finite")
        if self.budget_s < 0 or self.initial_backoff_s < 0 or self.max_backoff_s < 0:
            raise ValueError("budget_s, initial_backoff_s and max_backoff_s must not be negative")
        if self.multiplier < 1 or not 0 <= self.jitter <= 1:
            raise ValueError("multiplier must be at least 1 and jitter between 0 and 1")

    def backoff(self, round: int, retry_after: float | None, rng: random.Random) -> float:
        """Seconds to wait after `round` (0-based) rounds in which every replica failed."""
        delay = min(self.max_backoff_s, self.initial_backoff_s * self.multiplier**round)
        delay *= 1 - self.jitter * rng.random()
        return max(delay, retry_after or 0.0)


NO_RETRY = RetryPolicy(budget_s=0.0)


def is_retryable(exc: TokenizerError) -> bool:
    """Whether the same request may succeed later or elsewhere (unreachable, overloaded, restarting)."""
    if isinstance(exc, TokenizerConnectionError):
        return True
    return isinstance(exc, TokenizerServiceError) and exc.retryable


class Replicas:
    """Round robin over base URLs; one that could not be reached is tried last for `cooldown_s`.

    Each request starts one step further round the ring, so requests spread evenly; thread-safe.
    """

    def __init__(self, urls: Sequence[str], cooldown_s: float = 1.0, clock: Clock = time.monotonic) -> None:
        if not urls:
            raise ValueError("at least one server URL is needed")
        self.urls = tuple(urls)
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._down_until = [0.0] * len(self.urls)
        self._next = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.urls)

    def round(self) -> list[int]:
        """Replica indices to try for one request: the next in turn first, unreachable ones last."""
        with self._lock:
            start = self._next
            self._next = (self._next + 1) % len(self.urls)
            now = self._clock()
            ring = [(start + step) % len(self.urls) for step in range(len(self.urls))]
            return sorted(ring, key=lambda index: self._down_until[index] > now)

    def unreachable(self, index: int) -> None:
        with self._lock:
            self._down_until[index] = self._clock() + self.cooldown_s

    def reachable(self, index: int) -> None:
        with self._lock:
            self._down_until[index] = 0.0


class Attempt:
    """The retry loop's bookkeeping for one request."""

    def __init__(
        self,
        policy: RetryPolicy,
        replicas: Replicas,
        clock: Clock = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self.policy = policy
        self.replicas = replicas
        self._clock = clock
        self._rng = rng  # made at the first backoff: seeding one costs more than a request's own bookkeeping
        self.started = clock()
        self.attempts = 0
        self.retries = 0
        self._rounds = 0
        self._queue = replicas.round()

    def next_replica(self) -> int:
        if not self._queue:
            self._queue = self.replicas.round()
        self.attempts += 1
        return self._queue.pop(0)

    def succeeded(self, replica: int) -> None:
        self.replicas.reachable(replica)

    def failed(self, replica: int, exc: TokenizerError) -> float:
        """Seconds to wait before the next attempt (0: another replica at once); raises when giving up."""
        if isinstance(exc, TokenizerConnectionError):
            self.replicas.unreachable(replica)
        if not is_retryable(exc):
            raise exc
        elapsed = self._clock() - self.started
        if self._queue:
            if elapsed > self.policy.budget_s and self.policy.budget_s > 0:
                raise self._final(exc, elapsed)
            self.retries += 1
            return 0.0
        retry_after = exc.retry_after if isinstance(exc, TokenizerServiceError) else None
        if self._rng is None:
            self._rng = random.Random()
        delay = self.policy.backoff(self._rounds, retry_after, self._rng)
        self._rounds += 1
        remaining = self.policy.budget_s - elapsed
        if delay > remaining:
            # One last attempt when the budget ends, unless the server asked us to stay away longer.
            if remaining <= 0 or (retry_after is not None and retry_after > remaining):
                raise self._final(exc, elapsed)
            delay = remaining
        self.retries += 1
        return delay

    def _final(self, exc: TokenizerError, elapsed: float) -> TokenizerError:
        if self.attempts == 1:
            return exc
        if isinstance(exc, TokenizerConnectionError):
            final = TokenizerConnectionError(f"gave up after {self.attempts} attempts over {elapsed:.1f}s: {exc}")
            final.__cause__ = exc
            return final
        return exc
