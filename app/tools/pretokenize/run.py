"""One pre-tokenization run: resolve the model, open or resume the output, stream documents into shards.

Documents are texts, or (`Options.kind`) conversations rendered with the model's chat template (`--chat-template
FILE` overrides it) or prompt-completion records, tokenized as the service's /v1/tokenize does them, each with its
loss mask, into an output of format version 2 (``.mask`` beside each ``.bin``). A conversation the template
refuses (its raise_exception, nothing to train on) is a bad record, named by file:line, like any other.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tokenizer_client import storage
from tokenizer_client.batches import TokenizedBatch
from tokenizer_client.dataset import FORMAT_NAME, format_version, id_dtype
from tokenizer_service.core import environment, libraries, process
from tokenizer_service.core.environment import usable_cpus
from tokenizer_service.core.gatescan import GateScan
from tokenizer_service.core.models import ModelInfo, ModelLoadError, model_file_name
from tokenizer_service.core.options import EncodeOptions
from tokenizer_service.core.registry import inspect_model
from tokenizer_service.core.shadow import ShadowMismatch
from tokenizer_service.core.slots import shared_slots
from tokenizer_service.tools.pretokenize.backends import (
    local_pool,
    local_workers,
    start_method,
    tokenize_dialogue_locally,
    tokenize_dialogue_via_service,
    tokenize_locally,
    tokenize_via_service,
)
from tokenizer_service.tools.pretokenize.ranks import blocks, rank_directory, rank_place_problem
from tokenizer_service.tools.pretokenize.remote import output_for
from tokenizer_service.tools.pretokenize.shards import BestFitShards, ConcatShards, RaggedShards, ShardSink
from tokenizer_service.tools.pretokenize.sources import (
    CONVERSATIONS,
    DEFAULT_FIELDS,
    DOCUMENT_KINDS,
    PROMPT_COMPLETION,
    TEXT,
    BadRecordError,
    DocumentReader,
    InputRefused,
    NoTextError,
    Position,
    Source,
    check_first_parquet,
    expand_inputs,
    holds_text,
    record_reason,
)
from tokenizer_service.tools.pretokenize.store import OutputDir, OutputError, differences
from tokenizer_service.tools.pretokenize.verifier import start as start_verifier

DEFAULT_SHARD_TOKENS = 1 << 24
SERVICE_BATCH = 256
SERVICE_DEPTH = 4  # requests in flight per URL
LOCAL_CHUNK_CHARS = (1 << 16, 1 << 20)  # a chunk for one worker: at least 64 KiB, at most 1 MiB of text
EARLY_BAD_RECORDS = 1000  # a run whose first this many records are all bad stops then (see text_ahead)
LOOK_AHEAD_FILES = 8
GATE_SCAN_MIN_BYTES = 8 << 20  # a smaller --local input is pre-tokenized before the gate's scan could pass


@dataclass(frozen=True)
class Options:
    inputs: list[str]
    output: Path | str  # a directory, or a URL (tokenizer_service.tools.pretokenize.remote)
    model: str | None = None
    urls: list[str] = field(default_factory=list)  # empty: tokenize in-process (--local)
    text_field: str | None = None  # default: "text", or "messages" for conversations
    seq_len: int | None = None
    strategy: str = "concat"
    workers: int = field(default_factory=usable_cpus)
    shard_tokens: int = DEFAULT_SHARD_TOKENS
    strict: bool = False
    add_bos: bool = False
    add_eos: bool | None = None  # EOS after each document when the model has one
    parse_special_tokens: bool = False
    rank: int | None = (
        None  # with world_size: this run is rank `rank` of `world_size` (tokenizer_service.tools.pretokenize.ranks)
    )
    world_size: int | None = None
    kind: str = TEXT  # what a record holds: text, conversations (--conversations), prompt_completion
    chat_template: Path | None = None  # --chat-template FILE: overrides the model's own template
    train_on: str = "assistant"  # conversations: every assistant turn, or the last
    staging: Path | None = None  # --output URL: where shards are written before they are uploaded
    storage_options: dict[str, Any] | None = field(default=None, repr=False)  # fsspec options: never shown

    @property
    def dialogue(self) -> bool:
        """Conversations or prompt-completion records: ids with loss masks."""
        return self.kind != TEXT

    def __post_init__(self) -> None:
        if self.kind not in DOCUMENT_KINDS:
            raise ValueError(f"kind must be one of {', '.join(DOCUMENT_KINDS)}, got {self.kind!r}")
        if self.text_field is None:
            object.__setattr__(self, "text_field", DEFAULT_FIELDS[self.kind] or "text")
        if self.train_on not in ("assistant", "last"):
            raise ValueError(f"--train-on must be assistant or last, got {self.train_on!r}")
        if self.kind != CONVERSATIONS and (self.chat_template is not None or self.train_on != "assistant"):
            raise ValueError("--chat-template and --train-on need --conversations")
        if self.dialogue and (self.add_bos or self.add_eos):
            flag = "--conversations" if self.kind == CONVERSATIONS else "--prompt-completion"
            raise ValueError(
                f"--add-bos/--add-eos cannot be used with {flag}: the chat template (for records, TRL's rule) decides "
                "the special tokens"
            )
        if not self.inputs:
            raise ValueError("no input files")
        if any(not str(path).strip() for path in self.inputs):
            raise ValueError("an INPUT is an empty path; give a file, a directory or a URL (here: '.')")
        if self.seq_len is not None and not 2 <= self.seq_len <= MAX_SEQ_LEN:
            raise ValueError(
                f"--seq-len must be between 2 and {MAX_SEQ_LEN:,} ({MAX_SEQ_LEN // 2**20}M tokens a row), "
                f"got {self.seq_len:,}"
            )
        if self.strategy not in ("concat", "best_fit"):
            raise ValueError(f"--strategy must be concat or best_fit, got {self.strategy!r}")
        if self.workers < 1 or self.shard_tokens < 1:
            raise ValueError("--workers and --shard-tokens must be positive")
        if self.workers > (most := max_workers()):
            raise ValueError(
                f"--workers {self.workers:,} is more than {most} (8 per core of the {usable_cpus()} this process may "
                "use): each worker is a process holding the model"
            )
        if self.urls:
            from tokenizer_client.urls import parse_urls  # httpx: imported only by a run with --url

            parse_urls(self.urls)  # a URL without http(s):// is refused here, with the fix


# The longest row a packed output holds: 16M tokens (a million-token context is 1,048,576). Beyond it a row is no
# training row; a concat run of a corpus shorter than one row would store no token at all.
MAX_SEQ_LEN = 1 << 24


def max_workers() -> int:
    """The most --workers a run may start: 8 per usable core, at least 64."""
    return max(64, 8 * usable_cpus())


@dataclass(frozen=True)
class Progress:
    """So far in this run; input bytes are of the files on disk (compressed bytes for .gz), all runs together."""

    documents: int
    tokens: int
    input_bytes: int
    initial_bytes: int  # read by earlier runs of this output
    total_bytes: int


@dataclass(frozen=True)
class Summary:
    output: Path
    metadata: dict[str, Any]
    shards_before: int  # complete shards found at the start (a resumed run)
    documents: int  # documents tokenized by this run
    tokens: int
    seconds: float
    already_complete: bool = False
    encoded_by: dict[str, int] = field(default_factory=dict)  # documents by what encoded them (library, fastokens)


def resolve_local_model(name_or_path: str | None, chat_template: Path | None = None) -> ModelInfo:
    """A model file's path, or a model name as the server's options (TOKENIZER_* / bundled) resolve it;
    `chat_template` (--chat-template FILE) overrides its own template."""
    if name_or_path is not None and Path(name_or_path).expanduser().exists():
        path = Path(name_or_path).expanduser()
        name = path.name if path.is_dir() else (model_file_name(path) or path.stem)  # as --models-dir names them
        return inspect_model(name, path, chat_template=chat_template, keep=True, serving=False)
    # a model's name, resolved as the server's options do (pydantic: imported only here, not by a run given a path)
    from pydantic import ValidationError

    from tokenizer_service.settings import ConfigError, Settings, describe_error

    try:
        settings = Settings()  # type: ignore[call-arg]  # every field has a default or comes from TOKENIZER_*
    except ValidationError as exc:
        problems = "; ".join(describe_error(error) for error in exc.errors(include_url=False))
        raise ModelLoadError(f"the server's options are invalid: {problems}") from exc
    try:
        paths = settings.model_paths()
    except ConfigError as exc:
        raise ModelLoadError(str(exc)) from exc
    name = name_or_path or settings.default_model or ("default" if "default" in paths else next(iter(paths)))
    if name not in paths:
        raise ModelLoadError(
            f"--model {name!r} is neither a model file nor a model the server's options know ({', '.join(paths)})"
        )
    return inspect_model(name, paths[name], chat_template=chat_template, keep=True, serving=False)


def resolve_service_model(urls: list[str], name: str | None) -> ModelInfo:
    """The model as every URL serves it; they must agree on its sha256."""
    from tokenizer_client import TokenizerClient  # httpx: imported only by a run with --url

    infos = []
    for url in urls:
        with TokenizerClient(url) as client:
            answer = client.models()
        wanted = name or answer["default"]
        entry = next((model for model in answer["models"] if model["name"] == wanted), None)
        if entry is None:
            served = ", ".join(model["name"] for model in answer["models"])
            raise ModelLoadError(f"{url} does not serve model {wanted!r} (it serves {served})")
        infos.append(ModelInfo.from_dict(entry, Path(url)))
    if len({info.sha256 for info in infos}) > 1:
        found = ", ".join(f"{url}: {info.sha256[:12]}…" for url, info in zip(urls, infos, strict=True))
        raise ModelLoadError(f"the URLs serve different files as model {infos[0].name!r} ({found})")
    return infos[0]


def new_metadata(
    model: ModelInfo, sources: list[Source], options: Options, loss_mask: dict[str, Any] | None = None
) -> dict[str, Any]:
    strategy = options.strategy if options.seq_len else None
    metadata: dict[str, Any] = {
        "format": FORMAT_NAME,
        "version": format_version(loss_mask is not None),
        "complete": False,
        "layout": "packed" if options.seq_len else "ragged",
        "dtype": id_dtype(model.vocab_size).str,
        "seq_len": options.seq_len,
        "strategy": strategy,
        # where a local run read the model (what `tokenizer-shards verify` looks for, checked by sha256)
        "model": {**model.as_dict(), **({} if options.urls else {"path": str(model.path)})},
        "options": {
            "text_field": options.text_field,
            "add_bos": options.add_bos,
            "add_eos": options.add_eos,
            "seq_len": options.seq_len,
            "strategy": strategy,
            "shard_tokens": options.shard_tokens,
            # only when set: outputs from before the option resume with the same options
            **({"parse_special_tokens": True} if options.parse_special_tokens else {}),
            **({"input": options.kind} if options.dialogue else {}),
            **({"train_on": options.train_on} if options.kind == CONVERSATIONS else {}),
        },
        "documents": 0,
        "tokens": 0,
        "bad_records": 0,
        "shards": [],
        "sources": [source.as_dict() for source in sources],
    }
    if options.seq_len:
        metadata["rows"] = 0
    if loss_mask is not None:
        metadata["loss_mask"] = loss_mask
    return metadata


def dialogue_model(options: Options, model: ModelInfo) -> dict[str, Any]:
    """metadata.json's `loss_mask` for conversations or records (what `tokenizer-shards verify` needs to render
    them again), refusing in one line a model that cannot make them: no chat template, one whose loss mask is
    unknown, a --chat-template other than the service's, records without an EOS."""
    described: dict[str, Any] = {"input": options.kind, "parse_special_tokens": options.parse_special_tokens}
    if options.kind == PROMPT_COMPLETION:
        if model.eos_id < 0:
            raise ModelLoadError(f"model {model.name!r} has no EOS token: prompt-completion records end with it (TRL)")
        return described
    from tokenizer_service.core import chat
    from tokenizer_service.core.models import find_model_files

    announced = model.chat_template
    if announced is None:
        raise ModelLoadError(
            f"model {model.name!r} has no chat template: pass --chat-template FILE (a Jinja template; with "
            "{% generation %} marks unless it is a stock template TRL's catalogue knows)"
        )
    if announced["loss_mask"] is None:
        raise ModelLoadError(
            chat.no_mask_message(model.name).replace(f"--chat-template {model.name}=FILE", "--chat-template FILE")
        )
    text = None
    if options.chat_template is not None:
        try:
            text = Path(options.chat_template).expanduser().read_bytes().decode("utf-8", "replace")
        except OSError as exc:
            raise ModelLoadError(f"cannot read the chat template {options.chat_template}: {exc.strerror}") from None
        import hashlib

        if options.urls and hashlib.sha256(text.encode("utf-8")).hexdigest() != announced["sha256"]:
            raise ModelLoadError(
                f"--chat-template {options.chat_template} is not the template the service renders model "
                f"{model.name!r} with (sha256 {announced['sha256'][:12]}…): a service's template is set where it "
                f"starts (--chat-template {model.name}=FILE); leave the flag out to use it"
            )
    elif not options.urls:
        files = find_model_files(model.name, model.path, model.chat_template_path)
        text = files.template.text if files.template is not None else None
    described.update(train_on=options.train_on, chat_template={**announced, "text": text})
    return described


