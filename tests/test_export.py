"""tokenizer-shards: info, verify, and exports read back by the trainers' own readers.

megatron-core and litdata pull torch and pin each other out, so each lives in a virtual environment
of its own, named by TOKENIZER_MEGATRON_PYTHON and TOKENIZER_LITDATA_PYTHON (.ci/run creates both).
Without them these tests skip, except under TOKENIZER_CI=1, where that fails. nanoGPT's and llm.c's
files are checked against their documented layouts (llm.c's reader is C; its checks are mirrored).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from tokenizer_client.dataset import TokenDataset, write_dataset
from tokenizer_service.settings import BUNDLED_MODELS_DIR
from tokenizer_service.tools.pretokenize import main as pretokenize
from tokenizer_service.tools.pretokenize.export import ExportError, check_exportable
from tokenizer_service.tools.pretokenize.shards_cli import main as shards

MODEL = BUNDLED_MODELS_DIR / "default.model"


def reader_python(name: str) -> str:
    variable = f"TOKENIZER_{name.upper()}_PYTHON"
    python = os.environ.get(variable)
    if python and Path(python).exists():
        return python
    if os.environ.get("TOKENIZER_CI") == "1":
        pytest.fail(f"{variable} names no Python with {name} installed, and TOKENIZER_CI=1 says this must run")
    pytest.skip(f"{name} reader not available (set {variable} to a Python that has it)")


def run_reader(name: str, script: str, *args: str) -> object:
    result = subprocess.run(
        [reader_python(name), "-W", "ignore", "-c", script, *args], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


MEGATRON_READ = """
import json, sys, warnings
warnings.filterwarnings("ignore")
from megatron.core.datasets.indexed_dataset import IndexedDataset
dataset = IndexedDataset(sys.argv[1])
print(json.dumps({"sequences": [dataset[i].tolist() for i in range(len(dataset))],
                  "documents": dataset.document_indices.tolist()}))
"""

LITDATA_READ = """
import json, sys, warnings
warnings.filterwarnings("ignore")
from litdata import StreamingDataset
from litdata.streaming.item_loader import TokensLoader
dataset = StreamingDataset(sys.argv[1], item_loader=TokensLoader(block_size=int(sys.argv[2])), shuffle=False)
print(json.dumps([dataset[i].tolist() for i in range(len(dataset))]))
"""


LITDATA_READ_ITEMS = """
import json, sys, warnings
warnings.filterwarnings("ignore")
from litdata import StreamingDataset
dataset = StreamingDataset(sys.argv[1], shuffle=False)
items = [dataset[i] for i in range(len(dataset))]
print(json.dumps([[item["input_ids"].tolist(), item["loss_mask"].tolist(), str(item["input_ids"].dtype),
                   str(item["loss_mask"].dtype)] for item in items]))
"""

# litdata's own BinaryWriter, given the same items (one chunk): its chunk and index.json config against the export's
LITDATA_WRITE_ITEMS = """
import json, sys, warnings
from pathlib import Path
warnings.filterwarnings("ignore")
import numpy as np
from litdata.streaming.writer import BinaryWriter
arrays = np.load(sys.argv[2])
ids, mask, lengths = arrays["ids"], arrays["mask"], arrays["lengths"]
offsets = np.concatenate([[0], np.cumsum(lengths)])
writer = BinaryWriter(sys.argv[3], chunk_size=len(lengths))
for i in range(len(lengths)):
    writer[i] = {"input_ids": ids[offsets[i] : offsets[i + 1]], "loss_mask": mask[offsets[i] : offsets[i + 1]]}
writer.done()
writer.merge()
ours, theirs = Path(sys.argv[1]), Path(sys.argv[3])
config = lambda path: {k: v for k, v in json.loads((path / "index.json").read_text())["config"].items()}
print(json.dumps({"chunk": (ours / "chunk-0-0.bin").read_bytes() == (theirs / "chunk-0-0.bin").read_bytes(),
                  "chunks": json.loads((ours / "index.json").read_text())["chunks"]
                  == json.loads((theirs / "index.json").read_text())["chunks"],
                  "config": config(ours) == config(theirs)}))
