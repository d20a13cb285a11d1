"""Pre-tokenized shards: the on-disk format ``tokenizer-pretokenize`` writes, its writer and its reader.

This docstring is the one description of the format and this module its one implementation: the constants,
``write_shard`` (one shard's files, byte for byte), ``read_shard`` and ``TokenDataset`` (reading them back),
``check_metadata``; ``write_dataset`` (a whole output of ids tokenized elsewhere, for tests and benchmarks).
``tokenizer_service.tools.pretokenize`` decides what goes into which shard, has ``write_shard`` write it under
temporary names, and keeps ``metadata.json``. Everything is little-endian.

An output directory holds::

    metadata.json          what the shards are; rewritten atomically after each complete shard
    00000.bin  00000.idx   shard 0 (00000.seg too with --seq-len; 00000.mask too with loss masks)
    00001.bin  ...         shard 1, ...

Only shards listed in ``metadata.json`` are complete: shard files are written under a temporary name and
renamed before ``metadata.json`` names them, so a killed run never leaves a half shard that looks whole.

``NNNNN.bin``: token ids, no header. ``metadata.json["dtype"]`` is ``"<u2"`` (uint16) when the vocabulary
has at most 65,536 pieces, else ``"<u4"``; a reader refuses any other (``check_metadata``). Ragged output:
each document's ids, document after document.
Packed output (``--seq-len L``): ``rows x L`` ids in C order.

``NNNNN.idx``: a 32-byte header, then ``count + 1`` int64 offsets starting at 0:

    ======  ====  =====================================================================
    offset  size  field
    ======  ====  =====================================================================
    0       8     magic ``b"TKSHARD\\0"``
    8       2     format version, uint16 (1)
    10      1     layout: 0 ragged, 1 packed
    11      1     bytes per id in ``.bin`` (2 or 4)
    12      4     seq_len, uint32 (0 for ragged)
    16      8     count, int64: documents (ragged) or rows (packed)
    24      8     ids in ``.bin``, int64
    32      8n+8  offsets, int64
    ======  ====  =====================================================================

Ragged: document ``i`` is ``bin[offsets[i]:offsets[i + 1]]``.

``NNNNN.mask`` (format version 2, outputs with loss masks: conversations, prompt-completion records): one
uint8 a stored id, aligned with ``.bin`` (the same count, no header), 1 where the loss is taken (the
assistant's output), 0 elsewhere; packed, 0 on padding too. Packed rows' ``labels`` are -100 wherever it is 0.
Packed: the offsets index ``NNNNN.seg`` (int32, no header): row ``r``'s ``seg[offsets[r]:offsets[r + 1]]``
is ``[0, end of segment 1, ..., end of last segment]``, the ``cu_seqlens`` of ``/v1/pack``. A segment is a
document, or the piece of one, inside the row. From it: ``position_ids`` count from 0 in each segment;
ids after the last boundary are padding (``best_fit`` only; ``concat`` rows are full), where ``labels``
are -100 and ``position_ids`` 0; elsewhere ``labels`` equal the ids.

``metadata.json``: ``format`` (``"tokenizer-shards"``), ``version``, ``complete``, ``layout``
(``"ragged"``/``"packed"``), ``dtype``, ``seq_len``, ``strategy``, ``model`` (name, sha256, vocab_size,
bos/eos/pad ids), ``options``, ``shards`` (each: name; documents read into it; tokens, the ids in its
``.bin``; rows; padding ids), ``documents``, ``tokens`` (of all documents, padding not counted), ``rows``,
``bad_records``, ``sources`` (each input file and how far it was read) and ``leftover`` (concat only:
``ids``, the last ids that did not fill a row, and ``document_starts``, where documents begin in them;
``loss_mask``, their mask, in a masked output).

Versions: ``metadata.json["version"]`` is 1 for an output without masks (exactly the first format, which
every reader reads) and 2 for one with them: ``loss_mask`` then says where they come from (``input``:
``"conversations"`` or ``"prompt_completion"``; ``train_on``; ``parse_special_tokens``; ``chat_template``:
its ``sha256``, ``source``, ``loss_mask`` and ``text``, the template as given, so that ``tokenizer-shards
verify --sample`` renders the conversations again), and every shard has its ``.mask``. A reader of version 1
only refuses a version 2 output instead of reading its ids without their masks. The ``.idx`` header's
version stays 1: its layout did not change.

Reading shard 0 with plain numpy::

    import json, numpy as np
    meta = json.load(open("out/metadata.json"))
    ids = np.memmap("out/00000.bin", dtype=meta["dtype"], mode="r")
    offsets = np.memmap("out/00000.idx", dtype="<i8", mode="r", offset=32)
    document_3 = ids[offsets[3] : offsets[4]]                  # ragged
    rows = ids.reshape(-1, meta["seq_len"])                     # packed
    seg = np.fromfile("out/00000.seg", dtype="<i4")
    cu_seqlens_of_row_3 = seg[offsets[3] : offsets[4]]          # packed

Or ``TokenDataset("out")``: ``ds[i]`` (a document, or a packed row's ids), ``ds.row(i)``,
``ds.sequences(L)``, ``ds.torch()``. Arrays are read-only views of the memory map; nothing is copied
except a sequence that spans two shards. Needs numpy only; ``torch()`` imports torch when called.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import json
import operator
import os
import re
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, NamedTuple

import numpy as np
import numpy.typing as npt

from tokenizer_client.packing import IGNORE_INDEX, pack_best_fit, pack_concat
from tokenizer_client.storage import is_url

if TYPE_CHECKING:
    import torch

__all__ = [
    "BIN_SUFFIX",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "IDX_HEADER",
    "IDX_MAGIC",
    "IDX_SUFFIX",
    "IGNORE_INDEX",
    "LAYOUT_PACKED",
    "LAYOUT_RAGGED",
    "MASK_DTYPE",
    "MASK_SUFFIX",
    "METADATA_FILE",
    "OFFSET_DTYPE",
    "SEG_DTYPE",
    "SEG_SUFFIX",
    "SHARD_SUFFIXES",
    "IndexHeader",
    "PackedRow",
    "Shard",
    "TokenDataset",
    "check_metadata",
    "check_shard",
    "format_version",
    "id_dtype",
    "index_header",
    "read_index_header",
    "read_shard",
    "shard_index",
    "shard_name",
    "write_dataset",
    "write_shard",
]

FORMAT_NAME = "tokenizer-shards"
FORMAT_VERSION = 2  # the newest; an output without masks is written as version 1 (`format_version`)
FORMAT_VERSIONS = (1, 2)  # what this reader reads
IDX_VERSION = 1  # the .idx header's own version: unchanged by masks
METADATA_FILE = "metadata.json"
BIN_SUFFIX = ".bin"
IDX_SUFFIX = ".idx"
SEG_SUFFIX = ".seg"
MASK_SUFFIX = ".mask"
SHARD_SUFFIXES = (BIN_SUFFIX, IDX_SUFFIX, SEG_SUFFIX, MASK_SUFFIX)
MASK_DTYPE = np.dtype("u1")
IDX_MAGIC = b"TKSHARD\0"
IDX_HEADER = struct.Struct("<8sHBBIqq")
LAYOUT_RAGGED = 0
LAYOUT_PACKED = 1
LAYOUTS = {"ragged": LAYOUT_RAGGED, "packed": LAYOUT_PACKED}
OFFSET_DTYPE = np.dtype("<i8")
ID_DTYPES = ("<u2", "<u4")  # metadata.json's dtype: the only two a dataset may name
SEG_DTYPE = np.dtype("<i4")

_SHARDS_OPEN = 64  # memory maps kept open at once; each holds file descriptors


def shard_name(index: int) -> str:
    return f"{index:05d}"


_SHARD_FILE = re.compile(rf"([0-9]{{5,}})({'|'.join(map(re.escape, SHARD_SUFFIXES))})")


def shard_index(file_name: str) -> int | None:
    """The shard a file such as ``00012.idx`` belongs to; None for any other name."""
    match = _SHARD_FILE.fullmatch(file_name)
    return int(match[1]) if match else None


def id_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits, else uint32; little-endian either way."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


class IndexHeader(NamedTuple):
    layout: int
    itemsize: int
    seq_len: int
    items: int  # documents (ragged) or rows (packed)
    num_ids: int


def index_header(header: IndexHeader) -> bytes:
    """The 32 bytes that open an ``.idx`` file."""
    return IDX_HEADER.pack(IDX_MAGIC, IDX_VERSION, *header)


def format_version(masked: bool) -> int:
    """metadata.json's version: 2 for an output with loss masks, else 1 (what readers of version 1 read)."""
    return 2 if masked else 1


