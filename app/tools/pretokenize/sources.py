"""Input files of the pre-tokenizer, read as a stream that can resume mid-file.

Kinds: JSON Lines (`.jsonl`, and `.json` read as JSON Lines, as Dolma and RedPajama publish it), plain
text (`.txt`), either compressed with gzip (`.gz`) or zstandard (`.zst`), and Parquet (`.parquet`,
streamed by row group; FineWeb and WikiText publish it). A directory stands for every such file below
it, sorted by path.

What a document is (`DocumentReader`'s `kind`): a text (the string in --text-field), a conversation (--conversations:
the list of OpenAI messages in --text-field, default ``messages``; ShareGPT's ``conversations`` of ``from``/``value``
messages mapped to ``role``/``content``), or a prompt-completion record (--prompt-completion: ``prompt`` and
``completion`` strings). A record whose conversation is malformed (no role, content of the wrong type, a ShareGPT
``from`` that names no role) is a bad record like a text field that is not a string.

Every document comes with the Position just after it, which is what a resumed run seeks back to; bad
records are reported with file:line (file:row for Parquet) and counted in the position, so a resume
counts each one once. For Parquet the position's `lines` counts rows (where a resumed run goes on) and
`read_bytes` the bytes of the file up to the end of the row group being read.
"""

from __future__ import annotations

import gzip
import importlib
import io
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

import numpy as np
import orjson

from tokenizer_client.dataset import FORMAT_NAME, METADATA_FILE
from tokenizer_client.storage import StorageError, filesystem, is_url
from tokenizer_client.storage import describe as describe_storage_error

FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".txt": "txt", ".parquet": "parquet"}
COMPRESSIONS = (".gz", ".zst")
KINDS = ".jsonl, .json, .txt (each optionally .gz or .zst) or .parquet"
CORPORA_EXTRA = "pip install 'tokenizer-service[corpora]'"
PARQUET_BATCH_ROWS = 1024
PARQUET_MAGIC = b"PAR1"
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


class InputRefused(InputError):
    """An input named on the command line cannot be used at all (missing, not a file, of an unknown kind): a
    usage mistake, refused before anything is read."""


class NoTextError(InputError):
    """No text where --text-field says: a Parquet file without that column, or a corpus of bad records only."""


class BadRecordError(Exception):
    """A bad record under --strict; the message is `file:line: reason`."""


TEXT, CONVERSATIONS, PROMPT_COMPLETION = "text", "conversations", "prompt_completion"
DOCUMENT_KINDS = (TEXT, CONVERSATIONS, PROMPT_COMPLETION)
DEFAULT_FIELDS = {TEXT: "text", CONVERSATIONS: "messages", PROMPT_COMPLETION: None}
SHAREGPT_FIELD = "conversations"  # ShareGPT's field, read when the default field (messages) is absent
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
    "system": "system",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
}


def from_sharegpt(message: Any, position: int) -> Any:
    """A ShareGPT message (``from``/``value``) as an OpenAI one (``role``/``content``); others as they are. A
    ``weight`` (axolotl's 0/1 on a turn) becomes ``train`` on an assistant turn and is dropped on the others."""
    if type(message) is not dict or "role" in message or "from" not in message:
        return message
    speaker = message["from"]
    role = SHAREGPT_ROLES.get(speaker) if type(speaker) is str else None
    if role is None:
        known = ", ".join(sorted(SHAREGPT_ROLES))
        raise ValueError(f"messages[{position}]: 'from' {speaker!r} is not a ShareGPT role ({known})")
    mapped = {key: value for key, value in message.items() if key not in ("from", "value", "weight")}
    mapped["role"], mapped["content"] = role, message.get("value")
    weight = message.get("weight")
    if weight is not None and (type(weight) is not int or weight not in (0, 1)):  # 0.5, 2, "0": no turn's weight
        raise ValueError(f"messages[{position}]: 'weight' {weight!r} is not 0 or 1 (axolotl's: train the turn or not)")
    if role == "assistant" and weight is not None:
        mapped["train"] = bool(weight)
    return mapped


def check_messages(messages: list[Any]) -> list[Any]:
    """The conversation as the service takes it (ShareGPT mapped), or ValueError saying what is wrong with it."""
    from tokenizer_service.core.chat import check_conversation
    from tokenizer_service.core.errors import InvalidField, PayloadTooLarge

    mapped = [from_sharegpt(message, position) for position, message in enumerate(messages)]
    try:
        check_conversation(mapped, 0)
    except (InvalidField, PayloadTooLarge) as exc:
        raise ValueError(record_reason(exc.message)) from None
    return mapped


