"""Pack tokenized documents into fixed-length rows for pre-training.

A ragged batch is a flat ``ids`` array plus ``offsets`` (document ``i`` is
``ids[offsets[i]:offsets[i + 1]]``). Two strategies:

* :func:`pack_concat` cuts one continuous stream every ``seq_len`` tokens (no
  padding; documents span rows; the tail comes back as ``leftover`` so a
  stateless server loses no token across requests).
* :func:`pack_best_fit` places whole documents (pieces of at most ``seq_len``)
  best-fit decreasing and pads, so short documents are never truncated.

Both return per-row ``position_ids`` and FlashAttention-style ``cu_seqlens`` so
attention can stay inside each segment (a document, or the piece of one, that
lies in one row).
"""

from __future__ import annotations

import operator
from bisect import bisect_left, insort
from dataclasses import asdict, dataclass, fields
from heapq import heappop, heappush
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

__all__ = [
    "IGNORE_INDEX",
    "PackStats",
    "PackedRows",
    "Pieces",
    "first_fit_rows",
    "pack_best_fit",
    "pack_concat",
    "split_pieces",
]

IGNORE_INDEX = -100
"""Label value that PyTorch's cross-entropy skips."""

_INT32 = np.iinfo(np.int32)


@dataclass(frozen=True)
class PackStats:
    """How well a batch packed; cheap to log or return to a client."""

    rows: int
    tokens: int
    padding_tokens: int
    padding_fraction: float
    documents: int
    documents_split: int

    def as_dict(self) -> dict[str, int | float]:
        return asdict(self)


@dataclass(frozen=True, eq=False)
class PackedRows:
    """Rows of ``seq_len`` tokens with the tensors a varlen attention kernel needs.

    ``eq=False`` because element-wise ``==`` on arrays has no single truth value.
    """

    input_ids: np.ndarray
    labels: np.ndarray
    position_ids: np.ndarray
    cu_seqlens: np.ndarray
    cu_seqlens_offsets: np.ndarray
    leftover: np.ndarray
    leftover_document_starts: np.ndarray
    stats: PackStats
    # with a loss mask (conversations): the mask of the leftover, to send back as carry_loss_mask
    leftover_loss_mask: np.ndarray | None = None

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])

    def arrays(self) -> dict[str, np.ndarray]:
        """The arrays by name, in field order (what a binary /v1/pack answer carries; ``stats`` aside)."""
        return {name: getattr(self, name) for name in _ARRAYS if getattr(self, name) is not None}

    def row_cu_seqlens(self, row: int) -> np.ndarray:
        """``[0, end of segment 1, ..., end of last segment]`` of one row."""
        row = range(self.num_rows)[row]
        start, stop = self.cu_seqlens_offsets[row], self.cu_seqlens_offsets[row + 1]
        return self.cu_seqlens[start:stop]


_ARRAYS = tuple(field.name for field in fields(PackedRows) if field.name != "stats")


class Pieces(NamedTuple):
    """Pieces of at most ``seq_len`` tokens, in document order."""

    doc: np.ndarray
    start: np.ndarray
    length: np.ndarray


