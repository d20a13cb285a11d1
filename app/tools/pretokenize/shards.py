"""Shard builders: ragged documents, concat rows, best-fit rows; each closes shards at document boundaries.

Where a shard ends depends only on the documents, never on how they were batched for tokenizing, and
each closed shard records the position after its last document (plus, for concat, the ids that did not
fill a row): so a resumed run rebuilds exactly the shards an uninterrupted run writes. The bytes of a
shard are `tokenizer_client.dataset.write_shard`'s, the format's one writer.

Outputs with loss masks (conversations, prompt-completion records) carry each id's mask along the same way: a
ragged shard's ``.mask`` is the documents' masks end to end, a packed one's the rows' (0 on best_fit padding),
and concat's carry keeps its mask (``leftover.loss_mask``), so a resumed run cuts the same masked rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from tokenizer_client.dataset import MASK_DTYPE, is_masked, shard_name, write_shard
from tokenizer_client.packing import IGNORE_INDEX, pack_best_fit, pack_concat
from tokenizer_client.wire import ragged_offsets
from tokenizer_service.tools.pretokenize.sources import Position, Source, source_at
from tokenizer_service.tools.pretokenize.store import OutputDir

Leftover = tuple[np.ndarray, np.ndarray, np.ndarray | None]  # concat's carry: ids, document starts, mask


class ShardSink:
    """Writes complete shards and, after each, metadata.json saying how to go on from there."""

    def __init__(self, out: OutputDir, metadata: dict[str, Any], sources: list[Source]) -> None:
        self.out = out
        self.metadata = metadata  # the whole document; shards, totals and sources are updated here
        self.sources = sources  # the reader's, updated as it reads (it runs ahead of the shards)
        self.dtype = np.dtype(metadata["dtype"])
        self.seq_len: int = metadata["seq_len"] or 0
        self.shard_tokens: int = metadata["options"]["shard_tokens"]
        self.tokens: int = metadata["tokens"]  # document tokens up to the last closed shard
        self.last_position: Position | None = None
        self.masked = is_masked(metadata)
        # documents the tokenizer refused after the reader counted them good (a conversation its chat template
        # raises on), per source: moved from its documents to its bad records where a source read to its end is
        # written (positions handed to `add` are corrected by the caller)
        self.refused: dict[int, int] = {}

    def add(
        self, ids: np.ndarray, offsets: np.ndarray, positions: Sequence[Position], mask: np.ndarray | None = None
    ) -> None:
        """Take the next documents: int32 ids end to end, int64 offsets, the position after each (and, for an
        output with loss masks, the uint8 mask of the ids)."""
        raise NotImplementedError

    def finish(self) -> None:
        """Write what is left as the last shard and mark the output complete."""
        raise NotImplementedError

    def _write(
        self,
        ids: np.ndarray | list[np.ndarray],
        offsets: np.ndarray,
        seg: np.ndarray | None,
        record: dict[str, Any],
        doc_tokens: int,
        mask: np.ndarray | None = None,
    ) -> None:
        name = shard_name(len(self.metadata["shards"]))
        if self.masked and mask is None:
            raise RuntimeError("a shard of an output with loss masks without its mask")
        written = write_shard(
            self.out.path / name,
            ids,
            offsets,
            seg,
            dtype=self.dtype,
            seq_len=self.seq_len,
            opener=self.out.writing,
            mask=mask if self.masked else None,
        )
        self.out.commit(written)
        size = ids.size if isinstance(ids, np.ndarray) else sum(part.size for part in ids)
        self.metadata["shards"].append({"name": name, "tokens": int(size), **record})
        self.tokens = doc_tokens

    def _snapshot(self, position: Position | None, leftover: Leftover | None) -> None:
        """metadata.json as of `position` (None: every source read to its end)."""
        sources = []
        for index, source in enumerate(self.sources):
            if position is None or index < position.source:
                described = source.as_dict()
                refused = self.refused.get(index, 0)
                described["documents"] -= refused
                described["bad_records"] += refused
                sources.append(described)
            elif index == position.source:
                sources.append(source_at(source, position).as_dict())
            else:  # not reached yet at `position`, whatever the reader has done since
                sources.append(Source(source.path, source.size, source.format, source.compressed).as_dict())
        meta = self.metadata
        meta["complete"] = position is None
        meta["sources"] = sources
        meta["documents"] = sum(source["documents"] for source in sources)
        meta["bad_records"] = sum(source["bad_records"] for source in sources)
        meta["tokens"] = self.tokens
        if self.seq_len:
            meta["rows"] = sum(shard["rows"] for shard in meta["shards"])
        if leftover is not None:
            meta["leftover"] = {"ids": leftover[0].tolist(), "document_starts": leftover[1].tolist()}
            if self.masked:
                meta["leftover"]["loss_mask"] = (leftover[2] if leftover[2] is not None else []).tolist()
        self.out.write_metadata(meta)

    def _close(
        self,
        ids: np.ndarray | list[np.ndarray],
        offsets: np.ndarray,
        seg: np.ndarray | None,
        record: dict[str, Any],
        doc_tokens: int,
        position: Position,
        leftover: Leftover | None = None,
        mask: np.ndarray | None = None,
    ) -> None:
        self._write(ids, offsets, seg, record, doc_tokens, mask)
        self._snapshot(position, leftover)


class _DocumentGroups(ShardSink):
    """Documents in groups that close once they hold `shard_tokens` tokens (ragged shards, best-fit windows)."""

    def __init__(self, out: OutputDir, metadata: dict[str, Any], sources: list[Source]) -> None:
        super().__init__(out, metadata, sources)
        self._parts: list[np.ndarray] = []
        self._lengths: list[np.ndarray] = []
        self._masks: list[np.ndarray] = []
        self._group_tokens = 0

    def add(
        self, ids: np.ndarray, offsets: np.ndarray, positions: Sequence[Position], mask: np.ndarray | None = None
    ) -> None:
        lengths = np.diff(offsets)
        ends = np.cumsum(lengths)
        first = 0
        base = 0  # ids of this batch already given to closed groups
        while first < len(lengths):
            room = self.shard_tokens - self._group_tokens
            last = int(np.searchsorted(ends, base + room, side="left"))
            if last >= len(lengths):
                break
            piece_mask = None if mask is None else mask[base : ends[last]]
            self._take(ids[base : ends[last]], lengths[first : last + 1], piece_mask)
            self._close_group(positions[last])
            first, base = last + 1, int(ends[last])
        if first < len(lengths):
            self._take(ids[base:], lengths[first:], None if mask is None else mask[base:])
        self.last_position = positions[-1] if len(positions) else self.last_position

    def finish(self) -> None:
        if self._lengths and self.last_position is not None:
            self._close_group(self.last_position)
        self._snapshot(None, None)

    def _take(self, ids: np.ndarray, lengths: np.ndarray, mask: np.ndarray | None) -> None:
        self._parts.append(self._keep(ids))
        self._lengths.append(lengths)
        if mask is not None:
            self._masks.append(mask.astype(MASK_DTYPE))
        self._group_tokens += int(lengths.sum())

    def _keep(self, ids: np.ndarray) -> np.ndarray:
        return ids

    def _close_group(self, position: Position) -> None:
        parts = self._parts
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int64)
        mask = (np.concatenate(self._masks) if self._masks else np.zeros(0, MASK_DTYPE)) if self.masked else None
        self._parts, self._lengths, self._masks, self._group_tokens = [], [], [], 0
        self._close_shard(parts, lengths, position, mask)

    def _close_shard(
        self, parts: list[np.ndarray], lengths: np.ndarray, position: Position, mask: np.ndarray | None
    ) -> None:
        """Close a shard of the group's documents: their ids end to end in `parts`, and their `lengths`."""
        raise NotImplementedError