"""


@pytest.fixture(scope="module")
def outputs(documents: list[str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("exports")
    source = directory / "in.jsonl"
    source.write_text("".join(json.dumps({"text": text}) + "\n" for text in documents[:800]))
    common = [source, "--local", "--model", MODEL, "--workers", "1", "-q", "--shard-tokens", "8000"]
    made = {
        "ragged": directory / "ragged",
        "concat": directory / "concat",
        "best_fit": directory / "best_fit",
    }
    assert pretokenize([str(a) for a in [*common, "--output", made["ragged"]]]) == 0
    assert pretokenize([str(a) for a in [*common, "--output", made["concat"], "--seq-len", "64"]]) == 0
    best_fit = [*common, "--output", made["best_fit"], "--seq-len", "64", "--strategy", "best_fit"]
    assert pretokenize([str(a) for a in best_fit]) == 0
    return made


def documents_of(path: Path) -> list[list[int]]:
    dataset = TokenDataset(path)
    return [dataset[i].tolist() for i in range(len(dataset))]


def all_ids(path: Path) -> list[int]:
    dataset = TokenDataset(path)
    return np.concatenate([dataset.shard(i).ids for i in range(dataset.num_shards)]).tolist()


def test_info_and_verify(outputs, capsys):
    assert shards(["info", str(outputs["ragged"])]) == 0
    info = capsys.readouterr().out
    assert "complete" in info and "800 documents" in info and "model default" in info
    assert shards(["verify", str(outputs["ragged"]), "--sample", "40"]) == 0
    assert "40 sampled documents re-tokenized to the same ids" in capsys.readouterr().out


def test_verify_says_an_output_is_incomplete(outputs, tmp_path, capsys):
    """A probe's verify of a run stopped part way passed without a word about it: it now says INCOMPLETE first."""
    partial = tmp_path / "partial"
    shutil.copytree(outputs["ragged"], partial)
    meta = json.loads((partial / "metadata.json").read_text())
    (partial / "metadata.json").write_text(json.dumps({**meta, "complete": False}))
    assert shards(["verify", str(partial)]) == 0  # what is there is sound
    assert capsys.readouterr().out.startswith("INCOMPLETE output (run tokenizer-pretokenize again to finish)")


def test_verify_finds_a_damaged_shard(outputs, tmp_path, capsys):
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    for file in outputs["ragged"].iterdir():
        (damaged / file.name).write_bytes(file.read_bytes())
    shard = damaged / "00001.bin"
    shard.write_bytes(shard.read_bytes()[:-10])
    assert shards(["verify", str(damaged)]) == 1
    error = capsys.readouterr().err
    assert error.startswith("tokenizer-shards: verify failed:") and "Traceback" not in error


@pytest.mark.parametrize("kernel", ["copies", "refuses", "stops midway"])
def test_a_whole_shard_is_appended_by_the_kernel_or_written_with_the_same_bytes(outputs, tmp_path, monkeypatch, kernel):
    """One Megatron .bin of every shard: the kernel appends each whole shard's .bin (copy_file_range); where it
    cannot, or fails after copying part of one, that shard is written from its mapping. The bytes are the ids
    either way."""
    real = os.copy_file_range
    calls = []

    def copy(source: int, target: int, count: int) -> int:
        calls.append(count)
        if kernel == "refuses":
            raise OSError(18, "Invalid cross-device link")
        if kernel == "stops midway" and len(calls) == 2:
            raise OSError(5, "Input/output error")
        return real(source, target, min(count, 1000) if kernel == "stops midway" else count)

    monkeypatch.setattr(os, "copy_file_range", copy)
    prefix = tmp_path / "corpus"
    assert shards(["export", str(outputs["ragged"]), "--to", "megatron", "--output", str(prefix), "-q"]) == 0
    dataset = TokenDataset(outputs["ragged"])
    expected = np.asarray(all_ids(outputs["ragged"]), dtype=dataset.shard(0).ids.dtype)
    assert prefix.with_suffix(".bin").read_bytes() == expected.tobytes()
    if kernel == "copies":  # one call a shard, each the whole .bin
        assert calls == [dataset.shard(i).ids.nbytes for i in range(dataset.num_shards)], calls
    else:
        assert calls