def is_masked(meta: Mapping[str, Any]) -> bool:
    """Whether an output's shards carry loss masks (``.mask`` files)."""
    return bool(meta.get("loss_mask"))


def check_metadata(meta: Any, where: str | Path) -> dict[str, Any]:
    """`meta` (a parsed ``metadata.json``) if it is of this format and version; ValueError naming `where` if not."""
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise ValueError(f"{where}: format is not {FORMAT_NAME!r}")
    if meta.get("version") not in FORMAT_VERSIONS:
        known = " and ".join(map(str, FORMAT_VERSIONS))
        raise ValueError(f"{where}: format version {meta.get('version')}, this reader knows {known}")
    if meta.get("loss_mask") is not None and (meta["version"] < 2 or not isinstance(meta["loss_mask"], dict)):
        raise ValueError(f"{where}: loss_mask in a version {meta['version']} output (masks are version 2)")
    if meta.get("layout") not in LAYOUTS:
        raise ValueError(f"{where}: unknown layout {meta.get('layout')!r}")
    if meta.get("dtype") not in ID_DTYPES:  # another would read the ids as something else (float16, byte-swapped)
        raise ValueError(
            f"{where}: dtype {meta.get('dtype')!r} is not one this format stores: "
            f"{' or '.join(map(repr, ID_DTYPES))} (little-endian uint16 or uint32 ids)"
        )
    if meta["layout"] == "packed" and not isinstance(meta.get("seq_len"), int):
        raise ValueError(f"{where}: packed output without an integer seq_len")
    model = meta.get("model")
    if not isinstance(model, dict) or type(model.get("vocab_size")) is not int:
        raise ValueError(f"{where}: model is not an object with an integer vocab_size")
    shards = meta.get("shards")
    counted = ("rows",) if meta["layout"] == "packed" else ("documents", "tokens")
    if not isinstance(shards, list) or not all(
        isinstance(shard, dict)
        and isinstance(shard.get("name"), str)
        and all(type(shard.get(key)) is int and shard[key] >= 0 for key in counted)
        for shard in shards
    ):
        raise ValueError(
            f"{where}: shards is not a list of objects each with a name and its {' and '.join(counted)} (integers)"
        )
    return meta


