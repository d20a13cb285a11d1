"""What a process keeps on disk for the next one: the fast encoders' gate verdicts, the models' descriptions and the
outlines of their tokenizer.json files, each a small JSON file named by the digest of its key (the key is kept in
it, and a file whose key differs is no entry), and files such an entry names (a tokenizer.json's ranks). Written
atomically; a cache that cannot be read or written is
silently none: every entry is what a process would otherwise compute itself."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

CACHE_DIR_ENV = "TOKENIZER_CACHE_DIR"


def cache_dir() -> Path:
    """$TOKENIZER_CACHE_DIR/gate, else $XDG_CACHE_HOME (~/.cache)/tokenizer-service/gate."""
    configured = os.environ.get(CACHE_DIR_ENV)
    if configured:
        return Path(configured).expanduser() / "gate"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "tokenizer-service" / "gate"


def cache_file(key: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    return cache_dir() / f"{digest}.json"


def read(key: dict[str, Any]) -> dict[str, Any] | None:
    """The entry for exactly this key, or None (no cache, unreadable, not JSON, another key)."""
    try:
        found = json.loads(cache_file(key).read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) and found.get("key") == key else None


def write(key: dict[str, Any], value: dict[str, Any]) -> None:
    """`value` (which holds `key` under "key") as the entry for `key`, written atomically."""
    _replace(cache_file(key), json.dumps(value).encode())


def write_file(name: str, data: bytes) -> Path | None:
    """`data` as the file `name` in the cache (one an entry names: a model's ranks), written atomically; its path,
    or None where the cache cannot be written."""
    path = cache_dir() / name
    return path if _replace(path, data) else None


def _replace(path: Path, data: bytes) -> bool:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=".cached-", suffix=".tmp")
        try:
            with os.fdopen(descriptor, "wb") as file:
                file.write(data)
            os.replace(temporary, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise
    except OSError:
        return False
    return True
