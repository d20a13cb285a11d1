"""tokenizer-pretokenize end to end: real models, real files, a real server, real SIGKILL."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm

from tests.conftest import DATA, ROOT, Server
from tokenizer_client.dataset import TokenDataset
from tokenizer_client.packing import pack_best_fit, pack_concat
from tokenizer_client.wire import ragged_offsets
from tokenizer_service.settings import BUNDLED_MODELS_DIR
from tokenizer_service.tools.pretokenize import main
from tokenizer_service.tools.pretokenize.ranks import RankError, merge
from tokenizer_service.tools.pretokenize.sources import DocumentReader, Source

SHARD_TOKENS = "4000"


def write_jsonl(path: Path, texts: list[str], opener=open) -> Path:  # type: ignore[no-untyped-def]
    with opener(path, "wt", encoding="utf-8") as file:
        for number, text in enumerate(texts):
            file.write(json.dumps({"id": number, "text": text}) + "\n")
    return path


def write_txt(path: Path, texts: list[str], opener=open) -> Path:  # type: ignore[no-untyped-def]
    with opener(path, "wt", encoding="utf-8") as file:
        file.write("\n\n".join(texts) + "\n")
    return path


@pytest.fixture(scope="module")
def corpus(documents: list[str], tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Path], list[str]]:
    """Four inputs, one of each kind, and every document in reading order."""
    directory = tmp_path_factory.mktemp("corpus")
    parts = [documents[:300], documents[300:450], documents[450:600], documents[600:700]]
    multi_line = [text.replace(". ", ".\n", 1) for text in parts[3]]  # .txt documents may span lines
    files = [
        write_jsonl(directory / "a.jsonl", parts[0]),
        write_jsonl(directory / "b.jsonl.gz", parts[1], gzip.open),
        write_txt(directory / "c.txt.gz", parts[2], gzip.open),
        write_txt(directory / "d.txt", multi_line),
    ]
    return files, parts[0] + parts[1] + parts[2] + multi_line


def pretokenize(*args: object) -> int:
    return main([str(arg) for arg in args])


def ragged(sp: spm.SentencePieceProcessor, texts: list[str], **options: bool) -> tuple[np.ndarray, np.ndarray]:
    pieces = sp.encode(texts, add_eos=options.get("add_eos", True), add_bos=options.get("add_bos", False))
    ids = np.concatenate([np.asarray(piece, np.int32) for piece in pieces])
    return ids, ragged_offsets(np.array([len(piece) for piece in pieces]))


def files_of(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


def test_ragged_output_equals_in_process_tokenization(
    corpus: tuple[list[Path], list[str]], model_files: dict[str, Path], tmp_path: Path
) -> None:
    inputs, texts = corpus
    out = tmp_path / "out"
    args = ["--local", "--model", model_files["uni"], "--shard-tokens", "9000"]
    assert pretokenize(*inputs, "--output", out, *args) == 0

    sp = spm.SentencePieceProcessor(model_file=str(model_files["uni"]))
    expected = sp.encode(texts, add_eos=True)
    dataset = TokenDataset(out)
    assert len(dataset) == dataset.num_documents == len(texts)
    assert dataset.num_tokens == sum(len(ids) for ids in expected)
    assert dataset.num_shards > 2
    for index, ids in enumerate(expected):
        assert dataset[index].tolist() == ids
    meta = dataset.metadata
    assert meta["complete"] and "resume" not in meta
    assert meta["dtype"] == "<u2" and dataset[0].dtype == np.dtype("<u2")
    assert meta["model"]["sha256"] == hashlib.sha256(model_files["uni"].read_bytes()).hexdigest()
    assert meta["model"]["vocab_size"] == 3000
    assert meta["options"]["add_eos"] is True and meta["bad_records"] == 0
    assert [source["path"] for source in meta["sources"]] == [str(path.resolve()) for path in inputs]
    assert all(source["done"] for source in meta["sources"])
    assert [source["documents"] for source in meta["sources"]] == [300, 150, 150, 100]
    plain = [source for source in meta["sources"] if not source["compressed"]]
    assert all(source["read_bytes"] == source["size"] for source in plain)
    assert sum(shard["documents"] for shard in meta["shards"]) == len(texts)
    assert all(shard["tokens"] >= 9000 for shard in meta["shards"][:-1])


@pytest.mark.slow  # a run of the pre-tokenizer each; .ci/run's slow stage
@pytest.mark.parametrize("strategy", ["concat", "best_fit"])
def test_packed_rows_equal_the_online_packing(
    strategy: str, corpus: tuple[list[Path], list[str]], model_files: dict[str, Path], tmp_path: Path
) -> None:
    inputs, texts = corpus
    out, seq_len = tmp_path / "out", 96
    args = ["--local", "--model", model_files["bpe"], "--seq-len", seq_len, "--strategy", strategy]
    assert pretokenize(*inputs, "--output", out, *args, "--shard-tokens", SHARD_TOKENS) == 0

    sp = spm.SentencePieceProcessor(model_file=str(model_files["bpe"]))
    dataset = TokenDataset(out)
    assert dataset.num_shards > 2
    if strategy == "concat":  # one stream cut every seq_len, as /v1/pack with carry cuts it
        ids, offsets = ragged(sp, texts)
        expected = [pack_concat(ids, offsets, seq_len, eos_id=sp.eos_id())]
        assert dataset.metadata["leftover"]["ids"] == expected[0].leftover.tolist()
    else:  # each shard's documents packed together, as one /v1/pack request packs them
        expected, start = [], 0
        for shard in dataset.metadata["shards"]:
            ids, offsets = ragged(sp, texts[start : start + shard["documents"]])
            expected.append(pack_best_fit(ids, offsets, seq_len, pad_id=sp.eos_id()))
            start += shard["documents"]
        assert start == len(texts)
    assert len(dataset) == sum(packed.num_rows for packed in expected)
    row_index = 0
    for packed in expected:
        for row in range(packed.num_rows):
            got = dataset.row(row_index)
            assert np.array_equal(got.input_ids, packed.input_ids[row])
            assert np.array_equal(got.labels, packed.labels[row])
            assert np.array_equal(got.position_ids, packed.position_ids[row])
            assert np.array_equal(got.cu_seqlens, packed.row_cu_seqlens(row))
            row_index += 1
    assert dataset.metadata["tokens"] == sum(len(ids) for ids in sp.encode(texts, add_eos=True))


@pytest.mark.slow  # a run of the pre-tokenizer each; .ci/run's slow stage
@pytest.mark.parametrize("packing", [[], ["--seq-len", "64", "--strategy", "concat"]], ids=["ragged", "concat"])
def test_through_the_service_gives_the_same_files_as_local(
    packing: list[str], corpus: tuple[list[Path], list[str]], server: Server, tmp_path: Path
) -> None:
    inputs, _ = corpus
    common = [*inputs, "--shard-tokens", SHARD_TOKENS, *packing]
    assert pretokenize(*common, "--output", tmp_path / "service", "--url", server.url, "--model", "uni") == 0
    assert pretokenize(*common, "--output", tmp_path / "local", "--local", "--model", server.model_files["uni"]) == 0
    service, local = files_of(tmp_path / "service"), files_of(tmp_path / "local")
    # metadata.json alike but for where a --local run read its model (what verify looks for)
    service_meta, local_meta = json.loads(service.pop("metadata.json")), json.loads(local.pop("metadata.json"))
    assert local_meta["model"].pop("path") == str(server.model_files["uni"].resolve())
    assert service == local and service_meta == local_meta


@pytest.mark.slow  # a run of the pre-tokenizer each; .ci/run's slow stage
def test_service_with_two_urls_and_the_default_model(
    corpus: tuple[list[Path], list[str]], server: Server, tmp_path: Path
) -> None:
    inputs, texts = corpus
    out = tmp_path / "out"
    assert pretokenize(inputs[0], "--output", out, "--url", server.url, "--url", server.url + "/") == 0
    dataset = TokenDataset(out)
    assert dataset.model["name"] == "default"
    sp = server.processor("default")
    assert [dataset[i].tolist() for i in range(len(dataset))] == sp.encode(texts[:300], add_eos=True)


def test_bad_records_are_reported_with_file_and_line_skipped_and_counted(
    documents: list[str], model_files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    jsonl = tmp_path / "bad.jsonl"
    lines = [json.dumps({"text": documents[0]}).encode(), b"{not json", b'{"body": "no text field"}']
    lines += [b'{"text": 42}', b'["text"]', b"", json.dumps({"text": documents[1]}).encode(), b'{"text": "caf\xe9"}']
    jsonl.write_bytes(b"\n".join(lines) + b"\n")
    txt = tmp_path / "bad.txt"
    txt.write_bytes(documents[2].encode() + b"\n\nfine line\nbroken \xff line\n\n" + documents[3].encode() + b"\n")
    out = tmp_path / "out"
    assert pretokenize(jsonl, txt, "--output", out, "--local", "--model", model_files["uni"], "-q") == 0

    errors = capsys.readouterr().err
    for where, reason in [
        (f"{jsonl.resolve()}:2:", "invalid JSON"),
        (f"{jsonl.resolve()}:3:", "no field 'text'"),
        (f"{jsonl.resolve()}:4:", "field 'text' is a number, not a string"),
        (f"{jsonl.resolve()}:5:", "an array, not a JSON object"),
        (f"{jsonl.resolve()}:8:", "undecodable bytes"),
        (f"{txt.resolve()}:4:", "undecodable bytes"),
    ]:
        assert any(line.startswith(where) and reason in line for line in errors.splitlines()), (where, errors)
    dataset = TokenDataset(out)
    meta = dataset.metadata
    assert meta["bad_records"] == 6
    assert [source["bad_records"] for source in meta["sources"]] == [5, 1]
    sp = spm.SentencePieceProcessor(model_file=str(model_files["uni"]))
    good = [documents[0], documents[1], documents[2], documents[3]]
    assert [dataset[i].tolist() for i in range(len(dataset))] == sp.encode(good, add_eos=True)


@pytest.mark.slow  # a run of the pre-tokenizer each; .ci/run's slow stage
def test_strict_stops_at_the_first_bad_record(
    documents: list[str], model_files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    jsonl = tmp_path / "bad.jsonl"
    jsonl.write_text(json.dumps({"text": documents[0]}) + "\n" + json.dumps({"txt": "x"}) + "\n")
    code = pretokenize(jsonl, "--output", tmp_path / "out", "--local", "--model", model_files["uni"], "--strict")
    assert code == 1
    assert f"{jsonl.resolve()}:2: no field 'text'" in capsys.readouterr().err
    assert not json.loads((tmp_path / "out" / "metadata.json").read_text())["complete"]


@pytest.mark.slow  # a run of the pre-tokenizer each; .ci/run's slow stage
def test_a_wrong_text_field_stops_with_the_fix_and_leaves_no_output(
    documents: list[str], model_files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    jsonl = tmp_path / "in.jsonl"
    jsonl.write_text("".join(json.dumps({"content": documents[i]}) + "\n" for i in range(30)))
    out = tmp_path / "out"
    assert pretokenize(jsonl, "--output", out, "--local", "--model", model_files["uni"], "-q") == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("tokenizer-pretokenize: all 30 records are bad") and "is --text-field 'text' the" in last
    assert "(its fields: 'content'; choose one with --text-field)" in last
    assert not out.exists()
    code = pretokenize(
        jsonl, "--output", out, "--local", "--model", model_files["uni"], "-q", "--text-field", "content"
    )
    assert code == 0
    assert len(TokenDataset(out)) == 30


@pytest.mark.slow  # runs killed and resumed, every input kind; .ci/run's slow stage
def test_bad_records_first_and_a_rank_of_only_bad_records_still_finish(
    documents: list[str], model_files: dict[str, Path], tmp_path: Path
) -> None:
    """Only a whole corpus with no good record fails: 1,200 bad records before good ones are skipped,
    and a rank whose block holds only bad records writes an empty output for the merge."""
    bad = tmp_path / "a-bad.jsonl"
    bad.write_text("".join(json.dumps({"content": "x"}) + "\n" for _ in range(1200)))
    good = tmp_path / "b-good.jsonl"
    good.write_text("".join(json.dumps({"text": text}) + "\n" for text in documents[:20]))
    common = ["--local", "--model", model_files["uni"], "-q"]
    assert pretokenize(bad, good, "--output", tmp_path / "whole", *common) == 0
    assert len(TokenDataset(tmp_path / "whole")) == 20
    ranked = tmp_path / "ranked"
    for rank in (0, 1):
        assert pretokenize(bad, good, "--output", ranked, *common, "--rank", rank, "--world-size", 2) == 0
    assert merge(ranked)["documents"] == 20


def test_ranks_never_mix_with_a_single_run_nor_with_another_world_size(
    documents: list[str], model_files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A probe found a finished run replaced by ranks written beside it and merged over it, and a rank of another
    world size refused only at the merge, after every rank's work: both are refused at once, in one line."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": text}) + "\n" for text in documents[:12]))
    common = ["--local", "--model", model_files["uni"], "-q"]
    single = tmp_path / "single"
    assert pretokenize(corpus, "--output", single, *common) == 0
    before = files_of(single)
    capsys.readouterr()
    assert pretokenize(corpus, "--output", single, *common, "--rank", 0, "--world-size", 1) == 2
    assert "output of a run without ranks" in capsys.readouterr().err
    assert not (single / "rank-00000").exists() and files_of(single) == before
    with pytest.raises(RankError, match="run without ranks"):
        merge(single)
    assert files_of(single) == before

    ranked = tmp_path / "ranked"
    assert pretokenize(corpus, "--output", ranked, *common, "--rank", 0, "--world-size", 2) == 0
    capsys.readouterr()
    assert pretokenize(corpus, "--output", ranked, *common, "--rank", 1, "--world-size", 3) == 2
    assert "is a rank of 2 ranks; this run is a rank of 3" in capsys.readouterr().err
    assert pretokenize(corpus, "--output", ranked, *common, "--rank", 1, "--world-size", 2) == 0
    assert merge(ranked)["documents"] == 12
    assert pretokenize(corpus, "--output", ranked, *common, "--rank", 2, "--world-size", 3) == 2
    assert "holds a merge of 2 ranks" in capsys.readouterr().err
    assert pretokenize(corpus, "--output", ranked, *common, "--rank", 1, "--world-size", 2) == 0  # already complete


@pytest.fixture(scope="module")
def big_input(documents: list[str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """About 5 MB of documents with bad records early and late: long enough to be killed half way."""
    path = tmp_path_factory.mktemp("big") / "big.jsonl"
    with path.open("w", encoding="utf-8") as file:
        for copy in range(18):
            for number, text in enumerate(documents):
                file.write(json.dumps({"text": f"{copy}.{number} {text}"}) + "\n")
                if number in (3, 1500):
                    file.write('{"text": null}\n')
    return path


def wait_for_first_shard(out: Path, process: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if json.loads((out / "metadata.json").read_text())["shards"]:
                return
        except (FileNotFoundError, ValueError):
            pass
        if process.poll() is not None:
            raise AssertionError(f"the run ended ({process.returncode}) before a shard was written")
        time.sleep(0.002)
    raise AssertionError("no shard within the timeout")


def interrupt_after_first_shard(args: list[str], out: Path, stop: signal.Signals) -> tuple[int, str]:
    """Run the pre-tokenizer and send `stop` once its first shard is written: (exit status, stderr).

    A session of its own: the signal reaches the workers too, as kill -9 of a job or Ctrl-C would. The
    run starts with SIGINT handled, as from a terminal, even where these tests run with it ignored (a
    job a script starts in the background inherits SIGINT ignored, and so would the run: Python then
    never raises KeyboardInterrupt). A handler here becomes the default in the child at exec.
    """
    command = [sys.executable, "-m", "tokenizer_service.tools.pretokenize", *args]
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        process = subprocess.Popen(command, cwd=ROOT, stderr=subprocess.PIPE, start_new_session=True)
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        wait_for_first_shard(out, process)
        os.killpg(process.pid, stop)
        _, errors = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    return process.returncode, errors.decode()


@pytest.mark.parametrize(
    ("stop", "packing"),
    [
        (signal.SIGKILL, []),
        (signal.SIGKILL, ["--seq-len", "100", "--strategy", "concat"]),
        (signal.SIGINT, ["--seq-len", "100", "--strategy", "best_fit"]),
        (signal.SIGTERM, ["--seq-len", "100", "--strategy", "concat"]),
    ],
    ids=["kill-9-ragged", "kill-9-concat", "ctrl-c-best-fit", "sigterm-concat"],
)
@pytest.mark.slow  # runs killed and resumed, every input kind; .ci/run's slow stage
def test_an_interrupted_run_resumes_to_byte_identical_files(
    stop: signal.Signals, packing: list[str], big_input: Path, tmp_path: Path
) -> None:
    model = BUNDLED_MODELS_DIR / "default.model"
    args = [str(big_input), "--local", "--model", str(model), "--shard-tokens", "20000", "--workers", "1", *packing]
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    assert pretokenize(*args, "--output", reference, "-q") == 0

    returncode, errors = interrupt_after_first_shard([*args, "--output", str(resumed), "-q"], resumed, stop)
    # SIGTERM, as a scheduler ends a job (to every process of it): the workers die of it, the run stops as on Ctrl-C
    assert returncode == {signal.SIGINT: 130, signal.SIGTERM: 143}.get(stop, -signal.SIGKILL), errors
    if stop != signal.SIGKILL:
        assert "Traceback" not in errors and "the complete shards in" in errors, errors
    interrupted = json.loads((resumed / "metadata.json").read_text())
    assert not interrupted["complete"], "the run finished before it could be interrupted"
    done = len(interrupted["shards"])
    assert done >= 1

    assert pretokenize(*args, "--output", resumed, "-q") == 0
    assert files_of(resumed) == files_of(reference)  # metadata.json too: bad records counted once
    assert json.loads((resumed / "metadata.json").read_text())["bad_records"] == 36
    assert len(TokenDataset(resumed).metadata["shards"]) > done


@pytest.fixture
def finished(corpus: tuple[list[Path], list[str]], model_files: dict[str, Path], tmp_path: Path) -> list[object]:
    """The arguments of a run over the first input into tmp_path / "out" that has finished."""
    args = [corpus[0][0], "--output", tmp_path / "out", "--local", "--model", model_files["uni"]]
    args += ["--shard-tokens", SHARD_TOKENS]
    assert pretokenize(*args) == 0
    return args


@pytest.mark.slow  # a run of the pre-tokenizer each; .ci/run's slow stage
def test_a_finished_output_is_left_alone(
    finished: list[object], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    before = {path.name: path.stat().st_mtime_ns for path in out.iterdir()}
    capsys.readouterr()
    assert pretokenize(*finished) == 0
    assert "already complete, nothing to do" in capsys.readouterr().out
    assert {path.name: path.stat().st_mtime_ns for path in out.iterdir()} == before


@pytest.mark.parametrize(
    ("change", "complaint"),
    [
        (["--model", "bpe"], "model sha256"),
        (["--seq-len", "128"], "option seq_len"),
        (["--add-bos"], "option add_bos"),
        (["--shard-tokens", "5000"], "option shard_tokens"),
        (["--extra-input"], "inputs"),
    ],
)
@pytest.mark.slow  # a run of the pre-tokenizer each; .ci/run's slow stage
def test_another_model_or_other_options_refuse_to_mix(
    change: list[str],
    complaint: str,
    finished: list[object],
    corpus: tuple[list[Path], list[str]],
    model_files: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "out"
    before = files_of(out)
    if change == ["--extra-input"]:
        args = [finished[0], corpus[0][1], *finished[1:]]
    else:  # the last of an option given twice counts
        args = [*finished, *(model_files["bpe"] if word == "bpe" else word for word in change)]
    capsys.readouterr()
    assert pretokenize(*args) == 2
    errors = capsys.readouterr().err
    assert "refusing to mix" in errors and complaint in errors
    assert files_of(out) == before


def test_refuses_foreign_directories_and_unknown_inputs(
    corpus: tuple[list[Path], list[str]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    inputs, _ = corpus
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.md").write_text("mine")
    assert pretokenize(inputs[0], "--output", foreign, "--local") == 2
    assert "not a tokenizer-pretokenize output" in capsys.readouterr().err
    unknown = tmp_path / "data.csv"
    unknown.write_text("text\nhello\n")
    assert pretokenize(unknown, "--output", tmp_path / "out", "--local") == 2
    assert "unknown input kind" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        pretokenize(inputs[0], "--output", tmp_path / "out")  # neither --url nor --local


def test_an_output_inside_an_input_directory_is_never_read_as_input(
    documents: list[str], model_files: dict[str, Path], tmp_path: Path
) -> None:
    """A probe's output inside its input directory could never be run again: its own metadata.json was taken for
    an input, and the rerun refused to mix. Another dataset in that directory is left out too."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in documents[:9]))
    common = ["--local", "--model", model_files["uni"], "-q"]
    assert pretokenize(corpus, "--output", corpus / "shards", *common) == 0
    before = files_of(corpus / "shards")
    assert pretokenize(corpus, "--output", corpus / "shards", *common) == 0  # already complete
    assert files_of(corpus / "shards") == before
    assert pretokenize(corpus, "--output", tmp_path / "elsewhere", *common) == 0
    assert len(TokenDataset(tmp_path / "elsewhere")) == 9  # the dataset under corpus/ is no input
    assert TokenDataset(tmp_path / "elsewhere").metadata["bad_records"] == 0


