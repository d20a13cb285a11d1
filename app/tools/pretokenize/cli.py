"""`tokenizer-pretokenize`: flags -> Options -> run, with a progress bar, a summary and exit codes.

Exit codes: 0 done (or nothing to do), 1 failed (a bad record under --strict, an unreadable input, the
service), 2 refused (bad flags, an input that does not exist or is of an unknown kind, or an output
directory that holds another run), 130 interrupted.
"""

from __future__ import annotations

import argparse
import errno
import importlib.util
import shutil
import signal
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizer_client.errors import TokenizerError
from tokenizer_client.storage import ENVIRONMENT, StorageError, configure, configured, is_url
from tokenizer_service.core import process
from tokenizer_service.core.environment import EnvironmentValueError, usable_cpus
from tokenizer_service.core.models import ModelLoadError
from tokenizer_service.entry import ArgumentParser
from tokenizer_service.tools.pretokenize.backends import ServedModelChanged
from tokenizer_service.tools.pretokenize.ranks import RankError, rank_from_environment
from tokenizer_service.tools.pretokenize.run import (
    DEFAULT_SHARD_TOKENS,
    Options,
    Progress,
    Summary,
    gate_scan_min_bytes,
    run,
)
from tokenizer_service.tools.pretokenize.sources import (
    CONVERSATIONS,
    DEFAULT_FIELDS,
    KINDS,
    PROMPT_COMPLETION,
    TEXT,
    BadRecordError,
    InputError,
    InputRefused,
    peek,
)
from tokenizer_service.tools.pretokenize.sources import record_reason as chat_reason
from tokenizer_service.tools.pretokenize.store import OutputError
from tokenizer_service.tools.pretokenize.verifier import VerifierGone, min_bytes

if TYPE_CHECKING:  # tqdm is imported when a bar is first drawn (a quiet run never does)
    from tqdm import tqdm
if importlib.util.find_spec("tqdm") is None:  # but required from the start, as the extra that installs it
    raise ModuleNotFoundError("No module named 'tqdm'", name="tqdm")