def record_reason(message: str) -> str:
    """A refusal that names `conversations[i]` or `records[i]` (the service's words), as said of one record."""
    for prefix in ("conversations[", "records["):
        if message.startswith(prefix):
            rest = message[message.index("]") + 1 :]
            return rest.removeprefix(".").removeprefix(": ").lstrip() or message
    return message


def document_of(record: Any, kind: str, field: str, default_field: bool) -> Any:
    """What one record holds for `kind` (a text, a conversation, a prompt-completion record), or ValueError with
    the reason it is a bad record. `default_field`: --text-field was not given (ShareGPT's field is read when
    the default one is absent)."""
    if type(record) is not dict:
        raise ValueError(f"{JSON_TYPES.get(type(record), 'a string')}, not a JSON object")
    if kind == PROMPT_COMPLETION:
        values = {name: record.get(name) for name in ("prompt", "completion")}
        for name, value in values.items():
            if type(value) is not str:
                what = "missing" if name not in record else JSON_TYPES.get(type(value), type(value).__name__)
                fields = ", ".join(repr(key) for key in list(record)[:8]) or "none"
                raise ValueError(
                    f"field {name!r} is {what}, not a string (a prompt-completion record has prompt and completion "
                    f"strings; its fields: {fields})"
                )
        return values
    if field not in record and default_field and kind == CONVERSATIONS and SHAREGPT_FIELD in record:
        field = SHAREGPT_FIELD
    if field not in record:
        fields = ", ".join(repr(key) for key in list(record)[:8]) or "none"
        raise ValueError(f"no field {field!r} (its fields: {fields}; choose one with --text-field)")
    value = record.get(field)
    if kind == TEXT:
        if type(value) is not str:
            raise ValueError(f"field {field!r} is {JSON_TYPES.get(type(value), type(value).__name__)}, not a string")
        return value
    if type(value) is not list:
        what = JSON_TYPES.get(type(value), type(value).__name__) if type(value) is not str else "a string"
        raise ValueError(f"field {field!r} is {what}, not an array of messages (a conversation)")
    return check_messages(value)


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
        if is_url(path):
            return cls._from_url(str(path))
        resolved = Path(path).expanduser().resolve()
        try:
            size = resolved.stat().st_size
        except FileNotFoundError:
            raise InputRefused(f"{path}: no such file or directory") from None
        except OSError as exc:
            raise InputRefused(f"{path}: {exc.strerror}") from exc
        if not resolved.is_file():
            raise InputRefused(f"{path}: not a regular file")
        suffix, compression = kind_of(resolved.name)
        if suffix is None:
            raise InputRefused(f"{path}: unknown input kind; expected {KINDS}, or a directory of them")
        compressed = compression is not None
        return cls(path=str(resolved), size=size, format=FORMATS[suffix], compressed=compressed)

    @classmethod
    def _from_url(cls, url: str) -> Source:
        """An object in a store (or any fsspec URL): its size from the store; the path kept as its URL."""
        fs, path = filesystem(url)
        try:
            info = fs.info(path)
        except FileNotFoundError:
            raise InputRefused(f"{url}: no such file or directory") from None
        except Exception as exc:
            raise InputRefused(describe_storage_error(exc, url)) from None
        if info.get("type") != "file":
            raise InputRefused(f"{url}: not a file")
        suffix, compression = kind_of(path)
        if suffix is None:
            raise InputRefused(f"{url}: unknown input kind; expected {KINDS}, or a prefix of them")
        return cls(
            path=fs.unstrip_protocol(path), size=int(info["size"]), format=FORMATS[suffix], compressed=bool(compression)
        )

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


UTF8_BOM = b"\xef\xbb\xbf"


