"""tokenizer-bench on a small corpus: one table, every method, measured in the same run."""

from __future__ import annotations

import gzip
import json
import os
import re
from pathlib import Path

import pytest

from tests.conftest import Server
from tokenizer_service.tools.bench import main

METHODS = ["per-sample loop", "batched", "service", "prefetch", "pretokenize", "pre-tokenized read"]


def table_rows(output: str) -> dict[str, list[str]]:
    rows = {}
    for line in output.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("| ") and cells[0] in METHODS:
            rows[cells[0]] = cells[1:]
    return rows


def check_table(output: str) -> None:
    rows = table_rows(output)
    assert list(rows) == METHODS, output
    for what, docs_per_s, tokens_per_s, ratio in rows.values():
        assert what
        assert float(docs_per_s.replace(",", "")) > 0 and float(tokens_per_s) > 0
        assert re.fullmatch(r"\d+\.\d\d", ratio), ratio
    assert rows["batched"][3] == "1.00"


@pytest.fixture(scope="module")
def corpus(documents: list[str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bench") / "corpus.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as file:
        for text in documents[:300]:
            file.write(json.dumps({"text": text}) + "\n")
    return path


@pytest.mark.slow  # servers and pools of its own; .ci/run's slow stage
def test_bench_starts_its_own_server_and_prints_one_table(
    corpus: Path, model_files: dict[str, Path], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Relative paths, as a user types them: the server it starts runs elsewhere and gets them resolved."""
    monkeypatch.chdir(model_files["uni"].parent)
    corpus_path = os.path.relpath(corpus, model_files["uni"].parent)
    assert main(["--model", model_files["uni"].name, "--corpus", corpus_path, "--docs", "200", "--rounds", "1"]) == 0
    output = capsys.readouterr().out
    assert output.startswith("200 documents from corpus.jsonl.gz")
    check_table(output)


@pytest.mark.slow  # servers and pools of its own; .ci/run's slow stage
def test_bench_against_a_running_service_finds_the_model_by_sha256(
    corpus: Path, server: Server, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--model", str(server.model_files["bpe"]), "--corpus", str(corpus), "--docs", "100", "--rounds", "2"]
    assert main([*args, "--url", server.url]) == 0
    check_table(capsys.readouterr().out)


def test_bench_refuses_a_service_without_the_model(
    corpus: Path, server: Server, documents: list[str], tmp_path: Path
) -> None:
    import sentencepiece as spm

    text = tmp_path / "text.txt"
    text.write_text("\n".join(documents[:400]))
    spm.SentencePieceTrainer.train(
        input=str(text), model_prefix=str(tmp_path / "other"), vocab_size=500, minloglevel=2, num_threads=1
    )
    args = ["--model", str(tmp_path / "other.model"), "--corpus", str(corpus), "--url", server.url]
    with pytest.raises(SystemExit, match="does not serve this model file"):
        main(args)


def test_bench_refuses_a_missing_model_in_one_line(corpus: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", "no-such.model", "--corpus", str(corpus)])
    assert exit_info.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "no-such.model: no such file or directory" in line and line.endswith("(see tokenizer-bench --help)")
