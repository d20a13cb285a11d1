"""Faults from outside (issue 22, defects 9-12): cut and bit-flipped inputs and shards, a symlinked input.

Each is one line on stderr (no traceback), a documented exit status, and nothing corrupt marked complete.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import zstandard

from tests.test_pretokenize import write_parquet
from tokenizer_client.dataset import IDX_HEADER, TokenDataset
from tokenizer_service.settings import BUNDLED_MODELS_DIR
from tokenizer_service.tools.pretokenize import main as pretokenize_main
from tokenizer_service.tools.pretokenize.shards_cli import main as shards

MODEL = BUNDLED_MODELS_DIR / "default.model"
COMMON = ["--local", "--model", str(MODEL), "--workers", "1", "-q"]
FORMATS = ["megatron", "litdata", "nanogpt", "llmc"]


def pretokenize(*args: object) -> int:
    return pretokenize_main([str(arg) for arg in args])


def one_line(error: str) -> str:
    lines = error.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in error, error
    return lines[0]


def jsonl_bytes(texts: list[str]) -> bytes:
    return "".join(json.dumps({"text": text}) + "\n" for text in texts).encode()


def copy_output(source: Path, target: Path) -> Path:
    """A writable copy of an output (shards are written read-only)."""
    target.mkdir()
    for file in source.iterdir():
        (target / file.name).write_bytes(file.read_bytes())
    return target


# -- 9: .zst inputs cut short, bit-flipped, or not zstd at all --------------------------------------------------


@pytest.mark.parametrize("kind", ["jsonl.zst", "txt.zst"])
def test_a_zst_input_cut_short_is_one_line_and_reaches_no_complete_output(
    kind: str, documents: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    texts = documents[:400]
    data = jsonl_bytes(texts) if kind == "jsonl.zst" else "\n\n".join(texts).encode() + b"\n"
    for checksum in (True, False):  # a cut is found with or without the frame's content checksum
        packed = zstandard.ZstdCompressor(write_checksum=checksum).compress(data)
        path = tmp_path / f"cut-{checksum}.{kind}"
        path.write_bytes(packed[: len(packed) * 6 // 10])
        out = tmp_path / f"out-{checksum}"
        assert pretokenize(path, *COMMON, "--output", out) == 1
        line = one_line(capsys.readouterr().err)
        assert str(path) in line and "truncated zstd data" in line and "none of its documents were used" in line
        if out.exists():
            assert not json.loads((out / "metadata.json").read_text())["complete"]


def test_a_json_array_where_json_lines_belong_is_named_as_such(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A probe's pretty-printed JSON array got 92 "invalid JSON" records and then the --text-field question."""
    array = tmp_path / "corpus.json"
    array.write_text(json.dumps([{"text": f"document {number}"} for number in range(40)], indent=2))
    assert pretokenize(array, "--output", tmp_path / "out", *COMMON) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "is one JSON array, not JSON Lines" in last and "jq -c" in last
    assert not (tmp_path / "out").exists()


