"""Exports, merges and datasets that cannot destroy, mix or misread data (issue 36 items 2-6; issue 35's
refusals before any progress bar).

Datasets are made by the real pre-tokenizer (the bundled model) where a user's would be; the commands run
as the installed ``tokenizer-shards`` where the point is what a user sees on a terminal.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tokenizer_client.dataset import TokenDataset, write_dataset
from tokenizer_client.mixture import Mixture
from tokenizer_service.settings import BUNDLED_MODELS_DIR
from tokenizer_service.tools.pretokenize import main as pretokenize
from tokenizer_service.tools.pretokenize.shards_cli import main as shards

MODEL = BUNDLED_MODELS_DIR / "default.model"
COMMAND = shutil.which("tokenizer-shards") or str(Path(sys.executable).parent / "tokenizer-shards")


def tokenizer_shards(*args: Any) -> subprocess.CompletedProcess[str]:
    """The installed command, as from a terminal (no -q unless given: a progress bar would show on stderr)."""
    return subprocess.run([COMMAND, *map(str, args)], capture_output=True, text=True, timeout=120)


def one_line(result: subprocess.CompletedProcess[str], code: int, *needles: str) -> str:
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    error = result.stderr
    assert len(error.strip().splitlines()) == 1, error  # one line: no progress bar before it, no traceback
    assert error.startswith("tokenizer-shards: ") and "Traceback" not in error and "\r" not in error, error
    assert not result.stdout, result.stdout
    for needle in needles:
        assert needle in error, error
    return error


def snapshot(directory: Path) -> dict[str, bytes]:
    """Every file below `directory` (links followed) and its bytes."""
    files = sorted(path for path in directory.rglob("*") if path.is_file())
    return {str(path.relative_to(directory)): path.read_bytes() for path in files}


def build(directory: Path, texts: list[str], *extra: Any) -> Path:
    source = directory.parent / f"{directory.name}.jsonl"
    source.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts), encoding="utf-8")
    args = [source, "--local", "--model", MODEL, "--workers", "1", "-q", "--output", directory, *extra]
    assert pretokenize([str(a) for a in args]) == 0
    return directory


@pytest.fixture(scope="module")
def made(documents: list[str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("safety")
    return {
        "one": build(root / "one", documents[:200]),
        "three": build(root / "three", documents[:300], "--shard-tokens", "5000"),
    }


@pytest.fixture
def dataset(made: dict[str, Path], tmp_path: Path, request: pytest.FixtureRequest) -> Path:
    """A private copy of a made dataset (tests may try to damage it)."""
    copy = tmp_path / "ds"
    shutil.copytree(made[getattr(request, "param", "three")], copy)
    return copy


# -- 2. an export never writes onto its own dataset ------------------------------------------------------------


@pytest.mark.parametrize("dataset", ["one", "three"], indirect=True)
def test_an_export_onto_its_own_shards_is_refused_before_anything_is_touched(dataset: Path, tmp_path: Path) -> None:
    assert len(TokenDataset(dataset).metadata["shards"]) in (1, 3)
    before = snapshot(dataset)
    (tmp_path / "link").symlink_to(dataset)
    cases = [
        ("megatron", dataset / "00000", []),  # the reported one: unlinked 00000.bin, or overwrote 00000.bin/.idx
        ("megatron", tmp_path / "link" / "00000", []),  # through a symlink to the dataset
        ("megatron", dataset / "sub" / "corpus", []),
        ("nanogpt", dataset / "00000.bin", []),
        ("nanogpt", dataset, []),  # a directory: DIR/train.bin
        ("llmc", dataset, []),
        ("litdata", tmp_path / "link", []),
    ]
    for to, output, extra in cases:
        result = tokenizer_shards("export", dataset, "--to", to, "--output", output, *extra)
        one_line(result, 2, "inside the dataset", str(dataset))
        assert snapshot(dataset) == before, (to, output)
    # a shard linked from elsewhere: the export would replace the link's target
    store = tmp_path / "store"
    store.mkdir()
    (dataset / "00000.bin").rename(store / "corpus.bin")
    (dataset / "00000.bin").symlink_to(store / "corpus.bin")
    for to, output in (("megatron", store / "corpus"), ("nanogpt", store / "corpus.bin")):
        result = tokenizer_shards("export", dataset, "--to", to, "--output", output)
        one_line(result, 2, "would write over", "00000.bin")
        assert snapshot(dataset) == before, (to, output)
    # the validation set's place is checked too: megatron OUT_val, litdata OUT_val/
    base = dataset.parent / "x"
    dataset.rename(dataset.parent / "x_val")
    moved = dataset.parent / "x_val"
    result = tokenizer_shards("export", moved, "--to", "litdata", "--output", base, "--val-documents", "5")
    one_line(result, 2, "inside the dataset")
    assert snapshot(moved) == before and not base.exists()
    assert tokenizer_shards("verify", moved).returncode == 0


@pytest.mark.parametrize("dataset", ["one", "three"], indirect=True)
def test_a_file_url_is_held_to_the_rules_of_its_path(dataset: Path, tmp_path: Path) -> None:
    """An --output given as a file:// URL (staged, then stored through fsspec) was never checked: it overwrote the
    dataset's own shards, or the corpus the dataset was made from, and said nothing. A file:// dataset (read through
    a cache) with a path --output inside it was checked against the cache's folder."""
    before = snapshot(dataset)
    url = f"file://{dataset}"
    cases = [
        (dataset, "megatron", f"file://{dataset}/00000", "inside the dataset"),
        (dataset, "nanogpt", f"file://{dataset}/00000.bin", "inside the dataset"),
        (dataset, "litdata", f"file://{dataset}", "inside the dataset"),
        (url, "nanogpt", str(dataset / "x.bin"), "inside the dataset"),
        (url, "megatron", f"file://{dataset}/sub/corpus", "inside the dataset"),
    ]
    for given, to, output, says in cases:
        one_line(tokenizer_shards("export", given, "--to", to, "--output", output), 2, says)
        assert snapshot(dataset) == before, (given, to, output)


