"""Whether the service takes work: one state that the probes, the `tokenizer_ready` gauge and the edge read.

The lifespan moves the phase (starting, serving, stopping); while serving, the pool's workers decide
between ready and rebuilding (its tokenizers all gone, or the seeded sampler failing to start).
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from tokenizer_service.metrics import Metrics

if TYPE_CHECKING:
    from tokenizer_service.core.pool import WorkerPool


class Readiness(enum.Enum):
    STARTING = "starting"  # models not yet loaded in the workers: /v1 work gets 503
    READY = "ready"
    REBUILDING = "rebuilding"  # serving, but no tokenizer worker up now: /v1 work waits or gets 503
    STOPPING = "stopping"  # draining after SIGTERM: /v1 work gets 503


class ServiceState:
    """The phase of the service and the pool it serves with; `readiness` is the one answer."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        self._pool: WorkerPool | None = None
        self.phase = Readiness.STARTING  # STARTING, READY or STOPPING: what the edge reads on each request
        self.publish()

    @property
    def readiness(self) -> Readiness:
        """The phase, with READY made REBUILDING while the pool's workers do not serve."""
        if self.phase is not Readiness.READY:
            return self.phase
        assert self._pool is not None
        return Readiness.READY if self._pool.ready else Readiness.REBUILDING

    @property
    def pool(self) -> WorkerPool | None:
        """The pool, once started (also while stopping)."""
        return self._pool

    def serving(self, pool: WorkerPool) -> None:
        """The pool is started: serve with it, and follow its workers."""
        self._pool = pool
        pool.on_change = self.publish
        self.phase = Readiness.READY
        self.publish()

    def stopping(self) -> None:
        self.phase = Readiness.STOPPING
        self.publish()

    def publish(self) -> None:
        """The gauge follows the state (called on every change: the phase, or a worker's)."""
        self._metrics.ready.set(1 if self.readiness is Readiness.READY else 0)