def expand_inputs(
    paths: list[str] | list[Path], warn: Callable[[str], None] | None = None, output: Path | str | None = None
) -> list[Path]:
    """The input files: each file as given, each directory as every readable file below it, sorted; below a
    directory, never a file of `output` (the run's own) nor of any dataset or rank the pre-tokenizer wrote there
    (a directory whose metadata.json is of its format) nor of a litdata export (a directory whose index.json is
    litdata's): their metadata.json and index.json are no corpus.

    A file reached twice (a symlink and its target, a file named and inside a directory named) is read once,
    at its first place, and `warn` hears of each repeat."""
    files: list[Path] = []
    own = None if output is None or is_url(output) else Path(output).expanduser().resolve()
    for path in paths:
        if is_url(path):
            files.extend(expand_url(str(path)))  # type: ignore[arg-type]  # URLs stay strings
            continue
        path = Path(path).expanduser()
        if path.is_dir():
            outputs = _outputs_below(path, own)
            found = sorted(
                item
                for item in path.rglob("*")
                if item.is_file()
                and kind_of(item.name)[0]
                and not any(item.resolve().is_relative_to(place) for place in outputs)
            )
            if not found:
                raise InputRefused(f"{path}: a directory with no input file in it ({KINDS})")
            files.extend(found)
        elif not path.exists():
            raise InputRefused(f"{path}: no such file or directory")
        else:
            files.append(path)
    first: dict[Path, Path] = {}
    unique = []
    for file in files:
        resolved = file if isinstance(file, str) else file.resolve()  # a URL is its own identity
        if resolved in first:
            if warn is not None:
                warn(f"{file}: the same file as {first[resolved]} (a link or a repeat): read once")
            continue
        first[resolved] = file
        unique.append(file)
    return unique


# litdata's index of a dataset (what `tokenizer-shards export --to litdata` writes, and litdata's own `optimize`):
# a JSON object of `chunks` and `config`, beside chunk files. Its name reads as a JSON (Lines) input, each of its
# lines a bad record.
LITDATA_INDEX = "index.json"


def _outputs_below(directory: Path, own: Path | None) -> list[Path]:
    """The run's own output (`own`) and every output of ours below `directory` (resolved paths): a pre-tokenizer
    dataset or rank (a directory whose metadata.json is of its format) and a litdata dataset (a directory whose
    index.json has litdata's `chunks` and `config`: an export's). The other exports (megatron, nanogpt, llm.c)
    write only `.bin` and `.idx` files, which are no input kind."""
    found = [] if own is None else [own]
    for name in OUTPUT_MARKERS:
        found.extend(file.parent.resolve() for file in directory.rglob(name) if _marks_an_output(name, file.read_bytes))
    return found


def _is_pretokenized(metadata: dict[str, Any]) -> bool:
    return metadata.get("format") == FORMAT_NAME


def _is_litdata_index(index: dict[str, Any]) -> bool:
    return isinstance(index.get("chunks"), list) and isinstance(index.get("config"), dict)


# the file that marks its directory as an output of ours, and what its JSON holds then
OUTPUT_MARKERS: dict[str, Callable[[dict[str, Any]], bool]] = {
    METADATA_FILE: _is_pretokenized,
    LITDATA_INDEX: _is_litdata_index,
}


def _marks_an_output(name: str, read: Callable[[], bytes]) -> bool:
    """Whether a file named `name` whose bytes `read` gives marks its directory as an output of ours."""
    ours = OUTPUT_MARKERS.get(name)
    if ours is None:
        return False
    try:
        document = orjson.loads(read())
    except (OSError, orjson.JSONDecodeError):
        return False
    return isinstance(document, dict) and ours(document)


def expand_url(url: str) -> list[str]:
    """The input URLs a URL stands for: an object; a prefix (a "directory") as every readable object under it,
    sorted by key, as a local directory; a glob (``*``, ``?``, ``[``) as the readable objects it matches, sorted.
    InputRefused in one line for a missing bucket, a missing object or prefix, refused credentials, a prefix or glob
    with no input file."""
    try:
        fs, path = filesystem(url)
        fs.invalidate_cache()  # list what is there now, not what an earlier listing in this process saw
        if any(char in path for char in "*?["):
            found = sorted(item for item in fs.glob(path) if kind_of(item)[0] and fs.isfile(item))
            if not found:
                raise InputRefused(f"{url}: matches no input file ({KINDS})")
            return [fs.unstrip_protocol(item) for item in found]
        try:
            # one request that fails as the store does (isfile swallows every error into False, and a store that
            # does not answer was then asked a second time, by find)
            if fs.info(path).get("type") == "file":
                return [fs.unstrip_protocol(path)]
        except FileNotFoundError:
            found = []
        else:
            found = _inputs_of_listing(fs, sorted(fs.find(path)))
    except InputRefused:
        raise
    except StorageError as exc:
        raise InputRefused(str(exc)) from None
    except Exception as exc:
        raise InputRefused(describe_storage_error(exc, url)) from None
    if not found:
        _check_bucket(url)
        if not fs.exists(path):
            raise InputRefused(f"{url}: no such file or directory")
        raise InputRefused(f"{url}: a prefix with no input file under it ({KINDS})")
    return [fs.unstrip_protocol(item) for item in found]