def _corpus_of(dataset: Path) -> Path:
    return Path(TokenDataset(dataset).metadata["sources"][0]["path"])


def test_an_export_never_writes_over_the_corpus_it_was_made_from_by_url(documents: list[str], tmp_path: Path) -> None:
    dataset = build(tmp_path / "ds", documents[:50])
    source = _corpus_of(dataset)
    before = source.read_bytes()
    for given in (dataset, f"file://{dataset}"):
        for output in (f"file://{source}", str(source)):
            result = tokenizer_shards("export", given, "--to", "nanogpt", "--output", output)
            one_line(result, 2, "would write over", str(source))
    assert source.read_bytes() == before


def test_a_validation_place_of_other_files_is_refused_without_val_documents(made: dict[str, Path], tmp_path: Path):
    """An export removes an earlier export's validation files at OUT_val: a directory there that holds anything
    else is refused, as with --val-documents (it was emptied of its export and left with the foreign file)."""
    other = tmp_path / "web_val"
    assert shards(["export", str(made["three"]), "--to", "litdata", "--output", str(other), "-q"]) == 0
    (other / "notes.txt").write_text("keep")
    before = snapshot(other)
    result = tokenizer_shards("export", made["one"], "--to", "litdata", "--output", tmp_path / "web")
    one_line(result, 2, "notes.txt", "not written by an export")
    assert snapshot(other) == before and not (tmp_path / "web").exists()


@pytest.mark.parametrize(
    ("to", "extra", "says"),
    [
        ("nanogpt", ["--per-shard"], "--per-shard is megatron's"),
        ("litdata", ["--per-shard"], "--per-shard is megatron's"),
        ("megatron", ["--shard-tokens", "7"], "--shard-tokens is llmc's"),
        ("nanogpt", ["--shard-tokens", "7"], "--shard-tokens is llmc's"),
    ],
)
def test_an_option_of_another_format_is_refused(made: dict[str, Path], tmp_path: Path, to, extra, says) -> None:
    result = tokenizer_shards("export", made["one"], "--to", to, "--output", tmp_path / "out", *extra)
    one_line(result, 2, says)
    assert not list(tmp_path.iterdir())


