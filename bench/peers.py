"""Pre-tokenizing a Parquet corpus: the service's pre-tokenizer against the tools people use instead (issue 33).

    python -m bench.pretokenize --peers [--rounds R] [--mb 40] [--fresh] [--model DIR] [--only NAME,...]

On one machine, the same cores, the same Parquet corpus and the same byte-level BPE `tokenizer.json`:

  us         tokenizer-pretokenize --local, then tokenizer-shards export --to megatron (two commands, one after
             the other, as a user runs them)
  gigatoken  gigatoken's own Parquet pipeline (`gigatoken.encode_parquet`)
  datatrove  datatrove's ParquetReader -> DocumentTokenizer, LocalPipelineExecutor with 2 tasks on 2 workers
  datasets   Hugging Face datasets: Dataset.from_parquet(...).map(tokenize, batched=True, num_proc=2)

Each peer is installed once, with pip, into a venv of its own under bench/results/peers/ (one that cannot
install is skipped, with pip's last line). Each run is a command line started from here: wall time, CPU time
of its whole process tree (psutil, every process of the tree sampled every 20 ms; getrusage of the waited
children, which also counts processes shorter than a sample, whichever is larger), the peak of the tree's
summed resident set. The ids every tool wrote are read back and compared, document by document, with the
reference library, `tokenizers` (the peers' mode: special-token strings in the text become their control ids;
ours: they stay text, as the service encodes them unless parse_special_tokens).

The corpus: the shared multilingual corpus (1,970 documents, 10 languages, 5.9 MB) repeated until it reaches
--mb; copy k of a document has its paragraphs rotated by k (then, if that text was already used, a paragraph of
another document appended), so no two documents are byte-identical; one document in 500 has a special-token
string inserted between two paragraphs (as web text sometimes holds one). With --fresh, the corpus is instead
--mb of fresh documents from Debian packages, none repeated (bench/fresh_corpus.py). The model: without --model, a
128k byte-level BPE (Llama 3's split pattern) trained once on the multilingual corpus's unique text
(bench/results/).

After the tables: our steady state, the CPU of the run less that of the 20-document run over the MB between them,
against two floors on the same texts in this process (CPU of the first pass and the best of 3; the later passes
find the texts' words in the encoder's caches): fastokens' `encode_batch_flat`, and gigatoken's `encode` of each
text's UTF-8, the call the service makes where the gate serves a model with gigatoken (app/core/encoders.py's
Gigatoken), as it serves the default model here. Issue 33's target: within 1.25x.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from bench.inputs import MULTILINGUAL_CORPUS, RESULTS, ROOT, compile_service, write_byte_level_bpe

PEERS = RESULTS / "peers"
VOCAB = 128_000
SPECIALS = ["<|endoftext|>", "<|begin_of_text|>", "<|end_of_text|>"]
EOS = "<|endoftext|>"
VERSIONS = {"gigatoken": "gigatoken==0.10.0", "datatrove": "datatrove[io]==0.10.1", "datasets": "datasets==5.2.0"}
SPECIAL_EVERY = 500


def source_documents(corpus: Path = MULTILINGUAL_CORPUS) -> list[str]:
    with corpus.open(encoding="utf-8") as file:
        return [json.loads(line)["text"] for line in file if line.strip()]


def corpus_documents(megabytes: float, corpus: Path = MULTILINGUAL_CORPUS) -> list[str]:
    """The corpus's documents repeated, varied (see the module's docstring) until their UTF-8 reaches `megabytes`."""
    base = source_documents(corpus)
    paragraphs = [doc.split("\n\n") for doc in base]
    seen: set[str] = set()
    documents: list[str] = []
    size, copy = 0, 0
    while size < megabytes * 1e6:
        for index, parts in enumerate(paragraphs):
            shift = copy % len(parts)
            text = "\n\n".join(parts[shift:] + parts[:shift])
            extra = 1
            while text in seen:
                text += "\n\n" + paragraphs[(index + copy * 7 + extra) % len(paragraphs)][0]
                extra += 1
            seen.add(text)
            if len(documents) % SPECIAL_EVERY == SPECIAL_EVERY - 1:
                cut = text.find("\n\n")
                special = SPECIALS[(len(documents) // SPECIAL_EVERY) % len(SPECIALS)]
                text = text + special if cut < 0 else text[:cut] + "\n\n" + special + text[cut:]
            documents.append(text)
            size += len(text.encode("utf-8"))
            if size >= megabytes * 1e6:
                break
        copy += 1
    return documents


def build_corpus(megabytes: float) -> tuple[Path, list[str]]:
    """The Parquet file (one column, text; row groups of 1,000 documents, zstd as FineWeb ships) and its texts."""

    documents = corpus_documents(megabytes)
    return write_parquet(PEERS / f"corpus-{megabytes:g}mb" / "corpus.parquet", documents), documents


def write_parquet(path: Path, documents: list[str]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        pq.write_table(pa.table({"text": documents}), partial, row_group_size=1000, compression="zstd")
        partial.rename(path)
    return path


def peer_model(documents: list[str]) -> Path:
    """A 128k byte-level BPE tokenizer.json (Llama 3's split pattern, <|endoftext|> as EOS), trained once on the
    unique source text; its directory."""
    directory = RESULTS / f"bpe-{VOCAB // 1000}k-{MULTILINGUAL_CORPUS.stem}"
    if (directory / "tokenizer.json").exists():
        return directory
    print(f"training a {VOCAB // 1000}k byte-level BPE on {MULTILINGUAL_CORPUS.name} (once) ...", flush=True)
    config = {"eos_token": EOS, "bos_token": "<|begin_of_text|>"}
    return write_byte_level_bpe(directory, source_documents(), VOCAB, list(SPECIALS), config)


# A route not built yet (the seventh session's closing note): gigatoken's own Parquet pipeline over the encoder built as
# the service builds it (`load_hf_json` of the tokenizer.json without its special tokens), run by this venv's python
GIGATOKEN_ON_OURS = """
import sys
from pathlib import Path

import awkward as ak
import gigatoken
import numpy as np
from gigatoken import gigatoken_rs

from tokenizer_service.core.encoders import without_special_tokens

tokenizer, corpus, out = sys.argv[1:4]
backend = gigatoken_rs.load_hf_json(without_special_tokens(Path(tokenizer).read_text(encoding="utf-8")))
documents = gigatoken.Tokenizer(backend).encode_files(gigatoken.ParquetFileSource([corpus], column="text"))
Path(out).mkdir(parents=True, exist_ok=True)
np.save(Path(out) / "ids.npy", ak.to_numpy(ak.flatten(documents)))
np.save(Path(out) / "lengths.npy", ak.to_numpy(ak.num(documents)))
"""

RUNNERS = {
    "gigatoken": """
import sys
from pathlib import Path

import awkward as ak
import gigatoken
import numpy as np

tokenizer, corpus, out = sys.argv[1:4]
documents = gigatoken.Tokenizer(tokenizer).encode_files(gigatoken.ParquetFileSource([corpus], column="text"))
Path(out).mkdir(parents=True, exist_ok=True)
np.save(Path(out) / "ids.npy", ak.to_numpy(ak.flatten(documents)))
np.save(Path(out) / "lengths.npy", ak.to_numpy(ak.num(documents)))
""",
    "datatrove": """
import sys
from pathlib import Path

from datatrove.executor import LocalPipelineExecutor
from datatrove.pipeline.readers import ParquetReader
from datatrove.pipeline.tokens.megatron_tokenizer import MegatronDocumentTokenizer

if __name__ == "__main__":  # its workers import this script again
    tokenizer, corpus, out, eos = sys.argv[1:5]
    LocalPipelineExecutor(
        pipeline=[
            ParquetReader(str(Path(corpus).parent), glob_pattern=Path(corpus).name, text_key="text"),
            MegatronDocumentTokenizer(
                output_folder=out, tokenizer_name_or_path=tokenizer, eos_token=eos, save_filename="doc"
            ),
        ],
        tasks=2,
        workers=2,
        logging_dir=str(Path(out) / "logs"),
    ).run()
""",
    "datasets": """
import json
import sys
from pathlib import Path

from datasets import Dataset
from tokenizers import Tokenizer

tokenizer, corpus, out, eos = sys.argv[1:5]
tok = Tokenizer.from_file(tokenizer)
eos_id = tok.token_to_id(eos)


def tokenize(batch):
    return {"input_ids": [encoding.ids + [eos_id] for encoding in tok.encode_batch(batch["text"])]}


if __name__ == "__main__":
    dataset = Dataset.from_parquet(corpus, cache_dir=str(Path(out) / "cache"))
    tokenized = dataset.map(tokenize, batched=True, num_proc=2, remove_columns=["text"])
    (Path(out) / "files.json").write_text(json.dumps([f["filename"] for f in tokenized.cache_files]))
""",
}


@dataclass
class Measured:
    wall: float
    cpu: float
    rss: int  # peak of the tree's summed resident set, bytes


def measure(command: list[str], log: Path, env: dict[str, str] | None = None) -> Measured:
    """Run `command` to its end: wall, CPU of its whole process tree, peak summed RSS (see the docstring)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    with log.open("ab") as output:
        process = psutil.Popen(command, stdout=output, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        seen: dict[tuple[int, float], float] = {}
        peak = 0
        while process.poll() is None:
            rss = 0
            for member in [process, *_children(process)]:
                try:
                    with member.oneshot():
                        times, memory, born = member.cpu_times(), member.memory_info(), member.create_time()
                except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                    continue
                seen[(member.pid, born)] = times.user + times.system
                rss += memory.rss
            peak = max(peak, rss)
            time.sleep(0.02)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    waited = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited {process.returncode}; see {log}")
    return Measured(wall, max(waited, sum(seen.values())), peak)


def _children(process: psutil.Process) -> list[psutil.Process]:
    try:
        return process.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def install(peer: str) -> Path | None:
    """The python of `peer`'s own venv (created and installed once), or None, said why, when pip cannot."""
    venv = PEERS / f"venv-{peer}"
    python = venv / "bin" / "python"
    marker = venv / "installed"
    if marker.exists():
        return python
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    pip = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", VERSIONS[peer], "tokenizers==0.23.3", "pyarrow"],
        capture_output=True,
        text=True,
    )
    if pip.returncode != 0:
        last = (pip.stderr.strip().splitlines() or ["pip failed"])[-1]
        print(f"skipping {peer}: it cannot install here ({last})", flush=True)
        return None
    marker.write_text(VERSIONS[peer])
    return python


def read_megatron(prefix: Path) -> tuple[np.ndarray, np.ndarray]:
    """(ids, lengths) of a Megatron indexed dataset (prefix.bin, prefix.idx)."""
    import struct

    head = struct.Struct("<9sQBQQ")
    index = prefix.with_name(prefix.name + ".idx").read_bytes()
    _, _, code, count, _ = head.unpack_from(index)
    lengths = np.frombuffer(index, dtype="<i4", count=count, offset=head.size).astype(np.int64)
    dtype = {8: "<u2", 4: "<i4"}[code]
    return np.fromfile(prefix.with_name(prefix.name + ".bin"), dtype=dtype).astype(np.int64), lengths


def read_output(tool: str, out: Path) -> tuple[np.ndarray, np.ndarray]:
    """(ids, lengths) a tool wrote, document by document, in the corpus's order."""
    if tool in ("us", "datatrove"):
        prefixes = sorted(p.with_suffix("") for p in (out / "megatron" if tool == "us" else out).rglob("*.idx"))
        parts = [read_megatron(prefix) for prefix in prefixes]
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
    if tool == "gigatoken":
        return np.load(out / "ids.npy").astype(np.int64), np.load(out / "lengths.npy").astype(np.int64)
    import pyarrow as pa

    ids, lengths = [], []
    for name in json.loads((out / "files.json").read_text()):
        with pa.memory_map(name) as source:
            column = pa.ipc.open_stream(source).read_all().column("input_ids").combine_chunks()
        ids.append(column.values.to_numpy().astype(np.int64))
        lengths.append(np.diff(column.offsets.to_numpy()).astype(np.int64))
    return np.concatenate(ids), np.concatenate(lengths)


@dataclass
class Reference:
    """tokenizers' ids of every document: special-token strings as text (ours), and parsed (the peers')."""

    ids: list[np.ndarray]
    parsed: list[np.ndarray]  # the same array where a document holds no special-token string
    specials: int  # documents holding one

    @classmethod
    def of(cls, model: Path, documents: list[str]) -> Reference:
        from tokenizers import Tokenizer

        key = hashlib.sha256((model / "tokenizer.json").read_bytes() + "\0".join(documents).encode()).hexdigest()[:16]
        cache = PEERS / f"reference-{key}.npz"
        if not cache.exists():
            tok = Tokenizer.from_file(str(model / "tokenizer.json"))
            tok.encode_special_tokens = True
            plain = _encoded(tok, documents)
            tok.encode_special_tokens = False
            holding = [i for i, doc in enumerate(documents) if any(s in doc for s in SPECIALS)]
            parsed = _encoded(tok, [documents[i] for i in holding])
            lengths = np.array([len(x) for x in plain])
            np.savez(
                cache,
                ids=np.concatenate(plain),
                lengths=lengths,
                holding=np.array(holding, dtype=np.int64),
                parsed=np.concatenate(parsed) if parsed else np.zeros(0, np.int64),
                parsed_lengths=np.array([len(x) for x in parsed], dtype=np.int64),
            )
        data = np.load(cache)
        plain = np.split(data["ids"], np.cumsum(data["lengths"])[:-1])
        parsed = list(plain)
        # not strict: with no document holding a special-token string, np.split still yields one (empty) piece
        pieces = np.split(data["parsed"], np.cumsum(data["parsed_lengths"])[:-1])
        for index, ids in zip(data["holding"], pieces, strict=False):
            parsed[int(index)] = ids
        return cls(plain, parsed, len(data["holding"]))

    def check(self, ids: np.ndarray, lengths: np.ndarray, eos: int | None) -> tuple[int, int]:
        """(documents equal to our mode's ids, documents equal to the peers' mode's), EOS stripped if written."""
        if len(lengths) != len(self.ids):
            return 0, 0
        rows = np.split(ids, np.cumsum(lengths)[:-1])
        ours = peers = 0
        for row, plain, parsed in zip(rows, self.ids, self.parsed, strict=True):
            if eos is not None:
                if not len(row) or row[-1] != eos:
                    continue
                row = row[:-1]
            ours += len(row) == len(plain) and bool(np.array_equal(row, plain))
            peers += len(row) == len(parsed) and bool(np.array_equal(row, parsed))
        return ours, peers


def _encoded(tok: Any, documents: list[str], batch: int = 10_000) -> list[np.ndarray]:
    """tokenizers' ids of each document, `batch` documents at a time (an Encoding holds every token's string too:
    hundreds of MB of text at once would take many GB)."""
    ids: list[np.ndarray] = []
    for start in range(0, len(documents), batch):
        encodings = tok.encode_batch_fast(documents[start : start + batch], add_special_tokens=False)
        ids += [np.array(e.ids) for e in encodings]
    return ids


TOOLS = ("us", "gigatoken", "datatrove", "datasets")
LABELS = {
    "us": "`tokenizer-pretokenize --local` + Megatron export",
    "gigatoken": "gigatoken 0.10.0 (its own Parquet pipeline)",
    "datatrove": "datatrove 0.10.1 (2 tasks, 2 workers)",
    "datasets": "Hugging Face datasets 5.2.0 `map(num_proc=2)`",
}


def commands(tool: str, python: Path, corpus: Path, model: Path, out: Path) -> list[str]:
    if tool == "us":
        bin_dir = Path(sys.executable).parent
        return [
            "sh",
            "-c",
            f"{bin_dir}/tokenizer-pretokenize {corpus} --local --model {model} --output {out}/shards -q && "
            f"{bin_dir}/tokenizer-shards export {out}/shards --to megatron --output {out}/megatron/doc -q",
        ]
    return [str(python), str(PEERS / f"run_{tool}.py"), str(model / "tokenizer.json"), str(corpus), str(out), EOS]


def encoder_floor(model: Path, documents: list[str]) -> tuple[float, float]:
    """CPU seconds of fastokens' encode_batch_flat on the documents in this process: (first call, best of 3)."""
    import fastokens

    fast = fastokens.Tokenizer.from_json_str((model / "tokenizer.json").read_text(encoding="utf-8"))
    fast.no_truncation()
    fast.no_padding()
    spent = []
    for _ in range(3):
        started = time.process_time()
        fast.encode_batch_flat(documents, add_special_tokens=False, split_special_tokens=True)
        spent.append(time.process_time() - started)
    return spent[0], min(spent)


def gigatoken_floor(model: Path, documents: list[str]) -> tuple[float, float]:
    """CPU seconds of gigatoken's `encode` of each document's UTF-8 in this process, the encoder built as the
    service builds it (`load_hf_json` of the tokenizer.json without its special tokens): (first pass, best of 3)."""
    from gigatoken import gigatoken_rs

    from tokenizer_service.core.encoders import without_special_tokens

    backend = gigatoken_rs.load_hf_json(without_special_tokens((model / "tokenizer.json").read_text(encoding="utf-8")))
    encode = backend.encode
    texts = [document.encode("utf-8") for document in documents]  # the service's workers get UTF-8 bytes
    spent = []
    for _ in range(3):
        started = time.process_time()
        for text in texts:
            encode(text)
        spent.append(time.process_time() - started)
    return spent[0], min(spent)


def run_peers(
    rounds: int, megabytes: float, model: Path | None, only: list[str], corpus: tuple[Path, list[str]] | None = None
) -> None:
    """`corpus`: a Parquet file and its texts (bench.fresh_corpus's), else the repeated one of --mb."""
    import platform
    import statistics

    from tokenizers import Tokenizer

    if corpus is None:
        corpus, documents = build_corpus(megabytes)
        small = write_parquet(PEERS / "corpus-20docs" / "corpus.parquet", documents[:20])
    else:
        corpus, documents = corpus
        small = write_parquet(corpus.parent / "20docs" / "corpus.parquet", documents[:20])
    model = model or peer_model(documents)
    eos = Tokenizer.from_file(str(model / "tokenizer.json")).token_to_id(EOS)
    text_mb = sum(len(doc.encode("utf-8")) for doc in documents) / 1e6
    tools = [tool for tool in TOOLS if tool in only]
    pythons: dict[str, Path] = {}
    for tool in tools:
        python = Path(sys.executable) if tool == "us" else install(tool)
        if python is not None:
            pythons[tool] = python
            if tool != "us":
                (PEERS / f"run_{tool}.py").write_text(textwrap.dedent(RUNNERS[tool]).lstrip())
    cache = PEERS / "cache"
    env = {**os.environ, "TOKENIZER_CACHE_DIR": str(cache), "TOKENIZERS_PARALLELISM": "true"}
    log = PEERS / "runs.log"
    out = PEERS / "out"
    print(
        f"{platform.node()}: {os.cpu_count()} cores ({len(os.sched_getaffinity(0))} usable), "
        f"{psutil.virtual_memory().total / 2**30:.0f} GiB, "
        f"{platform.python_implementation()} {platform.python_version()}, "
        f"load average {os.getloadavg()[0]:.1f}; corpus {corpus} ({len(documents):,} documents, {text_mb:.1f} MB of "
        f"text, {corpus.stat().st_size / 1e6:.1f} MB of Parquet), model {model.name}",
        flush=True,
    )
    reference = Reference.of(model, documents)
    small_reference = Reference.of(model, documents[:20])
    extra: dict[str, Measured] = {}
    if "us" in pythons:
        compile_service()  # as pip installs it, where a peer's venv has its modules compiled
        shutil.rmtree(cache, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)
        extra["us, no gate verdict cached (first run on this model)"] = measure(
            commands("us", pythons["us"], corpus, model, out / "us"), log, env
        )
        gate = (
            "from pathlib import Path; from tokenizer_service.core.registry import inspect_model; "
            f"assert inspect_model('bench', Path({str(model)!r}), wait=True).gate == 'passed'"
        )
        extra["the gate's verdict, computed once (inspect_model(..., wait=True))"] = measure(
            [sys.executable, "-c", gate], log, env
        )
    results: dict[str, list[Measured]] = {tool: [] for tool in pythons}
    small_results: dict[str, list[Measured]] = {tool: [] for tool in pythons}
    correct: dict[str, tuple[int, int]] = {}
    for round_index in range(rounds):
        order = list(pythons)[round_index % len(pythons) :] + list(pythons)[: round_index % len(pythons)]
        for tool in order:
            for texts, sink, ref in ((corpus, results, reference), (small, small_results, small_reference)):
                shutil.rmtree(out, ignore_errors=True)
                measured = measure(commands(tool, pythons[tool], texts, model, out / tool), log, env)
                sink[tool].append(measured)
                ids, lengths = read_output(tool, out / tool)
                checked = ref.check(ids, lengths, None if tool == "gigatoken" else eos)
                if texts == corpus:
                    correct[tool] = min(correct.get(tool, checked), checked)
                elif max(checked) < len(ref.ids):
                    print(f"{tool}: the 20-document output differs from the reference", flush=True)
            print(
                f"round {round_index + 1}/{rounds} {tool}: {results[tool][-1].wall:.2f} s wall, "
                f"{results[tool][-1].cpu:.2f} CPU-s; 20 documents: {small_results[tool][-1].wall:.2f} s, "
                f"{small_results[tool][-1].cpu:.2f} CPU-s",
                flush=True,
            )
    first, best = encoder_floor(model, documents)
    giga_first, giga_best = gigatoken_floor(model, documents)
    route = PEERS / "run_gigatoken_on_ours.py"
    route.write_text(GIGATOKEN_ON_OURS.lstrip())
    on_ours: list[Measured] = []
    for _ in range(rounds):
        shutil.rmtree(out, ignore_errors=True)
        on_ours.append(measure([sys.executable, str(route), str(model / "tokenizer.json"), str(corpus), str(out)], log))
    on_ours_correct = reference.check(*read_output("gigatoken", out), None)[0]

    def median(values: list[float]) -> float:
        return statistics.median(values)

    us_wall = median([m.wall for m in results["us"]]) if "us" in results else float("nan")
    us_cpu = median([m.cpu for m in results["us"]]) if "us" in results else float("nan")
    count = len(documents)
    print()
    print(
        f"{count:,} documents, {text_mb:.1f} MB of text; medians of {rounds} rounds; "
        f"{reference.specials} documents hold a special-token string"
    )
    print()
    print("| tool | wall s | CPU s | MB per CPU-s | peak RSS MiB | ids correct | wall vs us | CPU vs us |")
    print("|---|---:|---:|---:|---:|---|---:|---:|")
    for tool, runs in results.items():
        wall, cpu = median([m.wall for m in runs]), median([m.cpu for m in runs])
        rss = max(m.rss for m in runs) / 2**20
        ours, peers = correct[tool]
        if tool == "us":
            ids = f"{ours:,}/{count:,} (special-token strings kept as text)"
        elif peers == count:
            ids = f"{peers:,}/{count:,} as tokenizers with special tokens parsed ({count - ours} became control ids)"
        else:
            ids = f"{max(ours, peers):,}/{count:,}"
        print(
            f"| {LABELS[tool]} | {wall:.2f} | {cpu:.2f} | {text_mb / cpu:.2f} | {rss:,.0f} | {ids} "
            f"| {wall / us_wall:.2f} | {cpu / us_cpu:.2f} |"
        )
    print(
        f"| fastokens `encode_batch_flat`, the texts in memory, one process (floor) | | {best:.2f} "
        f"| {text_mb / best:.1f} | | | | {best / us_cpu:.2f} |"
    )
    print(
        f"| gigatoken `encode` of each text's UTF-8, one process (the service's encoder for this model) | | "
        f"{giga_best:.2f} | {text_mb / giga_best:.1f} | | | | {giga_best / us_cpu:.2f} |"
    )
    wall, cpu = median([m.wall for m in on_ours]), median([m.cpu for m in on_ours])
    rss = max(m.rss for m in on_ours) / 2**20
    print(
        f"| a route not built: gigatoken's own Parquet pipeline on the service's encoder (special tokens as text, "
        f"no EOS, no shards) | {wall:.2f} | {cpu:.2f} | {text_mb / cpu:.2f} | {rss:,.0f} "
        f"| {on_ours_correct:,}/{count:,} as ours | {wall / us_wall:.2f} | {cpu / us_cpu:.2f} |"
    )
    print(f"(the floors' first pass: fastokens {first:.2f} CPU-s, gigatoken {giga_first:.2f} CPU-s)")
    print()
    print("20 documents (start-up):")
    print()
    print("| tool | wall s | CPU s |")
    print("|---|---:|---:|")
    for tool, runs in small_results.items():
        print(f"| {LABELS[tool]} | {median([m.wall for m in runs]):.2f} | {median([m.cpu for m in runs]):.2f} |")
    for name, measured in extra.items():
        print(f"{name}: {measured.wall:.2f} s wall, {measured.cpu:.2f} CPU-s, peak RSS {measured.rss / 2**20:,.0f} MiB")
    if "us" in results:
        small_cpu = median([m.cpu for m in small_results["us"]])
        small_mb = sum(len(doc.encode("utf-8")) for doc in documents[:20]) / 1e6
        floors = {
            "fastokens `encode_batch_flat`": (first, best),
            "gigatoken `encode` per text": (giga_first, giga_best),
        }
        print_steady_state(us_cpu - small_cpu, text_mb - small_mb, floors, text_mb)


def print_steady_state(cpu: float, megabytes: float, floors: dict[str, tuple[float, float]], floor_mb: float) -> None:
    """Our CPU per MB beyond start-up (`cpu` CPU-s over `megabytes`) against each encoder's CPU per MB on
    `floor_mb`: its first pass over the texts (each text new to its caches, as each is to our workers) and its
    best of 3 (the later passes find every word of the texts in its caches)."""
    steady = cpu / megabytes * 1e3
    print()
    print(
        f"steady state, us: {steady:.2f} ms per MB (the run less the 20-document run: {cpu:.2f} CPU-s over "
        f"{megabytes:.1f} MB); target: within 1.25x of the encoder's own call"
    )
    for name, (first, best) in floors.items():
        first_ms, best_ms = first / floor_mb * 1e3, best / floor_mb * 1e3
        print(
            f"  {name}: best of 3 {best_ms:.2f} ms per MB (us / it = {steady / best_ms:.2f}); "
            f"first pass {first_ms:.2f} ms per MB (us / it = {steady / first_ms:.2f})"
        )


if __name__ == "__main__":
    path, docs = build_corpus(float(sys.argv[1]) if len(sys.argv) > 1 else 40)
    print(path, len(docs), sum(len(d.encode()) for d in docs), len(set(docs)))
    model = peer_model(docs)
    from tokenizers import Tokenizer

    print(model, Tokenizer.from_file(str(model / "tokenizer.json")).get_vocab_size())