@pytest.mark.readers
@pytest.mark.parametrize("per_shard", [False, True])
def test_megatron_reads_the_export(outputs, tmp_path, per_shard):
    prefix = tmp_path / "megatron" / "corpus"
    args = ["export", str(outputs["ragged"]), "--to", "megatron", "--output", str(prefix), "-q"]
    assert shards(args + (["--per-shard"] if per_shard else [])) == 0
    expected = documents_of(outputs["ragged"])
    if not per_shard:
        read = run_reader("megatron", MEGATRON_READ, str(prefix))
        assert read["sequences"] == expected and read["documents"] == list(range(len(expected) + 1))
        return
    got = []
    dataset = TokenDataset(outputs["ragged"])
    for shard in dataset.metadata["shards"]:
        part = Path(f"{prefix}_{shard['name']}")
        assert part.with_suffix(".bin").stat().st_ino == (outputs["ragged"] / f"{shard['name']}.bin").stat().st_ino
        got += run_reader("megatron", MEGATRON_READ, str(part))["sequences"]
    assert got == expected


@pytest.mark.readers
def test_megatron_reads_a_concat_packed_export_as_rows(outputs, tmp_path):
    prefix = tmp_path / "rows"
    assert shards(["export", str(outputs["concat"]), "--to", "megatron", "--output", str(prefix), "-q"]) == 0
    read = run_reader("megatron", MEGATRON_READ, str(prefix))
    assert read["sequences"] == documents_of(outputs["concat"])
    assert {len(row) for row in read["sequences"]} == {64}


@pytest.mark.readers
def test_litdata_reads_the_export(outputs, tmp_path):
    out = tmp_path / "litdata"
    assert shards(["export", str(outputs["ragged"]), "--to", "litdata", "--output", str(out), "-q"]) == 0
    blocks = run_reader("litdata", LITDATA_READ, str(out), "50")
    expected = []
    dataset = TokenDataset(outputs["ragged"])
    for shard in range(dataset.num_shards):  # TokensLoader cuts each chunk into whole blocks
        ids = dataset.shard(shard).ids
        expected += [ids[start : start + 50].tolist() for start in range(0, len(ids) - 49, 50)]
    assert blocks == expected


