"""What the server lets in: a bound on the bytes requests hold, and texts known to be poison."""

from __future__ import annotations

import hashlib
from collections import Counter, OrderedDict

from app.errors import Overloaded
from app.metrics import Metrics

POISON_MEMORY = 256


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


def text_digest(text: str) -> bytes:
    """What poison texts are remembered by: the sha256 of the text (lone surrogates kept as they are)."""
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()


class PoisonMemory:
    """The last texts found to kill or stall a worker, by model and sha256.

    A client that sends one again is refused at once instead of costing everyone two pool rebuilds.
    Checking costs one len() per text while the memory is empty of that length: nothing is hashed
    unless a text has the length of a known poison text.
    """

    def __init__(self, capacity: int = POISON_MEMORY) -> None:
        self.capacity = capacity
        self._known: OrderedDict[tuple[str, bytes], int] = OrderedDict()
        self._lengths: Counter[int] = Counter()

    def add(self, model: str, digest: bytes, length: int) -> None:
        """Remember a text by its `text_digest` and length (the server sends no text to the workers)."""
        key = (model, digest)
        if key in self._known:
            return
        self._known[key] = length
        self._lengths[length] += 1
        if len(self._known) > self.capacity:
            _, length = self._known.popitem(last=False)
            self._lengths[length] -= 1
            if not self._lengths[length]:
                del self._lengths[length]

    def find(self, model: str, texts: list[str]) -> int | None:
        """Index of the first known poison text, if any."""
        if not self._lengths:
            return None
        for index, text in enumerate(texts):
            if len(text) in self._lengths and (model, text_digest(text)) in self._known:
                return index
        return None
