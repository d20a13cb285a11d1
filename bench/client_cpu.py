"""What the client costs a training process per request, against tokenizing the same texts in that process.

    python -m bench.client_cpu [--model FILE] [--corpus FILE.jsonl|FILE.txt] [--docs 2048] [--rounds 5]
                               [--in-flight D] [--workers 2]

A server with --workers workers serves --model (by default the bundled model) on a free loopback port. Then, in
alternating rounds, it measures this process's CPU (time.process_time, every thread counted) per request of 256
documents:

  in-process        the model's reference library encoding the same documents here, on one thread: what
                    tokenizing inline costs the training process
  sync, threads     TokenizerClient.tokenize_batch, called from --in-flight threads (default: the depth
                    client.prefetch keeps, 4)
  async             AsyncTokenizerClient.tokenize_batch, --in-flight at once on one event loop
  prefetch          client.prefetch(docs, batch_size=256, depth=--in-flight), iterated to the end, as a
                    training loop does (the prefetcher's event-loop thread and the consumer both counted)
  prefetch, packed  the same with pack=PackSpec(2048, rows): rows cut in the client

Each row is also given as a share of the in-process CPU. Before the rounds, once for each: the CPU to open a
client, and to run a prefetcher over 8 requests, opening included (every prefetcher opens a client of its
own). Both are the median of 10. A training process pays these next to its step, on the same cores.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from bench.inputs import RESULTS, describe_corpus, start_server
from bench.libraries import BATCH, FALLBACK, MULTILINGUAL_CORPUS, PREFETCH_DEPTH, read_corpus, service_run
from tokenizer_client import AsyncTokenizerClient, PackSpec, TokenizerClient
from tokenizer_service.core import libraries
from tokenizer_service.core.models import find_model_files
from tokenizer_service.core.reference import InProcess
from tokenizer_service.settings import BUNDLED

SEQ_LEN = 2048


def cpu_of(run: Callable[[], object]) -> float:
    started = time.process_time()
    run()
    return time.process_time() - started


def ways(
    url: str, docs: list[str], depth: int, rows: int
) -> tuple[dict[str, Callable[[], object]], Callable[[], None]]:
    """Each way of sending `docs` in 256-document requests, `depth` in flight; and what closes their clients."""
    client = TokenizerClient(url, timeout=300)
    batches = [docs[i : i + BATCH] for i in range(0, len(docs), BATCH)]
    loop = asyncio.new_event_loop()
    async_client = AsyncTokenizerClient(url, timeout=300)

    async def gathered() -> int:
        slots = asyncio.Semaphore(depth)

        async def one(batch: list[str]) -> int:
            async with slots:
                return (await async_client.tokenize_batch(batch, model="bench")).num_tokens

        return sum(await asyncio.gather(*(one(batch) for batch in batches)))

    def prefetch(pack: PackSpec | None) -> Callable[[], int]:
        def run() -> int:
            with client.prefetch(docs, batch_size=BATCH, depth=depth, model="bench", pack=pack) as batches_out:
                return sum(1 for _ in batches_out)

        return run

    def close() -> None:
        client.close()
        loop.run_until_complete(async_client.aclose())
        loop.close()

    return {
        "sync, threads": service_run(client, docs, depth),  # bench.libraries' way: a thread per request in flight
        "async": lambda: loop.run_until_complete(gathered()),
        "prefetch": prefetch(None),
        f"prefetch, packed {rows} x {SEQ_LEN}": prefetch(PackSpec(SEQ_LEN, rows)),
    }, close


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=BUNDLED["default"])
    parser.add_argument(
        "--corpus", type=Path, default=MULTILINGUAL_CORPUS if MULTILINGUAL_CORPUS.exists() else FALLBACK
    )
    parser.add_argument("--docs", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--in-flight", type=int, default=PREFETCH_DEPTH, help="requests at once (default: client.prefetch's depth)"
    )
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    if not args.model.is_file():
        parser.error(f"--model {args.model}: no such file")
    os.environ.setdefault(
        libraries.CACHE_DIR_ENV, str(RESULTS / "gate-cache")
    )  # the gate's verdicts, as bench.libraries

    docs = read_corpus(args.corpus, args.docs)
    reference = InProcess(find_model_files("bench", args.model), 1)
    tokens = reference.tokens(docs)
    rows = max(1, round(tokens / len(docs) * BATCH / SEQ_LEN))  # about as many tokens as a request's documents
    describe_corpus(
        args.corpus, docs, f"model {args.model.name}", f"{args.workers} workers", f"{args.in_flight} in flight"
    )
    url, process = start_server(args.model, args.workers)
    try:
        opened = statistics.median(cpu_of(lambda: TokenizerClient(url).close()) for _ in range(10))
        short = docs[: 8 * BATCH]
        with TokenizerClient(url, timeout=300) as client:

            def short_prefetch() -> None:
                with client.prefetch(short, batch_size=BATCH, depth=args.in_flight, model="bench") as batches_out:
                    for _ in batches_out:
                        pass

            short_prefetch()
            prefetcher = statistics.median(cpu_of(short_prefetch) for _ in range(10))
        each, close = ways(url, docs, args.in_flight, rows)
        try:
            for run in each.values():  # connections, workers and caches warm
                run()
            spent: dict[str, list[float]] = {"in-process": [], **{name: [] for name in each}}
            for _ in range(args.rounds):
                spent["in-process"].append(cpu_of(lambda: reference.tokens(docs)))
                for name, run in each.items():
                    spent[name].append(cpu_of(run))
        finally:
            close()
    finally:
        process.terminate()
        process.wait(timeout=30)

    requests = -(-len(docs) // BATCH)
    inline = statistics.median(spent["in-process"]) / requests
    print()
    print(f"| way | CPU per {BATCH}-document request, ms | share of in-process |")
    print("|---|---:|---:|")
    for name, seconds in spent.items():
        per = statistics.median(seconds) / requests
        print(f"| {name} | {per * 1e3:.2f} | {per / inline:.1%} |")
    print()
    print(
        f"opening a client: {opened * 1e3:.2f} ms CPU; a prefetcher over 8 requests, opening included: "
        f"{prefetcher * 1e3:.1f} ms CPU ({tokens / len(docs):.0f} tokens a document)"
    )


if __name__ == "__main__":
    main()