def test_a_file_saved_with_a_utf8_bom_loses_no_record(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A probe's JSON Lines saved "UTF-8 with BOM" dropped its first record as invalid JSON, exit 0; a text file kept
    the BOM as a character of its first document."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(MODEL))
    bom = b"\xef\xbb\xbf"
    lines = tmp_path / "bom.jsonl"
    lines.write_bytes(bom + jsonl_bytes(["first document", "second one"]))
    plain = tmp_path / "bom.txt"
    plain.write_bytes(bom + b"first document\n\nsecond one\n")
    for path in (lines, plain):
        out = tmp_path / f"out-{path.suffix[1:]}"
        assert pretokenize(path, "--output", out, *COMMON) == 0
        dataset = TokenDataset(out)
        assert dataset.metadata["bad_records"] == 0
        assert [sp.decode(dataset[i].tolist()) for i in range(len(dataset))] == ["first document", "second one"]
    assert "BOM" not in capsys.readouterr().err


def test_a_binary_parquet_column_of_text_is_read_as_utf8(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A probe's Parquet `binary` column holding valid UTF-8 was refused value by value ("bytes, not a string")."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(MODEL))
    values = [b"hello world", b"bad \xff", "d\u00e9j\u00e0".encode()]
    columns = {
        "binary": pa.array(values, pa.binary()),
        "large_binary": pa.array(values, pa.large_binary()),
        # as other writers store text: dictionary-encoded (a probe's were refused row by row), views
        "dictionary_binary": pa.array(values, pa.binary()).dictionary_encode(),
        "binary_view": pa.array(values, pa.binary_view()),
    }
    for kind, column in columns.items():
        path = tmp_path / f"{kind}.parquet"
        pq.write_table(pa.table({"text": column}), path)
        out = tmp_path / f"out-{kind}"
        assert pretokenize(path, "--output", out, *COMMON) == 0
        dataset = TokenDataset(out)
        assert [sp.decode(dataset[i].tolist()) for i in range(len(dataset))] == ["hello world", "d\u00e9j\u00e0"]
        assert dataset.metadata["bad_records"] == 1, kind
        assert "not valid UTF-8 (its byte 4)" in capsys.readouterr().err
        # --peek reads the first value as the run does (it said "no string field ... every record bad")
        assert pretokenize(path, "--peek") == 0
        said = capsys.readouterr().out
        assert "'text': a string of 11 characters: 'hello world'" in said, said
        assert "--text-field text holds a string: ready to pre-tokenize" in said, said


def test_peek_at_a_gzip_input_cut_short_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--peek read the first record of a truncated .gz into an EOFError traceback (a run said it in one line)."""
    import gzip

    whole = gzip.compress(jsonl_bytes(["a document of some words"] * 2000))
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(whole[: len(whole) // 2])
    assert pretokenize(cut, "--peek") == 1
    assert "corrupt compressed data" in one_line(capsys.readouterr().err)


def test_a_bit_flip_or_a_file_that_is_not_zstd_is_one_line(
    documents: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    packed = bytearray(zstandard.ZstdCompressor(write_checksum=True).compress(jsonl_bytes(documents[:400])))
    packed[len(packed) // 2] ^= 0x10
    flipped = tmp_path / "flipped.jsonl.zst"
    flipped.write_bytes(bytes(packed))
    assert pretokenize(flipped, *COMMON, "--output", tmp_path / "a") == 1
    line = one_line(capsys.readouterr().err)
    assert "corrupt zstd data" in line and "none of its documents were used" in line
    plain = tmp_path / "plain.jsonl.zst"
    plain.write_bytes(jsonl_bytes(documents[:10]))  # named .zst, but not compressed
    assert pretokenize(plain, *COMMON, "--output", tmp_path / "b") == 1
    assert "not zstd data" in one_line(capsys.readouterr().err)


def test_frames_without_a_checksum_are_read_with_one_warning(
    documents: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    paths = []
    for number in range(2):
        path = tmp_path / f"{number}.jsonl.zst"
        path.write_bytes(zstandard.ZstdCompressor(write_checksum=False).compress(jsonl_bytes(documents[:50])))
        paths.append(path)
    assert pretokenize(*paths, *COMMON, "--output", tmp_path / "out") == 0
    warning = one_line(capsys.readouterr().err)  # once a run, not once a file
    assert "without a content checksum: a cut file is detected, a flipped bit may not be" in warning
    assert len(TokenDataset(tmp_path / "out")) == 100


# -- 10: a run that wrote no shard leaves nothing that blocks the next -----------------------------------------


def test_a_wrong_parquet_column_is_refused_before_a_model_is_read(
    documents: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The first Parquet input's columns are read before the model loads (a 128k tokenizer.json takes a second
    or two): a model path that is not there is never reached."""
    path = write_parquet(tmp_path / "rows.parquet", list(documents[:10]))
    missing = tmp_path / "no-such-model.json"
    command = ["--local", "--model", missing, "--workers", "1", "-q", "--text-field", "body"]
    assert pretokenize(path, *command, "--output", tmp_path / "out") == 1
    error = one_line(capsys.readouterr().err)
    assert "no column 'body'" in error and "no-such-model" not in error


def test_a_wrong_parquet_column_leaves_nothing_behind(
    documents: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_parquet(tmp_path / "rows.parquet", list(documents[:100]))
    out = tmp_path / "out"
    assert pretokenize(path, *COMMON, "--text-field", "body", "--output", out) == 1
    assert "no column 'body'" in one_line(capsys.readouterr().err)
    assert not out.exists()
    assert pretokenize(path, *COMMON, "--output", out) == 0
    assert len(TokenDataset(out)) == 100


def test_an_output_without_a_shard_does_not_block_another_run(
    documents: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """As a run killed (SIGPIPE, SIGKILL) before its first shard leaves it: metadata.json and no shard."""
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"body": "x"}\n' + jsonl_bytes(documents[:50]))
    out = tmp_path / "out"
    assert pretokenize(path, *COMMON, "--strict", "--output", out) == 1  # stops at line 1: no shard
    capsys.readouterr()
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["shards"] == [] and not meta["complete"]
    assert pretokenize(path, *COMMON, "--text-field", "body", "--output", out) == 0  # other options: not refused
    assert TokenDataset(out).metadata["options"]["text_field"] == "body"


# -- 11, 12: truncated shards, corrupt indexes, ids above the vocabulary ------------------------------------


@pytest.fixture(scope="module")
def ragged(documents: list[str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("ragged")
    source = directory / "in.jsonl"
    source.write_bytes(jsonl_bytes(documents[:300]))
    assert pretokenize(source, *COMMON, "--shard-tokens", "3000", "--output", directory / "out") == 0
    return directory / "out"


@pytest.fixture(scope="module")
def packed(documents: list[str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("packed")
    source = directory / "in.jsonl"
    source.write_bytes(jsonl_bytes(documents[:300]))
    args = [*COMMON, "--shard-tokens", "3000", "--seq-len", "64", "--output", directory / "out"]
    assert pretokenize(source, *args) == 0
    return directory / "out"


def swap_offsets(output: Path, shard: str = "00001") -> None:
    index = output / f"{shard}.idx"
    offsets = np.fromfile(index, dtype="<i8", offset=IDX_HEADER.size)
    offsets[[3, 4]] = offsets[[4, 3]]
    index.write_bytes(index.read_bytes()[: IDX_HEADER.size] + offsets.tobytes())


def raise_an_id(output: Path, vocab_size: int, shard: str = "00000") -> None:
    data = output / f"{shard}.bin"
    ids = np.fromfile(data, dtype="<u2")
    ids[7] = vocab_size + 5
    data.write_bytes(ids.tobytes())


@pytest.mark.parametrize("to", FORMATS)
def test_export_of_a_truncated_shard_is_one_line_and_exit_2(
    to: str, ragged: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    damaged = copy_output(ragged, tmp_path / "damaged")
    shard = damaged / "00001.bin"
    shard.write_bytes(shard.read_bytes()[:-10])
    export = tmp_path / "export"
    assert shards(["export", str(damaged), "--to", to, "--output", str(export), "-q"]) == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith(f"tokenizer-shards: cannot export to {to}:") and "00001.bin" in line
    assert not export.exists() and not list(tmp_path.glob("export*"))  # nothing written


def test_verify_and_export_refuse_offsets_that_go_back(
    ragged: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    damaged = copy_output(ragged, tmp_path / "damaged")
    swap_offsets(damaged)
    assert shards(["verify", str(damaged)]) == 1
    line = one_line(capsys.readouterr().err)
    assert "00001.idx" in line and "is below offset 3" in line and "corrupt" in line
    for to in FORMATS:
        assert shards(["export", str(damaged), "--to", to, "--output", str(tmp_path / f"x-{to}"), "-q"]) == 2
        assert "is below offset 3" in one_line(capsys.readouterr().err)
    assert not list(tmp_path.glob("x-*"))


def test_verify_finds_ids_above_the_vocabulary_without_sample(
    ragged: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    damaged = copy_output(ragged, tmp_path / "damaged")
    vocab = TokenDataset(damaged).vocab_size
    raise_an_id(damaged, vocab)
    assert shards(["verify", str(damaged)]) == 1
    assert f"id {vocab + 5} at position 7 is not below the vocabulary size {vocab}" in one_line(capsys.readouterr().err)
    assert shards(["export", str(damaged), "--to", "megatron", "--output", str(tmp_path / "m"), "-q"]) == 2
    assert "not below the vocabulary size" in one_line(capsys.readouterr().err)
    assert shards(["verify", str(ragged)]) == 0  # the intact output passes
    assert "every id is below the vocabulary size" in capsys.readouterr().out


def test_verify_checks_packed_row_boundaries(packed: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert shards(["verify", str(packed)]) == 0
    capsys.readouterr()
    damaged = copy_output(packed, tmp_path / "damaged")
    seg = damaged / "00000.seg"
    boundaries = np.fromfile(seg, dtype="<i4")
    boundaries[1] = 1000  # past seq_len 64
    seg.write_bytes(boundaries.tobytes())
    assert shards(["verify", str(damaged)]) == 1
    assert "00000" in one_line(capsys.readouterr().err)
    assert shards(["export", str(damaged), "--to", "megatron", "--output", str(tmp_path / "m"), "-q"]) == 2
    one_line(capsys.readouterr().err)


def test_shards_are_written_read_only(ragged: Path) -> None:
    for file in ragged.iterdir():
        writable = file.stat().st_mode & 0o222
        assert (not writable) if file.name != "metadata.json" else writable, file


# -- inputs named twice: a symlink and its target, a missing path -----------------------------------------


def test_a_symlinked_input_is_read_once_with_a_warning(
    documents: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    target = corpus / "a.jsonl"
    target.write_bytes(jsonl_bytes(documents[:40]))
    os.symlink(target, corpus / "b.jsonl")
    assert pretokenize(corpus, target, *COMMON, "--output", tmp_path / "out") == 0
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and all("the same file as" in line and "read once" in line for line in lines), lines
    assert len(TokenDataset(tmp_path / "out")) == 40


def test_a_missing_input_is_no_such_file_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for missing in (tmp_path / "nope.jsonl", tmp_path / "nope"):
        assert pretokenize(missing, *COMMON, "--output", tmp_path / "out") == 2
        assert one_line(capsys.readouterr().err) == f"tokenizer-pretokenize: {missing}: no such file or directory"
    assert not (tmp_path / "out").exists()


def test_export_before_merge_says_to_merge(ragged: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ranked = tmp_path / "ranked"
    (ranked / "rank-00000").mkdir(parents=True)
    shutil.copy(ragged / "metadata.json", ranked / "rank-00000" / "metadata.json")
    assert shards(["export", str(ranked), "--to", "megatron", "--output", str(tmp_path / "m"), "-q"]) == 2
    line = one_line(capsys.readouterr().err)
    assert line == (
        f"tokenizer-shards: {ranked} is a ranked output (rank-RRRRR directories, no metadata.json over them yet): "
        f"run tokenizer-shards merge {ranked} first"
    )


# -- a Parquet text column's values as Arrow holds them ----------------------------------------------------------


def test_parquet_texts_reach_the_fast_encoder_as_utf8_and_bad_values_are_bad_records(
    multilingual: list[str], library_models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The local pool takes a Parquet column's texts as their UTF-8 (never decoded in the parent; gigatoken reads
    the bytes): the ids are the reference library's; a null and a value that is not UTF-8 are bad records that say
    which row and why, the rest of the file tokenized."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tokenizer_service.core import libraries
    from tokenizer_service.core.models import find_model_files
    from tokenizer_service.core.options import EncodeOptions

    good = multilingual[:300]
    assert len(good) > 100
    values = [text.encode() for text in good[:100]] + [None, b"bad \xff byte"] + [t.encode() for t in good[100:]]
    column = pa.array(values, type=pa.binary()).view(pa.string())
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"text": column}), path, row_group_size=128)
    model = library_models["hfbpe"]
    out = tmp_path / "out"
    assert pretokenize(path, "--local", "--model", model, "--workers", "2", "-q", "--output", out) == 0
    errors = capsys.readouterr().err
    assert "rows.parquet:102: column 'text' is not valid UTF-8 (its byte 4)" in errors, errors
    assert "rows.parquet:101:" in errors
    dataset = TokenDataset(out)
    # the fast encoder the gate's rule chose: gigatoken reads the bytes, fastokens the texts decoded in the worker
    # (on this 3k model the two measure within noise of each other, and the rule picks the faster of the day)
    assert dataset.metadata["bad_records"] == 2 and dataset.metadata["model"]["encoder"] in ("gigatoken", "fastokens")
    reference = libraries.load(find_model_files("hfbpe", model), libraries.REFERENCE)
    ids, lengths = reference.encode(good, EncodeOptions(add_eos=True))  # the pre-tokenizer's default
    got = [dataset[i].tolist() for i in range(len(dataset))]
    assert got == [row.tolist() for row in np.split(ids, np.cumsum(lengths)[:-1])]
