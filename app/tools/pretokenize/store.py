"""The output directory: atomic writes, metadata.json, and the checks that keep runs from mixing.

What the files hold is `tokenizer_client.dataset`'s (the format, its writer and reader); this module is how they get
there. A shard's files are written under temporary names, flushed to disk and renamed; metadata.json is
rewritten the same way afterwards and is the only thing that says a shard is complete. A run killed at
any point leaves either the previous metadata.json or the new one, never a half shard that looks whole.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from tokenizer_client.dataset import METADATA_FILE, check_metadata, shard_index

TMP_SUFFIX = ".tmp"
READ_ONLY = 0o444


def _ours(name: str) -> bool:
    """A file this tool writes: a shard file or metadata.json, or one of their temporary files."""
    name = name.removesuffix(TMP_SUFFIX)
    return name == METADATA_FILE or shard_index(name) is not None


class OutputError(Exception):
    """The output directory cannot take this run: another model, other options, or foreign files."""


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # not supported here (e.g. some network filesystems): renames are still atomic
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class OutputDir:
    """Where shards and metadata.json go; writes are atomic, reads are of complete files only."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.metadata_path = path / METADATA_FILE
        self._lock: int | None = None  # the directory, open and flock'ed while this run writes it

    @property
    def where(self) -> Any:
        """The output as the user named it (a URL for `remote.StagedOutput`, whose `path` is its staging folder)."""
        return self.path

    def close(self) -> None:
        """Let another run write here (a staged output also removes its staging folder)."""
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

    def load(self) -> dict[str, Any] | None:
        """metadata.json if there is one; refuses a directory that holds anything else of its own."""
        if not self.path.exists():
            return None
        if not self.path.is_dir():
            raise OutputError(f"{self.path} exists and is not a directory")
        try:
            text = self.metadata_path.read_text(encoding="utf-8")
        except FileNotFoundError:
            foreign = sorted(entry.name for entry in self.path.iterdir() if not _ours(entry.name))
            if foreign:
                raise OutputError(
                    f"{self.path} is not empty and is not a tokenizer-pretokenize output "
                    f"(no {METADATA_FILE}; found {', '.join(foreign[:5])}); choose another --output"
                ) from None
            return None
        try:
            metadata = json.loads(text)
        except ValueError as exc:
            raise OutputError(f"{self.metadata_path} is not JSON ({exc}); choose another --output") from exc
        try:
            return check_metadata(metadata, self.metadata_path)
        except ValueError as exc:
            raise OutputError(f"{exc}; choose another --output") from exc

    def prepare(self, shards_kept: int) -> None:
        """Create the directory and hold it (one run writes an output at a time); remove temporary files and shard
        files past the complete ones."""
        self.path.mkdir(parents=True, exist_ok=True)
        self.hold()
        for entry in self.path.iterdir():
            shard = shard_index(entry.name)
            if (entry.name.endswith(TMP_SUFFIX) and _ours(entry.name)) or (shard is not None and shard >= shards_kept):
                entry.unlink()

    def hold(self) -> None:
        """An exclusive lock on the directory for as long as this run writes it: a second run on the same --output
        removed the first one's temporary files and failed as if the disk were full. OutputError if another holds
        it. (flock on the directory itself: no file is added to the output.)"""
        if self._lock is not None:
            return
        descriptor = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(descriptor)
            raise OutputError(
                f"another tokenizer-pretokenize run is writing {self.path} now: wait for it to end (then run this "
                "command again to go on from its shards), or choose another --output"
            ) from None
        except OSError:  # a filesystem without flock (some network mounts): no lock, as before
            os.close(descriptor)
            return
        self._lock = descriptor

    def discard(self, created: bool) -> None:
        """Remove what this tool wrote here (a run that produced nothing), and the directory if this run
        `created` it and it is empty now."""
        for entry in self.path.iterdir():
            if _ours(entry.name):
                entry.unlink()
        if created and not any(self.path.iterdir()):
            with contextlib.suppress(OSError):  # a mount point, say: leaving it is harmless
                self.path.rmdir()

    @contextmanager
    def writing(self, final: Path) -> Iterator[IO[bytes]]:
        """A file written under a temporary name, flushed to disk; the caller renames it with `commit`."""
        tmp = final.with_name(final.name + TMP_SUFFIX)
        with tmp.open("wb") as file:
            yield file
            file.flush()
            os.fsync(file.fileno())

    def commit(self, finals: list[Path]) -> None:
        """Rename each written temporary file to its final name; shard files become read-only (an export may
        hard-link them: editing the export in place must not change the dataset)."""
        for final in finals:
            temporary = final.with_name(final.name + TMP_SUFFIX)
            if shard_index(final.name) is not None:
                os.chmod(temporary, READ_ONLY)
            os.replace(temporary, final)
        _fsync_dir(self.path)

    def write_metadata(self, metadata: dict[str, Any]) -> None:
        with self.writing(self.metadata_path) as file:
            file.write(json.dumps(metadata, indent=1).encode() + b"\n")
        self.commit([self.metadata_path])


def identity(metadata: dict[str, Any]) -> dict[str, Any]:
    """What must be equal for two runs to write into the same output."""
    fields = {
        "model sha256": metadata["model"]["sha256"],
        "layout": metadata["layout"],
        "dtype": metadata["dtype"],
        "options": metadata["options"],
        "inputs": [[source["path"], source["size"]] for source in metadata["sources"]],
    }
    if "rank" in metadata:  # one rank of a cluster job: the same world size over the same whole input list
        fields["ranks"] = {"world_size": metadata["rank"]["world_size"], "inputs": metadata["rank"]["inputs"]}
    return fields


def differences(
    existing: dict[str, Any], wanted: dict[str, Any], theirs: str = "output has", ours: str = "this run"
) -> list[str]:
    """Human-readable list of what differs between an existing output and this run (or two ranks: `theirs`, `ours`
    say which is which)."""
    try:
        old = identity(existing)
    except (KeyError, TypeError) as exc:
        return [f"the existing metadata.json lacks {exc}"]
    new = identity(wanted)
    lines = []
    for key in new:
        if key == "options":
            for option in {**old["options"], **new["options"]}:  # an option is only written when set
                before, now = old["options"].get(option), new["options"].get(option)
                if before != now:
                    lines.append(f"option {option}: {theirs} {before!r}, {ours} {now!r}")
        elif old[key] != new[key]:
            lines.append(f"{key}: {theirs} {old[key]!r}, {ours} {new[key]!r}")
    return lines