def resume_position(sources: list[Source]) -> Position | None:
    """Where the reader starts again: inside the first source not read to its end."""
    for index, source in enumerate(sources):
        if not source.done or index == len(sources) - 1:
            return Position(index, source.read_bytes, source.lines, source.documents, source.bad_records)
    return None


def make_sink(out: OutputDir, metadata: dict[str, Any], sources: list[Source], model: ModelInfo) -> ShardSink:
    if metadata["layout"] == "ragged":
        return RaggedShards(out, metadata, sources)
    if metadata["strategy"] == "concat":
        position = resume_position(sources) if metadata["shards"] else None
        return ConcatShards(out, metadata, sources, position)
    return BestFitShards(out, metadata, sources, model.padding_id)  # the same padding as /v1/pack


def open_output(out: OutputDir, wanted: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """The metadata to go on with, and whether the output is already complete; refuses to mix runs."""
    existing = out.load()
    if existing is None:
        out.prepare(0)
        out.write_metadata(wanted)
        return wanted, False
    problems = differences(existing, wanted)
    if problems and not existing.get("shards") and not existing.get("complete"):
        # another run's output that never got to its first shard (a wrong option, a killed run): nothing in it
        # is worth keeping, and refusing would block the corrected command
        out.prepare(0)
        out.write_metadata(wanted)
        return wanted, False
    if problems:
        raise OutputError(
            f"{out.where} holds another run's output; refusing to mix:\n  "
            + "\n  ".join(problems)
            + "\nuse another --output, or the same model, inputs and options"
        )
    if not existing.get("complete"):
        out.prepare(len(existing["shards"]))
    return existing, bool(existing.get("complete"))


def special_tokens(options: Options, model: ModelInfo) -> Options:
    """Options with `add_eos` decided (EOS when the model has one), refusing what the model cannot do."""
    if options.dialogue:  # the template (or TRL's rule) decides
        return dataclasses.replace(options, add_bos=False, add_eos=False)
    add_eos = model.eos_id >= 0 if options.add_eos is None else options.add_eos
    if add_eos and model.eos_id < 0:
        raise ModelLoadError(f"model {model.name!r} has no EOS piece: leave out --add-eos (or pass --no-add-eos)")
    if options.add_bos and model.bos_id < 0:
        raise ModelLoadError(f"model {model.name!r} has no BOS piece: leave out --add-bos")
    return dataclasses.replace(options, add_eos=add_eos)


def all_bad(bad: int, last_bad: str, reader: DocumentReader, options: Options, *, early: bool) -> NoTextError:
    """The error of a run whose records were all bad: how many, the last, the fields they had instead."""
    if early:
        what = f"the first {bad:,} records are all bad, so the run stops here (the last: {last_bad})"
    else:
        what = f"all {bad:,} records are bad, so nothing was tokenized (the last: {last_bad})"
    fields = ""
    if reader.records_without_field:
        common = ", ".join(f"{name!r} ({count:,})" for name, count in reader.fields.most_common(8))
        fields = f"; {reader.records_without_field:,} of them lack the field, and have: {common}"
    array = _json_array(reader)
    if array is not None and not reader.records_without_field:  # a .json file that is one JSON value, not lines
        return NoTextError(
            f"{what}; {array} is one JSON array, not JSON Lines (an object a line): convert it first, as with "
            f"jq -c '.[]' {array} > corpus.jsonl"
        )
    return NoTextError(f"{what}{fields}; is --text-field {options.text_field!r} the field that holds the text?")


def _json_array(reader: DocumentReader) -> str | None:
    """The first local JSON input whose first character is `[` (a JSON array where JSON Lines belong), if any."""
    for source in reader.sources:
        if source.format != "jsonl" or storage.is_url(source.path) or source.compressed:
            continue
        try:
            with open(source.path, "rb") as file:
                head = file.read(4096).lstrip()
        except OSError:
            continue
        if head.startswith(b"["):
            return str(source.path)
    return None


def run(
    options: Options,
    *,
    report_bad: Callable[[str], None],
    progress: Callable[[Progress], None] | None = None,
    warn: Callable[[str], None] | None = None,
) -> Summary:
    """Pre-tokenize `options.inputs` into `options.output`; resumes an interrupted output of the same run.

    `report_bad` hears of each bad record, `warn` of anything else worth a line (default: `report_bad`)."""
    started = time.monotonic()
    warn = warn or report_bad
    if options.storage_options is not None:  # --storage-options, for the URLs of inputs and output
        storage.configure(options.storage_options)
    sources = [Source.from_path(path) for path in expand_inputs(options.inputs, warn, options.output)]
    if options.dialogue and any(source.format == "txt" for source in sources):
        plain = next(source.path for source in sources if source.format == "txt")
        what = options.kind.replace("_", "-")
        raise InputRefused(f"{plain}: plain text holds no {what} records; give JSON Lines or Parquet")
    corpus = [source.path for source in sources]  # the whole input list, also of a rank
    output, rank = options.output, None
    if options.rank is not None and options.world_size is not None:
        if (problem := rank_place_problem(options.output, options.world_size)) is not None:
            raise OutputError(problem)
        start, end = blocks([source.size for source in sources], options.world_size)[options.rank]
        rank = {
            "index": options.rank,
            "world_size": options.world_size,
            "inputs": [[source.path, source.size] for source in sources],
        }
        sources, output = sources[start:end], rank_directory(options.output, options.rank)
    check_first_parquet(sources, str(options.text_field), options.kind)  # a misnamed column: before any model loads
    with ExitStack() as stack:
        urls = options.urls
        model = (
            resolve_service_model(urls, options.model)
            if urls
            else resolve_local_model(options.model, options.chat_template)
        )
        options = special_tokens(options, model)
        loss_mask = dialogue_model(options, model) if options.dialogue else None
        out = output_for(output, options.staging)
        stack.callback(out.close)
        created = not out.path.exists()
        wanted = new_metadata(model, sources, options, loss_mask)
        if rank is not None:
            wanted["rank"] = rank
        metadata, complete = open_output(out, wanted)
        if complete:
            return Summary(out.where, metadata, len(metadata["shards"]), 0, 0, time.monotonic() - started, True)
        sources = [Source(**source) for source in metadata["sources"]]
        try:
            summary = _tokenize(
                options, model, out, metadata, sources, stack, rank, report_bad, progress, warn, started, corpus
            )
            return dataclasses.replace(summary, output=out.where)
        except NoTextError:
            if not metadata["shards"]:  # nothing of this output is worth keeping, and it would block a rerun
                out.discard(created)
            raise
        except ShadowMismatch as mismatch:
            # Shadow verification found fastokens wrong: the shard being built (in memory, not written) is
            # dropped, and the run goes on from the last shard written, with the reference library.
            warn(f"{mismatch}; restarting the shard being written, encoding with {model.library}")
            stack.close()  # the pool of fast workers
            model = dataclasses.replace(model, encoder=model.library, gate=None)  # and never promoted again
            metadata, _ = open_output(out, wanted)
            sources = [Source(**source) for source in metadata["sources"]]
            return _tokenize(
                options, model, out, metadata, sources, stack, rank, report_bad, progress, warn, started, corpus
            )


def _take_refused(
    batches: Iterable[tuple[TokenizedBatch, list[tuple[int, str]]]],
    positions: deque[Position],
    sources: list[Source],
    refused: dict[int, int],
    on_refused: Callable[[Position, str], None],
) -> Iterator[TokenizedBatch]:
    """The batches of conversations or records, with the positions of the items the tokenizer refused taken out
    of `positions` (each told to `on_refused` with its bad-record line, file:line, and counted in `refused` by
    source) and the positions after them corrected: those documents were counted good when read."""
    for batch, rejected in batches:
        reasons = dict(rejected)
        if not reasons:
            if refused:
                for _ in range(len(batch)):
                    positions.append(_corrected(positions.popleft(), refused))
                positions.rotate(len(batch))
            yield batch
            continue
        taken = [positions.popleft() for _ in range(len(batch) + len(reasons))]
        kept = []
        for index, position in enumerate(taken):
            if index in reasons:
                refused[position.source] = refused.get(position.source, 0) + 1
                on_refused(
                    position, f"{sources[position.source].path}:{position.lines}: {record_reason(reasons[index])}"
                )
            else:
                kept.append(_corrected(position, refused))
        positions.extendleft(reversed(kept))
        if len(batch):
            yield batch


def _corrected(position: Position, refused: dict[int, int]) -> Position:
    """`position` with the documents of its source refused before it moved to its bad records."""
    count = refused.get(position.source, 0)
    if not count:
        return position
    return position._replace(documents=position.documents - count, bad_records=position.bad_records + count)


def _tokenize(
    options: Options,
    model: ModelInfo,
    out: OutputDir,
    metadata: dict[str, Any],
    sources: list[Source],
    stack: ExitStack,
    rank: dict[str, Any] | None,
    report_bad: Callable[[str], None],
    progress: Callable[[Progress], None] | None,
    warn: Callable[[str], None],
    started: float,
    corpus: list[str],
) -> Summary:
    """The reading, tokenizing and writing of `run`, into an output that is open."""
    urls = options.urls
    shards_before = len(metadata["shards"])
    bad, last_bad, good = 0, "", 0

    # A conversations or records run's bad records found as it reads are held until the documents read before them
    # are written or refused: the chat template refuses a document when its chunk comes back, after the reader has
    # gone on. Each is released once no document before it waits (`release`): the lines come in the input's order.
    held: deque[tuple[tuple[int, int], str]] = deque()

    def release(before: tuple[int, int] | None) -> None:
        """Report the held bad records found before (source index, line) `before`; None: all of them."""
        while held and (before is None or held[0][0] < before):
            report_bad(held.popleft()[1])

    def on_refused(position: Position, message: str) -> None:
        """A document the tokenizer refused (its chat template, TRL's rule): a bad record at `position`."""
        nonlocal bad, last_bad
        release((position.source, position.lines))
        if options.strict:
            raise BadRecordError(message)
        bad, last_bad = bad + 1, message
        report_bad(message)

    def on_bad(message: str) -> None:
        """A record the reader could not take."""
        nonlocal bad, last_bad
        if options.strict:
            raise BadRecordError(message)
        bad, last_bad = bad + 1, message
        if options.dialogue and reader.bad_at is not None:
            held.append((reader.bad_at, message))
        else:
            report_bad(message)
        if bad == EARLY_BAD_RECORDS and not good and not shards_before and not text_ahead():
            # a wrong --text-field or the wrong files: say so now, not after reading the whole corpus
            raise all_bad(bad, last_bad, reader, options, early=True)

    def text_ahead() -> bool:
        """Whether one of the next few inputs of the whole corpus starts with a record that has the text field
        (bad records first, then good ones: read on)."""
        current = reader.current.path if reader.current is not None else None
        after = corpus.index(current) + 1 if current in corpus else 0
        return any(
            holds_text(path, str(options.text_field), options.kind) for path in corpus[after : after + LOOK_AHEAD_FILES]
        )

    # the local pool takes a Parquet column's texts as their UTF-8, as Arrow holds them (tokenizer_service.core.texts)
    utf8 = not urls and options.kind == TEXT
    reader = DocumentReader(sources, str(options.text_field), on_bad, warn, options.kind, utf8=utf8)
    positions: deque[Position] = deque()

    def texts() -> Iterator[Any]:
        nonlocal good
        for text, position in reader:
            good += 1
            positions.append(position)
            yield text

    encode = EncodeOptions(
        add_bos=options.add_bos, add_eos=bool(options.add_eos), parse_special_tokens=options.parse_special_tokens
    )
    kind = {CONVERSATIONS: "conversations", PROMPT_COMPLETION: "records"}.get(options.kind)
    encoded_by: collections.Counter[str] = collections.Counter()
    if urls:
        from tokenizer_client import TokenizerClient  # httpx: imported only by a run with --url
    if kind is not None and urls:
        masked_batches = tokenize_dialogue_via_service(
            stack.enter_context(TokenizerClient(urls, timeout=300)),
            kind,
            texts(),
            model=model.name,
            sha256=model.sha256,
            parse_special_tokens=options.parse_special_tokens,
            train_on=options.train_on,
            batch_size=SERVICE_BATCH,
            depth=SERVICE_DEPTH * len(urls),
        )
    elif kind is not None:
        from tokenizer_service.core.chat import ChatOptions

        pool = stack.enter_context(local_pool(model, options.workers))
        stack.callback(pool.shutdown, wait=True, cancel_futures=True)
        chat_options = ChatOptions(parse_special_tokens=options.parse_special_tokens, train_on=options.train_on)
        masked_batches = tokenize_dialogue_locally(
            pool, model.name, kind, texts(), chat_options, depth=2 * options.workers
        )
    elif urls:
        batches = tokenize_via_service(
            stack.enter_context(TokenizerClient(urls, timeout=300)),
            texts(),
            encode,
            model=model.name,
            sha256=model.sha256,
            batch_size=SERVICE_BATCH,
            depth=SERVICE_DEPTH * len(urls),
        )
    else:
        remaining = sum(source.size for source in sources if not source.done)
        workers = local_workers(model, remaining, options.workers)  # fewer for a small input on a fast encoder
        slots = shared_slots(2 * workers)  # one a chunk in flight
        if slots is not None:
            stack.callback(slots.close)  # after the pool's shutdown below (callbacks run last first)
            stack.callback(process.share, None)
        # forked now, so its reference library loads while this process builds the fast encoder
        verifier = start_verifier(model, remaining, start_method(model) == "fork")
        if verifier is not None:
            stack.callback(verifier.close)
        pool = stack.enter_context(local_pool(model, workers, remaining, slots, verified_apart=verifier is not None))
        stack.callback(pool.shutdown, wait=True, cancel_futures=True)  # also on Ctrl-C: first, cancel the rest
        chunk_chars = int(np.clip(remaining // (8 * workers), *LOCAL_CHUNK_CHARS))
        batches = tokenize_locally(
            pool,
            model.name,
            texts(),
            encode,
            chunk_chars=chunk_chars,
            depth=2 * workers,
            encoder=_gate_beside(model, remaining, stack, warn),
            encoded_by=encoded_by,
            slots=slots,
            verifier=verifier,
        )

    sink = make_sink(out, metadata, sources, model)
    if kind is not None:
        batches = _take_refused(masked_batches, positions, sources, sink.refused, on_refused)
    total_bytes = sum(source.size for source in sources)
    initial_bytes = sum(
        source.size if source.done else 0 if source.compressed else source.read_bytes for source in sources
    )
    documents = tokens = 0
    try:
        for batch in batches:
            count = len(batch)
            sink.add(batch.ids, batch.offsets, [positions.popleft() for _ in range(count)], batch.loss_mask)
            documents += count
            tokens += batch.num_tokens
            if held:
                release((positions[0].source, positions[0].lines) if positions else None)
            if progress is not None:
                progress(Progress(documents, tokens, reader.compressed_bytes_read(), initial_bytes, total_bytes))
    finally:
        release(None)  # what was read, said also where the run stops early
    if documents == 0 and bad and shards_before == 0 and rank is None:
        # Every record of a whole corpus bad: a wrong --text-field, or the wrong files. (A rank's
        # block may hold only bad records; the merge sees the whole.) Nothing written is worth
        # keeping, and leaving it would make the corrected command "another run's output" (run
        # removes it on this error).
        raise all_bad(bad, last_bad, reader, options, early=False)
    if documents == 0 and not bad and shards_before == 0 and rank is None:  # empty files: a "complete" empty output
        raise NoTextError("the inputs hold no record (they are empty), so nothing was tokenized: give the corpus")
    sink.finish()
    if kind is not None or urls:
        encoded_by = collections.Counter({model.encoder: documents})
    return Summary(
        out.path, metadata, shards_before, documents, tokens, time.monotonic() - started, encoded_by=dict(encoded_by)
    )


def gate_scan_min_bytes() -> int:
    return int(environment.number("TOKENIZER_GATE_SCAN_MIN_BYTES", GATE_SCAN_MIN_BYTES, whole=True))


def _gate_beside(
    model: ModelInfo, remaining: int, stack: ExitStack, warn: Callable[[str], None]
) -> Callable[[], str | None]:
    """What the next chunk is to be encoded with: with no cached gate verdict (the model announced with its
    library, gate pending), the gate runs beside the workers (tokenizer_service.core.gatescan) and, once it
    passes, fastokens encodes every later chunk (ids are the same either way). An input under
    `TOKENIZER_GATE_SCAN_MIN_BYTES` (default 8 MiB) is done before the scan would be: not scanned."""
    if model.gate != libraries.PENDING or remaining < gate_scan_min_bytes():
        return lambda: None
    scan = GateScan([(0, model)]).start()
    stack.callback(scan.close)  # a run that ends first stops it (nothing cached)
    encoder: str | None = None

    def current() -> str | None:
        nonlocal encoder
        for _, differs, seconds, route in scan.poll():
            if differs is None:
                encoder = route or libraries.FASTOKENS
                warn(
                    f"model {model.name!r}: the fast encoder's gate passed ({seconds:.1f}s of scan); "
                    f"later chunks are encoded by {encoder}"
                )
            else:
                warn(libraries.refusal_line(model.path, model.library, differs))
        return encoder

    return current
