"""The corpora, models and server a benchmark runs on, and the line that says what they are.

Corpora: the shared multilingual one (10 languages, most documents not NFKC-normalized, like web text) or
the shared Python docs where ../shared has them, else the repository's Botchan. Documents: paragraphs
joined into 1-2 KB. Models: a unigram SentencePiece model trained on the corpus once, cached under
bench/results/ (git-ignored). Server: tokenizer_service.tools.launcher on a free loopback port, as the tests
start theirs.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterable
from pathlib import Path

import sentencepiece as spm

from tokenizer_service.tools.bench import describe_documents
from tokenizer_service.tools.launcher import ServerProcess

ROOT = Path(__file__).resolve().parent.parent

SHARED_CORPUS = ROOT.parent / "shared" / "corpus" / "python_docs.txt"
# The default where it exists: 10 languages, 71% of its documents not NFKC-normalized, like web text
MULTILINGUAL_CORPUS = ROOT.parent / "shared" / "corpus" / "debian_reference_multilingual.jsonl"
FALLBACK_CORPUS = ROOT / "tests" / "data" / "botchan.txt"
RESULTS = ROOT / "bench" / "results"


def compile_service(tree: Path = ROOT, folders: tuple[str, ...] = ("app", "client")) -> None:
    """The service's modules compiled, as an installed package has them (pip compiles at install): a checkout run
    under PYTHONDONTWRITEBYTECODE (which this machine sets) would compile some 40 of them at every start (0.13-0.15
    s of a command's start), which a peer installed in its venv never does."""
    import sys

    subprocess.run([sys.executable, "-m", "compileall", "-q", *folders], cwd=tree, check=True, capture_output=True)


def python_docs_corpus() -> Path:
    """The Python docs corpus where ../shared has it, else the repository's Botchan."""
    return SHARED_CORPUS if SHARED_CORPUS.exists() else FALLBACK_CORPUS


def default_corpus() -> Path:
    """The multilingual corpus where ../shared has it, else the Python docs, else the repository's Botchan."""
    return MULTILINGUAL_CORPUS if MULTILINGUAL_CORPUS.exists() else python_docs_corpus()


def read_text(corpus: Path) -> str:
    """A text file as it is, or a JSON Lines file's `text` fields separated by blank lines."""
    if corpus.suffix == ".jsonl":
        with corpus.open(encoding="utf-8") as file:
            return "\n\n".join(json.loads(line)["text"] for line in file if line.strip())
    return corpus.read_text(encoding="utf-8", errors="replace")


def load_documents(corpus: Path, count: int) -> list[str]:
    """Paragraphs (blank-line separated; lines for texts without blank lines) joined into 1-2 KB documents."""
    text = read_text(corpus)
    paragraphs = [p.strip() for p in text.split("\n\n") if p.strip()]
    if len(paragraphs) < 100:
        paragraphs = [line.strip() for line in text.splitlines() if line.strip()]
    documents: list[str] = []
    current: list[str] = []
    size = 0
    target = 1024
    for paragraph in paragraphs:
        current.append(paragraph)
        size += len(paragraph) + 2
        if size >= target:
            documents.append("\n\n".join(current)[:2048])
            current, size = [], 0
            target = 1024 + (len(documents) * 397) % 1024
            if len(documents) == count:
                break
    while len(documents) < count:  # a small corpus: repeat it
        documents.extend(documents[: count - len(documents)])
    return documents


SMALL_CORPUS_BYTES = 2_000_000
SMALL_CORPUS_VOCAB = 4000


def bench_model(corpus: Path, vocab_size: int = 32000) -> Path:
    """A unigram SentencePiece model of `vocab_size` pieces (4k for a corpus of 2 MB of text or less, too
    little for more) trained on `corpus`, once; its file name says the size it has."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    text = read_text(corpus) if corpus.suffix == ".jsonl" else None
    if (len(text.encode()) if text is not None else corpus.stat().st_size) <= SMALL_CORPUS_BYTES:
        vocab_size = SMALL_CORPUS_VOCAB
    prefix = RESULTS / f"bench-unigram-{vocab_size // 1000}k-{corpus.stem}"
    model = prefix.with_suffix(".model")
    if not model.exists():
        print(f"training a {vocab_size // 1000}k unigram model on {corpus.name} (once) ...", flush=True)
        if text is not None:
            plain = prefix.with_suffix(".txt")
            plain.write_text(text, encoding="utf-8")
            corpus = plain
        spm.SentencePieceTrainer.train(
            input=str(corpus),
            model_prefix=str(prefix),
            model_type="unigram",
            vocab_size=vocab_size,
            input_sentence_size=2_000_000,
            shuffle_input_sentence=True,
            num_threads=os.cpu_count() or 1,
            minloglevel=2,
        )
    return model


def documents_and_model(
    corpus: Path, count: int, model: Path | None, vocab_size: int = 32000
) -> tuple[list[str], Path]:
    """`count` documents of the corpus, and `model`, or without one a model trained on the corpus (cached)."""
    return load_documents(corpus, count), model or bench_model(corpus, vocab_size)


# The split pattern of cl100k_base and Llama 3, which byte-level BPE models of the benchmarks use
BYTE_LEVEL_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"""
    r"""\s+(?!\S)|\s+"""
)


def write_byte_level_bpe(
    directory: Path, texts: Iterable[str], vocab_size: int, special: list[str], config: dict[str, str]
) -> Path:
    """A byte-level BPE tokenizer.json (BYTE_LEVEL_PATTERN, then bytes) trained on `texts`, with `special` tokens
    after the trained ones and `config` as its tokenizer_config.json, written whole (a directory ending in
    .partial renamed at the end) so that an interrupted training leaves nothing to be taken for a model."""
    import shutil

    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(BYTE_LEVEL_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(special), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.add_special_tokens([AddedToken(token, special=True) for token in special])
    partial = directory.with_name(directory.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    tokenizer.save(str(partial / "tokenizer.json"))
    (partial / "tokenizer_config.json").write_text(json.dumps(config))
    partial.rename(directory)
    return directory


def start_server(model: Path, workers: int, *extra: str) -> tuple[str, subprocess.Popen[bytes]]:
    """A server on a free loopback port serving `model` as "bench"
    (tokenizer_service.tools.launcher, as the tests start theirs)."""
    args = ["--workers", str(workers), "--model", f"bench={model}", "--log-level", "warning", *extra]
    server = ServerProcess(args).start(timeout=120)
    assert server.process is not None
    return server.url, server.process


def describe_corpus(corpus: Path, docs: list[str], *details: str) -> None:
    """Print the line every benchmark starts with: its documents (how many, how long, how many not NFKC-normalized,
    as tokenizer-bench says it), then `details` (the model, the cores...), separated by semicolons."""
    print("; ".join([describe_documents(docs, corpus.name), *details]), flush=True)
