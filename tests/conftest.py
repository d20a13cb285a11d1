"""Fixtures: SentencePiece models trained at test time, real documents, a real tokenizer-server."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import orjson
import pytest
import sentencepiece as spm

from tokenizer_service.settings import BUNDLED_MODELS_DIR
from tokenizer_service.tools.launcher import ServerProcess, free_port, stop, wait_ready  # noqa: F401 - re-exported to tests

DATA = Path(__file__).parent / "data"
ROOT = Path(__file__).parent.parent

# Unigram without byte fallback (unknown characters become <unk>) and BPE with it, so both of
# SentencePiece's ways of handling unseen text are covered.
TEST_MODELS = {
    "uni": {"model_type": "unigram", "vocab_size": 3000},
    "bpe": {"model_type": "bpe", "vocab_size": 2000, "byte_fallback": True},
}
# Limits of the test server: large enough for the big requests below, small enough to test 413.
MAX_TEXTS = 5000
MAX_REQUEST_BYTES = 4 * 1024 * 1024

EDGE_CASES = [
    "",
    " ",
    "\x00",
    "a\x00b",
    "\t\n\r",
    "😀 emoji 👩‍👩‍👧 family",
    "日本語のテキスト、中文文本。",
    "e\u0301 combining a\u0308 marks",
    "\ufeffbyte order mark",
    "Ω≈ç√∫ ÅÍÎÏ",
    "x" * 5000,
]


def read_multilingual() -> list[str]:
    """Real web-like text in ten languages (tests/data/multilingual.jsonl: 92 of 120 not NFKC-normalized)."""
    with (DATA / "multilingual.jsonl").open("rb") as file:
        return [orjson.loads(line)["text"] for line in file]


def read_documents() -> list[str]:
    """Real English prose: Botchan, lines joined into documents of one to four lines."""
    lines = [line.strip() for line in (DATA / "botchan.txt").read_text(encoding="utf-8").splitlines()]
    lines = [line for line in lines if line]
    documents, position, width = [], 0, 1
    while position < len(lines):
        documents.append(" ".join(lines[position : position + width]))
        position += width
        width = width % 4 + 1
    return documents


@dataclass
class Server:
    url: str
    process: subprocess.Popen[bytes]
    model_files: dict[str, Path]
    log: Path

    def processor(self, name: str) -> spm.SentencePieceProcessor:
        return spm.SentencePieceProcessor(model_file=str(self.model_files[name]))


def start_server(args: list[str], log: Path, env: dict[str, str] | None = None) -> tuple[str, subprocess.Popen[bytes]]:
    """Start `python -m tokenizer_service` on a free loopback port and wait until /readyz answers 200."""
    server = ServerProcess(args, log=log, env=env).start()
    assert server.process is not None
    return server.url, server.process


def stop_server(process: subprocess.Popen[bytes]) -> None:
    stop(process)


@pytest.fixture(scope="session", autouse=True)
def gate_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One gate cache (TOKENIZER_CACHE_DIR) for every test and every server the tests start, beside pytest's
    own temporary directories (/tmp/pytest-of-USER/tokenizer-service-cache): each distinct model is scanned
    once, not once per server, and the user's own cache (~/.cache/tokenizer-service) is never written. It
    outlives the run (verdicts are keyed by both libraries' versions, the files' bytes and the check set, so
    a later run reuses only what still holds). Tests of the scan itself use caches of their own."""
    from tokenizer_service.core.libraries import CACHE_DIR_ENV

    directory = tmp_path_factory.getbasetemp().parent / "tokenizer-service-cache"
    directory.mkdir(exist_ok=True)
    previous = os.environ.get(CACHE_DIR_ENV)
    os.environ[CACHE_DIR_ENV] = str(directory)
    yield directory
    if previous is None:
        os.environ.pop(CACHE_DIR_ENV, None)
    else:
        os.environ[CACHE_DIR_ENV] = previous


@pytest.fixture(scope="session")
def model_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("models")
    files = {}
    for name, options in TEST_MODELS.items():
        spm.SentencePieceTrainer.train(
            input=str(DATA / "botchan.txt"), model_prefix=str(directory / name), minloglevel=2, num_threads=2, **options
        )
        files[name] = directory / f"{name}.model"
    files["default"] = BUNDLED_MODELS_DIR / "default.model"
    return files


@pytest.fixture(scope="session")
def documents() -> list[str]:
    return read_documents()


@pytest.fixture(scope="session")
def multilingual() -> list[str]:
    return read_multilingual()


@pytest.fixture(scope="session")
def library_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """tokenizer.json (a BPE snapshot, unigram, WordPiece) and tiktoken models trained here (tokenizer_models.py)."""
    from tests.tokenizer_models import write_all

    models = write_all(tmp_path_factory.mktemp("library-models"), read_documents(), read_multilingual())
    settle_gates(models)  # servers of these models then encode with fastokens from their first request
    return models


def settle_gates(models: dict[str, Path]) -> None:
    """Each model's fast-encoder gate verdict in the session's cache (`gate_cache`), scanned here where it is
    not there yet: what tests that expect fastokens from a server's start need (a server with no verdict
    serves with the reference library until its background scan passes)."""
    from tokenizer_service.core.registry import inspect_model

    for name, path in models.items():
        inspect_model(name, path, wait=True)


@pytest.fixture(scope="session")
def server(model_files: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("server") / "server.log"
    args = ["--workers", "2", "--max-texts", str(MAX_TEXTS), "--max-request-bytes", str(MAX_REQUEST_BYTES)]
    for name, path in model_files.items():
        args += ["--model", f"{name}={path}"]
    args += ["--default-model", "default"]
    url, process = start_server(args, log)
    yield Server(url=url, process=process, model_files=model_files, log=log)
    stop_server(process)