def test_what_a_killed_command_left_in_the_temporary_directory_goes_at_the_next_start(
    made: dict[str, Path], tmp_path: Path
) -> None:
    """A URL's cache and an export's staging were left in /tmp by every kill -9 (megabytes each), and a rerun made
    new ones: the next command removes those of processes that are gone, and leaves a live one's."""
    import os

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(gone.stdout)
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    stale = [temporary / f"tokenizer-shards-{what}-{dead}-abc" for what in ("cache", "export")]
    live = temporary / f"tokenizer-shards-cache-{os.getpid()}-abc"
    for directory in (*stale, live):
        directory.mkdir()
        (directory / "left.bin").write_bytes(b"x" * 1000)
    url = f"file://{made['one']}"
    command = [COMMAND, "export", url, "--to", "nanogpt", "--output", f"file://{tmp_path}/out.bin", "-q"]
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=120, env={**os.environ, "TMPDIR": str(temporary)}
    )
    assert result.returncode == 0, result.stderr
    assert sorted(path.name for path in temporary.iterdir()) == [live.name]


# -- 3. a re-export replaces the earlier one ----------------------------------------------------------------------


def llmc_ids(directory: Path, split: str = "train") -> list[int]:
    """What llm.c reads of `-i DIR/train_*.bin` (its glob, sorted)."""
    ids: list[int] = []
    for file in sorted(directory.glob(f"{split}_*.bin")):
        header = np.fromfile(file, dtype="<i4", count=256)
        assert file.stat().st_size == 1024 + 2 * int(header[2])
        ids += np.fromfile(file, dtype="<u2", offset=1024).tolist()
    return ids


