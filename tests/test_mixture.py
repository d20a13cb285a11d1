"""Mixture: the blend's bound, every document once per epoch, rows as /v1/pack cuts them, ranks, resume, torch."""

from __future__ import annotations

import hashlib
import json
import pickle
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import ROOT
from tokenizer_client.dataset import TokenDataset, write_dataset
from tokenizer_client.mixture import (
    MAX_PERIOD,
    Blend,
    Mixture,
    MixtureBatch,
    epoch_permutation,
    exact_weights,
)
from tokenizer_client.packing import pack_concat

FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DTYPE = np.dtype("<u4")


def documents(tag: int, lengths: Sequence[int]) -> list[np.ndarray]:
    """Document i of source `tag`: ids that say whose they are, ``tag * 10**6 + i * 1000 + position``."""
    return [tag * 10**6 + i * 1000 + np.arange(n, dtype=np.int64) for i, n in enumerate(lengths)]


MODEL = {"name": "test", "sha256": "0" * 64, "vocab_size": 1 << 24, "bos_id": -1, "eos_id": 0, "pad_id": 0}


def make_dataset(
    path: Path, docs: list[np.ndarray], *, per_shard: int = 3, seq_len: int | None = None, strategy: str = "concat"
) -> TokenDataset:
    """A pre-tokenized output of `per_shard` documents a shard (ragged, or packed with `seq_len`)."""
    ids = np.concatenate([*docs, np.zeros(0, np.int64)])
    offsets = np.concatenate([[0], np.cumsum([doc.size for doc in docs], dtype=np.int64)])
    return write_dataset(
        path, ids, offsets, model=MODEL, dtype=DTYPE, seq_len=seq_len, strategy=strategy, shard_documents=per_shard
    )


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TokenDataset]:
    root = tmp_path_factory.mktemp("mixture")
    rng = np.random.default_rng(5)
    return {
        "web": make_dataset(root / "web", documents(1, rng.integers(1, 90, 40).tolist())),
        "code": make_dataset(root / "code", documents(2, rng.integers(1, 300, 12).tolist()), per_shard=5),
        "books": make_dataset(root / "books", documents(3, rng.integers(20, 200, 30).tolist()), seq_len=32),
    }


@pytest.fixture(scope="module")
def mix(sources: dict[str, TokenDataset]) -> Mixture:
    return Mixture(sources, weights={"web": 0.5, "code": 0.3, "books": 0.2}, seq_len=32, seed=7)


def same(a: MixtureBatch, b: MixtureBatch) -> bool:
    return (
        np.array_equal(np.asarray(a.input_ids), np.asarray(b.input_ids))
        and np.array_equal(np.asarray(a.labels), np.asarray(b.labels))
        and np.array_equal(np.asarray(a.position_ids), np.asarray(b.position_ids))
        and np.array_equal(np.asarray(a.sources), np.asarray(b.sources))
        and len(a.cu_seqlens) == len(b.cu_seqlens)
        and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a.cu_seqlens, b.cu_seqlens, strict=True))
    )


def concat(batches: Sequence[MixtureBatch]) -> MixtureBatch:
    return MixtureBatch(
        np.concatenate([b.input_ids for b in batches]),
        np.concatenate([b.labels for b in batches]),
        np.concatenate([b.position_ids for b in batches]),
        [row for b in batches for row in b.cu_seqlens],
        np.concatenate([b.sources for b in batches]),
    )


# the blend: pure, no I/O


@FAST
@given(st.lists(st.integers(1, 40), min_size=1, max_size=7), st.integers(0, 10**12))
def test_every_prefix_is_within_one_row_of_its_weights(numerators: list[int], far: int) -> None:
    blend = Blend(numerators)
    period = blend.period
    sources, local = blend(0, 2 * period + 3)
    rows = np.arange(1, 2 * period + 4)
    for source, p in enumerate(numerators):
        given_ = np.cumsum(sources == source)
        assert np.all(np.abs(given_ * period - rows * p) < period)  # |given - n * weight| < 1, exactly
        assert np.array_equal(local[sources == source], np.arange(given_[-1]))  # a source's rows in order
    # far away: the same place in the period, the source's rows shifted by whole periods; no replay
    start = far - far % period
    far_sources, far_local = blend(start + 3, start + 3 + period)
    assert np.array_equal(far_sources, sources[3 : 3 + period])
    turns = start // period
    assert np.array_equal(far_local, local[3 : 3 + period] + turns * np.asarray(numerators)[sources[3 : 3 + period]])
    assert np.array_equal(
        blend.given(start + 3), turns * np.asarray(numerators) + np.bincount(sources[:3], minlength=len(numerators))
    )


