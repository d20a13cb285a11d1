"""How throughput scales with the number of workers, against in-process sentencepiece on as many threads.

    python -m bench.scaling [--workers 1 2 4 8 15] [--docs 8192] [--in-flight 0] [--frontends 1] [--model FILE]

For each worker count N it starts a server with N workers, then measures in alternating rounds
  in-process   sp.encode(docs, num_threads=N, out_type="numpy")
  service      binary /v1/tokenize, 256 documents a request, `--in-flight` requests at once
               (default 2 N: enough to keep every worker busy)
and reports docs/s of both, their ratio, and the serial ceiling (worker CPU / server-process CPU per
request). Meant for a machine with more cores than workers (leave one for the client): the curve
shows where one server process stops keeping its workers busy.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import psutil
import sentencepiece as spm

from bench.inputs import describe_corpus, documents_and_model, python_docs_corpus, start_server
from bench.serving import BATCH, Meter, in_flight
from tokenizer_client import TokenizerClient


def measure(model: Path, workers: int, frontends: int, depth: int, docs: list[str], rounds: int) -> dict[str, float]:
    sp = spm.SentencePieceProcessor(model_file=str(model))
    batches = [docs[i : i + BATCH] for i in range(0, len(docs), BATCH)]
    url, process = start_server(model, workers, "--frontends", str(frontends))
    server = psutil.Process(process.pid)
    inprocess, service, ceilings = [], [], []
    try:
        with TokenizerClient(url, timeout=300) as client:
            in_flight(client, batches, depth, "binary")  # warm up
            for _ in range(rounds):
                began = time.perf_counter()
                sp.encode(docs, num_threads=workers, out_type="numpy")
                inprocess.append(len(docs) / (time.perf_counter() - began))
                with Meter(server, frontends) as meter:
                    in_flight(client, batches, depth, "binary")
                service.append(len(docs) / meter.wall)
                # psutil counts CPU in 10 ms ticks: a short round can read no server-process CPU at all
                ceilings.append(meter.worker / meter.main if meter.main else float("nan"))
    finally:
        process.terminate()
        process.wait(timeout=30)
    ratios = [s / i for s, i in zip(service, inprocess, strict=True)]
    return {
        "inprocess": max(inprocess),
        "service": max(service),
        "ratio": statistics.median(ratios),
        # nan where a round read no server-process CPU: the median of the rounds that did (nan if none did)
        "ceiling": statistics.median([c for c in ceilings if c == c] or [float("nan")]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", type=Path, default=python_docs_corpus())
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4, 8, 15])
    parser.add_argument("--docs", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--in-flight", type=int, default=0, help="requests at once (default: 2 x workers)")
    parser.add_argument("--frontends", type=int, default=1)
    parser.add_argument("--model", type=Path, help="a SentencePiece model (default: 16k unigram on the corpus)")
    args = parser.parse_args()

    docs, model = documents_and_model(args.corpus, args.docs, args.model, vocab_size=16000)
    cores = len(os.sched_getaffinity(0))
    describe_corpus(args.corpus, docs, f"model {model.name}", f"{cores} cores", f"--frontends {args.frontends}")
    print()
    print(
        "| workers | in-process docs/s (N threads), best round | service docs/s, best round "
        "| service / in-process, median of the rounds' ratios | serial ceiling |"
    )
    print("|---:|---:|---:|---:|---:|")
    for workers in args.workers:
        depth = args.in_flight or 2 * workers
        result = measure(model, workers, args.frontends, depth, docs, args.rounds)
        print(
            f"| {workers} | {result['inprocess']:,.0f} | {result['service']:,.0f} | {result['ratio']:.2f} | "
            f"{result['ceiling']:.1f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