EPILOG = """\
Inputs: .jsonl or .json (one JSON object a line; the text in --text-field), .txt (one document per
block of lines between blank lines), each optionally compressed (.gz, or .zst with the corpora extra),
.parquet (the text in column --text-field; corpora extra: pip install 'tokenizer-service[corpora]'),
or a directory (every such file below it, sorted by path). --conversations: each record holds a conversation
(OpenAI messages in --text-field, default messages; ShareGPT's conversations of from/value read too), rendered
with the model's chat template (--chat-template FILE overrides it); --prompt-completion: prompt and completion
strings, as TRL's SFT trainer tokenizes them; both store a loss mask beside the ids (NNNNN.mask).
Output: NNNNN.bin/.idx shards and metadata.json (see the tokenizer_client.dataset module for the format;
read it with tokenizer_client.dataset.TokenDataset).
Run the same command again after an interruption to resume; a finished output is left as it is.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="tokenizer-pretokenize",
        description="Tokenize a corpus once into memory-mapped shards, with the service's tokenizer and packing.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help=f"input files ({KINDS}) or directories of them (every such file below, sorted by path); each may be "
        "a URL (s3://bucket/prefix/, a glob s3://bucket/*.parquet, gs://, hf://, file://: every fsspec protocol "
        "whose package is installed, e.g. pip install 'tokenizer-service[s3]')",
    )
    parser.add_argument(
        "--output",
        "-o",
        metavar="DIR",
        help="output directory, or a URL (s3://bucket/prefix, gs://..., any fsspec URL; staged under --staging, "
        "uploaded shard by shard) (required)",
    )
    parser.add_argument(
        "--staging",
        type=Path,
        metavar="DIR",
        help="--output URL: where shards are written before they are uploaded (default: a new directory under the "
        "system's temporary directory; removed when the run ends)",
    )
    parser.add_argument(
        "--storage-options",
        metavar="JSON",
        help='options for the URLs\' filesystems (fsspec; e.g. {"endpoint_url": ...}, or one object per protocol); '
        f"default: ${ENVIRONMENT}. Credentials come the store's standard way (AWS environment, config, role)",
    )
    parser.add_argument(
        "--model",
        metavar="NAME",
        help="model name on the service; with --local a model file, or a name the server's options know "
        "(TOKENIZER_MODEL / TOKENIZER_MODELS_DIR, else the bundled 'default')",
    )
    where = parser.add_mutually_exclusive_group()  # one of them is required, except with --peek
    where.add_argument("--url", action="append", dest="urls", metavar="URL", help="a tokenizer-service (repeatable)")
    where.add_argument("--local", action="store_true", help="tokenize in-process on a pool of the server's workers")
    parser.add_argument(
        "--text-field",
        help="JSON field or Parquet column holding the text (default: text), or with --conversations the messages "
        "(default: messages, else ShareGPT's conversations)",
    )
    what = parser.add_mutually_exclusive_group()
    what.add_argument(
        "--conversations",
        action="store_true",
        help="records hold conversations (OpenAI messages, or ShareGPT from/value): the model's chat template "
        "renders them, and a loss mask (the assistant's output) is stored beside the ids",
    )
    what.add_argument(
        "--prompt-completion",
        action="store_true",
        help='records are {"prompt": ..., "completion": ...}: tokenized as TRL\'s SFT trainer does, the completion '
        "(and the EOS appended to it) in the loss mask",
    )
    parser.add_argument(
        "--chat-template",
        type=Path,
        metavar="FILE",
        help="--conversations: render with this Jinja template instead of the model's own (with {%% generation %%} "
        "marks, or a stock template TRL's catalogue knows)",
    )
    parser.add_argument(
        "--train-on",
        choices=["assistant", "last"],
        help="--conversations: train on every assistant turn (default) or the last one only",
    )
    parser.add_argument("--seq-len", type=int, metavar="L", help="pack into rows of exactly L ids, as /v1/pack does")
    parser.add_argument("--strategy", choices=["concat", "best_fit"], help="packing with --seq-len (default: concat)")
    parser.add_argument(
        "--workers", type=int, default=usable_cpus(), metavar="N", help="--local worker processes (default: cores)"
    )
    parser.add_argument(
        "--shard-tokens",
        type=int,
        default=DEFAULT_SHARD_TOKENS,
        metavar="N",
        help=f"ids a shard holds, at least (default: {DEFAULT_SHARD_TOKENS}); best_fit packs each shard's documents",
    )
    parser.add_argument("--strict", action="store_true", help="stop at the first bad record instead of skipping it")
    parser.add_argument(
        "--add-bos", action=argparse.BooleanOptionalAction, default=False, help="begin each document with BOS"
    )
    parser.add_argument(
        "--add-eos",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="end each document with EOS (default: when the model has an EOS piece)",
    )
    parser.add_argument(
        "--parse-special-tokens",
        action="store_true",
        help="special-token strings in the text become their ids (chat-formatted data); by default they are "
        "ordinary text, so that training data cannot inject control tokens",
    )
    parser.add_argument(
        "--rank",
        type=int,
        help="this run is rank R of --world-size W: it tokenizes the R-th of W blocks of the inputs (balanced by "
        "bytes) into OUTPUT/rank-RRRRR; default: RANK, SLURM_ARRAY_TASK_ID or JOB_COMPLETION_INDEX if set",
    )
    parser.add_argument(
        "--world-size",
        type=int,
        metavar="W",
        help="ranks in all (default: WORLD_SIZE or SLURM_ARRAY_TASK_COUNT); merge them with tokenizer-shards merge",
    )
    parser.add_argument(
        "--ray",
        metavar="ADDRESS",
        help="run the --world-size ranks as tasks of the Ray cluster at ADDRESS (or `local`: a Ray on this "
        "machine, on 127.0.0.1 only), then merge them; needs pip install 'tokenizer-service[ray]'",
    )
    parser.add_argument("--quiet", "-q", action="store_true", help="no progress bar and no summary")
    parser.add_argument(
        "--peek",
        action="store_true",
        help="tokenize nothing: print the kind of each INPUT and its first record's fields and types (Parquet: "
        "its columns), to choose --text-field",
    )
    return parser


class BadRecordLog:
    """Bad records on stderr without a flood: the first few in full (file:line: reason), then a count at most
    every `every` seconds, and the total at the end (`close`)."""

    FIRST = 10
    EVERY = 10.0

    def __init__(self, write: Callable[[str], None], clock: Callable[[], float] = time.monotonic) -> None:
        self.write = write
        self.clock = clock
        self.count = 0
        self.said = 0  # the count at the last line written
        self._last_line = 0.0
        self._last = ""

    def __call__(self, message: str) -> None:
        self.count += 1
        self._last = message
        if self.count <= self.FIRST:
            self.write(message)
            if self.count == self.FIRST:
                self.write(f"(further bad records are counted, a line every {self.EVERY:.0f} s; --strict stops at one)")
            self.said, self._last_line = self.count, self.clock()
            return
        now = self.clock()
        if now - self._last_line >= self.EVERY:
            self.write(f"{self.count:,} bad records so far (the last: {message})")
            self.said, self._last_line = self.count, now

    def close(self) -> None:
        if self.count > self.said:
            self.write(f"{self.count:,} bad records in this run (the last: {self._last}); metadata.json counts all")
            self.said = self.count


class ProgressBar:
    """tqdm over input bytes (so the ETA is known), with documents/s and tokens/s beside it."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._bar: tqdm[None] | None = None
        self._started = time.monotonic()

    def update(self, progress: Progress) -> None:
        if not self.enabled:
            return
        if self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(
                total=progress.total_bytes,
                initial=progress.initial_bytes,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                desc="pretokenize",
                file=sys.stderr,
                dynamic_ncols=True,
            )
        elapsed = max(time.monotonic() - self._started, 1e-9)
        self._bar.set_postfix_str(
            f"{progress.documents / elapsed:,.0f} docs/s, {progress.tokens / elapsed / 1e6:.2f} M tokens/s",
            refresh=False,
        )
        self._bar.update(max(0, min(progress.input_bytes, progress.total_bytes) - self._bar.n))

    def write(self, message: str) -> None:
        """A line to stderr that does not tear the bar."""
        if self._bar is None:
            print(message, file=sys.stderr, flush=True)
            return
        from tqdm import tqdm

        tqdm.write(message, file=sys.stderr)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


