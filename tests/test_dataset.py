"""TokenDataset over real pre-tokenized output: views, sequences, pickling, torch, and refusing bad files."""

from __future__ import annotations

import json
import mmap
import pickle
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm

from tests.conftest import ROOT
from tokenizer_client.dataset import IDX_HEADER, METADATA_FILE, TokenDataset, check_metadata, write_dataset
from tokenizer_service.tools.pretokenize import main


def build(directory: Path, texts: list[str], model: Path, *args: str) -> Path:
    corpus = directory / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts), encoding="utf-8")
    out = directory / "out"
    assert main([str(corpus), "--output", str(out), "--local", "--model", str(model), "-q", *args]) == 0
    return out


@pytest.fixture(scope="module")
def texts(documents: list[str]) -> list[str]:
    return documents[:400]


@pytest.fixture(scope="module")
def ragged_dir(texts: list[str], model_files: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("ragged"), texts, model_files["uni"], "--shard-tokens", "3000")


@pytest.fixture(scope="module")
def packed_dir(texts: list[str], model_files: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    args = ["--shard-tokens", "3000", "--seq-len", "128", "--strategy", "best_fit"]
    return build(tmp_path_factory.mktemp("packed"), texts, model_files["uni"], *args)


@pytest.fixture(scope="module")
def expected(texts: list[str], model_files: dict[str, Path]) -> list[list[int]]:
    sp = spm.SentencePieceProcessor(model_file=str(model_files["uni"]))
    return sp.encode(texts, add_eos=True)  # type: ignore[no-any-return]


def test_documents_are_read_only_views_of_the_shards(ragged_dir: Path, expected: list[list[int]]) -> None:
    dataset = TokenDataset(ragged_dir)
    assert dataset.num_shards > 3
    assert len(dataset) == dataset.num_documents == len(expected)
    assert dataset.num_tokens == sum(map(len, expected))
    assert [dataset[i].tolist() for i in range(len(dataset))] == expected
    assert dataset[-1].tolist() == expected[-1] and dataset.document(np.int64(5)).tolist() == expected[5]
    document = dataset[7]
    backing: object = document
    while isinstance(backing, np.ndarray) and backing.base is not None:
        backing = backing.base
    assert isinstance(backing, mmap.mmap)  # a view of the file's memory map, not a copy
    assert not document.flags.writeable
    for bad in (len(expected), -len(expected) - 1):
        with pytest.raises(IndexError):
            dataset[bad]
    with pytest.raises(ValueError, match="ragged"):
        dataset.row(0)


def test_sequences_cut_the_whole_stream_across_shards(ragged_dir: Path, expected: list[list[int]]) -> None:
    dataset = TokenDataset(ragged_dir)
    stream = np.concatenate([np.asarray(ids) for ids in expected])
    sequences = dataset.sequences(100)
    assert len(sequences) == stream.size // 100
    for index in range(len(sequences)):
        assert np.array_equal(sequences[index], stream[index * 100 : (index + 1) * 100])
    assert np.array_equal(sequences[-1], stream[(len(sequences) - 1) * 100 : len(sequences) * 100])
    with pytest.raises(ValueError):
        dataset.sequences(0)


def test_the_documented_plain_numpy_recipe_reads_the_same(ragged_dir: Path, packed_dir: Path) -> None:
    meta = json.loads((ragged_dir / "metadata.json").read_text())
    ids = np.memmap(ragged_dir / "00000.bin", dtype=meta["dtype"], mode="r")
    offsets = np.memmap(ragged_dir / "00000.idx", dtype="<i8", mode="r", offset=32)
    assert np.array_equal(ids[offsets[3] : offsets[4]], TokenDataset(ragged_dir)[3])
    assert len(offsets) == meta["shards"][0]["documents"] + 1

    meta = json.loads((packed_dir / "metadata.json").read_text())
    rows = np.memmap(packed_dir / "00001.bin", dtype=meta["dtype"], mode="r").reshape(-1, meta["seq_len"])
    offsets = np.memmap(packed_dir / "00001.idx", dtype="<i8", mode="r", offset=32)
    seg = np.fromfile(packed_dir / "00001.seg", dtype="<i4")
    packed = TokenDataset(packed_dir)
    first = meta["shards"][0]["rows"]
    assert np.array_equal(rows[3], packed[first + 3])
    assert np.array_equal(seg[offsets[3] : offsets[4]], packed.row(first + 3).cu_seqlens)


def test_packed_rows_carry_labels_and_positions(packed_dir: Path, expected: list[list[int]]) -> None:
    dataset = TokenDataset(packed_dir)
    assert len(dataset) == dataset.num_rows == dataset.metadata["rows"]
    assert dataset.num_tokens == len(dataset) * 128
    real = 0
    for index in range(len(dataset)):
        row = dataset.row(index)
        used = int(row.cu_seqlens[-1])
        assert row.cu_seqlens[0] == 0 and np.all(np.diff(row.cu_seqlens) > 0)
        assert np.array_equal(row.labels[:used], row.input_ids[:used]) and np.all(row.labels[used:] == -100)
        assert np.all(row.position_ids[row.cu_seqlens[:-1]] == 0)
        real += used
    assert real == sum(map(len, expected)) == dataset.metadata["tokens"]
    assert len(dataset.sequences(128)) == len(dataset)
    with pytest.raises(ValueError, match="128"):
        dataset.sequences(64)


def test_pickles_by_path(ragged_dir: Path) -> None:
    dataset = TokenDataset(ragged_dir)
    dataset[0]  # maps a shard
    payload = pickle.dumps(dataset)
    assert len(payload) < 500 and str(ragged_dir).encode() in payload
    copy = pickle.loads(payload)
    assert len(copy) == len(dataset) and np.array_equal(copy[-1], dataset[-1])


def test_torch_datasets_and_a_dataloader(ragged_dir: Path, packed_dir: Path, expected: list[list[int]]) -> None:
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader, Dataset

    documents = TokenDataset(ragged_dir).torch()
    assert isinstance(documents, Dataset)
    assert documents[2].dtype == torch.int64 and documents[2].tolist() == expected[2]

    sequences = TokenDataset(ragged_dir).torch(seq_len=64)
    batch = next(iter(DataLoader(sequences, batch_size=4)))
    assert batch["input_ids"].shape == (4, 64) and batch["input_ids"].dtype == torch.int64
    stream = [token for ids in expected for token in ids]
    assert batch["input_ids"].reshape(-1).tolist() == stream[: 4 * 64]

    rows = TokenDataset(packed_dir).torch()
    batch = next(iter(DataLoader(rows, batch_size=2)))
    assert set(batch) == {"input_ids", "labels", "position_ids"} and batch["labels"].shape == (2, 128)
    assert pickle.loads(pickle.dumps(rows))[1]["input_ids"].tolist() == rows[1]["input_ids"].tolist()


def test_a_sequence_length_of_zero_and_an_index_out_of_range_say_what_was_given(
    ragged_dir: Path, packed_dir: Path
) -> None:
    """`torch(seq_len=0)` gave whole documents (0 read as "no seq_len"); `dataset[-N - 1]` named index -1."""
    pytest.importorskip("torch")
    dataset = TokenDataset(ragged_dir)
    for directory in (ragged_dir, packed_dir):
        with pytest.raises(ValueError, match="seq_len"):
            TokenDataset(directory).torch(seq_len=0)
    beyond = -len(dataset) - 3
    with pytest.raises(IndexError, match=rf"index {beyond} out of range for {len(dataset)} items"):
        dataset[beyond]


@pytest.mark.parametrize("strategy", ["concat", "best_fit"])
def test_write_dataset_reads_back_what_it_was_given(ragged_dir: Path, tmp_path: Path, strategy: str) -> None:
    real = TokenDataset(ragged_dir)
    docs = [real[i] for i in range(len(real))]
    ids, offsets = np.concatenate(docs), np.concatenate([[0], np.cumsum([doc.size for doc in docs])])
    model = real.model
    ragged = write_dataset(tmp_path / "ragged", ids, offsets, model=model, shard_tokens=3000)
    assert [ragged[i].tolist() for i in range(len(ragged))] == [doc.tolist() for doc in docs]
    assert [shard["documents"] for shard in ragged.metadata["shards"]] == [
        shard["documents"] for shard in real.metadata["shards"]
    ]  # cut where the pre-tokenizer's --shard-tokens cuts
    assert ragged.dtype == real.dtype and ragged.num_tokens == real.num_tokens == ragged.metadata["tokens"]
    packed = write_dataset(tmp_path / strategy, ids, offsets, model=model, seq_len=64, strategy=strategy)
    for dataset in (ragged, packed):
        meta = json.loads((dataset.path / METADATA_FILE).read_text())
        assert check_metadata(meta, dataset.path) == dataset.metadata and meta["complete"]
        assert set(meta) - {"leftover"} >= set(json.loads((ragged_dir / METADATA_FILE).read_text())) - {"leftover"}
        for index in range(dataset.num_shards):
            dataset.check(index)
    rows = [packed.row(i) for i in range(len(packed))]
    used = [row.input_ids[: row.cu_seqlens[-1]] for row in rows]
    stream = np.concatenate(used).tolist()
    if strategy == "concat":  # one shard, its ids after the last full row left out
        assert stream == ids[: len(rows) * 64].tolist() and packed.metadata["tokens"] == len(rows) * 64
    else:
        assert sorted(stream) == sorted(ids.tolist()) and packed.metadata["tokens"] == ids.size
    assert packed.metadata["rows"] == len(packed) and packed.metadata["documents"] == len(docs)
    with pytest.raises(ValueError, match="not empty"):
        write_dataset(tmp_path / "ragged", ids, offsets, model=model)


def corrupt(source: Path, destination: Path) -> Path:
    destination.mkdir()
    for path in source.iterdir():
        (destination / path.name).write_bytes(path.read_bytes())
    return destination


def test_bad_files_raise_value_error(ragged_dir: Path, tmp_path: Path) -> None:
    magic = corrupt(ragged_dir, tmp_path / "magic")
    raw = bytearray((magic / "00001.idx").read_bytes())
    raw[:8] = b"NOTSHARD"
    (magic / "00001.idx").write_bytes(bytes(raw))
    dataset = TokenDataset(magic)
    dataset[0]  # shard 0 is fine; shard 1 is refused when first used
    with pytest.raises(ValueError, match="bad magic"):
        dataset[dataset.metadata["shards"][0]["documents"]]

    version = corrupt(ragged_dir, tmp_path / "version")
    raw = bytearray((version / "00000.idx").read_bytes())
    struct.pack_into("<H", raw, 8, 99)
    (version / "00000.idx").write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="version 99"):
        TokenDataset(version)[0]

    truncated = corrupt(ragged_dir, tmp_path / "truncated")
    (truncated / "00000.bin").write_bytes((truncated / "00000.bin").read_bytes()[:-2])
    with pytest.raises(ValueError, match="ids"):
        TokenDataset(truncated)[0]

    meta_path = corrupt(ragged_dir, tmp_path / "meta") / "metadata.json"
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({**meta, "version": 3}))  # 1 (no masks) and 2 (loss masks) are read
    with pytest.raises(ValueError, match="version 3"):
        TokenDataset(meta_path.parent)
    meta_path.write_text(json.dumps({**meta, "complete": False}))
    with pytest.raises(ValueError, match="incomplete"):
        TokenDataset(meta_path.parent)
    # fields of the wrong type were TypeErrors deep in the reader (tracebacks of tokenizer-shards info and verify)
    for field, value, says in [
        ("shards", "00000", "shards is not a list"),
        ("shards", [{"name": "00000", "documents": "3", "tokens": 5}], "shards is not a list"),
        ("model", None, "model is not an object"),
        ("model", {"vocab_size": "4000"}, "model is not an object"),
    ]:
        meta_path.write_text(json.dumps({**meta, field: value}))
        with pytest.raises(ValueError, match=says):
            TokenDataset(meta_path.parent)
    meta_path.write_text(json.dumps({**meta, "complete": False}))
    assert len(TokenDataset(meta_path.parent, allow_partial=True)) == len(TokenDataset(ragged_dir))
    with pytest.raises(ValueError, match=r"metadata\.json"):
        TokenDataset(tmp_path)
    assert IDX_HEADER.size == 32


def test_importing_the_reader_imports_neither_torch_nor_the_server() -> None:
    code = (
        "import sys, tokenizer_client.dataset\n"
        "loaded = [m for m in ('torch', 'sentencepiece', 'tokenizer_service', 'fastapi') if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


@pytest.mark.parametrize(
    ("where", "message"),
    [
        ("missing", "does not exist: give the directory a tokenizer-pretokenize run wrote"),
        ("file", "is not a directory: give the directory a tokenizer-pretokenize run wrote"),
        ("empty", "holds no metadata.json: not a tokenizer-pretokenize output"),
    ],
)
def test_a_path_that_is_no_output_says_what_it_is(tmp_path: Path, where: str, message: str) -> None:
    path = tmp_path / where
    if where == "file":
        path.write_text("text\n")
    elif where == "empty":
        path.mkdir()
    with pytest.raises(ValueError, match=message):
        TokenDataset(path)
    result = subprocess.run(
        [sys.executable, "-m", "tokenizer_service.tools.pretokenize.shards_cli", "info", str(path)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and message in result.stderr
