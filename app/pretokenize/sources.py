"""Input files of the pre-tokenizer: .jsonl and .txt, gzip or not, read as a stream that can resume mid-file.

Every document comes with the Position just after it, which is what a resumed run seeks back to; bad
records are reported with file:line and counted in the position, so a resume counts each one once.
"""

from __future__ import annotations

import gzip
import io
import zlib
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

import orjson

FORMATS = {".jsonl": "jsonl", ".txt": "txt"}
JSON_TYPES = {
    bool: "a boolean",
    int: "a number",
    float: "a number",
    type(None): "null",
    list: "an array",
    dict: "an object",
}


class InputError(Exception):
    """An input file is missing, of an unknown kind, or unreadable as a whole (e.g. a corrupt gzip stream)."""


class BadRecordError(Exception):
    """A bad record under --strict; the message is `file:line: reason`."""


@dataclass
class Source:
    """One input file and how far it has been read (the form metadata.json keeps)."""

    path: str
    size: int  # bytes on disk (compressed size for .gz)
    format: str  # "jsonl" or "txt"
    compressed: bool
    read_bytes: int = 0  # uncompressed offset where reading goes on
    lines: int = 0
    documents: int = 0
    bad_records: int = 0
    done: bool = False

    @classmethod
    def from_path(cls, path: str | Path) -> Source:
        resolved = Path(path).expanduser().resolve()
        name = resolved.name.lower()
        compressed = name.endswith(".gz")
        stem = name[:-3] if compressed else name
        suffix = next((suffix for suffix in FORMATS if stem.endswith(suffix)), None)
        if suffix is None:
            raise InputError(f"{path}: unknown input kind; expected .jsonl or .txt, optionally gzipped (.gz)")
        try:
            size = resolved.stat().st_size
        except OSError as exc:
            raise InputError(f"{path}: {exc.strerror}") from exc
        if not resolved.is_file():
            raise InputError(f"{path}: not a regular file")
        return cls(path=str(resolved), size=size, format=FORMATS[suffix], compressed=compressed)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class Position(NamedTuple):
    """Where reading stands just after one document."""

    source: int
    read_bytes: int
    lines: int
    documents: int
    bad_records: int


def source_at(source: Source, position: Position) -> Source:
    """`source` as it stood at `position` (a position inside it)."""
    return Source(
        path=source.path,
        size=source.size,
        format=source.format,
        compressed=source.compressed,
        read_bytes=position.read_bytes,
        lines=position.lines,
        documents=position.documents,
        bad_records=position.bad_records,
    )


def describe_bad_json(line: bytes, error: ValueError) -> str:
    try:
        line.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"undecodable bytes (not UTF-8) at byte {exc.start}"
    return f"invalid JSON: {error}"


def verify_compressed(path: Path) -> None:
    """Decompress a whole .gz file once, checking its CRCs, before any of its documents are used.

    gzip checks a member's CRC only at its end: read as a stream, a flipped bit would put corrupted
    documents into shards before the error surfaced. One more decompression pass costs a few percent
    of the tokenizing.
    """
    try:
        with gzip.open(path, "rb") as stream:
            while stream.read(1 << 22):
                pass
    except (OSError, EOFError, zlib.error) as exc:
        raise InputError(f"{path}: corrupt compressed data ({exc}); none of its documents were used") from exc


class DocumentReader:
    """Documents of several input files in order, from where an earlier run stopped.

    `sources` are updated as they are read (a finished one is `done`); `on_bad(message)` hears of each
    bad record (it may raise to stop). `compressed_bytes_read()` is for a progress bar.
    """

    def __init__(self, sources: list[Source], text_field: str, on_bad: Callable[[str], None]) -> None:
        self.sources = sources
        self.text_field = text_field
        self.on_bad = on_bad
        self._raw: BinaryIO | None = None
        self._done_bytes = sum(source.size for source in sources if source.done)

    def compressed_bytes_read(self) -> int:
        """Bytes of the files on disk consumed so far (compressed bytes for .gz inputs)."""
        raw = self._raw
        try:
            current = raw.tell() if raw is not None else 0
        except (ValueError, OSError):  # closed under us
            current = 0
        return self._done_bytes + current

    def __iter__(self) -> Iterator[tuple[str, Position]]:
        for index, source in enumerate(self.sources):
            if source.done:
                continue
            if source.compressed:
                verify_compressed(source.path)
            with open(source.path, "rb") as raw:
                self._raw = raw
                stream: BinaryIO = raw
                if source.compressed:
                    stream = io.BufferedReader(gzip.GzipFile(fileobj=raw, mode="rb"), buffer_size=1 << 20)
                try:
                    if source.read_bytes:
                        stream.seek(source.read_bytes)
                    parse = self._jsonl if source.format == "jsonl" else self._txt
                    yield from parse(index, source, stream)
                except (OSError, EOFError, zlib.error) as exc:
                    raise InputError(f"{source.path}: unreadable after line {source.lines}: {exc}") from exc
                finally:
                    self._raw = None
            source.done = True
            self._done_bytes += source.size

    def _bad(self, source: Source, line: int, reason: str) -> None:
        source.bad_records += 1
        self.on_bad(f"{source.path}:{line}: {reason}")

    def _jsonl(self, index: int, source: Source, stream: BinaryIO) -> Iterator[tuple[str, Position]]:
        field = self.text_field
        loads = orjson.loads
        offset, line_number = source.read_bytes, source.lines
        for line in stream:
            offset += len(line)
            line_number += 1
            if line.isspace():
                continue
            try:
                record = loads(line)
            except orjson.JSONDecodeError as exc:
                self._bad(source, line_number, describe_bad_json(line, exc))
                continue
            text = record.get(field) if type(record) is dict else None
            if type(text) is not str:
                if type(record) is not dict:
                    reason = f"{JSON_TYPES.get(type(record), 'a string')}, not a JSON object"
                elif field not in record:
                    reason = f"no field {field!r}"
                else:
                    reason = f"field {field!r} is {JSON_TYPES.get(type(text), type(text).__name__)}, not a string"
                self._bad(source, line_number, reason)
                continue
            source.documents += 1
            source.read_bytes, source.lines = offset, line_number
            yield text, Position(index, offset, line_number, source.documents, source.bad_records)
        source.read_bytes, source.lines = offset, line_number

    def _txt(self, index: int, source: Source, stream: BinaryIO) -> Iterator[tuple[str, Position]]:
        """A document is a block of lines between blank lines, without its last line break."""
        block: list[bytes] = []
        first_line = 0
        offset, line_number = source.read_bytes, source.lines
        for line in stream:
            if line.isspace():
                if block:
                    yield from self._txt_block(index, source, block, first_line, offset, line_number)
                    block = []
                offset += len(line)
                line_number += 1
                continue
            offset += len(line)
            line_number += 1
            if not block:
                first_line = line_number
            block.append(line)
        if block:
            yield from self._txt_block(index, source, block, first_line, offset, line_number)
        source.read_bytes, source.lines = offset, line_number

    def _txt_block(
        self, index: int, source: Source, block: list[bytes], first_line: int, offset: int, last_line: int
    ) -> Iterator[tuple[str, Position]]:
        data = b"".join(block)
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            line = first_line + data.count(b"\n", 0, exc.start)
            self._bad(source, line, f"undecodable bytes (not UTF-8) at byte {exc.start} of the document")
            return
        if text.endswith("\n"):
            text = text[:-2] if text.endswith("\r\n") else text[:-1]
        source.documents += 1
        source.read_bytes, source.lines = offset, last_line
        yield text, Position(index, offset, last_line, source.documents, source.bad_records)
