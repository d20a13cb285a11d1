"""Throughput of the service against in-process sentencepiece, measured in one run.

    python -m bench.throughput [--corpus FILE.txt|FILE.jsonl] [--docs N] [--rounds R] [--model FILE]

Methods, on the same 1-2 KB documents, in alternating rounds (machines drift; the median ratio of
each round is reported):
  loop        for text in docs: sp.encode(text)
  baseline    sp.encode(docs, num_threads=cores)                      (what users know)
  floor       sp.encode(docs, num_threads=cores, out_type="numpy")    (the compute floor)
  service     TokenizerClient, 256 documents a request, 1 and 2 in flight, binary and JSON
plus single-text request latency (p50, p99). Starts its own server on a free loopback port.
Without --model it trains a 32k unigram model on the corpus (cached under bench/results/). The corpus
defaults to the shared multilingual one where it exists (a JSON Lines file's `text` fields are cut into
paragraphs and joined into 1-2 KB documents); its share of non-NFKC documents is printed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import sentencepiece as spm

from bench.inputs import default_corpus, describe_corpus, documents_and_model, start_server
from tokenizer_client import TokenizerClient
from tokenizer_service.tools.bench import alternate

BATCH = 256


def service_run(client: TokenizerClient, docs: list[str], in_flight: int, format: str) -> Callable[[], int]:
    batches = [docs[i : i + BATCH] for i in range(0, len(docs), BATCH)]

    def one(batch: list[str]) -> int:
        if format == "binary":
            return client.tokenize_batch(batch, model="bench").num_tokens
        return client.tokenize_batch(batch, model="bench", format="json").num_tokens

    def run() -> int:
        if in_flight == 1:
            return sum(one(batch) for batch in batches)
        with ThreadPoolExecutor(in_flight) as pool:
            return sum(pool.map(one, batches))

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", type=Path, default=default_corpus(), help=".txt or .jsonl (default: multilingual)")
    parser.add_argument("--docs", type=int, default=10000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--model", type=Path, help="a SentencePiece model (default: train one on the corpus)")
    parser.add_argument("--latency-requests", type=int, default=2000)
    args = parser.parse_args()

    cores = len(os.sched_getaffinity(0))
    docs, model = documents_and_model(args.corpus, args.docs, args.model)
    sp = spm.SentencePieceProcessor(model_file=str(model))
    describe_corpus(args.corpus, docs, f"model {model.name} (vocab {sp.vocab_size()})", f"{cores} cores")

    url, server = start_server(model, cores)
    try:
        with TokenizerClient(url, timeout=120) as client:
            client.tokenize_batch(docs[:BATCH], model="bench")  # warm connections and workers
            methods: dict[str, Callable[[], int]] = {
                "loop of sp.encode(text)": lambda: sum(len(sp.encode(d)) for d in docs),
                f"sp.encode(list, num_threads={cores})": lambda: sum(
                    len(x) for x in sp.encode(docs, num_threads=cores)
                ),
                f"sp.encode(list, num_threads={cores}, numpy)": lambda: sum(
                    len(x) for x in sp.encode(docs, num_threads=cores, out_type="numpy")
                ),
                "service binary, 1 in flight": service_run(client, docs, 1, "binary"),
                "service binary, 2 in flight": service_run(client, docs, 2, "binary"),
                "service JSON, 1 in flight": service_run(client, docs, 1, "json"),
                "service JSON, 2 in flight": service_run(client, docs, 2, "json"),
            }
            baseline_name = f"sp.encode(list, num_threads={cores})"
            floor_name = f"sp.encode(list, num_threads={cores}, numpy)"
            seconds, tokens = alternate(
                methods, args.rounds, lambda done: print(f"round {done}/{args.rounds} done", flush=True)
            )

            latencies = []
            single = docs[: args.latency_requests]
            for text in single:
                started = time.perf_counter()
                client.tokenize_batch([text], model="bench")
                latencies.append(time.perf_counter() - started)
    finally:
        server.terminate()
        server.wait(timeout=30)

    expected = tokens[baseline_name]
    assert all(count == expected for count in tokens.values()), f"token counts differ: {tokens}"
    print()
    print("| method | docs/s | M tokens/s | vs baseline | vs floor |")
    print("|---|---:|---:|---:|---:|")
    for name in methods:
        best = min(seconds[name])
        ratios_baseline = [b / s for s, b in zip(seconds[name], seconds[baseline_name], strict=False)]
        ratios_floor = [f / s for s, f in zip(seconds[name], seconds[floor_name], strict=False)]
        print(
            f"| {name} | {len(docs) / best:,.0f} | {tokens[name] / best / 1e6:.2f} | "
            f"{statistics.median(ratios_baseline):.2f} | {statistics.median(ratios_floor):.2f} |"
        )
    lat = np.array(latencies) * 1000
    print()
    print(
        f"single-text request latency over {len(lat)} requests: p50 {np.percentile(lat, 50):.2f} ms, "
        f"p99 {np.percentile(lat, 99):.2f} ms"
    )
    print("(docs/s and tokens/s: best round; ratios: median over rounds of per-round time ratios)")


if __name__ == "__main__":
    main()
