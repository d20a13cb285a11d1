"""Pre-tokenizing as W ranks of a cluster job, and merging their outputs into one dataset.

A rank is told R and W by flags, else by its job system's environment (see `rank_from_environment`).
The inputs, expanded and sorted exactly as one run sees them, are cut into W contiguous blocks of
about equal bytes (a file is never split); rank R writes `DIR/rank-RRRRR/`, a complete, resumable
output of its own (its metadata.json records R, W and the whole input list, so ranks that disagree
refuse to mix). `merge` then writes `DIR/metadata.json` naming every rank's shards in rank order:
`TokenDataset(DIR)` reads them all, no id copied. An output at a URL is merged in its store the same way
(`merge_at`): one metadata.json object over the ranks' shard objects, none copied or moved. Ragged documents
come out exactly as one run over the same inputs makes them; `concat` packing ends each rank's stream with its
own leftover (in `leftovers`, by rank), and `best_fit` packs each shard's documents, as one run does.
"""

from __future__ import annotations

import bisect
import itertools
import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tokenizer_client.dataset import (
    FORMAT_NAME,
    IDX_HEADER,
    IDX_SUFFIX,
    LAYOUTS,
    METADATA_FILE,
    IndexHeader,
    TokenDataset,
    check_metadata,
    is_masked,
    read_index_header,
    shard_file_sizes,
)
from tokenizer_client.storage import StorageError, check_reachable, describe, filesystem, is_url
from tokenizer_service.tools.pretokenize.store import TMP_SUFFIX, differences, identity

RANK_DIRECTORY = "rank-{:05d}"
RANK_NAME = re.compile(r"rank-([0-9]{5})")


class RankError(Exception):
    """Rank and world size are missing, contradictory, or out of range; or ranks cannot be merged."""


def rank_from_environment(
    rank: int | None, world_size: int | None, environ: Mapping[str, str] = os.environ
) -> tuple[int, int] | None:
    """(rank, world size) from the flags, else the environment; None when this is not a ranked run.

    Conventions: RANK and WORLD_SIZE (torchrun); SLURM_ARRAY_TASK_ID minus SLURM_ARRAY_TASK_MIN, and
    SLURM_ARRAY_TASK_COUNT (a Slurm job array); JOB_COMPLETION_INDEX (a Kubernetes Indexed Job), whose
    world size must come from --world-size.
    """
    source = "--rank"
    if rank is None:
        if "RANK" in environ and "WORLD_SIZE" in environ:
            rank, source = _integer(environ, "RANK"), "RANK"
            world_size = world_size if world_size is not None else _integer(environ, "WORLD_SIZE")
        elif "SLURM_ARRAY_TASK_ID" in environ:
            rank = _integer(environ, "SLURM_ARRAY_TASK_ID") - _integer(environ, "SLURM_ARRAY_TASK_MIN", 0)
            source = "SLURM_ARRAY_TASK_ID"
            if world_size is None and "SLURM_ARRAY_TASK_COUNT" in environ:
                world_size = _integer(environ, "SLURM_ARRAY_TASK_COUNT")
        elif "JOB_COMPLETION_INDEX" in environ:
            rank, source = _integer(environ, "JOB_COMPLETION_INDEX"), "JOB_COMPLETION_INDEX"
    if rank is None:
        if world_size is not None:
            raise RankError("--world-size needs a rank: --rank, or RANK, SLURM_ARRAY_TASK_ID or JOB_COMPLETION_INDEX")
        return None
    if world_size is None:
        raise RankError(f"rank {rank} (from {source}) needs a world size: --world-size W")
    if world_size < 1 or not 0 <= rank < world_size:
        raise RankError(f"rank {rank} (from {source}) is not in [0, {world_size}) for world size {world_size}")
    return rank, world_size


