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

**S3 timeouts and retries** (s3://, s3a://), so that a store that is down or never answers ends a command in bounded
time: s3fs retries a failed request by itself (5 tries) around botocore's own retries (5 by default), and a request
then ran up to 25 times, each waiting out the read timeout. Here only botocore retries: the s3fs instance makes one
try (its ``retries`` = 1), and botocore's config is, where the user set none of it, ``connect_timeout`` 5 s and
``read_timeout`` 15 s (s3fs's own defaults: the longest silence tolerated inside a response, not a limit on a
transfer) and ``retries`` ``{"total_max_attempts": 3, "mode": "standard"}`` (the AWS SDKs' standard mode: connection
errors, timeouts, 5xx and throttling retried with jittered exponential backoff). One request to an endpoint that
accepts connections and never answers thus fails after at most 3 x 15 s + 3 s of backoff = 48 s; one to a port that
refuses connections, in about 3 s; one to a host that drops them, 3 x 5 s + 3 s = 18 s. A body cut short mid-transfer
is not retried (s3fs's own retry did that): the read fails with one line and the same command resumes. The user's
settings win, key by key: ``config_kwargs`` in the options (``{"config_kwargs": {"read_timeout": 60, "retries":
{"total_max_attempts": 10}}}``), and for the number of attempts and the retry mode also ``AWS_MAX_ATTEMPTS`` /
``AWS_RETRY_MODE`` and ``max_attempts`` / ``retry_mode`` in the AWS config file's profile.

Readers (``TokenDataset(URL, cache_dir=...)``) download what they read into a cache with ``fetch``: a file is
written under a temporary name in the cache and renamed once its size is checked, so processes that fill one cache at
once never see a half file, and each file is downloaded again only when it is missing or of the wrong size.

Public: ``is_url``, ``filesystem``, ``join``, ``configure``, ``StorageError``, ``describe``, ``fetch``,
``cache_directory``.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import json
import os
import re
import socket
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
S3 = ("s3", "s3a")
S3_TIMEOUTS = {"connect_timeout": 5, "read_timeout": 15}  # seconds: botocore's config unless the options set them
S3_ATTEMPTS = 3  # botocore's tries of one request (the first included), unless the options or the AWS config set it
S3_RETRY_MODE = "standard"  # unless the options or the AWS config set one
S3FS_TRIES = 1  # s3fs's own loop around each request (its `retries`): botocore's retries are the only ones

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


def _aws_retry_settings(profile: object) -> set[str]:
    """Which of ``max_attempts`` and ``retry_mode`` the AWS environment or config file (of `profile`) sets."""
    variables = {"max_attempts": "AWS_MAX_ATTEMPTS", "retry_mode": "AWS_RETRY_MODE"}
    names = {name for name, variable in variables.items() if os.environ.get(variable)}
    where = (os.environ.get("AWS_PROFILE"), os.environ.get("AWS_CONFIG_FILE"))  # what the cached answer depends on
    return names | _config_file_retry_settings(profile if isinstance(profile, str) else None, *where)


@functools.lru_cache(maxsize=16)
def _config_file_retry_settings(profile: str | None, *environment: str | None) -> frozenset[str]:
    """`_aws_retry_settings`' part from the config file (read once a process for each profile and file: 10 ms)."""
    try:
        import botocore.session

        scoped = botocore.session.Session(profile=profile).get_scoped_config()
    except Exception:  # no botocore, or a profile that is not there: s3fs says so when it starts its client
        return frozenset()
    return frozenset(name for name in ("max_attempts", "retry_mode") if scoped.get(name) is not None)


def _s3_options(options: dict[str, Any]) -> dict[str, Any]:
    """`options` with the timeouts and retries of the module's docstring added where neither they nor the AWS
    environment set them (a copy: the configured options are left as given)."""
    config = options.get("config_kwargs")
    if config is not None and not isinstance(config, dict):
        return options  # s3fs says what is wrong with it
    config = dict(config or {})
    for name, value in S3_TIMEOUTS.items():
        config.setdefault(name, value)
    retries = config.get("retries")
    if retries is None or isinstance(retries, dict):
        retries = dict(retries or {})
        aws = _aws_retry_settings(options.get("profile"))
        if not {"max_attempts", "total_max_attempts"} & retries.keys() and "max_attempts" not in aws:
            retries["total_max_attempts"] = S3_ATTEMPTS
        if "mode" not in retries and "retry_mode" not in aws:
            retries["mode"] = S3_RETRY_MODE
        if retries:
            config["retries"] = retries
    return {**options, "config_kwargs": config}


def filesystem(url: str) -> tuple[Any, str]:
    """(fsspec filesystem, path inside it) of a URL; StorageError in one line if its package is missing. For S3, the
    timeouts and retries of the module's docstring."""
    protocol = protocol_of(url)
    try:
        import fsspec
    except ImportError:
        raise _missing_package(protocol) from None
    options = options_for(protocol)
    if protocol in S3:
        options = _s3_options(options)
    try:
        fs, path = fsspec.core.url_to_fs(url, **options)
        if protocol in S3 and hasattr(fs, "retries"):
            fs.retries = S3FS_TRIES  # an attribute, not an option: set on the (cached, shared) instance every time
        return fs, path
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


def _causes(exc: BaseException) -> list[BaseException]:
    """`exc` and what it wraps: botocore's ``kwargs["error"]``, aiohttp's ``os_error``, the cause and context."""
    found: list[BaseException] = []
    pending: list[object] = [exc]
    while pending and len(found) < 16:
        item = pending.pop(0)
        if not isinstance(item, BaseException) or any(item is seen for seen in found):
            continue
        found.append(item)
        kwargs = getattr(item, "kwargs", None)
        wrapped = kwargs.get("error") if isinstance(kwargs, dict) else None
        pending += [wrapped, getattr(item, "os_error", None), item.__cause__, item.__context__]
    return found


def _names(exc: BaseException) -> set[str]:
    return {cls.__name__ for cls in type(exc).__mro__}


TIMEOUTS = {"ReadTimeoutError", "ReadTimeout", "SocketTimeoutError", "ServerTimeoutError", "FSTimeoutError"}
CLOSED = {"ConnectionClosedError", "ServerDisconnectedError"}
CONNECTING = {"EndpointConnectionError", "ClientConnectorError", "ProxyConnectionError"}
CONFIGURATION = {"ParamValidationError", "ValidationError", "ProfileNotFound", "NoRegionError", "InvalidConfigError"}


def _unreachable(exc: BaseException) -> str | None:
    """How `exc` failed to reach the store ("refuses connections", "does not answer", ...); None if it did not."""
    causes = _causes(exc)
    for cause in causes:
        if isinstance(cause, ConnectionRefusedError) or getattr(cause, "errno", None) == errno.ECONNREFUSED:
            return "refuses connections"
        if isinstance(cause, socket.gaierror) or "ClientConnectorDNSError" in _names(cause):
            return "cannot be found (its host name does not resolve)"
    for cause in causes:
        names = _names(cause)
        if names & {"ConnectTimeoutError", "ConnectionTimeoutError"}:
            return "does not accept connections (connecting timed out)"
        if names & TIMEOUTS or isinstance(cause, TimeoutError):
            return "does not answer (no reply within the read timeout)"
        if names & CLOSED:
            return "closed the connection without answering"
        if names & CONNECTING:
            return "cannot be connected to"
    return None


def _endpoint(exc: BaseException) -> str | None:
    """``scheme://host:port`` of the request that failed (from botocore's or aiohttp's error), if it says."""
    for cause in _causes(exc):
        kwargs = getattr(cause, "kwargs", None)
        value = kwargs.get("endpoint_url") if isinstance(kwargs, dict) else None
        if isinstance(value, str) and "://" in value:
            scheme, rest = value.split("://", 1)
            host = re.split(r"[/?#]", rest, maxsplit=1)[0].rpartition("@")[2]  # never a user:password@
            if host:
                return f"{scheme}://{host}"
    for cause in _causes(exc):
        host, port = getattr(cause, "host", None), getattr(cause, "port", None)
        if isinstance(host, str) and host and isinstance(port, int):
            return f"{host}:{port}"
    return None


def _configuration(exc: BaseException) -> bool:
    """Whether `exc` is an option or setting the client refused before asking the store (a rerun cannot help)."""
    names = _names(exc)
    if isinstance(exc, (ValueError, TypeError)) or names & CONFIGURATION:
        return True
    return "BotoCoreError" in names and any(name.startswith("Invalid") for name in names)


def _secrets(value: object, under: str = "") -> list[str]:
    """The string values of `value` (options) under a key naming a key, secret, token or password."""
    if isinstance(value, dict):
        return [secret for key, item in value.items() for secret in _secrets(item, str(key))]
    if isinstance(value, (list, tuple)):
        return [secret for item in value for secret in _secrets(item, under)]
    sensitive = re.search(r"key|secret|token|password|credential", under, re.IGNORECASE)
    return [value] if isinstance(value, str) and value and sensitive else []


def _summary(exc: BaseException, url: str) -> str:
    """The first line of `exc` (and the second when the first only announces it), no option's secret in it."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    text = " ".join(lines[:2]) if len(lines) > 1 and lines[0].endswith(":") else (lines[0] if lines else "")
    try:
        secrets = _secrets(options_for(protocol_of(url)))
    except StorageError:
        secrets = []
    for secret in sorted(secrets, key=len, reverse=True):
        text = text.replace(secret, "***")
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def describe(exc: BaseException, url: str) -> str:
    """One line for a failure of the store at `url`: missing, refused, not answering, or misconfigured. Only a
    failure that the same command run again can get past says so."""
    if isinstance(exc, StorageError):
        return str(exc)
    if isinstance(exc, FileNotFoundError):
        if "bucket" in str(exc).lower() and protocol_of(url) in BUCKETED:
            return _no_such_bucket(url, URL.sub("", url).split("/", 1)[0])
        return f"{url}: no such file, prefix or bucket ({_first_line(exc)})"
    if isinstance(exc, PermissionError):
        return (
            f"{url}: access denied ({_first_line(exc)}): check the credentials (for S3 the AWS environment, "
            "config files or role) and the bucket's permissions"
        )
    s3 = protocol_of(url) in S3
    how = _unreachable(exc)
    if how is not None:
        endpoint = _endpoint(exc)
        where = f"the store at {endpoint}" if endpoint else "the store"
        check = (
            "check that AWS_ENDPOINT_URL (or endpoint_url in the storage options) names the store and that it is up"
            if s3
            else "check the store's address and that it is up"
        )
        return f"{url}: {where} {how}: {check}, then run the same command again"
    name = type(exc).__name__
    if name in ("NoCredentialsError", "PartialCredentialsError"):
        return f"{url}: no credentials found ({_first_line(exc)}): set them the store's standard way"
    if _configuration(exc):
        where = "--storage-options or TOKENIZER_STORAGE_OPTIONS" + (
            " and the AWS environment and config files" if s3 else ""
        )
        return f"{url}: the storage settings are not valid ({_summary(exc, url)}): check {where}"
    return f"{url}: the store failed ({name}: {_first_line(exc)}); run the same command again to go on"


def _no_such_bucket(url: str, bucket: str) -> str:
    return f"{url}: no such bucket {bucket!r} (or it is not visible with these credentials)"


def _check_s3_bucket(fs: Any, bucket: str, url: str) -> None:
    """The bucket asked about directly (HeadBucket; GetBucketLocation, and a listing under requester-pays, for
    credentials that may not head it), so that a store that is down or silent is told apart from a missing bucket
    (s3fs's ``exists`` says False for both)."""
    probes: list[tuple[str, dict[str, Any]]] = [("head_bucket", {}), ("get_bucket_location", {})]
    if getattr(fs, "requester_pays", False):
        probes.append(("list_objects_v2", {"MaxKeys": 1}))
    refused: BaseException | None = None
    for method, extra in probes:
        try:
            fs.call_s3(method, Bucket=bucket, **extra)
            return
        except FileNotFoundError:  # 404, NoSuchBucket
            raise StorageError(_no_such_bucket(url, bucket)) from None
        except Exception as exc:
            if _unreachable(exc) is not None or _configuration(exc):
                raise  # not a question of this bucket: asking otherwise would wait as long again
            refused = refused or exc  # 403 (or a store without this call): the next probe may be allowed
    assert refused is not None
    raise refused


def check_reachable(url: str) -> None:
    """StorageError in one line unless `url`'s bucket (or container) exists and the credentials are accepted: no
    such bucket, access denied, the store refuses connections or does not answer (naming its endpoint)."""
    fs, path = filesystem(url)
    protocol = protocol_of(url)
    try:
        if protocol in S3:
            _check_s3_bucket(fs, path.split("/", 1)[0], url)
        elif protocol in BUCKETED:
            bucket = path.split("/", 1)[0]
            if not fs.exists(bucket):
                raise StorageError(_no_such_bucket(url, bucket))
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
