"""A tokenizer-pretokenize output in the formats trainers read with their own readers.

Each format's layout is stated here once, next to its writer; the readers are the trainers' own
(tests/test_export.py reads every export back with them).

megatron  (Megatron-LM / NeMo, ``megatron/core/datasets/indexed_dataset.py``): ``PREFIX.bin`` the
          ids, no header (our ragged ``.bin`` files already are this); ``PREFIX.idx``:

          ======  =========  =======================================================
          offset  size       field
          ======  =========  =======================================================
          0       9          magic ``b"MMIDIDX\\x00\\x00"``
          9       8          version, uint64 (1)
          17      1          dtype code, uint8: 8 uint16, 4 int32 (no uint32 code: ids of a
                             vocabulary over 65,536 are stored as int32, the same bytes)
          18      8          sequences N, uint64
          26      8          document indices, uint64: N + 1
          34      4N         sequence lengths, int32
          34+4N   8N         byte offsets of the sequences in ``.bin``, int64
          34+12N  8(N+1)     document indices 0..N, int64 (one sequence a document)
          ======  =========  =======================================================

litdata   (Lightning, ``litdata.streaming``, read with ``StreamingDataset(dir,
          item_loader=TokensLoader(block_size))``): ``index.json`` (``chunks``: ``chunk_bytes``,
          ``chunk_size`` items, ``dim`` ids, ``filename``; ``config`` with ``data_format``
          ``["no_header_numpy:5"]`` for uint16, ``6`` for uint32, ``item_loader: "TokensLoader"``)
          and one chunk file per shard: uint32 item count n, uint32[n + 1] byte offsets of the items
          from the start of the file, then the items' ids (a document each).

nanogpt   (nanoGPT's ``train.bin``): every id as uint16, documents end to end.

llmc      (llm.c, ``dev/data/data_common.py``, ``llmc/dataloader.h``): shard files of a 256 x int32
          header (``[0] = 20240520``, ``[1] = 1``, ``[2]`` = ids in the shard) then the ids as uint16;
          the loader needs a file size of exactly 1024 + 2 x ids.

Ragged outputs export to all four. Packed ``concat`` outputs too (each row of ``seq_len`` ids is a
sequence, an item, or simply ids in the stream: the rows are the corpus's id stream cut every
``seq_len``). Packed ``best_fit`` outputs are refused: their rows carry padding that these readers
cannot mask. nanogpt and llmc are uint16 formats: a vocabulary over 65,536 pieces is refused.
Where the same bytes serve, files are hard-linked, not copied (one ``.bin`` shard to megatron).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from client.dataset import BIN_SUFFIX, TokenDataset

FORMATS = ("megatron", "litdata", "nanogpt", "llmc")

MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
MEGATRON_VERSION = 1
MEGATRON_DTYPE_CODES = {"<u2": 8, "<u4": 4}
MEGATRON_HEADER = struct.Struct("<9sQBQQ")

LITDATA_DTYPE_CODES = {"<u2": 5, "<u4": 6}
LITDATA_DATA_SPEC = '[1, {"type": null, "context": null, "children_spec": []}]'

LLMC_MAGIC = 20240520
LLMC_VERSION = 1
LLMC_HEADER_INTS = 256
DEFAULT_LLMC_SHARD_TOKENS = 100_000_000  # as llm.c's own data scripts write them

Progress = Callable[[int], None]  # ids written since the last call


class ExportError(Exception):
    """This output cannot go to that format; the message says why and what to do instead."""


def check_exportable(metadata: dict[str, Any], to: str) -> None:
    """Refuse (ExportError) an output a format cannot represent."""
    if not metadata.get("complete"):
        raise ExportError("the output is incomplete: finish it first (run the same tokenizer-pretokenize again)")
    if metadata.get("layout") == "packed" and metadata.get("strategy") == "best_fit":
        raise ExportError(
            f"best_fit rows carry padding that {to} readers cannot mask: export a ragged or --strategy concat output"
        )
    if to in ("nanogpt", "llmc") and metadata.get("dtype") != "<u2":
        vocab = metadata.get("model", {}).get("vocab_size")
        raise ExportError(
            f"{to} stores ids as uint16: a vocabulary of {vocab} pieces does not fit; use megatron or litdata"
        )


def sequences(dataset: TokenDataset, shard: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids, lengths) of a shard: documents (ragged) or rows (packed)."""
    arrays = dataset.shard(shard)
    if dataset.layout == "packed":
        rows = len(arrays.ids) // (dataset.seq_len or 1)
        return arrays.ids, np.full(rows, dataset.seq_len, dtype=np.int64)
    return arrays.ids, np.diff(arrays.offsets)