@pytest.mark.readers
@pytest.mark.parametrize("vocab", [1000, 100_000])  # uint16 and uint32 ids
def test_litdata_reads_a_masked_export_as_items_of_ids_and_loss_mask(tmp_path, vocab):
    """A dataset with loss masks exports to litdata as an item a document, {"input_ids", "loss_mask"}, in litdata's
    own layout: StreamingDataset(dir) reads back TokenDataset's ids and masks (training and validation sets, ragged
    and concat-packed rows), and litdata's BinaryWriter writes the same bytes for the same items."""
    rng = np.random.default_rng(vocab)
    lengths = rng.integers(1, 200, size=300)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    ids = rng.integers(0, vocab, size=int(offsets[-1]))
    mask = rng.integers(0, 2, size=int(offsets[-1]))
    model = {"name": "m", "sha256": "0" * 64, "vocab_size": vocab, "bos_id": -1, "eos_id": 1, "pad_id": 0}
    ragged = write_dataset(tmp_path / "ragged", ids, offsets, model=model, loss_mask=mask, shard_tokens=9000)
    assert ragged.num_shards > 2 and ragged.metadata["dtype"] == ("<u2" if vocab < 1 << 16 else "<u4")
    out = tmp_path / "litdata"
    args = ["export", str(tmp_path / "ragged"), "--to", "litdata", "--output", str(out), "--val-documents", "20"]
    assert shards([*args, "-q"]) == 0
    dtype = "uint16" if vocab < 1 << 16 else "uint32"
    expected = [[ragged[i].tolist(), ragged.loss_mask(i).tolist(), dtype, "uint8"] for i in range(len(ragged))]
    assert run_reader("litdata", LITDATA_READ_ITEMS, str(out.with_name("litdata_val"))) == expected[:20]
    assert run_reader("litdata", LITDATA_READ_ITEMS, str(out)) == expected[20:]

    packed = write_dataset(tmp_path / "packed", ids, offsets, model=model, loss_mask=mask, seq_len=64)
    rows = tmp_path / "rows"
    assert shards(["export", str(tmp_path / "packed"), "--to", "litdata", "--output", str(rows), "-q"]) == 0
    read = run_reader("litdata", LITDATA_READ_ITEMS, str(rows))
    assert read == [[packed[i].tolist(), packed.loss_mask(i).tolist(), dtype, "uint8"] for i in range(len(packed))]
    assert {len(row[0]) for row in read} == {64}

    one = write_dataset(tmp_path / "one", ids[: offsets[40]], offsets[:41], model=model, loss_mask=mask[: offsets[40]])
    assert (
        shards(["export", str(tmp_path / "one"), "--to", "litdata", "--output", str(tmp_path / "one-out"), "-q"]) == 0
    )
    arrays = tmp_path / "items.npz"
    stored = np.dtype(one.metadata["dtype"])
    np.savez(
        arrays, ids=ids[: offsets[40]].astype(stored), mask=mask[: offsets[40]].astype(np.uint8), lengths=lengths[:40]
    )
    same = run_reader("litdata", LITDATA_WRITE_ITEMS, str(tmp_path / "one-out"), str(arrays), str(tmp_path / "theirs"))
    assert same == {"chunk": True, "chunks": True, "config": True}

    dropped = tmp_path / "dropped"  # --drop-mask: TokensLoader's layout, the ids only, as for an unmasked output
    assert (
        shards(["export", str(tmp_path / "one"), "--to", "litdata", "--output", str(dropped), "--drop-mask", "-q"]) == 0
    )
    assert json.loads((dropped / "index.json").read_text())["config"]["item_loader"] == "TokensLoader"
    blocks = run_reader("litdata", LITDATA_READ, str(dropped), "50")
    flat = ids[: offsets[40]].tolist()
    assert blocks == [flat[start : start + 50] for start in range(0, len(flat) - 49, 50)]


def test_nanogpt_is_one_flat_uint16_file(outputs, tmp_path):
    out = tmp_path / "train.bin"
    assert shards(["export", str(outputs["ragged"]), "--to", "nanogpt", "--output", str(out), "-q"]) == 0
    assert np.memmap(out, dtype=np.uint16, mode="r").tolist() == all_ids(outputs["ragged"])  # as nanoGPT reads it


def test_llmc_shards_have_the_header_llmc_checks(outputs, tmp_path):
    out = tmp_path / "llmc"
    args = ["export", str(outputs["ragged"]), "--to", "llmc", "--output", str(out), "--shard-tokens", "10000", "-q"]
    assert shards(args) == 0
    ids: list[int] = []
    files = sorted(out.glob("train_*.bin"))
    assert len(files) >= 3
    for file in files:  # llmc/dataloader.h: magic, version, token count, and the file size they imply
        header = np.fromfile(file, dtype="<i4", count=256)
        assert (header[0], header[1]) == (20240520, 1)
        assert file.stat().st_size == 256 * 4 + int(header[2]) * 2
        ids += np.fromfile(file, dtype="<u2", offset=1024).tolist()
        assert int(header[2]) <= 10000
    assert ids == all_ids(outputs["ragged"])


