"""Packing a stream that arrives in windows, in the client, without I/O (pure numpy).

Concat packing cuts one continuous token stream every ``seq_len`` tokens. Each /v1/pack request
with ``carry`` needs the previous request's leftover, so at most one such request can be in flight.
The prefetcher instead tokenizes windows of texts with /v1/tokenize (any number in flight: the
ids of a text do not depend on its neighbours) and cuts rows here, in stream order, with the same
``tokenizer_client.packing.pack_concat`` the server's /v1/pack uses, so the rows equal what /v1/pack makes of
the whole stream at once (which tests check).

Best-fit packing has no carry, so the server packs each window (/v1/pack, any number in flight) and
:class:`RowRegrouper` regroups its rows into blocks of exactly ``rows``.

Both know, after every block, the position to resume from: the first text that still has
undelivered tokens (concat) or rows (best_fit), and how many of them were already delivered.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from tokenizer_client import wire
from tokenizer_client.batches import ROW_FIELDS, PackedBatch
from tokenizer_client.packing import pack_concat


@dataclass(frozen=True)
class StreamPosition:
    """Where a stream resumes: text ``text``, of which ``skip`` tokens (concat) or rows (best_fit) are delivered."""

    text: int
    skip: int = 0


# A block: rows ready to hand out (a PackedBatch, model fields left for the caller to fill in), and
# the position to resume from once they are delivered.
Block = tuple[PackedBatch, StreamPosition]


class StreamMismatch(ValueError):
    """The texts given on resume do not continue the stream a saved state came from."""


class ConcatPacker:
    """Cuts a token stream, fed one window of documents at a time, into blocks of ``rows`` rows.

    Rows start every ``seq_len`` tokens from the start of the stream; a segment starts at each row
    start and at each document start, and ``position_ids`` restart there. ``cu_seqlens`` per row are
    ``[segment starts..., seq_len]``; with ``mask_document_start`` the label of each document's first
    token is IGNORE_INDEX. ``masked`` (conversations, records): each window comes with its loss mask, which
    travels with the tokens it describes (a document cut across rows and blocks keeps every token's mask),
    and labels are IGNORE_INDEX wherever it is 0.
    """

    def __init__(
        self, seq_len: int, rows: int, mask_document_start: bool, resume: StreamPosition, masked: bool = False
    ) -> None:
        self.seq_len = seq_len
        self.rows = rows
        self.mask_document_start = mask_document_start
        self._tokens = np.empty(0, np.int32)
        self._mask = np.empty(0, np.uint8) if masked else None  # one 0/1 per buffered token
        self._doc_starts = np.empty(0, np.int64)  # positions in _tokens where a document begins
        self._doc_texts = np.empty(0, np.int64)  # stream index of each of those documents
        self._head = resume  # the document that _tokens[0] belongs to, when no document begins there
        self._fed = resume.text  # texts fed so far (stream index of the next one)
        self._skip = resume.skip  # tokens of the first text to drop: delivered before a resume

    @property
    def buffered(self) -> int:
        return int(self._tokens.size)

    @property
    def masked(self) -> bool:
        return self._mask is not None

    def position_at(self, offset: int) -> StreamPosition:
        """The resume position after the first `offset` buffered tokens are delivered."""
        if offset >= self._tokens.size:
            return StreamPosition(self._fed, 0)
        j = int(np.searchsorted(self._doc_starts, offset, side="right")) - 1
        if j >= 0:
            return StreamPosition(int(self._doc_texts[j]), offset - int(self._doc_starts[j]))
        return StreamPosition(self._head.text, self._head.skip + offset)

    def feed(self, ids: np.ndarray, offsets: np.ndarray, start: int, loss_mask: np.ndarray | None = None) -> None:
        """Append the documents of texts ``start, start + 1, ...`` (ragged ids and offsets; the loss mask of the
        ids when the packer is ``masked``)."""
        if start != self._fed:
            raise ValueError(f"windows must be fed in order: expected text {self._fed}, got {start}")
        if (self._mask is None) != (loss_mask is None):
            raise ValueError("a masked packer takes a loss mask with every window, an unmasked one none")
        lengths = np.diff(offsets)
        continues = False
        if self._skip:
            if lengths.size == 0 or lengths[0] <= self._skip:
                have = int(lengths[0]) if lengths.size else 0
                raise StreamMismatch(
                    f"text {start} has {have} tokens but the saved state had delivered {self._skip} of them: "
                    "the texts or the model differ from the run the state came from"
                )
            ids = ids[self._skip :]
            if loss_mask is not None:
                loss_mask = loss_mask[self._skip :]
            offsets = np.maximum(offsets - self._skip, 0)
            lengths = np.diff(offsets)
            if self._tokens.size == 0:
                self._head = StreamPosition(start, self._skip)
            continues, self._skip = True, 0
        documents = np.flatnonzero(lengths > 0)
        if continues:
            documents = documents[documents != 0]
        base = self._tokens.size
        self._doc_starts = np.concatenate([self._doc_starts, offsets[documents] + base])
        self._doc_texts = np.concatenate([self._doc_texts, documents + start])
        self._tokens = np.concatenate([self._tokens, np.asarray(ids, dtype=np.int32)])
        if self._mask is not None:
            self._mask = np.concatenate([self._mask, np.asarray(loss_mask, dtype=np.uint8)])
        self._fed = start + lengths.size

    def take(self) -> Block | None:
        """The next block of exactly ``rows`` rows, if the buffer holds one."""
        if self._tokens.size < self.rows * self.seq_len:
            return None
        return self._block(self.rows)

    def finish(self) -> tuple[Block | None, np.ndarray]:
        """At the end of the stream: a last block of the full rows left (fewer than ``rows``), and the
        tokens that fill no row."""
        rows = self._tokens.size // self.seq_len
        block = self._block(rows) if rows else None
        return block, self._tokens.copy()

    @property
    def leftover_loss_mask(self) -> np.ndarray | None:
        """The loss mask of the buffered tokens (after ``finish``: of the leftover); None when not ``masked``."""
        return None if self._mask is None else self._mask.copy()

    def _block(self, rows: int) -> Block:
        used = rows * self.seq_len
        starts = self._doc_starts[self._doc_starts < used]
        continued = int(starts[0]) if starts.size else used  # tokens of a document begun in an earlier block
        packed = pack_concat(
            self._tokens[continued:used],
            np.append(starts, used) - continued,
            self.seq_len,
            carry=self._tokens[:continued],
            mask_document_start=self.mask_document_start,
            loss_mask=None if self._mask is None else self._mask[continued:used],
            carry_loss_mask=None if self._mask is None else self._mask[:continued],
        )
        documents = starts.size + (1 if continued else 0)
        batch = _rows(
            packed.input_ids,
            packed.labels,
            packed.position_ids,
            wire.split_ragged(packed.cu_seqlens, packed.cu_seqlens_offsets),
            self.seq_len,
            "concat",
            self.position_at(0).text,
            {"rows": rows, "tokens": used, "padding_tokens": 0, "padding_fraction": 0.0, "documents": documents},
        )
        self._head = after = self.position_at(used)
        keep = self._doc_starts >= used
        self._doc_starts = self._doc_starts[keep] - used
        self._doc_texts = self._doc_texts[keep]
        self._tokens = self._tokens[used:].copy()
        if self._mask is not None:
            self._mask = self._mask[used:].copy()
        return batch, after


def _rows(
    input_ids: np.ndarray,
    labels: np.ndarray,
    position_ids: np.ndarray,
    cu_seqlens: list[np.ndarray],
    seq_len: int,
    strategy: str,
    start: int,
    stats: dict[str, Any],
) -> PackedBatch:
    """Rows as a PackedBatch without the answer's model (the prefetcher fills it in) and no leftover."""
    empty = np.empty(0, np.int32)
    return PackedBatch(
        input_ids, labels, position_ids, cu_seqlens, empty, stats, "", seq_len, strategy, None, start=start
    )


class RowRegrouper:
    """Regroups the rows of best-fit packed windows into blocks of exactly ``rows`` rows, in order.

    Each window's answer waits in ``_parts`` with the number of its rows already handed out.
    """

    def __init__(self, seq_len: int, rows: int, resume: StreamPosition) -> None:
        self.seq_len = seq_len
        self.rows = rows
        self._parts: deque[tuple[PackedBatch, int]] = deque()
        self._fed = resume.text
        self._skip = resume.skip

    @property
    def buffered(self) -> int:
        return sum(len(answer) - first for answer, first in self._parts)

    def feed(self, answer: PackedBatch, start: int, stop: int) -> None:
        """Append the rows that texts ``[start, stop)`` packed into (one /v1/pack answer)."""
        if start != self._fed:
            raise ValueError(f"windows must be fed in order: expected text {self._fed}, got {start}")
        first, self._skip = self._skip, 0
        if first > len(answer):
            raise StreamMismatch(
                f"texts from {start} packed into {len(answer)} rows but the saved state had delivered {first}: "
                "the texts, the model or batch_size differ from the run the state came from"
            )
        if first < len(answer):
            self._parts.append((replace(answer, start=start), first))
        self._fed = stop

    def take(self) -> Block | None:
        if self.buffered < self.rows:
            return None
        return self._block(self.rows)

    def finish(self) -> Block | None:
        rows = self.buffered
        return self._block(rows) if rows else None

    def _block(self, rows: int) -> Block:
        pieces: list[tuple[PackedBatch, int, int]] = []
        needed = rows
        start = self._parts[0][0].start
        assert start is not None
        while needed:
            answer, first = self._parts.popleft()
            count = min(needed, len(answer) - first)
            pieces.append((answer, first, first + count))
            needed -= count
            if first + count < len(answer):
                self._parts.appendleft((answer, first + count))
        cu_seqlens = [row for answer, a, b in pieces for row in answer.cu_seqlens[a:b]]
        tokens = int(sum(int(row[-1]) for row in cu_seqlens))
        padding = rows * self.seq_len - tokens
        after = (
            StreamPosition(self._parts[0][0].start or 0, self._parts[0][1])
            if self._parts
            else StreamPosition(self._fed, 0)
        )
        input_ids, labels, position_ids = (
            np.concatenate([getattr(answer, name)[a:b] for answer, a, b in pieces]) for name in ROW_FIELDS
        )
        batch = _rows(
            input_ids,
            labels,
            position_ids,
            cu_seqlens,
            self.seq_len,
            "best_fit",
            start,
            {
                "rows": rows,
                "tokens": tokens,
                "padding_tokens": padding,
                "padding_fraction": padding / (rows * self.seq_len),
            },
        )
        return batch, after