def read_index_header(raw: bytes, where: str) -> IndexHeader:
    if len(raw) < IDX_HEADER.size:
        raise ValueError(f"{where}: {len(raw)} bytes is shorter than the {IDX_HEADER.size}-byte index header")
    magic, version, *fields = IDX_HEADER.unpack_from(raw)
    if magic != IDX_MAGIC:
        raise ValueError(f"{where}: bad magic {magic!r}, expected {IDX_MAGIC!r}; not a tokenizer shard index")
    if version != IDX_VERSION:
        raise ValueError(f"{where}: shard format version {version}, this reader knows {IDX_VERSION}")
    return IndexHeader(*fields)


def _map(path: Path, dtype: np.dtype, offset: int = 0) -> np.ndarray:
    """Read-only memory map of a whole file from `offset` (an empty file cannot be mapped)."""
    if path.stat().st_size <= offset:
        return np.zeros(0, dtype)
    # a plain ndarray over the map: slices of an np.memmap are np.memmap too, several times slower to make
    return np.memmap(path, dtype=dtype, mode="r", offset=offset).view(np.ndarray)


@dataclass(frozen=True, eq=False)
class Shard:
    """One shard's arrays, memory-mapped: ``ids`` (flat), ``offsets``, packed ``seg``, masked ``mask``."""

    ids: np.ndarray
    offsets: np.ndarray
    seg: np.ndarray | None
    mask: np.ndarray | None = None  # uint8 0/1 aligned with ids (outputs with loss masks)


Opener = Callable[[Path], AbstractContextManager[IO[bytes]]]


def _create(path: Path) -> IO[bytes]:
    return path.open("wb")


def write_shard(
    base: Path,
    ids: np.ndarray | Sequence[np.ndarray],
    offsets: np.ndarray,
    seg: np.ndarray | None = None,
    *,
    dtype: np.dtype,
    seq_len: int = 0,
    opener: Opener = _create,
    mask: np.ndarray | None = None,
) -> list[Path]:
    """Write one shard's files, `base` plus each suffix; returns their paths (``.bin``, ``.idx``, packed ``.seg``,
    with `mask` ``.mask``: one 0/1 an id).

    Ragged: `ids` are the documents end to end (one array, or consecutive parts of it, written one after the
    other: no copy of the whole), `offsets` where each starts. Packed (`seg` given): `ids` are rows of `seq_len`,
    `offsets` index `seg`, each row's segment boundaries. `opener(path)` opens a file for writing; the
    pre-tokenizer's writes a temporary file and renames it once the shard is whole.
    """
    parts = [ids] if isinstance(ids, np.ndarray) else list(ids)
    size = sum(part.size for part in parts)
    offsets = np.asarray(offsets)
    count = len(offsets) - 1
    if offsets.ndim != 1 or count < 0 or offsets[0] != 0:
        raise ValueError("offsets must be count + 1 values starting at 0")
    end = int(offsets[-1])
    if seg is None and (seq_len or end != size):
        raise ValueError(f"ragged shard: seq_len {seq_len} (must be 0), offsets end at {end} of {size} ids")
    if seg is not None and (seq_len < 1 or size != count * seq_len or end != seg.size):
        raise ValueError(
            f"packed shard: {size} ids for {count} rows of {seq_len}, offsets end at {end} of {seg.size} boundaries"
        )
    if mask is not None and (mask.shape != (size,) or (mask.size and int(mask.max()) > 1)):
        raise ValueError(f"mask: {mask.shape} values (0/1), the shard holds {size} ids")
    layout = LAYOUT_RAGGED if seg is None else LAYOUT_PACKED
    header = IndexHeader(layout, dtype.itemsize, seq_len, count, size)
    files = [base.with_suffix(BIN_SUFFIX), base.with_suffix(IDX_SUFFIX)]
    with opener(files[0]) as file:
        for part in parts:
            file.write(np.ascontiguousarray(part, dtype).data)
    with opener(files[1]) as file:
        file.write(index_header(header))
        file.write(np.ascontiguousarray(offsets, OFFSET_DTYPE).data)
    if seg is not None:
        files.append(base.with_suffix(SEG_SUFFIX))
        with opener(files[-1]) as file:
            file.write(np.ascontiguousarray(seg, SEG_DTYPE).data)
    if mask is not None:
        files.append(base.with_suffix(MASK_SUFFIX))
        with opener(files[-1]) as file:
            file.write(np.ascontiguousarray(mask, MASK_DTYPE).data)
    return files


def _shard_bounds(offsets: np.ndarray, shard_documents: int | None, shard_tokens: int | None) -> list[int]:
    """The first document of each shard, then the number of documents."""
    count = offsets.size - 1
    bounds = [0]
    while bounds[-1] < count:
        first = bounds[-1]
        if shard_documents is not None:
            last = first + shard_documents
        elif shard_tokens is not None:  # closes with the document that brings it to shard_tokens ids
            last = int(np.searchsorted(offsets[1:], offsets[first] + shard_tokens)) + 1
        else:
            last = count
        bounds.append(min(last, count))
    return bounds