class RaggedShards(_DocumentGroups):
    """Documents as they are: ids end to end plus offsets; a shard closes after `shard_tokens` ids."""

    def _keep(self, ids: np.ndarray) -> np.ndarray:
        # Kept as a view (int32 ids are the same bytes as uint32: every id is below 2**31) where they are most of
        # an array of their own, as a chunk's ids from the pool are; else copied, so that a larger buffer they lie
        # in (an answer of the service) is freed
        base = ids
        while isinstance(base.base, np.ndarray):
            base = base.base
        if (
            base.flags.owndata
            and 2 * ids.nbytes >= base.nbytes
            and ids.dtype.kind in "iu"
            and ids.dtype.itemsize == self.dtype.itemsize
        ):
            return ids.view(self.dtype)
        return ids.astype(self.dtype)

    def _close_shard(
        self, parts: list[np.ndarray], lengths: np.ndarray, position: Position, mask: np.ndarray | None
    ) -> None:
        record = {"documents": len(lengths)}
        tokens = sum(part.size for part in parts)
        self._close(parts, ragged_offsets(lengths), None, record, self.tokens + tokens, position, mask=mask)


class BestFitShards(_DocumentGroups):
    """Each shard is pack_best_fit over the documents of one `shard_tokens` window, as /v1/pack packs a request."""

    def __init__(self, out: OutputDir, metadata: dict[str, Any], sources: list[Source], pad_id: int) -> None:
        super().__init__(out, metadata, sources)
        self.pad_id = pad_id

    def _close_shard(
        self, parts: list[np.ndarray], lengths: np.ndarray, position: Position, mask: np.ndarray | None
    ) -> None:
        ids = np.concatenate(parts) if parts else np.zeros(0, self.dtype)
        packed = pack_best_fit(ids, ragged_offsets(lengths), self.seq_len, pad_id=self.pad_id, loss_mask=mask)
        row_mask = None if mask is None else (packed.labels.reshape(-1) != IGNORE_INDEX).astype(MASK_DTYPE)
        record = {
            "documents": len(lengths),
            "rows": packed.num_rows,
            "padding": packed.stats.padding_tokens,
        }
        self._close(
            packed.input_ids.reshape(-1),
            packed.cu_seqlens_offsets,
            packed.cu_seqlens,
            record,
            self.tokens + ids.size,
            position,
            mask=row_mask,
        )


