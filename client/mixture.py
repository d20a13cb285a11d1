"""Training data mixtures: weighted, deterministic, split over data-parallel ranks, resumable on any number of them.

::

    from tokenizer_client import Mixture, TokenDataset

    mix = Mixture({"web": TokenDataset("web-shards"), "code": TokenDataset("code-shards")},
                  weights={"web": 0.7, "code": 0.3}, seq_len=2048, seed=1234)
    rows = mix.loader(rank=r, world_size=w, batch_size=8)   # this rank's micro-batches, in order
    batch = next(rows)                                      # MixtureBatch: input_ids, labels, position_ids, ...
    state = rows.state_dict()                               # into the checkpoint
    rows = mix.loader(rank=r, world_size=w2, batch_size=8 * w // w2, state=state)

**One global stream of rows.** Global row k is a pure function of the sources' fingerprints, the weights,
``seq_len``, ``seed`` and k; nothing is replayed to find it, so resuming at row 10**9 costs what row 0 does.

* The blend. Which source row k comes from is an earliest-deadline-first schedule of the exact weights
  (Tijdeman's solution of the chairman assignment problem): after any n rows each source has given within
  ``1 - 1/(2k - 2)`` rows of ``n * weight`` (k sources), so always within one row. Weights are exact
  fractions ``p / D`` (0.7 is 7/10, 1/3 is 1/3; weights that need a denominator over 65,536 are rounded to
  one of 65,536, ``Mixture.weights`` shows them). After D rows every source has given exactly p rows, so the
  schedule repeats every D rows: one period is computed once (:class:`Blend`), and row k is period
  ``k // D``, place ``k % D``.
* A source's rows. A ragged dataset: its documents in a seeded permutation per epoch, end to end (each
  keeps its EOS), epoch after epoch, cut every ``seq_len`` ids; row j is ids ``[j * seq_len, (j + 1) *
  seq_len)`` of that endless stream, found by bisecting the cumulative lengths of the epoch's permutation.
  Its fields are those of ``/v1/pack`` concat rows (:func:`cut_rows`): ``labels`` equal to the ids,
  ``position_ids`` restarting at each document start and each row start, ``cu_seqlens`` those starts plus
  ``seq_len``. A packed dataset (whose ``seq_len`` must be the mixture's): its rows in a seeded permutation
  per epoch, with their stored ``cu_seqlens`` (``labels`` -100 on padding). A source with loss masks
  (conversations, prompt-completion records: format version 2) has ``labels`` -100 wherever its mask is 0,
  rows of other sources as without. A source never runs out.
* Ranks. Global batch g is rows ``[g * G, (g + 1) * G)``, ``G = batch_size * world_size``; rank r reads
  its contiguous ``batch_size`` rows of it. The state is the global position (rows consumed) and what the
  stream is made of (each source's :func:`fingerprint` and :func:`content_digest`, so a dataset rewritten in
  place is refused); any (world_size, batch_size) of the same G continues the same stream.
* Sources of other tokenizers (model sha256 or vocabulary size) are refused: an id is another token in each.

The permutation and cumulative-length arrays a large ragged source needs (12-16 bytes a document an
epoch) are built on first use and kept for the last two epochs; with ``cache_dir`` those of sources of at
least ``CACHE_FROM_ITEMS`` documents (or rows) are written there once, named by the source's fingerprint and
content digest (a dataset rewritten in place gets new ones), and memory-mapped afterwards (never
inside a dataset directory, which may be read-only). Needs numpy
only; :meth:`Mixture.torch` imports torch when called.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import hashlib
import heapq
import itertools
import json
import math
import operator
import os
import tempfile
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

import numpy as np

from tokenizer_client.dataset import (
    IDX_SUFFIX,
    IGNORE_INDEX,
    LAYOUT_PACKED,
    LAYOUT_RAGGED,
    SEG_SUFFIX,
    SHARD_SUFFIXES,
    IndexHeader,
    Shard,
    TokenDataset,
    lazy_attributes,
    read_shard,
)

if TYPE_CHECKING:
    import torch

__all__ = [
    "CACHE_FROM_ITEMS",
    "MAX_PERIOD",
    "READ_AHEAD_IDS",
    "STATE_FORMAT",
    "STATE_VERSION",
    "Blend",
    "Mixture",
    "MixtureBatch",
    "MixtureLoader",
    "cut_rows",
    "epoch_permutation",
    "exact_weights",
    "row_fields",
]

MAX_PERIOD = 1 << 16
"""Largest blend period D: weights are fractions p / D with D at most this."""
CACHE_FROM_ITEMS = 1 << 16
"""Sources with fewer items (documents or rows) build their index arrays in memory: it takes microseconds."""
READ_AHEAD_IDS = 1 << 17
"""A loader (and each torch worker) reads this many ids of its rows at once, whole micro-batches (at least one),
and hands them out one micro-batch at a time: the cost of a read is mostly per call on small batches. Its
micro-batches need not be consecutive rows (several ranks, several workers): one read takes several ranges."""
STATE_FORMAT = "tokenizer-mixture"
STATE_VERSION = 1

Weight = Union[int, float, Fraction, np.integer, np.floating]  # noqa: UP007 (a runtime alias on Python 3.10)


# ---------------------------------------------------------------------------------------------------------
# Pure logic: weights, the blend, epoch permutations, cutting rows. No I/O.


def exact_weights(weights: Sequence[Weight], max_period: int = MAX_PERIOD) -> tuple[int, ...]:
    """Numerators p of the weights as fractions p / D, D = sum(p) at most `max_period`, each p at least 1.

    A float is read as the shortest fraction that rounds to it (0.7 is 7/10, 1/3 is 1/3); weights are
    relative (2 and 1 are 2/3 and 1/3). When the exact fractions need a denominator over `max_period`,
    they are rounded to `max_period` parts (largest remainders), each source keeping at least one.
    """
    exact = [_fraction(weight) for weight in weights]
    if not exact:
        raise ValueError("a mixture needs at least one source")
    total = sum(exact, Fraction(0))
    shares = [weight / total for weight in exact]
    period = math.lcm(*(share.denominator for share in shares))
    if period <= max_period:
        return tuple(int(share * period) for share in shares)
    if len(shares) > max_period:
        raise ValueError(f"{len(shares)} sources are more than the {max_period} rows of a blend period")
    ideal = [share * max_period for share in shares]
    parts = [max(1, math.floor(value)) for value in ideal]
    order = sorted(range(len(parts)), key=lambda i: ideal[i] - parts[i], reverse=True)
    for i in order[: max(0, max_period - sum(parts))]:
        parts[i] += 1
    while sum(parts) > max_period:  # sources lifted to 1 took rows: give them back from the largest
        parts[max(range(len(parts)), key=lambda i: (parts[i] - ideal[i], parts[i]))] -= 1
    common = math.gcd(*parts)
    return tuple(part // common for part in parts)


def _fraction(weight: Weight) -> Fraction:
    if isinstance(weight, (bool, np.bool_)) or not isinstance(weight, (int, float, Fraction, np.integer, np.floating)):
        raise ValueError(f"a weight must be a positive number, got {weight!r}")
    if isinstance(weight, (float, np.floating)):
        value = float(weight)
        if not math.isfinite(value):
            raise ValueError(f"a weight must be a positive number, got {weight!r}")
        short = Fraction(value).limit_denominator(1_000_000)
        fraction = short if float(short) == value else Fraction(repr(value))
    else:
        fraction = Fraction(int(weight)) if isinstance(weight, np.integer) else Fraction(weight)
    if fraction <= 0:
        raise ValueError(f"a weight must be a positive number, got {weight!r} (leave the source out instead)")
    return fraction


@functools.lru_cache(maxsize=16)
def _blend_period(numerators: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """One period of the blend: the source of each row, and how many rows that source gave before it.

    Earliest deadline first (Tijdeman 1980) over unit jobs: a source's j-th row of the period is released
    at the first row n (counted from 1) where ``n * p / D - (j - 1) >= 1/M`` and is due by the first n where
    leaving it out would put the source more than ``1 - 1/M`` behind, M = 2k - 2. Ties go to the first
    source. The caller checks the bound on the result.
    """
    sources = len(numerators)
    period = sum(numerators)
    if sources == 1:
        return np.zeros(period, np.int32), np.arange(period, dtype=np.int64)
    m = 2 * sources - 2

    def release(source: int, job: int) -> int:
        return -(-period * ((job - 1) * m + 1) // (numerators[source] * m))

    def deadline(source: int, job: int) -> int:
        return period * (job * m - 1) // (numerators[source] * m) + 1

    table = np.empty(period, np.int32)
    local = np.empty(period, np.int64)
    given = [0] * sources
    waiting = [(release(source, 1), source) for source in range(sources)]
    heapq.heapify(waiting)
    ready: list[tuple[int, int]] = []
    for row in range(1, period + 1):
        while waiting and waiting[0][0] <= row:
            _, source = heapq.heappop(waiting)
            heapq.heappush(ready, (deadline(source, given[source] + 1), source))
        _, source = heapq.heappop(ready)  # never empty: the deficits sum to 1, the largest is >= 1/k >= 1/M
        table[row - 1] = source
        local[row - 1] = given[source]
        given[source] += 1
        if given[source] < numerators[source]:
            heapq.heappush(waiting, (release(source, given[source] + 1), source))
    return table, local


class Blend:
    """Which source each global row comes from, and the row's number within that source.

    ``Blend((7, 3))`` gives weights 7/10 and 3/10. After any n rows source s has given within ``1 - 1/(2k -
    2)`` rows of ``n * p[s] / D``; every D rows the schedule repeats, so any row is found in O(1).
    """

    def __init__(self, numerators: Sequence[int]) -> None:
        self.numerators = tuple(operator.index(p) for p in numerators)
        if not self.numerators or min(self.numerators) < 1:
            raise ValueError(f"numerators must be positive integers, got {numerators!r}")
        self.period = sum(self.numerators)
        self._table, self._local = _blend_period(self.numerators)
        self._p = np.asarray(self.numerators, np.int64)
        self._check()

    def _check(self) -> None:
        """The bound the schedule promises, on every prefix of the period (the schedule repeats after it)."""
        sources = len(self.numerators)
        bound = Fraction(1) - (Fraction(1, 2 * sources - 2) if sources > 1 else Fraction(0))
        rows = np.arange(1, self.period + 1, dtype=np.int64)
        for source, p in enumerate(self.numerators):
            given = np.cumsum(self._table == source, dtype=np.int64)
            worst = int(np.abs(given * self.period - rows * p).max())  # error times D, exact
            if Fraction(worst, self.period) > bound or given[-1] != p:
                raise RuntimeError(f"blend of {self.numerators}: source {source} is {worst}/{self.period} rows off")

    def __call__(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Source (int32) and row within that source (int64) of global rows ``start`` to ``stop``."""
        if not 0 <= start <= stop:
            raise ValueError(f"rows [{start}, {stop}) are not a range of non-negative row numbers")
        return self.of(np.arange(start, stop, dtype=np.int64))

    def of(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Source (int32) and row within that source (int64) of global rows `rows` (int64, non-negative)."""
        turn, place = np.divmod(rows, self.period)
        sources = self._table[place]
        return sources, turn * self._p[sources] + self._local[place]

    def given(self, rows: int) -> np.ndarray:
        """How many rows each source has given after the first `rows` global rows."""
        turn, place = divmod(operator.index(rows), self.period)
        counts = np.bincount(self._table[:place], minlength=len(self.numerators)).astype(np.int64)
        return turn * self._p + counts


def _name_key(name: str) -> int:
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")


def epoch_permutation(count: int, seed: int, name: str, epoch: int) -> np.ndarray:
    """The order of a source's `count` items (documents or rows) in `epoch`: a pure function of its arguments."""
    generator = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, _name_key(name), epoch])))
    order = generator.permutation(count)
    return order.astype(np.int32) if count < 2**31 else order