def bin_path(dataset: TokenDataset, shard: int) -> Path:
    return dataset.path / f"{dataset.metadata['shards'][shard]['name']}{BIN_SUFFIX}"


def link_or_copy(source: Path, target: Path) -> None:
    """A hard link where the filesystem allows one, else a copy."""
    target.unlink(missing_ok=True)
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)


def _write_atomically(path: Path, write: Callable[[Any], None]) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    with temporary.open("wb") as file:
        write(file)
    os.replace(temporary, path)


# -- megatron -------------------------------------------------------------------------------------------------


def megatron_index(lengths: np.ndarray, dtype: str) -> list[bytes]:
    """The ``.idx`` of sequences with these lengths (one document each), as buffers to write in order."""
    count = len(lengths)
    itemsize = np.dtype(dtype).itemsize
    pointers = np.zeros(count, dtype=np.int64)
    if count:
        np.cumsum(lengths[:-1] * itemsize, out=pointers[1:])
    head = MEGATRON_HEADER.pack(MEGATRON_MAGIC, MEGATRON_VERSION, MEGATRON_DTYPE_CODES[dtype], count, count + 1)
    return [
        head,
        lengths.astype("<i4").tobytes(),
        pointers.astype("<i8").tobytes(),
        np.arange(count + 1, dtype="<i8").tobytes(),
    ]


def export_megatron(dataset: TokenDataset, output: Path, *, per_shard: bool, progress: Progress) -> list[Path]:
    """OUT.bin + OUT.idx for the whole output, or OUT_NNNNN.bin/.idx a shard (``.bin`` hard-linked)."""
    dtype = dataset.metadata["dtype"]
    output.parent.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    if per_shard or dataset.num_shards == 1:
        for shard in range(dataset.num_shards):
            name = dataset.metadata["shards"][shard]["name"].replace("/", "-")  # merged ranks: rank-RRRRR/NNNNN
            prefix = Path(f"{output}_{name}") if per_shard else output
            ids, lengths = sequences(dataset, shard)
            link_or_copy(bin_path(dataset, shard), prefix.with_suffix(".bin"))
            _write_atomically(
                prefix.with_suffix(".idx"), lambda file, n=lengths: file.writelines(megatron_index(n, dtype))
            )
            written += [prefix.with_suffix(".bin"), prefix.with_suffix(".idx")]
            progress(len(ids))
        return written
    all_lengths = []

    def write_bin(file: Any) -> None:
        for shard in range(dataset.num_shards):
            ids, lengths = sequences(dataset, shard)
            file.write(memoryview(ids).cast("B"))
            all_lengths.append(lengths)
            progress(len(ids))

    _write_atomically(output.with_suffix(".bin"), write_bin)
    lengths = np.concatenate(all_lengths) if all_lengths else np.zeros(0, dtype=np.int64)
    _write_atomically(output.with_suffix(".idx"), lambda file: file.writelines(megatron_index(lengths, dtype)))
    return [output.with_suffix(".bin"), output.with_suffix(".idx")]


# -- litdata --------------------------------------------------------------------------------------------------


def litdata_chunk_head(lengths: np.ndarray, itemsize: int) -> bytes:
    """Item count and item byte offsets (from the start of the chunk file) that open a litdata chunk."""
    count = len(lengths)
    header_bytes = 4 * (count + 2)
    offsets = header_bytes + np.concatenate([[0], np.cumsum(lengths * itemsize, dtype=np.int64)])
    if offsets[-1] >= 1 << 32:
        raise ExportError(
            f"a shard of {offsets[-1]} bytes is over litdata's 4 GiB chunk: pre-tokenize with a smaller --shard-tokens"
        )
    return np.uint32(count).tobytes() + offsets.astype("<u4").tobytes()


