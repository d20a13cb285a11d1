"""Texts known to be poison: the last ones found to kill or stall a worker, remembered by sha256."""

from __future__ import annotations

import hashlib
from collections import Counter, OrderedDict

POISON_MEMORY = 256


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