def pack_concat(
    ids: npt.ArrayLike,
    offsets: npt.ArrayLike,
    seq_len: int,
    *,
    carry: npt.ArrayLike | None = None,
    carry_document_starts: npt.ArrayLike | None = None,
    eos_id: int | None = None,
    mask_document_start: bool = False,
    loss_mask: npt.ArrayLike | None = None,
    carry_loss_mask: npt.ArrayLike | None = None,
) -> PackedRows:
    """Cut ``carry + documents`` into rows of exactly ``seq_len`` tokens.

    With ``loss_mask`` (one 0/1 per id: conversations' assistant-only loss), ``labels`` are ``IGNORE_INDEX``
    wherever the mask is 0, and ``leftover_loss_mask`` carries the leftover's mask, for the next call's
    ``carry_loss_mask`` (a carry without one is all trained), so no token's mask is lost between calls.

    Nothing is padded or dropped: what does not fill a last row is returned as
    ``leftover``, with ``leftover_document_starts`` (where documents begin in
    it), for the caller to send back as ``carry`` and ``carry_document_starts``:
    then any sequence of calls gives the rows one call over the whole stream
    gives. Without ``carry_document_starts`` the starts inside the carry are
    guessed: after each ``eos_id`` in it, never at its first token. Segments
    start at each row start and at each document start; ``position_ids``
    restart there.
    """
    seq_len = _check_seq_len(seq_len)
    ids, offsets = _check_ragged(ids, offsets)
    carry_ids = np.empty(0, np.int32) if carry is None else _check_tokens(carry, "carry")
    eos = None if eos_id is None else _check_int(eos_id, "eos_id")
    if carry_document_starts is not None:
        carry_starts = _check_starts(carry_document_starts, carry_ids.size)
    elif eos is not None:
        carry_starts = np.flatnonzero(carry_ids[:-1] == eos) + 1
    else:
        carry_starts = np.empty(0, np.int64)

    stream = np.concatenate([carry_ids, ids])
    rows = stream.size // seq_len
    used = rows * seq_len
    stream_mask = None
    if loss_mask is not None or carry_loss_mask is not None:
        own = _check_mask(loss_mask, ids.size, "loss_mask")
        carried = _check_mask(carry_loss_mask, carry_ids.size, "carry_loss_mask")
        stream_mask = np.concatenate([carried, own])

    lengths = np.diff(offsets)
    all_starts = np.concatenate([carry_starts, offsets[:-1][lengths > 0] + carry_ids.size])
    doc_starts = all_starts[all_starts < used]
    seg_starts = np.union1d(np.arange(rows, dtype=np.int64) * seq_len, doc_starts)

    seg_lengths = np.diff(np.append(seg_starts, used))
    # each token's place less its segment's start; in int32 where every place fits (a third of int64's time)
    places = np.int32 if used < 2**31 else np.int64
    positions = np.arange(used, dtype=places) - np.repeat(seg_starts.astype(places), seg_lengths)

    input_ids = stream[:used].reshape(rows, seq_len)
    labels = input_ids.copy()
    if stream_mask is not None:
        labels.reshape(-1)[stream_mask[:used] == 0] = IGNORE_INDEX
    if mask_document_start:
        labels.reshape(-1)[doc_starts] = IGNORE_INDEX

    seg_rows = seg_starts // seq_len
    cu_seqlens, cu_offsets = _cu_seqlens(seg_rows, seg_starts - seg_rows * seq_len, np.full(rows, seq_len, np.int64))

    doc_begin = offsets[:-1] + carry_ids.size
    nonempty = lengths > 0
    split = doc_begin[nonempty] // seq_len != (doc_begin[nonempty] + lengths[nonempty] - 1) // seq_len

    return PackedRows(
        input_ids=input_ids,
        labels=labels,
        position_ids=positions.astype(np.int32, copy=False).reshape(rows, seq_len),
        cu_seqlens=cu_seqlens,
        cu_seqlens_offsets=cu_offsets,
        leftover=stream[used:].copy(),
        leftover_document_starts=(all_starts[all_starts >= used] - used).astype(np.int32),
        stats=_stats(rows, seq_len, used, lengths.size, int(split.sum())),
        leftover_loss_mask=None if stream_mask is None else stream_mask[used:].copy(),
    )


def _check_mask(mask: npt.ArrayLike | None, size: int, name: str) -> np.ndarray:
    """A loss mask as uint8 0/1, one per id (none: every id trained)."""
    if mask is None:
        return np.ones(size, np.uint8)
    array = np.asarray(mask)
    if array.ndim != 1 or array.size != size:
        raise ValueError(f"{name} must be 1-D with one value per id ({size}), got shape {array.shape}")
    if array.size and (array.min() < 0 or array.max() > 1):
        raise ValueError(f"{name} must hold only 0 and 1")
    return array.astype(np.uint8, copy=False)