def write_dataset(
    path: str | Path,
    ids: npt.ArrayLike,
    offsets: npt.ArrayLike,
    *,
    model: Mapping[str, Any],
    seq_len: int | None = None,
    strategy: str = "concat",
    shard_documents: int | None = None,
    shard_tokens: int | None = None,
    dtype: np.dtype | None = None,
    loss_mask: npt.ArrayLike | None = None,
    loss_mask_source: Mapping[str, Any] | None = None,
) -> TokenDataset:
    """Write documents tokenized elsewhere as a complete output in `path` (new or empty); ``TokenDataset(path)``.

    `ids` are the documents end to end, `offsets` their ``count + 1`` starts from 0. A shard holds
    `shard_documents` documents, or closes with the document that brings it to `shard_tokens` ids (the
    pre-tokenizer's ``--shard-tokens``); with neither, one shard. With `seq_len` each shard's documents are
    packed into rows: ``best_fit`` pads with the model's pad id (else EOS, else 0); ``concat`` leaves out the
    ids after a shard's last full row (the pre-tokenizer carries them into the next shard instead). `model`
    is ``metadata.json``'s (name, sha256, vocab_size, bos_id, eos_id, pad_id); `dtype` defaults to
    ``id_dtype(vocab_size)``. metadata.json has the pre-tokenizer's keys; ``options`` says how shards were cut.
    `loss_mask` (one 0/1 an id, aligned with `ids`) makes a version 2 output with ``.mask`` files;
    `loss_mask_source` is what its metadata.json's ``loss_mask`` says of it (default ``{"input": "external"}``).
    """
    path = Path(path)
    ids = np.asarray(ids)
    offsets = np.asarray(offsets, np.int64)
    if offsets.ndim != 1 or offsets.size < 1 or offsets[0] != 0 or (np.diff(offsets) < 0).any():
        raise ValueError("offsets must be count + 1 non-decreasing values starting at 0")
    if ids.ndim != 1 or int(offsets[-1]) != ids.size:
        raise ValueError(f"offsets end at {int(offsets[-1])}, the documents hold {ids.size} ids")
    if shard_documents is not None and shard_tokens is not None:
        raise ValueError("give shard_documents or shard_tokens, not both")
    if any(size is not None and size < 1 for size in (shard_documents, shard_tokens, seq_len)):
        raise ValueError("shard_documents, shard_tokens and seq_len must be at least 1")
    if seq_len is not None and strategy not in ("concat", "best_fit"):
        raise ValueError(f"strategy must be 'concat' or 'best_fit', got {strategy!r}")
    mask = None
    if loss_mask is not None:
        mask = np.asarray(loss_mask)
        if mask.shape != ids.shape or (mask.size and (int(mask.min()) < 0 or int(mask.max()) > 1)):
            raise ValueError(f"loss_mask must hold one 0/1 per id ({ids.size}), got shape {mask.shape}")
        mask = mask.astype(MASK_DTYPE)
    dtype = id_dtype(int(model["vocab_size"])) if dtype is None else np.dtype(dtype)
    pad_id = next((int(i) for i in (model.get("pad_id"), model.get("eos_id")) if i is not None and i >= 0), 0)
    path.mkdir(parents=True, exist_ok=True)
    if any(path.iterdir()):
        raise ValueError(f"{path} is not empty")
    bounds = _shard_bounds(offsets, shard_documents, shard_tokens)
    shards: list[dict[str, Any]] = []
    for first, last in itertools.pairwise(bounds):
        name = shard_name(len(shards))
        start = int(offsets[first])
        chunk, chunk_offsets = ids[start : offsets[last]], offsets[first : last + 1] - start
        chunk_mask = None if mask is None else mask[start : offsets[last]]
        if seq_len is None:
            write_shard(path / name, chunk, chunk_offsets, dtype=dtype, mask=chunk_mask)
            shards.append({"name": name, "tokens": int(chunk.size), "documents": last - first})
            continue
        if strategy == "concat":
            rows = pack_concat(chunk, chunk_offsets, seq_len, loss_mask=chunk_mask)
        else:
            rows = pack_best_fit(chunk, chunk_offsets, seq_len, pad_id=pad_id, loss_mask=chunk_mask)
        flat = rows.input_ids.reshape(-1)
        row_mask = None if chunk_mask is None else (rows.labels.reshape(-1) != IGNORE_INDEX).astype(MASK_DTYPE)
        write_shard(
            path / name, flat, rows.cu_seqlens_offsets, rows.cu_seqlens, dtype=dtype, seq_len=seq_len, mask=row_mask
        )
        record = {"documents": last - first, "rows": rows.num_rows, "padding": rows.stats.padding_tokens}
        shards.append({"name": name, "tokens": int(flat.size), **record})
    meta: dict[str, Any] = {
        "format": FORMAT_NAME,
        "version": format_version(mask is not None),
        "complete": True,
        "layout": "ragged" if seq_len is None else "packed",
        "dtype": dtype.str,
        "seq_len": seq_len,
        "strategy": None if seq_len is None else strategy,
        "model": dict(model),
        "options": {
            "seq_len": seq_len,
            "strategy": None if seq_len is None else strategy,
            "shard_documents": shard_documents,
            "shard_tokens": shard_tokens,
        },
        "documents": int(offsets.size - 1),
        "tokens": sum(shard["tokens"] - shard.get("padding", 0) for shard in shards),  # padding not counted
        "bad_records": 0,
        "shards": shards,
        "sources": [],
    }
    if seq_len is not None:
        meta["rows"] = sum(shard["rows"] for shard in shards)
    if mask is not None:
        meta["loss_mask"] = dict(loss_mask_source or {"input": "external"})
    (path / METADATA_FILE).write_text(json.dumps(meta), encoding="utf-8")
    return TokenDataset(path)


def shard_file_sizes(count: int, num_ids: int, dtype: np.dtype, layout: str, masked: bool) -> dict[str, int | None]:
    """A shard's files by suffix, with the size in bytes its metadata.json record implies (`count` documents or
    rows, `num_ids` ids): None for the packed layout's .seg file, whose size its index's last offset says."""
    sizes: dict[str, int | None] = {
        IDX_SUFFIX: IDX_HEADER.size + (count + 1) * OFFSET_DTYPE.itemsize,
        BIN_SUFFIX: num_ids * dtype.itemsize,
    }
    if layout == "packed":
        sizes[SEG_SUFFIX] = None
    if masked:
        sizes[MASK_SUFFIX] = num_ids * MASK_DTYPE.itemsize
    return sizes


