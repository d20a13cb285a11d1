"""`tokenizer-bench`: where tokenization time goes on your own data, in one table.

    tokenizer-bench --model FILE --corpus FILE [--docs N] [--url URL] [--rounds R] [--workers N]

On the first N documents of the corpus (one file of any kind tokenizer-pretokenize reads; read as it
reads it), measured in the same run, in alternating rounds, against the batched in-process call:

  per-sample loop     for text in docs: sp.encode(text)             (what a naive Dataset does)
  batched             sp.encode(docs, num_threads=workers)          (the baseline; tok.encode_batch with
                      as many Rayon threads, enc.encode_ordinary_batch for tokenizers and tiktoken models)
  service             TokenizerClient.tokenize_batch, one request at a time
  prefetch            TokenizerClient.prefetch: requests in flight while the consumer works
  pretokenize         tokenizer-pretokenize --local into shards (paid once per dataset)
  pre-tokenized read  TokenDataset[i] for every document (what every epoch pays after that)

It starts a server on a free loopback port for the service rows, or uses --url (which must serve the
same model file: it is found by sha256). Every row must produce the same number of tokens.
"""

from __future__ import annotations

import argparse
import itertools
import shutil
import statistics
import sys
import tempfile
import time
import unicodedata
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import orjson

from tokenizer_client import TokenizerClient, TokenizerError
from tokenizer_client.dataset import TokenDataset
from tokenizer_client.urls import parse_urls
from tokenizer_service.core.models import find_model_files
from tokenizer_service.core.reference import InProcess
from tokenizer_service.core.registry import inspect_model
from tokenizer_service.entry import ArgumentParser
from tokenizer_service.settings import usable_cpus
from tokenizer_service.tools.launcher import ServerNotReady, ServerProcess
from tokenizer_service.tools.pretokenize.run import Options, run
from tokenizer_service.tools.pretokenize.sources import DocumentReader, InputError, Source

BATCH = 256
BASELINE = "batched"


@dataclass(frozen=True)
class Method:
    name: str
    how: str
    run: Callable[[], int]  # returns the number of tokens it produced


def read_corpus(path: Path, count: int, text_field: str) -> list[str]:
    """The first `count` documents, as the pre-tokenizer reads them; bad records are reported and skipped."""
    reader = DocumentReader([Source.from_path(path)], text_field, lambda message: print(message, file=sys.stderr))
    return [text for text, _ in itertools.islice(reader, count)]


@contextmanager
def local_server(model: Path, workers: int, timeout: float = 120.0) -> Iterator[tuple[str, str]]:
    """A tokenizer-server on a free loopback port serving `model` as "bench"; yields (url, model name)."""
    args = ["--workers", str(workers), "--model", f"bench={model}", "--log-level", "warning"]
    server = ServerProcess(args)
    try:
        server.start(timeout=timeout)
    except ServerNotReady as exc:
        raise RuntimeError(str(exc)) from None
    try:
        yield server.url, "bench"
    finally:
        server.stop()
        server.log.unlink(missing_ok=True)


def served_name(url: str, sha256: str) -> str:
    """The name under which the service at `url` serves the model file with this sha256."""
    with TokenizerClient(url) as client:
        models = client.models()["models"]
    for model in models:
        if model["sha256"] == sha256:
            return str(model["name"])
    names = ", ".join(f"{model['name']} ({model['sha256'][:12]}…)" for model in models)
    raise SystemExit(f"tokenizer-bench: {url} does not serve this model file ({sha256[:12]}…); it serves {names}")


@contextmanager
def given_server(url: str, sha256: str) -> Iterator[tuple[str, str]]:
    """A running service (--url); yields (url, the name it serves this model file under)."""
    yield url, served_name(url, sha256)


def methods(
    reference: InProcess,
    docs: list[str],
    model: Path,
    workers: int,
    client: TokenizerClient,
    name: str,
    scratch: Path,
) -> list[Method]:
    corpus = scratch / "docs.jsonl"
    with corpus.open("wb") as file:
        for doc in docs:
            file.write(orjson.dumps({"text": doc}) + b"\n")
    shards = scratch / "shards"
    batches = [docs[i : i + BATCH] for i in range(0, len(docs), BATCH)]

    def pretokenize() -> int:
        shutil.rmtree(shards, ignore_errors=True)
        options = Options(inputs=[str(corpus)], output=shards, model=str(model), workers=workers, add_eos=False)
        summary = run(options, report_bad=lambda message: print(message, file=sys.stderr))
        return int(summary.metadata["tokens"])

    def read_shards() -> int:
        dataset = TokenDataset(shards)
        return sum(len(dataset[i]) for i in range(len(dataset)))

    def prefetch() -> int:
        with client.prefetch(docs, batch_size=BATCH, depth=2 * workers, model=name) as stream:
            return sum(batch.num_tokens for batch in stream)

    return [
        Method("per-sample loop", reference.one_call, lambda: sum(len(reference.one(d)) for d in docs)),
        Method(BASELINE, reference.batch_call, lambda: reference.tokens(docs)),
        Method(
            "service",
            f"client.tokenize_batch, {BATCH} a request, 1 in flight",
            lambda: sum(client.tokenize_batch(batch, model=name).num_tokens for batch in batches),
        ),
        Method("prefetch", f"client.prefetch(batch_size={BATCH}, depth={2 * workers})", prefetch),
        Method("pretokenize", f"tokenizer-pretokenize --local --workers {workers} (once)", pretokenize),
        Method("pre-tokenized read", "TokenDataset(dir)[i] for every document", read_shards),
    ]


