"""Pre-tokenizing from a bucket into a bucket against the same run on local files, on one machine (issue 34).

    python -m bench.storage [--corpus FILE] [--docs N] [--files F] [--rounds R] [--workers W] [--model FILE]

The documents of bench/inputs.py (1-2 KB, the shared multilingual corpus where ../shared has it) are written once as
F JSON Lines files, to a local directory and to a bucket of an S3 API server on 127.0.0.1 (moto's standalone server,
`moto[server]`, in a process of its own, as tests/test_object_storage.py starts it). Then, in alternating rounds
(the machine drifts; medians are reported):

  local   tokenizer-pretokenize DIR --local --output DIR2              (files in, files out)
  s3      tokenizer-pretokenize s3://bucket/corpus/ --local --output s3://bucket/out-N
          (streamed ranged reads in; shards staged locally, uploaded, metadata.json last)

each as a command line in a process of its own, timed by wall clock and by CPU time of its whole process tree (user +
system of the command and every process it waited for: its tokenizing workers), and for s3 the CPU the S3 server
spent meanwhile, reported apart: on a real store that work is not on this machine. The first round checks that the
s3 run's shard objects equal the local run's files byte for byte.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson
import psutil

from bench.inputs import ROOT, default_corpus, describe_corpus, documents_and_model
from tokenizer_service.tools.launcher import ServerNotReady, free_port, wait_listening


def start_s3(log: Path) -> tuple[subprocess.Popen[bytes], dict[str, str]]:
    """moto's S3 server on a free loopback port; the environment a client needs to use it (no file of this
    machine's AWS configuration is read)."""
    port = free_port()
    with log.open("wb") as output:
        server = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_listening(port, server, log)
    except ServerNotReady as exc:
        server.kill()
        raise SystemExit(f"moto's server did not start: {exc}") from None
    env = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    }
    return server, env


