"""Properties of tokenizer_client.packing, checked against references written independently here."""

from __future__ import annotations

from collections.abc import Callable
from itertools import pairwise

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tokenizer_client.packing import (
    IGNORE_INDEX,
    PackedRows,
    first_fit_rows,
    pack_best_fit,
    pack_concat,
    split_pieces,
)

EOS = 0
PROPERTY = settings(max_examples=200, deadline=None)


def ragged(docs: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    ids = np.array([t for doc in docs for t in doc], dtype=np.int32)
    offsets = np.zeros(len(docs) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(doc) for doc in docs])
    return ids, offsets


def doc_starts(docs: list[list[int]]) -> list[int]:
    """Stream positions of every non-empty document's first token."""
    starts, position = [], 0
    for doc in docs:
        if doc:
            starts.append(position)
        position += len(doc)
    return starts


def reference_pieces(lengths: list[int], seq_len: int) -> list[tuple[int, int, int]]:
    """(doc, start within doc, length) in document order."""
    return [(doc, start, min(seq_len, n - start)) for doc, n in enumerate(lengths) for start in range(0, n, seq_len)]


def reference_first_fit(sizes: list[int], seq_len: int) -> list[list[int]]:
    rows: list[list[int]] = []
    rooms: list[int] = []
    for piece, size in enumerate(sizes):
        for row, room in enumerate(rooms):
            if room >= size:
                rows[row].append(piece)
                rooms[row] -= size
                break
        else:
            rows.append([piece])
            rooms.append(seq_len - size)
    return rows


def reference_best_fit_decreasing(sizes: list[int], seq_len: int) -> list[list[int]]:
    rows: list[list[int]] = []
    rooms: list[int] = []
    for piece in sorted(range(len(sizes)), key=lambda p: -sizes[p]):
        fitting = [row for row, room in enumerate(rooms) if room >= sizes[piece]]
        if fitting:
            row = min(fitting, key=lambda r: rooms[r])
            rows[row].append(piece)
            rooms[row] -= sizes[piece]
        else:
            rows.append([piece])
            rooms.append(seq_len - sizes[piece])
    return rows


def segments(packed: PackedRows, row: int) -> list[tuple[int, int]]:
    cu = packed.row_cu_seqlens(row).tolist()
    return list(pairwise(cu))


def check_row_structure(packed: PackedRows, seq_len: int) -> None:
    """cu_seqlens, position_ids and padding labels agree with each other in every row."""
    n = packed.num_rows
    for array in (packed.input_ids, packed.labels, packed.position_ids):
        assert array.shape == (n, seq_len)
        assert array.dtype == np.int32
    assert packed.cu_seqlens.dtype == np.int32
    assert packed.cu_seqlens_offsets.dtype == np.int64
    assert packed.cu_seqlens_offsets.shape == (n + 1,)
    assert packed.cu_seqlens_offsets[0] == 0
    assert packed.cu_seqlens_offsets[-1] == packed.cu_seqlens.size
    real_total = 0
    for row in range(n):
        cu = packed.row_cu_seqlens(row)
        assert cu[0] == 0 and cu.size >= 2
        assert (np.diff(cu) > 0).all()
        real = int(cu[-1])
        assert real <= seq_len
        real_total += real
        expected_positions = np.zeros(seq_len, dtype=np.int32)
        for start, end in segments(packed, row):
            expected_positions[start:end] = np.arange(end - start)
        np.testing.assert_array_equal(packed.position_ids[row], expected_positions)
        assert (packed.labels[row, real:] == IGNORE_INDEX).all()
    stats = packed.stats
    assert stats.rows == n
    assert stats.tokens == real_total
    assert stats.padding_tokens == n * seq_len - real_total
    assert stats.padding_fraction == (stats.padding_tokens / (n * seq_len) if n else 0.0)