def _inputs_of_listing(fs: Any, keys: list[str]) -> list[str]:
    """The input files among the `keys` listed under a prefix, less those inside an output of ours stored there (a
    pre-tokenizer dataset or a litdata export, told by their metadata.json or index.json, as `_outputs_below`)."""
    outputs = []
    for key in keys:
        name = key.rsplit("/", 1)[-1]
        if _marks_an_output(name, lambda key=key: fs.cat_file(key)):
            outputs.append(key[: -len(name)])  # the directory, with its trailing slash
    return [key for key in keys if kind_of(key)[0] and not any(key.startswith(place) for place in outputs)]


def _check_bucket(url: str) -> None:
    from tokenizer_client.storage import check_reachable

    try:
        check_reachable(url)
    except StorageError as exc:
        raise InputRefused(str(exc)) from None


def open_input(path: str | Path) -> BinaryIO:
    """An input opened for reading bytes: a local file, or a URL's object streamed by its fsspec filesystem (ranged
    reads ahead of the reader; seeks are ranged requests, so a resumed run does not read what it skips)."""
    if not is_url(path):
        return open(path, "rb")
    fs, inner = filesystem(str(path))
    try:
        return fs.open(inner, "rb", block_size=READ_BLOCK)  # type: ignore[no-any-return]
    except FileNotFoundError:
        raise InputError(f"{path}: no such file (it was there when the run started)") from None
    except Exception as exc:
        raise InputError(describe_storage_error(exc, str(path))) from None


READ_BLOCK = 8 << 20  # bytes a ranged read of a URL's object asks for at once
STORE_ERRORS = ("botocore", "aiobotocore", "aiohttp", "s3fs", "gcsfs", "fsspec", "google", "huggingface_hub")


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


ZSTD_HEADER_MAX = 18  # bytes of a zstd frame header, at most
VERIFY_READ = 1 << 16  # compressed bytes per step: text expands 3-10x


def verify_compressed(path: str | Path) -> str | None:
    """Decompress a whole compressed file once, checking its checksums, before any of its documents are used;
    returns a note when the check is weaker than it looks (zstd frames without a content checksum).

    gzip checks a member's CRC only at its end (zstandard a frame's checksum, when it has one): read as
    a stream, a flipped bit would put corrupted documents into shards before the error surfaced, and a
    zstd stream cut short simply ends. One more decompression pass costs a few percent of the tokenizing.
    """
    codec = kind_of(str(path))[1]
    try:
        with open_input(path) as raw:
            if codec == "zstd":
                return _verify_zstd(path, raw)
            stream = decompressed(raw, codec)
            while stream.read(1 << 22):
                pass
    except (OSError, EOFError, zlib.error, ValueError) as exc:
        raise InputError(f"{path}: corrupt compressed data ({exc}); none of its documents were used") from exc
    except Exception as exc:
        if type(exc).__name__ != "ZstdError":
            raise
        what = "not zstd data" if "Unknown frame descriptor" in str(exc) else f"corrupt zstd data ({exc})"
        raise InputError(f"{path}: {what}; none of its documents were used") from exc
    return None