def test_a_second_run_on_an_output_another_run_is_writing_is_one_line(
    documents: list[str], model_files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A probe's two runs on one --output at once: the second removed the first's temporary files and failed as if
    the disk were full. A run holds its output (flock on the directory) while it writes it."""
    from tokenizer_service.tools.pretokenize.store import OutputDir

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": text}) + "\n" for text in documents[:9]))
    out = tmp_path / "out"
    writing = OutputDir(out)
    writing.prepare(0)  # what a run does before it writes: the directory, held
    (out / "00000.bin.tmp").write_bytes(b"half a shard")
    common = ["--local", "--model", model_files["uni"], "-q"]
    assert pretokenize(corpus, "--output", out, *common) == 2
    assert "another tokenizer-pretokenize run is writing" in capsys.readouterr().err
    assert (out / "00000.bin.tmp").read_bytes() == b"half a shard"  # the other run's file is left alone
    writing.close()
    assert pretokenize(corpus, "--output", out, *common) == 0
    assert len(TokenDataset(out)) == 9


def test_a_corpus_of_empty_files_is_exit_1_and_leaves_no_output(
    model_files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A probe's empty .jsonl (and zero-row Parquet) made a "complete" dataset of no document, exit 0."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    out = tmp_path / "out"
    assert pretokenize(empty, "--output", out, "--local", "--model", model_files["uni"], "-q") == 1
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "hold no record" in error[0]
    assert not out.exists()


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["", "--output", "{out}"], "an INPUT is an empty path"),
        (["{input}", "--output", ""], "--output is an empty path"),
        (["{input}", "--output", "{out}", "--seq-len", "99999999999999"], "--seq-len must be between 2 and"),
        (["{input}", "--output", "{out}", "--seq-len", "2000000000", "--strategy", "best_fit"], "--seq-len must be"),
        (["{input}", "--output", "{out}", "--workers", "100000"], "--workers 100,000 is more than"),
        (["{input}", "--output", "{out}", "--staging", "/nonexistent"], "--staging is where shards wait"),
    ],
    ids=["empty-input", "empty-output", "seq-len", "seq-len-best-fit", "workers", "staging-for-a-local-output"],
)
def test_options_no_run_can_honour_are_one_line_before_anything_starts(
    corpus: tuple[list[Path], list[str]], tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], says: str
) -> None:
    """A probe's empty INPUT tokenized everything under the current directory; --seq-len 10^14 stored no token of
    the corpus and said nothing; --workers 100000 forked processes until it was killed."""
    inputs, _ = corpus
    filled = [arg.format(input=inputs[0], out=tmp_path / "out") for arg in args]
    with pytest.raises(SystemExit) as stopped:
        pretokenize(*filled, "--local", "-q")
    assert stopped.value.code == 2
    assert says in capsys.readouterr().err.strip().splitlines()[-1]
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # a run of the pre-tokenizer each; .ci/run's slow stage
def test_model_names_resolve_as_the_server_resolves_them(
    corpus: tuple[list[Path], list[str]],
    model_files: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    inputs, _ = corpus
    assert pretokenize(inputs[0], "--output", tmp_path / "bundled", "--local", "-q") == 0
    bundled = TokenDataset(tmp_path / "bundled").model
    assert bundled["name"] == "default"
    assert bundled["sha256"] == hashlib.sha256((BUNDLED_MODELS_DIR / "default.model").read_bytes()).hexdigest()
    monkeypatch.setenv("TOKENIZER_MODEL", f"mine={model_files['bpe']}")
    assert pretokenize(inputs[0], "--output", tmp_path / "named", "--local", "--model", "mine", "-q") == 0
    assert TokenDataset(tmp_path / "named").model["vocab_size"] == 2000
    assert pretokenize(inputs[0], "--output", tmp_path / "x", "--local", "--model", "nope", "-q") == 1


def test_reader_resumes_mid_file_from_a_position(corpus: tuple[list[Path], list[str]]) -> None:
    inputs, texts = corpus
    everything = list(DocumentReader([Source.from_path(path) for path in inputs], "text", pytest.fail))
    assert [text for text, _ in everything] == texts
    for stop in (10, 299, 300, 420, 520, 650):  # plain and gzipped, .jsonl and .txt, at a file's end too
        position = everything[stop][1]
        sources = [Source.from_path(path) for path in inputs]
        for source in sources[: position.source]:
            source.done = True
        resumed = sources[position.source]
        resumed.read_bytes, resumed.lines = position.read_bytes, position.lines
        resumed.documents, resumed.bad_records = position.documents, position.bad_records
        rest = list(DocumentReader(sources, "text", pytest.fail))
        assert rest == everything[stop + 1 :]


def _limit_file_size() -> None:
    """In the child: files may not grow past 256 KiB, and exceeding that is EFBIG, not a SIGXFSZ death."""
    import resource

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, 256 * 1024))


@pytest.mark.slow  # runs killed and resumed, every input kind; .ci/run's slow stage
def test_a_write_that_fails_is_one_line_and_the_rerun_resumes_byte_identical(big_input: Path, tmp_path: Path) -> None:
    """EFBIG (a file-size limit) stands in for a full disk: both are an OSError on write."""
    model = BUNDLED_MODELS_DIR / "default.model"
    args = [str(big_input), "--local", "--model", str(model), "--shard-tokens", "200000", "--workers", "1", "-q"]
    reference, limited = tmp_path / "reference", tmp_path / "limited"
    assert pretokenize(*args, "--output", reference) == 0
    command = [sys.executable, "-m", "tokenizer_service.tools.pretokenize", *args, "--output", str(limited)]
    failed = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120, preexec_fn=_limit_file_size)
    assert failed.returncode == 1, failed.stderr
    *bad_records, last = failed.stderr.strip().splitlines()
    assert "Traceback" not in failed.stderr and all(
        "big.jsonl:" in line or line.startswith("(further bad records") for line in bad_records
    ), failed.stderr
    assert last.startswith("tokenizer-pretokenize: cannot write ") and "File too large" in last, last
    assert "MiB free" in last and "run the same command again" in last
    assert pretokenize(*args, "--output", limited) == 0
    assert files_of(limited) == files_of(reference)


@pytest.mark.slow  # a run of the pre-tokenizer each; .ci/run's slow stage
def test_add_eos_follows_the_model_unless_told(
    tmp_path: Path, documents: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    directory = tmp_path / "bare"
    directory.mkdir()
    spm.SentencePieceTrainer.train(
        input=str(DATA / "botchan.txt"), model_prefix=str(directory / "bare"), vocab_size=1000,
        bos_id=-1, eos_id=-1, minloglevel=2, num_threads=2,
    )  # fmt: skip
    source = write_jsonl(tmp_path / "in.jsonl", documents[:50])
    model = directory / "bare.model"
    assert pretokenize(source, "--local", "--model", model, "--output", tmp_path / "out", "-q") == 0
    sp = spm.SentencePieceProcessor(model_file=str(model))
    dataset = TokenDataset(tmp_path / "out")
    assert [dataset[i].tolist() for i in range(len(dataset))] == sp.encode(documents[:50])  # no EOS
    capsys.readouterr()
    assert pretokenize(source, "--local", "--model", model, "--add-eos", "--output", tmp_path / "eos", "-q") == 1
    error = capsys.readouterr().err
    assert "has no EOS piece" in error and "Traceback" not in error


@pytest.mark.slow  # a run of the pre-tokenizer each; .ci/run's slow stage
def test_a_corrupt_gzip_input_reaches_no_shard(documents: list[str], tmp_path: Path) -> None:
    """A flipped bit in a .gz: refused before any of its documents are tokenized, with one line."""
    good = write_jsonl(tmp_path / "good.jsonl", documents[:200])
    bad = write_jsonl(tmp_path / "bad.jsonl.gz", documents * 8, gzip.open)  # long: read over many shards
    data = bytearray(bad.read_bytes())
    data[len(data) * 3 // 4] ^= 0x10  # deep in the deflate stream: most of the file still decompresses
    bad.write_bytes(bytes(data))
    model = BUNDLED_MODELS_DIR / "default.model"
    out = tmp_path / "out"
    args = [good, bad, "--local", "--model", model, "--shard-tokens", "1000", "--workers", "1", "-q"]
    assert pretokenize(*args, "--output", out) == 1
    metadata = json.loads((out / "metadata.json").read_text())
    assert not metadata["complete"]
    assert metadata["documents"] <= 200  # only the good file's documents, never the bad one's
    sp = spm.SentencePieceProcessor(model_file=str(model))
    dataset = TokenDataset(out, allow_partial=True)
    assert [dataset[i].tolist() for i in range(len(dataset))] == sp.encode(documents[:200], add_eos=True)[
        : len(dataset)
    ]


# -- corpora as published: zstandard, .json, Parquet, directories --------------------------------------------


def zstd_open(path: Path, mode: str, encoding: str):  # type: ignore[no-untyped-def]
    """Like gzip.open for writing text: a zstandard stream with checksums, as the zstd tool writes."""
    import io

    import zstandard

    raw = open(path, "wb")  # noqa: SIM115 - closed with the text wrapper
    writer = zstandard.ZstdCompressor(write_checksum=True).stream_writer(raw, closefd=True)
    return io.TextIOWrapper(writer, encoding=encoding)


def write_parquet(path: Path, texts: list[str | None], row_group_size: int = 64) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"id": list(range(len(texts))), "text": texts, "url": ["https://example.org"] * len(texts)})
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def documents_of(output: Path) -> list[list[int]]:
    dataset = TokenDataset(output)
    return [dataset[i].tolist() for i in range(len(dataset))]


@pytest.mark.slow  # runs killed and resumed, every input kind; .ci/run's slow stage
def test_every_input_kind_gives_the_documents_of_the_jsonl_run(documents: list[str], tmp_path: Path) -> None:
    texts = documents[:500]
    model = BUNDLED_MODELS_DIR / "default.model"
    common = ["--local", "--model", model, "--workers", "1", "--shard-tokens", SHARD_TOKENS, "-q"]
    expected = spm.SentencePieceProcessor(model_file=str(model)).encode(texts, add_eos=True)
    inputs = {
        "jsonl": write_jsonl(tmp_path / "a.jsonl", texts),
        "jsonl.zst": write_jsonl(tmp_path / "a.jsonl.zst", texts, zstd_open),
        "json": write_jsonl(tmp_path / "a.json", texts),
        "json.gz": write_jsonl(tmp_path / "a.json.gz", texts, gzip.open),
        "json.zst": write_jsonl(tmp_path / "a.json.zst", texts, zstd_open),
        "parquet": write_parquet(tmp_path / "a.parquet", list(texts)),
    }
    for kind, path in inputs.items():
        out = tmp_path / f"out-{kind}"
        assert pretokenize(path, *common, "--output", out) == 0, kind
        assert documents_of(out) == expected, kind
    # .txt.zst reads as .txt does.
    plain, packed = (
        write_txt(tmp_path / "b.txt", texts[:100]),
        write_txt(tmp_path / "b.txt.zst", texts[:100], zstd_open),
    )
    assert pretokenize(plain, *common, "--output", tmp_path / "txt") == 0
    assert pretokenize(packed, *common, "--output", tmp_path / "txt-zst") == 0
    assert documents_of(tmp_path / "txt-zst") == documents_of(tmp_path / "txt")
    # A directory: every input file below it, sorted by path; other files ignored.
    tree = tmp_path / "tree"
    (tree / "b").mkdir(parents=True)
    write_parquet(tree / "b" / "2.parquet", list(texts[200:]))
    write_jsonl(tree / "a.jsonl.zst", texts[:200], zstd_open)
    (tree / "README.md").write_text("not an input")
    (tree / "b" / "_SUCCESS").write_text("")
    assert pretokenize(tree, *common, "--output", tmp_path / "tree-out") == 0
    assert documents_of(tmp_path / "tree-out") == expected


@pytest.mark.slow  # a run of the pre-tokenizer each; .ci/run's slow stage
def test_parquet_bad_rows_are_reported_by_row_and_a_missing_column_is_one_line(
    documents: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows: list[str | None] = list(documents[:100])
    rows[6] = None
    path = write_parquet(tmp_path / "rows.parquet", rows, row_group_size=16)
    model = BUNDLED_MODELS_DIR / "default.model"
    common = ["--local", "--model", model, "--workers", "1", "-q"]
    assert pretokenize(path, *common, "--output", tmp_path / "out") == 0
    assert f"{path.resolve()}:7: column 'text' is null, not a string" in capsys.readouterr().err
    assert json.loads((tmp_path / "out" / "metadata.json").read_text())["bad_records"] == 1
    assert pretokenize(path, *common, "--text-field", "body", "--output", tmp_path / "other") == 1
    error = capsys.readouterr().err
    assert "no column 'body' (columns: id, text, url)" in error and "Traceback" not in error


@pytest.mark.slow  # runs killed and resumed, every input kind; .ci/run's slow stage
@pytest.mark.parametrize("kind", ["jsonl.zst", "parquet"])
def test_an_interrupted_run_over_zstd_or_parquet_resumes_byte_identical(
    kind: str, documents: list[str], tmp_path: Path
) -> None:
    texts = [f"{copy}.{number} {text}" for copy in range(7) for number, text in enumerate(documents)]
    if kind == "parquet":
        source = write_parquet(tmp_path / "big.parquet", list(texts), row_group_size=1000)
    else:
        source = write_jsonl(tmp_path / "big.jsonl.zst", texts, zstd_open)
    model = BUNDLED_MODELS_DIR / "default.model"
    args = [str(source), "--local", "--model", str(model), "--shard-tokens", "20000", "--workers", "1"]
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    assert pretokenize(*args, "--output", reference, "-q") == 0
    interrupt_after_first_shard([*args, "--output", str(resumed), "-q"], resumed, signal.SIGKILL)
    assert not json.loads((resumed / "metadata.json").read_text())["complete"]
    assert pretokenize(*args, "--output", resumed, "-q") == 0
    assert files_of(resumed) == files_of(reference)


@pytest.mark.parametrize(
    ("variable", "value", "give"),
    [
        ("TOKENIZER_SHADOW_RATE", "abc", "a number from 0 to 1"),
        ("TOKENIZER_SHADOW_RATE", "2", "a number from 0 to 1"),
        ("TOKENIZER_SHADOW_INTERVAL_SECONDS", "nan", "a number at least 0"),
        ("TOKENIZER_SHADOW_INTERVAL_SECONDS", "inf", "a number at least 0"),
        ("TOKENIZER_VERIFIER_MIN_BYTES", "1.5", "a whole number of bytes at least 0"),
        ("TOKENIZER_GATE_SCAN_MIN_BYTES", "-3", "a whole number of bytes at least 0"),
    ],
)
def test_a_bad_number_in_the_environment_is_one_line_before_anything_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, variable, value, give
) -> None:
    jsonl = tmp_path / "in.jsonl"
    jsonl.write_text('{"text": "hello"}\n')
    monkeypatch.setenv(variable, value)
    assert pretokenize(jsonl, "--output", tmp_path / "out", "--local", "-q") == 2
    err = capsys.readouterr().err.strip().splitlines()
    line = f"tokenizer-pretokenize: {variable}={value!r}: give {give}, or unset it ("
    assert len(err) == 1 and err[0].startswith(line)
    assert not (tmp_path / "out").exists()


def test_a_run_imports_no_pydantic_nor_tqdm(tmp_path: Path) -> None:
    """What the run imports as it goes, not only at start (tests/test_layers.py holds the start): a quiet run of
    the bundled model given by its path (a model's name is resolved by the server's settings, with pydantic), in a
    process of its own."""
    jsonl = tmp_path / "in.jsonl"
    jsonl.write_text("".join(json.dumps({"text": f"document {i}: some words"}) + "\n" for i in range(50)))
    script = (
        "import sys\n"
        "from tokenizer_service.tools.pretokenize import main\n"
        "if __name__ == '__main__':\n"
        f"    args = [{str(jsonl)!r}, '--local', '--model', {str(BUNDLED_MODELS_DIR / 'default.model')!r}]\n"
        f"    assert main([*args, '--output', {str(tmp_path / 'out')!r}, '-q']) == 0\n"
        "    print(sorted(m for m in ('pydantic', 'pydantic_settings', 'tqdm', 'fastapi') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.slow  # a run killed half way and resumed; .ci/run's slow stage
def test_a_worker_killed_is_one_line_and_the_run_resumes(big_input: Path, tmp_path: Path) -> None:
    """SIGKILL to one worker, as the kernel's OOM killer sends it: one line (no traceback), exit 1, the complete shards
    kept, and the same command goes on to the same files as a run never interrupted."""
    model = BUNDLED_MODELS_DIR / "default.model"
    args = [str(big_input), "--local", "--model", str(model), "--shard-tokens", "20000", "--workers", "2"]
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    assert pretokenize(*args, "--output", reference, "-q") == 0
    command = [sys.executable, "-m", "tokenizer_service.tools.pretokenize", *args, "--output", str(resumed), "-q"]
    process = subprocess.Popen(command, cwd=ROOT, stderr=subprocess.PIPE, start_new_session=True)
    try:
        wait_for_first_shard(resumed, process)
        workers = [int(task) for task in Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text().split()]
        assert workers, "no worker process to kill"
        os.kill(workers[-1], signal.SIGKILL)
        _, errors = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    said = errors.decode()
    if process.returncode == 0:
        pytest.skip("the run finished before the worker was killed")
    last = said.strip().splitlines()[-1]  # after the input's bad records
    assert process.returncode == 1 and "Traceback" not in said, said
    assert "a worker process died" in last and "run the same command again" in last, last
    assert pretokenize(*args, "--output", resumed, "-q") == 0
    assert files_of(resumed) == files_of(reference)
