"""`tokenizer-shards`: look at, check and export a tokenizer-pretokenize output directory.

    tokenizer-shards info DIR
    tokenizer-shards merge DIR
    tokenizer-shards verify DIR [--sample N] [--model FILE_OR_NAME]
    tokenizer-shards export DIR --to {megatron,litdata,nanogpt,llmc} --output OUT [--per-shard] [--shard-tokens N]

A refusal or a broken output is one line on stderr: exit 2 for a refusal (a format that cannot hold
the output, an incomplete output), 1 for an output that fails verification.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

from app.core import libraries
from app.core.models import ModelInfo, ModelLoadError, find_model_files
from app.pretokenize.cli import describe_os_error
from app.pretokenize.export import DEFAULT_LLMC_SHARD_TOKENS, FORMATS, ExportError, export
from app.pretokenize.ranks import RankError, merge
from app.pretokenize.run import resolve_local_model
from app.pretokenize.sources import DocumentReader, InputError, Source
from app.registry import inspect_model
from app.schemas import EncodeOptions
from client.dataset import TokenDataset

EXPORTS = """\
export formats (ragged outputs go to all four; packed concat outputs too, a row being a sequence;
packed best_fit outputs to none, their padding cannot be masked by these readers):
  megatron  OUT.bin + OUT.idx, read by megatron.core.datasets.indexed_dataset.IndexedDataset(OUT)
            (--per-shard: OUT_NNNNN.bin/.idx a shard, the .bin files hard-linked)
  litdata   OUT/index.json + chunks, read by litdata StreamingDataset(OUT, item_loader=TokensLoader(n))
  nanogpt   OUT as one flat uint16 file (nanoGPT's train.bin); vocabularies up to 65,536 pieces
  llmc      OUT/train_NNNNNN.bin shards of --shard-tokens ids with llm.c's header; uint16 only
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenizer-shards",
        description="Look at, check and export a tokenizer-pretokenize output directory.",
        epilog=EXPORTS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    info = commands.add_parser("info", help="documents, tokens, dtype, shards, model, options, complete or not")
    info.add_argument("directory", type=Path)
    verify = commands.add_parser("verify", help="every shard's header and sizes; optionally re-tokenize a sample")
    verify.add_argument("directory", type=Path)
    verify.add_argument("--sample", type=int, default=0, metavar="N", help="re-tokenize N documents and compare")
    verify.add_argument("--model", help="the model file (default: the output's model, resolved as the server does)")
    verify.add_argument("--seed", type=int, default=0, help="which documents --sample picks")
    merger = commands.add_parser("merge", help="one dataset over the rank-RRRRR outputs of a ranked run")
    merger.add_argument("directory", type=Path)
    exporter = commands.add_parser(
        "export",
        help="write the output in a trainer's format",
        epilog=EXPORTS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    exporter.add_argument("directory", type=Path)
    exporter.add_argument("--to", required=True, choices=FORMATS)
    exporter.add_argument("--output", required=True, type=Path, help="prefix (megatron), file (nanogpt) or directory")
    exporter.add_argument("--per-shard", action="store_true", help="megatron: one .bin/.idx pair a shard")
    exporter.add_argument(
        "--shard-tokens",
        type=int,
        default=DEFAULT_LLMC_SHARD_TOKENS,
        help=f"llmc: ids a shard file (default {DEFAULT_LLMC_SHARD_TOKENS:,})",
    )
    exporter.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    return parser


def describe(dataset: TokenDataset) -> str:
    meta = dataset.metadata
    model = meta["model"]
    layout = (
        f"packed, {meta['rows']:,} rows of {meta['seq_len']} ({meta['strategy']})"
        if dataset.layout == "packed"
        else "ragged"
    )
    options = ", ".join(f"{key}={value}" for key, value in meta["options"].items())
    state = "complete" if meta["complete"] else "INCOMPLETE (run tokenizer-pretokenize again to finish)"
    lines = [
        f"{dataset.path}: {state}",
        f"  {meta['documents']:,} documents, {meta['tokens']:,} tokens, {layout}",
        f"  {dataset.num_shards} shards, dtype {meta['dtype']}, {meta['bad_records']:,} bad records skipped",
        f"  model {model['name']} ({model.get('library', 'sentencepiece')} {model.get('type', '')}, encoded by "
        f"{model.get('encoder', model.get('library', 'sentencepiece'))}, vocab {model['vocab_size']:,}, "
        f"sha256 {model['sha256']})",
        f"  options: {options}",
        f"  inputs: {len(meta['sources'])} files",
    ]
    return "\n".join(lines)


def model_of(dataset: TokenDataset, given: str | None) -> ModelInfo:
    """The model the output was made with: --model when given, else the file metadata.json records (a local
    run), else the model of that name in the server's options; each checked by sha256."""
    wanted = dataset.model["sha256"]
    if given is not None:
        info = resolve_local_model(given)
        if info.sha256 != wanted:
            raise ValueError(f"model {info.path} has sha256 {info.sha256}, the output was made with {wanted}")
        return info
    recorded = dataset.model.get("path")
    candidates = []
    if recorded and Path(recorded).exists():
        candidates.append(lambda: inspect_model(dataset.model["name"], Path(recorded), libraries.REFERENCE))
    candidates.append(lambda: resolve_local_model(dataset.model["name"]))
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


def verify(dataset: TokenDataset, sample: int, model: str | None, seed: int) -> str:
    """Every shard against its header and metadata.json; then `sample` documents re-tokenized."""
    tokens = 0
    for shard in range(dataset.num_shards):
        tokens += len(dataset.shard(shard).ids)  # maps and checks header, sizes and offsets
    if tokens != dataset.num_tokens:
        raise ValueError(f"the shards hold {tokens} ids, metadata.json says {dataset.num_tokens}")
    checked = f"{dataset.num_shards} shards, {tokens:,} ids: headers, sizes and offsets agree with metadata.json"
    if not sample:
        return checked
    if dataset.layout != "ragged":
        raise ValueError("--sample re-tokenizes documents: it needs a ragged output")
    info = model_of(dataset, model)
    # always the reference library, never the fast encoder whose ids are being checked
    library = libraries.load(find_model_files(info.name, info.path), libraries.REFERENCE)
    options: dict[str, Any] = dataset.metadata["options"]
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "merge":
        try:
            merged = merge(args.directory)
        except RankError as exc:
            print(f"tokenizer-shards: {exc}", file=sys.stderr)
            return 2
        print(
            f"merged {merged['merged']['world_size']} ranks into {args.directory}: {len(merged['shards'])} shards, "
            f"{merged['documents']:,} documents, {merged['tokens']:,} tokens"
        )
        return 0
    try:
        dataset = TokenDataset(args.directory, allow_partial=args.command != "export")
    except (ValueError, OSError) as exc:
        print(f"tokenizer-shards: {exc}", file=sys.stderr)
        return 2
    if args.command == "info":
        print(describe(dataset))
        return 0
    if args.command == "verify":
        try:
            print(verify(dataset, args.sample, args.model, args.seed))
        except (ValueError, OSError, InputError, ModelLoadError) as exc:
            print(f"tokenizer-shards: verify failed: {exc}", file=sys.stderr)
            return 1
        return 0
    bar = tqdm(total=dataset.num_tokens, unit="ids", unit_scale=True, disable=args.quiet, file=sys.stderr)
    try:
        written = export(
            dataset, args.to, args.output, per_shard=args.per_shard, shard_tokens=args.shard_tokens, progress=bar.update
        )
    except ExportError as exc:
        bar.close()
        print(f"tokenizer-shards: cannot export to {args.to}: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        bar.close()
        hint = "make room (or raise the limit) and export again"
        print(f"tokenizer-shards: {describe_os_error(exc, args.output, hint)}", file=sys.stderr)
        return 1
    bar.close()
    if not args.quiet:
        print(f"exported {dataset.num_tokens:,} ids to {args.to}: {len(written)} files at {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
