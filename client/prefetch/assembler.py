"""Answers fed in stream order become deliveries: batches (ragged, or rows cut and regrouped) with their states.

No I/O and no asyncio: the prefetch pipeline feeds each window's answer here once every answer
before it has been fed, whatever order they arrived in.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from tokenizer_client.batches import Batch, TokenizedBatch
from tokenizer_client.prefetch.options import PackSpec, PrefetchOptions
from tokenizer_client.prefetch.resume import Resume, state_dict
from tokenizer_client.prefetch.rows import Block, ConcatPacker, RowRegrouper, StreamPosition
from tokenizer_client.prefetch.texts import TextCheck, Window, text_fingerprint


@dataclass(frozen=True)
class Delivery:
    """A batch ready for the consumer, with the state to save once it has been handed out."""

    batch: Batch
    state: dict[str, Any]
    texts: int
    tokens: int


class Assembler:
    """Turns answers, fed in stream order, into deliveries."""

    def __init__(self, options: PrefetchOptions, resume: Resume) -> None:
        self.options = options
        self.batches = resume.batches
        self.position = resume.position
        self.model = resume.model
        self.sha256 = resume.model_sha256
        self.check = resume.check  # the last text read, as the state after the last delivery names it
        self._windows: deque[Window] = deque()  # those from the text `check` will name next on
        self.leftover = np.empty(0, np.int32)
        self.leftover_loss_mask: np.ndarray | None = None  # conversations and records (concat): the leftover's mask
        self.empty_reason: str | None = None  # set by finish() when the stream delivered no batch
        # A run from the stream's start that delivers nothing says why (a resumed one may just be at the end).
        self._delivered = 0 if resume.position == StreamPosition(0, 0) else 1
        pack = options.pack
        self._packer: ConcatPacker | None = None
        self._regrouper: RowRegrouper | None = None
        if pack is not None and pack.strategy == "concat":
            masked = options.inputs != "texts"
            self._packer = ConcatPacker(pack.seq_len, pack.rows, pack.mask_document_start, resume.position, masked)
        elif pack is not None:
            self._regrouper = RowRegrouper(pack.seq_len, pack.rows, resume.position)

    def feed(self, window: Window, answer: Batch) -> list[Delivery]:
        self.model, self.sha256 = answer.model, answer.model_sha256
        self._windows.append(window)
        if isinstance(answer, TokenizedBatch) and self._packer is None:
            batch = replace(answer, index=self.batches, start=window.start)
            return [self._deliver(batch, StreamPosition(window.stop, 0), len(window.texts), answer.num_tokens)]
        if isinstance(answer, TokenizedBatch):
            assert self._packer is not None
            mask = None if answer.loss_mask is None else np.asarray(answer.loss_mask)
            if self._packer.masked and mask is None:
                raise ValueError(f"the answer to {self.options.inputs} {window.start}.. carries no loss mask")
            self._packer.feed(np.asarray(answer.ids), np.asarray(answer.offsets), window.start, mask)
            return self._drain(self._packer.take)
        assert self._regrouper is not None
        self._regrouper.feed(answer, window.start, window.stop)
        return self._drain(self._regrouper.take)

    def finish(self) -> list[Delivery]:
        """The last, partial block at the end of the stream (packing; dropped with ``drop_last``), and the
        leftover tokens. When the stream delivered no batch at all, ``empty_reason`` says why."""
        pack = self.options.pack
        if self._packer is not None:
            block, self.leftover = self._packer.finish()
            self.leftover_loss_mask = self._packer.leftover_loss_mask
        elif self._regrouper is not None:
            block = self._regrouper.finish()
        else:
            if not self._delivered:
                self.empty_reason = "the stream held no texts"
            return []
        assert pack is not None
        dropped = 0
        if block is not None and pack.drop_last and len(block[0]) < pack.rows:
            dropped, block = len(block[0]), None
        deliveries = [self._packed(block, self.leftover, self.leftover_loss_mask)] if block is not None else []
        if not self._delivered and not deliveries:
            self.empty_reason = self._why_empty(pack, dropped)
        return deliveries

    def _why_empty(self, pack: PackSpec, dropped: int) -> str:
        if dropped:
            return (
                f"the stream packed into {dropped} rows, fewer than one batch of {pack.rows}, "
                "and drop_last=True dropped them"
            )
        if self.leftover.size:
            return (
                f"the stream's {self.leftover.size} tokens fill no row of seq_len={pack.seq_len} "
                "(concat rows are never padded); they are in .leftover"
            )
        return "the stream held no texts" if self.position.text == 0 else "the stream held no tokens"

    def _drain(self, take: Callable[[], Block | None]) -> list[Delivery]:
        deliveries = []
        while (block := take()) is not None:
            empty_mask = None if self._packer is None or not self._packer.masked else np.empty(0, np.uint8)
            deliveries.append(self._packed(block, np.empty(0, np.int32), empty_mask))
        return deliveries

    def _packed(self, block: Block, leftover: np.ndarray, leftover_mask: np.ndarray | None = None) -> Delivery:
        rows, after = block
        batch = replace(
            rows,
            leftover=leftover,
            leftover_loss_mask=leftover_mask,
            model=self.model or "",
            model_sha256=self.sha256,
            index=self.batches,
        )
        return self._deliver(batch, after, after.text - self.position.text, int(rows.stats["tokens"]))

    def _deliver(self, batch: Batch, after: StreamPosition, texts: int, tokens: int) -> Delivery:
        self._delivered += 1
        self.batches += 1
        self.position = after
        self.check = self._last_read(after)
        state = state_dict(self.options, after, self.batches, self.model, self.sha256, self.check)
        return Delivery(batch, state, texts, tokens)

    def _last_read(self, after: StreamPosition) -> TextCheck | None:
        """The fingerprint a state at `after` keeps: of the text it stops inside, else of the one before it."""
        index = after.text if after.skip else after.text - 1
        while self._windows and self._windows[0].stop <= index:  # positions only move on: never needed again
            self._windows.popleft()
        if self._windows and self._windows[0].start <= index:
            window = self._windows[0]
            return TextCheck(index, text_fingerprint(window.texts[index - window.start]))
        return self.check if self.check is not None and self.check.text == index else None