def test_a_reexport_replaces_the_files_of_the_earlier_one(made: dict[str, Path], tmp_path: Path) -> None:
    source = made["three"]
    dataset = TokenDataset(source)
    everything = np.concatenate([dataset.shard(i).ids for i in range(dataset.num_shards)]).tolist()
    out = tmp_path / "llmc"
    first = tokenizer_shards("export", source, "--to", "llmc", "--output", out, "--shard-tokens", "500", "-q")
    assert first.returncode == 0, first.stderr
    assert len(list(out.glob("train_*.bin"))) > 8
    again = tokenizer_shards("export", source, "--to", "llmc", "--output", out, "--shard-tokens", "4000", "-q")
    assert again.returncode == 0, again.stderr
    assert llmc_ids(out) == everything  # no stale train_*.bin left for llm.c's glob
    assert sorted(p.name for p in out.iterdir()) == [f"train_{i:06d}.bin" for i in range(-(-len(everything) // 4000))]
    # a validation split, then none: the old val_*.bin go too (they would hold training documents now)
    val = shards(["export", str(source), "--to", "llmc", "--output", str(out), "--val-documents", "20", "-q"])
    assert val == 0 and llmc_ids(out, "val") and llmc_ids(out) != everything
    assert shards(["export", str(source), "--to", "llmc", "--output", str(out), "-q"]) == 0
    assert not list(out.glob("val_*")) and llmc_ids(out) == everything

    # megatron --per-shard, then one pair: the per-shard pairs and the old validation pair go
    prefix = tmp_path / "meg" / "corpus"
    megatron = ["export", str(source), "--to", "megatron", "--output", str(prefix), "-q"]
    assert shards([*megatron, "--per-shard"]) == 0
    assert shards([*megatron, "--val-documents", "3"]) == 0
    assert shards(megatron) == 0
    assert sorted(p.name for p in prefix.parent.iterdir()) == ["corpus.bin", "corpus.idx"]

    # nanogpt: val.bin beside train.bin goes with a re-export without a validation split
    nano = tmp_path / "nano"
    nano.mkdir()
    assert shards(["export", str(source), "--to", "nanogpt", "--output", str(nano), "--val-documents", "3", "-q"]) == 0
    assert (nano / "val.bin").exists()
    assert shards(["export", str(source), "--to", "nanogpt", "--output", str(nano), "-q"]) == 0
    assert sorted(p.name for p in nano.iterdir()) == ["train.bin"]

    # litdata: chunks of the earlier export go
    lit = tmp_path / "lit"
    assert shards(["export", str(source), "--to", "litdata", "--output", str(lit), "-q"]) == 0
    (lit / "chunk-0-7.bin").write_bytes(b"stale")  # as a longer earlier export leaves
    assert shards(["export", str(source), "--to", "litdata", "--output", str(lit), "-q"]) == 0
    index = json.loads((lit / "index.json").read_text())
    assert sorted(p.name for p in lit.iterdir()) == sorted(["index.json", *(c["filename"] for c in index["chunks"])])


def test_an_export_into_a_directory_of_other_files_is_refused(made: dict[str, Path], tmp_path: Path) -> None:
    for to in ("llmc", "litdata"):
        out = tmp_path / to
        out.mkdir()
        (out / "notes.txt").write_text("mine")
        result = tokenizer_shards("export", made["one"], "--to", to, "--output", out)
        one_line(result, 2, "notes.txt", "not written by an export")
        assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


# -- issue 35: refusals before any progress bar -------------------------------------------------------------------


def test_refusals_known_before_work_come_before_any_progress_bar(
    made: dict[str, Path], documents: list[str], tmp_path: Path
) -> None:
    wide = dict(json.loads((made["one"] / "metadata.json").read_text()))
    wide_dir = tmp_path / "wide"
    shutil.copytree(made["one"], wide_dir)
    meta = {**wide, "dtype": "<u4", "model": {**wide["model"], "vocab_size": 129_280}}
    # a 129k vocabulary's dataset (its ids as uint32: written again so that the sizes agree)
    for name in ("00000.bin",):
        ids = np.fromfile(made["one"] / name, dtype="<u2").astype("<u4")
        (wide_dir / name).chmod(0o644)
        ids.tofile(wide_dir / name)
    idx = wide_dir / "00000.idx"
    idx.chmod(0o644)
    raw = bytearray(idx.read_bytes())
    raw[11] = 4
    idx.write_bytes(bytes(raw))
    (wide_dir / "metadata.json").write_text(json.dumps(meta))
    assert tokenizer_shards("verify", wide_dir).returncode == 0
    one_line(tokenizer_shards("export", wide_dir, "--to", "nanogpt", "--output", tmp_path / "n"), 2, "uint16")
    one_line(tokenizer_shards("export", wide_dir, "--to", "llmc", "--output", tmp_path / "l"), 2, "uint16")
    packed = build(tmp_path / "best", documents[:100], "--seq-len", "64", "--strategy", "best_fit")
    one_line(tokenizer_shards("export", packed, "--to", "litdata", "--output", tmp_path / "b"), 2, "best_fit")
    too_many = tokenizer_shards(
        "export", made["one"], "--to", "megatron", "--output", tmp_path / "v", "--val-documents", 999
    )
    one_line(too_many, 2, "leaves no training document")
    one_line(
        tokenizer_shards("export", made["one"], "--to", "llmc", "--output", tmp_path / "s", "--shard-tokens", "0"),
        2,
        "--shard-tokens",
    )
    one_line(tokenizer_shards("verify", packed, "--sample", "5"), 2, "ragged")
    one_line(tokenizer_shards("verify", made["one"], "--sample", "-1"), 2, "--sample")
    assert not any((tmp_path / name).exists() for name in ("n", "l", "b", "v", "v_val", "s"))


# -- 4. merge takes exactly the rank directories it names ----------------------------------------------------------


@pytest.fixture(scope="module")
def ranked(documents: list[str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ranked")
    inputs = root / "inputs"
    inputs.mkdir()
    for part in range(4):
        text = "".join(json.dumps({"text": f"{part} {doc}"}) + "\n" for doc in documents[part * 60 : (part + 1) * 60])
        (inputs / f"part-{part}.jsonl").write_text(text, encoding="utf-8")
    output = root / "out"
    for rank in range(2):
        args = [inputs, "--local", "--model", MODEL, "--workers", "1", "-q", "--shard-tokens", "1500"]
        args += ["--output", output, "--rank", rank, "--world-size", 2]
        assert pretokenize([str(a) for a in args]) == 0
    return output


def merged_copy(ranked: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "ranked"
    shutil.copytree(ranked, copy)
    return copy


def half_written(rank: Path) -> None:
    """Make `rank` look like a rank killed after its first shard."""
    meta_file = rank / "metadata.json"
    meta = json.loads(meta_file.read_text())
    for shard in meta["shards"][1:]:
        for suffix in (".bin", ".idx"):
            (rank / f"{shard['name']}{suffix}").unlink()
    meta["shards"], meta["complete"] = meta["shards"][:1], False
    meta_file.chmod(0o644)
    meta_file.write_text(json.dumps(meta))


def test_merge_refuses_any_rank_directory_it_does_not_name(ranked: Path, tmp_path: Path) -> None:
    whole = merged_copy(ranked, tmp_path / "whole")
    assert tokenizer_shards("merge", whole).returncode == 0
    expected = [doc.tolist() for doc in (TokenDataset(whole)[i] for i in range(len(TokenDataset(whole))))]
    assert len(expected) == 240

    # a stale copy beside a complete rank: named, the complete rank not blamed
    stale = merged_copy(ranked, tmp_path / "stale")
    shutil.copytree(stale / "rank-00001", stale / "rank-00001.old")
    half_written(stale / "rank-00001.old")
    error = one_line(tokenizer_shards("merge", stale), 2, "rank-00001.old")
    assert "incomplete: rank-00001" not in error and not (stale / "metadata.json").exists()

    # a complete backup beside a half-written rank: refused, never merged over the half-written files
    backup = merged_copy(ranked, tmp_path / "backup")
    shutil.copytree(backup / "rank-00001", backup / "rank-00001.bak")
    half_written(backup / "rank-00001")
    one_line(tokenizer_shards("merge", backup), 2, "rank-00001.bak")
    assert not (backup / "metadata.json").exists()
    shutil.rmtree(backup / "rank-00001.bak")
    one_line(tokenizer_shards("merge", backup), 2, "incomplete: rank-00001")

    # a rank written as rank-1: refused by name (a merge would name rank-00001/..., files that do not exist)
    short = merged_copy(ranked, tmp_path / "short")
    (short / "rank-00001").rename(short / "rank-1")
    one_line(tokenizer_shards("merge", short), 2, "rank-1")
    assert not (short / "metadata.json").exists()

    # a rank directory holding another rank's output
    swapped = merged_copy(ranked, tmp_path / "swapped")
    shutil.rmtree(swapped / "rank-00001")
    shutil.copytree(swapped / "rank-00000", swapped / "rank-00001")
    one_line(tokenizer_shards("merge", swapped), 2, "rank-00001", "rank 0")

    # a shard file gone from a complete rank: merge exits 0 only for a dataset that reads back
    missing = merged_copy(ranked, tmp_path / "missing")
    gone = sorted((missing / "rank-00001").glob("*.bin"))[-1]
    gone.unlink()
    one_line(tokenizer_shards("merge", missing), 2, gone.name)
    assert not (missing / "metadata.json").exists()


# -- 5. datasets cannot lie: the dtype -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["<f2", ">u2", "<i2", "<u8", "|u1", "float16", 7])
def test_a_dtype_other_than_u2_or_u4_is_refused_at_open(dataset: Path, tmp_path: Path, dtype: Any) -> None:
    meta_file = dataset / "metadata.json"
    meta = json.loads(meta_file.read_text())
    meta_file.chmod(0o644)
    meta_file.write_text(json.dumps({**meta, "dtype": dtype}))
    with pytest.raises(ValueError, match=r"dtype .* is not one this format stores: '<u2' .*'<u4'"):
        TokenDataset(dataset)
    if dtype in ("<f2", ">u2"):  # the reported ones, through every command
        for command in (
            ["verify", dataset],
            ["info", dataset],
            ["export", dataset, "--to", "megatron", "--output", tmp_path / "m"],
            ["export", dataset, "--to", "litdata", "--output", tmp_path / "l"],
        ):
            one_line(tokenizer_shards(*command), 2, "dtype", repr(dtype))
        assert not (tmp_path / "m.bin").exists() and not (tmp_path / "l").exists()


# -- 5. datasets cannot lie: a mixture's cache and state know the data they were made of ------------------------


MIX_MODEL = {"name": "test", "sha256": "0" * 64, "vocab_size": 1 << 16, "bos_id": -1, "eos_id": 0, "pad_id": 0}


def mix_dataset(path: Path, docs: list[np.ndarray], model: dict[str, Any] = MIX_MODEL) -> TokenDataset:
    ids = np.concatenate(docs)
    offsets = np.concatenate([[0], np.cumsum([len(doc) for doc in docs])])
    return write_dataset(path, ids, offsets, model=model, shard_documents=50)


def test_a_dataset_rewritten_in_place_is_neither_read_from_a_stale_cache_nor_resumed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("tokenizer_client.mixture.CACHE_FROM_ITEMS", 0)  # ours are small: cache them all the same
    rng = np.random.default_rng(3)
    docs = [rng.integers(1, 60000, int(n)).astype(np.int64) for n in rng.integers(5, 80, 200)]
    web = tmp_path / "web"
    cache = tmp_path / "cache"
    mix = Mixture({"web": mix_dataset(web, docs)}, seq_len=64, seed=1, cache_dir=cache)
    mix.rows(0, 256)
    loader = mix.loader(batch_size=8)
    next(loader)
    state = loader.state_dict()
    # the same documents in another order within each shard: metadata.json the same, other document starts
    shutil.rmtree(web)
    order = np.concatenate([start + rng.permutation(50) for start in range(0, len(docs), 50)])
    mix_dataset(web, [docs[i] for i in order])
    fresh = Mixture({"web": TokenDataset(web)}, seq_len=64, seed=1).rows(0, 256)
    cached = Mixture({"web": TokenDataset(web)}, seq_len=64, seed=1, cache_dir=cache)
    assert np.array_equal(cached.rows(0, 256).input_ids, fresh.input_ids)  # not the old starts from the cache
    with pytest.raises(ValueError, match=r"source 'web' holds other data"):
        cached.loader(batch_size=8, state=state)


# -- 6. a mixture never mixes tokenizers -----------------------------------------------------------------------


def test_a_mixture_of_datasets_of_other_tokenizers_is_refused(tmp_path: Path) -> None:
    docs = [np.arange(1, 40, dtype=np.int64)] * 20
    llama = {**MIX_MODEL, "name": "llama2", "sha256": "a" * 64, "vocab_size": 32_000}
    qwen = {**MIX_MODEL, "name": "qwen", "sha256": "b" * 64, "vocab_size": 151_646}
    sources = {
        "web": mix_dataset(tmp_path / "web", docs, llama),
        "code": mix_dataset(tmp_path / "code", docs, qwen),
        "books": mix_dataset(tmp_path / "books", docs, llama),
    }
    with pytest.raises(ValueError) as refused:
        Mixture(sources, seq_len=16)
    message = str(refused.value)
    assert "\n" not in message and "other tokenizers" in message
    for needle in ("'web'", "'books'", "'code'", "llama2", "qwen", "32,000", "151,646", "aaaaaaaaaaaa", "bbbbbbbbbbbb"):
        assert needle in message, message
    same_vocab = {**llama, "sha256": "c" * 64}  # the same vocabulary size, another model file
    with pytest.raises(ValueError, match="other tokenizers"):
        Mixture({"web": sources["web"], "other": mix_dataset(tmp_path / "other", docs, same_vocab)}, seq_len=16)
    Mixture({"web": sources["web"], "books": sources["books"]}, seq_len=16)  # one tokenizer: fine
