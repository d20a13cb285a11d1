"""A prefetched stream's bookkeeping, without I/O: options, windows of texts, in-order assembly, resume state.

Texts are read in windows of ``batch_size``; each window is one request. Answers are fed to the
:class:`Assembler` strictly in stream order; it turns them into deliveries (a batch plus the state to
save once that batch is handed out). A state names the first text with something not yet delivered
and how many of its tokens (concat) or of its request's rows (best_fit) were, so a resumed run
re-reads the stream from its start, skips what was delivered and goes on with the very next batch.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from client._packing import Block, ConcatPacker, Position, RowRegrouper
from client._protocol import PackedBatch, TokenizedBatch
from client._retry import RetryPolicy
from client.errors import PrefetchError, TokenizerError, TokenizerServiceError

Batch = TokenizedBatch | PackedBatch

STATE_FORMAT = "tokenizer-prefetch"
STATE_VERSION = 1


@dataclass(frozen=True)
class PackSpec:
    """Pack the stream into batches of ``rows`` rows of exactly ``seq_len`` tokens.

    ``concat`` (no padding; documents run across rows and batches) or ``best_fit`` (whole documents,
    pieces of at most ``seq_len``, padded; each request of ``batch_size`` texts packs on its own).
    ``add_eos``/``add_bos`` mark document boundaries in the ids; ``mask_document_start`` sets the
    label of each document's first token to -100.
    """

    seq_len: int
    rows: int
    strategy: Literal["concat", "best_fit"] = "concat"
    add_eos: bool = True
    add_bos: bool = False
    mask_document_start: bool = False

    def __post_init__(self) -> None:
        if self.seq_len < 2:
            raise ValueError(f"seq_len must be at least 2, got {self.seq_len}")
        if self.rows < 1:
            raise ValueError(f"rows must be at least 1, got {self.rows}")
        if self.strategy not in ("concat", "best_fit"):
            raise ValueError(f"strategy must be 'concat' or 'best_fit', got {self.strategy!r}")


@dataclass(frozen=True)
class PrefetchOptions:
    """Everything that decides what a prefetcher requests and hands out (validated once)."""

    batch_size: int
    depth: int
    model: str | None
    add_bos: bool
    add_eos: bool
    max_length: int | None
    sample: dict[str, Any] | None
    pack: PackSpec | None
    as_torch: bool
    pin_memory: bool
    retry: RetryPolicy

    @classmethod
    def build(
        cls,
        *,
        batch_size: int,
        depth: int,
        model: str | None,
        add_bos: bool,
        add_eos: bool,
        max_length: int | None,
        sample: dict[str, Any] | None,
        pack: PackSpec | None,
        as_torch: bool,
        pin_memory: bool,
        retry: RetryPolicy,
    ) -> PrefetchOptions:
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        if depth < 1:
            raise ValueError(f"depth must be at least 1, got {depth}")
        if pack is not None:
            if add_bos or add_eos or max_length is not None or sample is not None:
                raise ValueError(
                    "with pack=, set add_bos/add_eos on the PackSpec; max_length and sample do not apply to packing"
                )
            add_bos, add_eos = pack.add_bos, pack.add_eos
        if pin_memory and not as_torch:
            raise ValueError("pin_memory=True needs as_torch=True")
        if as_torch:
            from client._torch import check_torch

            pin_memory = check_torch(pin_memory)
        return cls(batch_size, depth, model, add_bos, add_eos, max_length, sample, pack, as_torch, pin_memory, retry)

    @property
    def mode(self) -> str:
        return "ragged" if self.pack is None else self.pack.strategy

    def fingerprint(self) -> dict[str, Any]:
        """The options a resumed run must repeat to produce the same ids."""
        options: dict[str, Any] = {
            "model": self.model,
            "add_bos": self.add_bos,
            "add_eos": self.add_eos,
            "max_length": self.max_length,
            "sample": self.sample,
        }
        if self.pack is not None:
            options.update(seq_len=self.pack.seq_len, mask_document_start=self.pack.mask_document_start)
        if self.mode == "best_fit":
            options["batch_size"] = self.batch_size  # best-fit rows depend on which texts share a request
        return options


@dataclass(frozen=True)
class Window:
    """One request's texts: stream indices ``start`` to ``start + len(texts)``."""

    start: int
    texts: list[str]

    @property
    def stop(self) -> int:
        return self.start + len(self.texts)