def _verify_zstd(path: str | Path, raw: BinaryIO) -> str | None:
    """Every frame decompressed to its end (a frame cut short is an error, which a stream reader does not
    raise), its checksum checked where the frame has one; a note when a frame has none."""
    zstandard = _import("zstandard", "reading .zst")
    context = zstandard.ZstdDecompressor()
    frame = None
    unchecked = 0
    buffer = b""
    while True:
        if not buffer:
            buffer = raw.read(VERIFY_READ)
            if not buffer:
                break
        if frame is None:
            while len(buffer) < ZSTD_HEADER_MAX:  # the next frame's header, whole
                more = raw.read(VERIFY_READ)
                if not more:
                    break
                buffer += more
            if not zstandard.get_frame_parameters(buffer).has_checksum:
                unchecked += 1
            frame = context.decompressobj()
        frame.decompress(buffer)
        buffer = b""
        if frame.eof:
            buffer, frame = frame.unused_data, None
    if frame is not None:
        raise InputError(
            f"{path}: truncated zstd data (its last frame ends before its end: the file was cut short); "
            "none of its documents were used"
        )
    if unchecked:
        return (
            f"{path}: {unchecked} zstd frame{'s' if unchecked > 1 else ''} without a content checksum: a cut file is "
            "detected, a flipped bit may not be (zstd --check, the zstd tool's default, writes checksums)"
        )
    return None


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
    if codec is None and not isinstance(stream, io.BufferedIOBase):
        # a URL's object (an fsspec file): its readline takes a copy of up to READ_BLOCK bytes from its cache for
        # each line (24 MB of JSON Lines from a loopback S3 server: 15x slower than through this buffer)
        stream = io.BufferedReader(stream, buffer_size=1 << 20)  # type: ignore[arg-type]
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

    def __init__(
        self,
        sources: list[Source],
        text_field: str,
        on_bad: Callable[[str], None],
        warn: Callable[[str], None] | None = None,
        kind: str = TEXT,
        utf8: bool = False,
    ) -> None:
        """`utf8`: a Parquet text column's documents come as their UTF-8 bytes (memoryviews of Arrow's buffers,
        checked to be UTF-8), never decoded here: what the local pool sends on as `Utf8Texts`."""
        self.sources = sources
        self.utf8 = utf8
        self.text_field = text_field
        self.kind = kind
        self.default_field = text_field == DEFAULT_FIELDS[kind]
        self.on_bad = on_bad
        self.warn = warn
        self.fields: Counter[str] = Counter()  # fields of the records that lacked the text field
        self.records_without_field = 0
        self._unchecked_said = False
        self.current: Source | None = None  # the input being read
        self._index = 0  # its index in `sources`
        self.bad_at: tuple[int, int] | None = None  # (source index, line or row) of the last bad record, as said
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

    def __iter__(self) -> Iterator[tuple[Any, Position]]:
        for index, source in enumerate(self.sources):
            if source.done:
                continue
            self.current, self._index = source, index
            if source.compressed:
                note = verify_compressed(source.path)
                if note and self.warn is not None and not self._unchecked_said:
                    self.warn(note + " (said once a run)")
                    self._unchecked_said = True
            with open_input(source.path) as raw:
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
                except Exception as exc:  # zstandard.ZstdError: the file changed since it was verified
                    if is_url(source.path) and type(exc).__module__.split(".")[0] in STORE_ERRORS:
                        # the store stayed down past its client's retries (botocore's errors are not OSErrors)
                        raise InputError(describe_storage_error(exc, source.path)) from exc
                    if type(exc).__name__ != "ZstdError":
                        raise
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
        columns = parquet_columns(source.path, file.schema_arrow.names, self.text_field, self.kind)
        row = first_row = 0
        groups = []
        group_ends = []  # (last row, bytes of the file up to the end of the row group)
        done_bytes = len(PARQUET_MAGIC)
        for group in range(file.metadata.num_row_groups):
            meta = file.metadata.row_group(group)
            rows = meta.num_rows
            done_bytes += sum(meta.column(column).total_compressed_size for column in range(meta.num_columns))
            if row + rows > source.lines:
                groups.append(group)
                group_ends.append((row + rows, done_bytes))
            else:
                first_row = row + rows
            row += rows
        row = first_row
        ends = iter(group_ends)
        group_end, group_bytes = next(ends, (0, 0))
        for batch in file.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=columns, row_groups=groups):
            if self.kind == TEXT:
                values = text_values(batch.column(0), self.utf8)
            else:  # a record of the columns, read as a JSON record is
                rows = zip(*(column.to_pylist() for column in batch.columns), strict=True)
                values = [dict(zip(columns, row, strict=True)) for row in rows]
            for value in values:
                row += 1
                if row > group_end:
                    group_end, group_bytes = next(ends, (row, group_bytes))
                if row <= source.lines:
                    continue  # before the resume point, inside its row group
                # read_bytes: bytes of the file up to the end of the row group being read (for progress);
                # the position is the row, in `lines`
                source.read_bytes, source.lines = group_bytes, row
                if self.kind != TEXT:
                    try:
                        value = document_of(value, self.kind, columns[0], False)
                    except ValueError as exc:
                        self._bad(source, row, str(exc))
                        continue
                elif isinstance(value, UnicodeDecodeError):
                    self._bad(source, row, f"column {columns[0]!r} is not valid UTF-8 (its byte {value.start})")
                    continue
                elif type(value) is not str and type(value) is not memoryview:
                    described = JSON_TYPES.get(type(value), type(value).__name__)
                    self._bad(source, row, f"column {columns[0]!r} is {described}, not a string")
                    continue
                source.documents += 1
                yield value, Position(index, group_bytes, row, source.documents, source.bad_records)

    def _bad(self, source: Source, line: int, reason: str) -> None:
        source.bad_records += 1
        self.bad_at = (self._index, line)
        self.on_bad(f"{source.path}:{line}: {reason}")

    def _jsonl(self, index: int, source: Source, stream: BinaryIO) -> Iterator[tuple[Any, Position]]:
        field = self.text_field
        loads = orjson.loads
        offset, line_number = source.read_bytes, source.lines
        for line in stream:
            offset += len(line)
            line_number += 1
            if line_number == 1 and line.startswith(UTF8_BOM):  # a file saved "UTF-8 with BOM": the BOM is no text
                line = line[len(UTF8_BOM) :]
            if line.isspace():
                continue
            try:
                record = loads(line)
            except orjson.JSONDecodeError as exc:
                self._bad(source, line_number, describe_bad_json(line, exc))
                continue
            if self.kind != TEXT:
                try:
                    text = document_of(record, self.kind, field, self.default_field)
                except ValueError as exc:
                    if type(record) is dict and self.kind == CONVERSATIONS and field not in record:
                        self.records_without_field += 1
                        self.fields.update(list(record)[:32])
                    self._bad(source, line_number, str(exc))
                    continue
                source.documents += 1
                source.read_bytes, source.lines = offset, line_number
                yield text, Position(index, offset, line_number, source.documents, source.bad_records)
                continue
            text = record.get(field) if type(record) is dict else None
            if type(text) is not str:
                if type(record) is not dict:
                    reason = f"{JSON_TYPES.get(type(record), 'a string')}, not a JSON object"
                elif field not in record:
                    self.records_without_field += 1
                    self.fields.update(list(record)[:32])
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
            if line_number == 0 and line.startswith(UTF8_BOM):  # a file saved "UTF-8 with BOM": the BOM is no text
                offset += len(UTF8_BOM)
                line = line[len(UTF8_BOM) :]
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