def _integer(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    value = environ.get(name)
    if value is None:
        if default is None:
            raise RankError(f"{name} is not set")
        return default
    try:
        return int(value)
    except ValueError:
        raise RankError(f"{name}={value!r} is not an integer") from None


def blocks(sizes: Sequence[int], world_size: int) -> list[tuple[int, int]]:
    """W contiguous [start, end) blocks of files with these sizes, about equal in bytes (some may be empty)."""
    cumulative = list(itertools.accumulate(sizes))
    total = cumulative[-1] if cumulative else 0
    edges = [0]
    for rank in range(1, world_size):
        target = total * rank / world_size
        # the first file whose end passes the target goes to the earlier block when it is mostly before it
        index = bisect.bisect_left(cumulative, target)
        if index < len(cumulative):
            start = cumulative[index - 1] if index else 0
            if target - start > cumulative[index] - target:
                index += 1
        edges.append(max(edges[-1], min(index, len(sizes))))
    edges.append(len(sizes))
    return list(itertools.pairwise(edges))


def rank_directory(output: Path, rank: int) -> Path:
    if isinstance(output, str):  # a URL: RANK/ under its prefix
        return f"{output.rstrip('/')}/{RANK_DIRECTORY.format(rank)}"  # type: ignore[return-value]
    return output / RANK_DIRECTORY.format(rank)


def rank_place_problem(output: Path | str, world_size: int) -> str | None:
    """Why a rank of `world_size` ranks may not write under `output` (a local directory), or None: `output` holds a
    single run's complete output (ranks beside it, then a merge, would replace it), or a merge of another number of
    ranks, or a rank directory of another world size (found only at merge time, after every rank's work)."""
    if is_url(output):
        return None
    output = Path(output)
    top = _metadata(output / METADATA_FILE)
    if top is not None and top.get("merged") is None:
        return (
            f"{output} holds the output of a run without ranks (its {METADATA_FILE}): ranks and their merge would "
            "replace it; give the ranked run an --output of its own"
        )
    if top is not None and top["merged"].get("world_size") != world_size:
        return (
            f"{output} holds a merge of {top['merged'].get('world_size')} ranks; this run is a rank of {world_size}: "
            "ranks of another world size never mix (give another --output)"
        )
    if output.is_dir():
        for entry in sorted(output.iterdir()):
            if RANK_NAME.fullmatch(entry.name) and entry.is_dir():
                found = _metadata(entry / METADATA_FILE)
                theirs = None if found is None else (found.get("rank") or {}).get("world_size")
                if theirs is not None and theirs != world_size:
                    return (
                        f"{entry} is a rank of {theirs} ranks; this run is a rank of {world_size}: ranks of another "
                        "world size never mix (give another --output, or the same --world-size)"
                    )
    return None


def _metadata(file: Path) -> dict[str, Any] | None:
    """A metadata.json's content where it reads as a JSON object, else None (absent, unreadable, not JSON)."""
    try:
        found = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def rank_entries(entries: Sequence[tuple[str, bool]], where: object) -> list[str]:
    """The names of the ranks among an output's `entries` (name, is a directory), sorted; RankError naming any other
    entry named ``rank-...`` (a copy ``rank-00001.old``, a ``rank-1``), so that a merge never blames, skips or takes
    the wrong one, and when there is no rank at all."""
    entries = sorted(entry for entry in entries if entry[0].startswith("rank-"))
    strays = [name for name, is_dir in entries if not (RANK_NAME.fullmatch(name) and is_dir)]
    if strays:
        what, them = ("is not a rank", "it") if len(strays) == 1 else ("are not ranks", "them")
        raise RankError(
            f"cannot merge: {', '.join(strays)} in {where} {what} (only directories named rank-NNNNN are): "
            f"move {them} out of {where}"
        )
    ranks = [name for name, is_dir in entries if is_dir]
    if not ranks:
        raise RankError(f"{where} holds no rank-RRRRR directories: run the ranks first")
    return ranks


def merge(directory: Path | str) -> dict[str, Any]:
    """Write DIR/metadata.json over every rank's output; RankError naming each rank that is not ready. A URL (any
    fsspec URL) is merged in its store (`merge_at`), the same way.

    Exactly the directories named ``rank-NNNNN`` are ranks, each holding the output of the rank its name says (see
    `rank_entries`). metadata.json is written only once every shard it names opens as ``TokenDataset`` opens it
    (files present, headers and sizes agreeing)."""
    if is_url(directory):
        return merge_at(str(directory))
    directory = Path(directory)
    if not directory.is_dir():
        raise RankError(f"{directory} is not a directory: give the --output of the ranked run")
    top = _metadata(directory / METADATA_FILE)
    if top is not None and top.get("merged") is None:
        raise RankError(
            f"{directory} holds the complete output of a run without ranks (its {METADATA_FILE}, which a merge would "
            "replace): merge the --output of a ranked run"
        )
    ranks = rank_entries([(path.name, path.is_dir()) for path in directory.iterdir()], directory)
    found: dict[str, dict[str, Any] | str] = {}
    for name in ranks:
        try:
            file = directory / name / METADATA_FILE
            found[name] = check_metadata(json.loads(file.read_text(encoding="utf-8")), file)
        except (OSError, ValueError) as exc:
            found[name] = f"no readable {METADATA_FILE} ({exc})"
    merged, ordered = combine(found)
    for rank in range(len(ordered)):  # every shard the merged metadata.json names opens as a TokenDataset opens it
        path = rank_directory(directory, rank)
        try:
            dataset = TokenDataset(path)
            for shard in range(dataset.num_shards):
                dataset.shard(shard)
        except (OSError, ValueError) as exc:
            raise RankError(f"cannot merge: {path.name}: {exc} (run that rank again, or verify it)") from None
    temporary = directory / f".{METADATA_FILE}.tmp"
    temporary.write_text(merged_text(merged), encoding="utf-8")
    os.replace(temporary, directory / METADATA_FILE)
    return merged


def merge_at(url: str) -> dict[str, Any]:
    """`ranks.merge` in a store: ``URL/metadata.json`` over every ``URL/rank-RRRRR/`` output, in rank order.

    An index operation, as on disk: the merged metadata.json names each rank's shard objects where the rank uploaded
    them (``rank-00001/00003``), so no id is copied, moved or uploaded again. It is the only object written, in one
    PUT (on a local filesystem, under a temporary name renamed over it), and only after every shard it names was
    found as ``TokenDataset`` opens it: each object present with the size the rank's metadata.json implies and each
    ``.idx`` header agreeing (its first 32 bytes, ranged reads). A merge killed at any point leaves no merged
    metadata.json or the whole one; run again, it writes the same bytes."""
    url = url.rstrip("/")
    fs, root = filesystem(url)
    root = root.rstrip("/")
    check_reachable(url)
    try:
        listed = fs.ls(root, detail=True, refresh=True)
    except FileNotFoundError:
        raise RankError(f"{url} does not exist: give the --output of the ranked run") from None
    except Exception as exc:
        raise StorageError(describe(exc, url)) from None
    entries = [(str(entry["name"]).rstrip("/").rsplit("/", 1)[-1], entry["type"] == "directory") for entry in listed]
    found: dict[str, dict[str, Any] | str] = {}
    for name in rank_entries(entries, url):
        where = f"{url}/{name}/{METADATA_FILE}"
        try:
            found[name] = check_metadata(json.loads(fs.cat_file(f"{root}/{name}/{METADATA_FILE}")), where)
        except FileNotFoundError:
            found[name] = f"no {METADATA_FILE}"
        except ValueError as exc:
            found[name] = f"no readable {METADATA_FILE} ({exc})"
        except Exception as exc:
            raise StorageError(describe(exc, where)) from None
    merged, ordered = combine(found)
    for rank, meta in enumerate(ordered):
        name = merged["merged"]["ranks"][rank]
        problem = _shard_objects_problem(fs, f"{root}/{name}", meta)
        if problem:
            raise RankError(f"cannot merge: {name}: {problem} (run that rank again, or verify it)")
    _write_object(fs, f"{root}/{METADATA_FILE}", merged_text(merged).encode("utf-8"), url)
    return merged


def _shard_objects_problem(fs: Any, prefix: str, meta: dict[str, Any]) -> str | None:
    """Why the shards `meta` lists under `prefix` would not open as ``TokenDataset`` opens them, or None: an object
    missing or of another size than `meta` implies, an ``.idx`` header that disagrees."""
    try:
        sizes = {str(path).rsplit("/", 1)[-1]: int(info["size"]) for path, info in fs.find(prefix, detail=True).items()}
    except Exception as exc:
        raise StorageError(describe(exc, fs.unstrip_protocol(prefix))) from None
    dtype = np.dtype(meta["dtype"])
    packed = meta["layout"] == "packed"
    row = int(meta["seq_len"] or 0)
    headers = []
    for shard in meta["shards"]:
        count = int(shard["rows"] if packed else shard["documents"])
        num_ids = count * row if packed else int(shard["tokens"])
        wanted = shard_file_sizes(count, num_ids, dtype, meta["layout"], is_masked(meta))
        for suffix, size in wanted.items():  # the .seg file's None: its size is the index's; present is enough
            file = f"{shard['name']}{suffix}"
            if file not in sizes:
                return f"{file} is missing"
            if size is not None and sizes[file] != size:
                return f"{file} holds {sizes[file]:,} bytes, its metadata.json implies {size:,}"
        headers.append(IndexHeader(LAYOUTS[meta["layout"]], dtype.itemsize, row, count, num_ids))
    paths = [f"{prefix}/{shard['name']}{IDX_SUFFIX}" for shard in meta["shards"]]
    try:
        raws = fs.cat_ranges(paths, [0] * len(paths), [IDX_HEADER.size] * len(paths)) if paths else []
    except Exception as exc:
        raise StorageError(describe(exc, fs.unstrip_protocol(prefix))) from None
    for path, raw, expected in zip(paths, raws, headers, strict=True):
        if isinstance(raw, Exception):  # cat_ranges returns an object's error in its place on some stores
            raise StorageError(describe(raw, fs.unstrip_protocol(path)))
        try:
            header = read_index_header(raw, path.rsplit("/", 1)[-1])
        except ValueError as exc:
            return str(exc)
        if header != expected:
            return f"{path.rsplit('/', 1)[-1]}: header {header} does not match metadata.json {expected}"
    return None


def _write_object(fs: Any, key: str, data: bytes, url: str) -> None:
    """`data` at `key`, whole or not at all: one PUT in an object store; on a local filesystem (``file://``) a
    temporary file renamed over it."""
    try:
        if "file" in _protocols(fs):
            folder, name = key.rsplit("/", 1)
            temporary = f"{folder}/.{name}{TMP_SUFFIX}"  # as ranks.merge names it on disk
            fs.pipe_file(temporary, data)
            fs.mv(temporary, key)
        else:
            fs.pipe_file(key, data)
    except Exception as exc:
        raise StorageError(describe(exc, url)) from None


def _protocols(fs: Any) -> tuple[str, ...]:
    protocol = fs.protocol
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)