@dataclass(frozen=True)
class Delivery:
    """A batch ready for the consumer, with the state to save once it has been handed out."""

    batch: Batch
    state: dict[str, Any]
    texts: int
    tokens: int


@dataclass(frozen=True)
class Resume:
    """Where a prefetcher starts: a position in the stream and the number of batches already handed out."""

    position: Position
    batches: int
    model: str | None
    model_sha256: str | None

    @classmethod
    def from_state(cls, state: dict[str, Any] | None, options: PrefetchOptions) -> Resume:
        if state is None:
            return cls(Position(0, 0), 0, None, None)
        if state.get("format") != STATE_FORMAT or state.get("version") != STATE_VERSION:
            raise ValueError(f"not a prefetch state of version {STATE_VERSION}: {state!r:.200}")
        if state["mode"] != options.mode:
            raise ValueError(f"the state is of a {state['mode']!r} prefetch, this one is {options.mode!r}")
        if state["options"] != options.fingerprint():
            raise ValueError(f"the state was saved with options {state['options']}, not {options.fingerprint()}")
        position = Position(int(state["text"]), int(state["skip"]))
        return cls(position, int(state["batches"]), state["model"], state["sha256"])


def state_dict(
    options: PrefetchOptions, position: Position, batches: int, model: str | None, sha256: str | None
) -> dict[str, Any]:
    return {
        "format": STATE_FORMAT,
        "version": STATE_VERSION,
        "mode": options.mode,
        "text": position.text,
        "skip": position.skip,
        "batches": batches,
        "model": model,
        "sha256": sha256,
        "options": options.fingerprint(),
    }


class Assembler:
    """Turns answers, fed in stream order, into deliveries; runs only on the event loop, in order."""

    def __init__(self, options: PrefetchOptions, resume: Resume) -> None:
        self.options = options
        self.batches = resume.batches
        self.position = resume.position
        self.model = resume.model
        self.sha256 = resume.model_sha256
        self.leftover = np.empty(0, np.int32)
        pack = options.pack
        self._packer: ConcatPacker | None = None
        self._regrouper: RowRegrouper | None = None
        if pack is not None and pack.strategy == "concat":
            self._packer = ConcatPacker(pack.seq_len, pack.rows, pack.mask_document_start, resume.position)
        elif pack is not None:
            self._regrouper = RowRegrouper(pack.seq_len, pack.rows, resume.position)

    def feed(self, window: Window, answer: Batch) -> list[Delivery]:
        self.model, self.sha256 = answer.model, answer.model_sha256
        if isinstance(answer, TokenizedBatch) and self._packer is None:
            batch = dataclasses.replace(answer, index=self.batches, start=window.start)
            return [self._deliver(batch, Position(window.stop, 0), len(window.texts), answer.num_tokens)]
        if isinstance(answer, TokenizedBatch):
            assert self._packer is not None
            self._packer.feed(np.asarray(answer.ids), np.asarray(answer.offsets), window.start)
            return self._drain(self._packer.take)
        assert self._regrouper is not None
        self._regrouper.feed(
            answer.input_ids, answer.labels, answer.position_ids, answer.cu_seqlens, window.start, window.stop
        )
        return self._drain(self._regrouper.take)

    def finish(self) -> list[Delivery]:
        """The last, partial block at the end of the stream (packing), and the leftover tokens."""
        if self._packer is not None:
            block, self.leftover = self._packer.finish()
            return [self._packed(block, self.leftover)] if block is not None else []
        if self._regrouper is not None:
            block = self._regrouper.finish()
            return [self._packed(block, self.leftover)] if block is not None else []
        return []

    def _drain(self, take: Callable[[], Block | None]) -> list[Delivery]:
        deliveries = []
        while (block := take()) is not None:
            deliveries.append(self._packed(block, np.empty(0, np.int32)))
        return deliveries

    def _packed(self, block: Block, leftover: np.ndarray) -> Delivery:
        pack = self.options.pack
        assert pack is not None
        batch = PackedBatch(
            input_ids=block.input_ids,
            labels=block.labels,
            position_ids=block.position_ids,
            cu_seqlens=block.cu_seqlens,
            leftover=leftover,
            stats=block.stats,
            model=self.model or "",
            seq_len=pack.seq_len,
            strategy=pack.strategy,
            model_sha256=self.sha256,
            index=self.batches,
            start=block.start,
        )
        return self._deliver(batch, block.after, block.after.text - self.position.text, int(block.stats["tokens"]))

    def _deliver(self, batch: Batch, after: Position, texts: int, tokens: int) -> Delivery:
        self.batches += 1
        self.position = after
        return Delivery(batch, state_dict(self.options, after, self.batches, self.model, self.sha256), texts, tokens)