def test_refusals_are_one_line_and_exit_2(outputs, tmp_path, capsys):
    args = ["export", str(outputs["best_fit"]), "--to", "megatron", "--output", str(tmp_path / "x"), "-q"]
    assert shards(args) == 2
    error = capsys.readouterr().err
    assert len(error.strip().splitlines()) == 1 and "best_fit rows carry padding" in error
    metadata = json.loads((outputs["ragged"] / "metadata.json").read_text())
    with pytest.raises(ExportError, match="uint16"):
        check_exportable({**metadata, "dtype": "<u4", "model": {**metadata["model"], "vocab_size": 100_000}}, "nanogpt")
    check_exportable({**metadata, "dtype": "<u4"}, "megatron")  # int32 ids there
    with pytest.raises(ExportError, match="incomplete"):
        check_exportable({**metadata, "complete": False}, "litdata")


def test_an_export_never_writes_over_an_input_another_dataset_or_a_file_of_the_user(outputs, tmp_path, capsys):
    """A probe's exports replaced the corpus the dataset was made from (nanogpt at in.jsonl: a hard link to the
    shard there now) and another dataset's shards (megatron at OTHER/00000): each is refused in one line, exit 2,
    before anything is written; an earlier export's .bin is still replaced."""
    source = outputs["ragged"].parent / "in.jsonl"
    other = outputs["concat"]
    mine = tmp_path / "notes.txt"
    mine.write_text("mine")
    before = {path: path.read_bytes() for path in (source, mine, *sorted(other.iterdir()))}
    cases = [
        (["--to", "nanogpt", "--output", str(source)], "an input the dataset"),
        (["--to", "megatron", "--output", str(other / "00000")], "lies inside the dataset"),
        (["--to", "nanogpt", "--output", str(other / "rows.bin")], "lies inside the dataset"),
        (["--to", "litdata", "--output", str(other / "litdata")], "lies inside the dataset"),
        (["--to", "nanogpt", "--output", str(mine)], "is no .bin file"),
    ]
    for args, says in cases:
        assert shards(["export", str(outputs["ragged"]), *args, "-q"]) == 2, args
        error = capsys.readouterr().err
        assert len(error.strip().splitlines()) == 1 and says in error, error
    assert {path: path.read_bytes() for path in before} == before
    assert sorted(other.iterdir()) == sorted(path for path in before if path.parent == other)
    again = tmp_path / "train.bin"
    for _ in range(2):  # an earlier export's own file is replaced
        assert shards(["export", str(outputs["ragged"]), "--to", "nanogpt", "--output", str(again), "-q"]) == 0
    assert np.fromfile(again, dtype=np.uint16).tolist() == all_ids(outputs["ragged"])