RESUME_HINT = "the complete shards are kept: make room (or raise the limit) and run the same command again"


def describe_os_error(exc: OSError, output: Path, hint: str = RESUME_HINT) -> str:
    """One line for a failed read or write: what, where, the room left on the output's filesystem, and,
    when the filesystem is full or a limit was hit, `hint`."""
    where = exc.filename or output
    what = exc.strerror or str(exc)
    try:
        free = shutil.disk_usage(output if output.exists() else output.parent).free
        room = f"; {free / 2**20:,.1f} MiB free on the output's filesystem"
    except OSError:
        room = ""
    then = f"; {hint}" if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) else ""
    return f"cannot write {where}: {what}{room}{then}"


def describe(summary: Summary) -> str:
    meta = summary.metadata
    shards = len(meta["shards"])
    what = f"{meta['rows']:,} rows of {meta['seq_len']} ({meta['strategy']})" if meta["seq_len"] else "ragged"
    plural = "" if shards == 1 else "s"
    totals = (
        f"{summary.output}: {shards} shard{plural}, {meta['documents']:,} documents, {meta['tokens']:,} tokens, "
        f"{what}, dtype {meta['dtype']}, model {meta['model']['name']} ({meta['model']['sha256'][:12]}…)"
    )
    if meta["bad_records"]:
        totals += f"; {meta['bad_records']:,} bad records skipped"
    if summary.already_complete:
        return f"already complete, nothing to do: {totals}"
    rate = f"{summary.documents / summary.seconds:,.0f} docs/s, {summary.tokens / summary.seconds / 1e6:.2f} M tokens/s"
    resumed = f" (resumed after {summary.shards_before} complete shards)" if summary.shards_before else ""
    return (
        f"tokenized {summary.documents:,} documents, {summary.tokens:,} tokens in {summary.seconds:.1f} s "
        f"({rate}){resumed}\n{totals}"
    )