@dataclass(frozen=True, eq=False)
class Rows:
    """Rows of one source: [rows, seq_len] int32 arrays and each row's cu_seqlens."""

    input_ids: np.ndarray
    labels: np.ndarray
    position_ids: np.ndarray
    cu_seqlens: list[np.ndarray]


def cut_rows(ids: np.ndarray, document_starts: np.ndarray, seq_len: int) -> Rows:
    """Cut a stream of ids (a multiple of `seq_len` long) into rows as ``/v1/pack`` concat does.

    `document_starts` are the increasing positions in `ids` where documents begin. A segment starts at each
    of them and at each row start; ``position_ids`` restart there; ``cu_seqlens`` of a row are its segment
    starts and ``seq_len``; ``labels`` equal the ids (concat rows have no padding).
    """
    total = ids.size
    rows = total // seq_len
    if rows * seq_len != total:
        raise ValueError(f"{total} ids are not whole rows of {seq_len}")
    starts = np.union1d(np.arange(0, total, seq_len, dtype=np.int64), np.asarray(document_starts, np.int64))
    return row_fields(ids.reshape(rows, seq_len), starts, np.full(rows, seq_len, np.int64))


def row_fields(ids: np.ndarray, segment_starts: np.ndarray, used: np.ndarray | None = None) -> Rows:
    """The ``/v1/pack`` fields of rows of ids: [rows, seq_len] `ids`, the increasing flat positions where
    segments start (every row's start among them) and the ids each row uses (the rest is padding, where
    ``labels`` are -100 and ``position_ids`` 0; None: every row uses all its ids)."""
    rows, seq_len = ids.shape
    total = rows * seq_len
    segment_starts = segment_starts.astype(np.int64, copy=False)
    lengths = np.empty_like(segment_starts)
    np.subtract(segment_starts[1:], segment_starts[:-1], out=lengths[:-1])
    lengths[-1:] = total - segment_starts[-1:]
    flat_positions = np.repeat(segment_starts.astype(np.int32), lengths)  # each id's segment start, then
    np.subtract(_arange(total), flat_positions, out=flat_positions)  # its place in the segment
    positions = flat_positions.reshape(rows, seq_len)
    input_ids = ids.astype(np.int32, copy=False)
    labels = input_ids.copy()
    if used is None:
        used = np.full(rows, seq_len, np.int64)
    elif (used < seq_len).any():
        padding = _arange(seq_len) >= used[:, None]
        labels[padding] = IGNORE_INDEX
        positions[padding] = 0
    # each row's cu_seqlens (its segment starts, then the ids it uses), all rows' in one flat array
    row_of = segment_starts // seq_len
    ends = np.cumsum(np.bincount(row_of, minlength=rows) + 1)
    flat = np.empty(segment_starts.size + rows, np.int32)
    flat[_arange(segment_starts.size) + row_of] = segment_starts - row_of * seq_len  # the i-th, after r ends
    flat[ends - 1] = used
    bounds = [0, *ends.tolist()]
    return Rows(input_ids, labels, positions, [flat[bounds[r] : bounds[r + 1]] for r in range(rows)])