def write_corpus(docs: list[str], directory: Path, files: int) -> None:
    directory.mkdir(parents=True)
    size = -(-len(docs) // files)
    for number in range(files):
        with (directory / f"part-{number:03d}.jsonl").open("wb") as file:
            for doc in docs[number * size : (number + 1) * size]:
                file.write(orjson.dumps({"text": doc}) + b"\n")


def cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return float(times.user + times.system)


def timed(command: list[str], env: dict[str, str], server: psutil.Process | None) -> dict[str, float]:
    """Wall and CPU seconds of one command line, its waited-for children included; the server's CPU meanwhile."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    served = cpu_seconds(server) if server is not None else 0.0
    started = time.perf_counter()
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({result.returncode}): {result.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall": wall, "cpu": cpu, "server": (cpu_seconds(server) - served) if server is not None else 0.0}


def shard_files(files: dict[str, bytes]) -> dict[str, bytes]:
    return {name: data for name, data in files.items() if name != "metadata.json"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", type=Path, default=default_corpus())
    parser.add_argument("--docs", type=int, default=30000)
    parser.add_argument("--files", type=int, default=4, help="JSON Lines files the documents are written to")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--model", type=Path, help="a SentencePiece model (default: one trained on the corpus)")
    args = parser.parse_args()

    docs, model = documents_and_model(args.corpus, args.docs, args.model)
    scratch = Path(tempfile.mkdtemp(prefix="bench-storage-"))
    server, s3_env = start_s3(scratch / "moto.log")
    try:
        import s3fs

        env = {**os.environ, **s3_env}
        os.environ.update(s3_env)
        fs = s3fs.S3FileSystem()
        fs.mkdir("bench")
        write_corpus(docs, scratch / "corpus", args.files)
        fs.put(str(scratch / "corpus") + "/", "bench/corpus/", recursive=True)
        size = sum(path.stat().st_size for path in (scratch / "corpus").iterdir())
        cores = len(os.sched_getaffinity(0))
        describe_corpus(
            args.corpus,
            docs,
            f"{size / 1e6:.1f} MB in {args.files} .jsonl files",
            f"model {model.name}",
            f"--workers {args.workers}",
            f"{cores} cores ({platform.processor() or platform.machine()})",
        )
        common = ["--local", "--model", str(model), "--workers", str(args.workers), "-q"]
        tool = [sys.executable, "-m", "tokenizer_service.tools.pretokenize"]
        watched = psutil.Process(server.pid)
        print("load average before: {:.1f} {:.1f} {:.1f}".format(*os.getloadavg()), flush=True)
        results: dict[str, list[dict[str, float]]] = {"local": [], "s3": []}
        tokens = 0
        for round_number in range(args.rounds):
            order = ["local", "s3"] if round_number % 2 == 0 else ["s3", "local"]
            for name in order:
                if name == "local":
                    output = scratch / f"out-{round_number}"
                    command = [*tool, str(scratch / "corpus"), "--output", str(output), *common]
                    results[name].append(timed(command, env, None))
                else:
                    staging = scratch / "staging"
                    url = f"s3://bench/out-{round_number}"
                    command = [*tool, "s3://bench/corpus/", "--output", url, "--staging", str(staging), *common]
                    results[name].append(timed(command, env, watched))
            local = scratch / f"out-{round_number}"
            metadata = json.loads((local / "metadata.json").read_text())
            tokens = int(metadata["tokens"])
            if round_number == 0:  # the same bytes, whichever way they went
                here = {path.name: path.read_bytes() for path in local.iterdir()}
                fs.invalidate_cache()
                there = {path.rsplit("/", 1)[-1]: fs.cat_file(path) for path in fs.find("bench/out-0")}
                if shard_files(here) != shard_files(there):
                    raise SystemExit("the s3 run's shard objects differ from the local run's files")
            shutil.rmtree(local)
            fs.rm(f"bench/out-{round_number}", recursive=True)
            said = ", ".join(
                f"{name} {results[name][-1]['wall']:.1f} s wall, {results[name][-1]['cpu']:.1f} CPU-s" for name in order
            )
            print(f"round {round_number + 1}/{args.rounds}: {said}", flush=True)
        # start-up: the same two runs on 20 documents, what either costs before its first document
        write_corpus(docs[:20], scratch / "small", 1)
        fs.put(str(scratch / "small") + "/", "bench/small/", recursive=True)
        small = {
            "local": timed([*tool, str(scratch / "small"), "--output", str(scratch / "small-out"), *common], env, None),
            "s3": timed([*tool, "s3://bench/small/", "--output", "s3://bench/small-out", *common], env, watched),
        }
    finally:
        server.terminate()
        server.wait(timeout=30)
        shutil.rmtree(scratch, ignore_errors=True)

    def median(name: str, field: str) -> float:
        return statistics.median(result[field] for result in results[name])

    print()
    print(f"{tokens:,} tokens; medians of {args.rounds} rounds")
    print("| run | wall s | CPU s (tool, its workers) | CPU s (S3 server) | M tokens/s (wall) |")
    print("|---|---:|---:|---:|---:|")
    for name in ("local", "s3"):
        row: list[Any] = [name, median(name, "wall"), median(name, "cpu"), median(name, "server")]
        server_cpu = f"{row[3]:.1f}" if name == "s3" else "-"
        print(f"| {name} | {row[1]:.1f} | {row[2]:.1f} | {server_cpu} | {tokens / row[1] / 1e6:.2f} |")
    pairs = list(zip(results["s3"], results["local"], strict=True))
    wall = statistics.median(there["wall"] / here["wall"] for there, here in pairs)
    cpu = statistics.median(there["cpu"] / here["cpu"] for there, here in pairs)
    print(f"s3 / local (median of per-round ratios): wall {wall:.2f}x, CPU of the tool {cpu:.2f}x")
    said = ", ".join(f"{name} {small[name]['wall']:.1f} s wall, {small[name]['cpu']:.1f} CPU-s" for name in small)
    print(f"20 documents (start-up): {said}")
    print("load average after: {:.1f} {:.1f} {:.1f}".format(*os.getloadavg()))


if __name__ == "__main__":
    main()