def run_ranks_on_ray(options: Options, address: str, world_size: int, *, quiet: bool) -> int:
    from tokenizer_service.tools.pretokenize.on_ray import run_on_ray

    try:
        merged = run_on_ray(options, address, world_size, report=(lambda line: None) if quiet else print)
    except (InputError, OutputError, RankError, ModelLoadError) as exc:
        print(f"tokenizer-pretokenize: {exc}", file=sys.stderr)
        return 1
    if not quiet:
        print(
            f"{options.output}: {world_size} ranks merged, {merged['documents']:,} documents, "
            f"{merged['tokens']:,} tokens in {len(merged['shards'])} shards"
        )
    return 0


def render_first(document: Any, kind: str, args: argparse.Namespace) -> list[str]:
    """--peek of conversations or records: the first one as the model renders it, and its trainable share
    (with the model --model names, or the server's options' default, and --chat-template)."""
    from tokenizer_service.core import chat, libraries
    from tokenizer_service.core.errors import InvalidField, PayloadTooLarge
    from tokenizer_service.core.models import find_model_files
    from tokenizer_service.tools.pretokenize.run import resolve_local_model

    try:
        info = resolve_local_model(args.model, args.chat_template)
        files = find_model_files(info.name, info.path, info.chat_template_path)
        library = libraries.load(files, libraries.REFERENCE)
        special = chat.special_tokens(files, library)
        train_on = args.train_on or "assistant"
        options = chat.ChatOptions(parse_special_tokens=args.parse_special_tokens, train_on=train_on)
        if kind == CONVERSATIONS:
            if files.template is None:
                return [f"  model {info.name!r} has no chat template: pass --chat-template FILE to see the rendering"]
            template = chat.ChatTemplate(info.name, files.template, library, special)
            rendered, _ = template.render(document, 0)
            ids, _, mask = template.encode([document], options)
            source = template.resolved.loss_mask
        else:
            ids, _, mask = chat.Records(library, special.get("eos")).encode([document], options)
            rendered, source = document["prompt"] + document["completion"], "TRL's prompt-completion rule"
    except (InvalidField, PayloadTooLarge) as exc:
        return [f"  the first record is refused: {chat_reason(exc.message)}"]
    except (ModelLoadError, OSError, ValueError) as exc:
        return [f"  (not rendered: {exc}; pass --model and --chat-template to see it)"]
    shown = rendered if len(rendered) <= PEEK_RENDERED else rendered[:PEEK_RENDERED] + "…"
    trained = int(mask.sum())
    return [
        f"  rendered by model {info.name!r} (loss mask from {source}):",
        *(f"    {line}" for line in shown.splitlines()),
        f"  {len(ids):,} tokens, {trained:,} trained ({trained / max(1, len(ids)):.1%})",
    ]


PEEK_RENDERED = 1200


