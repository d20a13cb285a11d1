"""Reading a Mixture: M tokens/s of training rows from a warm page cache, in one process.

    python -m bench.mixture [--tokens N] [--seq-len L] [--batch-size B] [--seconds S] [--dir DIR]

Writes three pre-tokenized datasets of about N/3 ids each (uint16, 64 MiB-ish shards) into DIR (default a
temporary directory, removed at the end), reads every file once so the page cache is warm, then times
``mix.loader(batch_size=B)`` (numpy batches: input_ids, labels, position_ids, cu_seqlens) for S seconds on:

* web: ragged, web-like document lengths (log-normal, median about 450 ids, mean about 800);
* short: ragged, short documents (median about 60 ids): the most pieces a row;
* packed: rows packed at L (best_fit, with padding), as ``tokenizer-pretokenize --seq-len`` writes;
* mixture: all three at weights 0.5 / 0.2 / 0.3.

Document ids are random: what reading costs depends on lengths, not on which ids. Each case reports M
tokens/s (row ids, padding included) per second of wall time and per second of this process's CPU time
(the two differ when other jobs share the cores), and rows/s; the first batch (building the first epoch's
permutation and cumulative lengths) is timed apart. A loader reads ``READ_AHEAD_IDS`` ids of whole
micro-batches at once; the case "mixture, a batch a read" times ``Mixture.batch`` one micro-batch at a time,
and the cases "rank 0 of 8" a loader of rank 0 of world_size 8 (its micro-batches are every eighth of the
global stream's, read ahead several at once). Finally the time to resume at global row 10**9,
which must not replay the stream. The issue's target: >= 50 M tokens/s at L = 2048.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from tokenizer_client.dataset import TokenDataset, write_dataset
from tokenizer_client.mixture import Mixture, MixtureBatch

SHARD_IDS = 1 << 25  # ids a shard holds, at least (64 MiB of uint16)
RANKS = 8  # the world size of the cases "rank 0 of 8"
MODEL = {"name": "bench", "sha256": "0" * 64, "vocab_size": 32000, "bos_id": 1, "eos_id": 2, "pad_id": 0}


def lengths(rng: np.random.Generator, tokens: int, median: float) -> np.ndarray:
    """Document lengths (at least 2: text and EOS) adding up to about `tokens`."""
    drawn = np.maximum(2, rng.lognormal(np.log(median), 1.1, size=int(tokens / (median * 1.8)) + 16).astype(np.int64))
    return drawn[: int(np.searchsorted(np.cumsum(drawn), tokens)) + 1]


def random_dataset(path: Path, sizes: np.ndarray, rng: np.random.Generator, seq_len: int | None = None) -> TokenDataset:
    """A tokenizer-pretokenize output of documents of these lengths (random ids, EOS = 2 last), best_fit rows
    of `seq_len` if given."""
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    ids = rng.integers(3, 32000, int(offsets[-1]), dtype=np.int32)
    ids[offsets[1:] - 1] = 2
    return write_dataset(path, ids, offsets, model=MODEL, seq_len=seq_len, strategy="best_fit", shard_tokens=SHARD_IDS)


def warm(path: Path) -> None:
    for file in path.iterdir():
        with file.open("rb") as handle:
            while handle.read(1 << 24):
                pass


class OneAtATime:
    """Micro-batches of one rank read one at a time (``Mixture.batch``), as with several ranks."""

    def __init__(self, mix: Mixture, batch_size: int) -> None:
        self.mix, self.batch_size, self.index = mix, batch_size, 0

    def __next__(self) -> MixtureBatch:
        self.index += 1
        return self.mix.batch(self.index - 1, rank=0, batch_size=self.batch_size, world_size=1)


def measure(
    mix: Mixture, batch_size: int, seconds: float, one_at_a_time: bool = False, world_size: int = 1
) -> tuple[float, float, float, float]:
    """(seconds for the first batch, M tokens/s of wall time, M tokens/s of this process's CPU time, rows/s) of
    rank 0 of `world_size`."""
    loader: Iterator[MixtureBatch] | OneAtATime = (
        OneAtATime(mix, batch_size) if one_at_a_time else mix.loader(world_size=world_size, batch_size=batch_size)
    )
    began = time.perf_counter()
    next(loader)
    first = time.perf_counter() - began
    rows = 0
    began, cpu = time.perf_counter(), time.process_time()
    while time.perf_counter() - began < seconds:
        for _ in range(16):
            rows += len(next(loader))
    elapsed, cpu = time.perf_counter() - began, time.process_time() - cpu
    tokens = rows * mix.seq_len / 1e6
    return first, tokens / elapsed, tokens / cpu, rows / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=150_000_000, help="ids in all three datasets together")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=8, help="rows a micro-batch")
    parser.add_argument("--seconds", type=float, default=3.0, help="time each case this long")
    parser.add_argument("--dir", type=Path, help="where to write the datasets (default: a temporary directory)")
    args = parser.parse_args()

    root = args.dir or Path(tempfile.mkdtemp(prefix="bench-mixture-"))
    rng = np.random.default_rng(0)
    try:
        began = time.perf_counter()
        third = args.tokens // 3
        sources = {
            "web": random_dataset(root / "web", lengths(rng, third, 450), rng),
            "short": random_dataset(root / "short", lengths(rng, third, 60), rng),
            "packed": random_dataset(root / "packed", lengths(rng, third, 450), rng, seq_len=args.seq_len),
        }
        for dataset in sources.values():
            warm(dataset.path)
        print(f"wrote and read {args.tokens / 1e6:.0f} M ids in {time.perf_counter() - began:.1f} s ({root})")
        for name, dataset in sources.items():
            print(f"  {name}: {dataset!r}")

        cases = {name: Mixture({name: dataset}, seq_len=args.seq_len, seed=1) for name, dataset in sources.items()}
        cases["mixture"] = Mixture(
            sources, weights={"web": 0.5, "short": 0.2, "packed": 0.3}, seq_len=args.seq_len, seed=1
        )
        print(f"\nseq_len {args.seq_len}, batch_size {args.batch_size}, one process, {args.seconds:.0f} s a case\n")
        print("| case | first batch (ms) | M tokens/s | M tokens per CPU second | rows/s |")
        print("|---|---:|---:|---:|---:|")
        for name, mix in cases.items():
            first, wall, cpu, rows = measure(mix, args.batch_size, args.seconds)
            print(f"| {name} | {first * 1e3:.1f} | {wall:.0f} | {cpu:.0f} | {rows:,.0f} |")
        first, wall, cpu, rows = measure(cases["mixture"], args.batch_size, args.seconds, one_at_a_time=True)
        print(f"| mixture, a batch a read | {first * 1e3:.1f} | {wall:.0f} | {cpu:.0f} | {rows:,.0f} |")
        for name in ("web", "mixture"):
            first, wall, cpu, rows = measure(cases[name], args.batch_size, args.seconds, world_size=RANKS)
            print(f"| {name}, rank 0 of {RANKS} | {first * 1e3:.1f} | {wall:.0f} | {cpu:.0f} | {rows:,.0f} |")

        mix = cases["mixture"]
        began = time.perf_counter()
        size = args.batch_size * 4
        loader = mix.loader(
            rank=3, world_size=4, batch_size=args.batch_size, state=mix.state_dict(10**9 // size * size, size)
        )
        next(loader)
        print(f"\nresume at global row 10**9 (4 ranks), first batch: {(time.perf_counter() - began) * 1e3:.1f} ms")
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
