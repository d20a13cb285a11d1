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
import json
import os
import statistics
import subprocess
import time
import unicodedata
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import sentencepiece as spm

from app.tools.launcher import ServerProcess
from client import TokenizerClient

ROOT = Path(__file__).resolve().parent.parent

SHARED_CORPUS = ROOT.parent / "shared" / "corpus" / "python_docs.txt"
# The default where it exists: 10 languages, 71% of its documents not NFKC-normalized, like web text
MULTILINGUAL_CORPUS = ROOT.parent / "shared" / "corpus" / "debian_reference_multilingual.jsonl"
FALLBACK_CORPUS = ROOT / "tests" / "data" / "botchan.txt"
RESULTS = ROOT / "bench" / "results"
BATCH = 256


def default_corpus() -> Path:
    """The multilingual corpus where ../shared has it, else the Python docs, else the repository's Botchan."""
    for corpus in (MULTILINGUAL_CORPUS, SHARED_CORPUS):
        if corpus.exists():
            return corpus
    return FALLBACK_CORPUS


def read_text(corpus: Path) -> str:
    """A text file as it is, or a JSON Lines file's `text` fields separated by blank lines."""
    if corpus.suffix == ".jsonl":
        with corpus.open(encoding="utf-8") as file:
            return "\n\n".join(json.loads(line)["text"] for line in file if line.strip())
    return corpus.read_text(encoding="utf-8", errors="replace")


def not_nfkc(docs: list[str]) -> float:
    """The share of documents that Unicode NFKC normalization would change (web text: most of them)."""
    return sum(not unicodedata.is_normalized("NFKC", doc) for doc in docs) / max(len(docs), 1)


def load_documents(corpus: Path, count: int) -> list[str]:
    """Paragraphs (blank-line separated; lines for texts without blank lines) joined into 1-2 KB documents."""
    text = read_text(corpus)
    paragraphs = [p.strip() for p in text.split("\n\n") if p.strip()]
    if len(paragraphs) < 100:
        paragraphs = [line.strip() for line in text.splitlines() if line.strip()]
    documents: list[str] = []
    current: list[str] = []
    size = 0
    target = 1024
    for paragraph in paragraphs:
        current.append(paragraph)
        size += len(paragraph) + 2
        if size >= target:
            documents.append("\n\n".join(current)[:2048])
            current, size = [], 0
            target = 1024 + (len(documents) * 397) % 1024
            if len(documents) == count:
                break
    while len(documents) < count:  # a small corpus: repeat it
        documents.extend(documents[: count - len(documents)])
    return documents


def bench_model(corpus: Path, vocab_size: int = 32000) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    prefix = RESULTS / f"bench-unigram-{vocab_size // 1000}k-{corpus.stem}"
    model = prefix.with_suffix(".model")
    if not model.exists():
        print(f"training a {vocab_size // 1000}k unigram model on {corpus.name} (once) ...", flush=True)
        if corpus.suffix == ".jsonl":
            plain = prefix.with_suffix(".txt")
            plain.write_text(read_text(corpus), encoding="utf-8")
            corpus = plain
        spm.SentencePieceTrainer.train(
            input=str(corpus),
            model_prefix=str(prefix),
            model_type="unigram",
            vocab_size=vocab_size if corpus.stat().st_size > 2_000_000 else 4000,
            input_sentence_size=2_000_000,
            shuffle_input_sentence=True,
            num_threads=os.cpu_count() or 1,
            minloglevel=2,
        )
    return model


def start_server(model: Path, workers: int, *extra: str) -> tuple[str, subprocess.Popen[bytes]]:
    """A server on a free loopback port serving `model` as "bench" (app.tools.launcher, as the tests start theirs)."""
    args = ["--workers", str(workers), "--model", f"bench={model}", "--log-level", "warning", *extra]
    server = ServerProcess(args).start(timeout=120)
    assert server.process is not None
    return server.url, server.process


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
    docs = load_documents(args.corpus, args.docs)
    model = args.model or bench_model(args.corpus)
    sp = spm.SentencePieceProcessor(model_file=str(model))
    total_chars = sum(len(d) for d in docs)
    print(
        f"corpus {args.corpus.name}: {len(docs)} documents, mean {total_chars / len(docs):.0f} chars, "
        f"{not_nfkc(docs):.0%} not NFKC-normalized; "
        f"model {model.name} (vocab {sp.vocab_size()}); {cores} cores",
        flush=True,
    )

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
            seconds: dict[str, list[float]] = {name: [] for name in methods}
            tokens: dict[str, int] = {}
            for round_index in range(args.rounds):
                for name, run in methods.items():
                    started = time.perf_counter()
                    tokens[name] = run()
                    seconds[name].append(time.perf_counter() - started)
                print(f"round {round_index + 1}/{args.rounds} done", flush=True)

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