def test_weights_are_exact_fractions() -> None:
    assert exact_weights([0.7, 0.3]) == (7, 3)
    assert exact_weights([1 / 3, 1 / 3, 1 / 3]) == (1, 1, 1)
    assert exact_weights([2, 1]) == (2, 1)
    assert exact_weights([Fraction(1, 6), 0.5]) == (1, 3)
    counts = exact_weights([1_234_567_891, 987_654_321, 1])  # token counts: rounded to MAX_PERIOD parts
    assert sum(counts) <= MAX_PERIOD and min(counts) >= 1
    assert abs(counts[0] / sum(counts) - 1_234_567_891 / 2_222_222_213) < 1e-4
    for bad in (0, -1, float("nan"), float("inf"), "1", True, None):
        with pytest.raises(ValueError, match="weight"):
            exact_weights([1, bad])  # type: ignore[list-item]


def test_row_a_billion_without_replay(mix: Mixture) -> None:
    began = time.perf_counter()
    loader = mix.loader(batch_size=8, state=mix.state_dict(10**9, 8))
    batch = next(loader)
    assert time.perf_counter() - began < 1.0
    assert same(batch, mix.rows(10**9, 10**9 + 8)) and batch.index == 10**9 // 8


# every document once per epoch; rows as /v1/pack concat cuts the permuted documents


def source_rows(mix: Mixture, name: str, rows: int) -> MixtureBatch:
    """The first `rows` rows a source gives, in its order, read through the mixture's global stream."""
    index = mix.names.index(name)
    stop = 0
    while mix.blend.given(stop)[index] < rows:
        stop += 64
    batch = mix.rows(0, stop)
    keep = np.flatnonzero(np.asarray(batch.sources) == index)[:rows]
    return MixtureBatch(
        batch.input_ids[keep], batch.labels[keep], batch.position_ids[keep], [batch.cu_seqlens[i] for i in keep], keep
    )


