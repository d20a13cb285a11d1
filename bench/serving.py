"""Where the server's CPU goes, per request, against the same encoding in-process, measured in the same run.

    python -m bench.serving [--workers 2 8] [--docs 4096] [--rounds 3] [--singles 3000] [--passes 12]
                            [--in-flight 4] [--corpus FILE.txt|FILE.jsonl] [--model FILE]

For each worker count it starts a server on a free loopback port and prints:
  serial ceiling   worker CPU / main-process CPU per 256-document request: how many busy workers
                   one server process can feed before its own core is the bottleneck (with
                   --frontends N: per front-end, each of which feeds its own workers); beside it
                   the batch floor (bench.floor): a bare uvicorn app reading the same bodies and
                   answering as many bytes as the service's binary answers, and the ceiling at it;
                   and the relay floor (bench.floor.relay_app): the same, and each body written to a
                   worker process and its answer read back, as the service's server process must
  CPU efficiency   CPU of the workers' own encode of the same documents (fresh str objects) in a
                   single-threaded process of its own, as a worker is (for SentencePiece sp.encode(chunk, num_threads=1,
                   out_type="numpy"); for tokenizer.json and tiktoken the encoder the workers use,
                   fastokens where it passed its check), measured before each pass of requests / (main +
                   workers) CPU; with --in-flight requests in flight (4: every worker busy, one request
                   queued for each), and one request at a time; beside the workers' CPU, their whole job
                   (parse, checks, encode, answer) in such a process, without sockets; and the same with
                   the encode measured on two processes at once, each encoding half of every batch (both
                   cores busy, as the workers are under load: cores that share caches or a host's SMT
                   siblings slow each other down, which no service can avoid)
  split cost       one request at a time, the server's CPU (main + workers) on this server, which splits
                   a lone request over its idle workers, / on one started with --min-chunk-chars huge
                   (never splits), passes alternating; beside it, what the same split costs without any
                   service: two such processes encoding the two halves of each request at once / one
  single text      p50/p99 latency of one 1-2 KB text through TokenizerClient, and main-process CPU each;
                   beside it the floor (bench.floor): a bare uvicorn app that answers 16 bytes, called
                   through the same httpx transport, on the same texts; and the library's own encode of
                   one text in a single-threaded process, with its caches warm and after touching 64 MiB
                   (more than this machine's caches), as a worker finds them between single requests
  client CPU       this process's CPU per 256-document binary request (TokenizerClient)
  throughput       binary and JSON, 2 requests in flight, against the library's batch call on all cores
                   (sp.encode(list, num_threads=cores), tok.encode_batch, enc.encode_ordinary_batch) and,
                   for SentencePiece, the numpy floor sp.encode(list, num_threads=cores,
                   out_type="numpy"), rounds alternating (the median of per-round ratios is reported);
                   beside it the share of the cores the client and the server kept busy meanwhile
CPU times come from psutil (the server's main process; the sum over its worker processes), which
holds up on a shared machine where wall time does not. Without --model it trains a 16k unigram
model on the corpus (cached under bench/results/). The corpus defaults to the shared multilingual one
(71% of its documents not NFKC-normalized, like web text); the share is printed.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import os
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil

from bench.floor import measure_floor
from bench.inputs import default_corpus, describe_corpus, documents_and_model, start_server
from tokenizer_client import TokenizerClient, wire
from tokenizer_client._requests import texts_frame
from tokenizer_service.core import channel, libraries
from tokenizer_service.core.handler import Handler, Limits, TextMarker
from tokenizer_service.core.models import SENTENCEPIECE, find_model_files
from tokenizer_service.core.options import EncodeOptions
from tokenizer_service.core.protocol import TOKENIZE, request_head
from tokenizer_service.core.reference import InProcess
from tokenizer_service.core.registry import model_info
from tokenizer_service.settings import Settings
from tokenizer_service.tools.launcher import metric_total, stop, worker_pids

BATCH = 256
# 256-document requests to the bare app for the batch floor: enough that the 10 ms granularity of
# process CPU times stays under 5% of the figure
FLOOR_BATCH_REQUESTS = 192
# single texts encoded in-process, and the memory touched between two of them to evict the caches
SINGLE_ENCODES = 1000
EVICT_BYTES = 64 << 20


def cpu(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def spawned(process: psutil.Process) -> list[psutil.Process]:
    """The worker processes of a server process (or with --frontends, the supervisor's front-ends)."""
    return [psutil.Process(pid) for pid in worker_pids(process.pid)]


class Meter:
    """CPU seconds of the server process(es), of the workers, and of this process, over a block.

    With --frontends N the server processes are the N front-ends (the supervisor only waits).
    """

    def __init__(self, server: psutil.Process, frontends: int) -> None:
        self.servers = spawned(server) if frontends > 1 else [server]
        self.workers = [worker for front in self.servers for worker in spawned(front)]

    def __enter__(self) -> Meter:
        self._main = sum(cpu(server) for server in self.servers)
        self._workers = sum(cpu(worker) for worker in self.workers)
        self._client = time.process_time()
        self._wall = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self._wall
        self.main = sum(cpu(server) for server in self.servers) - self._main
        self.worker = sum(cpu(worker) for worker in self.workers) - self._workers
        self.client = time.process_time() - self._client


def frame_body(payload: dict[str, Any]) -> bytes:
    """The body TokenizerClient sends for a binary answer: the texts as a frame of UTF-8 (`texts_frame`)."""
    body = texts_frame(payload)
    assert body is not None, "texts that are not valid Unicode"
    return body


def binary_answer_bytes(url: str, body: bytes) -> int:
    """The size of the service's binary answer to one /v1/tokenize body."""
    headers = {"content-type": wire.MEDIA_TYPE, "accept": wire.MEDIA_TYPE}
    response = httpx.post(f"{url}/v1/tokenize", content=body, headers=headers, timeout=120)
    response.raise_for_status()
    return len(response.content)


def encode_seconds(url: str) -> float:
    """Seconds the workers have spent in the library's encode, by their own clock (tokenizer_worker_seconds_total)."""
    return metric_total(url, "tokenizer_worker_seconds_total")


def in_flight(client: TokenizerClient, batches: list[list[str]], depth: int, fmt: str) -> int:
    def one(batch: list[str]) -> int:
        return client.tokenize_batch(batch, model="bench", format=fmt).num_tokens

    with ThreadPoolExecutor(depth) as pool:
        return sum(pool.map(one, batches))


def load(model: Path) -> libraries.Library:
    """The model as the workers load it (fastokens in front where it passes its check)."""
    return libraries.load(find_model_files("bench", model))


def handler(model: Path, work: libraries.Library) -> Handler:
    """A worker's request handler over the loaded model, with the server's default limits (never splitting)."""
    settings = Settings()
    limits = Limits(
        max_texts=settings.max_texts,
        max_seq_len=settings.max_seq_len,
        min_chunk_chars=10**12,
        max_request_bytes=settings.max_request_bytes,
    )
    info = model_info("bench", find_model_files("bench", model), work)
    return Handler([info], [work], "bench", limits, TextMarker(None))


def _handling(handle: Handler, payloads: list[bytes]) -> float:
    """CPU ms of a worker's whole job per 256-document binary /v1/tokenize request (its REQUEST payload),
    sockets aside: parse the body, check it, encode, build the answer."""
    started = time.process_time()
    for payload in payloads:
        kind, _ = handle.handle(channel.REQUEST, payload)
        assert kind == channel.DONE, kind
    return (time.process_time() - started) / len(payloads) * 1e3


def encoder(work: libraries.Library) -> Callable[[list[str]], int]:
    """The workers' own encode of a batch, in this process, one thread: it returns the number of ids."""
    if isinstance(work, libraries.SentencePiece):
        processor = work.processor

        def encode(batch: list[str]) -> int:
            return int(sum(len(ids) for ids in processor.encode(batch, num_threads=1, out_type="numpy")))

        return encode
    options = EncodeOptions()
    return lambda batch: len(work.encode(batch, options)[0])


def _encoding(model: Path, batches: list[list[str]], half: int, barrier: Any, connection: Any) -> None:
    """A single-threaded process, as a worker is, that encodes on command: every batch whole, or one half of
    every batch at the same moment as its twin encodes the other half (it answers with its CPU seconds);
    or single texts (`_singles`), or each batch as a worker's whole job (`_handling`)."""
    libraries.single_threaded()
    work = load(model)
    encode = encoder(work)
    handle = handler(model, work)
    payloads = [request_head(TOKENIZE, True, 1, False) + frame_body({"texts": batch}) for batch in batches]
    middle = BATCH // 2
    encode(batches[0])  # caches warm, as the workers' are
    while (command := connection.recv()) is not None:
        if command == "singles":
            connection.send(_singles(work, [text for batch in batches for text in batch][:SINGLE_ENCODES]))
            continue
        if command == "handle":
            connection.send(_handling(handle, payloads))
            continue
        # Fresh str objects, as a training loop has them from its reader (and a worker from a request): a
        # str already encoded once keeps its UTF-8, which the libraries would then not pay for again.
        fresh = [[text.encode().decode() for text in batch] for batch in batches]
        if command == "half":
            barrier.wait()
        started = time.process_time()
        for batch in fresh:
            encode(batch if command == "whole" else batch[:middle] if half == 0 else batch[middle:])
        connection.send(time.process_time() - started)


def _singles(work: libraries.Library, texts: list[str]) -> tuple[float, float]:
    """CPU ms of the library's encode of one text, as a worker calls it for a single-text request: with the
    caches warm from the text before, and after touching more memory than the caches hold (the cores' L2
    and the shared L3), as when the client and the server process ran between two texts."""
    options = EncodeOptions()
    sweep = np.ones(EVICT_BYTES // 8, dtype=np.float64)
    spent = {"warm": 0.0, "evicted": 0.0}
    for text in texts:
        for state in spent:
            fresh = [text.encode().decode()]
            if state == "evicted":
                sweep.sum()
            started = time.thread_time()
            work.encode(fresh, options)
            spent[state] += time.thread_time() - started
    return spent["warm"] / len(texts) * 1e3, spent["evicted"] / len(texts) * 1e3


class Baseline:
    """The work itself, without a service: the workers' own encode in single-threaded processes.

    `whole()`: one process encodes every batch. `pair()`: two processes encode the two halves of each
    batch at once, as a lone request split over two workers; on a machine whose cores slow each other
    down (shared caches, SMT siblings on the host) the same work costs more CPU on two cores at once.
    """

    def __init__(self, model: Path, batches: list[list[str]]) -> None:
        context = multiprocessing.get_context("spawn")
        self.barrier = barrier = context.Barrier(2)  # held here: a collected one is gone before the children load it
        self.connections = []
        self.processes = []
        for half in (0, 1):
            ours, theirs = context.Pipe()
            process = context.Process(target=_encoding, args=(model, batches, half, barrier, theirs), daemon=True)
            process.start()
            self.connections.append(ours)
            self.processes.append(process)

    def whole(self) -> float:
        self.connections[0].send("whole")
        return float(self.connections[0].recv())

    def pair(self) -> float:
        for connection in self.connections:
            connection.send("half")
        return float(sum(connection.recv() for connection in self.connections))

    def singles(self) -> tuple[float, float]:
        """CPU ms of one text's encode, caches warm and evicted (`_singles`)."""
        self.connections[0].send("singles")
        warm, evicted = self.connections[0].recv()
        return float(warm), float(evicted)

    def handling(self) -> float:
        """CPU ms of a worker's whole job per request, in-process (`_handling`)."""
        self.connections[0].send("handle")
        return float(self.connections[0].recv())

    def close(self) -> None:
        for connection in self.connections:
            connection.send(None)
        for process in self.processes:
            process.join(timeout=30)


def measure(
    model: Path,
    workers: int,
    frontends: int,
    docs: list[str],
    rounds: int,
    singles: int,
    passes: int,
    reference: InProcess,
    depth: int = 4,
) -> dict[str, float]:
    cores = len(os.sched_getaffinity(0))
    batches = [docs[i : i + BATCH] for i in range(0, len(docs), BATCH)]
    # Single-threaded CPU of the workers' own encode of the same batches, in processes of their own: the
    # work itself, measured again before each pass of requests (this machine's speed drifts within minutes).
    expected = sum(map(encoder(load(model)), batches))
    work = Baseline(model, batches)
    url, process = start_server(model, workers, "--frontends", str(frontends))
    # The same server, but one that never splits a request: what a lone request's split costs.
    whole_url, whole_process = start_server(
        model, workers, "--frontends", str(frontends), "--min-chunk-chars", str(10**12)
    )
    server = psutil.Process(process.pid)
    whole_server = psutil.Process(whole_process.pid)
    result: dict[str, float] = {}
    try:
        with TokenizerClient(url, timeout=120) as client, TokenizerClient(whole_url, timeout=120) as whole:
            in_flight(whole, batches[:4], 2, "binary")
            in_flight(client, batches[:4], 2, "binary")  # warm connections, workers and heaps
            for text in docs[:200]:
                client.tokenize_batch([text], model="bench")
            # CPU per 256-document binary request, `depth` in flight: enough requests that the 10 ms
            # granularity of process CPU times does not matter.
            inproc_cpu = pair_cpu = main_cpu = worker_cpu = client_cpu = handling_ms = 0.0
            for _ in range(passes):
                inproc_cpu += work.whole()
                pair_cpu += work.pair()
                handling_ms += work.handling()  # in the same moments as the encode alone: the machine drifts
                with Meter(server, frontends) as meter:
                    tokens = in_flight(client, batches, depth, "binary")
                    assert tokens == expected, (tokens, expected)
                main_cpu += meter.main
                worker_cpu += meter.worker
                client_cpu += meter.client
            requests = len(batches) * passes
            result["main_ms"] = main_cpu / requests * 1e3
            result["worker_ms"] = worker_cpu / requests * 1e3
            result["handling_ms"] = handling_ms / passes
            result["encode_ms"] = inproc_cpu / requests * 1e3
            result["client_ms"] = client_cpu / requests * 1e3
            result["ceiling"] = worker_cpu / main_cpu
            result["efficiency"] = inproc_cpu / (main_cpu + worker_cpu)
            result["efficiency_pair"] = pair_cpu / (main_cpu + worker_cpu)
            # One request at a time: the client alone, and the server's efficiency when requests come singly
            # (a lone large request is split over the idle workers), against the server that never splits,
            # and the same encode split over two processes in-process.
            inproc_cpu = client_cpu = pair_cpu = 0.0
            # main-process CPU, worker CPU, and the library's encode inside the workers (their own clock)
            split = [0.0, 0.0, 0.0]
            never = [0.0, 0.0, 0.0]
            for _ in range(passes):
                inproc_cpu += work.whole()
                pair_cpu += work.pair()
                for target, caller, meter_of, address in (
                    (split, client, server, url),
                    (never, whole, whole_server, whole_url),
                ):
                    encoding = encode_seconds(address)
                    started = time.process_time()
                    with Meter(meter_of, frontends) as meter:
                        for batch in batches:
                            caller.tokenize_batch(batch, model="bench")
                    if caller is client:
                        client_cpu += time.process_time() - started
                    target[0] += meter.main
                    target[1] += meter.worker
                    target[2] += encode_seconds(address) - encoding
            split_cpu, whole_cpu = split[0] + split[1], never[0] + never[1]
            result["client_serial_ms"] = client_cpu / requests * 1e3
            result["efficiency_serial"] = inproc_cpu / split_cpu
            result["efficiency_whole"] = inproc_cpu / whole_cpu
            result["split_cost"] = split_cpu / whole_cpu - 1
            result["split_main_ms"] = (split[0] - never[0]) / requests * 1e3
            result["split_outside_ms"] = ((split[1] - split[2]) - (never[1] - never[2])) / requests * 1e3
            result["split_encode"] = split[2] / never[2] - 1
            result["pair_cost"] = pair_cpu / inproc_cpu - 1
            # Single texts, one at a time, then the same bodies to a bare uvicorn app (the floor).
            latencies = []
            client_started = time.process_time()
            with Meter(server, frontends) as meter:
                for text in docs[:singles]:
                    begun = time.perf_counter()
                    client.tokenize_batch([text], model="bench")
                    latencies.append(time.perf_counter() - begun)
            result["single_p50_ms"] = float(np.percentile(latencies, 50) * 1e3)
            result["single_p99_ms"] = float(np.percentile(latencies, 99) * 1e3)
            result["single_main_ms"] = meter.main / singles * 1e3
            result["single_worker_ms"] = meter.worker / singles * 1e3
            result["single_client_ms"] = (time.process_time() - client_started) / singles * 1e3
            result["single_encode_warm_ms"], result["single_encode_evicted_ms"] = work.singles()
            bare = measure_floor([frame_body({"texts": [text], "model": "bench"}) for text in docs[:singles]])
            result["floor_p50_ms"] = bare["p50_ms"]
            result["floor_server_ms"] = bare["server_ms"]
            result["floor_client_ms"] = bare["client_ms"]
            # The batch floor: the bare app reading the same 256-document bodies and answering as many bytes
            # as this service's binary answer to each: the least a server process built on uvicorn spends
            # moving a batch's bytes, and so the highest serial ceiling one could reach.
            bodies = [frame_body({"texts": batch, "model": "bench"}) for batch in batches]
            sizes = [binary_answer_bytes(url, body) for body in bodies]
            repeat = max(1, FLOOR_BATCH_REQUESTS // len(bodies))
            result["floor_batch_ms"] = measure_floor(bodies * repeat, sizes * repeat, in_flight=depth)["server_ms"]
            result["ceiling_floor"] = result["worker_ms"] / result["floor_batch_ms"]
            # The relay floor: the same, and each body written to a worker process and its answer read back from
            # it, as this server's process must: the highest serial ceiling this design could reach.
            relayed = measure_floor(bodies * repeat, sizes * repeat, relay=True, in_flight=depth)
            result["floor_relay_ms"] = relayed["server_ms"]
            result["ceiling_relay"] = result["worker_ms"] / result["floor_relay_ms"]
            # Throughput, alternating with in-process encodes in each round.
            ratios: dict[str, list[float]] = {"binary/list": [], "binary/floor": [], "json/list": [], "json/floor": []}
            busy: list[float] = []  # the cores' busy share while binary requests run (client, server, workers)
            for _ in range(rounds):
                began = time.perf_counter()
                reference.batch(docs)
                listed = time.perf_counter() - began
                began = time.perf_counter()
                if reference.library == SENTENCEPIECE:
                    reference.processor.encode(docs, num_threads=cores, out_type="numpy")
                floor = time.perf_counter() - began if reference.library == SENTENCEPIECE else math.nan
                began = time.perf_counter()
                with Meter(server, frontends) as meter:
                    in_flight(client, batches, 2, "binary")
                binary = time.perf_counter() - began
                busy.append((meter.main + meter.worker + meter.client) / (meter.wall * cores))
                began = time.perf_counter()
                in_flight(client, batches, 2, "json")
                json = time.perf_counter() - began
                ratios["binary/list"].append(listed / binary)
                ratios["binary/floor"].append(floor / binary)
                ratios["json/list"].append(listed / json)
                ratios["json/floor"].append(floor / json)
                result["binary_docs_s"] = max(result.get("binary_docs_s", 0.0), len(docs) / binary)
                result["list_docs_s"] = max(result.get("list_docs_s", 0.0), len(docs) / listed)
            for name, values in ratios.items():
                result[name] = statistics.median(values)
            result["busy"] = statistics.median(busy)
    finally:
        work.close()
        stop(process)
        stop(whole_process)
    return result


ROWS = [
    ("serial ceiling (worker CPU / main CPU, 256-doc request, {depth} in flight)", "ceiling", "{:.1f}"),
    ("main-process CPU per 256-doc request (ms)", "main_ms", "{:.2f}"),
    (
        "floor: bare uvicorn app, same bodies in, same answer bytes out, {depth} in flight: server CPU (ms)",
        "floor_batch_ms",
        "{:.2f}",
    ),
    ("serial ceiling at that floor (worker CPU / the floor's server CPU)", "ceiling_floor", "{:.1f}"),
    ("relay floor: the same, each body to a worker and its answer back: server CPU (ms)", "floor_relay_ms", "{:.2f}"),
    ("serial ceiling at the relay floor (the most a server handing bodies on can reach)", "ceiling_relay", "{:.1f}"),
    ("worker CPU per 256-doc request (ms)", "worker_ms", "{:.2f}"),
    ("  the same job in a process of its own, no sockets: parse, checks, encode, answer (ms)", "handling_ms", "{:.2f}"),
    ("  the library's encode alone, in a process of its own (ms)", "encode_ms", "{:.2f}"),
    ("CPU efficiency, {depth} in flight (in-process encode CPU / server CPU)", "efficiency", "{:.2f}"),
    ("  against the same encode on 2 processes at once (both cores busy)", "efficiency_pair", "{:.2f}"),
    ("CPU efficiency, one request at a time", "efficiency_serial", "{:.2f}"),
    ("CPU efficiency, one request at a time, never split (--min-chunk-chars huge)", "efficiency_whole", "{:.2f}"),
    ("a lone request's split: server CPU split / never split - 1", "split_cost", "{:+.1%}"),
    ("  of which: server-process CPU, split - never split (ms per request)", "split_main_ms", "{:+.2f}"),
    ("  of which: workers' CPU outside the library's encode, split - never split (ms)", "split_outside_ms", "{:+.2f}"),
    ("  the library's encode in the workers (their own clock), split / never split - 1", "split_encode", "{:+.1%}"),
    ("the same encode on 2 processes at once, in-process / on one - 1", "pair_cost", "{:+.1%}"),
    ("single text p50 (ms)", "single_p50_ms", "{:.2f}"),
    ("single text p99 (ms)", "single_p99_ms", "{:.2f}"),
    ("main-process CPU per single text (ms)", "single_main_ms", "{:.3f}"),
    ("worker CPU per single text (ms)", "single_worker_ms", "{:.3f}"),
    ("client CPU per single text (ms)", "single_client_ms", "{:.3f}"),
    ("the library's encode of one text in-process, caches warm (ms)", "single_encode_warm_ms", "{:.3f}"),
    ("the same after touching 64 MiB, as between requests (ms)", "single_encode_evicted_ms", "{:.3f}"),
    ("floor: bare uvicorn app, same client transport: p50 (ms)", "floor_p50_ms", "{:.2f}"),
    ("floor: its server CPU per request (ms)", "floor_server_ms", "{:.3f}"),
    ("floor: its client CPU per request (ms)", "floor_client_ms", "{:.3f}"),
    ("client CPU per 256-doc binary request, 1 in flight (ms)", "client_serial_ms", "{:.2f}"),
    ("client CPU per 256-doc binary request, {depth} in flight (ms)", "client_ms", "{:.2f}"),
    ("binary, 2 in flight / the library's batch call", "binary/list", "{:.2f}"),
    ("binary, 2 in flight / numpy floor (SentencePiece)", "binary/floor", "{:.2f}"),
    ("  the cores' busy share meanwhile (client + server CPU / wall time x cores)", "busy", "{:.2f}"),
    ("JSON, 2 in flight / the library's batch call", "json/list", "{:.2f}"),
    ("JSON, 2 in flight / numpy floor (SentencePiece)", "json/floor", "{:.2f}"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", type=Path, default=default_corpus(), help=".txt or .jsonl (default: multilingual)")
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--docs", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--frontends", type=int, default=1, help="server processes sharing the port (SO_REUSEPORT)")
    parser.add_argument("--singles", type=int, default=3000)
    parser.add_argument("--passes", type=int, default=12, help="times the documents are sent for the CPU figures")
    parser.add_argument("--in-flight", type=int, default=4, help="requests in flight for the CPU figures per request")
    parser.add_argument(
        "--model",
        type=Path,
        help="a .model, tokenizer.json (or its directory) or .tiktoken (default: a 16k unigram trained on the corpus)",
    )
    args = parser.parse_args()

    docs, model = documents_and_model(args.corpus, args.docs, args.model, vocab_size=16000)
    cores = len(os.sched_getaffinity(0))
    reference = InProcess(find_model_files("bench", model), cores)
    vocab = f"{reference.library}, vocab {reference.model.vocab_size}"
    describe_corpus(args.corpus, docs, f"model {model.name} ({vocab})", f"{cores} cores")
    results = {}
    for workers in args.workers:
        print(f"measuring --workers {workers} --frontends {args.frontends} ...", flush=True)
        results[workers] = measure(
            model, workers, args.frontends, docs, args.rounds, args.singles, args.passes, reference, args.in_flight
        )
    print()
    print("| measure | " + " | ".join(f"--workers {w}" for w in results) + " |")
    print("|---|" + "---:|" * len(results))
    for label, key, form in ROWS:
        label = label.format(depth=args.in_flight)
        print(f"| {label} | " + " | ".join(form.format(result[key]) for result in results.values()) + " |")


if __name__ == "__main__":
    main()