PEEK_CHARS = 60


def text_column(column: Any) -> Any:
    """A Parquet column of text stored another way (dictionary-encoded, as bytes, as views) as the string column of
    its values, their UTF-8 unchecked (`text_values` checks it); any other column as it is."""
    import pyarrow as pa

    if pa.types.is_dictionary(column.type):
        column = column.dictionary_decode()
    views = {
        getattr(pa, name)(): cast
        for name, cast in (("binary_view", pa.large_binary()), ("string_view", pa.large_string()))
        if hasattr(pa, name)
    }
    if column.type in views:
        column = column.cast(views[column.type])
    if column.type in (pa.binary(), pa.large_binary()):  # text stored as bytes: read as UTF-8, each value checked
        column = column.view(pa.string() if column.type == pa.binary() else pa.large_string())
    return column


def text_values(column: Any, utf8: bool) -> list[Any]:
    """A Parquet text column's values: each a str (with `utf8`: a memoryview of its UTF-8, never decoded), None for
    a null, and for a value that is not UTF-8 the UnicodeDecodeError saying where; a binary column is read so too
    (text stored as bytes); a column of another type: its Python values (refused one by one)."""
    import pyarrow as pa

    column = text_column(column)
    if column.type not in (pa.string(), pa.large_string()):
        return column.to_pylist()
    try:
        column.validate(full=True)  # Arrow's own UTF-8 check of the whole batch
        valid = True
    except pa.ArrowInvalid:
        valid = False
    if valid and not utf8:
        return column.to_pylist()
    _validity, offsets_buffer, data_buffer = column.buffers()
    width = np.int64 if column.type == pa.large_string() else np.int32
    count = len(column)
    bounds = np.frombuffer(offsets_buffer, dtype=width)[column.offset : column.offset + count + 1].tolist()
    data = memoryview(data_buffer) if data_buffer is not None else memoryview(b"")
    present = column.is_valid().to_pylist() if column.null_count else None
    views = [data[bounds[i] : bounds[i + 1]] if present is None or present[i] else None for i in range(count)]
    if valid:
        return views
    values: list[Any] = []
    for view in views:
        try:
            text = None if view is None else str(view, "utf-8")
        except UnicodeDecodeError as exc:
            values.append(exc)
            continue
        values.append(view if utf8 else text)
    return values


