"""Texts as a binary request body carries them: their UTF-8 end to end and where each starts, decoded only on use.

An encoder that reads UTF-8 (gigatoken) takes each text's bytes as they arrived: no Python ``str`` is built for it,
and none is encoded back to UTF-8 by the call (for 256 multilingual documents, 0.9 ms of decoding and as much
again of re-encoding, of a 5 ms encode). Everything else sees a sequence of ``str``, each decoded when it is read.
A slice shares the bytes; pickled (a chunk of a split request), it carries only its own.

Pure logic: no I/O.
"""

from __future__ import annotations

import codecs
import functools
from collections.abc import Iterator, Sequence
from typing import Any, overload

import numpy as np


class Utf8Texts(Sequence[str]):
    """Texts ``data[bounds[i]:bounds[i + 1]]``, each valid UTF-8 (checked by `all_valid` or made by `of`)."""

    __slots__ = ("bounds", "data")

    def __init__(self, data: bytes, bounds: list[int]) -> None:
        self.data = data
        self.bounds = bounds  # one more than there are texts, non-decreasing, within data

    def __len__(self) -> int:
        return len(self.bounds) - 1

    @overload
    def __getitem__(self, index: int) -> str: ...

    @overload
    def __getitem__(self, index: slice) -> Utf8Texts: ...

    def __getitem__(self, index: int | slice) -> str | Utf8Texts:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                return Utf8Texts.of([self[i] for i in range(start, stop, step)])
            return Utf8Texts(self.data, self.bounds[start : max(start, stop) + 1])
        count = len(self)
        if index < 0:
            index += count
        if not 0 <= index < count:
            raise IndexError("text index out of range")
        return str(self.data[self.bounds[index] : self.bounds[index + 1]], "utf-8")

    def __iter__(self) -> Iterator[str]:
        data, bounds = self.data, self.bounds
        for index in range(len(bounds) - 1):
            yield str(data[bounds[index] : bounds[index + 1]], "utf-8")

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Utf8Texts):
            return self.utf8() == other.utf8()
        if isinstance(other, Sequence) and not isinstance(other, str | bytes):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # a sequence, compared by value

    def __repr__(self) -> str:
        return f"Utf8Texts({len(self)} texts, {self.bounds[-1] - self.bounds[0]} bytes)"

    def __reduce__(self) -> tuple[Any, ...]:
        first, last = self.bounds[0], self.bounds[-1]
        return Utf8Texts, (self.data[first:last], [bound - first for bound in self.bounds])

    def utf8(self) -> list[bytes]:
        """Each text's UTF-8 bytes."""
        return list(self.each_utf8())

    def each_utf8(self) -> Iterator[bytes]:
        """Each text's UTF-8 bytes, one at a time."""
        data, bounds = self.data, self.bounds
        for index in range(len(bounds) - 1):
            yield data[bounds[index] : bounds[index + 1]]

    def sizes(self) -> np.ndarray:
        """Each text's size in UTF-8 bytes (int64)."""
        return np.diff(np.asarray(self.bounds, dtype=np.int64))

    @classmethod
    def of(cls, texts: Sequence[str | bytes | memoryview]) -> Utf8Texts:
        """The same texts as UTF-8 (a ``str`` with a lone surrogate raises UnicodeEncodeError); bytes-like ones are
        taken to be UTF-8 already."""
        encoded = [text.encode("utf-8") if isinstance(text, str) else text for text in texts]
        bounds = np.zeros(len(encoded) + 1, dtype=np.int64)
        np.cumsum([len(item) for item in encoded], out=bounds[1:])
        return cls(b"".join(encoded), bounds.tolist())


def readable(texts: Sequence[str], library: Any) -> Sequence[str]:
    """The texts as `library` (a tokenizer_service.core.libraries.Library) encodes them: `Utf8Texts` stay UTF-8
    for an encoder that reads it (`library.takes_utf8`) and are decoded once for any other."""
    if isinstance(texts, Utf8Texts) and not library.takes_utf8:
        return list(texts)
    return texts


def as_utf8(texts: list[Any]) -> Sequence[str]:
    """`texts` (str, or bytes-like UTF-8) as `Utf8Texts` to send to another process (one bytes object to pickle
    instead of a str each); as a list of str where one cannot be UTF-8 (a lone surrogate: the encoder's own error
    says so)."""
    try:
        return Utf8Texts.of(texts)
    except UnicodeEncodeError:
        return [text if isinstance(text, str) else str(text, "utf-8") for text in texts]


def text_sizes(texts: Sequence[str]) -> np.ndarray:
    """What a text weighs when a request is cut into chunks: characters, or UTF-8 bytes for `Utf8Texts`
    (an encoder's work follows the bytes more closely than the characters)."""
    if isinstance(texts, Utf8Texts):
        return texts.sizes()
    return np.fromiter((len(text) for text in texts), dtype=np.int64, count=len(texts))


def all_valid(data: bytes, offsets: np.ndarray) -> bool:
    """Whether every text ``data[offsets[i]:offsets[i + 1]]`` is valid UTF-8 (int64 offsets from 0 to len(data),
    non-decreasing; a sequence cut between two texts is invalid in both). With pyarrow installed (the corpora extra;
    the server does not need it), Arrow checks the texts as one large-string array without building a str: for 712
    KB of 10-language text 0.39 ms, against 0.9 ms decoding it (12% of a worker's whole job on a gigatoken model).
    Else the buffer is decoded a window at a time. The caller finds which text is not."""
    pa = _pyarrow()
    if pa is None:
        return _all_decode(data, offsets)
    bounds = pa.py_buffer(np.ascontiguousarray(offsets, dtype=np.int64))
    texts = pa.LargeStringArray.from_buffers(len(offsets) - 1, bounds, pa.py_buffer(data))
    try:
        texts.validate(full=True)
    except pa.ArrowInvalid:
        return False
    return True


@functools.cache  # once a process: a missing module is searched for again at every import (a request's)
def _pyarrow() -> Any:
    """pyarrow, imported on first use (the pre-tokenizer imports this module and never checks a frame), or None."""
    try:
        import pyarrow
    except ImportError:
        return None
    return pyarrow


# Bytes decoded at a time where pyarrow is not installed: the str each window makes (up to 4 bytes a character)
# stays in the core's cache (0.65 ms for 712 KB of 10-language text with 32 KiB windows, 1.1-1.5 ms with 1 MiB).
VALIDATE_WINDOW = 1 << 15


def _all_decode(data: bytes, offsets: np.ndarray, window: int = VALIDATE_WINDOW) -> bool:
    """`all_valid` by Python's incremental decoder: the whole buffer decodes, and no text starts with a continuation
    byte (a sequence cut between two texts would decode whole)."""
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    view = memoryview(data)
    try:
        for start in range(0, len(data), window):
            decoder.decode(view[start : start + window])
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        return False
    if len(offsets) > 2 and len(data):
        starts = offsets[1:-1]
        starts = starts[starts < len(data)]
        if len(starts) and bool(np.any((np.frombuffer(data, dtype=np.uint8)[starts] & 0xC0) == 0x80)):
            return False
    return True