def pack_best_fit(
    ids: npt.ArrayLike,
    offsets: npt.ArrayLike,
    seq_len: int,
    *,
    pad_id: int,
    mask_document_start: bool = False,
    loss_mask: npt.ArrayLike | None = None,
) -> PackedRows:
    """Best-fit decreasing packing with padding (Ding et al. 2024).

    Documents longer than ``seq_len`` are cut into consecutive pieces of
    ``seq_len`` (remainder last); shorter ones are never split. Pieces go
    longest first (stable) into the open row with the least room that fits,
    else into a new row. Best-fit decreasing is not better than plain
    first-fit on every instance, so when it needs more rows than first-fit over
    the pieces in document order, the first-fit packing is returned instead
    (first-fit is only simulated when best-fit misses a lower bound on rows).
    Segments within a row appear in placement order; rows in creation order.
    """
    seq_len = _check_seq_len(seq_len)
    ids, offsets = _check_ragged(ids, offsets)
    pad = _check_int(pad_id, "pad_id")

    lengths = np.diff(offsets)
    pieces = split_pieces(lengths, seq_len)
    rows, piece_row, piece_col = _best_fit_decreasing(pieces.length, seq_len)
    if rows > _min_rows(pieces.length, seq_len):
        ff_rows, ff_row, ff_col = _first_fit(pieces.length, seq_len)
        if ff_rows < rows:
            rows, piece_row, piece_col = ff_rows, ff_row, ff_col

    total = ids.size
    dst_start = piece_row * seq_len + piece_col
    within = np.arange(total, dtype=np.int64) - np.repeat(offsets[pieces.doc] + pieces.start, pieces.length)
    dst = within + np.repeat(dst_start, pieces.length)

    input_ids = np.full(rows * seq_len, pad, np.int32)
    input_ids[dst] = ids
    labels = np.full(rows * seq_len, IGNORE_INDEX, np.int32)
    if loss_mask is None:
        labels[dst] = ids
    else:
        labels[dst] = np.where(_check_mask(loss_mask, ids.size, "loss_mask") == 1, ids, IGNORE_INDEX)
    if mask_document_start:
        labels[dst_start[pieces.start == 0]] = IGNORE_INDEX
    positions = np.zeros(rows * seq_len, np.int32)
    positions[dst] = within

    used = np.bincount(piece_row, weights=pieces.length, minlength=rows).astype(np.int64)
    order = np.lexsort((piece_col, piece_row))
    cu_seqlens, cu_offsets = _cu_seqlens(piece_row[order], piece_col[order], used)

    return PackedRows(
        input_ids=input_ids.reshape(rows, seq_len),
        labels=labels.reshape(rows, seq_len),
        position_ids=positions.reshape(rows, seq_len),
        cu_seqlens=cu_seqlens,
        cu_seqlens_offsets=cu_offsets,
        leftover=np.empty(0, np.int32),
        leftover_document_starts=np.empty(0, np.int32),
        stats=_stats(rows, seq_len, total, lengths.size, int((lengths > seq_len).sum())),
    )