def alternate(
    runs: Mapping[str, Callable[[], int]], rounds: int, after_round: Callable[[int], object] = lambda done: None
) -> tuple[dict[str, list[float]], dict[str, int]]:
    """Every run once a round, in order, `rounds` times (machines drift: ratios are taken round by round);
    the seconds of each run in every round, and the tokens it produced. `after_round` gets the rounds done."""
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    tokens: dict[str, int] = {}
    for done in range(1, rounds + 1):
        for name, method in runs.items():
            started = time.perf_counter()
            tokens[name] = method()
            seconds[name].append(time.perf_counter() - started)
        after_round(done)
    return seconds, tokens


def describe_documents(docs: list[str], source: str) -> str:
    """'N documents from SOURCE (mean M characters, P% not NFKC-normalized)': how long the texts are, and how
    many a normalizing tokenizer has to change (web text: most of them)."""
    chars = sum(len(doc) for doc in docs) / max(len(docs), 1)
    not_nfkc = sum(not unicodedata.is_normalized("NFKC", doc) for doc in docs) / max(len(docs), 1)
    return f"{len(docs):,} documents from {source} (mean {chars:,.0f} characters, {not_nfkc:.0%} not NFKC-normalized)"


def table(candidates: list[Method], seconds: dict[str, list[float]], tokens: dict[str, int], docs: int) -> str:
    lines = ["| method | what | docs/s | M tokens/s | vs batched |", "|---|---|---:|---:|---:|"]
    for method in candidates:
        best = min(seconds[method.name])
        pairs = zip(seconds[method.name], seconds[BASELINE], strict=True)
        ratio = statistics.median(baseline / spent for spent, baseline in pairs)
        lines.append(
            f"| {method.name} | {method.how} | {docs / best:,.0f} | {tokens[method.name] / best / 1e6:.3g} | "
            f"{ratio:.2f} |"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="tokenizer-bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model",
        type=Path,
        required=True,
        help="a SentencePiece .model, a tokenizer.json (or its directory) or a *.tiktoken file",
    )
    parser.add_argument(
        "--corpus",
        type=Path,
        required=True,
        help="one input file, of any kind tokenizer-pretokenize reads (.jsonl, .txt, .parquet; .gz, .zst)",
    )
    parser.add_argument("--docs", type=int, default=5000, help="documents to use (default: 5000)")
    parser.add_argument("--text-field", default="text", help="JSON field of the text (default: text)")
    parser.add_argument("--url", help="a running tokenizer-service (default: start one here)")
    parser.add_argument("--workers", type=int, default=usable_cpus(), help="threads, processes (default: cores)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds; ratios are medians (default: 3)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.docs < 1 or args.rounds < 1 or args.workers < 1:
        parser.error("--docs, --rounds and --workers must be positive")
    if args.url is not None:
        try:
            parse_urls(args.url)
        except ValueError as exc:
            parser.error(str(exc))
    # the server this starts, and the pre-tokenizer's workers, run from elsewhere: hand on absolute paths
    args.model, args.corpus = args.model.expanduser().resolve(), args.corpus.expanduser().resolve()
    for flag, path in (("--model", args.model), ("--corpus", args.corpus)):
        if not path.exists():
            parser.error(f"{flag} {path}: no such file or directory")
    try:
        info = inspect_model("bench", args.model)
        docs = read_corpus(args.corpus, args.docs, args.text_field)
    except (InputError, OSError, RuntimeError) as exc:
        raise SystemExit(f"tokenizer-bench: {exc}") from exc
    if not docs:
        raise SystemExit(f"tokenizer-bench: no documents in {args.corpus}")
    reference = InProcess(find_model_files("bench", args.model), args.workers)
    print(
        f"{describe_documents(docs, args.corpus.name)}; "
        f"model {args.model.name} ({info.library} {info.type}, vocab {info.vocab_size:,}, served by {info.encoder}); "
        f"{args.workers} workers; {args.rounds} rounds",
        flush=True,
    )
    service = local_server(args.model, args.workers) if args.url is None else given_server(args.url, info.sha256)
    try:
        with (
            tempfile.TemporaryDirectory(prefix="tokenizer-bench-") as scratch,
            service as (url, name),
            TokenizerClient(url, timeout=300) as client,
        ):
            candidates = methods(reference, docs, args.model, args.workers, client, name, Path(scratch))
            client.tokenize_batch(docs[:BATCH], model=name)  # connections and workers warm
            seconds, tokens = alternate({method.name: method.run for method in candidates}, args.rounds)
    except TokenizerError as exc:  # the --url server is down, or refuses
        raise SystemExit(f"tokenizer-bench: {exc}") from exc
    if len(set(tokens.values())) != 1:
        raise SystemExit(f"tokenizer-bench: the methods disagree on the number of tokens: {tokens}")
    print()
    print(table(candidates, seconds, tokens, len(docs)))
    print()
    print(
        "docs/s and tokens/s: best round; vs batched: median over rounds of the per-round time ratio "
        f"(above 1 is faster than the batched in-process {info.library} call). The service rows include HTTP and the "
        "client's own CPU on this machine; pretokenize includes reading the file, starting its workers and "
        "writing shards."
    )
    return 0