def peek_inputs(inputs: list[str], text_field: str, kind: str = TEXT, args: argparse.Namespace | None = None) -> int:
    try:
        for path in inputs:
            found: list[Any] = []
            print("\n".join(peek(path, text_field, kind, found)))
            if found and args is not None:
                print("\n".join(render_first(found[0], kind, args)))
    except InputRefused as exc:
        print(f"tokenizer-pretokenize: {exc}", file=sys.stderr)
        return 2
    except (InputError, OSError) as exc:
        print(f"tokenizer-pretokenize: {exc}", file=sys.stderr)
        return 1
    except (EOFError, zlib.error) as exc:  # a compressed input cut short or corrupt before its first record
        print(f"tokenizer-pretokenize: {path}: corrupt compressed data ({exc})", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    kind = CONVERSATIONS if args.conversations else PROMPT_COMPLETION if args.prompt_completion else TEXT
    if args.text_field is None:
        args.text_field = DEFAULT_FIELDS[kind] or "text"
    if kind != CONVERSATIONS and (args.chat_template is not None or args.train_on is not None):
        parser.error("--chat-template and --train-on need --conversations")
    try:
        configure(args.storage_options)  # before any URL is opened; the options are never printed
    except StorageError as exc:
        parser.error(str(exc))
    if args.peek:
        return peek_inputs(args.inputs, args.text_field, kind, args)
    if args.output is None:
        parser.error("the following arguments are required: --output/-o")
    if not args.output.strip():
        parser.error("--output is an empty path; give a directory or a URL (here: '.')")
    if args.staging is not None and not is_url(args.output):  # it was silently ignored
        parser.error(
            "--staging is where shards wait for their upload to an --output URL; a local --output is "
            "written in place: leave --staging out"
        )
    if not args.urls and not args.local:
        parser.error("one of the arguments --url --local is required")
    if args.strategy is not None and args.seq_len is None:
        parser.error("--strategy needs --seq-len")
    if args.ray is not None:
        if args.world_size is None or args.rank is not None:
            parser.error("--ray runs every rank: give --world-size W, and no --rank")
        ranked = None
    else:
        try:
            ranked = rank_from_environment(args.rank, args.world_size)
        except RankError as exc:
            parser.error(str(exc))
    rank, world_size = ranked if ranked is not None else (None, None)
    try:
        options = Options(
            inputs=args.inputs,
            output=args.output if is_url(args.output) else Path(args.output),
            staging=args.staging,
            storage_options=configured(),
            model=args.model,
            urls=args.urls or [],
            text_field=args.text_field,
            seq_len=args.seq_len,
            strategy=args.strategy or "concat",
            workers=args.workers,
            shard_tokens=args.shard_tokens,
            strict=args.strict,
            add_bos=args.add_bos,
            add_eos=args.add_eos,
            parse_special_tokens=args.parse_special_tokens,
            rank=rank,
            world_size=world_size,
            kind=kind,
            chat_template=args.chat_template,
            train_on=args.train_on or "assistant",
        )
    except ValueError as exc:
        parser.error(str(exc))
    try:  # the TOKENIZER_* numbers the run reads later (no flag sets them): refused now, in one line
        process.pretokenize_sampler(), min_bytes(), gate_scan_min_bytes()
    except EnvironmentValueError as exc:
        print(f"tokenizer-pretokenize: {exc}", file=sys.stderr)
        return 2
    if args.ray is not None:
        return run_ranks_on_ray(options, args.ray, args.world_size, quiet=args.quiet)
    bar = ProgressBar(enabled=not args.quiet)
    bad_records = BadRecordLog(bar.write)
    previous = (
        signal.signal(signal.SIGTERM, _terminate) if threading.current_thread() is threading.main_thread() else None
    )
    try:
        try:
            summary = run(options, report_bad=bad_records, progress=bar.update, warn=bar.write)
        finally:
            bad_records.close()
            bar.close()  # before any message below
    except KeyboardInterrupt as stop:
        what, status = ("terminated (SIGTERM)", 143) if isinstance(stop, Terminated) else ("interrupted", 130)
        print(
            f"{what}: the complete shards in {args.output} are kept; run the same command again to go on",
            file=sys.stderr,
        )
        return status
    except (OutputError, InputRefused) as exc:
        print(f"tokenizer-pretokenize: {exc}", file=sys.stderr)
        return 2
    except BrokenProcessPool:  # a worker killed (the kernel's OOM killer, a signal): its chunk is not written
        print(
            f"tokenizer-pretokenize: a worker process died (killed by a signal, or out of memory); the complete "
            f"shards in {args.output} are kept: run the same command again to go on",
            file=sys.stderr,
        )
        return 1
    except BadRecordError as exc:
        print(f"tokenizer-pretokenize: bad record (--strict): {exc}", file=sys.stderr)
        return 1
    except (InputError, ModelLoadError, ServedModelChanged, TokenizerError, VerifierGone) as exc:
        print(f"tokenizer-pretokenize: {exc}", file=sys.stderr)
        return 1
    except StorageError as exc:  # the store refused or stayed down (after its client's retries): resumable
        print(f"tokenizer-pretokenize: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # disk full, file too large, quota, read-only: say what, where, how much room
        output = options.staging or Path(tempfile.gettempdir()) if is_url(args.output) else Path(args.output)
        print(f"tokenizer-pretokenize: {describe_os_error(exc, output)}", file=sys.stderr)
        return 1
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    if not args.quiet:
        print(describe(summary))
    return 0


class Terminated(KeyboardInterrupt):
    """SIGTERM: a scheduler ending or preempting the job (Slurm, Kubernetes). The run stops as on Ctrl-C, its
    complete shards kept for the same command to go on from (exit 143); its workers die of the signal itself."""


def _terminate(signum: int, frame: Any) -> None:
    raise Terminated
