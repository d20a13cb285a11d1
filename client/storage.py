"""Object storage and every other fsspec filesystem: URLs for the pre-tokenizer's inputs and outputs and for readers.

A path is a **URL** when it starts with ``PROTOCOL://`` (``s3://bucket/prefix``, ``gs://``, ``hf://datasets/...``,
``file:///abs/path``, ...): it is opened with fsspec and the filesystem package of its protocol (s3fs, gcsfs,
huggingface_hub, ...), which must be installed (``pip install 'tokenizer-service[s3]'``, ``[gcs]``); a missing one
is one line naming the extra. Plain paths are local files, as always, and never go through fsspec.

Credentials and endpoints come the standard way of each store (for S3: the AWS SDK's environment variables, config
files and roles, ``AWS_ENDPOINT_URL`` for S3-compatible stores such as MinIO, R2 or Ceph). Options for the
filesystem (``endpoint_url``, ``anon``, ``requester_pays``, ...) come from ``configure(options)`` (the commands'
``--storage-options JSON``) or the environment's ``TOKENIZER_STORAGE_OPTIONS`` (JSON), as one object for every
protocol or an object per protocol (``{"s3": {...}, "gs": {...}}``). They are never logged or repeated in a message.

Readers (``TokenDataset(URL, cache_dir=...)``) download what they read into a cache with ``fetch``: a file is
written under a temporary name in the cache and renamed once its size is checked, so processes that fill one cache at
once never see a half file, and each file is downloaded again only when it is missing or of the wrong size.

Public: ``is_url``, ``filesystem``, ``join``, ``configure``, ``StorageError``, ``describe``, ``fetch``,
``cache_directory``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["StorageError", "cache_directory", "configure", "describe", "fetch", "filesystem", "is_url", "join"]

URL = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]+)://")
ENVIRONMENT = "TOKENIZER_STORAGE_OPTIONS"
EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}  # protocol -> tokenizer-service extra
PACKAGES = {
    "s3": "s3fs",
    "s3a": "s3fs",
    "gs": "gcsfs",
    "gcs": "gcsfs",
    "hf": "huggingface_hub",
    "az": "adlfs",
    "abfs": "adlfs",
    "abfss": "adlfs",
}
BUCKETED = ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss")  # stores whose first path part is a bucket/container

_configured: dict[str, Any] | None = None


class StorageError(Exception):
    """A URL that cannot be used: its filesystem package is missing, its bucket or object does not exist, the
    credentials are refused, the store does not answer. The message is one line."""


def is_url(path: object) -> bool:
    """Whether `path` is a URL (``PROTOCOL://...``) rather than a local path."""
    return isinstance(path, str) and URL.match(path) is not None


def protocol_of(url: str) -> str:
    match = URL.match(url)
    return match.group(1).lower() if match else "file"


def configure(options: dict[str, Any] | str | None) -> None:
    """Options for every filesystem opened after this (a dict or its JSON; None: the environment's only)."""
    global _configured
    if isinstance(options, str):
        options = _parse(options, "--storage-options")
    _configured = options


def configured() -> dict[str, Any] | None:
    """What `configure` was last given (to hand to another process: ranks on Ray)."""
    return _configured


def _parse(text: str, where: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError:
        raise StorageError(f"{where} is not JSON (an object of filesystem options)") from None  # not the text
    if not isinstance(value, dict):
        raise StorageError(f"{where} must be a JSON object of filesystem options")
    return value


def options_for(protocol: str) -> dict[str, Any]:
    """The filesystem options for `protocol`: the environment's, then `configure`'s over them."""
    merged: dict[str, Any] = {}
    environment = os.environ.get(ENVIRONMENT)
    for layer in (_parse(environment, ENVIRONMENT) if environment else None, _configured):
        if not layer:
            continue
        if all(isinstance(value, dict) for value in layer.values()) and any(
            key in PACKAGES or key in EXTRAS or key == "file" for key in layer
        ):
            layer = layer.get(protocol, {})  # an object per protocol
        merged.update(layer)
    return merged


def _missing_package(protocol: str, exc: BaseException | None = None) -> StorageError:
    extra = EXTRAS.get(protocol)
    package = PACKAGES.get(protocol)
    if extra:
        fix = f"pip install 'tokenizer-service[{extra}]'"
    elif package:
        fix = f"pip install {package}"
    else:
        fix = f"install the fsspec filesystem package for {protocol}://" + (f" ({exc})" if exc else "")
    return StorageError(f"{protocol}:// URLs need {package or 'its filesystem package'}: {fix}")


def filesystem(url: str) -> tuple[Any, str]:
    """(fsspec filesystem, path inside it) of a URL; StorageError in one line if its package is missing."""
    protocol = protocol_of(url)
    try:
        import fsspec
    except ImportError:
        raise _missing_package(protocol) from None
    try:
        return fsspec.core.url_to_fs(url, **options_for(protocol))  # type: ignore[no-any-return]
    except ImportError as exc:
        raise _missing_package(protocol, exc) from None
    except ValueError as exc:
        if "Protocol not known" in str(exc):
            raise StorageError(f"{url}: no fsspec filesystem knows {protocol}://") from None
        raise StorageError(f"{url}: {exc}") from None
    except TypeError as exc:  # an option the filesystem does not take (the options themselves are never shown)
        raise StorageError(f"{protocol}:// does not take the storage options given ({_first_line(exc)})") from None


def unstrip(fs: Any, path: str) -> str:
    """The URL of a path inside `fs` (fsspec's paths have no protocol)."""
    return fs.unstrip_protocol(path)  # type: ignore[no-any-return]


def join(url: str, *parts: str) -> str:
    """`url` with path parts added (``/``-separated, whatever the local system uses)."""
    return "/".join([url.rstrip("/"), *(part.strip("/") for part in parts)])


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def describe(exc: BaseException, url: str) -> str:
    """One line for a failure of the store at `url`: missing, refused, or not answering."""
    if isinstance(exc, StorageError):
        return str(exc)
    if isinstance(exc, FileNotFoundError):
        if "bucket" in str(exc).lower() and protocol_of(url) in BUCKETED:
            bucket = URL.sub("", url).split("/", 1)[0]
            return f"{url}: no such bucket {bucket!r} (or it is not visible with these credentials)"
        return f"{url}: no such file, prefix or bucket ({_first_line(exc)})"
    if isinstance(exc, PermissionError):
        return (
            f"{url}: access denied ({_first_line(exc)}): check the credentials (for S3 the AWS environment, "
            "config files or role) and the bucket's permissions"
        )
    name = type(exc).__name__
    if name in ("NoCredentialsError", "PartialCredentialsError"):
        return f"{url}: no credentials found ({_first_line(exc)}): set them the store's standard way"
    return f"{url}: the store failed ({name}: {_first_line(exc)}); run the same command again to go on"


def check_reachable(url: str) -> None:
    """StorageError in one line unless `url`'s bucket (or container) exists and the credentials are accepted."""
    fs, path = filesystem(url)
    protocol = protocol_of(url)
    try:
        if protocol in BUCKETED:
            bucket = path.split("/", 1)[0]
            if not fs.exists(bucket):
                raise StorageError(f"{url}: no such bucket {bucket!r} (or it is not visible with these credentials)")
        else:
            fs.exists(path)
    except StorageError:
        raise
    except Exception as exc:
        raise StorageError(describe(exc, url)) from None


def cache_directory(url: str, cache_dir: str | Path, index: bytes) -> Path:
    """Where the files of the dataset at `url` are cached: a folder named by the URL and by the sha256 of its
    ``metadata.json`` (`index`), so a dataset rewritten in place gets another folder instead of stale files."""
    where = hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]
    version = hashlib.sha256(index).hexdigest()[:16]
    return Path(cache_dir).expanduser() / f"{where}-{version}"


def fetch(url: str, target: Path, size: int | None = None, fs: Any = None, path: str | None = None) -> Path:
    """`target`, downloaded from `url` unless it is already there with the right size: written under a temporary
    name beside it and renamed once complete (another process filling the same cache at once renames the same
    bytes over it), then made read-only. `size`: the size the caller knows the file must have (else the store's)."""
    if fs is None or path is None:
        fs, path = filesystem(url)
    if size is None:
        try:
            size = int(fs.info(path)["size"])
        except Exception as exc:
            raise StorageError(describe(exc, url)) from None
    try:
        if target.stat().st_size == size:
            return target
    except FileNotFoundError:
        pass
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".part", dir=target.parent)
    try:
        with os.fdopen(handle, "wb") as file, fs.open(path, "rb", block_size=1 << 23) as remote:
            while True:
                block = remote.read(1 << 23)
                if not block:
                    break
                file.write(block)
            file.flush()
            os.fsync(file.fileno())
        got = os.path.getsize(temporary)
        if got != size:
            raise StorageError(f"{url}: downloaded {got:,} bytes, expected {size:,} (the object changed?)")
        os.chmod(temporary, 0o444)
        os.replace(temporary, target)
    except StorageError:
        raise
    except Exception as exc:
        raise StorageError(describe(exc, url)) from None
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
    return target