class ConcatShards(ShardSink):
    """One stream of all documents cut every `seq_len` ids (pack_concat); `shard_tokens // seq_len` rows a shard.

    The ids after the last full row are the carry; document starts inside it are kept beside it, so
    segments come out as pack_concat over the whole stream at once would cut them.
    """

    def __init__(self, out: OutputDir, metadata: dict[str, Any], sources: list[Source], position: Position | None):
        super().__init__(out, metadata, sources)
        self.rows_per_shard = max(1, self.shard_tokens // self.seq_len)
        leftover = metadata.get("leftover") or {"ids": [], "document_starts": []}
        self.carry = np.asarray(leftover["ids"], np.int32)
        self.carry_starts = np.asarray(leftover["document_starts"], np.int64)
        self.carry_mask = np.asarray(leftover.get("loss_mask", []), MASK_DTYPE) if self.masked else None
        self.rows_done = int(metadata.get("rows") or 0)
        self.last_position = position
        self._reset()

    def _reset(self) -> None:
        self._rows: list[np.ndarray] = []
        self._row_masks: list[np.ndarray] = []
        self._seg: list[np.ndarray] = []
        self._seg_counts: list[np.ndarray] = []
        self._shard_rows = 0
        self._shard_documents = 0

    def add(
        self, ids: np.ndarray, offsets: np.ndarray, positions: Sequence[Position], mask: np.ndarray | None = None
    ) -> None:
        carried = self.carry.size
        stream = np.concatenate([self.carry, ids]) if carried else ids
        stream_mask = None
        if self.carry_mask is not None:
            own = mask.astype(MASK_DTYPE) if mask is not None else np.zeros(ids.size, MASK_DTYPE)
            stream_mask = np.concatenate([self.carry_mask, own])
        lengths = np.diff(offsets)
        starts = np.concatenate([self.carry_starts, offsets[:-1][lengths > 0] + carried])
        # Where each document ends in the stream; the carry's end comes first, standing for the
        # document the carry came from (a resumed run's carry can hold more than a row).
        ends = np.concatenate([[carried], offsets[1:] + carried])
        after: list[Position | None] = [self.last_position, *positions]
        consumed, taken = 0, 0  # ids cut into rows; documents (of `ends`) given to closed shards
        while True:
            boundary = consumed + (self.rows_per_shard - self._shard_rows) * self.seq_len
            last = int(np.searchsorted(ends, boundary, side="left"))
            if last >= len(ends):
                break
            self._cut(stream, starts, consumed, boundary, stream_mask)
            self._shard_documents += max(last, taken) - taken
            taken = max(last, taken)
            position = after[last]
            carry = stream[boundary : ends[last]]
            carry_starts = starts[(starts > boundary) & (starts < ends[last])] - boundary
            carry_mask = None if stream_mask is None else stream_mask[boundary : ends[last]]
            self._close_rows(position, (carry, carry_starts, carry_mask))
            consumed = boundary
        full = (stream.size - consumed) // self.seq_len * self.seq_len
        self._cut(stream, starts, consumed, consumed + full, stream_mask)
        consumed += full
        self._shard_documents += len(positions) - taken
        self.carry = stream[consumed:].copy()
        self.carry_starts = starts[starts > consumed] - consumed
        if stream_mask is not None:
            self.carry_mask = stream_mask[consumed:].copy()
        if positions:
            self.last_position = positions[-1]

    def finish(self) -> None:
        self.add(np.zeros(0, np.int32), np.zeros(1, np.int64), [])  # a resumed carry may still hold whole rows
        if self._shard_rows and self.last_position is not None:
            self._close_rows(self.last_position, (self.carry, self.carry_starts, self.carry_mask))
        else:
            self.tokens = self.rows_done * self.seq_len + self.carry.size
        self._snapshot(None, (self.carry, self.carry_starts, self.carry_mask))

    def _cut(
        self, stream: np.ndarray, starts: np.ndarray, begin: int, end: int, stream_mask: np.ndarray | None = None
    ) -> None:
        """Pack ids begin..end of the stream (whole rows) into the open shard."""
        if end <= begin:
            return
        inside = starts[(starts > begin) & (starts < end)] - begin
        offsets = np.concatenate([[0], inside, [end - begin]])
        packed = pack_concat(stream[begin:end], offsets, self.seq_len)
        self._rows.append(packed.input_ids.reshape(-1).astype(self.dtype))
        if stream_mask is not None:  # concat rows are the stream cut: their mask is the stream's, cut the same way
            self._row_masks.append(stream_mask[begin:end])
        self._seg.append(packed.cu_seqlens)
        self._seg_counts.append(np.diff(packed.cu_seqlens_offsets))
        self._shard_rows += packed.num_rows

    def _close_rows(self, position: Position | None, leftover: Leftover) -> None:
        ids = np.concatenate(self._rows)
        mask = np.concatenate(self._row_masks) if self.masked else None
        seg = np.concatenate(self._seg)
        offsets = ragged_offsets(np.concatenate(self._seg_counts))
        record = {"documents": self._shard_documents, "rows": self._shard_rows, "padding": 0}
        self.rows_done += self._shard_rows
        doc_tokens = self.rows_done * self.seq_len + leftover[0].size
        self._reset()
        if position is None:  # nothing read at all in this run, yet rows to close: cannot happen
            raise RuntimeError("a shard closed before any document was read")
        self._close(ids, offsets, seg, record, doc_tokens, position, leftover, mask)
