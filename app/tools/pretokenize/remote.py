"""An output at a URL (``--output s3://bucket/prefix``, or any fsspec URL): staged locally, uploaded shard by shard.

Shards are written exactly as into a local output, under a staging directory (``--staging DIR``, default a new
directory under the system's temporary directory, removed when the run ends), and each complete shard's files are
uploaded, then removed from the staging directory; only after a shard's objects exist is ``metadata.json`` (the
only object that says a shard is complete) uploaded over the previous one, in one PUT. A run killed at any point
leaves the previous ``metadata.json`` or the new one, and perhaps objects of a shard it does not list: the rerun
(the same command) reads ``metadata.json`` from the store, deletes those objects and goes on from the shards it
lists, so it ends with exactly the objects of an uninterrupted run. Large objects are uploaded in parts
(``part_size``: at most 10,000 of them, S3's limit; ``TOKENIZER_UPLOAD_PART_MIB`` sets the smallest).

Parts of a multipart upload that never completed are not objects, but the store keeps (and bills) them until the
upload is aborted. s3fs aborts its own upload when a part fails; an upload cut short otherwise (Ctrl-C, or the
abort itself failing because the store went away) is aborted here where the run can (`abort_uploads`), and the
uploads a killed run left (``kill -9``, a lost node) are aborted by the rerun before it writes anything: only those
of this output's own objects (its shard files and metadata.json, directly under its prefix), never another run's.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tokenizer_client.dataset import METADATA_FILE, check_metadata, shard_index
from tokenizer_client.storage import StorageError, check_reachable, describe, filesystem, is_url, protocol_of
from tokenizer_service.core import scratch
from tokenizer_service.tools.pretokenize.store import TMP_SUFFIX, OutputDir, OutputError, _ours

MAX_PARTS = 10_000  # S3's limit on the parts of one multipart upload
MIN_PART = 50 << 20  # s3fs's default part size
SMALLEST_PART = 5 << 20  # S3's smallest (but the last)
PART_ENVIRONMENT = "TOKENIZER_UPLOAD_PART_MIB"
MiB = 1 << 20


def part_size(size: int) -> int:
    """The part size of a multipart upload of `size` bytes: 50 MiB (``TOKENIZER_UPLOAD_PART_MIB``, at least 5: s3fs
    sends 10 parts at once, so smaller parts hold less memory), or more (whole MiB) to stay within 10,000 parts (a
    5 TiB object, S3's largest, in parts of 525 MiB). An object under two parts is one PUT."""
    smallest = MIN_PART
    given = os.environ.get(PART_ENVIRONMENT)
    if given:
        try:
            smallest = max(SMALLEST_PART, int(given) * MiB)
        except ValueError:
            raise StorageError(f"{PART_ENVIRONMENT}={given!r} is not a whole number of MiB") from None
    return max(smallest, math.ceil(size / MAX_PARTS / MiB) * MiB)


def abort_uploads(fs: Any, prefix: str, wanted: Callable[[str], bool]) -> int:
    """Abort the incomplete multipart uploads in `prefix`'s bucket whose key (``bucket/key``) is `wanted`; how many.
    Stores without multipart uploads of their own to list (every one but s3fs's): 0. The listing is s3fs's
    ``list_multipart_uploads`` (its first 1,000 uploads in the bucket: the S3 API's page), each abort its
    ``abort_mpu``. Credentials that may not list or abort them (a policy without s3:ListBucketMultipartUploads or
    s3:AbortMultipartUpload) leave them to the bucket's lifecycle rule: no reason to refuse a run or an export."""
    if not (hasattr(fs, "list_multipart_uploads") and hasattr(fs, "abort_mpu")):
        return 0
    bucket = prefix.split("/", 1)[0]
    aborted = 0
    try:
        uploads = fs.list_multipart_uploads(bucket)
    except PermissionError:
        return 0
    for upload in uploads:
        if wanted(f"{bucket}/{upload['Key']}"):
            try:
                fs.abort_mpu(bucket, upload["Key"], upload["UploadId"])
            except FileNotFoundError:  # aborted or completed meanwhile
                continue
            except PermissionError:
                return aborted
            aborted += 1
    return aborted


def upload_file(fs: Any, local: Path, key: str, url: str, where: str) -> None:
    """Upload `local` to `key` (``bucket/key``) of `url`'s store, an S3 object of two parts or more in `part_size`
    parts; StorageError naming `where` when it fails. s3fs aborts its upload when a part fails, unless the abort
    fails too (the store went away); Ctrl-C leaves it going: it is aborted here if the store answers, else a rerun
    aborts it (the upload's own failure is the one reported)."""
    extra = {"chunksize": part_size(local.stat().st_size)} if protocol_of(url) in ("s3", "s3a") else {}
    try:
        fs.put_file(str(local), key, **extra)
    except BaseException as exc:
        with contextlib.suppress(Exception):
            abort_uploads(fs, key, key.__eq__)
        if isinstance(exc, Exception):
            raise StorageError(describe(exc, where)) from None
        raise


STAGING_PREFIX = "tokenizer-pretokenize-staging-"  # then the pid and a random part (core.scratch)


class StagedOutput(OutputDir):
    """`OutputDir` for a URL: `path` is the local staging directory shards are written in, `url` where they go."""

    def __init__(self, url: str, staging: Path | None = None) -> None:
        self.url = url.rstrip("/")
        self.fs, self.root = filesystem(self.url)
        self.root = self.root.rstrip("/")
        self._base = Path(staging).expanduser() if staging is not None else None
        if self._base is None:
            scratch.remove_stale(STAGING_PREFIX)  # what runs killed outright left behind
            self._base = scratch.make(STAGING_PREFIX)
            self._own_base = True
        else:
            self._own_base = not self._base.exists()
        # one folder per output URL, so that runs (ranks) sharing one --staging never meet
        super().__init__(self._base / hashlib.sha256(self.url.encode()).hexdigest()[:16])
        self.uploaded = 0  # objects uploaded by this run

    @property
    def where(self) -> str:
        return self.url

    def _key(self, name: str) -> str:
        return f"{self.root}/{name}"

    def _own_key(self, key: str) -> bool:
        """Whether `key` (``bucket/key``) is one of this output's objects: a shard file or metadata.json (or their
        temporary names) right under its prefix, not another output's nor a rank's under it."""
        folder, _, name = key.rpartition("/")
        return folder == self.root and _ours(name)

    def _abort_uploads(self) -> None:
        """Abort this output's incomplete multipart uploads."""
        try:
            abort_uploads(self.fs, self.root, self._own_key)
        except StorageError:
            raise
        except Exception as exc:
            raise StorageError(describe(exc, self.url)) from None

    def _names(self) -> list[str]:
        """Names of the objects (and "directories") right under the output's prefix."""
        try:
            listed = self.fs.ls(self.root, detail=False, refresh=True)
        except FileNotFoundError:
            return []
        except Exception as exc:
            raise StorageError(describe(exc, self.url)) from None
        return [str(entry).rstrip("/").rsplit("/", 1)[-1] for entry in listed]

    def load(self) -> dict[str, Any] | None:
        """The store's metadata.json, if there is one; refuses a prefix that holds anything else of its own. A
        missing bucket or refused credentials are one line, before any work."""
        check_reachable(self.url)
        try:
            text = self.fs.cat_file(self._key(METADATA_FILE))
        except FileNotFoundError:
            foreign = sorted(name for name in self._names() if not _ours(name))
            if foreign:
                raise OutputError(
                    f"{self.url} is not empty and is not a tokenizer-pretokenize output "
                    f"(no {METADATA_FILE}; found {', '.join(foreign[:5])}); choose another --output"
                ) from None
            return None
        except Exception as exc:
            raise StorageError(describe(exc, self.url)) from None
        where = f"{self.url}/{METADATA_FILE}"
        try:
            metadata = json.loads(text)
        except ValueError as exc:
            raise OutputError(f"{where} is not JSON ({exc}); choose another --output") from exc
        try:
            return check_metadata(metadata, where)
        except ValueError as exc:
            raise OutputError(f"{exc}; choose another --output") from exc

    def prepare(self, shards_kept: int) -> None:
        """An empty staging folder; in the store, the objects of shards past the complete ones (a killed run's
        upload) and temporary names removed."""
        if self.path.exists():
            shutil.rmtree(self.path)
        self.path.mkdir(parents=True)
        try:
            self.fs.makedirs(self.root, exist_ok=True)  # a folder where the store has them (file://); else nothing
        except Exception as exc:
            raise StorageError(describe(exc, self.url)) from None
        for name in self._names():
            shard = shard_index(name)
            if (name.endswith(TMP_SUFFIX) and _ours(name)) or (shard is not None and shard >= shards_kept):
                self._remove(name)
        self._abort_uploads()  # parts a killed run left: billed until aborted

    def discard(self, created: bool) -> None:
        """Remove what this tool wrote (a run that produced nothing), in the store and in the staging folder."""
        for name in self._names():
            if _ours(name):
                self._remove(name)
        shutil.rmtree(self.path, ignore_errors=True)

    def commit(self, finals: list[Path]) -> None:
        """Rename the staged files as on disk, upload the shard files, then (a later call) metadata.json."""
        super().commit(finals)
        for final in finals:
            self._upload(final)
            if final.name != METADATA_FILE:
                final.unlink()  # uploaded: the store holds it now

    def _upload(self, local: Path) -> None:
        upload_file(self.fs, local, self._key(local.name), self.url, f"{self.url}/{local.name}")
        self.uploaded += 1

    def _remove(self, name: str) -> None:
        try:
            self.fs.rm_file(self._key(name))
        except FileNotFoundError:
            pass
        except Exception as exc:
            raise StorageError(describe(exc, f"{self.url}/{name}")) from None

    def close(self) -> None:
        """Remove the staging folder (and the staging directory, if this run made it)."""
        super().close()
        shutil.rmtree(self.path, ignore_errors=True)
        if self._own_base and self._base is not None:
            shutil.rmtree(self._base, ignore_errors=True)


def output_for(output: str | Path, staging: Path | None = None) -> OutputDir:
    """Where a run writes: a local directory, or a URL staged under `staging`."""
    if is_url(output):
        return StagedOutput(str(output), staging)
    return OutputDir(Path(output))
