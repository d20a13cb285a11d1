"""Pre-tokenization throughput against in-process sentencepiece, measured in one run.

    python bench/pretokenize.py [--corpus FILE] [--docs N] [--rounds R] [--model FILE]

The documents of bench/throughput.py (1-2 KB, from the Python docs corpus) are written to a .jsonl
file once; then, in alternating rounds (the machine drifts; the median of per-round ratios is reported):
  baseline   sp.encode(docs, num_threads=cores)                       (documents already in memory)
  floor      sp.encode(docs, num_threads=cores, out_type="numpy")
  local      tokenizer-pretokenize --local: read the file, tokenize on a pool, write shards (end to end,
             worker start-up included), ragged and with --seq-len 2048 (concat)
  service    tokenizer-pretokenize --url: the same through a server on this machine (client and server
             share the cores)
Targets: local >= 0.8 x baseline, service >= 0.7 x baseline.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import orjson
import sentencepiece as spm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from throughput import FALLBACK_CORPUS, SHARED_CORPUS, bench_model, load_documents, start_server  # noqa: E402

from app.pretokenize.run import Options, run  # noqa: E402

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", type=Path, default=SHARED_CORPUS if SHARED_CORPUS.exists() else FALLBACK_CORPUS)
    parser.add_argument("--docs", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", type=Path, help="a SentencePiece model (default: train one on the corpus)")
    args = parser.parse_args()

    cores = len(os.sched_getaffinity(0))
    docs = load_documents(args.corpus, args.docs)
    model = args.model or bench_model(args.corpus)
    sp = spm.SentencePieceProcessor(model_file=str(model))
    scratch = Path(tempfile.mkdtemp(prefix="bench-pretokenize-"))
    corpus = scratch / "corpus.jsonl"
    write_jsonl(docs, corpus)
    print(
        f"corpus {args.corpus.name}: {len(docs)} documents, {corpus.stat().st_size / 1e6:.1f} MB of .jsonl; "
        f"model {model.name} (vocab {sp.vocab_size()}); {cores} cores",
        flush=True,
    )
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
        seconds: dict[str, list[float]] = {name: [] for name in methods}
        tokens: dict[str, int] = {}
        for round_index in range(args.rounds):
            for name, method in methods.items():
                started = time.perf_counter()
                tokens[name] = method()
                seconds[name].append(time.perf_counter() - started)
            print(f"round {round_index + 1}/{args.rounds} done", flush=True)
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