def check_labels(packed: PackedRows, masked: set[tuple[int, int]], mask: bool) -> None:
    """labels equal input_ids on real tokens except at `masked` (row, col) when masking."""
    for row in range(packed.num_rows):
        real = int(packed.row_cu_seqlens(row)[-1])
        expected = packed.input_ids[row].copy()
        expected[real:] = IGNORE_INDEX
        if mask:
            for r, col in masked:
                if r == row:
                    expected[col] = IGNORE_INDEX
        np.testing.assert_array_equal(packed.labels[row], expected)


@st.composite
def eos_documents(draw: st.DrawFn) -> list[list[int]]:
    """Documents ending in EOS; some empty (a document with no tokens at all)."""
    bodies = draw(st.lists(st.lists(st.integers(1, 30), max_size=20), max_size=12))
    empty = draw(st.lists(st.booleans(), min_size=len(bodies), max_size=len(bodies)))
    return [[] if e and not body else [*body, EOS] for body, e in zip(bodies, empty, strict=True)]


@st.composite
def requests(draw: st.DrawFn) -> list[list[list[int]]]:
    docs = draw(eos_documents())
    cuts = sorted(draw(st.lists(st.integers(0, len(docs)), max_size=4)))
    bounds = [0, *cuts, len(docs)]
    return [docs[a:b] for a, b in pairwise(bounds)]


# The review's case: the first call's row ends exactly where a document begins, so the leftover
# starts with that document, whose first label must still be masked in the second call.
BOUNDARY_CALLS = [[[5, 6, 7, EOS], [8, 9, EOS]], [[10, 11, 12, 13, 14, EOS]]]


