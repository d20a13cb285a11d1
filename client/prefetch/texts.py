"""Where a prefetcher's texts come from: windows of ``batch_size`` texts, each one request.

:class:`TextReader` reads a sync iterable in the thread that calls ``read()``: Prefetcher's, the
thread that calls ``next()``. AsyncPrefetcher awaits ``next_window()`` of the reader
:func:`open_texts` picks: a TextReader for a sync iterable (read on the event loop), an
:class:`AsyncTextReader` for an async one. Every reader skips the texts a saved state says were
delivered, and checks that each text is a str (or, for conversations, a list of messages; for prompt-completion
records, a dict). :func:`detect_inputs` decides which of the three a stream holds, from its first item.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from tokenizer_client._inputs import check_texts
from tokenizer_client._requests import Inputs

ITEM_TYPES = {"texts": str, "conversations": list, "records": dict}
ITEM_NAMES = {"texts": "text", "conversations": "conversation", "records": "record"}
KINDS_HINT = (
    "conversations are lists of message dicts (prefetch(..., conversations=True)), prompt-completion records "
    'dicts with "prompt" and "completion" (records=True)'
)


@dataclass(frozen=True)
class Window:
    """One request's texts: stream indices ``start`` to ``start + len(texts)``."""

    start: int
    texts: list[str]

    @property
    def stop(self) -> int:
        return self.start + len(self.texts)


def canonical_json(item: object) -> str:
    """A conversation or record as one canonical JSON text (keys sorted, no spaces): what its fingerprint hashes."""
    return json.dumps(item, sort_keys=True, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def text_fingerprint(text: object) -> str:
    """A short hash of one text (its UTF-8), or of one conversation or record (its canonical JSON), which a saved
    state keeps to check that a resumed stream continues there."""
    if not isinstance(text, str):
        try:
            text = canonical_json(text)
        except (TypeError, ValueError):
            return hashlib.blake2b(repr(text).encode("utf-8", "replace"), digest_size=12).hexdigest()
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=12).hexdigest()


def _shown(item: object) -> str:
    """The start of an item, for an error message."""
    if not isinstance(item, str):
        try:
            item = canonical_json(item)
        except (TypeError, ValueError):
            return type(item).__name__
    return f"{item[:40]!r}{'...' * (len(item) > 40)}"


def detected_kind(first: object) -> Inputs:
    """What a stream whose first item is `first` holds: conversations (a non-empty list of dicts), prompt-completion
    records (a dict with "prompt" and "completion"), else texts."""
    if isinstance(first, list) and first and all(isinstance(message, dict) for message in first):
        return "conversations"
    if isinstance(first, dict) and "prompt" in first and "completion" in first:
        return "records"
    return "texts"


def _raising(exc: Exception) -> Iterator[Any]:
    raise exc
    yield


def detect_inputs(
    items: Iterable[Any] | AsyncIterable[Any], conversations: bool | None, records: bool | None
) -> tuple[Inputs, Iterable[Any] | AsyncIterable[Any]]:
    """Which of texts, conversations and records `items` holds, and the items to read (the same stream).

    ``conversations=True`` or ``records=True`` says so; otherwise a sync iterable's first item decides
    (``detected_kind``; a kind given False is not detected), read ahead and handed back in front of the rest.
    An async iterable cannot be looked into before the first batch: it is texts unless a flag says otherwise.
    """
    if conversations and records:
        raise ValueError("conversations=True and records=True: a stream holds one kind of item")
    if conversations:
        return "conversations", items
    if records:
        return "records", items
    if isinstance(items, AsyncIterable | str | bytes | bytearray | dict):
        return "texts", items  # a single str or dict is refused, as before, by the reader
    kind: Inputs
    if isinstance(items, Sequence):
        kind = detected_kind(items[0]) if len(items) else "texts"
    else:
        iterator = iter(items)
        try:
            first = next(iterator)
        except StopIteration:
            return "texts", iter(())
        except Exception as exc:  # raised from next(), after the batches before it (none), as a source's error is
            return "texts", _raising(exc)
        kind = detected_kind(first)
        items = itertools.chain([first], iterator)
    if (kind == "conversations" and conversations is False) or (kind == "records" and records is False):
        kind = "texts"
    return kind, items


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
    inputs: str = "texts",
) -> WindowReader:
    """The reader of `texts` in windows of `batch_size`, from stream index `start` on (the texts before are skipped).

    `inside`: the saved state stopped inside text `start`, so the stream must have it. `check`: the text
    (`start - 1`, or `start` when inside) whose fingerprint the state kept; another text there is a ValueError.
    `inputs`: what the items are (texts, conversations or records), each checked to be one."""
    if isinstance(texts, AsyncIterable):
        return AsyncTextReader(texts, batch_size, start, inside, check, inputs)
    return TextReader(texts, batch_size, start, inside, check, inputs)


class _Windows:
    """Counts the stream position and cuts windows; the readers below add where the texts come from."""

    def __init__(
        self, batch_size: int, start: int, inside: bool = False, check: TextCheck | None = None, inputs: str = "texts"
    ) -> None:
        self._inputs = inputs
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
            item = ITEM_NAMES[self._inputs]
            where = f"inside {item} {self._start}" if self._inside else f"before {item} {self._start}"
            raise ValueError(
                f"the stream given does not continue where the saved state stopped ({where}): its {item} {index} "
                f"({_shown(text)}) is not the {item} the saved run read there; resume on the same {self._inputs} "
                "from the start "
                "of the stream (not a generator already partly consumed, nor a changed or reordered source)"
            )

    def _refuse(self, index: int, item: object) -> None:
        """TypeError: item `index` is not of the stream's kind (saying how to pass another kind)."""
        if self._inputs == "texts":
            hint = "; " + KINDS_HINT if isinstance(item, list | dict) else ""
            raise TypeError(f"text {index} is a {type(item).__name__}, not a str{hint}")
        what = "a list of messages" if self._inputs == "conversations" else 'a {"prompt", "completion"} dict'
        raise TypeError(f"{ITEM_NAMES[self._inputs]} {index} is a {type(item).__name__}, not {what}")

    def _ended_before_start(self) -> ValueError:
        return ValueError(f"the stream ended at text {self._position}, before the saved position {self._start}")

    def _window(self, texts: list[str]) -> Window | None:
        kind = ITEM_TYPES[self._inputs]
        if set(map(type, texts)) - {kind}:  # one pass in C; then look closer (subclasses are fine)
            for i, text in enumerate(texts):
                if not isinstance(text, kind):
                    self._refuse(self._position + i, text)
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
        self,
        texts: Iterable[str],
        batch_size: int,
        start: int,
        inside: bool = False,
        check: TextCheck | None = None,
        inputs: str = "texts",
    ) -> None:
        check_texts(texts)
        super().__init__(batch_size, start, inside, check, inputs)
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
        inputs: str = "texts",
    ) -> None:
        super().__init__(batch_size, start, inside, check, inputs)
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
