"""Shared memory between the pre-tokenizer's process and the workers it forks: a chunk's texts go in, its ids come
back, without a pipe.

A pool's pipes cost more than the encode they feed: each chunk's UTF-8 and each chunk's ids (four bytes a token)
are pickled, written through a 64 KiB pipe, read back in pieces into a buffer and unpickled: 1.9 CPU-seconds for
the 757 MB of ids of 400 MB of text, against 0.2 through memory both processes map. So a run that forks its
workers maps `count` slots (one per chunk in flight) of anonymous shared memory before the fork; the parent puts a
chunk's texts in the slot it is sent with, the worker reads them there and puts the chunk's ids in the same slot,
and the parent copies them out as it takes the chunk's result, before the slot is used again. A chunk whose texts
or ids do not fit in a slot travels through the pipe as before.

The memory is an anonymous shared mapping, not a file in /dev/shm (which containers cap at 64 MiB): only the pages
a chunk touched are resident, counted as the process tree's memory.
"""

from __future__ import annotations

import contextlib
import mmap
from dataclasses import dataclass

import numpy as np

from tokenizer_service.core.texts import Utf8Texts

TEXT_BYTES = 2 << 20  # of a slot, for a chunk's UTF-8 (a local chunk is at most 1 MiB, and one text more)
IDS_BYTES = 8 << 20  # of a slot, for its ids (2 Mi ids: two a byte of text and more)


@dataclass(frozen=True)
class TextsInSlot:
    """A chunk's texts, put in slot `slot`: the bounds of each text in its UTF-8."""

    slot: int
    bounds: list[int]


@dataclass(frozen=True)
class IdsInSlot:
    """A chunk's ids, put in slot `slot` by the worker: `count` int32 ids, and the offsets of each text's."""

    slot: int
    count: int
    offsets: np.ndarray


class Slots:
    """`count` slots of shared memory, each `text_bytes` for a chunk's texts and `ids_bytes` for its ids."""

    def __init__(self, count: int, text_bytes: int | None = None, ids_bytes: int | None = None) -> None:
        self.count = count
        self.text_bytes, self.ids_bytes = text_bytes or TEXT_BYTES, ids_bytes or IDS_BYTES
        self.shared = False  # set once a pool's workers are forked with them (`process.share`)
        self.memory = mmap.mmap(-1, count * (self.text_bytes + self.ids_bytes))  # MAP_SHARED | MAP_ANONYMOUS

    def close(self) -> None:
        """Unmap the slots (the pool's workers are gone)."""
        with contextlib.suppress(BufferError):  # an array still viewing them: unmapped when it goes
            self.memory.close()

    def _text_at(self, slot: int) -> int:
        return slot * (self.text_bytes + self.ids_bytes)

    def put_texts(self, slot: int, texts: Utf8Texts) -> TextsInSlot | None:
        """The chunk's texts in `slot` (the parent, as it sends the chunk); None where they do not fit."""
        first, last = texts.bounds[0], texts.bounds[-1]
        size = last - first
        if size > self.text_bytes:
            return None
        start = self._text_at(slot)
        self.memory[start : start + size] = memoryview(texts.data)[first:last]
        return TextsInSlot(slot, [bound - first for bound in texts.bounds])

    def take_texts(self, texts: TextsInSlot) -> Utf8Texts:
        """The chunk's texts, read out of their slot (the worker)."""
        start = self._text_at(texts.slot)
        return Utf8Texts(self.memory[start : start + texts.bounds[-1]], texts.bounds)

    def put_ids(self, slot: int, ids: np.ndarray, offsets: np.ndarray) -> IdsInSlot | None:
        """The chunk's int32 ids in `slot` (the worker); None where they do not fit."""
        if ids.nbytes > self.ids_bytes:
            return None
        start = self._text_at(slot) + self.text_bytes
        np.frombuffer(self.memory, dtype=np.int32, count=len(ids), offset=start)[:] = ids
        return IdsInSlot(slot, len(ids), offsets)

    def take_ids(self, ids: IdsInSlot) -> np.ndarray:
        """A copy of the chunk's ids (the parent, before the slot takes another chunk)."""
        start = self._text_at(ids.slot) + self.text_bytes
        return np.frombuffer(self.memory, dtype=np.int32, count=ids.count, offset=start).copy()


def shared_slots(count: int) -> Slots | None:
    """`count` slots, or None where the system will not map them (the chunks then travel through the pipes)."""
    try:
        return Slots(count)
    except (OSError, ValueError, OverflowError):  # mmap refused (a strict overcommit policy, an address-space limit)
        return None
