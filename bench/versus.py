"""The server at another commit and the server of this tree, side by side in one run: what a change did to the
CPU a request costs.

    python -m bench.versus REV [--model FILE] [--workers 2] [--in-flight 4] [--rounds 5] [--passes 8]
                               [--docs 4096] [--corpus FILE.txt|FILE.jsonl]

REV (a commit, tag or branch) is checked out in a temporary git worktree and served from it (its
`app/` and `client/` first on PYTHONPATH); this tree serves beside it. Each model's gate verdict is settled
first, by each tree's own `tokenizer_service.core.gatescan`, so both serve their fast encoder from the first
request. Then in rounds, alternating: the workers' own encode of the documents in this process (fresh `str`
objects, one thread: bench.serving's baseline), and for each server --passes passes over the documents in
256-document binary requests (this tree's TokenizerClient), --in-flight at a time. It prints, per server, the
server process's and the workers' CPU per request (psutil), the CPU efficiency (the in-process encode / the
server's CPU, per round) and the serial ceiling (workers / server process), medians with the rounds' range, and
the ratio of the two servers' CPU per request. CPU times, not wall time: they hold up on a shared machine.
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
from pathlib import Path

import psutil

from bench.inputs import default_corpus, describe_corpus, documents_and_model
from bench.serving import BATCH, Meter, encoder, in_flight, load
from tokenizer_client import TokenizerClient
from tokenizer_service.core import libraries
from tokenizer_service.tools.launcher import ServerProcess, stop

ROOT = Path(__file__).resolve().parent.parent


def checkout(rev: str, scratch: Path) -> Path:
    """A directory to put first on PYTHONPATH: REV's packages, from a worktree of it under `scratch`."""
    tree = scratch / "tree"
    if subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--verify", "-q", f"{rev}^{{commit}}"], capture_output=True
    ).returncode:
        raise SystemExit(f"{rev!r} is no commit of this repository: give a commit, tag or branch (git log --oneline)")
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(tree), rev], check=True)
    paths = scratch / "paths"
    paths.mkdir()
    (paths / "tokenizer_service").symlink_to(tree / "app")
    (paths / "tokenizer_client").symlink_to(tree / "client")
    return paths


def remove_checkout(scratch: Path) -> None:
    """The worktree `checkout` made under `scratch`, if it made one, and `scratch` itself."""
    if (scratch / "tree").exists():
        remove = ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(scratch / "tree")]
        subprocess.run(remove, check=False)
    shutil.rmtree(scratch, ignore_errors=True)


def settle(model: Path, env: dict[str, str]) -> None:
    """The model's gate verdict in the cache, as that tree computes it (its check set version may differ). A
    refusal (exit 1) is a verdict too, and a tree whose gatescan fails on a model (before 2026-11-27: any
    SentencePiece model, which no gate applies to) serves it with its library: said in one line, and measured."""
    scan = subprocess.run(
        [sys.executable, "-m", "tokenizer_service.core.gatescan", str(model)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
    )
    if scan.returncode:
        last = (scan.stderr.strip().splitlines() or scan.stdout.strip().splitlines() or ["?"])[-1]
        print(f"gatescan exited {scan.returncode} ({last}); that server runs with what its gate left it", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("rev", help="the commit to compare this tree with")
    parser.add_argument("--corpus", type=Path, default=default_corpus(), help=".txt or .jsonl (default: multilingual)")
    parser.add_argument("--model", type=Path, help="default: a 16k unigram trained on the corpus (as bench.serving)")
    parser.add_argument("--docs", type=int, default=4096)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--in-flight", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--passes", type=int, default=8, help="times the documents are sent per server and round")
    args = parser.parse_args()

    docs, model = documents_and_model(args.corpus, args.docs, args.model, vocab_size=16000)
    batches = [docs[start : start + BATCH] for start in range(0, len(docs), BATCH)]
    describe_corpus(args.corpus, docs, f"model {model.name}", f"{len(os.sched_getaffinity(0))} cores")
    scratch = Path(tempfile.mkdtemp(prefix="bench-versus-"))
    servers: dict[str, tuple[ServerProcess, TokenizerClient]] = {}
    try:
        trees = {args.rev: {"PYTHONPATH": str(checkout(args.rev, scratch))}, "this tree": {}}
        for name, env in trees.items():
            settle(model, env)
            server = ServerProcess(
                ["--workers", str(args.workers), "--model", f"bench={model}", "--log-level", "warning"], env=env
            ).start(timeout=180)
            servers[name] = (server, TokenizerClient(server.url, timeout=300))
        work = load(model)
        libraries.single_threaded()  # the baseline runs as a worker does: one thread
        encode = encoder(work)
        print(f"this tree's workers encode with {work.encoder}; {args.in_flight} in flight", flush=True)
        for _, client in servers.values():
            in_flight(client, batches, args.in_flight, "binary")  # warm: connections, workers' caches
        baseline: list[float] = []
        main_ms: dict[str, list[float]] = {name: [] for name in servers}
        worker_ms: dict[str, list[float]] = {name: [] for name in servers}
        for _ in range(args.rounds):
            fresh = [[doc.encode().decode() for doc in batch] for batch in batches]  # no cached UTF-8
            started = time.process_time()
            for batch in fresh:
                encode(batch)
            baseline.append((time.process_time() - started) / len(fresh) * 1e3)
            for name, (server, client) in servers.items():
                assert server.process is not None
                with Meter(psutil.Process(server.process.pid), 1) as meter:
                    for _ in range(args.passes):
                        in_flight(client, batches, args.in_flight, "binary")
                requests = args.passes * len(batches)
                main_ms[name].append(meter.main / requests * 1e3)
                worker_ms[name].append(meter.worker / requests * 1e3)
    finally:
        for server, client in servers.values():
            client.close()
            if server.process is not None:
                stop(server.process)
        remove_checkout(scratch)

    if min(min(main_ms[name]) for name in servers) <= 0:  # process CPU times tick in 10 ms steps
        sys.exit("bench.versus: too few requests a round to measure the server process's CPU; raise --passes or --docs")

    def spread(values: list[float], form: str) -> str:
        return f"{form.format(statistics.median(values))} ({form.format(min(values))}-{form.format(max(values))})"

    print(f"\nthe workers' encode in-process (ms per {BATCH}-doc request): {spread(baseline, '{:.2f}')}\n")
    print("| server | server process (ms/request) | workers (ms/request) | CPU efficiency | serial ceiling |")
    print("|---|---:|---:|---:|---:|")
    for name in servers:
        main, workers = main_ms[name], worker_ms[name]
        efficiency = [b / (m + w) for b, m, w in zip(baseline, main, workers, strict=True)]
        ceiling = [w / m for m, w in zip(main, workers, strict=True)]
        print(
            f"| {name} | {spread(main, '{:.2f}')} | {spread(workers, '{:.2f}')} | {spread(efficiency, '{:.2f}')} "
            f"| {spread(ceiling, '{:.1f}')} |"
        )
    ratios = [
        (main_ms["this tree"][i] + worker_ms["this tree"][i]) / (main_ms[args.rev][i] + worker_ms[args.rev][i])
        for i in range(args.rounds)
    ]
    print(f"\nserver CPU per request, this tree / {args.rev}: {spread(ratios, '{:.2f}')} (per round)")


if __name__ == "__main__":
    main()