def failure(window: Window, exc: TokenizerError, batch_index: int) -> PrefetchError:
    text_index = None
    if isinstance(exc, TokenizerServiceError) and exc.field == "texts" and exc.index is not None:
        text_index = window.start + exc.index
    return PrefetchError(
        f"batch {batch_index} (texts {window.start} to {window.stop - 1}) failed: {exc}",
        batch_index=batch_index,
        text_start=window.start,
        text_stop=window.stop,
        text_index=text_index,
    )


class TextReader:
    """Reads windows of texts from the caller's iterable, skipping the texts a saved state delivered."""

    def __init__(self, texts: Iterable[str], batch_size: int, start: int) -> None:
        if isinstance(texts, (str, bytes)):
            raise TypeError("texts must be an iterable of str (a list, a generator, a file...), not one string")
        self._iterator: Iterator[str] = iter(texts)
        self._batch_size = batch_size
        self._start = start
        self._position = 0

    def _skip(self) -> None:
        if self._position < self._start:
            skipped = sum(1 for _ in itertools.islice(self._iterator, self._start - self._position))
            self._position += skipped
            if self._position < self._start:
                raise ValueError(f"the stream ended at text {self._position}, before the saved position {self._start}")

    def next_window(self) -> Window | None:
        self._skip()
        texts = list(itertools.islice(self._iterator, self._batch_size))
        return self._window(texts)

    def _window(self, texts: list[str]) -> Window | None:
        if set(map(type, texts)) - {str}:  # one pass in C; then look closer (str subclasses are fine)
            for i, text in enumerate(texts):
                if not isinstance(text, str):
                    raise TypeError(f"text {self._position + i} is a {type(text).__name__}, not a str")
        if not texts:
            return None
        window = Window(self._position, texts)
        self._position += len(texts)
        return window


class AsyncTextReader(TextReader):
    """The same over a sync or an async iterable (a sync one is read on the event loop)."""

    def __init__(self, texts: Iterable[str] | AsyncIterable[str], batch_size: int, start: int) -> None:
        self._async: AsyncIterator[str] | None = None
        if isinstance(texts, AsyncIterable):
            self._async = texts.__aiter__()
            texts = ()
        super().__init__(texts, batch_size, start)

    async def _next(self) -> tuple[bool, str]:
        assert self._async is not None
        try:
            return True, await self._async.__anext__()
        except StopAsyncIteration:
            return False, ""

    async def next_window_async(self) -> Window | None:
        if self._async is None:
            return self.next_window()
        while self._position < self._start:
            more, _ = await self._next()
            if not more:
                raise ValueError(f"the stream ended at text {self._position}, before the saved position {self._start}")
            self._position += 1
        texts: list[str] = []
        while len(texts) < self._batch_size:
            more, text = await self._next()
            if not more:
                break
            texts.append(text)
        return self._window(texts)