_COUNTING: dict[type, np.ndarray] = {}
_COUNTING_LIMIT = 1 << 22


def _arange(size: int, dtype: type[np.integer[Any]] = np.int32) -> np.ndarray:
    """0, 1, ..., size - 1 (read-only): a slice of one array a type, made again only when a larger size is asked."""
    numbers = _COUNTING.get(dtype)
    if numbers is None or numbers.size < size:
        if size > _COUNTING_LIMIT:
            return np.arange(size, dtype=dtype)
        numbers = np.arange(max(size, 1 << 12, 2 * (0 if numbers is None else numbers.size)), dtype=dtype)
        numbers.flags.writeable = False
        _COUNTING[dtype] = numbers
    return numbers[:size]


_PIECE_IDS = 128
"""Pieces of documents shorter than this on average are copied by one index computation over all their ids,
longer ones a slice each (numpy's cost per slice is that of copying about this many ids)."""
_PIECES_A_SHARD = 4
"""Pieces from one shard (on average) under which a batch copies a slice each instead of grouping by shard."""


def _runs(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``starts[i], starts[i] + 1, ..., starts[i] + lengths[i] - 1`` for each i, end to end (int64, lengths > 0)."""
    ends = np.cumsum(lengths)
    index = np.repeat(starts - (ends - lengths), lengths)  # each place's run start less the run's place
    index += _arange(int(ends[-1]), np.int64)
    return index


def _copy(out: np.ndarray, ids: np.ndarray, froms: np.ndarray, takes: np.ndarray) -> None:
    """Fill `out` with the pieces ``ids[froms[i] : froms[i] + takes[i]]`` end to end (``takes > 0``)."""
    if takes.size * _PIECE_IDS > out.size:
        out[:] = ids[_runs(froms, takes)]
        return
    targets = np.cumsum(takes) - takes
    for source, target, take in zip(froms.tolist(), targets.tolist(), takes.tolist(), strict=True):
        out[target : target + take] = ids[source : source + take]


# ---------------------------------------------------------------------------------------------------------
# Sources: a TokenDataset's endless stream of rows.


def _open_limit() -> int:
    """Shards a source keeps mapped at once (each holds 2 or 3 file descriptors)."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return 64
    if soft == resource.RLIM_INFINITY:
        return 1024
    return max(64, min(1024, soft // 16))


def fingerprint(dataset: TokenDataset) -> str:
    """What a dataset holds, from its metadata.json: layout, model, counts per shard (not where it lies)."""
    meta = dataset.metadata
    what = {
        "layout": meta["layout"],
        "dtype": meta["dtype"],
        "seq_len": meta["seq_len"],
        "strategy": meta.get("strategy"),
        "model": {key: meta["model"].get(key) for key in ("sha256", "vocab_size", "bos_id", "eos_id", "pad_id")},
        "shards": [
            [shard["name"], shard.get("documents"), shard.get("tokens"), shard.get("rows")] for shard in meta["shards"]
        ],
    }
    if meta.get("loss_mask"):  # only then: the fingerprints of datasets without masks stay what they were
        what["loss_mask"] = meta["loss_mask"].get("input")
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


DIGEST_SAMPLES = 16
"""Blocks of each ``.bin`` read into a source's content digest (besides its first and last): a sample, not all ids."""
DIGEST_BLOCK = 1 << 16


def content_digest(dataset: TokenDataset) -> str:
    """What a dataset's files hold, not only what metadata.json says: a hash of every shard's ``.idx`` and ``.seg``
    (where each document or segment starts) and of each ``.bin``'s (and any other shard file's, ``SHARD_SUFFIXES``)
    size and 18 blocks spread over it. A dataset rewritten in place with the same counts (documents reordered) gets
    another digest; a copy elsewhere, the same.
    Reads the 8 bytes a document of the indexes (about 30 ms a million documents, page cache warm) and 1 MiB a shard."""
    digest = hashlib.blake2b(digest_size=16)
    for shard in dataset.metadata["shards"]:
        base = dataset.path / shard["name"]
        for file in (base.with_name(base.name + suffix) for suffix in SHARD_SUFFIXES):
            try:
                handle = file.open("rb")
            except FileNotFoundError:
                digest.update(f"{file.name}:-;".encode())
                continue
            with handle:
                size = os.fstat(handle.fileno()).st_size
                digest.update(f"{file.name}:{size};".encode())
                if file.suffix in (IDX_SUFFIX, SEG_SUFFIX):  # whole; the ids (and any other file) sampled
                    while block := handle.read(1 << 20):
                        digest.update(block)
                    continue
                places = np.linspace(0, max(0, size - DIGEST_BLOCK), DIGEST_SAMPLES + 2).astype(np.int64)
                for place in sorted(set(places.tolist())):
                    handle.seek(place)
                    digest.update(handle.read(DIGEST_BLOCK))
    return digest.hexdigest()


def check_one_tokenizer(sources: Mapping[str, TokenDataset]) -> None:
    """ValueError naming the sources and their models unless every source was tokenized by the same model
    (sha256 and vocabulary size): the same id means another token in another vocabulary."""
    groups: dict[tuple[Any, Any], list[str]] = {}
    for name, dataset in sources.items():
        model = dataset.model
        groups.setdefault((model.get("sha256"), model.get("vocab_size")), []).append(name)
    if len(groups) < 2:
        return
    described = []
    for (sha256, vocab), names in groups.items():
        model = sources[names[0]].model
        size = f"{vocab:,}" if isinstance(vocab, int) else repr(vocab)
        described.append(
            f"{', '.join(map(repr, names))}: model {model.get('name')!r} (sha256 {str(sha256)[:12]}, vocab {size})"
        )
    raise ValueError(
        "a mixture's sources must share one tokenizer, these were made by other tokenizers (the same id is another "
        f"token in each): {'; '.join(described)}"
    )


class _Source:
    """One named dataset of a mixture: its rows j, j + 1, ... of the endless stream, read on demand."""

    def __init__(self, name: str, dataset: TokenDataset, seq_len: int, seed: int, cache_dir: Path | None) -> None:
        self.name = name
        self.dataset = dataset
        self.seq_len = seq_len
        self.seed = seed
        self.cache_dir = cache_dir
        self.fingerprint = fingerprint(dataset)
        self.contents = content_digest(dataset)
        self.packed = dataset.layout == "packed"
        self.masked = dataset.masked  # loss masks (.mask): labels -100 where the mask is 0
        shards = dataset.metadata["shards"]
        counts = [int(shard["rows"] if self.packed else shard["documents"]) for shard in shards]
        sizes = [int(shard["rows"]) * seq_len if self.packed else int(shard["tokens"]) for shard in shards]
        self._names = [shard["name"] for shard in shards]
        self._counts = counts
        self._id_starts = [0, *np.cumsum(sizes, dtype=np.int64).tolist()]
        self._id_starts_array = np.asarray(self._id_starts, np.int64)
        self._count_starts = [0, *np.cumsum(counts, dtype=np.int64).tolist()]
        self.items = self._count_starts[-1]  # documents or rows
        self.tokens = self._id_starts[-1]
        if self.packed and dataset.seq_len != seq_len:
            raise ValueError(f"source {name!r}: packed rows of {dataset.seq_len}, the mixture's seq_len is {seq_len}")
        if self.items == 0 or self.tokens == 0:
            raise ValueError(f"source {name!r} ({dataset.path}) holds no {'rows' if self.packed else 'ids'}")
        self._maps: OrderedDict[int, Shard] = OrderedDict()
        self._limit = _open_limit()
        self._documents: np.ndarray | None = None  # ragged: where each document starts in all ids, and the end
        self._epochs: OrderedDict[int, tuple[np.ndarray, np.ndarray | None]] = OrderedDict()

    def shard(self, index: int) -> Shard:
        shard = self._maps.get(index)
        if shard is not None:
            self._maps.move_to_end(index)
            return shard
        count = self._counts[index]
        num_ids = self._id_starts[index + 1] - self._id_starts[index]
        layout = LAYOUT_PACKED if self.packed else LAYOUT_RAGGED
        expected = IndexHeader(layout, self.dataset.dtype.itemsize, self.seq_len if self.packed else 0, count, num_ids)
        shard = read_shard(self.dataset.path / self._names[index], self.dataset.dtype, expected, self.masked)
        self._maps[index] = shard
        if len(self._maps) > self._limit:
            self._maps.popitem(last=False)
        return shard

    # index arrays, cached in memory (the last two epochs) and, with cache_dir, on disk

    def _cached(self, what: str, build: Any) -> np.ndarray:
        if self.cache_dir is None or self.items < CACHE_FROM_ITEMS:
            array: np.ndarray = build()
            return array
        path = self.cache_dir / f"{self.name_tag}-{what}.npy"
        try:
            cached: np.ndarray = np.load(path, mmap_mode="r")
            return cached
        except FileNotFoundError:
            pass
        array = build()
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=self.cache_dir, suffix=".tmp", delete=False) as file:
            np.save(file, array)
        os.replace(file.name, path)
        return array

    @property
    def name_tag(self) -> str:
        return f"{self.fingerprint}-{self.contents[:16]}-{_name_key(self.name):016x}-{self.seed}"

    def documents(self) -> np.ndarray:
        """Ragged: int64 start of each document in all ids end to end, then the total."""
        if self._documents is None:

            def build() -> np.ndarray:
                parts = [self.shard(i).offsets[:-1] + self._id_starts[i] for i in range(len(self._names))]
                return np.concatenate([*parts, np.array([self.tokens], np.int64)]).astype(np.int64)

            self._documents = self._cached("documents", build)
        return self._documents

    def epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray | None]:
        """The epoch's order of items and (ragged) the cumulative lengths in that order, starting at 0."""
        found = self._epochs.get(epoch)
        if found is not None:
            return found
        order = self._cached(f"epoch{epoch}-order", lambda: epoch_permutation(self.items, self.seed, self.name, epoch))
        ends = None
        if not self.packed:
            documents = self.documents()

            def build() -> np.ndarray:
                lengths = np.diff(documents)[order]
                return np.concatenate([np.zeros(1, np.int64), np.cumsum(lengths, dtype=np.int64)])

            ends = self._cached(f"epoch{epoch}-ends", build)
        self._epochs[epoch] = (order, ends)
        if len(self._epochs) > 2:
            self._epochs.popitem(last=False)
        return order, ends

    # rows

    def ragged_ids(
        self, firsts: np.ndarray, counts: np.ndarray, out: np.ndarray, mask_out: np.ndarray | None = None
    ) -> np.ndarray:
        """Ids of the runs of rows ``firsts[i]`` to ``firsts[i] + counts[i]`` end to end into `out` (int32),
        and the increasing positions in `out` where documents start (int64). Counts are positive. `mask_out`
        (a masked source): their loss mask, likewise."""
        length = self.seq_len
        begin = firsts * length  # each run: ids [begin, end) of the endless stream
        end = (firsts + counts) * length
        # the runs cut at epoch ends: pieces [low, high) of the stream, each inside one epoch
        first_epoch = begin // self.tokens
        epochs = (end - 1) // self.tokens - first_epoch + 1
        if int(epochs.max()) == 1:
            epoch, low, high = first_epoch, begin, end
        else:
            epoch = _runs(first_epoch, epochs)
            run = np.repeat(_arange(epochs.size, np.int64), epochs)
            low = np.maximum(begin[run], epoch * self.tokens)
            high = np.minimum(end[run], (epoch + 1) * self.tokens)
        placed = np.cumsum(high - low) - (high - low)  # where each piece goes in `out`
        documents = self.documents()
        cuts = [0, *(np.flatnonzero(epoch[1:] != epoch[:-1]) + 1).tolist(), epoch.size]
        froms, takes, document_starts = [], [], []
        for a, b in itertools.pairwise(cuts):  # once an epoch the pieces are in
            order, ends = self.epoch(int(epoch[a]))
            assert ends is not None
            offset = low[a:b] - int(epoch[a]) * self.tokens  # the pieces [offset, stop) of the epoch's ids
            stop = offset + (high[a:b] - low[a:b])
            # a piece holds (some ids of) documents first to last of the epoch's order: ends[first] <= offset <
            # ends[first + 1], ends[last] < stop <= ends[last + 1]
            first = ends.searchsorted(offset, "right") - 1
            many = ends.searchsorted(stop - 1, "right") - first
            items = _runs(first, many)
            piece = np.repeat(_arange(b - a, np.int64), many)
            starts, finishes = ends[items], ends[items + 1]
            since = np.maximum(starts, offset[piece])
            take = np.minimum(finishes, stop[piece]) - since
            froms.append(documents[order[items]] + (since - starts))
            takes.append(take)
            inside = (starts >= offset[piece]) & (take > 0)  # documents that start in the piece (not empty ones)
            document_starts.append((starts - offset[piece] + placed[a:b][piece])[inside])
        all_froms = froms[0] if len(froms) == 1 else np.concatenate(froms)
        all_takes = takes[0] if len(takes) == 1 else np.concatenate(takes)
        self._gather(out, all_froms, all_takes)
        if mask_out is not None:
            self._gather(mask_out, all_froms, all_takes, "mask")
        if len(froms) == 1:
            found: np.ndarray = document_starts[0]
            return found
        return np.concatenate(document_starts)

    def _gather(self, out: np.ndarray, froms: np.ndarray, takes: np.ndarray, field: str = "ids") -> None:
        """Fill `out` with the pieces ``ids[froms[i] : froms[i] + takes[i]]`` of all ids, end to end (`field`
        "mask": of the loss mask)."""
        keep = takes > 0  # empty documents (one may start where the last shard ends: no shard holds it)
        if not keep.all():
            froms, takes = froms[keep], takes[keep]
        id_starts = self._id_starts_array
        shards = np.searchsorted(id_starts, froms, "right") - 1  # a document never spans two shards
        local = froms - id_starts[shards]
        if shards[0] == shards[-1] and (shards == shards[0]).all():  # one shard: most batches of most datasets
            _copy(out, getattr(self.shard(int(shards[0])), field), local, takes)
            return
        if takes.size * _PIECE_IDS <= out.size:  # long pieces: a slice each
            self._slices(out, shards, local, takes, field)
            return
        order = np.argsort(shards, kind="stable")
        grouped = shards[order]
        cuts = [0, *(np.flatnonzero(grouped[1:] != grouped[:-1]) + 1).tolist(), order.size]
        if (len(cuts) - 1) * _PIECES_A_SHARD > order.size:  # most pieces from shards of their own: a slice each
            self._slices(out, shards, local, takes, field)
            return
        # short pieces from a few shards: each shard's pieces end to end into `staged`, then one gather in order
        # (numpy gathers faster than it scatters)
        staged = np.empty(out.size, out.dtype)
        sizes = takes[order]
        ends = np.cumsum(sizes)
        for low, high in itertools.pairwise(cuts):
            begin = int(ends[low]) - int(sizes[low])
            _copy(
                staged[begin : int(ends[high - 1])],
                getattr(self.shard(int(grouped[low])), field),
                local[order[low:high]],
                sizes[low:high],
            )
        placed = np.empty_like(takes)
        placed[order] = ends - sizes  # where each piece lies in `staged`
        np.take(staged, _runs(placed, takes), out=out)

    def _slices(
        self, out: np.ndarray, shards: np.ndarray, froms: np.ndarray, takes: np.ndarray, field: str = "ids"
    ) -> None:
        """Fill `out` with the pieces ``shard(shards[i]).ids[froms[i] : froms[i] + takes[i]]`` end to end."""
        targets = np.cumsum(takes) - takes
        pieces = zip(shards.tolist(), froms.tolist(), targets.tolist(), takes.tolist(), strict=True)
        for shard, source, target, take in pieces:
            out[target : target + take] = getattr(self.shard(shard), field)[source : source + take]

    def packed_rows(self, numbers: np.ndarray, out: np.ndarray, mask_out: np.ndarray | None = None) -> list[np.ndarray]:
        """Rows `numbers` of the stream: their ids into `out` ([len(numbers), seq_len] int32), their cu_seqlens
        (and, `mask_out`, their loss masks)."""
        length = self.seq_len
        cu_seqlens = []
        for i, number in enumerate(numbers.tolist()):  # a row is long: a slice each
            epoch, place = divmod(number, self.items)
            row = int(self.epoch(epoch)[0][place])
            shard_index = bisect.bisect_right(self._count_starts, row) - 1
            local = row - self._count_starts[shard_index]
            shard = self.shard(shard_index)
            assert shard.seg is not None
            out[i] = shard.ids[local * length : (local + 1) * length]
            if mask_out is not None and shard.mask is not None:
                mask_out[i] = shard.mask[local * length : (local + 1) * length]
            cu_seqlens.append(shard.seg[shard.offsets[local] : shard.offsets[local + 1]])
        return cu_seqlens


# ---------------------------------------------------------------------------------------------------------
# The mixture, its batches, the loader and the state.


@dataclass(frozen=True, eq=False)
class MixtureBatch:
    """Rows of a mixture: numpy arrays, or torch tensors from :meth:`Mixture.torch`.

    ``index`` is the global batch number and ``state`` the state to resume after this batch (from a loader
    or the torch dataset; None from :meth:`Mixture.rows`). ``sources`` are indexes into ``Mixture.names``.
    """

    input_ids: Any  # [rows, seq_len] int32
    labels: Any  # [rows, seq_len] int32, -100 where no loss is taken (best_fit padding; where a loss mask is 0)
    position_ids: Any  # [rows, seq_len] int32, restarting at each segment
    cu_seqlens: list[Any]  # per row: [0, end of segment 1, ..., end of last segment] int32
    sources: Any  # [rows] int32
    index: int | None = None
    state: dict[str, Any] | None = None

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_tokens(self) -> int:
        """Ids in the rows that are not padding."""
        return int(sum(int(row[-1]) for row in self.cu_seqlens))

    def as_torch(self, pin_memory: bool = False) -> MixtureBatch:
        """The same batch with int32 torch tensors in place of its arrays (imports torch)."""
        from tokenizer_client._torch import tensors

        input_ids, labels, position_ids, sources, *cu_seqlens = tensors(
            [self.input_ids, self.labels, self.position_ids, self.sources, *self.cu_seqlens], pin_memory
        )
        return dataclasses.replace(
            self, input_ids=input_ids, labels=labels, position_ids=position_ids, sources=sources, cu_seqlens=cu_seqlens
        )

    def pin_memory(self) -> MixtureBatch:
        """The batch in pinned memory (what DataLoader(pin_memory=True) calls); needs an accelerator."""
        return self.as_torch(pin_memory=True)


def _positive(value: Any, name: str, minimum: int = 1) -> int:
    if isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if number < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {number}")
    return number


class Mixture:
    """Weighted, shuffled, endless rows of several pre-tokenized datasets; see the module docstring.

    ``sources`` maps a name to a :class:`~tokenizer_client.dataset.TokenDataset`; ``weights`` maps the same names to
    positive numbers (relative; default: each source's ids, so every source runs its epochs at the same
    pace). ``seed`` orders each source's epochs. ``cache_dir``, when given, keeps the index arrays of ragged
    sources (and epoch orders) between runs; it must not lie inside a dataset.
    """

    def __init__(
        self,
        sources: Mapping[str, TokenDataset],
        *,
        weights: Mapping[str, Weight] | None = None,
        seq_len: int,
        seed: int = 0,
        cache_dir: str | Path | None = None,
    ) -> None:
        if not isinstance(sources, Mapping) or not sources:
            raise ValueError("sources must be a non-empty mapping of names to TokenDataset")
        for name, dataset in sources.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"source names must be non-empty strings, got {name!r}")
            if not isinstance(dataset, TokenDataset):
                raise ValueError(f"source {name!r} must be a TokenDataset, got {type(dataset).__name__}")
        self.names: tuple[str, ...] = tuple(sources)
        self.seq_len = _positive(seq_len, "seq_len")
        self.seed = _positive(seed, "seed", minimum=0)
        self.cache_dir = None if cache_dir is None else Path(cache_dir).expanduser()
        if self.cache_dir is not None:
            where = self.cache_dir.resolve()
            for name, dataset in sources.items():
                if where.is_relative_to(dataset.path.resolve()):
                    raise ValueError(f"cache_dir {self.cache_dir} is inside source {name!r}'s directory {dataset.path}")
        check_one_tokenizer(sources)
        for dataset in sources.values():  # a source at a URL: every shard into its cache (all are read)
            dataset.fetch()
        self._sources = [_Source(name, sources[name], self.seq_len, self.seed, self.cache_dir) for name in self.names]
        if weights is None:
            weights = {source.name: source.tokens for source in self._sources}
        if not isinstance(weights, Mapping):
            raise ValueError(f"weights must map source names to numbers, got {type(weights).__name__}")
        missing = [name for name in self.names if name not in weights]
        extra = [name for name in weights if name not in sources]
        if missing or extra:
            raise ValueError(f"weights and sources differ: no weight for {missing}, weights for unknown {extra}")
        for name in self.names:
            try:
                _fraction(weights[name])
            except ValueError as exc:
                raise ValueError(f"weight of {name!r}: {exc}") from None
        self.blend = Blend(exact_weights([weights[name] for name in self.names]))
        self._given_weights = dict(weights)
        self._identity: dict[str, Any] = {
            "seq_len": self.seq_len,
            "seed": self.seed,
            "sources": {source.name: source.fingerprint for source in self._sources},
            "contents": {source.name: source.contents for source in self._sources},
            "weights": {name: str(weight) for name, weight in self.weights.items()},
        }

    @property
    def weights(self) -> dict[str, Fraction]:
        """The exact weights used: each source gives ``weight`` of the rows, within one row at every prefix."""
        return {name: Fraction(p, self.blend.period) for name, p in zip(self.names, self.blend.numerators, strict=True)}

    def __repr__(self) -> str:
        weights = ", ".join(f"{name}: {weight}" for name, weight in self.weights.items())
        return f"Mixture({weights}; seq_len={self.seq_len}, seed={self.seed})"

    # pickling by arguments: the datasets pickle by path, index arrays are built (or read) again
    def __getstate__(self) -> dict[str, Any]:
        return {
            "sources": {source.name: source.dataset for source in self._sources},
            "weights": self._given_weights,
            "seq_len": self.seq_len,
            "seed": self.seed,
            "cache_dir": self.cache_dir,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(  # type: ignore[misc]
            state["sources"],
            weights=state["weights"],
            seq_len=state["seq_len"],
            seed=state["seed"],
            cache_dir=state["cache_dir"],
        )

    def rows(self, start: int, stop: int) -> MixtureBatch:
        """Global rows ``start`` to ``stop`` (any, in any order of calls: nothing depends on what came before)."""
        if not 0 <= start <= stop:
            raise ValueError(f"rows [{start}, {stop}) are not a range of non-negative row numbers")
        return self._read([(start, stop)])

    def _read(self, ranges: Sequence[tuple[int, int]]) -> MixtureBatch:
        """Global rows of the ranges ``[start, stop)`` end to end, in one read: the rows of ``rows(start, stop)``
        of each, concatenated. Ranges must not overlap (a source's rows are read once, in any order)."""
        merged: list[list[int]] = []  # ranges that continue the one before are one range
        for start, stop in ranges:
            if not 0 <= start <= stop:
                raise ValueError(f"rows [{start}, {stop}) are not a range of non-negative row numbers")
            if start == stop:
                continue
            if merged and merged[-1][1] == start:
                merged[-1][1] = stop
            else:
                merged.append([start, stop])
        count, length = sum(stop - start for start, stop in merged), self.seq_len
        if len(merged) == 1:
            numbers = np.arange(merged[0][0], merged[0][1], dtype=np.int64)
        else:
            starts = np.array([start for start, _ in merged], np.int64)
            numbers = _runs(starts, np.array([stop for _, stop in merged], np.int64) - starts) if merged else starts
        groups: list[tuple[int, np.ndarray, np.ndarray | None]] = []  # source, its rows, where in the batch (None: all)
        if len(self._sources) == 1:
            sources = np.zeros(count, np.int32)
            if count:
                groups = [(0, numbers, None)]
        else:
            sources, local = self.blend.of(numbers)
            if not count:
                pass
            elif sources[0] == sources[-1] and (sources == sources[0]).all():
                groups = [(int(sources[0]), local, None)]
            else:
                for source in np.unique(sources).tolist():
                    mine = np.flatnonzero(sources == source)
                    groups.append((source, local[mine], mine))
        ids = np.empty((count, length), np.int32)
        # sources with loss masks: each id's mask (1 for the ids of sources without one), labels -100 where 0
        masks = np.ones((count, length), np.uint8) if any(self._sources[s].masked for s, _, _ in groups) else None
        used: np.ndarray | None = None
        inside = []  # flat positions in the batch where segments start inside a row (not at its start)
        for source, rows, where in groups:
            reader = self._sources[source]
            together = where is None or where[-1] - where[0] + 1 == where.size
            out_mask = None
            if together:
                low = 0 if where is None else int(where[0])
                out = ids[low : low + rows.size]
                if reader.masked and masks is not None:
                    out_mask = masks[low : low + rows.size]
            else:
                out = np.empty((rows.size, length), np.int32)
                if reader.masked:
                    out_mask = np.empty((rows.size, length), np.uint8)
            if reader.packed:
                bounds = reader.packed_rows(rows, out, out_mask)
                if used is None:
                    used = np.full(count, length, np.int64)
                used[slice(None) if where is None else where] = [int(b[-1]) for b in bounds]
                starts = np.concatenate([b[1:-1] + row * length for row, b in enumerate(bounds)], dtype=np.int64)
            else:
                breaks = np.flatnonzero(rows[1:] != rows[:-1] + 1) + 1  # runs of consecutive rows of the source
                firsts = np.concatenate([[0], breaks])
                counts = np.diff(np.concatenate([firsts, [rows.size]]))
                starts = reader.ragged_ids(
                    rows[firsts], counts, out.reshape(-1), None if out_mask is None else out_mask.reshape(-1)
                )
                starts = starts[starts % length != 0]
            if where is not None:
                if together:
                    starts += int(where[0]) * length
                else:
                    ids[where] = out
                    if out_mask is not None and masks is not None:
                        masks[where] = out_mask
                    row = starts // length
                    starts += (where[row] - row) * length
            inside.append(starts)
        flat_starts = np.concatenate([np.arange(0, count * length, length, dtype=np.int64), *inside])
        if any(starts.size for starts in inside):
            flat_starts.sort()
        fields = row_fields(ids, flat_starts, used)
        if masks is not None:
            fields.labels[masks == 0] = IGNORE_INDEX
        return MixtureBatch(fields.input_ids, fields.labels, fields.position_ids, fields.cu_seqlens, sources)

    def state_dict(self, rows: int = 0, global_batch_size: int = 1) -> dict[str, Any]:
        """The state of a reader of this mixture that has consumed `rows` global rows."""
        return {
            "format": STATE_FORMAT,
            "version": STATE_VERSION,
            "rows": rows,
            "global_batch_size": global_batch_size,
            **self._identity,
        }

    def position(self, state: Mapping[str, Any] | None, global_batch_size: int) -> int:
        """Global rows consumed according to `state` (0 for None); ValueError naming what differs from this one."""
        if state is None:
            return 0
        if not isinstance(state, Mapping) or state.get("format") != STATE_FORMAT:
            raise ValueError(f"not a mixture state (format {STATE_FORMAT!r}): {str(state)[:200]}")
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"mixture state version {state.get('version')}, this reader knows {STATE_VERSION}")
        differences = []
        sources, mine = dict(state.get("sources") or {}), self._identity["sources"]
        if list(sources) != list(mine):
            differences.append(f"sources {list(sources)} in the state, {list(mine)} here")
        else:
            differences += [
                f"source {name!r} holds other data (fingerprint {sources[name]} in the state, {mine[name]} here)"
                for name in mine
                if sources[name] != mine[name]
            ]
            contents = state.get("contents")  # absent from a state saved before it was recorded: not checked
            if isinstance(contents, Mapping):
                differences += [
                    f"source {name!r} holds other data (its shards' contents differ from those the state was saved "
                    f"on: {contents.get(name)} in the state, {digest} here; rewritten in place?)"
                    for name, digest in self._identity["contents"].items()
                    if sources[name] == mine[name] and contents.get(name) != digest
                ]
            theirs, ours = dict(state.get("weights") or {}), self._identity["weights"]
            differences += [
                f"weight of {name!r} {theirs.get(name)} in the state, {ours[name]} here"
                for name in ours
                if theirs.get(name) != ours[name]
            ]
        for key in ("seq_len", "seed"):
            if state.get(key) != self._identity[key]:
                differences.append(f"{key} {state.get(key)} in the state, {self._identity[key]} here")
        if state.get("global_batch_size") != global_batch_size:
            differences.append(
                f"global batch size (batch_size x world_size) {state.get('global_batch_size')} in the state, "
                f"{global_batch_size} here"
            )
        if differences:
            raise ValueError("cannot resume this mixture from the state: " + "; ".join(differences))
        rows = state.get("rows")
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 0 or rows % global_batch_size:
            raise ValueError(f"state rows {rows!r} is not a whole number of global batches of {global_batch_size}")
        return rows

    def batch(self, index: int, *, rank: int, batch_size: int, world_size: int) -> MixtureBatch:
        """Rank `rank`'s micro-batch of global batch `index`, with the state to resume after it."""
        return self._batches([index], rank=rank, batch_size=batch_size, world_size=world_size)[0]

    def _batches(self, numbers: Sequence[int], *, rank: int, batch_size: int, world_size: int) -> list[MixtureBatch]:
        """Rank `rank`'s micro-batches of the global batches `numbers` (increasing), in one read of all their rows,
        the arrays of each a view of the read's."""
        size = batch_size * world_size
        rows = self._read([(g * size + rank * batch_size, g * size + (rank + 1) * batch_size) for g in numbers])
        batches = [
            MixtureBatch(
                rows.input_ids[low : low + batch_size],
                rows.labels[low : low + batch_size],
                rows.position_ids[low : low + batch_size],
                rows.cu_seqlens[low : low + batch_size],
                rows.sources[low : low + batch_size],
            )
            for low in range(0, len(numbers) * batch_size, batch_size)
        ]
        for number, batch in zip(numbers, batches, strict=True):  # frozen, made here
            batch.__dict__.update(index=number, state=self.state_dict((number + 1) * size, size))
        return batches

    def loader(
        self, *, rank: int = 0, world_size: int = 1, batch_size: int, state: Mapping[str, Any] | None = None
    ) -> MixtureLoader:
        """This rank's micro-batches, in order, from the start or from `state` (any world size of the same G)."""
        return MixtureLoader(self, rank=rank, world_size=world_size, batch_size=batch_size, state=state)

    def torch(
        self, *, rank: int = 0, world_size: int = 1, batch_size: int, state: Mapping[str, Any] | None = None
    ) -> torch.utils.data.IterableDataset[MixtureBatch]:
        """A torch IterableDataset of this rank's micro-batches (imports torch now); see TorchMixture.

        Use it with ``DataLoader(ds, batch_size=None, num_workers=k, pin_memory=True)``, or torchdata's
        ``StatefulDataLoader`` for ``state_dict``/``load_state_dict``: any k gives the same batches in the same order.
        """
        dataset: torch.utils.data.IterableDataset[MixtureBatch] = _torch_class()(
            self, rank=rank, world_size=world_size, batch_size=batch_size, state=state
        )
        return dataset