def _describe_value(value: Any) -> str:
    if type(value) is str:
        preview = value[:PEEK_CHARS] + ("…" if len(value) > PEEK_CHARS else "")
        return f"a string of {len(value):,} characters: {preview!r}"
    return JSON_TYPES.get(type(value), type(value).__name__)


def _suggest(fields: dict[str, Any], text_field: str) -> str:
    """Which --text-field to pass, from a first record's fields."""
    if type(fields.get(text_field)) is str:
        return f"--text-field {text_field} holds a string: ready to pre-tokenize"
    strings = [name for name, value in fields.items() if type(value) is str]
    if not strings:
        return f"no string field in the first record: --text-field {text_field} would make every record bad"
    longest = max(strings, key=lambda name: len(fields[name]))
    why = "missing" if text_field not in fields else _describe_value(fields[text_field])
    return f"--text-field {text_field} is {why} here: pass --text-field {longest} (the longest string in it)"


def parquet_columns(path: str, names: list[str], text_field: str, kind: str) -> list[str]:
    """The columns of a Parquet file (its column `names`) that hold what `kind` reads; NoTextError naming the
    one it lacks."""
    if kind == PROMPT_COMPLETION:
        columns = ["prompt", "completion"]
    elif (
        text_field not in names
        and text_field == DEFAULT_FIELDS[kind]
        and kind == CONVERSATIONS
        and SHAREGPT_FIELD in names
    ):
        columns = [SHAREGPT_FIELD]
    else:
        columns = [text_field]
    if any(column not in names for column in columns):
        missing = next(column for column in columns if column not in names)
        listed = ", ".join(names)
        fix = "" if kind == PROMPT_COMPLETION else "; name it with --text-field"
        raise NoTextError(f"{path}: no column {missing!r} (columns: {listed}){fix}")
    return columns


def check_first_parquet(sources: list[Source], text_field: str, kind: str) -> None:
    """Read the schema of the first Parquet input (its footer only) and refuse now, before a model is loaded,
    one without the column to read: the one-line error a misnamed --text-field gets at once."""
    first = next((source for source in sources if source.format == "parquet"), None)
    if first is not None:
        parquet_columns(first.path, _parquet_file(first).schema_arrow.names, text_field, kind)


def _parquet_file(source: Source) -> Any:
    parquet = _import("pyarrow.parquet", "reading .parquet")
    try:
        return parquet.ParquetFile(open_input(source.path) if is_url(source.path) else source.path)
    except Exception as exc:  # pyarrow raises ArrowInvalid and others for a file that is not Parquet
        raise InputError(f"{source.path}: not a Parquet file ({exc})") from exc


def first_record(source: Source) -> dict[str, Any] | str | None:
    """The first record of an input: a dict of fields (JSON Lines, Parquet), the first document (plain text),
    None for an empty input; InputError if the first record is not a JSON object."""
    if source.format == "parquet":
        first = next(_parquet_file(source).iter_batches(batch_size=1), None)
        if first is None:
            return None
        return {name: _first_value(column) for name, column in zip(first.schema.names, first.columns, strict=True)}
    with open_input(source.path) as raw:
        stream = decompressed(raw, source.codec)
        if source.format == "txt":
            block: list[bytes] = []
            for line in stream:
                if line.isspace():
                    if block:
                        break
                    continue
                block.append(line)
            return b"".join(block).decode("utf-8", "replace").rstrip("\r\n") if block else None
        for number, line in enumerate(stream, start=1):
            if number == 1 and line.startswith(UTF8_BOM):
                line = line[len(UTF8_BOM) :]
            if line.isspace():
                continue
            try:
                parsed = orjson.loads(line)
            except orjson.JSONDecodeError as exc:
                raise InputError(f"{source.path}:{number}: {describe_bad_json(line, exc)}") from None
            if type(parsed) is not dict:
                raise InputError(f"{source.path}:{number}: {_describe_value(parsed)}, not a JSON object")
            return parsed  # type: ignore[no-any-return]
    return None