@PROPERTY
@given(calls=requests(), seq_len=st.integers(1, 16), mask=st.booleans(), use_eos=st.booleans())
@example(calls=BOUNDARY_CALLS, seq_len=4, mask=True, use_eos=True)
@example(calls=BOUNDARY_CALLS, seq_len=4, mask=True, use_eos=False)
def test_concat_threads_every_token_through_carry(
    calls: list[list[list[int]]], seq_len: int, mask: bool, use_eos: bool
) -> None:
    """Calls threading leftover and its document starts give exactly the rows of one call over everything,
    whether documents end in EOS or not. eos_id is passed as /v1/pack passes it: told starts win over it."""
    if not use_eos:  # documents with no EOS: nothing in a carry marks where one begins
        calls = [[[t for t in doc if t != EOS] for doc in docs] for docs in calls]
    eos_id = EOS if use_eos else None
    all_docs = [doc for call in calls for doc in call]
    whole = pack_concat(*ragged(all_docs), seq_len, eos_id=eos_id, mask_document_start=mask)
    starts = {s for s in doc_starts(all_docs) if s < whole.num_rows * seq_len}
    for row in range(whole.num_rows):  # the one-call packing against document starts found here
        expected = {0} | {s - row * seq_len for s in starts if s // seq_len == row}
        assert {start for start, _ in segments(whole, row)} == expected
    check_row_structure(whole, seq_len)
    check_labels(whole, {(s // seq_len, s % seq_len) for s in starts}, mask)

    done = 0
    carry = np.empty(0, dtype=np.int32)
    carry_starts = np.empty(0, dtype=np.int32)
    for docs in calls:
        ids, offsets = ragged(docs)
        stream_len = carry.size + ids.size
        packed = pack_concat(
            ids,
            offsets,
            seq_len,
            carry=carry,
            carry_document_starts=carry_starts,
            eos_id=eos_id,
            mask_document_start=mask,
        )
        rows = stream_len // seq_len
        assert packed.num_rows == rows
        check_row_structure(packed, seq_len)
        for row in range(rows):
            for name in ("input_ids", "labels", "position_ids"):
                np.testing.assert_array_equal(getattr(packed, name)[row], getattr(whole, name)[done + row], name)
            np.testing.assert_array_equal(packed.row_cu_seqlens(row), whole.row_cu_seqlens(done + row))

        position = carry.size
        split = 0
        for doc in docs:
            if doc and position // seq_len != (position + len(doc) - 1) // seq_len:
                split += 1
            position += len(doc)
        assert packed.stats.documents == len(docs)
        assert packed.stats.documents_split == split
        assert packed.stats.padding_tokens == 0
        assert packed.leftover.size == stream_len - rows * seq_len
        done += rows
        carry, carry_starts = packed.leftover, packed.leftover_document_starts
    assert done == whole.num_rows
    assert carry.tolist() == whole.leftover.tolist()
    assert carry_starts.tolist() == whole.leftover_document_starts.tolist()


def test_a_carry_that_begins_a_document_keeps_its_start() -> None:
    """The review's example: [8, 9, EOS] left over begins a document; told so, its first label is masked."""
    first = pack_concat(*ragged(BOUNDARY_CALLS[0]), 4, eos_id=EOS, mask_document_start=True)
    assert first.leftover.tolist() == [8, 9, EOS]
    assert first.leftover_document_starts.tolist() == [0]
    ids, offsets = ragged(BOUNDARY_CALLS[1])
    told = pack_concat(
        ids,
        offsets,
        4,
        carry=first.leftover,
        carry_document_starts=first.leftover_document_starts,
        eos_id=EOS,
        mask_document_start=True,
    )
    assert told.labels[0].tolist() == [IGNORE_INDEX, 9, EOS, IGNORE_INDEX]
    assert told.row_cu_seqlens(0).tolist() == [0, 3, 4]
    assert told.leftover_document_starts.tolist() == []
    guessed = pack_concat(ids, offsets, 4, carry=first.leftover, eos_id=EOS, mask_document_start=True)
    assert guessed.labels[0].tolist() == [8, 9, EOS, IGNORE_INDEX]  # the fallback's blind spot


def test_concat_without_carry_starts_guesses_them_from_eos() -> None:
    """The fallback for callers that keep only the leftover: a document starts after each EOS in the carry,
    never at its first token; without an EOS id the carry is one segment."""
    carry = np.array([7, EOS, 8, 9, EOS, 5], dtype=np.int32)
    ids, offsets = ragged([[6, EOS]])
    guessed = pack_concat(ids, offsets, 4, carry=carry, eos_id=EOS, mask_document_start=True)
    assert guessed.row_cu_seqlens(0).tolist() == [0, 2, 4]
    assert guessed.row_cu_seqlens(1).tolist() == [0, 1, 2, 4]
    assert guessed.labels[0].tolist() == [7, EOS, IGNORE_INDEX, 9]
    told = pack_concat(ids, offsets, 4, carry=carry, carry_document_starts=[0, 2, 5], mask_document_start=True)
    assert told.row_cu_seqlens(0).tolist() == [0, 2, 4]
    assert told.row_cu_seqlens(1).tolist() == [0, 1, 2, 4]
    assert told.labels[0].tolist() == [IGNORE_INDEX, EOS, IGNORE_INDEX, 9]
    blind = pack_concat(ids, offsets, 4, carry=carry)
    assert blind.row_cu_seqlens(0).tolist() == [0, 4]
    assert blind.row_cu_seqlens(1).tolist() == [0, 2, 4]
    for bad in ([2, 2], [3, 1], [6], [-1]):
        with pytest.raises(ValueError, match="carry_document_starts"):
            pack_concat(ids, offsets, 4, carry=carry, carry_document_starts=bad)


def distinct_docs(lengths: list[int]) -> list[list[int]]:
    tokens = iter(range(100, 100 + sum(lengths)))
    return [[next(tokens) for _ in range(n)] for n in lengths]


# Inputs where first-fit in document order needs one row fewer than best-fit decreasing;
# random generation almost never finds them.
FIRST_FIT_WINS = [
    (16, [5, 5, 6, 5, 4, 7]),
    (7, [2, 3, 6, 2, 6, 3, 6, 3, 2, 3, 2]),
    (15, [6, 5, 4, 18, 8, 4]),
    (10, [3, 2, 15, 13, 0, 4, 13]),
]


def with_first_fit_wins(test: Callable[..., None]) -> Callable[..., None]:
    for seq_len, lengths in FIRST_FIT_WINS:
        test = example(docs=distinct_docs(lengths), seq_len=seq_len, pad_id=0, mask=True)(test)
    return test


@st.composite
def unique_documents(draw: st.DrawFn) -> list[list[int]]:
    """Documents whose tokens are all distinct, so a segment's first token names its source."""
    lengths = draw(st.lists(st.integers(0, 40), max_size=14))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    tokens = iter(rng.permutation(10_000)[: sum(lengths)].tolist())
    return [[next(tokens) for _ in range(n)] for n in lengths]


@PROPERTY
@with_first_fit_wins
@given(
    docs=unique_documents(),
    seq_len=st.integers(1, 16),
    pad_id=st.integers(-5, 5),
    mask=st.booleans(),
)
def test_best_fit_places_every_piece_once(docs: list[list[int]], seq_len: int, pad_id: int, mask: bool) -> None:
    ids, offsets = ragged(docs)
    lengths = [len(doc) for doc in docs]
    packed = pack_best_fit(ids, offsets, seq_len, pad_id=pad_id, mask_document_start=mask)
    check_row_structure(packed, seq_len)
    assert packed.leftover.size == 0

    source = {int(t): i for i, t in enumerate(ids.tolist())}
    pieces = reference_pieces(lengths, seq_len)
    piece_at = {int(offsets[doc]) + start: (doc, start, n) for doc, start, n in pieces}
    placed: list[tuple[int, int, int]] = []
    first_tokens: set[tuple[int, int]] = set()
    layout: list[list[tuple[int, int, int]]] = []
    for row in range(packed.num_rows):
        real = int(packed.row_cu_seqlens(row)[-1])
        assert (packed.input_ids[row, real:] == pad_id).all()
        layout.append([])
        for start, end in segments(packed, row):
            src = source[int(packed.input_ids[row, start])]
            assert src in piece_at, "segment does not begin a piece"
            doc, piece_start, n = piece_at[src]
            assert end - start == n
            np.testing.assert_array_equal(packed.input_ids[row, start:end], ids[src : src + n])
            placed.append((doc, piece_start, n))
            layout[-1].append((doc, piece_start, n))
            if piece_start == 0:
                first_tokens.add((row, start))
    assert sorted(placed) == sorted(pieces)
    check_labels(packed, first_tokens, mask)

    sizes = [n for _, _, n in pieces]
    ff_rows = first_fit_rows(sizes, seq_len)
    assert ff_rows == len(reference_first_fit(sizes, seq_len))
    bfd = reference_best_fit_decreasing(sizes, seq_len)
    assert packed.num_rows <= ff_rows
    assert packed.num_rows == min(len(bfd), ff_rows)
    if len(bfd) <= ff_rows:
        assert layout == [[pieces[p] for p in row] for row in bfd]

    assert packed.stats.documents == len(docs)
    assert packed.stats.documents_split == sum(n > seq_len for n in lengths)
    assert packed.stats.tokens == ids.size


@PROPERTY
@given(lengths=st.lists(st.integers(0, 50), max_size=20), seq_len=st.integers(1, 16))
def test_split_pieces_matches_reference(lengths: list[int], seq_len: int) -> None:
    pieces = split_pieces(lengths, seq_len)
    got = list(zip(pieces.doc.tolist(), pieces.start.tolist(), pieces.length.tolist(), strict=True))
    assert got == reference_pieces(lengths, seq_len)


@PROPERTY
@given(data=st.data(), seq_len=st.integers(1, 20))
def test_first_fit_rows_matches_reference(data: st.DataObject, seq_len: int) -> None:
    sizes = data.draw(st.lists(st.integers(1, seq_len), max_size=40))
    assert first_fit_rows(sizes, seq_len) == len(reference_first_fit(sizes, seq_len))


def test_concat_small_example() -> None:
    ids, offsets = ragged([[1, 2, 3], [4, 5, 6, 7, 8], [9, 10]])
    packed = pack_concat(ids, offsets, 4, mask_document_start=True)
    assert packed.input_ids.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert packed.labels.tolist() == [[-100, 2, 3, -100], [5, 6, 7, 8]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0], [0, 1, 2, 3]]
    assert packed.row_cu_seqlens(0).tolist() == [0, 3, 4]
    assert packed.row_cu_seqlens(1).tolist() == [0, 4]
    assert packed.cu_seqlens.tolist() == [0, 3, 4, 0, 4]
    assert packed.cu_seqlens_offsets.tolist() == [0, 3, 5]
    assert packed.leftover.tolist() == [9, 10]
    assert packed.stats.as_dict() == {
        "rows": 2,
        "tokens": 8,
        "padding_tokens": 0,
        "padding_fraction": 0.0,
        "documents": 3,
        "documents_split": 1,
    }


def test_concat_carry_with_eos_starts_documents_inside_it() -> None:
    ids, offsets = ragged([[20, 21, 22]])
    packed = pack_concat(ids, offsets, 4, carry=[7, 8, EOS, 9], eos_id=EOS, mask_document_start=True)
    assert packed.input_ids.tolist() == [[7, 8, EOS, 9]]
    assert packed.labels.tolist() == [[7, 8, EOS, -100]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0]]
    assert packed.row_cu_seqlens(0).tolist() == [0, 3, 4]
    assert packed.leftover.tolist() == [20, 21, 22]
    assert packed.stats.documents_split == 0

    without_eos = pack_concat(ids, offsets, 4, carry=[7, 8, EOS, 9], mask_document_start=True)
    assert without_eos.labels.tolist() == [[7, 8, EOS, 9]]
    assert without_eos.row_cu_seqlens(0).tolist() == [0, 4]


def test_concat_empty_input_returns_carry() -> None:
    packed = pack_concat([], [0], 8, carry=[1, 2, 3])
    assert packed.num_rows == 0
    assert packed.input_ids.shape == (0, 8)
    assert packed.cu_seqlens.size == 0
    assert packed.cu_seqlens_offsets.tolist() == [0]
    assert packed.leftover.tolist() == [1, 2, 3]
    assert packed.stats.padding_fraction == 0.0


def test_concat_zero_length_documents_are_not_split() -> None:
    ids, offsets = ragged([[1, 2], [], [3, 4], []])
    packed = pack_concat(ids, offsets, 2, mask_document_start=True)
    assert packed.input_ids.tolist() == [[1, 2], [3, 4]]
    assert packed.labels.tolist() == [[-100, 2], [-100, 4]]
    assert packed.stats.documents == 4
    assert packed.stats.documents_split == 0


def test_best_fit_small_example() -> None:
    ids, offsets = ragged([[1, 2, 3], [4, 5, 6, 7, 8], [9, 10]])
    packed = pack_best_fit(ids, offsets, 4, pad_id=0, mask_document_start=True)
    assert packed.input_ids.tolist() == [[4, 5, 6, 7], [1, 2, 3, 8], [9, 10, 0, 0]]
    assert packed.labels.tolist() == [[-100, 5, 6, 7], [-100, 2, 3, 8], [-100, 10, -100, -100]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3], [0, 1, 2, 0], [0, 1, 0, 0]]
    assert [packed.row_cu_seqlens(r).tolist() for r in range(3)] == [[0, 4], [0, 3, 4], [0, 2]]
    assert packed.stats.padding_tokens == 2
    assert packed.stats.documents_split == 1


@pytest.mark.parametrize(("seq_len", "lengths"), FIRST_FIT_WINS)
def test_first_fit_wins_cases_need_the_fallback(seq_len: int, lengths: list[int]) -> None:
    sizes = [n for _, _, n in reference_pieces(lengths, seq_len)]
    ff_rows = len(reference_first_fit(sizes, seq_len))
    assert len(reference_best_fit_decreasing(sizes, seq_len)) == ff_rows + 1
    assert pack_best_fit(*ragged(distinct_docs(lengths)), seq_len, pad_id=0).num_rows == ff_rows


def test_best_fit_falls_back_to_first_fit_when_that_needs_fewer_rows() -> None:
    # BFD puts 7+6 together (room 3 left) and needs 3 rows; first-fit finds 5+5+6 and 5+4+7.
    lengths = [5, 5, 6, 5, 4, 7]
    assert len(reference_best_fit_decreasing(lengths, 16)) == 3
    assert first_fit_rows(lengths, 16) == 2
    docs = [[10 * d + i for i in range(n)] for d, n in enumerate(lengths)]
    packed = pack_best_fit(*ragged(docs), 16, pad_id=-1)
    assert packed.num_rows == 2
    assert packed.input_ids.tolist() == [docs[0] + docs[1] + docs[2], docs[3] + docs[4] + docs[5]]


def test_best_fit_empty_and_zero_length_documents() -> None:
    packed = pack_best_fit([], [0, 0, 0], 4, pad_id=0)
    assert packed.num_rows == 0
    assert packed.input_ids.shape == (0, 4)
    assert packed.cu_seqlens_offsets.tolist() == [0]
    assert packed.stats.documents == 2

    packed = pack_best_fit([1, 2], [0, 0, 2, 2], 4, pad_id=0)
    assert packed.input_ids.tolist() == [[1, 2, 0, 0]]
    assert packed.row_cu_seqlens(0).tolist() == [0, 2]


def test_row_cu_seqlens_out_of_range() -> None:
    packed = pack_concat([1, 2], [0, 2], 2)
    with pytest.raises(IndexError):
        packed.row_cu_seqlens(1)


@pytest.mark.parametrize("seq_len", [0, -3, 2.5, True, "4", None])
def test_bad_seq_len(seq_len: object) -> None:
    with pytest.raises(ValueError, match="seq_len"):
        pack_concat([1, 2], [0, 2], seq_len)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="seq_len"):
        pack_best_fit([1, 2], [0, 2], seq_len, pad_id=0)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("ids", "offsets", "match"),
    [
        ([1, 2, 3], [1, 3], "start at 0"),
        ([1, 2, 3], [0, 2], "end at len"),
        ([1, 2, 3], [0, 2, 1, 3], "non-decreasing"),
        ([1, 2, 3], [], "offsets"),
        ([[1, 2], [3, 4]], [0, 4], "1-D"),
        ([1.5, 2.0], [0, 2], "integers"),
        ([1, 2], [0.0, 2.0], "integers"),
        ([2**40], [0, 1], "int32"),
    ],
)
def test_bad_ragged_batch(ids: object, offsets: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        pack_concat(ids, offsets, 4)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=match):
        pack_best_fit(ids, offsets, 4, pad_id=0)  # type: ignore[arg-type]


def test_bad_keyword_arguments() -> None:
    with pytest.raises(ValueError, match="carry"):
        pack_concat([1], [0, 1], 4, carry=[[1]])
    with pytest.raises(ValueError, match="eos_id"):
        pack_concat([1], [0, 1], 4, eos_id=1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pad_id"):
        pack_best_fit([1], [0, 1], 4, pad_id=2**31)


def test_bad_piece_lengths() -> None:
    with pytest.raises(ValueError, match="longer than seq_len"):
        first_fit_rows([3, 5], 4)
    with pytest.raises(ValueError, match="non-negative"):
        first_fit_rows([3, -1], 4)
    with pytest.raises(ValueError, match="non-negative"):
        split_pieces([-1], 4)