@FAST
@given(
    lengths=st.lists(st.integers(0, 60), min_size=1, max_size=12).filter(lambda x: sum(x) > 0),
    other=st.lists(st.integers(1, 60), min_size=1, max_size=8),
    seq_len=st.integers(1, 48),
    weights=st.tuples(st.integers(1, 5), st.integers(1, 5)),
    seed=st.integers(0, 2**32),
)
def test_every_document_once_per_epoch_cut_as_pack_concat_cuts(
    lengths: list[int], other: list[int], seq_len: int, weights: tuple[int, int], seed: int
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        docs = documents(1, lengths)
        mix = Mixture(
            {"a": make_dataset(Path(tmp) / "a", docs), "b": make_dataset(Path(tmp) / "b", documents(2, other))},
            weights=dict(zip("ab", weights, strict=True)),
            seq_len=seq_len,
            seed=seed,
        )
        total = sum(lengths)
        epochs = 3
        rows = source_rows(mix, "a", -(-epochs * total // seq_len))
        stream = rows.input_ids.reshape(-1)
        for epoch in range(epochs):  # each epoch: the documents, each whole and once, in some order
            tokens = stream[epoch * total : (epoch + 1) * total]
            seen = []
            at = 0
            while at < tokens.size:
                doc = int(tokens[at]) % 10**6 // 1000
                assert np.array_equal(tokens[at : at + lengths[doc]], docs[doc])
                seen.append(doc)
                at += lengths[doc]
            assert sorted(seen) == [i for i, n in enumerate(lengths) if n]

        # the reference: /v1/pack concat over the documents in each epoch's permutation, end to end
        count = len(rows.cu_seqlens)
        spanned = -(-count * seq_len // total)  # a row can span several epochs of a tiny source
        order = [docs[i] for epoch in range(spanned) for i in epoch_permutation(len(docs), seed, "a", epoch)]
        offsets = np.concatenate([[0], np.cumsum([d.size for d in order])])
        packed = pack_concat(np.concatenate(order), offsets, seq_len)
        assert np.array_equal(rows.input_ids, packed.input_ids[:count])
        assert np.array_equal(rows.labels, packed.labels[:count])
        assert np.array_equal(rows.position_ids, packed.position_ids[:count])
        assert all(np.array_equal(rows.cu_seqlens[r], packed.row_cu_seqlens(r)) for r in range(count))


def reference_rows(
    mix: Mixture, docs: dict[str, list[np.ndarray]], packed: dict[str, TokenDataset], start: int, stop: int
) -> MixtureBatch:
    """Global rows ``start`` to ``stop`` as the module docstring says, one row at a time, slowly."""
    sources, local = mix.blend(start, stop)
    ids, labels, positions, cu = [], [], [], []
    length = mix.seq_len
    streams: dict[
        str, tuple[np.ndarray, list[int]]
    ] = {}  # a ragged source's ids, epoch after epoch, and its document starts
    for name, rows in zip(mix.names, mix.blend.given(stop).tolist(), strict=True):
        if name in packed or not rows:
            continue
        total = sum(doc.size for doc in docs[name])
        stream, starts = [], []
        at = 0
        for epoch in range(rows * length // total + 1):
            for i in epoch_permutation(len(docs[name]), mix.seed, name, epoch).tolist():
                if docs[name][i].size:
                    starts.append(at)
                stream.append(docs[name][i])
                at += docs[name][i].size
        streams[name] = np.concatenate(stream), starts
    for source, row in zip(sources.tolist(), local.tolist(), strict=True):
        name = mix.names[source]
        if name in packed:
            dataset = packed[name]
            epoch, place = divmod(row, len(dataset))
            expected = dataset.row(int(epoch_permutation(len(dataset), mix.seed, name, epoch)[place]))
            ids.append(expected.input_ids)
            labels.append(expected.labels)
            positions.append(expected.position_ids)
            cu.append(np.asarray(expected.cu_seqlens))
            continue
        stream, starts = streams[name]
        flat = stream[row * length : (row + 1) * length]
        cuts = sorted({0, *(s - row * length for s in starts if row * length < s < (row + 1) * length)})
        ids.append(flat)
        labels.append(flat)
        positions.append(np.concatenate([np.arange(b - a) for a, b in zip(cuts, [*cuts[1:], length], strict=True)]))
        cu.append(np.array([*cuts, length]))
    shape = (len(ids), length)
    return MixtureBatch(*(np.array(x).reshape(shape) for x in (ids, labels, positions)), cu, sources)


@FAST
@given(
    lengths=st.lists(st.integers(0, 70), min_size=1, max_size=14).filter(lambda x: sum(x) > 0),
    other=st.lists(st.integers(1, 300), min_size=1, max_size=8),
    per_shard=st.integers(1, 4),
    seq_len=st.integers(1, 40),
    weights=st.tuples(st.integers(1, 4), st.integers(1, 4), st.integers(0, 3)),
    start=st.integers(0, 200),
    count=st.integers(0, 40),
    piece_ids=st.sampled_from([0, 128, 10**9]),
    pieces_a_shard=st.sampled_from([0, 4, 10**9]),
)
def test_rows_equal_a_row_by_row_reference(
    lengths: list[int],
    other: list[int],
    per_shard: int,
    seq_len: int,
    weights: tuple[int, int, int],
    start: int,
    count: int,
    piece_ids: int,
    pieces_a_shard: int,
) -> None:
    """Any range of rows, multi-shard sources, empty documents, every way of copying pieces (a slice each,
    one index computation, grouped by shard or not): what a row-at-a-time reading of the definition gives."""
    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as patch:
        patch.setattr("tokenizer_client.mixture._PIECE_IDS", piece_ids)
        patch.setattr("tokenizer_client.mixture._PIECES_A_SHARD", pieces_a_shard)
        docs = {"a": documents(1, lengths), "b": documents(2, other)}
        sources = {name: make_dataset(Path(tmp) / name, d, per_shard=per_shard) for name, d in docs.items()}
        packed = {}
        if weights[2]:
            books = documents(3, [5 + (7 * i) % 40 for i in range(2 * per_shard + 3)])
            packed["p"] = make_dataset(
                Path(tmp) / "p", books, per_shard=per_shard, seq_len=seq_len, strategy="best_fit"
            )
        chosen = {name: w for name, w in zip("abp", weights, strict=True) if w}
        mix = Mixture({**sources, **packed}, weights=chosen, seq_len=seq_len, seed=start)
        assert same(mix.rows(start, start + count), reference_rows(mix, docs, packed, start, start + count))


def test_a_loader_reading_ahead_gives_the_batches_of_one_at_a_time(
    mix: Mixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("tokenizer_client.mixture.READ_AHEAD_IDS", 5 * 3 * 32)  # five micro-batches a read
    loader = mix.loader(batch_size=3, state=mix.state_dict(6, 3))
    got = [next(loader) for _ in range(12)]
    assert [b.index for b in got] == list(range(2, 14))
    assert all(same(b, mix.batch(b.index, rank=0, batch_size=3, world_size=1)) for b in got)
    assert all(b.state == mix.state_dict((b.index + 1) * 3, 3) for b in got)
    assert loader.state_dict() == got[-1].state
    loader.load_state_dict(got[3].state)  # mid-read: what was read ahead is dropped
    assert same(next(loader), got[4]) and next(loader).index == 7


@FAST
@given(
    lengths=st.lists(st.integers(0, 50), min_size=1, max_size=10).filter(lambda x: sum(x) > 0),
    per_shard=st.integers(1, 4),
    seq_len=st.integers(1, 40),
    weights=st.tuples(st.integers(1, 4), st.integers(0, 3), st.integers(0, 3)),
    cuts=st.lists(st.integers(0, 300), max_size=12, unique=True),
    order=st.randoms(use_true_random=False),
    piece_ids=st.sampled_from([0, 128, 10**9]),
)
def test_a_read_of_several_ranges_equals_a_read_of_each(
    lengths: list[int],
    per_shard: int,
    seq_len: int,
    weights: tuple[int, int, int],
    cuts: list[int],
    order: Any,
    piece_ids: int,
) -> None:
    """Disjoint ranges of rows (empty ones, adjacent ones, in any order; runs that cross epochs, several shards,
    empty documents, packed rows) read at once: the rows of ``rows(start, stop)`` of each, end to end."""
    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as patch:
        patch.setattr("tokenizer_client.mixture._PIECE_IDS", piece_ids)
        docs = {"a": documents(1, lengths), "b": documents(2, [1 + (13 * i) % 70 for i in range(5)])}
        sources = {name: make_dataset(Path(tmp) / name, d, per_shard=per_shard) for name, d in docs.items()}
        books = documents(3, [5 + (7 * i) % 40 for i in range(2 * per_shard + 3)])
        sources["p"] = make_dataset(Path(tmp) / "p", books, per_shard=per_shard, seq_len=seq_len, strategy="best_fit")
        chosen = {name: w for name, w in zip("abp", weights, strict=True) if w}
        mix = Mixture({name: sources[name] for name in chosen}, weights=chosen, seq_len=seq_len, seed=len(cuts))
        bounds = sorted(cuts)
        ranges = [(bounds[i], bounds[i + 1]) for i in range(0, len(bounds) - 1, 2)]  # every other gap: disjoint
        ranges += [(stop, stop) for _, stop in ranges[:1]]  # an empty one
        ranges += [(bounds[i], bounds[i + 1]) for i in range(1, len(bounds) - 1, 4)]  # some adjacent to others
        order.shuffle(ranges)
        expected = concat([mix.rows(start, stop) for start, stop in ranges]) if ranges else mix.rows(0, 0)
        assert same(mix._read(ranges), expected)


@FAST
@given(
    world_size=st.integers(1, 5),
    rank_at=st.floats(0, 1, exclude_max=True),
    batch_size=st.integers(1, 4),
    start=st.integers(0, 30),
    ahead=st.integers(0, 7),
)
def test_a_rank_reading_ahead_gives_the_batches_of_one_at_a_time(
    mix: Mixture, world_size: int, rank_at: float, batch_size: int, start: int, ahead: int
) -> None:
    """A loader of any rank of any world size reads ``ahead`` micro-batches at once (0: one, as without reading
    ahead), and each TorchMixture worker its own; every batch is the one read alone, with its index and state."""
    rank, size = int(rank_at * world_size), world_size * batch_size
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("tokenizer_client.mixture.READ_AHEAD_IDS", ahead * batch_size * mix.seq_len)
        state = mix.state_dict(start * size, size)
        loader = mix.loader(rank=rank, world_size=world_size, batch_size=batch_size, state=state)
        got = [next(loader) for _ in range(11)]
        assert [b.index for b in got] == list(range(start, start + 11))
        for b in got:
            assert same(b, mix.batch(b.index, rank=rank, batch_size=batch_size, world_size=world_size))
            assert b.state == mix.state_dict((b.index + 1) * size, size)
        assert loader.state_dict() == got[-1].state
        loader.load_state_dict(got[2].state)  # mid-read: what was read ahead is dropped
        assert same(next(loader), got[3]) and loader.state_dict() == got[3].state


def test_torch_workers_read_their_own_batches_ahead(mix: Mixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """DataLoader workers read 3 of their batches (every other one) at once and hand out the batches read alone;
    without workers, a state loaded while the dataset iterates drops what it read ahead."""
    pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    monkeypatch.setattr("tokenizer_client.mixture.READ_AHEAD_IDS", 3 * 2 * 32)
    state = mix.state_dict(5 * 6, 6)
    reference = [mix.batch(g, rank=2, batch_size=2, world_size=3) for g in range(5, 16)]
    got = batches(
        DataLoader(mix.torch(rank=2, world_size=3, batch_size=2, state=state), batch_size=None, num_workers=2), 11
    )
    assert [b.index for b in got] == list(range(5, 16)) and all(same(a, b) for a, b in zip(got, reference, strict=True))
    dataset = mix.torch(rank=2, world_size=3, batch_size=2, state=state)
    iterator = iter(dataset)
    assert [next(iterator).index for _ in range(4)] == [5, 6, 7, 8]
    dataset.load_state_dict(got[1].state)
    assert same(next(iterator), reference[2]) and dataset.state_dict()["rows"] == 8 * 6


def test_packed_rows_in_a_permutation_per_epoch(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    packed = make_dataset(
        tmp_path / "p", documents(4, rng.integers(1, 40, 25).tolist()), seq_len=16, strategy="best_fit"
    )
    mix = Mixture({"p": packed}, seq_len=16, seed=11)
    count = len(packed)
    batch = mix.rows(0, 3 * count)
    for epoch in range(3):
        order = epoch_permutation(count, 11, "p", epoch)
        for place, row in enumerate(order.tolist()):
            expected = packed.row(row)
            i = epoch * count + place
            assert np.array_equal(batch.input_ids[i], expected.input_ids)
            assert np.array_equal(batch.labels[i], expected.labels)  # -100 on padding
            assert np.array_equal(batch.position_ids[i], expected.position_ids)
            assert np.array_equal(batch.cu_seqlens[i], expected.cu_seqlens)
    assert (batch.labels == -100).any()


def test_the_same_rows_in_another_process(mix: Mixture, sources: dict[str, TokenDataset]) -> None:
    def digest(batch: MixtureBatch) -> str:
        parts = [batch.input_ids, batch.labels, batch.position_ids, batch.sources, *batch.cu_seqlens]
        return hashlib.sha256(b"".join(np.ascontiguousarray(p).tobytes() for p in parts)).hexdigest()

    paths = {name: str(ds.path) for name, ds in sources.items()}
    code = (
        "import json, sys, hashlib, numpy as np\n"
        "from client import Mixture, TokenDataset\n"
        "paths = json.loads(sys.argv[1])\n"
        "mix = Mixture({n: TokenDataset(p) for n, p in paths.items()},"
        " weights={'web': 0.5, 'code': 0.3, 'books': 0.2}, seq_len=32, seed=7)\n"
        "for start, stop in ((0, 300), (10**9, 10**9 + 40)):\n"
        "    b = mix.rows(start, stop)\n"
        "    parts = [b.input_ids, b.labels, b.position_ids, b.sources, *b.cu_seqlens]\n"
        "    print(hashlib.sha256(b''.join(np.ascontiguousarray(p).tobytes() for p in parts)).hexdigest())\n"
    )
    out = subprocess.run([sys.executable, "-c", code, json.dumps(paths)], cwd=ROOT, check=True, capture_output=True)
    assert out.stdout.decode().split() == [digest(mix.rows(0, 300)), digest(mix.rows(10**9, 10**9 + 40))]
    assert digest(pickle.loads(pickle.dumps(mix)).rows(0, 300)) == digest(mix.rows(0, 300))


# ranks and resume


def test_resumed_on_other_world_sizes_gives_the_rows_of_one_uninterrupted_rank(mix: Mixture) -> None:
    size = 16
    single = mix.loader(batch_size=size)
    reference = [next(single) for _ in range(12)]
    four = [mix.loader(rank=r, world_size=4, batch_size=4) for r in range(4)]
    for g in range(7):
        micro = [next(loader) for loader in four]
        assert same(concat(micro), reference[g]) and {b.index for b in micro} == {g}
    states = [loader.state_dict() for loader in four]
    assert all(state == states[0] for state in states) and states[0]["rows"] == 7 * size
    assert micro[2].state == states[0]
    json.dumps(states[0])  # goes into any checkpoint
    for world in (2, 8):
        loaders = [
            mix.loader(rank=r, world_size=world, batch_size=size // world, state=states[0]) for r in range(world)
        ]
        for g in range(7, 12):
            assert same(concat([next(loader) for loader in loaders]), reference[g])
    again = mix.loader(batch_size=size)
    again.load_state_dict(states[0])
    assert same(next(again), reference[7])


def test_every_refusal_names_what_differs(mix: Mixture, sources: dict[str, TokenDataset], tmp_path: Path) -> None:
    state = mix.loader(rank=1, world_size=2, batch_size=4).state_dict()
    weights = {"web": 0.5, "code": 0.3, "books": 0.2}

    def refused(other: Mixture, pattern: str, batch_size: int = 4, world_size: int = 2, data: Any = state) -> None:
        with pytest.raises(ValueError, match=pattern):
            other.loader(world_size=world_size, batch_size=batch_size, state=data)

    refused(mix, r"global batch size \(batch_size x world_size\) 8 in the state, 6 here", batch_size=3)
    ragged = {"web": sources["web"], "code": sources["code"]}
    ragged_state = Mixture(ragged, seq_len=32).state_dict(0, 8)
    refused(Mixture(ragged, seq_len=16), r"seq_len 32 in the state, 16 here", data=ragged_state)
    refused(Mixture(sources, weights=weights, seq_len=32, seed=8), r"seed 7 in the state, 8 here")
    refused(
        Mixture(sources, weights={**weights, "web": 0.6, "code": 0.2}, seq_len=32, seed=7),
        r"weight of 'web' 1/2 in the state, 3/5 here; weight of 'code' 3/10 in the state, 1/5 here$",
    )
    refused(
        Mixture({"web": sources["web"]}, seq_len=32, seed=7),
        r"sources \['web', 'code', 'books'\] in the state, \['web'\]",
    )
    swapped = {"web": sources["code"], "code": sources["web"], "books": sources["books"]}
    refused(
        Mixture(swapped, weights=weights, seq_len=32, seed=7), r"source 'web' holds other data.*source 'code' holds"
    )
    refused(mix, "not a whole number of global batches", data={**state, "rows": 12})
    refused(mix, "version 2", data={**state, "version": 2})
    refused(mix, "not a mixture state", data={"rows": 8})

    with pytest.raises(ValueError, match="source 'books': packed rows of 32, the mixture's seq_len is 16"):
        Mixture({"books": sources["books"]}, seq_len=16)
    with pytest.raises(ValueError, match=r"no weight for \['code'\], weights for unknown \['cod'\]"):
        Mixture({"web": sources["web"], "code": sources["code"]}, weights={"web": 1, "cod": 1}, seq_len=8)
    with pytest.raises(ValueError, match="weight of 'code'"):
        Mixture({"web": sources["web"], "code": sources["code"]}, weights={"web": 1, "code": 0}, seq_len=8)
    with pytest.raises(ValueError, match="rank 4 is not below world_size 4"):
        mix.loader(rank=4, world_size=4, batch_size=1)
    with pytest.raises(ValueError, match="batch_size must be at least 1"):
        mix.loader(batch_size=0)
    with pytest.raises(ValueError, match="inside source 'web'"):
        Mixture(sources, seq_len=32, cache_dir=sources["web"].path / "cache")
    with pytest.raises(ValueError, match=r"source 'empty'.*holds no ids"):
        Mixture({"empty": make_dataset(tmp_path / "empty", documents(5, [0, 0]))}, seq_len=8)


def test_index_arrays_are_cached_in_cache_dir_only(
    sources: dict[str, TokenDataset], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("tokenizer_client.mixture.CACHE_FROM_ITEMS", 0)  # ours are small: cache them all the same
    before = {name: sorted(p.name for p in ds.path.iterdir()) for name, ds in sources.items()}
    cached = Mixture(sources, seq_len=32, seed=3, cache_dir=tmp_path / "cache")
    expected = Mixture(sources, seq_len=32, seed=3).rows(0, 500)
    assert same(cached.rows(0, 500), expected)
    files = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert any("documents" in f for f in files) and any("epoch0-ends" in f for f in files)
    assert not any(f.endswith(".tmp") for f in files)
    assert {name: sorted(p.name for p in ds.path.iterdir()) for name, ds in sources.items()} == before

    def no_permutation(*args: Any) -> np.ndarray:
        raise AssertionError("recomputed an epoch that is in the cache")

    monkeypatch.setattr("tokenizer_client.mixture.epoch_permutation", no_permutation)
    assert same(Mixture(sources, seq_len=32, seed=3, cache_dir=tmp_path / "cache").rows(0, 500), expected)


def test_importing_client_imports_neither_torch_nor_the_mixture() -> None:
    code = (
        "import sys, client\n"
        "assert not [m for m in ('torch', 'tokenizer_client.mixture') if m in sys.modules]\n"
        "from client import Mixture, TokenDataset\n"
        "assert 'torch' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


# torch


def batches(loader: Any, count: int) -> list[MixtureBatch]:
    out = []
    for batch in loader:
        out.append(batch)
        if len(out) == count:
            return out
    raise AssertionError("the stream ended")


def test_dataloader_workers_give_the_batches_of_no_workers(mix: Mixture) -> None:
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    state = mix.state_dict(3 * 8, 8)
    reference = batches(mix.loader(rank=1, world_size=2, batch_size=4, state=state), 7)
    for workers in (0, 2, 3):
        ds = mix.torch(rank=1, world_size=2, batch_size=4, state=state)
        with warnings.catch_warnings():  # pin_memory without an accelerator warns, and so do more workers than cores
            warnings.simplefilter("ignore", UserWarning)
            got = batches(DataLoader(ds, batch_size=None, num_workers=workers, pin_memory=workers == 2), 7)
        assert [b.index for b in got] == [b.index for b in reference]
        assert all(same(a, b) for a, b in zip(got, reference, strict=True))
        assert got[0].input_ids.dtype == torch.int32 and got[-1].state == reference[-1].state


def test_every_loop_over_a_dataloader_starts_at_the_state_whatever_its_workers(mix: Mixture) -> None:
    """A probe's: with no workers a second loop went on from where the first stopped (the dataset kept its
    position), with 2 it started again (workers advance copies). Both start again now, at the state given."""
    pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    state = mix.state_dict(2 * 4, 4)
    for workers in (0, 2):
        loader = DataLoader(mix.torch(batch_size=4, state=state), batch_size=None, num_workers=workers)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            loops = [[b.index for b in batches(loader, 3)] for _ in range(2)]
        assert loops == [[2, 3, 4], [2, 3, 4]], (workers, loops)


@pytest.mark.parametrize("workers", [0, 2])
def test_stateful_dataloader_resumes_where_it_stopped(mix: Mixture, workers: int) -> None:
    pytest.importorskip("torch")
    stateful = pytest.importorskip("torchdata.stateful_dataloader")

    reference = batches(mix.loader(batch_size=4), 10)
    first = stateful.StatefulDataLoader(mix.torch(batch_size=4), batch_size=None, num_workers=workers)
    got = batches(first, 5)
    saved = first.state_dict()
    del first
    second = stateful.StatefulDataLoader(mix.torch(batch_size=4), batch_size=None, num_workers=workers)
    second.load_state_dict(saved)
    got += batches(second, 5)
    assert [b.index for b in got] == list(range(10))
    assert all(same(a, b) for a, b in zip(got, reference, strict=True))
