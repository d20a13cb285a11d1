"""Start-up of the two commands, against the floors of the same machine in the same run (issue 33).

    python -m bench.startup [--rounds 5] [--model PATH] [--versus REV]

Issue 33 asks for "a start in under two seconds". With the 128k byte-level BPE tokenizer.json of bench/peers.py
(trained once, bench/results/; --model for another), its gate verdict settled once beforehand
(`python -m tokenizer_service.core.gatescan`, TOKENIZER_CACHE_DIR=bench/results/peers/cache for every command), each
round measures, in an order that rotates from round to round (the machine drifts):

  server       python -m tokenizer_service --workers 2 --model m=MODEL: seconds from Popen until GET /readyz
               answers 200 (polled every 10 ms), and the CPU seconds of its whole process tree at that moment
               (psutil, the tree's processes and the children they waited for); then SIGTERM to its process group
  pretokenize  tokenizer-pretokenize on bench/peers.py's 20-document Parquet file, --local, into a fresh directory:
               wall and tree CPU (bench.peers.measure), and the seconds until its first shard is written (both
               files of NNNNN.bin/.idx under their final names; the output directory polled every 5 ms)
  floors       python -c pass (the interpreter); the reference library, tokenizers, loading the model alone;
               gigatoken loading it alone (`gigatoken_rs.load_hf_json`, as app/core/encoders.py does), if installed

--versus REV measures the two commands at commit REV too (from a git worktree, as bench/versus.py serves it), in the
same rounds. The service's modules are compiled first (`compileall`), as an installed package has them.

Targets (the issue's): the server ready within 3 s; the first shard within 2 s, the whole 20-document run under
2.5 CPU-s. The floors say how much of that any Python process that loads the model pays on this machine.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil

from bench.inputs import RESULTS, ROOT, compile_service
from bench.peers import PEERS, corpus_documents, measure, peer_model, write_parquet
from bench.versus import checkout, remove_checkout
from tokenizer_service.tools.launcher import free_port, stop

OUT = RESULTS / "startup"
CORPUS = PEERS / "corpus-20docs.parquet"
CACHE = PEERS / "cache"
SHARD = re.compile(r"([0-9]+)\.idx")


def tree_cpu(process: psutil.Process) -> float:
    """User + system CPU seconds of `process`, its live descendants, and the children each of them waited for."""
    total = 0.0
    for member in [process, *process.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            times = member.cpu_times()
            total += times.user + times.system + times.children_user + times.children_system
    return total


def server_ready(model: Path, env: dict[str, str]) -> tuple[float, float]:
    """(seconds from Popen to /readyz 200, CPU seconds of the server's process tree then)."""
    port = free_port()
    command = [sys.executable, "-m", "tokenizer_service", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--workers", "2", "--model", f"m={model}", "--log-level", "warning"]
    log = OUT / "server.log"
    with log.open("ab") as output, httpx.Client(timeout=1.0) as client:
        started = time.perf_counter()
        process = subprocess.Popen(
            command, stdout=output, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True
        )
        try:
            while True:
                if process.poll() is not None:
                    raise RuntimeError(f"tokenizer-server exited {process.returncode}; see {log}")
                with contextlib.suppress(httpx.TransportError):
                    if client.get(f"http://127.0.0.1:{port}/readyz").status_code == 200:
                        break
                time.sleep(0.01)
            ready = time.perf_counter() - started
            cpu = tree_cpu(psutil.Process(process.pid))
        finally:
            stop(process)  # SIGTERM, then SIGKILL past its timeout
            with contextlib.suppress(ProcessLookupError, PermissionError):  # no worker left behind
                os.killpg(process.pid, signal.SIGKILL)
    return ready, cpu


def first_shard(directory: Path, started: float, done: threading.Event, seen: list[float]) -> None:
    """Append the seconds from `started` until `directory` holds a whole shard (NNNNN.idx and NNNNN.bin)."""
    while not done.is_set():
        with contextlib.suppress(OSError):
            names = set(os.listdir(directory))
            if any((m := SHARD.fullmatch(name)) and f"{m[1]}.bin" in names for name in names):
                seen.append(time.perf_counter() - started)
                return
        time.sleep(0.005)


def pretokenize(model: Path, env: dict[str, str]) -> tuple[float, float, float]:
    """(seconds to the first shard, wall, tree CPU) of the 20-document --local run."""
    directory = OUT / "out"
    shutil.rmtree(directory, ignore_errors=True)
    tool = Path(sys.executable).parent / "tokenizer-pretokenize"
    command = [str(tool), str(CORPUS), "--local", "--model", str(model), "--output", str(directory), "-q"]
    done, seen = threading.Event(), []
    watcher = threading.Thread(target=first_shard, args=(directory, time.perf_counter(), done, seen))
    watcher.start()
    try:
        measured = measure(command, OUT / "runs.log", env)
    finally:
        done.set()
        watcher.join()
    if not seen:
        raise RuntimeError(f"no shard seen in {directory}")
    return seen[0], measured.wall, measured.cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--model", type=Path, help="a tokenizer.json or its directory (default: bench/peers.py's)")
    parser.add_argument("--versus", metavar="REV", help="also measure the commands at commit REV, in the same rounds")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="startup-"))
    try:
        measure_rounds(args, scratch)
    finally:
        remove_checkout(scratch)


def measure_rounds(args: argparse.Namespace, scratch: Path) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    documents = corpus_documents(1)
    write_parquet(CORPUS, documents[:20])
    model = (args.model or peer_model(documents)).resolve()
    file = model / "tokenizer.json" if model.is_dir() else model
    env = {**os.environ, "TOKENIZER_CACHE_DIR": str(CACHE)}
    trees = {"": env}  # a row's suffix -> the environment its commands run in
    if args.versus:
        trees[f" at {args.versus}"] = {**env, "PYTHONPATH": str(checkout(args.versus, scratch))}
    for tree_env in trees.values():  # each tree settles its own gate (and keeps what it keeps beside it)
        scan = [sys.executable, "-m", "tokenizer_service.core.gatescan", str(model)]
        print(subprocess.run(scan, env=tree_env, cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip())
    for tree in {  # compiled, as an installed package is (bench.inputs.compile_service)
        ROOT,
        *(Path(tree_env["PYTHONPATH"]).resolve() for tree_env in trees.values() if "PYTHONPATH" in tree_env),
    }:
        compile_service(tree, ("app", "client") if tree == ROOT else ("tokenizer_service/", "tokenizer_client/"))

    load = f"tokenizers.Tokenizer.from_file({str(file)!r})"
    floors = {
        "floor: `python -c pass`": "pass",
        "floor: tokenizers loads the model": f"import tokenizers; {load}",
    }
    if importlib.util.find_spec("gigatoken") is not None:
        floors["floor: gigatoken loads the model"] = (
            f"import gigatoken.gigatoken_rs as g; g.load_hf_json(open({str(file)!r}, encoding='utf-8').read())"
        )
    print(
        f"{os.cpu_count()} cores ({len(os.sched_getaffinity(0))} usable), load average "
        "{:.1f} {:.1f} {:.1f}".format(*os.getloadavg())
        + f", {datetime.date.today()}, CPython "
        f"{sys.version.split()[0]}; model {file.relative_to(ROOT) if file.is_relative_to(ROOT) else file}",
        flush=True,
    )

    rows: dict[str, list[float]] = {}

    def record(name: str, value: float) -> None:
        rows.setdefault(name, []).append(value)

    things = [*(f"server{tree}" for tree in trees), *(f"pretokenize{tree}" for tree in trees), *floors]
    for round_index in range(args.rounds):
        shift = round_index % len(things)
        for thing in things[shift:] + things[:shift]:
            if thing.startswith("server"):
                tree = thing.removeprefix("server")
                ready, cpu = server_ready(model, trees[tree])
                record(f"server ready (s){tree}", ready)
                record(f"server CPU at ready (CPU-s){tree}", cpu)
            elif thing.startswith("pretokenize"):
                tree = thing.removeprefix("pretokenize")
                shard, wall, cpu = pretokenize(model, trees[tree])
                record(f"pretokenize first shard (s){tree}", shard)
                record(f"pretokenize wall (s){tree}", wall)
                record(f"pretokenize CPU (CPU-s){tree}", cpu)
            else:
                measured = measure([sys.executable, "-c", floors[thing]], OUT / "runs.log", env)
                record(f"{thing}, wall (s)", measured.wall)
                record(f"{thing}, CPU (CPU-s)", measured.cpu)
        said = ", ".join(f"{name} {values[-1]:.2f}" for name, values in list(rows.items())[: 5 * len(trees)])
        print(f"round {round_index + 1}/{args.rounds}: {said}", flush=True)

    targets = {"server ready (s)": "3", "pretokenize first shard (s)": "2", "pretokenize CPU (CPU-s)": "2.5"}
    print()
    print(f"{args.rounds} rounds; load average after {os.getloadavg()[0]:.1f}")
    print()
    print("| measure | target | median | min | max |")
    print("|---|---:|---:|---:|---:|")
    for name, values in rows.items():
        median, low, high = statistics.median(values), min(values), max(values)
        print(f"| {name} | {targets.get(name, '')} | {median:.2f} | {low:.2f} | {high:.2f} |")


if __name__ == "__main__":
    main()
