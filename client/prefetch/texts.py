"""Where a prefetcher's texts come from: windows of ``batch_size`` texts, each one request.

:class:`TextReader` reads a sync iterable in the thread that calls ``read()``: Prefetcher's, the
thread that calls ``next()``. AsyncPrefetcher awaits ``next_window()`` of the reader
:func:`open_texts` picks: a TextReader for a sync iterable (read on the event loop), an
:class:`AsyncTextReader` for an async one. Every reader skips the texts a saved state says were
delivered, and checks that each text is a str.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

from tokenizer_client._inputs import check_texts


@dataclass(frozen=True)
class Window:
    """One request's texts: stream indices ``start`` to ``start + len(texts)``."""

    start: int
    texts: list[str]

    @property
    def stop(self) -> int:
        return self.start + len(self.texts)


def text_fingerprint(text: object) -> str:
    """A short hash of one text, which a saved state keeps to check that a resumed stream continues there."""
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else repr(text).encode("utf-8", "replace")
    return hashlib.blake2b(data, digest_size=12).hexdigest()


@dataclass(frozen=True)
class TextCheck:
    """A text the saved run read: its stream index and ``text_fingerprint``, checked when a resumed run reads it."""

    text: int
    fingerprint: str


class WindowReader(Protocol):
    async def next_window(self) -> Window | None: ...


def open_texts(
    texts: Iterable[str] | AsyncIterable[str],
    batch_size: int,
    start: int,
    inside: bool = False,
    check: TextCheck | None = None,
) -> WindowReader:
    """The reader of `texts` in windows of `batch_size`, from stream index `start` on (the texts before are skipped).

    `inside`: the saved state stopped inside text `start`, so the stream must have it. `check`: the text
    (`start - 1`, or `start` when inside) whose fingerprint the state kept; another text there is a ValueError."""
    if isinstance(texts, AsyncIterable):
        return AsyncTextReader(texts, batch_size, start, inside, check)
    return TextReader(texts, batch_size, start, inside, check)


class _Windows:
    """Counts the stream position and cuts windows; the readers below add where the texts come from."""

    def __init__(self, batch_size: int, start: int, inside: bool = False, check: TextCheck | None = None) -> None:
        self._batch_size = batch_size
        self._start = start
        self._inside = inside
        self._check = check if check is not None and check.text in (start - 1, start) else None
        self._position = 0

    @property
    def _skips_checked(self) -> int:
        """How many of the texts before `start` to skip unread: all but the one checked, if that is `start - 1`."""
        checked = self._check is not None and self._check.text == self._start - 1
        return self._start - int(checked)

    def _verify(self, index: int, text: object) -> None:
        """Text `index` of the stream given must be the one the saved state's run read there."""
        check = self._check
        if check is None or check.text != index:
            return
        self._check = None
        if text_fingerprint(text) != check.fingerprint:
            where = f"inside text {self._start}" if self._inside else f"before text {self._start}"
            shown = f"{text[:40]!r}{'...' * (len(text) > 40)}" if isinstance(text, str) else type(text).__name__
            raise ValueError(
                f"the stream given does not continue where the saved state stopped ({where}): its text {index} "
                f"({shown}) is not the text the saved run read there; resume on the same texts from the start "
                "of the stream (not a generator already partly consumed, nor a changed or reordered source)"
            )

    def _ended_before_start(self) -> ValueError:
        return ValueError(f"the stream ended at text {self._position}, before the saved position {self._start}")

    def _window(self, texts: list[str]) -> Window | None:
        if set(map(type, texts)) - {str}:  # one pass in C; then look closer (str subclasses are fine)
            for i, text in enumerate(texts):
                if not isinstance(text, str):
                    raise TypeError(f"text {self._position + i} is a {type(text).__name__}, not a str")
        if not texts:
            if self._inside and self._position == self._start:
                raise ValueError(
                    f"the stream ended at text {self._position}, but the saved position is inside text "
                    f"{self._start}: resume on the same texts the state was saved from"
                )
            return None
        self._verify(self._position, texts[0])
        window = Window(self._position, texts)
        self._position += len(texts)
        return window


class TextReader(_Windows):
    """Reads windows from a sync iterable, in the thread that calls ``read()`` (or awaits ``next_window()``)."""

    def __init__(
        self, texts: Iterable[str], batch_size: int, start: int, inside: bool = False, check: TextCheck | None = None
    ) -> None:
        check_texts(texts)
        super().__init__(batch_size, start, inside, check)
        self._iterator: Iterator[str] = iter(texts)

    def read(self) -> Window | None:
        if self._position < self._start:
            skip = self._skips_checked - self._position
            self._position += sum(1 for _ in itertools.islice(self._iterator, skip))
            if self._position < self._start:  # the checked text, start - 1, if any
                for text in itertools.islice(self._iterator, self._start - self._position):
                    self._verify(self._position, text)
                    self._position += 1
            if self._position < self._start:
                raise self._ended_before_start()
        return self._window(list(itertools.islice(self._iterator, self._batch_size)))

    async def next_window(self) -> Window | None:
        """``read()``, for AsyncPrefetcher (a sync iterable is read on the event loop)."""
        return self.read()


class AsyncTextReader(_Windows):
    """Reads windows from an async iterable."""

    def __init__(
        self,
        texts: AsyncIterable[str],
        batch_size: int,
        start: int,
        inside: bool = False,
        check: TextCheck | None = None,
    ) -> None:
        super().__init__(batch_size, start, inside, check)
        self._iterator: AsyncIterator[str] = texts.__aiter__()

    async def _next(self) -> tuple[bool, str]:
        try:
            return True, await self._iterator.__anext__()
        except StopAsyncIteration:
            return False, ""

    async def next_window(self) -> Window | None:
        while self._position < self._start:
            more, text = await self._next()
            if not more:
                raise self._ended_before_start()
            self._verify(self._position, text)
            self._position += 1
        texts: list[str] = []
        while len(texts) < self._batch_size:
            more, text = await self._next()
            if not more:
                break
            texts.append(text)
        return self._window(texts)