def split_pieces(lengths: npt.ArrayLike, seq_len: int) -> Pieces:
    """Cut each document into consecutive pieces of ``seq_len``, remainder last.

    Zero-length documents give no piece.
    """
    seq_len = _check_seq_len(seq_len)
    lengths = _check_lengths(lengths)
    counts = -(-lengths // seq_len)
    doc = np.repeat(np.arange(lengths.size, dtype=np.int64), counts)
    index = np.arange(doc.size, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    start = index * seq_len
    return Pieces(doc=doc, start=start, length=np.minimum(seq_len, lengths[doc] - start))


def first_fit_rows(lengths: npt.ArrayLike, seq_len: int) -> int:
    """Rows plain first-fit needs: each piece, in order, into the first row with room."""
    seq_len = _check_seq_len(seq_len)
    lengths = _check_lengths(lengths)
    if (lengths > seq_len).any():
        raise ValueError(f"a piece is longer than seq_len={seq_len}; split documents first")
    return _first_fit(lengths, seq_len)[0]


def _best_fit_decreasing(lengths: np.ndarray, seq_len: int) -> tuple[int, np.ndarray, np.ndarray]:
    """Row and column of each piece; ties on room go to the oldest row."""
    order = np.argsort(-lengths, kind="stable")
    piece_row = np.empty(lengths.size, np.int64)
    piece_col = np.empty(lengths.size, np.int64)
    rooms: list[int] = []
    rows_by_room: dict[int, list[int]] = {}
    rows = 0
    for piece, size in zip(order.tolist(), lengths[order].tolist(), strict=True):
        if size == 0:
            continue
        i = bisect_left(rooms, size)
        if i == len(rooms):
            row, room = rows, seq_len
            rows += 1
        else:
            room = rooms[i]
            waiting = rows_by_room[room]
            row = heappop(waiting)
            if not waiting:
                del rooms[i]
                del rows_by_room[room]
        piece_row[piece] = row
        piece_col[piece] = seq_len - room
        left = room - size
        if left in rows_by_room:
            heappush(rows_by_room[left], row)
        elif left:
            insort(rooms, left)
            rows_by_room[left] = [row]
    return rows, piece_row, piece_col


def _first_fit(lengths: np.ndarray, seq_len: int) -> tuple[int, np.ndarray, np.ndarray]:
    """First-fit via a max-tree of room over rows (unopened rows have full room)."""
    piece_row = np.empty(lengths.size, np.int64)
    piece_col = np.empty(lengths.size, np.int64)
    leaves = 1 << max(0, (lengths.size - 1).bit_length())
    room = [seq_len] * (2 * leaves)
    rows = 0
    for piece, size in enumerate(lengths.tolist()):
        if size == 0:
            continue
        node = 1
        while node < leaves:
            node <<= 1
            if room[node] < size:
                node += 1
        row = node - leaves
        piece_row[piece] = row
        piece_col[piece] = seq_len - room[node]
        rows = max(rows, row + 1)
        room[node] -= size
        node >>= 1
        while node:
            best = max(room[2 * node], room[2 * node + 1])
            if room[node] == best:
                break
            room[node] = best
            node >>= 1
    return rows, piece_row, piece_col


def _min_rows(lengths: np.ndarray, seq_len: int) -> int:
    """Martello-Toth L2 lower bound on rows; no packing can use fewer."""
    sizes = np.sort(lengths[lengths > 0])
    if sizes.size == 0:
        return 0
    prefix = np.concatenate([[0], np.cumsum(sizes)])
    alphas = np.unique(np.concatenate([[0], sizes[2 * sizes <= seq_len]]))
    half = np.searchsorted(sizes, seq_len // 2, side="right")
    big_from = np.searchsorted(sizes, seq_len - alphas, side="right")
    small_from = np.searchsorted(sizes, alphas, side="left")
    mid_count = np.maximum(big_from - half, 0)
    mid_sum = prefix[np.maximum(big_from, half)] - prefix[half]
    small_sum = prefix[half] - prefix[np.minimum(small_from, half)]
    spare = mid_count * seq_len - mid_sum
    extra = np.maximum(0, -(-(small_sum - spare) // seq_len))
    bound = (sizes.size - half) + extra
    return int(max(bound.max(), -(-prefix[-1] // seq_len)))


def _cu_seqlens(seg_rows: np.ndarray, seg_cols: np.ndarray, row_used: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Flat per-row ``[segment starts..., used]`` from segments sorted by (row, col)."""
    rows = row_used.size
    per_row = np.bincount(seg_rows, minlength=rows) + 1
    offsets = np.zeros(rows + 1, np.int64)
    np.cumsum(per_row, out=offsets[1:])
    flat = np.empty(int(offsets[-1]), np.int32)
    flat[np.arange(seg_rows.size) + seg_rows] = seg_cols
    flat[offsets[1:] - 1] = row_used
    return flat, offsets


def _stats(rows: int, seq_len: int, tokens: int, documents: int, split: int) -> PackStats:
    padding = rows * seq_len - tokens
    return PackStats(
        rows=rows,
        tokens=tokens,
        padding_tokens=padding,
        padding_fraction=padding / (rows * seq_len) if rows else 0.0,
        documents=documents,
        documents_split=split,
    )


def _index(value: int, name: str) -> int:
    """`value` as a Python int: any integer but a bool; a ValueError naming `name` otherwise."""
    if isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


def _check_seq_len(seq_len: int) -> int:
    value = _index(seq_len, "seq_len")
    if value < 1:
        raise ValueError(f"seq_len must be at least 1, got {value}")
    return value


def _check_int(value: int, name: str) -> int:
    value = _index(value, name)
    if not _INT32.min <= value <= _INT32.max:
        raise ValueError(f"{name}={value} does not fit in int32")
    return value


def _integer_array(values: npt.ArrayLike, name: str) -> np.ndarray:
    array = np.asarray(values)
    if array.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {array.shape}")
    if array.size == 0:
        return array.astype(np.int64)
    if array.dtype == np.bool_ or not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"{name} must hold integers, got dtype {array.dtype}")
    return array


def _check_tokens(values: npt.ArrayLike, name: str) -> np.ndarray:
    array = _integer_array(values, name)
    if array.dtype != np.int32 and array.size:
        low, high = array.min(), array.max()
        if low < _INT32.min or high > _INT32.max:
            raise ValueError(f"{name} holds values outside int32: [{low}, {high}]")
    return array.astype(np.int32, copy=False)


def _check_ragged(ids: npt.ArrayLike, offsets: npt.ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    tokens = _check_tokens(ids, "ids")
    bounds = _integer_array(offsets, "offsets").astype(np.int64, copy=False)
    if bounds.size == 0:
        raise ValueError("offsets must have len(documents) + 1 entries, starting at 0; got none")
    if bounds[0] != 0:
        raise ValueError(f"offsets must start at 0, got {bounds[0]}")
    if bounds[-1] != tokens.size:
        raise ValueError(f"offsets must end at len(ids)={tokens.size}, got {bounds[-1]}")
    if (np.diff(bounds) < 0).any():
        raise ValueError("offsets must be non-decreasing")
    return tokens, bounds


def _check_starts(values: npt.ArrayLike, size: int) -> np.ndarray:
    starts = _integer_array(values, "carry_document_starts").astype(np.int64, copy=False)
    if starts.size and (starts[0] < 0 or starts[-1] >= size or (np.diff(starts) <= 0).any()):
        raise ValueError(f"carry_document_starts must be increasing positions in the carry [0, {size})")
    return starts


def _check_lengths(lengths: npt.ArrayLike) -> np.ndarray:
    array = _integer_array(lengths, "lengths").astype(np.int64, copy=False)
    if (array < 0).any():
        raise ValueError("lengths must be non-negative")
    return array