def _ranks(rank: Any, world_size: Any, batch_size: Any) -> tuple[int, int, int]:
    world_size = _positive(world_size, "world_size")
    rank = _positive(rank, "rank", minimum=0)
    if rank >= world_size:
        raise ValueError(f"rank {rank} is not below world_size {world_size}")
    return rank, world_size, _positive(batch_size, "batch_size")


class _RankBatches:
    """One rank's micro-batches of a mixture, from the start or from `state`: what MixtureLoader and
    TorchMixture share. Batch g of rank r is global rows ``[g * G + r * batch_size, g * G + (r + 1) * batch_size)``
    (G, the global batch size: batch_size x world_size); the state after it is the global position ``(g + 1) * G``,
    the same on every rank."""

    _next: int  # the global batch this rank hands out next

    def __init__(
        self,
        mixture: Mixture,
        *,
        rank: int = 0,
        world_size: int = 1,
        batch_size: int,
        state: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.mixture = mixture
        self.rank, self.world_size, self.batch_size = _ranks(rank, world_size, batch_size)
        self.global_batch_size = self.world_size * self.batch_size
        self.load_state_dict(state)

    def load_state_dict(self, state: Mapping[str, Any] | None) -> None:
        raise NotImplementedError

    def _read_ahead(self) -> int:
        """Micro-batches a read takes: READ_AHEAD_IDS ids of them, at least one."""
        return max(1, READ_AHEAD_IDS // (self.batch_size * self.mixture.seq_len))


class MixtureLoader(_RankBatches):
    """One rank's micro-batches of a mixture, in order: an endless iterator with ``state_dict``.

    It reads :data:`READ_AHEAD_IDS` ids of whole micro-batches at once (each batch's arrays are views of that
    read's); ``load_state_dict`` drops what was read ahead.
    """

    def __iter__(self) -> MixtureLoader:
        return self

    def __next__(self) -> MixtureBatch:
        if not self._ahead:
            numbers = range(self._next, self._next + self._read_ahead())
            self._ahead.extend(
                self.mixture._batches(numbers, rank=self.rank, batch_size=self.batch_size, world_size=self.world_size)
            )
        batch = self._ahead.popleft()
        self._next += 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        return self.mixture.state_dict(self._next * self.global_batch_size, self.global_batch_size)

    def load_state_dict(self, state: Mapping[str, Any] | None) -> None:
        self._next = self.mixture.position(state, self.global_batch_size) // self.global_batch_size
        self._ahead: deque[MixtureBatch] = deque()  # batches read and not yet handed out


@functools.cache
def _torch_class() -> type:
    """Build the torch IterableDataset class on first use, so that importing this module never imports torch."""
    from torch.utils.data import IterableDataset, get_worker_info

    class TorchMixture(_RankBatches, IterableDataset):  # type: ignore[type-arg]
        """One rank's micro-batches of a mixture as torch tensors, for ``DataLoader(batch_size=None)``.

        DataLoader worker w of k builds the batches g with ``(g - first) % k == w`` (``first``: the batch it
        starts at), :data:`READ_AHEAD_IDS` ids of them a read; DataLoader takes batches from its workers in
        turn, so any k hands them out in the order k = 0 does. ``state_dict``/``load_state_dict`` follow
        torchdata's Stateful protocol: in a worker the state says which of its batches the loader has consumed,
        and ``StatefulDataLoader`` (same number of workers) resumes each worker and the turn. The state of a
        batch (``batch.state``) resumes any loader. Every iteration (every loop over a DataLoader) starts at the
        state given, or the start, whatever k: a copy in a worker never tells the dataset where it got to.
        """

        def __iter__(self) -> Any:
            info = get_worker_info()
            worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
            # Every iteration starts at the state given (or the start): a worker's copy never tells the
            # DataLoader's dataset where it got to, so a second loop with k workers starts there again, and so
            # does one with none (it went on from where the first stopped).
            self._next = self._start
            ahead: deque[MixtureBatch] = deque()  # this worker's batches read and not yet handed out
            handed = None  # the batch after the last one handed out
            while True:
                if self._next != handed:  # the start, or a state was loaded: read from there
                    ahead.clear()
                    index = self._next + (worker - (self._next - self._first)) % workers
                if not ahead:
                    numbers = range(index, index + workers * self._read_ahead(), workers)
                    ahead.extend(
                        self.mixture._batches(
                            numbers, rank=self.rank, batch_size=self.batch_size, world_size=self.world_size
                        )
                    )
                    index = numbers.stop
                batch = ahead.popleft()
                assert batch.index is not None
                self._next = handed = batch.index + 1
                yield batch.as_torch()

        def state_dict(self) -> dict[str, Any]:
            size = self.global_batch_size
            return {**self.mixture.state_dict(self._next * size, size), "first": self._first * size}

        def load_state_dict(self, state: Mapping[str, Any] | None) -> None:
            rows = self.mixture.position(state, self.global_batch_size)
            first = (state or {}).get("first", rows)
            if isinstance(first, bool) or not isinstance(first, int) or first % self.global_batch_size:
                raise ValueError(f"state first {first!r} is not a whole number of global batches")
            self._next = self._start = rows // self.global_batch_size  # the start of every iteration from here
            self._first: int = first // self.global_batch_size  # the batch its workers started at

    TorchMixture.__module__ = __name__
    TorchMixture.__qualname__ = "TorchMixture"
    return TorchMixture


__getattr__ = lazy_attributes(__name__, TorchMixture=_torch_class)