def read_shard(base: Path, dtype: np.dtype, expected: IndexHeader, masked: bool = False) -> Shard:
    """Memory-map one shard's files, ``base`` plus each suffix (`masked`: its ``.mask`` too); ValueError unless
    they are what `expected` says."""
    idx_path = base.with_suffix(IDX_SUFFIX)
    with idx_path.open("rb") as file:
        header = read_index_header(file.read(IDX_HEADER.size), str(idx_path))
    if header != expected:
        raise ValueError(f"{idx_path}: header {header} does not match metadata.json {expected}")
    count, num_ids = expected.items, expected.num_ids
    size = idx_path.stat().st_size
    if size != IDX_HEADER.size + (count + 1) * OFFSET_DTYPE.itemsize:
        raise ValueError(f"{idx_path}: {size} bytes, expected {count + 1} offsets after the header")
    offsets = _map(idx_path, OFFSET_DTYPE, IDX_HEADER.size)
    ids = _map(base.with_suffix(BIN_SUFFIX), dtype)
    if ids.size != num_ids:
        raise ValueError(f"{base.with_suffix(BIN_SUFFIX)}: {ids.size} ids, the index says {num_ids}")
    seg = None
    if expected.layout == LAYOUT_PACKED:
        seg = _map(base.with_suffix(SEG_SUFFIX), SEG_DTYPE)
        if seg.size != int(offsets[-1]):
            raise ValueError(f"{base.with_suffix(SEG_SUFFIX)}: {seg.size} entries, the index says {offsets[-1]}")
    elif int(offsets[-1]) != num_ids:
        raise ValueError(f"{idx_path}: offsets end at {offsets[-1]}, the shard holds {num_ids} ids")
    mask = None
    if masked:
        mask_path = base.with_suffix(MASK_SUFFIX)
        if not mask_path.exists():
            raise ValueError(f"{mask_path}: missing; metadata.json says the shards carry loss masks")
        mask = _map(mask_path, MASK_DTYPE)
        if mask.size != num_ids:
            raise ValueError(f"{mask_path}: {mask.size} mask values, the shard holds {num_ids} ids")
    return Shard(ids=ids, offsets=offsets, seg=seg, mask=mask)


def check_shard(shard: Shard, vocab_size: int, seq_len: int, base: Path) -> None:
    """ValueError naming the file (`base` plus its suffix) unless the shard's contents are consistent: offsets
    start at 0, never decrease and end at the data's size; every id is below `vocab_size`; packed, each row's
    boundaries start at 0 and rise to at most `seq_len`. Vectorized: one pass over the ids, one over the
    offsets (and boundaries).

    ``read_shard`` checks only sizes (cheap, at every open); this reads every byte, as verify and export do.
    """
    offsets = shard.offsets
    idx, data, seg_file = (base.with_suffix(suffix) for suffix in (IDX_SUFFIX, BIN_SUFFIX, SEG_SUFFIX))
    if len(offsets) and int(offsets[0]) != 0:
        raise ValueError(f"{idx}: offsets start at {int(offsets[0])}, not 0 (a corrupt index)")
    steps = np.diff(offsets)
    if steps.size and int(steps.min()) < 0:
        at = int(np.argmax(steps < 0))
        raise ValueError(
            f"{idx}: offset {at + 1} ({int(offsets[at + 1])}) is below offset {at} ({int(offsets[at])}); "
            "the index is corrupt"
        )
    end = shard.seg.size if shard.seg is not None else shard.ids.size
    if len(offsets) and int(offsets[-1]) != end:
        raise ValueError(f"{idx}: offsets end at {int(offsets[-1])}, the data holds {end}")
    if shard.ids.size:
        top = int(shard.ids.max())
        if top >= vocab_size:
            at = int(np.argmax(shard.ids >= vocab_size))
            raise ValueError(f"{data}: id {top} at position {at} is not below the vocabulary size {vocab_size}")
    if shard.mask is not None and shard.mask.size and int(shard.mask.max()) > 1:
        at = int(np.argmax(shard.mask > 1))
        raise ValueError(f"{base.with_suffix(MASK_SUFFIX)}: value {int(shard.mask[at])} at position {at} is not 0 or 1")
    seg = shard.seg
    if seg is None or not seg.size:
        return
    starts = offsets[:-1][steps > 0]
    if int(np.abs(seg[starts]).max()) != 0 or (steps == 0).any():
        raise ValueError(f"{seg_file}: a row's segment boundaries do not start at 0 (a corrupt .seg)")
    rising = np.diff(seg) > 0
    rising[starts[1:] - 1] = True  # a row's first boundary follows the previous row's last
    if not rising.all() or int(seg.max()) > seq_len:
        raise ValueError(
            f"{seg_file}: segment boundaries that do not rise within a row up to {seq_len} (a corrupt .seg)"
        )


@dataclass(frozen=True, eq=False)
class PackedRow:
    """One training row with what a varlen attention kernel needs (as /v1/pack returns it)."""

    input_ids: np.ndarray
    labels: np.ndarray
    position_ids: np.ndarray
    cu_seqlens: np.ndarray


