"""`tokenizer-shards`: look at, check and export a tokenizer-pretokenize output directory.

    tokenizer-shards info DIR
    tokenizer-shards merge DIR
    tokenizer-shards verify DIR [--sample N] [--model FILE_OR_NAME]
    tokenizer-shards export DIR --to {megatron,litdata,nanogpt,llmc} --output OUT [--per-shard] [--shard-tokens N]
                            [--val-documents N]

A refusal or a broken output is one line on stderr: exit 2 for a refusal (a format that cannot hold
the output, an incomplete output, an --output inside the dataset, ranks that cannot merge), said before
any progress bar; 1 for an output that fails verification.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tokenizer_client.dataset import TokenDataset
from tokenizer_client.storage import ENVIRONMENT, StorageError, configure, filesystem, is_url
from tokenizer_service.core import scratch as scratch_dirs
from tokenizer_service.entry import ArgumentParser
from tokenizer_service.tools.pretokenize.export import (
    DEFAULT_LLMC_SHARD_TOKENS,
    FORMATS,
    NANOGPT_FILE,
    Exported,
    ExportError,
    check_destination,
    check_exportable,
    check_url_destination,
    export,
    local_home,
    url_base,
)
from tokenizer_service.tools.pretokenize.ranks import RankError, merge

# info, merge and export read shards only: the model and tokenizer code (the pre-tokenizer's reader and run, the
# libraries) is imported where verify needs it, which keeps those commands' start-up at a fraction of a second
if TYPE_CHECKING:
    from tokenizer_service.core.models import ModelInfo
if importlib.util.find_spec("tqdm") is None:  # imported by export when it draws its bar; required from the start
    raise ModuleNotFoundError("No module named 'tqdm'", name="tqdm")  # as the extra that installs it (entry.py)


class _Silent(contextlib.nullcontext):
    """export's progress bar under --quiet: tqdm's calls, doing nothing."""

    def update(self, count: int = 1) -> None:
        pass

    def reset(self, total: int | None = None) -> None:
        pass

    def set_description(self, text: str) -> None:
        pass


EXPORTS = """\
export formats (ragged outputs go to all four; packed concat outputs too, a row being a sequence;
packed best_fit outputs to none, their padding cannot be masked by these readers):
  megatron  OUT.bin + OUT.idx, read by megatron.core.datasets.indexed_dataset.IndexedDataset(OUT)
            (--per-shard: OUT_NNNNN.bin/.idx a shard); a whole shard's .bin is hard-linked
  litdata   OUT/index.json + chunks, read by litdata StreamingDataset(OUT, item_loader=TokensLoader(n));
            with loss masks an item a document, {"input_ids", "loss_mask"}, read by StreamingDataset(OUT)
  nanogpt   OUT (or OUT/train.bin for a directory), every id as uint16 (nanoGPT's train.bin);
            hard-linked for one shard; vocabularies up to 65,536 pieces
  llmc      OUT/train_NNNNNN.bin shards of --shard-tokens ids with llm.c's header; uint16 only
Outputs with loss masks (--conversations, --prompt-completion) go to litdata with their masks; the other formats,
which have no place for a mask, refuse them unless --drop-mask (the ids only). Hard links are the shards' own
read-only files: copy one before editing it. --val-documents N puts the
first N documents in a validation set: nanogpt val.bin beside train.bin, llmc OUT/val_NNNNNN.bin,
megatron OUT_val.bin/.idx, litdata OUT_val/. Every shard is checked before anything is written.
An export owns its output: it replaces the files of an earlier export of the same format there (a
re-export leaves no stale train_*.bin, chunk or validation file), refuses a litdata or llmc directory
holding other files, and never writes into the dataset it reads.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="tokenizer-shards",
        description="Look at, check and export a tokenizer-pretokenize output directory.",
        epilog=EXPORTS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    remote = argparse.ArgumentParser(add_help=False)  # DIR may be a URL (s3://bucket/prefix, any fsspec URL)
    remote.add_argument(
        "--cache-dir",
        type=Path,
        metavar="DIR",
        help="DIR is a URL: download the shards here (reused by later commands); default: a temporary directory "
        "removed at the end",
    )
    remote.add_argument(
        "--storage-options",
        metavar="JSON",
        help=f"options for the URLs' fsspec filesystems (default: ${ENVIRONMENT}); credentials come the store's "
        "standard way",
    )
    info = commands.add_parser(
        "info", parents=[remote], help="documents, tokens, dtype, shards, model, options, complete or not"
    )
    info.add_argument("directory", type=str)
    verify = commands.add_parser(
        "verify", parents=[remote], help="every shard's header and sizes; optionally re-tokenize a sample"
    )
    verify.add_argument("directory", type=str)
    verify.add_argument("--sample", type=int, default=0, metavar="N", help="re-tokenize N documents and compare")
    verify.add_argument("--model", help="the model file (default: the output's model, resolved as the server does)")
    verify.add_argument("--seed", type=int, default=0, help="which documents --sample picks")
    verify.add_argument(
        "--chat-template",
        type=Path,
        metavar="FILE",
        help="conversations made through a service started with --chat-template: that template (a --local run, or "
        "one given --chat-template, records its text in metadata.json)",
    )
    merger = commands.add_parser(
        "merge", help="one dataset over the rank-RRRRR outputs of a ranked run (a directory or a URL)"
    )
    merger.add_argument("directory", type=str)
    merger.add_argument(
        "--storage-options",
        metavar="JSON",
        help=f"DIR is a URL: options for its fsspec filesystem (default: ${ENVIRONMENT})",
    )
    exporter = commands.add_parser(
        "export",
        parents=[remote],
        help="write the output in a trainer's format",
        epilog=EXPORTS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    exporter.add_argument("directory", type=str)
    exporter.add_argument("--to", required=True, choices=FORMATS)
    exporter.add_argument(
        "--output",
        required=True,
        help="prefix (megatron), file or directory (nanogpt: DIR/train.bin), directory (litdata, llmc); or a URL "
        "(written under a temporary directory, then uploaded)",
    )
    exporter.add_argument("--per-shard", action="store_true", help="megatron: one .bin/.idx pair a shard")
    exporter.add_argument(
        "--val-documents",
        type=int,
        default=0,
        metavar="N",
        help="the first N documents to a validation set (nanogpt val.bin, llmc val_*.bin, megatron/litdata OUT_val)",
    )
    exporter.add_argument(
        "--shard-tokens",
        type=int,
        default=None,
        help=f"llmc: ids a shard file (default {DEFAULT_LLMC_SHARD_TOKENS:,})",
    )
    exporter.add_argument(
        "--drop-mask",
        action="store_true",
        help="an output with loss masks (conversations, prompt-completion): export its ids only (these formats have "
        "no place for a mask, so it is refused without this flag)",
    )
    exporter.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    return parser


HISTOGRAM_WIDTH = 40
EXACT_PERCENTILES = 1 << 24  # lengths kept for percentiles; past this, an evenly strided sample


def length_histogram(dataset: TokenDataset) -> list[str]:
    """Lines of text: a histogram of document lengths in tokens (packed: of segments, a document or the piece of
    one in a row), powers of two, with percentiles."""
    counts = np.zeros(64, dtype=np.int64)
    kept: list[np.ndarray] = []
    total = len(dataset) if dataset.layout == "ragged" else 0
    stride = 1
    for shard in range(dataset.num_shards):
        arrays = dataset.shard(shard)
        if dataset.layout == "ragged":
            lengths = np.diff(arrays.offsets)
        else:
            seg = arrays.seg if arrays.seg is not None else np.zeros(0, np.int32)
            lengths = np.diff(seg.astype(np.int64))
            lengths = lengths[lengths > 0]  # a row's first boundary follows the previous row's last
        if not total and shard == 0:
            total = max(1, len(lengths) * dataset.num_shards)
        stride = max(1, -(-total // EXACT_PERCENTILES))
        bins = np.zeros(len(lengths), dtype=np.int64)
        positive = lengths > 0
        bins[positive] = np.floor(np.log2(lengths[positive])).astype(np.int64) + 1
        counts += np.bincount(bins, minlength=64)[:64]
        kept.append(lengths[::stride])
    lengths = np.concatenate(kept) if kept else np.zeros(0, dtype=np.int64)
    if not lengths.size:
        return []
    what = "document lengths" if dataset.layout == "ragged" else "segment lengths (a document, or its piece in a row)"
    sampled = "" if stride == 1 else f", percentiles of every {stride:,}th"
    lines = [f"  {what} in tokens, {int(counts.sum()):,} in all{sampled}:"]
    used = np.nonzero(counts)[0]
    biggest = int(counts.max())
    for index in range(int(used[0]), int(used[-1]) + 1):
        low, high = (0, 0) if index == 0 else (1 << (index - 1), (1 << index) - 1)
        share = counts[index] / counts.sum()
        bar = "█" * max(1 if counts[index] else 0, round(HISTOGRAM_WIDTH * counts[index] / biggest))
        lines.append(f"    {low:>9,}-{high:<9,} {bar:<{HISTOGRAM_WIDTH}} {share:6.1%}")
    p10, p50, p90, p99 = (int(value) for value in np.percentile(lengths, [10, 50, 90, 99]))
    lines.append(
        f"    p10 {p10:,}, p50 {p50:,}, p90 {p90:,}, p99 {p99:,}, max {int(lengths.max()):,}, "
        f"mean {float(lengths.mean()):,.1f}"
    )
    return lines


def packing_lines(dataset: TokenDataset) -> list[str]:
    """Packed output: the padding share of the stored ids and how often a row boundary cut a document."""
    meta = dataset.metadata
    stored = dataset.num_tokens
    padding = sum(int(shard.get("padding", 0)) for shard in meta["shards"])
    segments = 0
    for shard in range(dataset.num_shards):
        seg = dataset.shard(shard).seg
        segments += (len(seg) if seg is not None else 0) - (len(dataset.shard(shard).offsets) - 1)
    leftovers = [meta.get("leftover")] if "leftover" in meta else list(meta.get("leftovers") or [])
    for leftover in leftovers:  # the pieces of documents in ids that did not fill a row (concat)
        if leftover and leftover["ids"]:
            starts = leftover["document_starts"]
            segments += len(starts) + (0 if starts and starts[0] == 0 else 1)
    documents = max(1, int(meta["documents"]))
    cuts = max(0, segments - int(meta["documents"]))
    return [
        f"  padding: {padding:,} of {stored:,} ids stored ({padding / max(1, stored):.2%})",
        f"  split documents: {cuts:,} cuts at a row boundary over {int(meta['documents']):,} documents "
        f"({cuts / documents:.2%} per document; a document longer than a row is cut once per row it spans)",
    ]


def trainable_lines(dataset: TokenDataset) -> list[str]:
    """An output with loss masks: the trainable share (masked-in tokens over tokens, padding not counted) and
    where the masks come from."""
    described = dataset.metadata["loss_mask"]
    trained = 0
    for shard in range(dataset.num_shards):
        mask = dataset.shard(shard).mask
        trained += int(np.count_nonzero(mask)) if mask is not None else 0
    padding = sum(int(shard.get("padding", 0)) for shard in dataset.metadata["shards"])
    tokens = dataset.num_tokens - padding
    what = {"conversations": "conversations", "prompt_completion": "prompt-completion records"}.get(
        described.get("input"), str(described.get("input"))
    )
    source = ""
    template = described.get("chat_template")
    if template:
        source = (
            f", chat template {template.get('source')} (sha256 {str(template.get('sha256'))[:12]}…, loss mask from "
            f"{template.get('loss_mask')}), train_on={described.get('train_on')}"
        )
    return [
        f"  loss mask: {trained:,} of {tokens:,} tokens stored are trained ({trained / max(1, tokens):.1%}, the "
        f"trainable share); {what}{source}"
    ]


def describe(dataset: TokenDataset, name: str | None = None) -> str:
    """`info`'s lines; `name`: the dataset as given (a URL's, not the cache's temporary folder)."""
    meta = dataset.metadata
    model = meta["model"]
    layout = (
        f"packed, {meta['rows']:,} rows of {meta['seq_len']} ({meta['strategy']})"
        if dataset.layout == "packed"
        else "ragged"
    )
    stored = f"{dataset.num_tokens:,} ids stored"
    if dataset.layout == "packed":
        leftover = sum(
            len((item or {}).get("ids", []))
            for item in ([meta.get("leftover")] if "leftover" in meta else meta.get("leftovers") or [])
        )
        padding = sum(int(shard.get("padding", 0)) for shard in meta["shards"])
        stored += f" (padding included: {padding:,}; the {leftover:,} tokens after the last full row not stored)"
    options = ", ".join(f"{key}={value}" for key, value in meta["options"].items())
    state = "complete" if meta["complete"] else "INCOMPLETE (run tokenizer-pretokenize again to finish)"
    lines = [
        f"{name or dataset.path}: {state}",
        f"  {meta['documents']:,} documents, {meta['tokens']:,} tokens tokenized, {stored}, {layout}",
        f"  {dataset.num_shards} shards, dtype {meta['dtype']}, {meta['bad_records']:,} bad records skipped",
        f"  model {model['name']} ({model.get('library', 'sentencepiece')} {model.get('type', '')}, encoded by "
        f"{model.get('encoder', model.get('library', 'sentencepiece'))}, vocab {model['vocab_size']:,}, "
        f"sha256 {model['sha256']})",
        f"  options: {options}",
        f"  inputs: {len(meta['sources'])} files",
    ]
    try:
        if dataset.masked:
            lines += trainable_lines(dataset)
        lines += length_histogram(dataset)
        if dataset.layout == "packed":
            lines += packing_lines(dataset)
    except (ValueError, OSError) as exc:
        lines.append(f"  (no histogram: {exc}; tokenizer-shards verify {dataset.path} checks every shard)")
    return "\n".join(lines)


def recorded_template(dataset: TokenDataset) -> Path | None:
    """A conversations output made with --chat-template FILE (or a service's): the template metadata.json
    records, written to a temporary file (its bytes join the model's sha256), else None."""
    template = (dataset.metadata.get("loss_mask") or {}).get("chat_template")
    if not template or template.get("source") != "flag" or template.get("text") is None:
        return None

    with tempfile.NamedTemporaryFile("wb", suffix=".jinja", prefix="chat-template-", delete=False) as file:
        file.write(template["text"].encode("utf-8"))
    return Path(file.name)


def model_of(dataset: TokenDataset, given: str | None, chat_template: Path | None = None) -> ModelInfo:
    """The model the output was made with: --model when given, else the file metadata.json records (a local
    run), else the model of that name in the server's options; each checked by sha256 (with `chat_template`,
    the --chat-template the output records, whose bytes join it)."""
    from tokenizer_service.core import libraries
    from tokenizer_service.core.models import ModelLoadError
    from tokenizer_service.core.registry import inspect_model
    from tokenizer_service.tools.pretokenize.run import resolve_local_model

    wanted = dataset.model["sha256"]
    if given is not None:
        info = resolve_local_model(given, chat_template)
        if info.sha256 != wanted:
            raise ValueError(f"model {info.path} has sha256 {info.sha256}, the output was made with {wanted}")
        return info
    recorded = dataset.model.get("path")
    candidates = []
    if recorded and Path(recorded).exists():
        candidates.append(
            lambda: inspect_model(dataset.model["name"], Path(recorded), libraries.REFERENCE, chat_template)
        )
    candidates.append(lambda: resolve_local_model(dataset.model["name"], chat_template))
    for candidate in candidates:
        try:
            info = candidate()
        except ModelLoadError:
            continue
        if info.sha256 == wanted:
            return info
    where = ""
    if recorded:
        now = "other bytes" if Path(recorded).exists() else "nothing"
        where = f" (it was read from {recorded}, which holds {now} now)"
    raise ValueError(
        f"cannot find the model this output was made with{where}: pass --model FILE, the model with sha256 {wanted}"
    )


def verify(dataset: TokenDataset, sample: int, model: str | None, seed: int, info: ModelInfo | None = None) -> str:
    """Every shard against its header and metadata.json; then `sample` documents re-tokenized (with `info`, the
    model `model_of` found, when the caller looked for it before the shards were read)."""
    tokens = 0
    for shard in range(dataset.num_shards):
        dataset.check(shard)  # header and sizes; offsets rising to the data's end; ids below the vocabulary
        tokens += len(dataset.shard(shard).ids)
    if tokens != dataset.num_tokens:
        raise ValueError(f"the shards hold {tokens} ids, metadata.json says {dataset.num_tokens}")
    checked = (
        f"{dataset.num_shards} shards, {tokens:,} ids: headers and sizes agree with metadata.json, offsets rise to "
        f"each shard's end, every id is below the vocabulary size {dataset.vocab_size:,}"
    )
    if not dataset.metadata.get("complete"):  # verified as far as it goes; a reader refuses it until it is done
        checked = f"INCOMPLETE output (run tokenizer-pretokenize again to finish): its {checked}"
    if not sample:
        return checked
    if dataset.layout != "ragged":
        raise ValueError("--sample re-tokenizes documents: it needs a ragged output")
    from tokenizer_service.core import libraries
    from tokenizer_service.core.models import find_model_files
    from tokenizer_service.core.options import EncodeOptions
    from tokenizer_service.tools.pretokenize.sources import DocumentReader, Source

    info = info or model_of(dataset, model, recorded_template(dataset) if dataset.masked else None)
    # always the reference library, never the fast encoder whose ids are being checked
    library = libraries.load(find_model_files(info.name, info.path, info.chat_template_path), libraries.REFERENCE)
    options: dict[str, Any] = dataset.metadata["options"]
    if dataset.masked:
        return f"{checked}; {verify_masked(dataset, sample, seed, info, library)}"
    encode_options = EncodeOptions(
        add_bos=options["add_bos"],
        add_eos=options["add_eos"],
        parse_special_tokens=options.get("parse_special_tokens", False),
    )
    picks = set(random.Random(seed).sample(range(len(dataset)), min(sample, len(dataset))))
    sources = [
        Source(**{**source, "read_bytes": 0, "lines": 0, "documents": 0, "bad_records": 0, "done": False})
        for source in dataset.metadata["sources"]
    ]
    reader = DocumentReader(sources, options["text_field"], on_bad=lambda message: None)
    found = 0
    for number, (text, _) in enumerate(reader):
        if number in picks:
            ids, _ = library.encode([text], encode_options)
            if dataset[number].tolist() != ids.tolist():
                raise ValueError(f"document {number} differs from what {info.name} makes of its text now")
            found += 1
            if found == len(picks):
                break
    return f"{checked}; {found} sampled documents re-tokenized to the same ids"


def verify_masked(dataset: TokenDataset, sample: int, seed: int, info: ModelInfo, library: Any) -> str:
    """`sample` conversations (or prompt-completion records) read from the inputs again, rendered with the template
    metadata.json records and the reference library, their ids AND loss masks compared with the shards'."""
    from tokenizer_service.core import chat
    from tokenizer_service.core.errors import InvalidField, PayloadTooLarge
    from tokenizer_service.core.models import find_model_files
    from tokenizer_service.tools.pretokenize.sources import DocumentReader, Source

    described = dataset.metadata["loss_mask"]
    kind = described.get("input")
    if kind not in ("conversations", "prompt_completion"):
        raise ValueError(f"--sample cannot make again loss masks of input {kind!r} (not made by the pre-tokenizer)")
    files = find_model_files(info.name, info.path, info.chat_template_path)
    special = chat.special_tokens(files, library)
    options = chat.ChatOptions(
        parse_special_tokens=bool(described.get("parse_special_tokens")),
        train_on=described.get("train_on") or "assistant",
    )
    if kind == "conversations":
        wanted = (described.get("chat_template") or {}).get("sha256")
        if files.template is None or chat.announce(files.template)["sha256"] != wanted:
            raise ValueError(
                f"the model found ({info.path}) does not render with the chat template this output was made with "
                f"(sha256 {str(wanted)[:12]}…)"
            )
        encoder: Any = chat.ChatTemplate(info.name, files.template, library, special)
    else:
        encoder = chat.Records(library, special.get("eos"))
    meta_options: dict[str, Any] = dataset.metadata["options"]
    picks = set(random.Random(seed).sample(range(len(dataset)), min(sample, len(dataset))))
    sources = [
        Source(**{**source, "read_bytes": 0, "lines": 0, "documents": 0, "bad_records": 0, "done": False})
        for source in dataset.metadata["sources"]
    ]
    reader = DocumentReader(sources, meta_options["text_field"], on_bad=lambda message: None, kind=kind)
    found = number = 0
    for item, _ in reader:
        try:
            ids, _, mask = encoder.encode([item], options)
        except (InvalidField, PayloadTooLarge):
            continue  # refused when pre-tokenized too: a bad record, not a document
        if number in picks:
            if dataset[number].tolist() != ids.tolist():
                raise ValueError(f"document {number} differs from what {info.name} makes of its conversation now")
            stored = dataset.loss_mask(number)
            if stored is None or stored.tolist() != mask.tolist():
                raise ValueError(
                    f"document {number}: its loss mask differs from what {info.name}'s chat template marks now "
                    f"({int(mask.sum())} trained tokens; the shard has {0 if stored is None else int(stored.sum())})"
                )
            found += 1
            if found == len(picks):
                break
        number += 1
    what = "conversations" if kind == "conversations" else "prompt-completion records"
    return f"{found} sampled {what} tokenized again to the same ids and loss masks"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    scratch: list[Path] = []  # temporary directories (a URL's cache, an export's staging), removed at the end
    try:
        configure(getattr(args, "storage_options", None))
        return _main(args, scratch)
    except StorageError as exc:
        print(f"tokenizer-shards: {exc}", file=sys.stderr)
        return 1
    finally:
        for directory in scratch:
            shutil.rmtree(directory, ignore_errors=True)


TEMPORARY_PREFIX = "tokenizer-shards-{what}-"  # then the pid and a random part (core.scratch)


def _temporary(scratch: list[Path], what: str) -> Path:
    """A temporary directory for this command (removed at its end), after those that killed ones left behind."""
    scratch_dirs.remove_stale(TEMPORARY_PREFIX.format(what=what))
    directory = scratch_dirs.make(TEMPORARY_PREFIX.format(what=what))
    scratch.append(directory)
    return directory


def open_dataset(args: argparse.Namespace, scratch: list[Path]) -> TokenDataset:
    """DIR as a TokenDataset: a local directory in place, a URL through --cache-dir (else a temporary one)."""
    partial = args.command != "export"
    if not is_url(args.directory):
        return TokenDataset(Path(args.directory), allow_partial=partial)
    cache = args.cache_dir if args.cache_dir is not None else _temporary(scratch, "cache")
    return TokenDataset(args.directory, allow_partial=partial, cache_dir=cache)


def upload_export(staging: Path, url: str) -> int:
    """Every file an export wrote under `staging`, uploaded to the same place under `url`'s parent; the count."""
    from tokenizer_client.storage import describe as describe_storage
    from tokenizer_service.tools.pretokenize.remote import abort_uploads, upload_file

    fs, root = filesystem(url)
    base = url_base(root)
    files = sorted(path for path in staging.rglob("*") if path.is_file())
    targets = {f"{base}/{path.relative_to(staging).as_posix()}": path for path in files}
    try:  # the parts an export of the same files killed mid-upload left (billed until aborted)
        abort_uploads(fs, base, targets.__contains__)
    except Exception as exc:
        raise StorageError(describe_storage(exc, url)) from None
    for target, path in targets.items():
        try:
            fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
        except Exception as exc:
            raise StorageError(describe_storage(exc, fs.unstrip_protocol(target))) from None
        upload_file(fs, path, target, url, fs.unstrip_protocol(target))
    return len(targets)


def _main(args: argparse.Namespace, scratch: list[Path]) -> int:
    if args.command == "merge":
        try:  # a URL is merged in its store, by the same index operation: no shard object copied or moved
            merged = merge(args.directory if is_url(args.directory) else Path(args.directory))
        except RankError as exc:
            print(f"tokenizer-shards: {exc}", file=sys.stderr)
            return 2
        print(
            f"merged {merged['merged']['world_size']} ranks into {args.directory}: {len(merged['shards'])} shards, "
            f"{merged['documents']:,} documents, {merged['tokens']:,} tokens"
        )
        return 0
    try:
        dataset = open_dataset(args, scratch)
    except (ValueError, OSError) as exc:
        print(f"tokenizer-shards: {exc}", file=sys.stderr)
        return 2
    if args.command == "info":
        print(describe(dataset, args.directory if is_url(args.directory) else None))
        return 0
    if args.command == "verify":
        from tokenizer_service.core.models import ModelLoadError
        from tokenizer_service.tools.pretokenize.sources import InputError

        info = None  # what --sample needs is found, or refused (exit 2), before any shard is read
        try:
            if args.sample < 0:
                raise ValueError(f"--sample must be 0 or more, got {args.sample}")
            if args.sample and dataset.layout != "ragged":
                raise ValueError("--sample re-tokenizes documents: it needs a ragged output, this one is packed")
            if args.sample:
                template = args.chat_template or (recorded_template(dataset) if dataset.masked else None)
                info = model_of(dataset, args.model, template)
        except (ValueError, OSError, ModelLoadError) as exc:
            print(f"tokenizer-shards: cannot verify {args.directory}: {exc}", file=sys.stderr)
            return 2
        try:
            print(verify(dataset, args.sample, args.model, args.seed, info))
        except (ValueError, OSError, InputError, ModelLoadError) as exc:
            print(f"tokenizer-shards: verify failed: {exc}", file=sys.stderr)
            return 1
        return 0
    if args.val_documents < 0:
        print("tokenizer-shards: --val-documents must be 0 or more", file=sys.stderr)
        return 2
    if args.per_shard and args.to != "megatron":
        print(
            f"tokenizer-shards: --per-shard is megatron's (one .bin/.idx pair a shard), not {args.to}'s",
            file=sys.stderr,
        )
        return 2
    if args.shard_tokens is not None and args.to != "llmc":
        print(f"tokenizer-shards: --shard-tokens is llmc's (ids a shard file), not {args.to}'s", file=sys.stderr)
        return 2
    if args.shard_tokens is None:
        args.shard_tokens = DEFAULT_LLMC_SHARD_TOKENS
    if args.shard_tokens < 1:
        print(f"tokenizer-shards: --shard-tokens must be at least 1, got {args.shard_tokens}", file=sys.stderr)
        return 2
    if not args.output.strip():
        print("tokenizer-shards: --output is an empty path; give a file, a prefix or a directory", file=sys.stderr)
        return 2
    url = args.output if is_url(args.output) else None
    staging = _temporary(scratch, "export") if url is not None else None
    try:  # every refusal that needs no shard read comes before the progress bar
        if url is not None and staging is not None:  # written here, then uploaded under the URL's parent
            name = url.rstrip("/").rsplit("/", 1)[-1] + ("/" if url.endswith("/") else "")
            output = export_output(args.to, str(staging / name) + ("/" if name.endswith("/") else ""))
            check_url_destination(dataset, args.directory, args.to, url, staging, output, args.val_documents)
        else:
            output = export_output(args.to, args.output)
        check_exportable(dataset.metadata, args.to, args.val_documents, args.drop_mask)
        check_destination(dataset, args.to, output, args.val_documents, home=local_home(args.directory))
    except ExportError as exc:
        print(f"tokenizer-shards: cannot export to {args.to}: {exc}", file=sys.stderr)
        return 2
    bar: Any = _Silent()
    if not args.quiet:
        from tqdm import tqdm  # here: 40 ms of imports that --quiet, info, verify and merge never need

        bar = tqdm(total=dataset.num_tokens, desc="export", unit="ids", unit_scale=True, file=sys.stderr)

    def stage(what: str, total: int) -> None:
        bar.reset(total=total)
        bar.set_description(what)

    try:
        with bar:  # closed before any message
            done = export(
                dataset,
                args.to,
                output,
                per_shard=args.per_shard,
                shard_tokens=args.shard_tokens,
                val_documents=args.val_documents,
                progress=bar.update,
                stage=stage,
                drop_mask=args.drop_mask,
            )
    except ExportError as exc:
        print(f"tokenizer-shards: cannot export to {args.to}: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        hint = "make room (or raise the limit) and export again"
        from tokenizer_service.tools.pretokenize.cli import describe_os_error

        print(f"tokenizer-shards: {describe_os_error(exc, output, hint)}", file=sys.stderr)
        return 1
    if url is not None and staging is not None:
        uploaded = upload_export(staging, url)
        if not args.quiet:
            where = url.rstrip("/").rsplit("/", 1)[0]
            print(describe_export(dataset, args.to, output, done, args.val_documents).replace(str(staging), where))
            print(f"uploaded {uploaded} files under {where}")
        return 0
    if not args.quiet:
        print(describe_export(dataset, args.to, output, done, args.val_documents))
    return 0


def export_output(to: str, given: str) -> Path:
    """Where the export goes; a directory where a format needs a prefix or a file is refused (megatron) or
    used as the documented place (nanogpt: DIR/train.bin)."""
    path = Path(given).expanduser()
    is_directory = given.endswith(("/", os.sep)) or path.is_dir()
    if to == "megatron" and is_directory:
        raise ExportError(
            f"--output {given} is a directory; megatron writes PREFIX.bin and PREFIX.idx: give a prefix, "
            f"e.g. {path / 'corpus_text_document'}"
        )
    if to == "nanogpt" and is_directory:
        return path / NANOGPT_FILE
    if to in ("litdata", "llmc") and path.exists() and not path.is_dir():
        raise ExportError(f"--output {given} is a file; {to} writes a directory of files there")
    return path


def describe_export(dataset: TokenDataset, to: str, output: Path, done: Exported, val_documents: int) -> str:
    lines = [f"exported {dataset.num_tokens:,} ids to {to}: {len(done.files)} files at {output}"]
    if val_documents:
        lines[0] = (
            f"exported {dataset.num_tokens:,} ids to {to}: the first {val_documents:,} documents to "
            f"{', '.join(map(str, done.val_files[:2]))}{' ...' if len(done.val_files) > 2 else ''} (validation), "
            f"the rest to {output}; {len(done.files)} files"
        )
    if done.linked:
        lines.append(
            f"{len(done.linked)} of them {'is a hard link' if len(done.linked) == 1 else 'are hard links'} to the "
            f"shards (the same bytes, no copy; read-only like the shards: copy a file before editing it)"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
