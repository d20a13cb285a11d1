"""Pre-tokenization throughput against in-process sentencepiece, measured in one run.

    python -m bench.pretokenize [--corpus FILE] [--docs N] [--rounds R] [--model FILE]
    python -m bench.pretokenize --ranks W [--docs N] [--rounds R]
    python -m bench.pretokenize --peers [--rounds R] [--mb 40] [--fresh] [--model DIR] [--only us,gigatoken,...]

With --peers it compares instead, on a 40 MB Parquet corpus and a 128k byte-level BPE tokenizer.json, the
pre-tokenizer (with its Megatron export) against gigatoken, datatrove and Hugging Face datasets, each installed in
a venv of its own, every tool's ids checked against tokenizers (bench/peers.py says how).

The documents of bench/inputs.py (1-2 KB, from the Python docs corpus) are written to a .jsonl
file once; then, in alternating rounds (the machine drifts; the median of per-round ratios is reported):
  baseline   sp.encode(docs, num_threads=cores)                       (documents already in memory)
  floor      sp.encode(docs, num_threads=cores, out_type="numpy")
  local      tokenizer-pretokenize --local: read the file, tokenize on a pool, write shards (end to end,
             worker start-up included), ragged and with --seq-len 2048 (concat)
  service    tokenizer-pretokenize --url: the same through a server on this machine (client and server
             share the cores)
Targets: local >= 0.8 x baseline, service >= 0.7 x baseline.

With --ranks W it compares instead, on the documents split into 16 files, W ranks of --workers 1 (W
processes at once, as W tasks of a cluster job would run on one machine) with one run of --workers W,
both as command lines, and reports the merge's time (target: ranks >= 0.9 x one run).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import orjson
import sentencepiece as spm

from bench.inputs import ROOT, describe_corpus, documents_and_model, python_docs_corpus, start_server
from tokenizer_client.dataset import TokenDataset
from tokenizer_service.tools.bench import alternate
from tokenizer_service.tools.pretokenize.ranks import merge
from tokenizer_service.tools.pretokenize.run import Options, run

TARGETS = {"pretokenize --local": 0.8, "pretokenize --local --seq-len 2048": 0.8, "pretokenize --url": 0.7}


def write_jsonl(docs: list[str], path: Path) -> None:
    with path.open("wb") as file:
        for doc in docs:
            file.write(orjson.dumps({"text": doc}) + b"\n")


def pretokenize(
    corpus: Path, scratch: Path, cores: int, model: Path | None, url: str | None, seq_len: int | None = None
) -> Callable[[], int]:
    """One end-to-end run into a fresh output directory; returns the tokens it wrote."""

    def go() -> int:
        output = scratch / "out"
        shutil.rmtree(output, ignore_errors=True)
        options = Options(
            inputs=[str(corpus)],
            output=output,
            model="bench" if url else str(model),
            urls=[url] if url else [],
            workers=cores,
            seq_len=seq_len,
        )
        summary = run(options, report_bad=print)
        return int(summary.metadata["tokens"])

    return go


def ranks_versus_one_run(docs: list[str], model: Path, ranks: int, rounds: int) -> None:
    scratch = Path(tempfile.mkdtemp(prefix="bench-ranks-"))
    corpus = scratch / "corpus"
    corpus.mkdir()
    for part in range(16):
        write_jsonl(docs[part::16], corpus / f"part-{part:02d}.jsonl")
    base = [
        sys.executable,
        "-m",
        "tokenizer_service.tools.pretokenize",
        str(corpus),
        "--local",
        "--model",
        str(model),
        "-q",
    ]

    def one_run() -> float:
        shutil.rmtree(scratch / "one", ignore_errors=True)
        started = time.perf_counter()
        subprocess.run([*base, "--workers", str(ranks), "--output", str(scratch / "one")], check=True, cwd=ROOT)
        return time.perf_counter() - started

    def ranked() -> tuple[float, float]:
        shutil.rmtree(scratch / "ranked", ignore_errors=True)
        started = time.perf_counter()
        processes = [
            subprocess.Popen(
                [
                    *base,
                    "--workers",
                    "1",
                    "--rank",
                    str(rank),
                    "--world-size",
                    str(ranks),
                    "--output",
                    str(scratch / "ranked"),
                ],
                cwd=ROOT,
            )
            for rank in range(ranks)
        ]
        if any(process.wait() != 0 for process in processes):
            raise SystemExit("a rank failed")
        ran = time.perf_counter() - started
        started = time.perf_counter()
        merge(scratch / "ranked")
        return ran, time.perf_counter() - started

    try:
        ratios, merges, singles, multis = [], [], [], []
        for round_index in range(rounds):
            single = one_run()
            multi, merging = ranked()
            singles.append(single)
            multis.append(multi)
            merges.append(merging)
            ratios.append(single / multi)
            print(f"round {round_index + 1}/{rounds}: one run {single:.2f} s, {ranks} ranks {multi:.2f} s", flush=True)
        tokens = TokenDataset(scratch / "ranked").num_tokens
        assert tokens == TokenDataset(scratch / "one").num_tokens
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print()
    print("| method | seconds (best) | M tokens/s | vs one run | target |")
    print("|---|---:|---:|---:|---:|")
    print(f"| one run, --workers {ranks} | {min(singles):.2f} | {tokens / min(singles) / 1e6:.2f} | 1.00 | |")
    print(
        f"| {ranks} ranks of --workers 1, merged | {min(multis):.2f} | {tokens / min(multis) / 1e6:.2f} | "
        f"{statistics.median(ratios):.2f} | ≥ 0.9 |"
    )
    print(f"merge: {statistics.median(merges) * 1e3:.1f} ms (median); {len(docs)} documents, {tokens:,} tokens")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", type=Path, default=python_docs_corpus())
    parser.add_argument("--docs", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--model",
        type=Path,
        help="a SentencePiece model (default: train one on the corpus); --peers: a tokenizer.json directory",
    )
    parser.add_argument("--ranks", type=int, help="compare W ranks of --workers 1 with one run of --workers W")
    parser.add_argument(
        "--peers", action="store_true", help="compare with gigatoken, datatrove, datasets (bench/peers.py)"
    )
    parser.add_argument("--mb", type=float, default=40, help="--peers: the corpus's size in MB of text")
    parser.add_argument("--only", default="us,gigatoken,datatrove,datasets", help="--peers: the tools to run")
    parser.add_argument(
        "--fresh", action="store_true", help="--peers: fresh documents from Debian packages (bench/fresh_corpus.py)"
    )
    args = parser.parse_args()
    if args.peers:
        from bench.fresh_corpus import build_fresh_corpus
        from bench.peers import run_peers

        corpus = build_fresh_corpus(args.mb) if args.fresh else None  # else the repeated corpus of --mb
        # --model: a tokenizer.json's directory
        run_peers(args.rounds, args.mb, args.model, args.only.split(","), corpus)
        return
    docs, model = documents_and_model(args.corpus, args.docs, args.model)
    if args.ranks:
        ranks_versus_one_run(docs, model, args.ranks, args.rounds)
        return

    cores = len(os.sched_getaffinity(0))
    sp = spm.SentencePieceProcessor(model_file=str(model))
    scratch = Path(tempfile.mkdtemp(prefix="bench-pretokenize-"))
    corpus = scratch / "corpus.jsonl"
    write_jsonl(docs, corpus)
    size = f"{corpus.stat().st_size / 1e6:.1f} MB of .jsonl"
    describe_corpus(args.corpus, docs, size, f"model {model.name} (vocab {sp.vocab_size()})", f"{cores} cores")
    url, server = start_server(model, cores)
    try:
        baseline = f"sp.encode(list, num_threads={cores})"
        methods: dict[str, Callable[[], int]] = {
            # + one EOS a document, as the pre-tokenizer stores them by default
            baseline: lambda: sum(len(x) for x in sp.encode(docs, num_threads=cores)) + len(docs),
            f"sp.encode(list, num_threads={cores}, numpy)": lambda: (
                sum(len(x) for x in sp.encode(docs, num_threads=cores, out_type="numpy")) + len(docs)
            ),
            "pretokenize --local": pretokenize(corpus, scratch, cores, model, None),
            "pretokenize --local --seq-len 2048": pretokenize(corpus, scratch, cores, model, None, seq_len=2048),
            "pretokenize --url": pretokenize(corpus, scratch, cores, None, url),
        }
        seconds, tokens = alternate(
            methods, args.rounds, lambda done: print(f"round {done}/{args.rounds} done", flush=True)
        )
    finally:
        server.terminate()
        server.wait(timeout=30)
        shutil.rmtree(scratch, ignore_errors=True)

    expected = tokens[baseline]
    if any(count != expected for count in tokens.values()):
        raise SystemExit(f"token counts differ: {tokens}")
    print()
    print("| method | docs/s | M tokens/s | vs baseline | target |")
    print("|---|---:|---:|---:|---:|")
    for name in methods:
        best = min(seconds[name])
        ratio = statistics.median(b / s for s, b in zip(seconds[name], seconds[baseline], strict=True))
        target = f"≥ {TARGETS[name]}" if name in TARGETS else ""
        print(f"| {name} | {len(docs) / best:,.0f} | {tokens[name] / best / 1e6:.2f} | {ratio:.2f} | {target} |")
    print("(docs/s and tokens/s: best round; ratios: median over rounds of per-round time ratios)")


if __name__ == "__main__":
    main()