def test_exports_inside_an_input_directory_are_no_input(outputs, tmp_path):
    """A probe's litdata export inside the input directory of a next run: its index.json was read as a JSON Lines
    input, every line a bad record. An export of each format there is left out, as a dataset is; a file of the
    user's that is only named index.json is still read."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    texts = ["the first document of the corpus", "and the second one"]
    (corpus / "in.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    (corpus / "notes").mkdir()
    (corpus / "notes" / "index.json").write_text(json.dumps({"text": "a note"}) + "\n")
    places = {"litdata": corpus / "lit", "megatron": corpus / "megatron", "nanogpt": corpus / "train.bin"}
    places["llmc"] = corpus / "llmc"
    for to, place in places.items():
        export = ["tokenizer-shards", "export", str(outputs["ragged"]), "--to", to, "--output", str(place), "-q"]
        subprocess.run(export, check=True, capture_output=True, timeout=120)
    assert json.loads((corpus / "lit" / "index.json").read_text())["chunks"]
    out = tmp_path / "out"
    run = ["tokenizer-pretokenize", str(corpus), "--local", "--output", str(out), "--model", str(MODEL), "-q"]
    result = subprocess.run([*run, "--workers", "1"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "bad record" not in result.stderr, result.stderr
    metadata = TokenDataset(out).metadata
    assert metadata["bad_records"] == 0
    read = [Path(source["path"]) for source in metadata["sources"]]
    assert read == [(corpus / "in.jsonl").resolve(), (corpus / "notes" / "index.json").resolve()]
    assert len(TokenDataset(out)) == 3
    # the same corpus as a prefix URL (fsspec's listing, as in a bucket), a dataset of ours under it too: the
    # exports and the dataset are left out
    shutil.copytree(outputs["ragged"], corpus / "dataset")
    from_url = ["tokenizer-pretokenize", f"file://{corpus}/", "--local", "--output", str(tmp_path / "from-url")]
    from_url += ["--model", str(MODEL), "--workers", "1", "-q"]
    prefix = subprocess.run(from_url, capture_output=True, text=True, timeout=120)
    assert prefix.returncode == 0, prefix.stderr
    assert [source["path"] for source in TokenDataset(tmp_path / "from-url").metadata["sources"]] == [
        f"file://{corpus}/in.jsonl",
        f"file://{corpus}/notes/index.json",
    ]


@pytest.mark.readers
def test_a_tokenizer_json_model_end_to_end_with_int32_ids(documents, multilingual, tmp_path, capsys):
    """A tokenizer.json with a vocabulary over 65,536: pre-tokenized (parsing nothing), verified against
    tokenizers itself, exported to Megatron as int32 and read back by megatron-core; nanoGPT refuses it."""
    from tokenizers import Tokenizer

    from tests.conftest import settle_gates
    from tests.tokenizer_models import BPE_SPECIAL, WIDE_EXTRA, write_wide

    snapshot = write_wide(tmp_path / "wide", documents + multilingual)
    settle_gates({"wide": snapshot})  # the verdict cached: fastokens encodes it from the first chunk
    texts = [
        *multilingual[:40],
        *(f"{doc} <extra_{WIDE_EXTRA - 1 - i}> {BPE_SPECIAL[1]}" for i, doc in enumerate(documents[:60])),
    ]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    output = tmp_path / "shards"
    args = [
        source,
        "--local",
        "--model",
        snapshot,
        "--workers",
        "1",
        "-q",
        "--output",
        output,
        "--shard-tokens",
        "5000",
    ]
    assert pretokenize([str(a) for a in args]) == 0
    dataset = TokenDataset(output)
    assert dataset.metadata["dtype"] == "<u4" and dataset.model["library"] == "tokenizers"
    tokenizer = Tokenizer.from_file(str(snapshot / "tokenizer.json"))
    tokenizer.encode_special_tokens = True
    eos = tokenizer.token_to_id(BPE_SPECIAL[1])
    expected = [[*tokenizer.encode(text, add_special_tokens=False).ids, eos] for text in texts]
    assert documents_of(output) == expected
    assert max(max(ids) for ids in expected) > 1 << 16  # ids that need the int32 path
    assert shards(["info", str(output)]) == 0
    out = capsys.readouterr().out
    from tokenizer_service.core.registry import inspect_model

    encoder = inspect_model("wide", snapshot).encoder  # the fast encoder the rule chose (its verdict cached)
    assert f"model wide (tokenizers bpe, encoded by {encoder}, vocab {WIDE_EXTRA + 1000:,}" in out
    assert shards(["verify", str(output), "--sample", "30"]) == 0
    refused = shards(["export", str(output), "--to", "nanogpt", "--output", str(tmp_path / "nano"), "-q"])
    assert refused == 2
    prefix = tmp_path / "megatron" / "wide"
    assert shards(["export", str(output), "--to", "megatron", "--output", str(prefix), "-q"]) == 0
    assert run_reader("megatron", MEGATRON_READ, str(prefix))["sequences"] == expected