def export_litdata(dataset: TokenDataset, output: Path, *, progress: Progress) -> list[Path]:
    """OUT/index.json and one chunk a shard, items = documents (or rows)."""
    dtype = dataset.metadata["dtype"]
    itemsize = np.dtype(dtype).itemsize
    output.mkdir(parents=True, exist_ok=True)
    chunks = []
    written = []
    for shard in range(dataset.num_shards):
        ids, lengths = sequences(dataset, shard)
        name = f"chunk-0-{shard}.bin"
        head = litdata_chunk_head(lengths, itemsize)
        _write_atomically(
            output / name, lambda file, h=head, i=ids: (file.write(h), file.write(memoryview(i).cast("B")))
        )
        chunks.append(
            {"chunk_bytes": len(head) + ids.nbytes, "chunk_size": len(lengths), "dim": len(ids), "filename": name}
        )
        written.append(output / name)
        progress(len(ids))
    index = {
        "chunks": chunks,
        "config": {
            "chunk_bytes": None,
            "chunk_size": max((chunk["chunk_size"] for chunk in chunks), default=0),
            "compression": None,
            "compression_batch_size": None,
            "compression_level": None,
            "data_format": [f"no_header_numpy:{LITDATA_DTYPE_CODES[dtype]}"],
            "data_spec": LITDATA_DATA_SPEC,
            "encryption": None,
            "ipc_compression": None,
            "item_loader": "TokensLoader",
            "types": "json",
        },
        "updated_at": str(time.time()),
    }
    _write_atomically(output / "index.json", lambda file: file.write(json.dumps(index, indent=1).encode()))
    return [*written, output / "index.json"]


# -- nanogpt --------------------------------------------------------------------------------------------------


def export_nanogpt(dataset: TokenDataset, output: Path, *, progress: Progress) -> list[Path]:
    """One flat uint16 file (``train.bin``): every shard's ids end to end (hard-linked for one shard)."""
    output.parent.mkdir(parents=True, exist_ok=True)
    if dataset.num_shards == 1:
        link_or_copy(bin_path(dataset, 0), output)
        progress(len(dataset.shard(0).ids))
        return [output]

    def write(file: Any) -> None:
        for shard in range(dataset.num_shards):
            ids = dataset.shard(shard).ids
            file.write(memoryview(ids).cast("B"))
            progress(len(ids))

    _write_atomically(output, write)
    return [output]


# -- llm.c ----------------------------------------------------------------------------------------------------


def llmc_header(tokens: int) -> bytes:
    header = np.zeros(LLMC_HEADER_INTS, dtype="<i4")
    header[:3] = (LLMC_MAGIC, LLMC_VERSION, tokens)
    return header.tobytes()


def _stream(dataset: TokenDataset) -> Iterator[np.ndarray]:
    for shard in range(dataset.num_shards):
        yield dataset.shard(shard).ids


def export_llmc(dataset: TokenDataset, output: Path, *, shard_tokens: int, progress: Progress) -> list[Path]:
    """OUT/train_000000.bin, ...: shards of `shard_tokens` ids (the last one shorter)."""
    output.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    pending: list[np.ndarray] = []
    held = 0

    def flush(count: int) -> None:
        nonlocal pending, held
        taken, rest, need = [], [], count
        for piece in pending:
            if need >= len(piece):
                taken.append(piece)
                need -= len(piece)
            elif need:
                taken.append(piece[:need])
                rest.append(piece[need:])
                need = 0
            else:
                rest.append(piece)
        pending, held = rest, held - count
        path = output / f"train_{len(written):06d}.bin"
        _write_atomically(
            path, lambda file: (file.write(llmc_header(count)), [file.write(memoryview(p).cast("B")) for p in taken])
        )
        written.append(path)
        progress(count)

    for ids in _stream(dataset):
        pending.append(ids)
        held += len(ids)
        while held >= shard_tokens:
            flush(shard_tokens)
    if held:
        flush(held)
    return written


def export(
    dataset: TokenDataset,
    to: str,
    output: Path,
    *,
    per_shard: bool = False,
    shard_tokens: int = DEFAULT_LLMC_SHARD_TOKENS,
    progress: Progress | None = None,
) -> list[Path]:
    """Export `dataset` to format `to` at `output`; the files written."""
    check_exportable(dataset.metadata, to)
    report = progress or (lambda count: None)
    if to == "megatron":
        return export_megatron(dataset, output, per_shard=per_shard, progress=report)
    if to == "litdata":
        return export_litdata(dataset, output, progress=report)
    if to == "nanogpt":
        return export_nanogpt(dataset, output, progress=report)
    if to == "llmc":
        return export_llmc(dataset, output, shard_tokens=shard_tokens, progress=report)
    raise ExportError(f"unknown format {to!r}; one of {', '.join(FORMATS)}")
