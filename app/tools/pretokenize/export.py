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
          With loss masks, litdata's own per-item layout (what its ``BinaryWriter`` writes for items
          ``{"input_ids": ids, "loss_mask": uint8 0/1}``, read with ``StreamingDataset(dir)``, its
          ``PyTreeLoader``): ``data_format`` ``["no_header_numpy:5" or "6", "no_header_numpy:4"]``,
          ``data_spec`` a dict of those two keys, ``item_loader: "PyTreeLoader"``, ``dim`` null; a chunk
          is the same count and offsets, then per item: uint32 byte sizes of its two fields (ids, mask),
          its ids, its mask (one byte an id).

nanogpt   (nanoGPT's ``train.bin``): every id as uint16, documents end to end.

llmc      (llm.c, ``dev/data/data_common.py``, ``llmc/dataloader.h``): shard files of a 256 x int32
          header (``[0] = 20240520``, ``[1] = 1``, ``[2]`` = ids in the shard) then the ids as uint16;
          the loader needs a file size of exactly 1024 + 2 x ids.

Validation (``--val-documents N``, ragged outputs): the first N documents go to a validation set, the
rest to training. nanogpt writes ``val.bin`` beside ``train.bin`` (nanoGPT reads both from one
directory); llmc ``val_NNNNNN.bin`` beside ``train_NNNNNN.bin`` (llm.c's ``-j`` pattern); megatron and
litdata a second prefix or directory, ``OUT_val``.

Ragged outputs export to all four. Packed ``concat`` outputs too (each row of ``seq_len`` ids is a
sequence, an item, or simply ids in the stream: the rows are the corpus's id stream cut every
``seq_len``). Packed ``best_fit`` outputs are refused: their rows carry padding that these readers
cannot mask. nanogpt and llmc are uint16 formats: a vocabulary over 65,536 pieces is refused.
Where the same bytes serve, files are hard-linked, not copied: a whole ``.bin`` shard as megatron's
``.bin`` (one shard, or ``--per-shard``) or as nanogpt's file (one shard). A hard link is the shard
itself: the pre-tokenizer writes complete shards read-only so that editing an export in place fails
instead of changing the dataset. Every shard is checked first (``TokenDataset.check``: offsets, ids
below the vocabulary, row boundaries); an export of a corrupt shard is refused before anything is written.

Loss masks (outputs of conversations or prompt-completion records, format version 2) go to litdata only, as
above: an item a document (or a packed row) with its ids and its mask, where ``TokensLoader``'s layout (one array
of ids a chunk) has no place for them. Megatron's ``.bin/.idx``, nanoGPT's and llm.c's files hold ids only: such
an output is refused in one line, before anything is read, unless ``--drop-mask`` (export the ids only, every
token then trained on by these readers; to litdata, ``TokensLoader``'s layout as for an output without masks);
train on the masks with ``TokenDataset``/``Mixture`` or litdata's items.

An export owns its output (``check_destination``, ``earlier_files``): it never writes at a path that is, or lies
inside, the dataset it reads or any other of the pre-tokenizer's datasets (paths resolved, symlinks followed), nor
over an input the dataset was made from (its ``sources``), nor over a file of nanogpt's place that is no ``.bin``;
it removes the files of an earlier export of
the same format at the same place before writing (megatron: ``OUT.bin/.idx``, ``OUT_val.bin/.idx`` and the
``--per-shard`` pairs ``OUT[_val]_NNNNN.bin/.idx``; nanogpt: the file and its ``val.bin``; litdata: ``index.json``
and ``chunk-*.bin`` in ``OUT/`` and ``OUT_val/``; llmc: ``train_*.bin`` and ``val_*.bin`` in ``OUT/``), so that
nothing of it is read with the new one; and a litdata or llmc directory holding anything else is refused.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tokenizer_client.dataset import BIN_SUFFIX, FORMAT_NAME, METADATA_FILE, SHARD_SUFFIXES, TokenDataset, is_masked
from tokenizer_client.storage import StorageError, check_reachable, filesystem, is_url, protocol_of
from tokenizer_client.storage import describe as describe_storage

FORMATS = ("megatron", "litdata", "nanogpt", "llmc")

MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
MEGATRON_VERSION = 1
MEGATRON_DTYPE_CODES = {"<u2": 8, "<u4": 4}
MEGATRON_HEADER = struct.Struct("<9sQBQQ")

LITDATA_DTYPE_CODES = {"<u2": 5, "<u4": 6}
LITDATA_MASK_CODE = 4  # uint8
LITDATA_DATA_SPEC = '[1, {"type": null, "context": null, "children_spec": []}]'
LITDATA_FIELDS = ("input_ids", "loss_mask")  # an item of a masked export: a dict of these two arrays
_LITDATA_LEAF = {"type": None, "context": None, "children_spec": []}
LITDATA_MASKED_DATA_SPEC = json.dumps(  # litdata's pytree spec of such a dict, as its BinaryWriter writes it
    [1, {"type": "builtins.dict", "context": json.dumps(list(LITDATA_FIELDS)), "children_spec": [_LITDATA_LEAF] * 2}]
)
LITDATA_GROUP_TOKENS = 1 << 20  # a masked chunk is laid out this many ids at a time (bounded memory)

LLMC_MAGIC = 20240520
LLMC_VERSION = 1
LLMC_HEADER_INTS = 256
DEFAULT_LLMC_SHARD_TOKENS = 100_000_000  # as llm.c's own data scripts write them
NANOGPT_FILE = "train.bin"

Progress = Callable[[int], None]  # ids written (or checked) since the last call
Stage = Callable[[str, int], None]  # what the export does now, and how many ids that covers


class ExportError(Exception):
    """This output cannot go to that format; the message says why and what to do instead."""


@dataclass(frozen=True, eq=False)
class Piece:
    """Consecutive sequences of one shard (documents, or packed rows): `ids` end to end and their `lengths`.
    `file` is the shard's ``.bin`` when the piece is the whole shard, so that it can be hard-linked."""

    name: str
    ids: np.ndarray
    lengths: np.ndarray
    file: Path | None
    mask: np.ndarray | None = None  # one 0/1 an id, where the export carries the loss masks (litdata)


@dataclass
class Exported:
    """What an export wrote: every file, those that are hard links to shards, and the validation files."""

    files: list[Path] = field(default_factory=list)
    linked: list[Path] = field(default_factory=list)
    val_files: list[Path] = field(default_factory=list)


def check_exportable(metadata: dict[str, Any], to: str, val_documents: int = 0, drop_mask: bool = False) -> None:
    """Refuse (ExportError) an output a format cannot represent (a masked one unless `drop_mask`)."""
    if not metadata.get("complete"):
        raise ExportError("the output is incomplete: finish it first (run the same tokenizer-pretokenize again)")
    masked = is_masked(metadata) and not drop_mask
    if masked and to != "litdata":
        raise ExportError(
            f"this output has loss masks ({metadata['loss_mask'].get('input')}) and {to} has no place for them "
            "(it stores ids only): pass --drop-mask to export the ids only (every token trained), export to litdata "
            "(an item a document, its ids and its mask), or train from the shards with TokenDataset or Mixture, "
            "which apply the masks"
        )
    if metadata.get("layout") == "packed" and metadata.get("strategy") == "best_fit":
        raise ExportError(
            f"best_fit rows carry padding that {to} readers cannot mask: export a ragged or --strategy concat output"
        )
    if to in ("nanogpt", "llmc") and metadata.get("dtype") != "<u2":
        vocab = metadata.get("model", {}).get("vocab_size")
        raise ExportError(
            f"{to} stores ids as uint16: a vocabulary of {vocab} pieces does not fit; use megatron or litdata"
        )
    if to == "litdata":  # a chunk is at most a shard: its byte offsets are uint32
        itemsize = 4 if metadata.get("dtype") == "<u4" else 2
        for shard in metadata.get("shards", []):
            packed = metadata.get("layout") == "packed"
            items = int(shard.get("rows") or 0) if packed else int(shard.get("documents", 0))
            per_item, per_id = (8, itemsize + 1) if masked else (0, itemsize)  # masked: two sizes, a mask byte
            if 4 * (items + 2) + per_item * items + per_id * int(shard.get("tokens", 0)) >= 1 << 32:
                raise ExportError(
                    f"shard {shard.get('name')} is over litdata's 4 GiB chunk: pre-tokenize with a smaller "
                    "--shard-tokens"
                )
    if val_documents:
        if metadata.get("layout") != "ragged":
            raise ExportError(
                "--val-documents splits documents: it needs a ragged output (a packed row holds pieces of several)"
            )
        if val_documents >= metadata.get("documents", 0):
            raise ExportError(
                f"--val-documents {val_documents:,} leaves no training document of {metadata.get('documents', 0):,}"
            )


# -- where an export writes: never into its dataset, and only over its own earlier files -------------------------

_SHARD_PART = r"(?:[0-9]{5,}|rank-[0-9]{5}-[0-9]{5,})"  # a shard's name in OUT_NNNNN (merged ranks: rank-RRRRR-NNNNN)
_LITDATA_FILE = re.compile(r"index\.json|chunk-[0-9]+-[0-9]+\.bin")
_LLMC_FILE = re.compile(r"(?:train|val)_[0-9]{6,}\.bin")


def _ours(pattern: re.Pattern[str], name: str) -> bool:
    """`name` is a file an export writes, or the temporary name it writes it under (``.NAME.tmp``)."""
    temporary = name.startswith(".") and name.endswith(".tmp") and pattern.fullmatch(name[1:-4])
    return bool(pattern.fullmatch(name) or temporary)


def _megatron_files(prefix: Path) -> re.Pattern[str]:
    """PREFIX.bin/.idx, PREFIX_val.bin/.idx and the --per-shard pairs PREFIX[_val]_NNNNN.bin/.idx."""
    return re.compile(rf"{re.escape(prefix.name)}(?:_val)?(?:_{_SHARD_PART})?\.(?:bin|idx)")


def places(to: str, output: Path) -> list[tuple[Path, bool]]:
    """Where an export of format `to` at `output` writes, training then validation: each a directory the export owns
    (litdata, llmc: it may hold nothing else) or a file or prefix beside other files (megatron, nanogpt)."""
    owned_directory = to in ("litdata", "llmc")
    found = [(output, owned_directory)]
    if to != "llmc":  # llmc's validation files lie in OUT itself
        found.append((val_output(to, output), owned_directory))
    return found


def earlier_files(to: str, output: Path) -> list[Path]:
    """The files of an earlier export of format `to` at `output` (training and validation, and their temporary
    files): what a new export there removes before it writes, so that nothing of the earlier one is read with it."""
    found: list[Path] = []
    if to == "megatron":
        pattern = _megatron_files(output)
        if output.parent.is_dir():
            found += [path for path in output.parent.iterdir() if _ours(pattern, path.name) and not path.is_dir()]
        return sorted(found)
    if to == "nanogpt":
        return [path for path in (output, val_output(to, output)) if path.is_file() or path.is_symlink()]
    pattern = _LITDATA_FILE if to == "litdata" else _LLMC_FILE
    for directory, _ in places(to, output):
        if directory.is_dir():
            found += [path for path in directory.iterdir() if _ours(pattern, path.name) and not path.is_dir()]
    return sorted(found)


def _touches(to: str, output: Path, file: Path) -> bool:
    """Whether an export of format `to` at `output` may write or remove the file at (resolved) path `file`."""
    if to == "nanogpt":
        return file in (output.resolve(), val_output(to, output).resolve())
    if to == "megatron":
        return file.parent == output.parent.resolve() and _ours(_megatron_files(output), file.name)
    pattern = _LITDATA_FILE if to == "litdata" else _LLMC_FILE
    return file.parent in {place.resolve() for place, _ in places(to, output)} and _ours(pattern, file.name)


def local_home(source: str) -> Path | None:
    """Where the dataset given as `source` lies on this machine: a path's place, or a ``file://`` URL's (read
    through a cache, whose folder is not the dataset); None for a URL of another store."""
    if not is_url(source):
        return Path(source).resolve()
    if protocol_of(source) == "file":
        return Path(filesystem(source)[1]).resolve()
    return None


def check_destination(
    dataset: TokenDataset, to: str, output: Path, val_documents: int = 0, home: Path | None = None
) -> None:
    """ExportError, before anything is read or written, unless the export may write at `output`: no place it writes
    is, or lies inside, the dataset (`home`, else its path; paths resolved, symlinks followed), nor is any file it
    writes or removes one of the dataset's (a shard linked from elsewhere), nor an input it was made from; a directory
    it owns (litdata, llmc) holds nothing but an earlier export's files; and the places can be made and written."""
    shown = home or dataset.path  # the dataset as the user knows it (a file:// URL's place, not its cache)
    home = shown.resolve()
    # the validation place counts where it is written, or where an earlier export's files there would be removed
    written = [
        (place, owned)
        for index, (place, owned) in enumerate(places(to, output)[: 1 if to == "llmc" else 2])
        if index == 0 or val_documents or _occupied(to, place)
    ]
    for place, _ in written:
        resolved = place.resolve()
        if resolved == home or resolved.is_relative_to(home):
            what = f"--output {output}" if place == output else f"the validation set's place {place}"
            raise ExportError(
                f"{what} is inside the dataset {shown} ({resolved}): an export never writes into the dataset "
                "it reads; give a path outside it"
            )
    for place, owned in written:
        around = dataset_around(place if owned else place.parent)
        if around is not None:
            raise ExportError(
                f"{place} lies inside the dataset {around} (its {METADATA_FILE}): an export never writes into a "
                "dataset; give a path outside it"
            )
    for source in dataset.metadata.get("sources") or []:
        path = source.get("path") if isinstance(source, dict) else None
        if not isinstance(path, str) or not path or (file := local_home(path)) is None:
            continue
        inside = any(owned and file.is_relative_to(place.resolve()) for place, owned in written)
        if inside or _touches(to, output, file):
            raise ExportError(
                f"--output {output} would write over {path}, an input the dataset {shown} was made from; "
                "give another path"
            )
    if to == "nanogpt":
        for place, _ in written:
            if (place.exists() or place.is_symlink()) and (place.suffix != BIN_SUFFIX or not place.is_file()):
                raise ExportError(
                    f"{place} exists and is no {BIN_SUFFIX} file: an export to nanogpt replaces only an earlier "
                    f"export's {BIN_SUFFIX} files; give a new path (nanoGPT reads train.bin)"
                )
    for place, owned in written:
        if owned and place.is_dir():
            pattern = _LITDATA_FILE if to == "litdata" else _LLMC_FILE
            others = sorted(path.name for path in place.iterdir() if not _ours(pattern, path.name) or path.is_dir())
            if others:
                listed = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
                raise ExportError(
                    f"{place} holds files not written by an export to {to}: {listed}; give an empty or new directory "
                    f"(an export replaces an earlier export's own files there, and nothing else)"
                )
        existing = place if owned else place.parent
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        if not existing.is_dir():
            raise ExportError(f"cannot write {place}: {existing} is a file, not a directory")
        if not os.access(existing, os.W_OK | os.X_OK):
            raise ExportError(f"cannot write {place}: no permission to write in {existing}")
    for shard in dataset.metadata["shards"]:
        for suffix in SHARD_SUFFIXES:
            file = (home / f"{shard['name']}{suffix}").resolve()
            if _touches(to, output, file):
                raise ExportError(
                    f"--output {output} would write over {file}, shard {shard['name']}{suffix} of the dataset "
                    f"{shown} (linked from there): an export never writes into the dataset it reads; "
                    "give another path"
                )


def _occupied(to: str, place: Path) -> bool:
    """Whether anything is at an export's place: a directory or file there, or a megatron prefix's .bin/.idx."""
    if place.exists() or place.is_symlink():
        return True
    return to == "megatron" and any(place.with_name(place.name + suffix).exists() for suffix in (".bin", ".idx"))


def dataset_around(directory: Path) -> Path | None:
    """The pre-tokenizer's dataset (a directory whose metadata.json is of its format) that is `directory` or holds
    it, if one does (paths resolved): a rank's output and a merged one are datasets too."""
    for place in (directory.resolve(), *directory.resolve().parents):
        try:
            found = json.loads((place / METADATA_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(found, dict) and found.get("format") == FORMAT_NAME:
            return place
    return None


def url_base(root: str) -> str:
    """The store path an export to a URL whose path is `root` writes under: the URL's parent (its files are staged
    locally, then uploaded there)."""
    return root.rstrip("/").rsplit("/", 1)[0] if "/" in root.rstrip("/") else root


def _inside(path: str, home: str) -> bool:
    home = home.rstrip("/")
    return path.rstrip("/") == home or path.startswith(home + "/")


def check_url_destination(
    dataset: TokenDataset, source: str, to: str, url: str, staging: Path, output: Path, val_documents: int
) -> None:
    """ExportError (StorageError for the store's refusals), before a shard is read, unless an export staged at
    `output` under `staging` may be uploaded under `url`: the rules `check_destination` holds a path to, in the store.
    Its bucket exists and the credentials are accepted; no place it writes is, or lies inside, the dataset it reads
    (`source`, when a URL) or another dataset (a ``metadata.json`` of the format above it); none writes over an input
    the dataset was made from; a directory it owns (litdata, llmc) holds nothing but an earlier export's files, and a
    nanogpt file there is an earlier export's ``.bin``. A validation place counts where it is written or already
    holds something (an export removes an earlier one's files there)."""
    check_reachable(url)
    fs, root = filesystem(url)
    protocol, base = protocol_of(url), url_base(root)
    try:
        written: list[tuple[str, bool]] = []
        for index, (place, owned) in enumerate(places(to, output)[: 1 if to == "llmc" else 2]):
            target = f"{base}/{place.relative_to(staging).as_posix()}"
            if index == 0 or val_documents or fs.exists(target) or fs.exists(target + BIN_SUFFIX):
                written.append((os.path.realpath(target) if protocol == "file" else target, owned))
        home = _in_store(source, protocol)
        for target, owned in written:
            shown = fs.unstrip_protocol(target)
            if home is not None and _inside(target, home):
                raise ExportError(
                    f"{shown} is inside the dataset {source}: an export never writes into the dataset it reads; "
                    "give a URL outside it"
                )
            parts = (target if owned else target.rsplit("/", 1)[0]).split("/")
            for depth in range(len(parts), 0, -1):
                around = "/".join(parts[:depth])
                if fs.exists(f"{around}/{METADATA_FILE}") and _is_dataset(fs, f"{around}/{METADATA_FILE}"):
                    raise ExportError(
                        f"{shown} lies inside the dataset {fs.unstrip_protocol(around)} (its {METADATA_FILE}): an "
                        "export never writes into a dataset; give a URL outside it"
                    )
        for source_file in dataset.metadata.get("sources") or []:
            path = source_file.get("path") if isinstance(source_file, dict) else None
            if not isinstance(path, str) or not path or (file := _in_store(path, protocol)) is None:
                continue
            if any(_touches_url(to, target, owned, file) for target, owned in written):
                raise ExportError(
                    f"--output {url} would write over {path}, an input the dataset was made from; give another URL"
                )
        for target, owned in written:
            if owned and fs.isdir(target):
                pattern = _LITDATA_FILE if to == "litdata" else _LLMC_FILE
                names = sorted(entry.rstrip("/").rsplit("/", 1)[-1] for entry in fs.ls(target, detail=False))
                others = [name for name in names if not _ours(pattern, name) or fs.isdir(f"{target}/{name}")]
                if others:
                    listed = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
                    raise ExportError(
                        f"{fs.unstrip_protocol(target)} holds objects not written by an export to {to}: {listed}; "
                        "give an empty or new prefix (an export replaces an earlier export's own files there, and "
                        "nothing else)"
                    )
            if to == "nanogpt" and (fs.isdir(target) or (fs.exists(target) and not target.endswith(BIN_SUFFIX))):
                raise ExportError(
                    f"{fs.unstrip_protocol(target)} exists and is no {BIN_SUFFIX} file: an export to nanogpt replaces "
                    f"only an earlier export's {BIN_SUFFIX} files; give a new URL (nanoGPT reads train.bin)"
                )
    except (ExportError, StorageError):
        raise
    except Exception as exc:
        raise StorageError(describe_storage(exc, url)) from None


def _in_store(path: str, protocol: str) -> str | None:
    """Where `path` (a dataset's or an input's: a path or a URL) lies in the store of `protocol`, as that store names
    it (``file``: the resolved local path, as `check_destination` compares them); None for anywhere else."""
    if protocol == "file":
        found = local_home(path)
        return None if found is None else str(found)
    if is_url(path) and protocol_of(path) == protocol:
        return str(filesystem(path)[1]).rstrip("/")
    return None


def _is_dataset(fs: Any, metadata: str) -> bool:
    try:
        found = json.loads(fs.cat_file(metadata))
    except (OSError, ValueError):
        return False
    return isinstance(found, dict) and found.get("format") == FORMAT_NAME


def _touches_url(to: str, target: str, owned: bool, file: str) -> bool:
    """Whether an export writing `target` (a store path: a file, a megatron prefix, or an owned directory) may
    write or remove the object `file`."""
    if owned:
        return _inside(file, target)
    if to == "megatron":
        directory, _, prefix = target.rpartition("/")
        return file.rpartition("/")[0] == directory and _ours(_megatron_files(Path(prefix)), file.rpartition("/")[2])
    return file == target


def remove_earlier(dataset: TokenDataset, to: str, output: Path) -> list[Path]:
    """Remove the files of an earlier export of format `to` at `output` (and an emptied litdata OUT_val/); never a
    file inside `dataset` (a validation place not written this time is not checked by `check_destination`)."""
    home = dataset.path.resolve()
    removed = [path for path in earlier_files(to, output) if not path.parent.resolve().is_relative_to(home)]
    for path in removed:
        path.unlink(missing_ok=True)
    if to == "litdata":
        val = val_output(to, output)
        if val.is_dir() and not any(val.iterdir()):
            val.rmdir()
    return removed


def check_shards(dataset: TokenDataset, progress: Progress) -> None:
    """Every shard read once and checked (offsets, ids, row boundaries); ExportError naming the first bad one."""
    for shard in range(dataset.num_shards):
        try:
            dataset.check(shard)
        except (ValueError, OSError) as exc:
            message = f"{exc}; nothing was exported (tokenizer-shards verify {dataset.path} checks it all)"
            raise ExportError(message) from exc
        progress(len(dataset.shard(shard).ids))


def parts(dataset: TokenDataset, start: int, stop: int, masks: bool = False) -> list[Piece]:
    """Sequences [start, stop) of the dataset (documents, or packed rows), a part per shard they touch (`masks`: with
    their loss masks)."""
    found = []
    bounds = [0]
    for shard in range(dataset.num_shards):
        arrays = dataset.shard(shard)
        if dataset.layout == "packed":
            row = dataset.seq_len or 1
            count = len(arrays.ids) // row
        else:
            count = len(arrays.offsets) - 1
        first, last = bounds[-1], bounds[-1] + count
        bounds.append(last)
        lo, hi = max(start, first) - first, min(stop, last) - first
        if lo >= hi:
            continue
        whole = lo == 0 and hi == count
        if dataset.layout == "packed":
            begin, end = lo * row, hi * row
            lengths = np.full(hi - lo, row, dtype=np.int64)
        else:
            begin, end = int(arrays.offsets[lo]), int(arrays.offsets[hi])
            lengths = np.diff(arrays.offsets[lo : hi + 1])
        mask = None
        if masks:
            if arrays.mask is None:
                raise ExportError(f"shard {shard} has no loss masks although the output says it has")
            mask = arrays.mask[begin:end]
        name = dataset.metadata["shards"][shard]["name"].replace("/", "-")  # merged ranks: rank-RRRRR/NNNNN
        found.append(Piece(name, arrays.ids[begin:end], lengths, bin_path(dataset, shard) if whole else None, mask))
    return found


def bin_path(dataset: TokenDataset, shard: int) -> Path:
    return dataset.path / f"{dataset.metadata['shards'][shard]['name']}{BIN_SUFFIX}"


def link_or_copy(source: Path, target: Path) -> bool:
    """A hard link where the filesystem allows one (True), else a copy (False)."""
    target.unlink(missing_ok=True)
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)
        return False
    return True


def _write_atomically(path: Path, write: Callable[[Any], None]) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    try:
        with temporary.open("wb") as file:
            write(file)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def _write_ids(file: Any, pieces: list[Piece], progress: Progress) -> None:
    for part in pieces:
        if part.file is None or not _appended(part.file, part.ids.nbytes, file):
            file.write(memoryview(np.ascontiguousarray(part.ids)).cast("B"))
        progress(len(part.ids))


def _appended(source: Path, size: int, file: Any) -> bool:
    """The whole of `source` (a shard's ``.bin``: the piece's very bytes, `size` of them) appended to `file` by the
    kernel (`copy_file_range`: no page of it mapped here, half the CPU of writing it from the shard's mapping);
    False, with nothing written, where the kernel or the filesystems cannot, or the file is not that size."""
    copy = getattr(os, "copy_file_range", None)
    if copy is None:
        return False
    file.flush()
    start = file.seek(0, os.SEEK_END)
    try:
        with open(source, "rb") as shard:
            left = os.fstat(shard.fileno()).st_size
            if left != size:
                return False
            while left > 0:
                copied = copy(shard.fileno(), file.fileno(), left)
                if copied == 0:
                    raise OSError(f"{source} ended early")
                left -= copied
    except OSError:
        file.truncate(start)  # whatever part was copied
        file.seek(start)
        return False
    file.seek(0, os.SEEK_END)  # the writer's position, past what the kernel appended
    return True


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


def _with_suffix(prefix: Path, suffix: str) -> Path:
    """PREFIX + suffix (Path.with_suffix would eat a dot in the prefix's name)."""
    return prefix.with_name(prefix.name + suffix)


def export_megatron(
    pieces: list[Piece], dtype: str, output: Path, *, per_shard: bool, progress: Progress, done: Exported
) -> list[Path]:
    """OUT.bin + OUT.idx for all parts, or OUT_NNNNN.bin/.idx a part (a whole shard's ``.bin`` hard-linked)."""
    output.parent.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    if per_shard or len(pieces) == 1:
        for part in pieces:
            prefix = Path(f"{output}_{part.name}") if per_shard else output
            binary, index = _with_suffix(prefix, ".bin"), _with_suffix(prefix, ".idx")
            if part.file is not None:
                if link_or_copy(part.file, binary):
                    done.linked.append(binary)
            else:
                _write_atomically(binary, lambda file, p=part: _write_ids(file, [p], lambda count: None))
            _write_atomically(index, lambda file, n=part.lengths: file.writelines(megatron_index(n, dtype)))
            written += [binary, index]
            progress(len(part.ids))
        return written
    binary, index = _with_suffix(output, ".bin"), _with_suffix(output, ".idx")
    _write_atomically(binary, lambda file: _write_ids(file, pieces, progress))
    lengths = np.concatenate([part.lengths for part in pieces]) if pieces else np.zeros(0, dtype=np.int64)
    _write_atomically(index, lambda file: file.writelines(megatron_index(lengths, dtype)))
    return [binary, index]


# -- litdata --------------------------------------------------------------------------------------------------


def litdata_chunk_head(lengths: np.ndarray, itemsize: int, masked: bool = False) -> bytes:
    """Item count and item byte offsets (from the start of the chunk file) that open a litdata chunk (`masked`: items
    of two fields, their sizes, ids and masks)."""
    count = len(lengths)
    header_bytes = 4 * (count + 2)
    sizes = 8 + lengths * (itemsize + 1) if masked else lengths * itemsize
    offsets = header_bytes + np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
    if offsets[-1] >= 1 << 32:
        raise ExportError(
            f"a shard of {offsets[-1]} bytes is over litdata's 4 GiB chunk: pre-tokenize with a smaller --shard-tokens"
        )
    return np.uint32(count).tobytes() + offsets.astype("<u4").tobytes()


def litdata_masked_items(part: Piece, itemsize: int) -> Iterator[np.ndarray]:
    """The items of a masked chunk, as litdata's BinaryWriter lays out ``{"input_ids", "loss_mask"}``: per item the
    uint32 byte sizes of its ids and its mask, then its ids, then its mask. Buffers of about LITDATA_GROUP_TOKENS ids,
    laid out by numpy (no Python step per document)."""
    if part.mask is None or len(part.mask) != len(part.ids):
        raise ExportError(f"chunk {part.name}: its loss mask does not have one value an id")
    lengths = np.asarray(part.lengths, dtype=np.int64)
    ends = np.cumsum(lengths)
    ids = np.ascontiguousarray(part.ids).view(np.uint8).reshape(-1, itemsize)  # little-endian, as litdata reads
    mask = np.ascontiguousarray(part.mask, dtype=np.uint8)
    first = 0
    while first < len(lengths):
        begin = int(ends[first - 1]) if first else 0
        last = max(int(np.searchsorted(ends, begin + LITDATA_GROUP_TOKENS, side="right")), first + 1)
        group = lengths[first:last]
        end = int(ends[last - 1])
        sizes = 8 + group * (itemsize + 1)
        at = np.concatenate([[0], np.cumsum(sizes)[:-1]])  # each item's first byte in the buffer
        out = np.empty(int(sizes.sum()), dtype=np.uint8)
        heads = np.stack([group * itemsize, group], axis=1).astype("<u4").view(np.uint8)
        out[at[:, None] + np.arange(8)] = heads
        owner = np.repeat(np.arange(len(group)), group)
        within = np.arange(end - begin) - np.repeat(np.concatenate([[0], np.cumsum(group)[:-1]]), group)
        id_at = at[owner] + 8 + within * itemsize
        out[id_at[:, None] + np.arange(itemsize)] = ids[begin:end]
        out[at[owner] + 8 + group[owner] * itemsize + within] = mask[begin:end]
        yield out
        first = last


def _write_masked_chunk(file: Any, head: bytes, part: Piece, itemsize: int) -> None:
    file.write(head)
    for buffer in litdata_masked_items(part, itemsize):
        file.write(memoryview(buffer))


def export_litdata(pieces: list[Piece], dtype: str, output: Path, *, progress: Progress) -> list[Path]:
    """OUT/index.json and one chunk a part, items = documents (or rows): for TokensLoader, or, where the pieces
    carry their loss masks, items ``{"input_ids", "loss_mask"}`` in litdata's own per-item layout."""
    itemsize = np.dtype(dtype).itemsize
    masked = any(part.mask is not None for part in pieces)
    output.mkdir(parents=True, exist_ok=True)
    chunks = []
    written = []
    for number, part in enumerate(pieces):
        name = f"chunk-0-{number}.bin"
        head = litdata_chunk_head(part.lengths, itemsize, masked)
        if masked:
            _write_atomically(output / name, lambda file, h=head, p=part: _write_masked_chunk(file, h, p, itemsize))
            size = len(head) + 8 * len(part.lengths) + (itemsize + 1) * len(part.ids)
        else:
            _write_atomically(
                output / name,
                lambda file, h=head, p=part: (file.write(h), _write_ids(file, [p], lambda count: None)),
            )
            size = len(head) + part.ids.nbytes
        chunks.append(
            {
                "chunk_bytes": size,
                "chunk_size": len(part.lengths),
                "dim": None if masked else len(part.ids),
                "filename": name,
            }
        )
        written.append(output / name)
        progress(len(part.ids))
    index = {
        "chunks": chunks,
        "config": {
            "chunk_bytes": None,
            "chunk_size": max((chunk["chunk_size"] for chunk in chunks), default=0),
            "compression": None,
            "compression_batch_size": None,
            "compression_level": None,
            "data_format": [f"no_header_numpy:{LITDATA_DTYPE_CODES[dtype]}"]
            + ([f"no_header_numpy:{LITDATA_MASK_CODE}"] if masked else []),
            "data_spec": LITDATA_MASKED_DATA_SPEC if masked else LITDATA_DATA_SPEC,
            "encryption": None,
            "ipc_compression": None,
            "item_loader": "PyTreeLoader" if masked else "TokensLoader",
            "types": dict.fromkeys(LITDATA_FIELDS, "json") if masked else "json",
        },
        "updated_at": str(time.time()),
    }
    _write_atomically(output / "index.json", lambda file: file.write(json.dumps(index, indent=1).encode()))
    return [*written, output / "index.json"]


# -- nanogpt --------------------------------------------------------------------------------------------------


def export_nanogpt(pieces: list[Piece], output: Path, *, progress: Progress, done: Exported) -> list[Path]:
    """One flat uint16 file (``train.bin``): every part's ids end to end (hard-linked for one whole shard)."""
    output.parent.mkdir(parents=True, exist_ok=True)
    if len(pieces) == 1 and pieces[0].file is not None:
        if link_or_copy(pieces[0].file, output):
            done.linked.append(output)
        progress(len(pieces[0].ids))
        return [output]
    _write_atomically(output, lambda file: _write_ids(file, pieces, progress))
    return [output]


# -- llm.c ----------------------------------------------------------------------------------------------------


def llmc_header(tokens: int) -> bytes:
    header = np.zeros(LLMC_HEADER_INTS, dtype="<i4")
    header[:3] = (LLMC_MAGIC, LLMC_VERSION, tokens)
    return header.tobytes()


def export_llmc(pieces: list[Piece], output: Path, *, shard_tokens: int, split: str, progress: Progress) -> list[Path]:
    """OUT/{split}_000000.bin, ...: shards of `shard_tokens` ids (the last one shorter)."""
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
        path = output / f"{split}_{len(written):06d}.bin"
        _write_atomically(
            path, lambda file: (file.write(llmc_header(count)), [file.write(memoryview(p).cast("B")) for p in taken])
        )
        written.append(path)
        progress(count)

    for part in pieces:
        pending.append(np.ascontiguousarray(part.ids))
        held += len(part.ids)
        while held >= shard_tokens:
            flush(shard_tokens)
    if held:
        flush(held)
    return written


# -- all formats ----------------------------------------------------------------------------------------------


def val_output(to: str, output: Path) -> Path:
    """Where the validation set goes: nanogpt's val.bin beside train.bin; llmc's val_* files in the same
    directory; megatron's and litdata's own prefix or directory, OUT_val."""
    if to == "nanogpt":
        return output.with_name("val.bin" if output.name == NANOGPT_FILE else f"{output.stem}_val{output.suffix}")
    if to == "llmc":
        return output
    return output.with_name(output.name + "_val")


def _export_parts(
    pieces: list[Piece],
    to: str,
    dtype: str,
    output: Path,
    *,
    per_shard: bool,
    shard_tokens: int,
    split: str,
    progress: Progress,
    done: Exported,
) -> list[Path]:
    if to == "megatron":
        return export_megatron(pieces, dtype, output, per_shard=per_shard, progress=progress, done=done)
    if to == "litdata":
        return export_litdata(pieces, dtype, output, progress=progress)
    if to == "nanogpt":
        return export_nanogpt(pieces, output, progress=progress, done=done)
    if to == "llmc":
        return export_llmc(pieces, output, shard_tokens=shard_tokens, split=split, progress=progress)
    raise ExportError(f"unknown format {to!r}; one of {', '.join(FORMATS)}")


def export(
    dataset: TokenDataset,
    to: str,
    output: Path,
    *,
    per_shard: bool = False,
    shard_tokens: int = DEFAULT_LLMC_SHARD_TOKENS,
    val_documents: int = 0,
    progress: Progress | None = None,
    stage: Stage | None = None,
    drop_mask: bool = False,
) -> Exported:
    """Export `dataset` to format `to` at `output` (the first `val_documents` documents to `val_output`), replacing
    the files of an earlier export of that format there (`earlier_files`); refused (ExportError) before anything is
    read or written where the dataset cannot go to that format or the export cannot write there
    (`check_exportable`, `check_destination`), and before anything is written where a shard fails its check."""
    if to not in FORMATS:
        raise ExportError(f"unknown format {to!r}; one of {', '.join(FORMATS)}")
    if shard_tokens < 1:
        raise ExportError(f"--shard-tokens must be at least 1, got {shard_tokens}")
    check_exportable(dataset.metadata, to, val_documents, drop_mask)
    check_destination(dataset, to, output, val_documents)
    report = progress or (lambda count: None)
    announce = stage or (lambda what, total: None)
    announce("checking shards", dataset.num_tokens)
    check_shards(dataset, report)
    remove_earlier(dataset, to, output)
    dtype = dataset.metadata["dtype"]
    masks = to == "litdata" and is_masked(dataset.metadata) and not drop_mask
    done = Exported()
    if val_documents:
        val = parts(dataset, 0, val_documents, masks)
        announce(f"writing {to} validation", sum(len(part.ids) for part in val))
        done.val_files = _export_parts(
            val,
            to,
            dtype,
            val_output(to, output),
            per_shard=per_shard,
            shard_tokens=shard_tokens,
            split="val",
            progress=report,
            done=done,
        )
    train = parts(dataset, val_documents, len(dataset), masks)
    announce(f"writing {to}", sum(len(part.ids) for part in train))
    done.files = _export_parts(
        train,
        to,
        dtype,
        output,
        per_shard=per_shard,
        shard_tokens=shard_tokens,
        split="train",
        progress=report,
        done=done,
    )
    done.files += done.val_files
    return done
