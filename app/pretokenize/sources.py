"""Input files of the pre-tokenizer, read as a stream that can resume mid-file.

Kinds: JSON Lines (`.jsonl`, and `.json` read as JSON Lines, as Dolma and RedPajama publish it), plain
text (`.txt`), either compressed with gzip (`.gz`) or zstandard (`.zst`), and Parquet (`.parquet`,
streamed by row group; FineWeb and WikiText publish it). A directory stands for every such file below
it, sorted by path.

Every document comes with the Position just after it, which is what a resumed run seeks back to; bad
records are reported with file:line (file:row for Parquet) and counted in the position, so a resume
counts each one once. For Parquet the position's `lines` and `read_bytes` count rows.
"""

from __future__ import annotations

import gzip
import importlib
import io
import zlib
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

import orjson

FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".txt": "txt", ".parquet": "parquet"}
COMPRESSIONS = (".gz", ".zst")
KINDS = ".jsonl, .json, .txt (each optionally .gz or .zst) or .parquet"
CORPORA_EXTRA = "pip install 'tokenizer-service[corpora]'"
PARQUET_BATCH_ROWS = 1024
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
        suffix, compression = kind_of(resolved.name)
        if suffix is None:
            raise InputError(f"{path}: unknown input kind; expected {KINDS}, or a directory of them")
        compressed = compression is not None
        try:
            size = resolved.stat().st_size
        except OSError as exc:
            raise InputError(f"{path}: {exc.strerror}") from exc
        if not resolved.is_file():
            raise InputError(f"{path}: not a regular file")
        return cls(path=str(resolved), size=size, format=FORMATS[suffix], compressed=compressed)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def codec(self) -> str | None:
        """ "gzip", "zstd" or None, from the file name."""
        return kind_of(self.path)[1]


def kind_of(name: str) -> tuple[str | None, str | None]:
    """(format suffix, compression) of a file name; (None, None) for a kind the pre-tokenizer cannot read."""
    lowered = name.lower()
    compression = next((codec for codec in COMPRESSIONS if lowered.endswith(codec)), None)
    stem = lowered[: -len(compression)] if compression else lowered
    suffix = next((suffix for suffix in FORMATS if stem.endswith(suffix)), None)
    if suffix == ".parquet" and compression:  # Parquet compresses inside
        return None, None
    return suffix, {".gz": "gzip", ".zst": "zstd", None: None}[compression]


def expand_inputs(paths: list[str] | list[Path]) -> list[Path]:
    """The input files: each file as given, each directory as every readable file below it, sorted."""
    files: list[Path] = []
    for path in paths:
        path = Path(path).expanduser()
        if path.is_dir():
            found = sorted(item for item in path.rglob("*") if item.is_file() and kind_of(item.name)[0])
            if not found:
                raise InputError(f"{path}: a directory with no input file in it ({KINDS})")
            files.extend(found)
        else:
            files.append(path)
    return files


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


def verify_compressed(path: str | Path) -> None:
    """Decompress a whole compressed file once, checking its checksums, before any of its documents are used.

    gzip checks a member's CRC only at its end (zstandard a frame's checksum, when it has one): read as
    a stream, a flipped bit would put corrupted documents into shards before the error surfaced. One
    more decompression pass costs a few percent of the tokenizing.
    """
    try:
        with open(path, "rb") as raw:
            stream = decompressed(raw, kind_of(str(path))[1])
            while stream.read(1 << 22):
                pass
    except (OSError, EOFError, zlib.error, ValueError) as exc:
        raise InputError(f"{path}: corrupt compressed data ({exc}); none of its documents were used") from exc


def decompressed(raw: BinaryIO, codec: str | None, skip: int = 0) -> BinaryIO:
    """A readable stream of `raw`'s decompressed bytes, from uncompressed offset `skip`."""
    if codec == "zstd":  # a zstd stream only seeks forward, and not once buffered: seek first
        zstandard = _import("zstandard", "reading .zst")
        reader = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)
        if skip:
            reader.seek(skip)
        return io.BufferedReader(reader, buffer_size=1 << 20)  # type: ignore[no-any-return]
    stream = raw
    if codec == "gzip":
        stream = io.BufferedReader(gzip.GzipFile(fileobj=raw, mode="rb"), buffer_size=1 << 20)  # type: ignore[arg-type]
    if skip:
        stream.seek(skip)
    return stream


def _import(module: str, purpose: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError:
        raise InputError(f"{purpose} needs {module}: {CORPORA_EXTRA}") from None


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
                try:
                    if source.format == "parquet":
                        yield from self._parquet(index, source, raw)
                    else:
                        stream = decompressed(raw, source.codec, source.read_bytes)
                        parse = self._jsonl if source.format == "jsonl" else self._txt
                        yield from parse(index, source, stream)
                except (OSError, EOFError, zlib.error) as exc:
                    raise InputError(f"{source.path}: unreadable after line {source.lines}: {exc}") from exc
                finally:
                    self._raw = None
            source.done = True
            self._done_bytes += source.size

    def _parquet(self, index: int, source: Source, raw: BinaryIO) -> Iterator[tuple[str, Position]]:
        """Rows of one column, a row group at a time; a position is a row number (in `lines`)."""
        parquet = _import("pyarrow.parquet", "reading .parquet")
        try:
            file = parquet.ParquetFile(raw)
        except Exception as exc:  # pyarrow raises ArrowInvalid and others for a file that is not Parquet
            raise InputError(f"{source.path}: not a Parquet file ({exc})") from exc
        field = self.text_field
        if field not in file.schema_arrow.names:
            names = ", ".join(file.schema_arrow.names)
            raise InputError(f"{source.path}: no column {field!r} (columns: {names}); name it with --text-field")
        row = first_row = 0
        groups = []
        for group in range(file.metadata.num_row_groups):
            rows = file.metadata.row_group(group).num_rows
            if row + rows > source.lines:
                groups.append(group)
            else:
                first_row = row + rows
            row += rows
        row = first_row
        for batch in file.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[field], row_groups=groups):
            for value in batch.column(0).to_pylist():
                row += 1
                if row <= source.lines:
                    continue  # before the resume point, inside its row group
                if type(value) is not str:
                    described = JSON_TYPES.get(type(value), type(value).__name__)
                    self._bad(source, row, f"column {field!r} is {described}, not a string")
                    source.read_bytes = source.lines = row
                    continue
                source.documents += 1
                source.read_bytes = source.lines = row
                yield value, Position(index, row, row, source.documents, source.bad_records)

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
                    fields = ", ".join(repr(key) for key in list(record)[:8]) or "none"
                    reason = f"no field {field!r} (its fields: {fields}; choose one with --text-field)"
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