def row_tensors(input_ids: np.ndarray, cu_seqlens: np.ndarray, mask: np.ndarray | None = None) -> PackedRow:
    """Labels and position ids of one packed row, rebuilt from its segment boundaries (labels -100 on padding
    and, with a loss `mask`, wherever it is 0)."""
    seq_len = input_ids.shape[0]
    bounds = cu_seqlens.astype(np.int64)
    used = int(bounds[-1])
    starts = bounds[:-1]
    positions = np.zeros(seq_len, np.int32)
    positions[:used] = np.arange(used) - np.repeat(starts, np.diff(bounds))
    labels = input_ids.astype(np.int32)
    labels[used:] = IGNORE_INDEX
    if mask is not None:
        labels[mask == 0] = IGNORE_INDEX
    return PackedRow(input_ids=input_ids, labels=labels, position_ids=positions, cu_seqlens=cu_seqlens)


class TokenDataset:
    """Memory-mapped view of a ``tokenizer-pretokenize`` output directory.

    ``len(ds)`` and ``ds[i]`` are documents for ragged output and rows for packed output. Pickles by
    path, so it can be handed to DataLoader worker processes, which map the files again.
    """

    def __init__(self, path: str | Path, *, allow_partial: bool = False, cache_dir: str | Path | None = None) -> None:
        self.url: str | None = None  # a dataset in object storage (any fsspec URL), read through `cache_dir`
        self.cache_dir = None if cache_dir is None else Path(cache_dir).expanduser()
        if is_url(path):
            self.url = str(path).rstrip("/")
            self.path = self._fetch_index()
        else:
            self.path = Path(path)
        self.allow_partial = allow_partial
        self.metadata = self._read_metadata()
        meta = self.metadata
        self.layout: str = meta["layout"]
        self.dtype = np.dtype(meta["dtype"])
        self.seq_len: int | None = meta["seq_len"]
        self._row_len = self.seq_len or 0
        self.strategy: str | None = meta["strategy"]
        self.model: dict[str, Any] = meta["model"]
        self.vocab_size: int = int(self.model["vocab_size"])
        self.masked: bool = is_masked(meta)  # shards carry loss masks (.mask): conversations, prompt-completion
        shards = meta["shards"]
        self._names = [shard["name"] for shard in shards]
        counts = [int(shard["rows"] if self.layout == "packed" else shard["documents"]) for shard in shards]
        sizes = [
            int(shard["rows"]) * self._row_len if self.layout == "packed" else int(shard["tokens"]) for shard in shards
        ]
        self._count_starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        self._id_starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
        self._count_bounds: list[int] = self._count_starts.tolist()  # bisect on a list beats numpy for one value
        self._open: OrderedDict[int, Shard] = OrderedDict()

    def _fetch_index(self) -> Path:
        """The URL's metadata.json, read from the store every time (it says what the shards are), into its folder of
        the cache (named by the URL and the sha256 of that metadata.json); the shards are fetched as they are read."""
        from tokenizer_client import storage

        url = str(self.url)
        if self.cache_dir is None:
            raise ValueError(
                f"{url} is a URL: give TokenDataset({url!r}, cache_dir=DIR), a local directory the shards it reads "
                "are downloaded to (and reused from)"
            )
        fs, root = storage.filesystem(url)
        try:
            index = fs.cat_file(f"{root.rstrip('/')}/{METADATA_FILE}")
        except FileNotFoundError:
            storage.check_reachable(url)
            ranked = fs.glob(f"{root.rstrip('/')}/rank-*/{METADATA_FILE}")
            if ranked:
                raise ValueError(
                    f"{url} is a ranked output (rank-RRRRR prefixes, no {METADATA_FILE} over them yet): run "
                    f"tokenizer-shards merge {url} first"
                ) from None
            raise ValueError(f"{url} holds no {METADATA_FILE}: not a tokenizer-pretokenize output") from None
        except Exception as exc:
            raise storage.StorageError(storage.describe(exc, url)) from None
        folder = storage.cache_directory(url, self.cache_dir, index)
        target = folder / METADATA_FILE
        if not target.exists():  # written whole under a temporary name, then renamed: other processes see all or none
            folder.mkdir(parents=True, exist_ok=True)
            temporary = folder / f".{METADATA_FILE}.{os.getpid()}.{threading.get_ident()}.part"
            temporary.write_bytes(index)
            os.replace(temporary, target)
        self._store = (fs, root.rstrip("/"))
        return folder

    def _fetch_shard(self, index: int) -> None:
        """Shard `index`'s files from the store into the cache, unless there with the sizes metadata.json implies."""
        if self.url is None:
            return
        from tokenizer_client import storage

        fs, root = self._store
        name = self._names[index]
        count = int(self._count_starts[index + 1] - self._count_starts[index])
        num_ids = int(self._id_starts[index + 1] - self._id_starts[index])
        sizes = shard_file_sizes(count, num_ids, self.dtype, self.layout, self.masked)
        for suffix, size in sizes.items():  # the .seg file's None: the store's size (the index's last offset)
            file = f"{name}{suffix}"
            storage.fetch(f"{self.url}/{file}", self.path / file, size, fs, f"{root}/{file}")

    def fetch(self) -> TokenDataset:
        """Every shard downloaded into the cache now (a Mixture reads them all); nothing to do for a local path."""
        for index in range(self.num_shards):
            self._fetch_shard(index)
        return self

    def _read_metadata(self) -> dict[str, Any]:
        file = self.path / METADATA_FILE
        if not self.path.is_dir():
            problem = "is not a directory" if self.path.exists() else "does not exist"
            raise ValueError(f"{self.path} {problem}: give the directory a tokenizer-pretokenize run wrote (--output)")
        try:
            meta = check_metadata(json.loads(file.read_text(encoding="utf-8")), file)
        except FileNotFoundError:
            if any(self.path.glob("rank-*/" + METADATA_FILE)):
                raise ValueError(
                    f"{self.path} is a ranked output (rank-RRRRR directories, no {METADATA_FILE} over them yet): "
                    f"run tokenizer-shards merge {self.path} first"
                ) from None
            raise ValueError(f"{self.path} holds no {METADATA_FILE}: not a tokenizer-pretokenize output") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{file}: not JSON: {exc}") from exc
        if not meta.get("complete") and not self.allow_partial:
            raise ValueError(
                f"{self.path} is incomplete ({len(meta.get('shards', []))} shards so far): run tokenizer-pretokenize "
                "again with the same arguments to finish it, or pass allow_partial=True to read the complete shards"
            )
        return meta

    # pickling by path: memory maps do not travel, paths do
    def __getstate__(self) -> dict[str, Any]:
        if self.url is not None:  # the cache is where the files are: a worker finds them there
            return {"path": self.url, "allow_partial": self.allow_partial, "cache_dir": str(self.cache_dir)}
        return {"path": str(self.path), "allow_partial": self.allow_partial}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(  # type: ignore[misc]
            state["path"], allow_partial=state["allow_partial"], cache_dir=state.get("cache_dir")
        )

    def __repr__(self) -> str:
        what = (
            f"{self.num_rows} rows of {self.seq_len}" if self.layout == "packed" else f"{self.num_documents} documents"
        )
        return f"TokenDataset({self.url or str(self.path)!r}: {what}, {self.num_tokens} ids, {len(self._names)} shards)"

    @property
    def num_shards(self) -> int:
        return len(self._names)

    @property
    def num_documents(self) -> int:
        """Documents tokenized (for packed output, the documents the rows were packed from)."""
        return int(self.metadata["documents"])

    @property
    def num_tokens(self) -> int:
        """Ids stored in the shards (packed output: rows x seq_len, padding included; a concat output's leftover,
        the last ids that did not fill a row, is not stored). ``metadata["tokens"]`` counts the tokens
        tokenized, padding not included, leftover included: ``tokenizer-shards info`` shows both."""
        return int(self._id_starts[-1])

    @property
    def num_rows(self) -> int:
        if self.layout != "packed":
            raise ValueError("ragged output has documents, not rows; use sequences(seq_len) for fixed-length rows")
        return int(self._count_starts[-1])

    def __len__(self) -> int:
        return int(self._count_starts[-1])

    def shard(self, index: int) -> Shard:
        """Memory-mapped arrays of one shard, validated against its header and metadata.json."""
        index = range(self.num_shards)[index]
        shard = self._open.get(index)
        if shard is not None:
            if index != next(reversed(self._open)):
                self._open.move_to_end(index)
            return shard
        shard = self._map_shard(index)
        self._open[index] = shard
        if len(self._open) > _SHARDS_OPEN:
            self._open.popitem(last=False)
        return shard

    def check(self, index: int) -> None:
        """Read every byte of shard `index`: ValueError unless its offsets rise and end at its size, its ids are
        below the vocabulary size, and packed, its rows' boundaries are sound (what ``tokenizer-shards verify``
        and every export check)."""
        index = range(self.num_shards)[index]
        check_shard(self.shard(index), self.vocab_size, self._row_len, self.path / self._names[index])

    def _map_shard(self, index: int) -> Shard:
        self._fetch_shard(index)
        count = int(self._count_starts[index + 1] - self._count_starts[index])
        num_ids = int(self._id_starts[index + 1] - self._id_starts[index])
        expected = IndexHeader(LAYOUTS[self.layout], self.dtype.itemsize, self.seq_len or 0, count, num_ids)
        return read_shard(self.path / self._names[index], self.dtype, expected, self.masked)

    def _locate(self, index: int) -> tuple[int, int]:
        """(shard, position in shard) of document or row `index`; negative counts from the end."""
        bounds = self._count_bounds
        total = bounds[-1]
        given = index = operator.index(index)
        if index < 0:
            index += total
        if not 0 <= index < total:
            raise IndexError(f"index {given} out of range for {total} items")
        shard = bisect.bisect_right(bounds, index) - 1
        return shard, index - bounds[shard]

    def __getitem__(self, index: int) -> np.ndarray:
        """Document `index` (ragged) or row `index`'s ids (packed), as a read-only view."""
        shard_index, local = self._locate(index)
        shard = self.shard(shard_index)
        if self.layout == "packed":
            return shard.ids[local * self._row_len : (local + 1) * self._row_len]
        return shard.ids[shard.offsets[local] : shard.offsets[local + 1]]

    def loss_mask(self, index: int) -> np.ndarray | None:
        """The loss mask of document `index` (ragged) or row `index` (packed): uint8, one 0/1 an id of ``ds[index]``
        (1 where the loss is taken: the assistant's output; packed, 0 on padding); None for an output without
        masks (texts), where every id is trained."""
        if not self.masked:
            return None
        shard_index, local = self._locate(index)
        shard = self.shard(shard_index)
        assert shard.mask is not None
        if self.layout == "packed":
            return shard.mask[local * self._row_len : (local + 1) * self._row_len]
        return shard.mask[shard.offsets[local] : shard.offsets[local + 1]]

    def document(self, index: int) -> np.ndarray:
        if self.layout != "ragged":
            raise ValueError("packed output keeps rows, not documents; use row(i)")
        return self[index]

    def row(self, index: int) -> PackedRow:
        """Packed row `index` with labels, position ids and cu_seqlens, as /v1/pack gives them."""
        if self.layout != "packed":
            raise ValueError("ragged output has no packed rows; use sequences(seq_len) or pretokenize with --seq-len")
        shard_index, local = self._locate(index)
        shard = self.shard(shard_index)
        seg = shard.seg if shard.seg is not None else np.zeros(0, SEG_DTYPE)  # packed shards always have one
        input_ids = shard.ids[local * self._row_len : (local + 1) * self._row_len]
        mask = None if shard.mask is None else shard.mask[local * self._row_len : (local + 1) * self._row_len]
        return row_tensors(input_ids, seg[shard.offsets[local] : shard.offsets[local + 1]], mask)

    def sequences(self, seq_len: int) -> Sequences:
        """Fixed-length training sequences: the ids of every document end to end, cut every `seq_len`.

        The last ids that do not fill a sequence are left out. For packed output only the packed
        `seq_len` is allowed: the sequences are the rows.
        """
        if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len < 1:
            raise ValueError(f"seq_len must be a positive integer, got {seq_len!r}")
        if self.layout == "packed" and seq_len != self.seq_len:
            raise ValueError(f"packed rows are {self.seq_len} long; got seq_len={seq_len}")
        return Sequences(self, int(seq_len))

    def ids_range(self, start: int, stop: int) -> np.ndarray:
        """Ids `start` to `stop` of all shards end to end: a view within one shard, a copy across shards."""
        return self._range(start, stop, "ids")

    def mask_range(self, start: int, stop: int) -> np.ndarray | None:
        """The loss mask of ids `start` to `stop` (see `ids_range`); None for an output without masks."""
        return self._range(start, stop, "mask") if self.masked else None

    def _range(self, start: int, stop: int, what: str) -> np.ndarray:
        if not 0 <= start <= stop <= self.num_tokens:
            raise IndexError(f"ids [{start}, {stop}) out of range for {self.num_tokens} ids")
        pieces = []
        shard = int(np.searchsorted(self._id_starts, start, side="right")) - 1
        while start < stop:
            base, end = int(self._id_starts[shard]), min(stop, int(self._id_starts[shard + 1]))
            if end > start:
                pieces.append(getattr(self.shard(shard), what)[start - base : end - base])
                start = end
            shard += 1
        if len(pieces) == 1:
            return pieces[0]
        return np.concatenate(pieces) if pieces else np.zeros(0, self.dtype if what == "ids" else MASK_DTYPE)

    def torch(self, seq_len: int | None = None) -> torch.utils.data.Dataset[Any]:
        """A torch map-style Dataset of int64 tensors (imports torch now); see TorchTokenDataset."""
        dataset: torch.utils.data.Dataset[Any] = _torch_dataset_class()(self, seq_len)
        return dataset


