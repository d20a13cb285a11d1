"""What the edge lets in: a bound on the bytes that requests hold
(texts known to be poison: tokenizer_service.core.poison)."""

from __future__ import annotations

from tokenizer_service.core.errors import Overloaded
from tokenizer_service.metrics import Metrics


class Admission:
    """Counts the body bytes of requests received and not yet answered; refuses work beyond `limit`.

    Bytes are charged as they arrive, whatever the framing (Content-Length or chunked), so what is
    charged is what the server holds: a body declared but not sent holds nothing, a slow sender
    holds only what it sent. A request that declares its length is refused whole and at once
    (503) when it could not fit now (`check`), before its body is read; any body is refused as
    soon as a chunk would take the total over the limit (`admit`). A request alone (no other
    request holds bytes) is always let in, so a budget below --max-request-bytes cannot lock a
    large request out for good.
    """

    def __init__(self, limit: int | None, metrics: Metrics) -> None:
        self.limit = limit
        self.queued = 0
        self._metrics = metrics

    def check(self, size: int, held: int = 0) -> None:
        """503 if `size` more bytes would take the total over the limit while others hold bytes."""
        if self.limit is not None and self.queued > held and self.queued + size > self.limit:
            self._metrics.rejected_requests.labels("queue").inc()
            raise Overloaded(
                f"{self.queued} bytes of requests are waiting to be answered; {size} more would exceed "
                f"the limit of {self.limit}; retry later"
            )

    def admit(self, size: int, held: int = 0) -> None:
        """Charge `size` bytes to a request already holding `held` (checked first)."""
        self.check(size, held)
        self.queued += size
        self._metrics.queued_bytes.set(self.queued)

    def release(self, size: int) -> None:
        self.queued -= size
        self._metrics.queued_bytes.set(self.queued)