def _first_value(column: Any) -> Any:
    """A Parquet column's first value as the pre-tokenizer reads it: text stored as bytes (or dictionary-encoded,
    or as views) as a str where it is UTF-8."""
    values = text_values(column, utf8=False) if len(column) else [None]
    value = values[0]
    return column.to_pylist()[0] if isinstance(value, UnicodeDecodeError) else value


def holds_text(path: str | Path, text_field: str, kind: str = TEXT) -> bool:
    """Whether an input's first record has `text_field` as a string (a plain-text input always does; with
    another `kind`, a good conversation or prompt-completion record); False for an input that cannot be read."""
    try:
        record = first_record(Source.from_path(path))
    except Exception:  # any unreadable input: it is no evidence that the text field is right
        return False
    if kind != TEXT:
        try:
            document_of(record, kind, text_field, text_field == DEFAULT_FIELDS[kind])
        except ValueError:
            return False
        return True
    return isinstance(record, str) or (isinstance(record, dict) and type(record.get(text_field)) is str)


def describe_document(record: Any, kind: str, text_field: str) -> tuple[str, Any]:
    """A line on what the first record holds for --conversations or --prompt-completion, and that document
    (None where the record is bad for it)."""
    flag = "--conversations" if kind == CONVERSATIONS else "--prompt-completion"
    try:
        document = document_of(record, kind, text_field, text_field == DEFAULT_FIELDS[kind])
    except ValueError as exc:
        return f"{flag}: the first record is a bad record: {exc}", None
    if kind == PROMPT_COMPLETION:
        return (
            f"{flag}: a prompt of {len(document['prompt']):,} and a completion of {len(document['completion']):,} "
            "characters (ready to pre-tokenize)",
            document,
        )
    sharegpt = isinstance(record, dict) and text_field not in record
    where = f"{SHAREGPT_FIELD!r} (ShareGPT: from/value mapped to role/content)" if sharegpt else repr(text_field)
    roles = ", ".join(message["role"] for message in document[:12]) + (", ..." if len(document) > 12 else "")
    line = f"{flag}: {where} holds a conversation of {len(document)} messages ({roles}); ready to pre-tokenize"
    return line, document


def peek(path: str | Path, text_field: str, kind: str = TEXT, found: list[Any] | None = None) -> list[str]:
    """Lines that describe an input without reading it all: the kind detected and the first record's fields and
    types (Parquet: the columns), and which --text-field to pass. With another `kind`, what the first record holds
    for it (the document is appended to `found` for the caller to render)."""
    files = expand_inputs([path])
    lines = []
    if (len(files) != 1 or str(files[0]) != str(path)) if is_url(path) else Path(path).expanduser().is_dir():
        kinds = Counter(kind_of(str(file).rsplit("/", 1)[-1])[0] for file in files)
        listed = ", ".join(f"{count:,} {kind}" for kind, count in kinds.most_common())
        lines.append(f"{path}: a directory of {len(files):,} input files ({listed}); the first:")
    source = Source.from_path(files[0])
    codec = f", {source.codec}-compressed" if source.codec else ""
    if source.format == "parquet":
        file = _parquet_file(source)
        meta = file.metadata
        columns = ", ".join(f"{field.name} ({field.type})" for field in file.schema_arrow)
        lines.append(
            f"{source.path}: Parquet, {meta.num_rows:,} rows in {meta.num_row_groups:,} row groups; columns: {columns}"
        )
    elif source.format == "txt":
        lines.append(f"{source.path}: plain text{codec}, a document per block of lines between blank lines")
    else:
        lines.append(f"{source.path}: JSON Lines{codec}, a JSON object a line")
    record = first_record(source)
    if record is None:
        lines.append("  no record in it")
    elif isinstance(record, str):
        lines.append(f"  first document: {_describe_value(record)}")
    else:
        lines.append("  first record:")
        lines += [f"    {name!r}: {_describe_value(value)}" for name, value in record.items()]
        if kind == TEXT:
            lines.append(f"  {_suggest(record, text_field)}")
        else:
            line, document = describe_document(record, kind, text_field)
            lines.append(f"  {line}")
            if document is not None and found is not None:
                found.append(document)
    return lines
