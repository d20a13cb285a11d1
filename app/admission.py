"""What the pool lets in: a bound on the texts waiting for a worker, and texts known to be poison."""

from __future__ import annotations

import hashlib
from collections import Counter, OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager

from app.errors import Overloaded
from app.metrics import Metrics

RETRY_AFTER_SECONDS = "1"
POISON_MEMORY = 256


class Admission:
    """Counts texts admitted to the worker pool until their chunk is done; refuses work beyond `limit`.

    A request is refused whole and at once (503), so memory and waiting stay bounded; an idle pool
    takes any request, so a limit below --max-texts cannot lock a large request out for good.
    """

    def __init__(self, limit: int | None, metrics: Metrics) -> None:
        self.limit = limit
        self.queued = 0
        self._metrics = metrics

    def admit(self, count: int) -> None:
        if self.limit is not None and self.queued and self.queued + count > self.limit:
            self._metrics.rejected_requests.labels("queue").inc()
            raise Overloaded(
                f"{self.queued} texts are waiting for a tokenizer worker; {count} more would exceed the limit "
                f"of {self.limit}; retry later",
                headers={"Retry-After": RETRY_AFTER_SECONDS},
            )
        self.queued += count
        self._metrics.queued_texts.set(self.queued)

    def release(self, count: int) -> None:
        self.queued -= count
        self._metrics.queued_texts.set(self.queued)

    @contextmanager
    def holding(self, count: int) -> Iterator[Held]:
        """Admit `count` texts for a block that releases them chunk by chunk as they finish.

        What the block has not released when it ends is released then: a request cancelled before
        some of its chunks ever ran (a timeout, a hang-up) must not leave them counted for good.
        """
        self.admit(count)
        held = Held(self, count)
        try:
            yield held
        finally:
            held.release(held.remaining)


class Held:
    """Texts admitted for one request and not yet released."""

    def __init__(self, admission: Admission, count: int) -> None:
        self._admission = admission
        self.remaining = count

    def release(self, count: int) -> None:
        count = min(count, self.remaining)
        self.remaining -= count
        self._admission.release(count)


def _digest(text: str) -> bytes:
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

    def add(self, model: str, text: str) -> None:
        key = (model, _digest(text))
        if key in self._known:
            return
        self._known[key] = len(text)
        self._lengths[len(text)] += 1
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
            if len(text) in self._lengths and (model, _digest(text)) in self._known:
                return index
        return None
