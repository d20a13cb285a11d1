"""What a new user reaches for (issue 23): one clear line for each mistake, a look before reading and at
what was made, a validation split at export, exports that say what they link."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.test_pretokenize import write_parquet, zstd_open
from tokenizer_client.dataset import TokenDataset
from tokenizer_service.settings import BUNDLED_MODELS_DIR
from tokenizer_service.tools.pretokenize import main as pretokenize_main
from tokenizer_service.tools.pretokenize.cli import BadRecordLog
from tokenizer_service.tools.pretokenize.shards_cli import main as shards

MODEL = BUNDLED_MODELS_DIR / "default.model"
COMMON = ["--local", "--model", str(MODEL), "--workers", "1", "-q"]


def pretokenize(*args: object) -> int:
    return pretokenize_main([str(arg) for arg in args])


def write_records(path: Path, records: list[dict[str, object]], opener=open) -> Path:  # type: ignore[no-untyped-def]
    with opener(path, "wt", encoding="utf-8") as file:
        file.write("".join(json.dumps(record) + "\n" for record in records))
    return path


# -- 1: bad records summarized, an all-bad start stopped early ---------------------------------------------


def test_bad_records_are_summarized_not_one_line_each() -> None:
    lines: list[str] = []
    now = [0.0]
    log = BadRecordLog(lines.append, clock=lambda: now[0])
    for number in range(1, 60_001):
        now[0] = number * 0.001  # 60 s of reading
        log(f"f.jsonl:{number}: no field 'text'")
    log.close()
    assert lines[:10] == [f"f.jsonl:{number}: no field 'text'" for number in range(1, 11)]
    assert lines[10].startswith("(further bad records are counted, a line every 10 s")
    periodic = lines[11:-1]
    assert 4 <= len(periodic) <= 6 and all(
        line.endswith("bad records so far" + line.split("so far")[1]) for line in periodic
    )
    last = "60,000 bad records in this run (the last: f.jsonl:60000: no field 'text'); metadata.json counts all"
    assert lines[-1] == last


def test_a_run_whose_first_records_are_all_bad_stops_naming_their_fields(
    documents: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    records = [{"id": number, "content": documents[number % len(documents)]} for number in range(5000)]
    path = write_records(tmp_path / "corpus.jsonl", records)
    out = tmp_path / "out"
    assert pretokenize(path, *COMMON, "--output", out) == 1
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) <= 13 and "Traceback" not in "\n".join(error)
    last = error[-1]
    assert last.startswith("tokenizer-pretokenize: the first 1,000 records are all bad, so the run stops here")
    assert "have: 'id' (1,000), 'content' (1,000)" in last and "is --text-field 'text' the field" in last
    assert not out.exists()  # nothing left behind: the corrected command starts afresh
    assert pretokenize(path, *COMMON, "--text-field", "content", "--output", out) == 0


# -- 9: --peek ------------------------------------------------------------------------------------------------


def test_peek_shows_the_kind_and_the_first_records_fields(
    documents: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    write_records(corpus / "a.jsonl.zst", [{"id": 1, "body": documents[0], "meta": {"lang": "en"}}], zstd_open)
    write_parquet(corpus / "b.parquet", list(documents[:10]))
    assert pretokenize(corpus / "a.jsonl.zst", corpus / "b.parquet", "--peek") == 0
    out = capsys.readouterr().out
    assert "a.jsonl.zst: JSON Lines, zstd-compressed" in out
    assert "'body': a string of" in out and "'meta': an object" in out and "'id': a number" in out
    assert "pass --text-field body" in out
    assert "b.parquet: Parquet, 10 rows in 1 row groups; columns: id (int64), text (string), url (string)" in out
    assert "--text-field text holds a string: ready to pre-tokenize" in out
    assert pretokenize(corpus, "--peek") == 0
    assert "a directory of 2 input files" in capsys.readouterr().out
    assert pretokenize(tmp_path / "missing.jsonl", "--peek") == 2
    assert (
        capsys.readouterr().err.strip()
        == f"tokenizer-pretokenize: {tmp_path / 'missing.jsonl'}: no such file or directory"
    )
    with pytest.raises(SystemExit) as exit_info:  # without --peek, --output and --local/--url are required
        pretokenize(corpus)
    assert exit_info.value.code == 2


# -- 10, 12: info ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def outputs(documents: list[str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("newcomer")
    source = write_records(directory / "in.jsonl", [{"text": text} for text in documents[:600]])
    made = {"ragged": directory / "ragged", "concat": directory / "concat", "best_fit": directory / "best_fit"}
    common = [source, *COMMON, "--shard-tokens", "4000"]
    assert pretokenize(*common, "--output", made["ragged"]) == 0
    assert pretokenize(*common, "--output", made["concat"], "--seq-len", "64") == 0
    assert pretokenize(*common, "--output", made["best_fit"], "--seq-len", "64", "--strategy", "best_fit") == 0
    return made


def test_info_shows_a_length_histogram_and_names_tokens_and_ids(
    outputs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    assert shards(["info", str(outputs["ragged"])]) == 0
    info = capsys.readouterr().out
    dataset = TokenDataset(outputs["ragged"])
    assert f"{dataset.num_tokens:,} tokens tokenized, {dataset.num_tokens:,} ids stored, ragged" in info
    assert "document lengths in tokens, 600 in all:" in info
    lengths = np.array([len(dataset[i]) for i in range(len(dataset))])
    assert f"p50 {int(np.percentile(lengths, 50)):,}," in info and f"max {lengths.max():,}," in info
    assert "█" in info

    assert shards(["info", str(outputs["concat"])]) == 0
    info = capsys.readouterr().out
    concat = TokenDataset(outputs["concat"])
    leftover = len(concat.metadata["leftover"]["ids"])
    assert concat.metadata["tokens"] == concat.num_tokens + leftover
    assert f"{concat.metadata['tokens']:,} tokens tokenized, {concat.num_tokens:,} ids stored" in info
    assert f"the {leftover:,} tokens after the last full row not stored" in info
    assert "padding: 0 of" in info and "cuts at a row boundary over 600 documents" in info
    # every cut makes one more segment: segments in rows and leftover = documents + cuts
    cuts = int(info.split("split documents: ")[1].split(" cuts")[0].replace(",", ""))
    segments = sum(len(concat.row(i).cu_seqlens) - 1 for i in range(len(concat)))
    starts = concat.metadata["leftover"]["document_starts"]
    segments += len(starts) + (0 if starts and starts[0] == 0 else 1) if leftover else 0
    assert segments == 600 + cuts

    assert shards(["info", str(outputs["best_fit"])]) == 0
    info = capsys.readouterr().out
    padding = sum(shard["padding"] for shard in TokenDataset(outputs["best_fit"]).metadata["shards"])
    assert padding and f"padding: {padding:,} of" in info


# -- 5, 6, 8: export's output, hard links, validation ---------------------------------------------------------


def test_export_output_a_directory(
    outputs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = tmp_path / "outdir"
    directory.mkdir()
    for given in (f"{directory}/", str(directory)):
        assert shards(["export", str(outputs["ragged"]), "--to", "megatron", "--output", given, "-q"]) == 2
        error = capsys.readouterr().err.strip()
        assert len(error.splitlines()) == 1 and "is a directory; megatron writes PREFIX.bin and PREFIX.idx" in error
    assert not list(tmp_path.glob("outdir.*"))
    assert shards(["export", str(outputs["ragged"]), "--to", "nanogpt", "--output", f"{tmp_path}/nano/", "-q"]) == 0
    assert (tmp_path / "nano" / "train.bin").exists()


def test_export_says_which_files_are_hard_links(
    documents: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = write_records(tmp_path / "in.jsonl", [{"text": text} for text in documents[:50]])
    assert pretokenize(source, *COMMON, "--output", tmp_path / "one") == 0  # one shard
    prefix = tmp_path / "m" / "corpus"
    assert shards(["export", str(tmp_path / "one"), "--to", "megatron", "--output", str(prefix)]) == 0
    out = capsys.readouterr().out
    assert "1 of them is a hard link to the shards" in out and "read-only" in out
    linked = prefix.with_name("corpus.bin")
    assert linked.stat().st_ino == (tmp_path / "one" / "00000.bin").stat().st_ino
    assert not linked.stat().st_mode & 0o222


@pytest.mark.parametrize("to", ["nanogpt", "llmc", "megatron", "litdata"])
def test_val_documents_are_the_first_n_documents(
    to: str, outputs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dataset = TokenDataset(outputs["ragged"])
    val_ids = np.concatenate([dataset[i] for i in range(25)]).tolist()
    train_ids = np.concatenate([dataset[i] for i in range(25, len(dataset))]).tolist()
    output = {"nanogpt": tmp_path / "data" / "train.bin", "llmc": tmp_path / "llmc"}.get(to, tmp_path / "corpus")
    args = ["export", str(outputs["ragged"]), "--to", to, "--output", str(output), "--val-documents", "25"]
    assert shards(args) == 0
    assert "the first 25 documents to" in capsys.readouterr().out
    if to == "nanogpt":
        assert np.fromfile(tmp_path / "data" / "val.bin", dtype="<u2").tolist() == val_ids
        assert np.fromfile(output, dtype="<u2").tolist() == train_ids
    elif to == "llmc":
        read = {
            split: np.concatenate([np.fromfile(f, "<u2", offset=1024) for f in sorted(output.glob(f"{split}_*.bin"))])
            for split in ("val", "train")
        }
        assert {split: ids.tolist() for split, ids in read.items()} == {"val": val_ids, "train": train_ids}
    elif to == "megatron":  # the layouts are read back by megatron-core in test_export.py
        for prefix, expected in ((tmp_path / "corpus_val", val_ids), (output, train_ids)):
            assert np.fromfile(f"{prefix}.bin", dtype="<u2").tolist() == expected
            count = int(np.frombuffer(Path(f"{prefix}.idx").read_bytes()[18:26], "<u8")[0])
            assert count == (25 if prefix != output else len(dataset) - 25)
    else:
        index = json.loads((tmp_path / "corpus_val" / "index.json").read_text())
        assert [chunk["chunk_size"] for chunk in index["chunks"]] == [25]
        assert sum(chunk["chunk_size"] for chunk in json.loads((output / "index.json").read_text())["chunks"]) == 575


def test_val_documents_refusals(outputs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for source, count, complaint in (
        ("concat", "5", "it needs a ragged output"),
        ("ragged", "600", "leaves no training document of 600"),
        ("ragged", "-1", "must be 0 or more"),
    ):
        args = ["export", str(outputs[source]), "--to", "nanogpt", "--output", str(tmp_path / "x.bin")]
        assert shards([*args, "--val-documents", count, "-q"]) == 2
        error = capsys.readouterr().err.strip()
        assert len(error.splitlines()) == 1 and complaint in error, error