def merged_text(merged: dict[str, Any]) -> str:
    """The bytes of a merged metadata.json (the same locally and in a store)."""
    return json.dumps(merged, indent=1)


def combine(found: Mapping[str, dict[str, Any] | str]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The merged metadata.json of ranks `found` (name: its metadata.json, or why it could not be read), and the
    ranks' metadata in rank order; RankError naming every rank that is missing, incomplete, unreadable, misnamed, or
    made with other inputs, model or options."""
    metadata = []
    problems = []
    for name, meta in found.items():
        if isinstance(meta, str):
            problems.append(f"{name}: {meta}")
            continue
        index = meta.get("rank", {}).get("index")
        if index != int(name.removeprefix("rank-")):
            problems.append(f"{name} holds the output of rank {index}, not of the rank its name says")
        metadata.append(meta)
    if problems:
        raise RankError("cannot merge: " + "; ".join(problems))
    world_sizes = {meta.get("rank", {}).get("world_size") for meta in metadata}
    if len(world_sizes) != 1 or None in world_sizes:
        raise RankError(f"cannot merge: the ranks disagree on the world size ({sorted(map(str, world_sizes))})")
    world_size = int(world_sizes.pop())
    present = {meta["rank"]["index"]: meta for meta in metadata}
    missing = [RANK_DIRECTORY.format(rank) for rank in range(world_size) if rank not in present]
    incomplete = [RANK_DIRECTORY.format(rank) for rank, meta in sorted(present.items()) if not meta.get("complete")]
    if missing or incomplete:
        parts = []
        if missing:
            parts.append("missing: " + ", ".join(missing))
        if incomplete:
            parts.append("incomplete: " + ", ".join(incomplete))
        raise RankError(f"cannot merge {world_size} ranks yet; " + "; ".join(parts) + " (run or rerun those ranks)")
    ordered = [present[rank] for rank in range(world_size)]
    first = ordered[0]

    def agreed(meta: dict[str, Any]) -> dict[str, Any]:  # each rank reads its own block of the inputs
        return {key: value for key, value in identity(meta).items() if key != "inputs"}

    for rank, meta in enumerate(ordered[1:], start=1):
        if agreed(meta) != agreed(first):
            name, names = RANK_DIRECTORY.format(rank), RANK_DIRECTORY.format(0)
            found = [line for line in differences(first, meta, f"{names} has", name) if not line.startswith("inputs:")]
            raise RankError(
                f"cannot merge: {name} was made with other inputs, model or options ({'; '.join(found)}): run it "
                "again as the others were"
            )
    merged = {
        "format": FORMAT_NAME,
        "version": first["version"],  # 2 with loss masks (the ranks agree: the options say so)
        "complete": True,
        "layout": first["layout"],
        "dtype": first["dtype"],
        "seq_len": first["seq_len"],
        "strategy": first["strategy"],
        "model": first["model"],
        "options": first["options"],
        "merged": {"world_size": world_size, "ranks": [RANK_DIRECTORY.format(rank) for rank in range(world_size)]},
        "documents": sum(meta["documents"] for meta in ordered),
        "tokens": sum(meta["tokens"] for meta in ordered),
        "bad_records": sum(meta["bad_records"] for meta in ordered),
        "shards": [
            {**shard, "name": f"{RANK_DIRECTORY.format(rank)}/{shard['name']}"}
            for rank, meta in enumerate(ordered)
            for shard in meta["shards"]
        ],
        "sources": [source for meta in ordered for source in meta["sources"]],
    }
    if first["layout"] == "packed":
        merged["rows"] = sum(meta["rows"] for meta in ordered)
    if first.get("loss_mask") is not None:
        merged["loss_mask"] = first["loss_mask"]
    if any("leftover" in meta for meta in ordered):
        merged["leftovers"] = [meta.get("leftover") for meta in ordered]
    return merged, ordered
