"""Packing through the service, and how much padding each packing strategy leaves.

    python -m bench.pack [--corpus FILE] [--docs N] [--rounds R] [--model FILE] [--texts-per-request N]

Two tables, on the same 1-2 KB documents (built from the corpus by bench/inputs.py):

1. Throughput, tokens/s end to end through a server on a free loopback port, at L = 2048 and 8192:
   /v1/pack concat (one request after another: each needs the previous leftover as its carry),
   /v1/pack best_fit (no carry, 2 requests in flight), and /v1/tokenize (binary, 2 in flight) for
   reference; each against in-process `sp.encode(docs, num_threads=cores)` measured in the same
   rounds. Ratios are the median of per-round ratios.
2. Padding fraction (padding tokens / all row tokens) of best_fit, plain first-fit over the same
   pieces, and one document per row padded to L (documents over L cut into pieces of L), each
   over the whole corpus and per request of --texts-per-request documents, as the server packs.
   concat has no padding by construction.
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import sentencepiece as spm

from bench.inputs import describe_corpus, documents_and_model, python_docs_corpus, start_server
from tokenizer_client import TokenizerClient
from tokenizer_client.packing import first_fit_rows, pack_best_fit, split_pieces
from tokenizer_service.tools.bench import alternate

BENCH = Path(__file__).resolve().parent

SEQ_LENS = (2048, 8192)


def chunks(docs: list[str], size: int) -> list[list[str]]:
    return [docs[i : i + size] for i in range(0, len(docs), size)]


def concat_run(client: TokenizerClient, docs: list[str], seq_len: int, per_request: int) -> Callable[[], int]:
    def run() -> int:
        tokens = 0
        for packed in client.pack_stream(docs, seq_len, texts_per_request=per_request, model="bench"):
            tokens += packed.input_ids.size
        return tokens + packed.leftover.size

    return run


def best_fit_run(client: TokenizerClient, docs: list[str], seq_len: int, per_request: int) -> Callable[[], int]:
    def one(batch: list[str]) -> int:
        return int(client.pack(batch, seq_len, strategy="best_fit", model="bench").stats["tokens"])

    def run() -> int:
        with ThreadPoolExecutor(2) as pool:
            return sum(pool.map(one, chunks(docs, per_request)))

    return run


def tokenize_run(client: TokenizerClient, docs: list[str], per_request: int) -> Callable[[], int]:
    def one(batch: list[str]) -> int:
        return client.tokenize_batch(batch, model="bench", add_eos=True).num_tokens

    def run() -> int:
        with ThreadPoolExecutor(2) as pool:
            return sum(pool.map(one, chunks(docs, per_request)))

    return run


def throughput_table(
    sp: spm.SentencePieceProcessor, client: TokenizerClient, docs: list[str], rounds: int, per_request: int
) -> None:
    cores = len(os.sched_getaffinity(0))
    baseline = f"sp.encode(list, num_threads={cores})"
    methods: dict[str, Callable[[], int]] = {
        baseline: lambda: sum(len(ids) + 1 for ids in sp.encode(docs, num_threads=cores)),
        "service /v1/tokenize, 2 in flight": tokenize_run(client, docs, per_request),
    }
    for seq_len in SEQ_LENS:
        methods[f"service /v1/pack concat L={seq_len}, 1 in flight"] = concat_run(client, docs, seq_len, per_request)
        methods[f"service /v1/pack best_fit L={seq_len}, 2 in flight"] = best_fit_run(
            client, docs, seq_len, per_request
        )
    seconds, tokens = alternate(methods, rounds)
    expected = tokens[baseline]
    assert all(count == expected for count in tokens.values()), f"token counts differ: {tokens}"
    print(f"\nThroughput: {len(docs):,} documents, {expected:,} tokens (with EOS), {rounds} rounds\n")
    print("| method | M tokens/s | vs baseline |")
    print("|---|---:|---:|")
    for name in methods:
        ratio = statistics.median(b / s for s, b in zip(seconds[name], seconds[baseline], strict=True))
        print(f"| {name} | {expected / min(seconds[name]) / 1e6:.2f} | {ratio:.2f} |")


def padding(rows: int, seq_len: int, tokens: int) -> float:
    return 1 - tokens / (rows * seq_len) if rows else 0.0


def padding_table(lengths: np.ndarray, per_request: int, pad_id: int) -> None:
    print(f"\nPadding fraction: {lengths.size:,} documents, mean {lengths.mean():.0f} tokens (with EOS)\n")
    print("| L | packed over | best_fit | first-fit | one document per row |")
    print("|---:|---|---:|---:|---:|")
    for seq_len in SEQ_LENS:
        for label, groups in (
            ("whole corpus", [lengths]),
            (f"requests of {per_request}", [lengths[i : i + per_request] for i in range(0, lengths.size, per_request)]),
        ):
            best = first = single = 0
            for group in groups:
                offsets = np.concatenate([[0], np.cumsum(group)])
                ids = np.zeros(int(offsets[-1]), np.int32)
                best += pack_best_fit(ids, offsets, seq_len, pad_id=pad_id).stats.rows
                pieces = split_pieces(group, seq_len).length
                first += first_fit_rows(pieces, seq_len)
                single += pieces.size
            total = int(lengths.sum())
            print(
                f"| {seq_len} | {label} | {padding(best, seq_len, total):.2%} | {padding(first, seq_len, total):.2%} "
                f"| {padding(single, seq_len, total):.2%} |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", type=Path, default=python_docs_corpus())
    parser.add_argument("--docs", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", type=Path)
    parser.add_argument("--texts-per-request", type=int, default=256)
    args = parser.parse_args()

    docs, model = documents_and_model(args.corpus, args.docs, args.model)
    sp = spm.SentencePieceProcessor(model_file=str(model))
    workers = len(os.sched_getaffinity(0))
    describe_corpus(args.corpus, docs, f"model {model.name}", f"{workers} workers")

    url, process = start_server(model, workers)
    try:
        with TokenizerClient(url) as client:
            throughput_table(sp, client, docs, args.rounds, args.texts_per_request)
    finally:
        process.terminate()
        process.wait(30)

    lengths = np.array([len(ids) + 1 for ids in sp.encode(docs)], dtype=np.int64)
    pad_id = sp.pad_id() if sp.pad_id() >= 0 else sp.eos_id()
    padding_table(lengths, args.texts_per_request, pad_id)


if __name__ == "__main__":
    main()