class Sequences:
    """Sequence `k` is ids ``[k * seq_len, (k + 1) * seq_len)`` of the dataset's id stream."""

    def __init__(self, dataset: TokenDataset, seq_len: int) -> None:
        self.dataset = dataset
        self.seq_len = seq_len

    def __len__(self) -> int:
        return self.dataset.num_tokens // self.seq_len

    def __getitem__(self, index: int) -> np.ndarray:
        count = len(self)
        if not -count <= index < count:
            raise IndexError(f"sequence {index} out of range for {count} sequences")
        index %= count
        return self.dataset.ids_range(index * self.seq_len, (index + 1) * self.seq_len)


@functools.cache
def _torch_dataset_class() -> type:
    """Build the torch Dataset class on first use, so that importing this module never imports torch."""
    import torch
    from torch.utils.data import Dataset

    class TorchTokenDataset(Dataset):  # type: ignore[type-arg]
        """Items as int64 tensors: packed rows as {"input_ids", "labels", "position_ids"}; ragged output
        with `seq_len` as {"input_ids", "labels"} sequences; ragged without it, one document's ids. Labels are
        -100 where a masked output's loss mask is 0."""

        def __init__(self, dataset: TokenDataset, seq_len: int | None = None) -> None:
            self.dataset = dataset
            if dataset.layout == "packed" and seq_len not in (None, dataset.seq_len):
                raise ValueError(f"packed rows are {dataset.seq_len} long; got seq_len={seq_len}")
            self.seq_len = seq_len
            self._sequences = dataset.sequences(seq_len) if seq_len is not None and dataset.layout == "ragged" else None

        def __len__(self) -> int:
            return len(self._sequences) if self._sequences is not None else len(self.dataset)

        def __getitem__(self, index: int) -> Any:
            if self.dataset.layout == "packed":
                row = self.dataset.row(index)
                return {
                    "input_ids": torch.from_numpy(row.input_ids.astype(np.int64)),
                    "labels": torch.from_numpy(row.labels.astype(np.int64)),
                    "position_ids": torch.from_numpy(row.position_ids.astype(np.int64)),
                }
            if self._sequences is not None:
                ids = self._sequences[index].astype(np.int64)
                labels = ids.copy()
                count = len(self._sequences)
                place = (index % count) * self.seq_len if count else 0
                mask = self.dataset.mask_range(place, place + self.seq_len) if count else None
                if mask is not None:
                    labels[mask == 0] = IGNORE_INDEX
                return {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels)}
            return torch.from_numpy(self.dataset[index].astype(np.int64))

    TorchTokenDataset.__module__ = __name__
    TorchTokenDataset.__qualname__ = "TorchTokenDataset"
    return TorchTokenDataset


def lazy_attributes(module: str, **factories: Callable[[], Any]) -> Callable[[str], Any]:
    """A module ``__getattr__`` by which ``module.NAME`` is ``factories[NAME]()`` once asked for: the torch
    classes, built on first use so that importing the module never imports torch (pickle finds them by name)."""

    def __getattr__(name: str) -> Any:
        if name not in factories:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        return factories[name]()

    return __getattr__


__getattr__ = lazy_attributes(__name__, TorchTokenDataset=_torch_dataset_class)
