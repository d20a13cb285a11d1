"""Corpora where they live: inputs and outputs at URLs (issue 34).

`file://` URLs go through the same fsspec code path as `s3://` in the fast suite. The rest runs against a real S3 API
server on 127.0.0.1 that these tests start themselves (moto's standalone server, `moto[server]`, in a process of its
own, with IAM authentication on: a wrong key is refused as S3 refuses it), never a mock of the client library; the
runs find it through `AWS_ENDPOINT_URL`, as they would MinIO, R2 or Ceph.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import ROOT
from tokenizer_client import storage
from tokenizer_client.dataset import TokenDataset
from tokenizer_service.settings import BUNDLED_MODELS_DIR
from tokenizer_service.tools.launcher import free_port, wait_listening
from tokenizer_service.tools.pretokenize import main
from tokenizer_service.tools.pretokenize.remote import MAX_PARTS, part_size

MODEL = str(BUNDLED_MODELS_DIR / "default.model")


def pretokenize(*args: object) -> int:
    return main([str(arg) for arg in args])


def files_of(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


def shard_files(directory: Path) -> dict[str, bytes]:
    return {name: data for name, data in files_of(directory).items() if name != "metadata.json"}


def documents_of(dataset: TokenDataset) -> list[list[int]]:
    return [dataset[index].tolist() for index in range(len(dataset))]


def write_corpus(directory: Path, texts: list[str]) -> list[Path]:
    """The three kinds corpora are published in: Parquet (small row groups), .jsonl.zst and .json.gz."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    directory.mkdir(parents=True, exist_ok=True)
    thirds = [texts[: len(texts) // 3], texts[len(texts) // 3 : 2 * len(texts) // 3], texts[2 * len(texts) // 3 :]]
    parquet = directory / "a.parquet"
    pq.write_table(pa.table({"id": list(range(len(thirds[0]))), "text": thirds[0]}), parquet, row_group_size=40)
    lines = [b"".join(json.dumps({"text": text}).encode() + b"\n" for text in part) for part in thirds[1:]]
    zst = directory / "b.jsonl.zst"
    zst.write_bytes(zstandard.ZstdCompressor(write_checksum=True).compress(lines[0]))
    gz = directory / "c.json.gz"
    gz.write_bytes(gzip.compress(lines[1]))
    (directory / "README.md").write_text("not an input: ignored under a prefix, as in a directory\n")
    return [parquet, zst, gz]


# ---------------------------------------------------------------------------------------------------------------------
# file:// URLs: the fsspec path, in the fast suite


def test_file_urls_in_and_out_equal_a_local_run(documents: list[str], tmp_path: Path) -> None:
    write_corpus(tmp_path / "corpus", documents[:240])
    args = ["--local", "--model", MODEL, "--workers", "1", "--shard-tokens", "2000", "-q"]
    assert pretokenize(tmp_path / "corpus", "--output", tmp_path / "local", *args) == 0
    url = f"file://{tmp_path}/corpus/"
    assert pretokenize(url, "--output", f"file://{tmp_path}/remote", "--staging", tmp_path / "staging", *args) == 0
    local, remote = TokenDataset(tmp_path / "local"), TokenDataset(tmp_path / "remote")
    assert len(local) == 240 and documents_of(local) == documents_of(remote)
    assert shard_files(tmp_path / "local") == shard_files(tmp_path / "remote")
    metadata = json.loads((tmp_path / "remote" / "metadata.json").read_text())
    assert [source["path"] for source in metadata["sources"]] == [
        f"file://{tmp_path}/corpus/{name}" for name in ("a.parquet", "b.jsonl.zst", "c.json.gz")
    ]
    assert not (tmp_path / "staging").exists() or not any((tmp_path / "staging").iterdir())  # removed when done
    # a glob, and the finished output: nothing to do
    assert pretokenize(f"file://{tmp_path}/corpus/*.json.gz", "--output", tmp_path / "glob", *args) == 0
    assert len(TokenDataset(tmp_path / "glob")) == 80


def test_url_refusals_are_one_line_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.md").write_text("nothing to read\n")
    args = ["--local", "--model", MODEL, "--output", tmp_path / "out", "-q"]
    cases = {
        f"file://{tmp_path}/empty/": "a prefix with no input file under it",
        f"file://{tmp_path}/nothing-here/": "no such file or directory",
        f"file://{tmp_path}/empty/*.parquet": "matches no input file",
        "nosuchprotocol://bucket/x.jsonl": "no fsspec filesystem knows nosuchprotocol://",
    }
    for url, said in cases.items():
        assert pretokenize(url, *args) == 2, url
        errors = capsys.readouterr().err.strip().splitlines()
        assert len(errors) == 1 and said in errors[0], (url, errors)
    assert not (tmp_path / "out").exists()


def test_a_missing_filesystem_package_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import fsspec.registry

    def missing(protocol: str) -> None:
        raise ImportError(f"Install {storage.PACKAGES.get(protocol, protocol)} to access {protocol}")

    monkeypatch.setattr(fsspec.core, "url_to_fs", lambda url, **options: missing(storage.protocol_of(url)))
    for url, extra in (("s3://bucket/corpus/", "s3"), ("gs://bucket/corpus/", "gcs")):
        with pytest.raises(storage.StorageError, match=rf"pip install 'tokenizer-service\[{extra}\]'"):
            storage.filesystem(url)
    assert fsspec.registry is not None


def test_storage_options_are_passed_through_and_never_shown(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = "s3cr3t-never-printed"
    monkeypatch.setenv(storage.ENVIRONMENT, json.dumps({"file": {"auto_mkdir": True}}))
    assert storage.options_for("file") == {"auto_mkdir": True}
    storage.configure({"s3": {"key": "k", "secret": secret}, "file": {}})
    try:
        assert storage.options_for("s3") == {"key": "k", "secret": secret}
        storage.configure('{"auto_mkdir": true}')  # one object for every protocol, as --storage-options gives it
        fs, _ = storage.filesystem(f"file://{tmp_path}/x.jsonl")
        assert fs.storage_options == {"auto_mkdir": True}  # reached the filesystem
    finally:
        storage.configure(None)
    with pytest.raises(SystemExit) as exited:  # argparse's usage error: exit 2
        pretokenize(f"file://{tmp_path}/x.jsonl", "--storage-options", '{"secret": "' + secret + '"', "--peek")
    errors = capsys.readouterr().err
    assert exited.value.code == 2 and "--storage-options is not JSON" in errors and secret not in errors


def test_part_size_keeps_multipart_uploads_within_10000_parts() -> None:
    assert part_size(0) == part_size(16 << 20) == 50 << 20  # s3fs's default
    for size in (1 << 30, 500 << 30, (500 << 30) + 1, 5 << 40):
        assert -(-size // part_size(size)) <= MAX_PARTS
    assert part_size(5 << 40) <= 5 << 30  # S3's largest part


# ---------------------------------------------------------------------------------------------------------------------
# A real S3 API on 127.0.0.1


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """moto's S3 server in a process of its own, with IAM authentication from its fourth request on: the first three
    make a user with a key allowed everything. Yields the environment a client needs (AWS_ENDPOINT_URL and the key;
    no config file of this machine is read)."""
    pytest.importorskip("moto.server", reason="moto[server]: pip install -e '.[test]'")
    pytest.importorskip("s3fs", reason="s3fs: pip install -e '.[s3]'")
    import botocore.session

    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    log = tmp_path_factory.mktemp("moto") / "server.log"
    with log.open("wb") as output:
        process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            env={**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "3"},
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_listening(port, process, log)
        iam = botocore.session.get_session().create_client(
            "iam", region_name="us-east-1", endpoint_url=endpoint, aws_access_key_id="a", aws_secret_access_key="b"
        )
        iam.create_user(UserName="ci")
        policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}
        iam.put_user_policy(UserName="ci", PolicyName="all", PolicyDocument=json.dumps(policy))
        key = iam.create_access_key(UserName="ci")["AccessKey"]
        yield {
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_ACCESS_KEY_ID": key["AccessKeyId"],
            "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"],
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        }
    finally:
        process.terminate()
        process.wait(timeout=30)


@pytest.fixture
def s3(s3_server: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    """An s3fs filesystem on the server, with this process's environment pointing at it."""
    import s3fs

    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", storage.ENVIRONMENT):
        monkeypatch.delenv(name, raising=False)
    for name, value in s3_server.items():
        monkeypatch.setenv(name, value)
    s3fs.S3FileSystem.clear_instance_cache()
    yield s3fs.S3FileSystem()
    s3fs.S3FileSystem.clear_instance_cache()


_buckets = iter(range(1_000_000))


def new_bucket(fs: object) -> str:
    name = f"corpus-{os.getpid()}-{next(_buckets)}"
    fs.mkdir(name)  # type: ignore[attr-defined]
    return name


def upload(fs: object, local: Path, bucket: str, prefix: str) -> None:
    for path in sorted(local.iterdir()):
        fs.put_file(str(path), f"{bucket}/{prefix}/{path.name}")  # type: ignore[attr-defined]


def objects(fs: object, url: str) -> dict[str, bytes]:
    root = url.removeprefix("s3://").rstrip("/")
    fs.invalidate_cache()  # type: ignore[attr-defined]
    return {path[len(root) + 1 :]: fs.cat_file(path) for path in sorted(fs.find(root))}  # type: ignore[attr-defined]


def run_cli(args: list[str], env: dict[str, str] | None = None, **popen: object) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "tokenizer_service.tools.pretokenize", *map(str, args)]
    return subprocess.Popen(command, cwd=ROOT, env={**os.environ, **(env or {})}, stderr=subprocess.PIPE, **popen)  # type: ignore[call-overload]


@pytest.mark.slow  # a server of its own; runs uploading to it
def test_a_bucket_in_and_out_equals_local_files(s3: object, documents: list[str], tmp_path: Path) -> None:
    """Parquet, .jsonl.zst and .json.gz in a bucket, to a bucket and to a local directory: the same documents and
    byte-identical shard files as a run over the same files on disk."""
    files = write_corpus(tmp_path / "corpus", documents[:300])
    bucket = new_bucket(s3)
    upload(s3, tmp_path / "corpus", bucket, "corpus")
    args = ["--local", "--model", MODEL, "--workers", "1", "--shard-tokens", "2000", "-q"]
    assert pretokenize(*files, "--output", tmp_path / "reference", *args) == 0
    prefix = f"s3://{bucket}/corpus/"
    assert pretokenize(prefix, "--output", tmp_path / "local", *args) == 0
    assert pretokenize(prefix, "--output", f"s3://{bucket}/shards", *args) == 0
    reference = shard_files(tmp_path / "reference")
    assert len(reference) >= 6
    assert shard_files(tmp_path / "local") == reference
    uploaded = objects(s3, f"s3://{bucket}/shards")
    assert {name: data for name, data in uploaded.items() if name != "metadata.json"} == reference
    assert json.loads(uploaded["metadata.json"]) == json.loads((tmp_path / "local" / "metadata.json").read_bytes())
    sources = json.loads(uploaded["metadata.json"])["sources"]
    assert [source["path"] for source in sources] == [f"{prefix}{path.name}" for path in files]
    assert documents_of(TokenDataset(tmp_path / "local")) == documents_of(TokenDataset(tmp_path / "reference"))
    # the same command again: nothing to do, nothing uploaded
    assert pretokenize(prefix, "--output", f"s3://{bucket}/shards", *args) == 0
    assert objects(s3, f"s3://{bucket}/shards") == uploaded
    # tokenizer-shards export from the bucket to the bucket: the files of a local export
    from tokenizer_service.tools.pretokenize.shards_cli import main as shards

    prefix_local = f"{tmp_path}/megatron/web_text_document"
    assert shards(["export", str(tmp_path / "local"), "--to", "megatron", "--output", prefix_local, "-q"]) == 0
    export_url = f"s3://{bucket}/megatron/web_text_document"
    assert shards(["export", f"s3://{bucket}/shards", "--to", "megatron", "--output", export_url, "-q"]) == 0
    assert objects(s3, f"s3://{bucket}/megatron") == files_of(tmp_path / "megatron")


@pytest.mark.slow  # a server of its own
def test_an_export_to_a_url_never_writes_into_a_dataset_or_over_its_corpus(
    s3: object,
    documents: list[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A URL --output was never checked (a probe's): `--output s3://B/shards/00001.bin` overwrote the dataset's own
    shard, an export to the input's object overwrote the corpus, all exit 0. Now the rules of a path hold in the
    store, and refused credentials are one line before a shard is read."""
    from tokenizer_service.tools.pretokenize.shards_cli import main as shards

    files = write_corpus(tmp_path / "corpus", documents[:200])
    bucket = new_bucket(s3)
    upload(s3, tmp_path / "corpus", bucket, "corpus")
    args = ["--local", "--model", MODEL, "--workers", "1", "--shard-tokens", "2000", "-q"]
    dataset = f"s3://{bucket}/shards"
    assert pretokenize(f"s3://{bucket}/corpus/", "--output", dataset, *args) == 0
    assert pretokenize(*files, "--output", tmp_path / "local", *args) == 0
    before, corpus = objects(s3, dataset), objects(s3, f"s3://{bucket}/corpus")
    capsys.readouterr()
    cases = [
        (dataset, "nanogpt", f"{dataset}/00001.bin", "inside the dataset"),
        (dataset, "megatron", f"{dataset}/00000", "inside the dataset"),
        (dataset, "litdata", dataset, "inside the dataset"),
        (dataset, "llmc", f"{dataset}/llmc", "inside the dataset"),
        (str(tmp_path / "local"), "nanogpt", f"{dataset}/00002.bin", "lies inside the dataset"),
        (str(tmp_path / "local"), "megatron", f"{dataset}/sub/corpus", "lies inside the dataset"),
        (dataset, "nanogpt", f"s3://{bucket}/corpus/{files[0].name}", "would write over"),
        (dataset, "litdata", f"s3://{bucket}/corpus", "would write over"),
    ]
    for given, to, output, says in cases:
        assert shards(["export", given, "--to", to, "--output", output, "-q"]) == 2, (to, output)
        error = capsys.readouterr().err
        assert says in error and len(error.strip().splitlines()) == 1, error
    assert objects(s3, dataset) == before and objects(s3, f"s3://{bucket}/corpus") == corpus
    # refused credentials: one line, before the shards are read (no progress bar)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    assert shards(["export", str(tmp_path / "local"), "--to", "megatron", "--output", f"s3://{bucket}/out/m"]) == 1
    error = capsys.readouterr().err
    assert len(error.strip().splitlines()) == 1 and "checking shards" not in error, error


@pytest.mark.slow  # runs killed and resumed against a server
def test_a_run_killed_mid_upload_resumes_to_exactly_the_objects_of_an_uninterrupted_one(
    s3: object, s3_server: dict[str, str], documents: list[str], tmp_path: Path
) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    with (corpus / "big.jsonl").open("w") as file:
        for copy in range(6):
            for number, text in enumerate(documents):
                file.write(json.dumps({"text": f"{copy}.{number} {text}"}) + "\n")
    bucket = new_bucket(s3)
    upload(s3, corpus, bucket, "in")
    args = [f"s3://{bucket}/in/", "--local", "--model", MODEL, "--workers", "1", "--shard-tokens", "30000", "-q"]
    reference_url, resumed_url = f"s3://{bucket}/reference", f"s3://{bucket}/resumed"
    assert pretokenize(*args, "--output", reference_url) == 0
    reference = objects(s3, reference_url)

    process = run_cli([*args, "--output", resumed_url, "--staging", tmp_path / "staging"], start_new_session=True)
    killed_mid_upload = kill_between_upload_and_metadata(process, s3, resumed_url)
    assert killed_mid_upload, "the run ended before it could be killed between a shard's upload and its metadata"
    interrupted = json.loads(s3.cat_file(f"{bucket}/resumed/metadata.json"))  # type: ignore[attr-defined]
    assert not interrupted["complete"]

    rerun = run_cli([*args, "--output", resumed_url, "--staging", tmp_path / "staging"])
    _, errors = rerun.communicate(timeout=300)
    assert rerun.returncode == 0, errors.decode()
    assert objects(s3, resumed_url) == reference  # metadata.json too
    assert not any((tmp_path / "staging").iterdir())


def kill_between_upload_and_metadata(process: subprocess.Popen[bytes], fs: object, url: str) -> bool:
    """SIGKILL `process` (its session) once a shard's objects are uploaded under `url` and metadata.json does not
    name that shard yet; False if the run ended first."""
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and process.poll() is None:
            present = objects_names(fs, url)
            listed = listed_shards(fs, url)
            unlisted = {name for name in present if name[:5].isdigit() and int(name[:5]) >= listed}
            if listed >= 1 and unlisted:  # a shard's objects uploaded, metadata.json not yet naming it
                os.killpg(process.pid, signal.SIGKILL)
                return True
            time.sleep(0.005)
        return False
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def objects_names(fs: object, url: str) -> list[str]:
    root = url.removeprefix("s3://").rstrip("/")
    try:
        return [path.rsplit("/", 1)[-1] for path in fs.ls(root, detail=False, refresh=True)]  # type: ignore[attr-defined]
    except FileNotFoundError:
        return []


def listed_shards(fs: object, url: str) -> int:
    try:
        text = fs.cat_file(url.removeprefix("s3://") + "/metadata.json")  # type: ignore[attr-defined]
    except FileNotFoundError:
        return 0
    return len(json.loads(text)["shards"])


@pytest.mark.slow  # processes against a server
def test_store_faults_are_one_line_each(
    s3: object, s3_server: dict[str, str], documents: list[str], tmp_path: Path
) -> None:
    """A missing bucket (input or output), wrong credentials, a prefix with no supported file: one line, before any
    work, exit 2 for inputs (refused like a missing file) and 1 for an output the store refuses."""
    bucket = new_bucket(s3)
    write_corpus(tmp_path / "corpus", documents[:30])
    upload(s3, tmp_path / "corpus", bucket, "corpus")
    s3.pipe(f"{bucket}/docs/README.md", b"no corpus here\n")  # type: ignore[attr-defined]
    common = ["--local", "--model", MODEL, "--workers", "1", "-q"]
    wrong = {"AWS_ACCESS_KEY_ID": "AKIAWRONGWRONGWRONG0", "AWS_SECRET_ACCESS_KEY": "wrong-secret-never-printed"}
    cases = [
        ([f"s3://no-such-bucket-{os.getpid()}/corpus/", "--output", tmp_path / "a"], {}, 2, "no such bucket"),
        ([f"s3://{bucket}/docs/", "--output", tmp_path / "b"], {}, 2, "a prefix with no input file under it"),
        ([f"s3://{bucket}/corpus/", "--output", tmp_path / "c"], wrong, 2, "access denied"),
        (
            [f"s3://{bucket}/corpus/", "--output", f"s3://no-such-bucket-{os.getpid()}/out"],
            {},
            1,
            "no such bucket",
        ),
    ]
    for args, env, code, said in cases:
        process = run_cli([*args, *common], env)
        _, errors = process.communicate(timeout=120)
        lines = errors.decode().strip().splitlines()
        assert process.returncode == code and len(lines) == 1 and said in lines[0], (args, lines)
        assert "wrong-secret-never-printed" not in lines[0]
    assert not any(tmp_path.glob("[abc]"))


@pytest.mark.slow  # ranks as processes against a server, one killed and rerun
def test_three_ranks_in_a_bucket_one_killed_mid_upload_merge_to_one_local_run(
    s3: object, s3_server: dict[str, str], documents: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """3 ranks write `s3://.../rank-RRRRR/`; rank 1 is killed -9 between a shard's objects and its metadata.json and
    run again; `tokenizer-shards merge URL` then writes one metadata.json there (no shard object copied, moved or
    uploaded again), and the merged dataset read through a cache holds the ids of one local run, byte for byte."""
    from tokenizer_service.tools.pretokenize.shards_cli import main as shards

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for part in range(3):  # rank R of 3 reads file R (a file is never split); each is several shards
        with (corpus / f"part-{part}.jsonl").open("w") as file:
            for copy in range(2):
                for number, text in enumerate(documents):
                    file.write(json.dumps({"text": f"{part}.{copy}.{number} {text}"}) + "\n")
    bucket = new_bucket(s3)
    upload(s3, corpus, bucket, "in")
    common = ["--local", "--model", MODEL, "--workers", "1", "--shard-tokens", "30000", "-q"]
    assert pretokenize(corpus, "--output", tmp_path / "single", *common) == 0
    url = f"s3://{bucket}/ranked"
    args = [f"s3://{bucket}/in/", "--output", url, *common, "--world-size", "3"]

    process = run_cli([*args, "--rank", "1", "--staging", tmp_path / "staging"], start_new_session=True)
    killed = kill_between_upload_and_metadata(process, s3, f"{url}/rank-00001")
    assert killed, "rank 1 ended before it could be killed between a shard's upload and its metadata"
    for rank in (0, 2):
        assert pretokenize(*args, "--rank", rank) == 0
    assert shards(["merge", url]) == 2  # rank 1 is incomplete: refused, nothing written
    assert "incomplete: rank-00001" in capsys.readouterr().err
    assert "metadata.json" not in objects_names(s3, url)
    rerun = run_cli([*args, "--rank", "1", "--staging", tmp_path / "staging"])
    _, errors = rerun.communicate(timeout=300)
    assert rerun.returncode == 0, errors.decode()

    before = objects(s3, url)
    assert shards(["merge", url]) == 0
    assert capsys.readouterr().out.startswith(f"merged 3 ranks into {url}: ")
    after = objects(s3, url)
    assert {name: data for name, data in after.items() if name != "metadata.json"} == before  # nothing moved
    assert shards(["merge", url]) == 0 and objects(s3, url) == after  # a rerun (after a kill): the same objects

    single = TokenDataset(tmp_path / "single")
    merged = TokenDataset(url, cache_dir=tmp_path / "cache")
    assert merged.metadata["merged"]["world_size"] == 3 and merged.num_shards >= 6
    assert len(merged) == len(single) and merged.num_tokens == single.num_tokens
    assert all_ids(merged) == all_ids(single)  # byte for byte
    assert documents_of(merged) == documents_of(single)
    assert not any((tmp_path / "staging").iterdir())


def our_uploads(fs: object, bucket: str, prefix: str) -> list[str]:
    """Keys of the incomplete multipart uploads directly under `prefix` in `bucket`."""
    uploads = fs.list_multipart_uploads(bucket)  # type: ignore[attr-defined]
    return sorted(upload["Key"] for upload in uploads if upload["Key"].rpartition("/")[0] == prefix)


class PartsHeld:
    """A TCP relay on 127.0.0.1 in front of the S3 server that holds every part upload (`PUT ...?partNumber=`) until
    `release()`: a run that goes through it is mid-upload, its multipart upload created and no part landed, for as
    long as the test needs, however fast the server. Everything else passes as it comes."""

    PART = re.compile(rb"^PUT [^ ]*[?&]partNumber=", re.MULTILINE)

    def __init__(self, endpoint: str) -> None:
        self.target = ("127.0.0.1", int(endpoint.rsplit(":", 1)[1]))
        self.released = threading.Event()
        self.holds = 0  # part uploads held so far
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def release(self) -> None:
        self.released.set()

    def close(self) -> None:
        self.released.set()
        self.listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            threading.Thread(target=self._pipe, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, False), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, requests: bool) -> None:
        tail = b""
        try:
            while data := source.recv(1 << 16):
                if requests and self.PART.search(tail + data):  # a request line cut between two reads included
                    self.holds += 1
                    self.released.wait()
                tail = data[-256:]
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for end in (source, sink):
                with contextlib.suppress(OSError):
                    end.shutdown(socket.SHUT_RDWR)


def interrupt_mid_multipart_upload(
    process: subprocess.Popen[bytes], fs: object, bucket: str, prefix: str, sig: signal.Signals, held: PartsHeld
) -> bool:
    """Send `sig` to `process` once a multipart upload of an object under `prefix` is under way and a part of it is
    held by `held` (released once the signal is sent); False if the run ended first."""
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and process.poll() is None:
            if held.holds and our_uploads(fs, bucket, prefix):  # a part on its way, held
                if sig == signal.SIGKILL:
                    os.killpg(process.pid, sig)
                else:
                    os.kill(process.pid, sig)
                return True
            time.sleep(0.01)
        return False
    finally:
        held.release()
        process.wait(timeout=120)


@pytest.mark.slow  # runs interrupted and killed mid-upload against a server
def test_multipart_uploads_cut_short_are_aborted_and_a_rerun_aborts_a_killed_runs(
    s3: object, documents: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shard of 11.4 MiB goes up in 5 MiB parts (TOKENIZER_UPLOAD_PART_MIB=5). A run stopped by Ctrl-C mid-upload
    aborts its upload; one killed -9 mid-upload leaves its parts (billed until aborted), and the same command aborts
    them before it writes anything and completes. Uploads of other outputs in the bucket, a rank's under the same
    prefix included, are left alone."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    with (corpus / "big.jsonl").open("w") as file:  # 7.3 M ids with the default model
        for copy in range(90):
            for number, text in enumerate(documents):
                file.write(json.dumps({"text": f"{copy}.{number} {text}"}) + "\n")
    bucket = new_bucket(s3)
    upload(s3, corpus, bucket, "in")
    others = [  # uploads under way elsewhere in the bucket: another output's, and a rank's under ours
        (key, s3.call_s3("create_multipart_upload", Bucket=bucket, Key=key)["UploadId"])  # type: ignore[attr-defined]
        for key in ("out-2/00000.bin", "killed/rank-00000/00000.bin")
    ]
    held = PartsHeld(os.environ["AWS_ENDPOINT_URL"])
    try:
        env = {"TOKENIZER_UPLOAD_PART_MIB": "5"}
        slowed = {**env, "AWS_ENDPOINT_URL": held.url}
        args = [f"s3://{bucket}/in/", "--local", "--model", MODEL, "--workers", "1", "--shard-tokens", "6000000"]

        interrupted = run_cli([*args, "-q", "--output", f"s3://{bucket}/interrupted"], slowed, start_new_session=True)
        assert interrupt_mid_multipart_upload(interrupted, s3, bucket, "interrupted", signal.SIGINT, held)
        assert interrupted.returncode == 130, interrupted.stderr.read().decode()  # type: ignore[union-attr]
        assert our_uploads(s3, bucket, "interrupted") == []  # aborted by the run itself

        command = [*args, "-q", "--output", f"s3://{bucket}/killed", "--staging", tmp_path / "staging"]
        held.released.clear()
        held.holds = 0
        killed = run_cli(command, slowed, start_new_session=True)
        assert interrupt_mid_multipart_upload(killed, s3, bucket, "killed", signal.SIGKILL, held)
        assert our_uploads(s3, bucket, "killed") == ["killed/00000.bin"]  # what a kill -9 leaves
        rerun = run_cli(command, env)
        _, errors = rerun.communicate(timeout=300)
        assert rerun.returncode == 0, errors.decode()
        assert our_uploads(s3, bucket, "killed") == []
        keys = sorted(upload["Key"] for upload in s3.list_multipart_uploads(bucket))  # type: ignore[attr-defined]
        assert keys == ["killed/rank-00000/00000.bin", "out-2/00000.bin"]  # another's: left alone
        dataset = TokenDataset(f"s3://{bucket}/killed", cache_dir=tmp_path / "cache")
        assert dataset.num_shards == 2 and dataset.num_tokens == dataset.metadata["tokens"] > 6_000_000
        # an export killed mid-upload left parts of its .bin: the next export of it aborts them, then uploads in parts
        from tokenizer_service.tools.pretokenize.shards_cli import main as shards

        s3.call_s3("create_multipart_upload", Bucket=bucket, Key="export/text_document.bin")  # type: ignore[attr-defined]
        monkeypatch.setenv("TOKENIZER_UPLOAD_PART_MIB", "5")
        url = f"s3://{bucket}/export/text_document"
        assert shards(["export", f"s3://{bucket}/killed", "--to", "megatron", "--output", url, "-q"]) == 0
        assert our_uploads(s3, bucket, "export") == []
        sizes = {path.rsplit("/", 1)[-1]: size for path, size in s3.du(f"{bucket}/export", total=False).items()}  # type: ignore[attr-defined]
        assert sizes["text_document.bin"] == dataset.num_tokens * 2 > 10 << 20  # two parts or more
    finally:
        held.close()
        for key, upload_id in others:
            s3.abort_mpu(bucket, key, upload_id)  # type: ignore[attr-defined]
    assert s3.list_multipart_uploads(bucket) == []  # type: ignore[attr-defined]


@pytest.mark.slow  # processes against a server
def test_credentials_that_may_not_list_multipart_uploads_still_run(
    s3: object, s3_server: dict[str, str], documents: list[str], tmp_path: Path
) -> None:
    """A least-privilege key without s3:ListBucketMultipartUploads and s3:AbortMultipartUpload: the run (and its
    rerun, which looks for a killed run's uploads) and an export to the bucket complete; the parts are then the
    bucket lifecycle rule's."""
    import botocore.session

    iam = botocore.session.get_session().create_client(
        "iam",
        region_name="us-east-1",
        endpoint_url=s3_server["AWS_ENDPOINT_URL"],
        aws_access_key_id=s3_server["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=s3_server["AWS_SECRET_ACCESS_KEY"],
    )
    user = f"no-multipart-{os.getpid()}"
    iam.create_user(UserName=user)
    denied = ["s3:ListBucketMultipartUploads", "s3:AbortMultipartUpload"]
    policy = {
        "Version": "2012-10-17",
        "Statement": [
            {"Effect": "Allow", "Action": "s3:*", "Resource": "*"},
            {"Effect": "Deny", "Action": denied, "Resource": "*"},
        ],
    }
    iam.put_user_policy(UserName=user, PolicyName="no-multipart", PolicyDocument=json.dumps(policy))
    key = iam.create_access_key(UserName=user)["AccessKey"]
    env = {"AWS_ACCESS_KEY_ID": key["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"]}
    bucket = new_bucket(s3)
    with pytest.raises(PermissionError):  # the policy is in force
        s3fs_as(env).list_multipart_uploads(bucket)
    write_corpus(tmp_path / "corpus", documents[:60])
    upload(s3, tmp_path / "corpus", bucket, "corpus")
    args = [f"s3://{bucket}/corpus/", "--local", "--model", MODEL, "--workers", "1", "--shard-tokens", "2000", "-q"]
    for _ in range(2):  # a run, then a rerun of the finished output
        process = run_cli([*args, "--output", f"s3://{bucket}/out"], env)
        _, errors = process.communicate(timeout=120)
        assert process.returncode == 0, errors.decode()
    assert listed_shards(s3, f"s3://{bucket}/out") >= 2
    export = [f"s3://{bucket}/out", "--to", "megatron", "--output", f"s3://{bucket}/megatron/text_document", "-q"]
    command = [sys.executable, "-m", "tokenizer_service.tools.pretokenize.shards_cli", "export", *export]
    exported = subprocess.run(command, cwd=ROOT, env={**os.environ, **env}, capture_output=True, timeout=120)
    assert exported.returncode == 0, exported.stderr.decode()
    assert sorted(objects_names(s3, f"s3://{bucket}/megatron")) == ["text_document.bin", "text_document.idx"]


# ---------------------------------------------------------------------------------------------------------------------
# Stores that refuse connections or never answer: told apart from a missing bucket, in bounded time


class SilentStore:
    """A TCP server on 127.0.0.1 that accepts every connection and never answers (a store that is up and hung, or
    the wrong port of a proxy). Used as a context manager: on leaving it, `accepted` is the number of connections
    the clients made (each try of a request is one: a timed-out connection is not reused)."""

    def __init__(self) -> None:
        self.listening = socket.create_server(("127.0.0.1", 0), backlog=128)
        self.endpoint = f"http://127.0.0.1:{self.listening.getsockname()[1]}"
        self.held: list[socket.socket] = []
        self.accepted = 0
        self.stopping = False
        self.thread = threading.Thread(target=self._hold, daemon=True)

    def _hold(self) -> None:
        while True:
            connection, _ = self.listening.accept()
            if self.stopping:  # the connection `__exit__` makes to wake this loop: the clients' were accepted before
                connection.close()
                return
            self.held.append(connection)

    def __enter__(self) -> SilentStore:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping = True
        socket.create_connection(self.listening.getsockname(), timeout=10).close()
        self.thread.join(timeout=10)
        self.accepted = len(self.held)
        for connection in self.held:
            connection.close()
        self.listening.close()


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """This process's AWS environment (a key, a region, no config file of this machine, no retry setting; the test
    sets AWS_ENDPOINT_URL), s3fs's instances forgotten before and after."""
    s3fs = pytest.importorskip("s3fs", reason="s3fs: pip install -e '.[s3]'")
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_MAX_ATTEMPTS", "AWS_RETRY_MODE", storage.ENVIRONMENT):
        monkeypatch.delenv(name, raising=False)
    env = {
        "AWS_ACCESS_KEY_ID": "AKIAEXAMPLEEXAMPLE00",
        "AWS_SECRET_ACCESS_KEY": "secret-never-printed",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    s3fs.S3FileSystem.clear_instance_cache()  # fsspec caches an instance by its options, not by AWS_ENDPOINT_URL
    yield env
    storage.configure(None)
    s3fs.S3FileSystem.clear_instance_cache()


def run_to_the_end(args: list[object], env: dict[str, str], timeout: float) -> tuple[int, str, float]:
    """(exit code, stderr, seconds) of a tokenizer-pretokenize run; killed (and the test failed) past `timeout`."""
    started = time.monotonic()
    process = run_cli([str(arg) for arg in args], env)
    try:
        _, errors = process.communicate(timeout=timeout)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    return process.returncode, errors.decode(), time.monotonic() - started


READ_TIMEOUT = 1  # s, the --storage-options these tests give: each try of a request waits this long for an answer
RUN_BOUND = 45  # s: a run waits for 2 requests at most (an input: HEAD, then a listing), each 3 tries of 1 s and
# at most 1 + 2 s of backoff: 12 s, plus the run's start-up (2-5 s on 2 cores). With s3fs's own 5 tries around
# botocore's 5 (the defaults before), each request alone was 25 tries: at least 50 s.


def input_and_output_lines(local: Path, tmp_path: Path, common: list[object], env: dict[str, str]) -> list[str]:
    """The one line of a run with an input URL at the store (exit 2) and of one with an output URL there (exit 1),
    each within RUN_BOUND and without a traceback."""
    found = []
    for args, code in (
        (["s3://corpora/in.jsonl", "--output", tmp_path / "out"], 2),
        ([local, "--output", "s3://datasets/shards"], 1),
    ):
        returncode, errors, seconds = run_to_the_end([*args, *common], env, timeout=RUN_BOUND + 60)
        lines = errors.strip().splitlines()
        assert returncode == code and len(lines) == 1 and "Traceback" not in errors, (args, errors)
        assert seconds < RUN_BOUND, (args, seconds)
        found.append(lines[0])
    return found


@pytest.mark.slow  # processes waiting out timeouts
def test_a_store_that_never_answers_ends_the_run_with_one_line_in_bounded_time(
    aws_env: dict[str, str], tmp_path: Path
) -> None:
    """An endpoint that accepts connections and never answers: an input or an output URL there ends the run within
    RUN_BOUND with one line naming the endpoint and that it does not answer, exit 2 (an input) or 1 (an output),
    no traceback, nothing written."""
    local = tmp_path / "in.jsonl"
    local.write_text('{"text": "hello"}\n')
    options = json.dumps({"config_kwargs": {"read_timeout": READ_TIMEOUT}})
    common = ["--local", "--model", MODEL, "--workers", "1", "-q", "--storage-options", options]
    with SilentStore() as store:
        for errors in input_and_output_lines(local, tmp_path, common, {"AWS_ENDPOINT_URL": store.endpoint}):
            assert "does not answer" in errors and store.endpoint in errors, errors
            assert "secret-never-printed" not in errors
    assert store.accepted >= 3  # the store was asked, and waited for
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # waits out timeouts
def test_a_check_against_a_silent_store_makes_botocores_tries_only_and_the_users_settings_win(
    aws_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`check_reachable` against a silent endpoint: one request (HeadBucket; no second probe), tried
    storage.S3_ATTEMPTS times by botocore and once by s3fs (not 5 x 5), within READ_TIMEOUT a try plus the backoff;
    `config_kwargs` in the options, then AWS_MAX_ATTEMPTS, set the number of tries instead."""
    import s3fs

    cases = [
        ({"config_kwargs": {"read_timeout": READ_TIMEOUT}}, {}, storage.S3_ATTEMPTS),
        ({"config_kwargs": {"read_timeout": READ_TIMEOUT, "retries": {"total_max_attempts": 1}}}, {}, 1),
        ({"s3": {"config_kwargs": {"read_timeout": READ_TIMEOUT}}}, {"AWS_MAX_ATTEMPTS": "2"}, 2),
    ]
    for options, env, tries in cases:
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        storage.configure(options)
        s3fs.S3FileSystem.clear_instance_cache()
        with SilentStore() as store:
            monkeypatch.setenv("AWS_ENDPOINT_URL", store.endpoint)
            started = time.monotonic()
            with pytest.raises(storage.StorageError) as refused:
                storage.check_reachable("s3://corpora/in.jsonl")
            seconds = time.monotonic() - started
        message = str(refused.value)
        assert "does not answer" in message and store.endpoint in message and "no such bucket" not in message
        assert store.accepted == tries, (options, env)
        backoff = 2 ** (tries - 1) - 1  # botocore's standard mode: at most 1 s, then 2 s, ... between tries
        assert tries * READ_TIMEOUT <= seconds < tries * READ_TIMEOUT + backoff + 5, (options, env, seconds)
    fs, _ = storage.filesystem("s3://corpora/in.jsonl")
    assert fs.retries == 1  # s3fs's own loop makes one try
    assert storage.configured() == cases[-1][0]  # the options given are not changed by the defaults added


@pytest.mark.slow  # processes against a refusing port, and the S3 server of the module
def test_a_store_that_refuses_connections_or_a_bad_option_is_not_taken_for_a_missing_bucket(
    aws_env: dict[str, str], s3: object, s3_server: dict[str, str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A port nothing listens on: one line saying the endpoint refuses connections (input, exit 2; output, exit 1),
    never "no such bucket". A bucket that does not exist on a real S3 API still says "no such bucket", wrong
    credentials "access denied"; a bad option says the settings are not valid, without "run again"."""
    import s3fs

    local = tmp_path / "in.jsonl"
    local.write_text('{"text": "hello"}\n')
    common = ["--local", "--model", MODEL, "--workers", "1", "-q"]
    with socket.socket() as bound:  # bound, not listening: connections to it are refused, and no one else takes it
        bound.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{bound.getsockname()[1]}"
        for errors in input_and_output_lines(local, tmp_path, common, {**aws_env, "AWS_ENDPOINT_URL": endpoint}):
            assert "refuses connections" in errors and endpoint in errors and "no such bucket" not in errors, errors
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        with pytest.raises(storage.StorageError, match="refuses connections"):
            storage.check_reachable("s3://corpora/in.jsonl")
        storage.configure({"config_kwargs": {"retries": {"mode": "sometimes"}}})  # botocore refuses the value
        s3fs.S3FileSystem.clear_instance_cache()
        with pytest.raises(storage.StorageError) as refused:
            storage.check_reachable("s3://corpora/in.jsonl")
        message = str(refused.value)
        assert "storage settings are not valid" in message and "--storage-options" in message, message
        assert "run the same command again" not in message
        storage.configure(None)

    for name, value in s3_server.items():  # the module's S3 server
        monkeypatch.setenv(name, value)
    s3fs.S3FileSystem.clear_instance_cache()
    bucket = new_bucket(s3)
    storage.check_reachable(f"s3://{bucket}/corpus/")  # there, and these credentials may use it
    missing = f"no-such-bucket-{os.getpid()}"
    with pytest.raises(storage.StorageError, match=f"no such bucket '{missing}'"):
        storage.check_reachable(f"s3://{missing}/corpus/")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret-never-printed")
    s3fs.S3FileSystem.clear_instance_cache()
    with pytest.raises(storage.StorageError, match="access denied") as denied:
        storage.check_reachable(f"s3://{bucket}/corpus/")
    assert "wrong-secret-never-printed" not in str(denied.value)


def s3fs_as(env: dict[str, str]) -> object:
    import s3fs

    return s3fs.S3FileSystem(
        key=env["AWS_ACCESS_KEY_ID"], secret=env["AWS_SECRET_ACCESS_KEY"], skip_instance_cache=True
    )


def all_ids(dataset: TokenDataset) -> bytes:
    return b"".join(dataset.shard(shard).ids.tobytes() for shard in range(dataset.num_shards))


# ---------------------------------------------------------------------------------------------------------------------
# Reading for training: TokenDataset and Mixture over URLs, through a cache


@pytest.fixture(scope="module")
def two_outputs(documents: list[str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two local outputs of one model (a ragged one of several shards, and a packed one), to be read from URLs."""
    directory = tmp_path_factory.mktemp("outputs")
    common = ["--local", "--model", MODEL, "--workers", "1", "--shard-tokens", "3000", "-q"]
    outputs = {"web": directory / "web", "code": directory / "code"}
    write_corpus(directory / "web-corpus", documents[:300])
    write_corpus(directory / "code-corpus", documents[300:600])
    assert pretokenize(directory / "web-corpus", "--output", outputs["web"], *common) == 0
    assert pretokenize(directory / "code-corpus", "--output", outputs["code"], *common, "--seq-len", "64") == 0
    return outputs


def test_token_dataset_at_a_url_needs_a_cache_and_equals_the_local_one(
    two_outputs: dict[str, Path], tmp_path: Path
) -> None:
    url = f"file://{two_outputs['web']}"
    with pytest.raises(ValueError, match=r"is a URL: give TokenDataset\(.*cache_dir=DIR\)"):
        TokenDataset(url)
    local = TokenDataset(two_outputs["web"])
    remote = TokenDataset(url, cache_dir=tmp_path / "cache")
    assert local.num_shards >= 3 and len(remote) == len(local)
    assert not list((tmp_path / "cache").rglob("*.bin"))  # the index only, until a shard is read
    assert remote[len(remote) - 1].tolist() == local[len(local) - 1].tolist()
    assert len(list((tmp_path / "cache").rglob("*.bin"))) == 1  # only the shard it needed
    assert documents_of(remote) == documents_of(local)
    import pickle

    again = pickle.loads(pickle.dumps(remote))  # DataLoader workers: by URL and cache
    assert again.url == url and again.path == remote.path and documents_of(again) == documents_of(local)
    missing = f"file://{tmp_path}/nothing"
    with pytest.raises(ValueError, match=r"holds no metadata\.json"):
        TokenDataset(missing, cache_dir=tmp_path / "cache")


def read_all(url: str, cache: str, endpoint_env: dict[str, str]) -> str:
    """In a process of its own: every document of the dataset at `url` through `cache` (a digest of them)."""
    import hashlib

    os.environ.update(endpoint_env)
    dataset = TokenDataset(url, cache_dir=cache)
    digest = hashlib.sha256()
    for index in range(len(dataset)):
        digest.update(dataset[index].tobytes())
    return digest.hexdigest()


@pytest.mark.slow  # a server of its own; processes reading from it
def test_token_dataset_and_a_mixture_over_bucket_urls_equal_local_ones(
    s3: object, s3_server: dict[str, str], two_outputs: dict[str, Path], tmp_path: Path
) -> None:
    import concurrent.futures
    import hashlib
    import multiprocessing

    from tokenizer_client import Mixture

    bucket = new_bucket(s3)
    for name, local in two_outputs.items():
        upload(s3, local, bucket, f"shards/{name}")
    urls = {name: f"s3://{bucket}/shards/{name}" for name in two_outputs}
    cache = tmp_path / "cache"
    # two processes fill one cache at once
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(2, mp_context=context) as pool:
        digests = list(pool.map(read_all, [urls["web"]] * 2, [str(cache)] * 2, [s3_server] * 2))
    local = TokenDataset(two_outputs["web"])
    expected = hashlib.sha256(b"".join(local[index].tobytes() for index in range(len(local)))).hexdigest()
    assert digests == [expected, expected]
    assert not list(cache.rglob("*.part"))  # no temporary file left
    cached = sorted(path.name for path in cache.rglob("*") if path.is_file())
    assert sorted(path.name for path in two_outputs["web"].iterdir()) == cached
    assert documents_of(TokenDataset(urls["web"], cache_dir=cache)) == documents_of(local)

    # a two-source Mixture over the bucket equals the one over the local directories, rows and state
    def mixture(sources: dict[str, TokenDataset]) -> Mixture:
        return Mixture(sources, weights={"web": 0.7, "code": 0.3}, seq_len=64, seed=7, cache_dir=tmp_path / "mix")

    here = mixture({name: TokenDataset(path) for name, path in two_outputs.items()})
    there = mixture({name: TokenDataset(url, cache_dir=cache) for name, url in urls.items()})
    ours, theirs = here.rows(0, 40), there.rows(0, 40)
    for field in ("input_ids", "labels", "position_ids", "sources"):
        np.testing.assert_array_equal(getattr(ours, field), getattr(theirs, field))
    rows_here = here.loader(rank=0, world_size=1, batch_size=4)
    rows_there = there.loader(rank=0, world_size=1, batch_size=4)
    for mine, yours, _ in zip(rows_here, rows_there, range(3), strict=False):
        np.testing.assert_array_equal(mine.input_ids, yours.input_ids)
    assert rows_here.state_dict() == rows_there.state_dict()  # a dataset copied elsewhere resumes the same stream


def test_shards_info_verify_export_read_and_write_urls(
    two_outputs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """tokenizer-shards info|verify|export take a URL DIR (downloaded to --cache-dir, else a temporary one), and
    export's --output a URL (written under a temporary directory, then uploaded): the same as local."""
    from tokenizer_service.tools.pretokenize.shards_cli import main as shards

    local, url = two_outputs["web"], f"file://{two_outputs['web']}"
    assert shards(["info", str(local)]) == 0
    said_here = capsys.readouterr().out
    assert shards(["info", url, "--cache-dir", str(tmp_path / "cache")]) == 0
    assert capsys.readouterr().out == said_here.replace(str(local), url)  # named as given, not by its cache
    assert shards(["verify", url]) == 0
    assert "headers and sizes agree with metadata.json" in capsys.readouterr().out
    for to, where in (("megatron", "meg/web_text_document"), ("nanogpt", "nano/"), ("llmc", "llmc")):
        assert shards(["export", str(local), "--to", to, "--output", f"{tmp_path}/here/{where}", "-q"]) == 0
        target = f"file://{tmp_path}/there/{where}"
        assert shards(["export", url, "--to", to, "--output", target, "--val-documents", "0", "-q"]) == 0
    assert files_of_tree(tmp_path / "here") == files_of_tree(tmp_path / "there")
    assert shards(["merge", f"file://{tmp_path}/ranked"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"tokenizer-shards: file://{tmp_path}/ranked does not exist: give the --output of the ranked run"
    )


def test_ranks_at_a_file_url_merge_in_place_to_one_run(
    documents: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`tokenizer-shards merge URL` through the store's code path: ranks written to `URL/rank-RRRRR/`, merged by one
    metadata.json naming their shard objects where they are (no object copied or moved), equal to one local run;
    refused while a rank is missing, and a second merge (a rerun after a kill) writes the same bytes."""
    from tokenizer_service.tools.pretokenize.ranks import merge
    from tokenizer_service.tools.pretokenize.shards_cli import main as shards

    write_corpus(tmp_path / "corpus", documents[:240])
    args = [tmp_path / "corpus", "--local", "--model", MODEL, "--workers", "1", "--shard-tokens", "2000", "-q"]
    assert pretokenize(*args, "--output", tmp_path / "single") == 0
    url = f"file://{tmp_path}/ranked"
    for rank in (0, 1):
        assert pretokenize(*args, "--output", url, "--rank", rank, "--world-size", 3) == 0
    assert shards(["merge", url]) == 2
    assert "missing: rank-00002" in capsys.readouterr().err
    assert pretokenize(*args, "--output", url, "--rank", 2, "--world-size", 3) == 0
    before = files_of_tree(tmp_path / "ranked")
    (tmp_path / "ranked" / ".metadata.json.tmp").write_text("{half a merge")  # a merge killed mid-write
    assert shards(["merge", url]) == 0
    assert capsys.readouterr().out.startswith(f"merged 3 ranks into {url}: ")
    after = files_of_tree(tmp_path / "ranked")
    assert {name: data for name, data in after.items() if name != "metadata.json"} == before  # nothing moved
    merged = json.loads(after["metadata.json"])
    assert [shard["name"].split("/")[0] for shard in merged["shards"]][::-1][0] == "rank-00002"
    assert shards(["merge", url]) == 0 and files_of_tree(tmp_path / "ranked") == after  # again: the same bytes
    local = merge(tmp_path / "ranked")  # the local merge of the same ranks: the same metadata.json
    assert local == merged and files_of_tree(tmp_path / "ranked") == after
    single = TokenDataset(tmp_path / "single")
    remote = TokenDataset(url, cache_dir=tmp_path / "cache")
    assert documents_of(remote) == documents_of(single) and remote.num_tokens == single.num_tokens
    assert TokenDataset(tmp_path / "ranked").num_shards == remote.num_shards > 3
    # a rank whose objects do not agree with its metadata.json: refused by name, the merged metadata.json kept
    victim = next((tmp_path / "ranked" / "rank-00001").glob("*.bin"))
    victim.chmod(0o644)
    victim.write_bytes(victim.read_bytes()[:-2])
    assert shards(["merge", url]) == 2
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and f"rank-00001: {victim.name} holds" in said[0], said
    assert files_of_tree(tmp_path / "ranked")["metadata.json"] == after["metadata.json"]


@pytest.mark.readers  # megatron-core in its own venv (TOKENIZER_MEGATRON_PYTHON)
@pytest.mark.slow  # a server of its own
@pytest.mark.parametrize("per_shard", [False, True])
def test_a_megatron_export_in_a_bucket_is_read_back_by_megatron_core(
    s3: object, two_outputs: dict[str, Path], tmp_path: Path, per_shard: bool
) -> None:
    """`tokenizer-shards export s3://... --to megatron --output s3://...`: the objects, downloaded as a trainer's job
    would, are read by megatron-core's IndexedDataset as the dataset's documents."""
    from tests.test_export import MEGATRON_READ, reader_python, run_reader
    from tokenizer_service.tools.pretokenize.shards_cli import main as shards

    reader_python("megatron")  # skips before any work without megatron-core (fails under TOKENIZER_CI=1)
    bucket = new_bucket(s3)
    upload(s3, two_outputs["web"], bucket, "shards/web")
    url = f"s3://{bucket}/megatron/web_text_document"
    args = ["export", f"s3://{bucket}/shards/web", "--to", "megatron", "--output", url, "-q"]
    assert shards(args + (["--per-shard"] if per_shard else [])) == 0
    downloaded = tmp_path / "downloaded"
    downloaded.mkdir()
    for name in objects_names(s3, f"s3://{bucket}/megatron"):
        s3.get_file(f"{bucket}/megatron/{name}", str(downloaded / name))  # type: ignore[attr-defined]
    local = TokenDataset(two_outputs["web"])
    expected = documents_of(local)
    if per_shard:
        prefixes = [downloaded / f"web_text_document_{shard['name']}" for shard in local.metadata["shards"]]
        assert sorted(path.name for path in downloaded.iterdir()) == sorted(
            f"{prefix.name}{suffix}" for prefix in prefixes for suffix in (".bin", ".idx")
        )
    else:
        prefixes = [downloaded / "web_text_document"]
        assert sorted(path.name for path in downloaded.iterdir()) == ["web_text_document.bin", "web_text_document.idx"]
    read = [run_reader("megatron", MEGATRON_READ, str(prefix)) for prefix in prefixes]
    assert [sequence for part in read for sequence in part["sequences"]] == expected  # type: ignore[index]
    if not per_shard:
        assert read[0]["documents"] == list(range(len(expected) + 1))  # type: ignore[index]


def files_of_tree(directory: Path) -> dict[str, bytes]:
    return {
        str(path.relative_to(directory)): path.read_bytes() for path in sorted(directory.rglob("*")) if path.is_file()
    }


def test_the_kubernetes_job_reads_and_writes_s3_with_credentials_from_a_secret() -> None:
    import yaml

    (job,) = yaml.safe_load_all((ROOT / "deploy" / "k8s" / "pretokenize-s3-job.yaml").read_text())
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = container["args"]
    assert args[0].startswith("s3://") and args[args.index("--output") + 1].startswith("s3://")
    assert container["envFrom"] == [{"secretRef": {"name": "tokenizer-s3"}}]
    staging = args[args.index("--staging") + 1]
    mounted = {mount["mountPath"]: mount["name"] for mount in container["volumeMounts"]}
    assert "emptyDir" in next(volume for volume in pod["volumes"] if volume["name"] == mounted[staging])
    assert pod["restartPolicy"] == "OnFailure"  # a restarted pod resumes from what was uploaded
    script = (ROOT / "deploy" / "slurm" / "pretokenize.sbatch").read_text()
    assert "s3://" in script and "AWS_ENDPOINT_URL" in script
