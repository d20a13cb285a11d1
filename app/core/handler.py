"""What a worker process does with each job: all the per-text and per-token work of a request.

The server process only moves bytes. A request body goes to one worker as it arrived; that worker
parses and checks it, then either answers it whole (`DONE`: the answer's bytes, JSON or the
binary frame) or, when it is large and other workers may help, cuts it into chunks: it shares
every chunk but the first (`SHARE`, which the server hands to the other workers as `CHUNK` jobs),
runs the first itself and replies with its `PART`. Parsed once, and only the others' texts
travel. The server joins the parts' bytes into the answer (tokenizer_service.core.join); a split /v1/pack
request is packed by one more job (`FINISH` -> `DONE`). A seeded request goes whole to the
seeded sampler (`SPLIT`, one chunk).

Errors are replies too (`FAILED`, a ServiceError's dict): a worker never dies of bad input.
A job marked *careful* (a retry after its worker died or stalled) runs one text at a time and
writes the position of the text it is on into memory the server reads if this worker dies too:
that names the poison text.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import struct
import time
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from tokenizer_client import wire
from tokenizer_client.packing import PackedRows, pack_best_fit, pack_concat
from tokenizer_client.wire import ragged_offsets, split_ragged
from tokenizer_service.core import channel, chat, shadow
from tokenizer_service.core.errors import (
    InvalidField,
    ModelNotFound,
    PayloadTooLarge,
    PoisonInput,
    ServiceError,
    Unavailable,
)
from tokenizer_service.core.libraries import Library
from tokenizer_service.core.models import ModelInfo, find_model_files
from tokenizer_service.core.options import EncodeOptions
from tokenizer_service.core.poison import PoisonMemory
from tokenizer_service.core.protocol import (
    BINARY,
    DETOKENIZE,
    JSON,
    PACK,
    TOKENIZE,
    Chunk,
    PackContext,
    Result,
    read_chunk,
    read_finish,
    read_poison,
    read_request,
    read_result_head,
    result_blobs,
    split_payload,
)
from tokenizer_service.core.requests import (
    DetokenizeRequest,
    PackRequest,
    TokenizeRequest,
    parse_request,
)
from tokenizer_service.core.texts import readable, text_sizes

NO_OPTIONS = EncodeOptions()  # what a detokenize chunk carries

Parts = list[bytes | bytearray | memoryview]
Share = Callable[[int, Parts], None]  # sends a frame for the running job before its reply (a SHARE)


def no_share(kind: int, parts: Parts) -> None:
    raise RuntimeError("this job has no one to share chunks with")


@dataclass(frozen=True)
class Limits:
    """What the worker checks that the server was configured with."""

    max_texts: int
    max_seq_len: int
    min_chunk_chars: int
    max_request_bytes: int = 32 * 1024 * 1024
    shadow_rate: float = shadow.RATE  # shadow verification (tokenizer_service.core.shadow): share of texts checked
    shadow_interval: float = shadow.INTERVAL  # and at least one text per this many seconds of fast encoding


class TextMarker:
    """Where a careful job is: the text index in shared memory, -1 between texts."""

    def __init__(self, value: Any | None) -> None:
        self._value = value

    def mark(self, index: int) -> None:
        if self._value is not None:
            self._value.value = index


class Handler:
    """A worker's models and limits, and what it does with each kind of job."""

    def __init__(
        self,
        models: Sequence[ModelInfo],
        libraries: Sequence[Library],
        default: str,
        limits: Limits,
        progress: TextMarker,
    ) -> None:
        self.models = list(models)
        self.index = {info.name: position for position, info in enumerate(self.models)}
        self.default = default
        self.limits = limits
        self.progress = progress
        self.poison = PoisonMemory()
        self.libraries = list(libraries)
        self.chats: dict[int, chat.ChatTemplate] = {}  # compiled once per worker, on the first conversation
        self.records: dict[int, chat.Records] = {}

    # -- dispatch --------------------------------------------------------------------------------

    def handle(self, kind: int, payload: bytes | bytearray, share: Share = no_share) -> tuple[int, Parts]:
        """(reply kind, reply payload) for one job; bad input is a FAILED reply, never an exception.

        A REQUEST large enough to split sends its other chunks through `share` before it replies.
        """
        try:
            if kind == channel.REQUEST:
                return self.request(payload, share)
            if kind == channel.CHUNK:
                careful, chunk = read_chunk(payload)
                return channel.PART, self.chunk(chunk, careful).payload()
            if kind == channel.FINISH:
                return channel.DONE, self.finish(payload).payload()
            if kind == channel.PING:
                return channel.PONG, [struct.pack("<I", len(self.libraries))]
        except ServiceError as error:
            return channel.FAILED, [orjson.dumps(error.as_dict())]
        raise ValueError(f"unknown job kind {kind}")

    def remember_poison(self, payload: bytes | bytearray) -> None:
        model, length, digest = read_poison(payload)
        self.poison.add(self.models[model].name, digest, length)

    # -- requests --------------------------------------------------------------------------------

    def model(self, name: str | None) -> tuple[int, ModelInfo]:
        position = self.index.get(self.default if name is None else name)
        if position is None:
            raise ModelNotFound(
                f"model {name!r} is not served here; served models: {sorted(self.index)}", field="model"
            )
        return position, self.models[position]

    def request(self, payload: bytes | bytearray, share: Share) -> tuple[int, Parts]:
        route, binary, max_parts, careful, body = read_request(payload)
        if route == DETOKENIZE:
            return self.detokenize(body, max_parts, careful, share)
        request: TokenizeRequest | PackRequest
        if route == TOKENIZE:
            request = parse_request(body, TokenizeRequest, "texts", self.limits.max_texts)
        else:
            request = parse_request(body, PackRequest, "texts", self.limits.max_texts)
        position, info = self.model(request.model)
        if request.texts is None:  # conversations or prompt-completion records
            return self.dialogue(route, binary, request, position, info)
        texts = readable(request.texts, self.libraries[position])
        if (known := self.poison.find(info.name, texts)) is not None:
            raise PoisonInput(
                f"texts[{known}] was found earlier to crash or hang a tokenizer worker; it is refused",
                field="texts",
                index=known,
            )
        if self.libraries[position].normalizes:
            check_expansion(texts, len(body), self.limits.max_request_bytes)
        if isinstance(request, PackRequest):
            if request.carry_loss_mask is not None:  # it was ignored: a masked carried id kept its label
                raise InvalidField(
                    "carry_loss_mask is for conversations and records: texts have no loss mask, nor a pack of "
                    "them a leftover_loss_mask to send back",
                    field="carry_loss_mask",
                )
            context = pack_context(request, info, position, binary, self.limits.max_seq_len)
            # both already checked: request.add_bos by its schema, context.add_eos against the model
            options = EncodeOptions(
                add_bos=request.add_bos, add_eos=context.add_eos, parse_special_tokens=request.parse_special_tokens
            )
        else:
            context = None
            options = request.encode_options()
            check_special_tokens(options.add_bos, options.add_eos, info)
        seeded = options.seed is not None
        sizes = text_sizes(texts)
        parts = 1 if careful or seeded else max_parts
        bounds = chunk_bounds(sizes, parts, self.limits.min_chunk_chars)
        if seeded or len(bounds) > 1:
            # Seeded sampling reproduces ids only within one process: it runs on the seeded sampler.
            chunks = [
                Chunk(route, position, options, start, binary, texts=texts[start:end]) for start, end in bounds
            ] or [Chunk(route, position, options, 0, binary, texts=[])]
            units = np.array([int(sizes[start:end].sum()) for start, end in bounds] or [0], dtype=np.int64)
            if seeded:
                return channel.SPLIT, split_payload(position, route, len(texts), True, units, context, chunks)
            return self.shared(share, chunks, units, context, len(texts))
        started = time.monotonic()
        ids, offsets, seconds = self.encode(position, texts, options, 0, careful)
        if context is not None:
            return channel.DONE, self.packed(context, ids, offsets, len(texts), started, seconds).payload()
        tokens = int(offsets[-1])
        name = info.name
        if binary:
            parts_out = wire.encode_parts({"ids": ids, "offsets": offsets}, {"model": name, "num_tokens": tokens})
        else:
            content = {
                "model": name,
                "ids": split_ragged(ids, offsets),
                "lengths": np.diff(offsets),
                "num_tokens": tokens,
            }
            parts_out = [orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)]
        result = Result(position, binary, len(texts), tokens, started, seconds, math.nan, parts_out)
        return channel.DONE, result.payload()

    def detokenize(self, body: memoryview, max_parts: int, careful: bool, share: Share) -> tuple[int, Parts]:
        request = parse_request(body, DetokenizeRequest, "ids", self.limits.max_texts)
        position, info = self.model(request.model)
        ids, offsets = flatten_ids(request.ids, info.vocab_size)
        lengths = np.diff(offsets)
        bounds = chunk_bounds(lengths, 1 if careful else max_parts, self.limits.min_chunk_chars // 4)
        if len(bounds) > 1:
            chunks = [
                Chunk(
                    DETOKENIZE,
                    position,
                    NO_OPTIONS,
                    start,
                    False,
                    ids=ids[offsets[start] : offsets[end]],
                    offsets=offsets[start : end + 1] - offsets[start],
                )
                for start, end in bounds
            ]
            units = np.array([int(offsets[end] - offsets[start]) for start, end in bounds], dtype=np.int64)
            return self.shared(share, chunks, units, None, len(lengths))
        started = time.monotonic()
        texts = self.decode(position, ids, offsets, careful)
        content = orjson.dumps({"model": info.name, "texts": texts})
        seconds = time.monotonic() - started
        result = Result(position, JSON, len(texts), len(ids), started, seconds, math.nan, [content])
        return channel.DONE, result.payload()

    # -- conversations and prompt-completion records ---------------------------------------------------

    def dialogue(
        self, route: int, binary: bool, request: TokenizeRequest | PackRequest, position: int, info: ModelInfo
    ) -> tuple[int, Parts]:
        """Ids and loss masks of conversations (the chat template) or records, answered or packed whole here."""
        kind = request.inputs
        for name in ("add_bos", "add_eos", "sample", "max_length"):
            if getattr(request, name, None) not in (None, False):
                raise InvalidField(
                    f"{name} cannot be used with {kind}: the chat template (or, for records, TRL's rule) decides "
                    "the special tokens, and a truncated conversation would train on a cut turn",
                    field=name,
                )
        options = chat.ChatOptions(parse_special_tokens=request.parse_special_tokens, train_on=request.train_on)
        started = time.monotonic()
        if kind == "conversations":
            ids, lengths, mask = self.chat_template(position, info).encode(request.conversations, options)
        else:
            ids, lengths, mask = self.record_encoder(position, info).encode(request.records, options)
        seconds = time.monotonic() - started
        offsets = ragged_offsets(lengths)
        count, tokens = len(lengths), int(offsets[-1])
        if isinstance(request, PackRequest):
            context, packed = pack_dialogue(
                request, info, position, binary, self.limits.max_seq_len, ids, offsets, mask
            )
            padding = packed.stats.padding_fraction if packed.stats.rows else math.nan
            parts = pack_answer(info.name, context, packed)
            return channel.DONE, Result(position, binary, count, tokens, started, seconds, padding, parts).payload()
        if binary:
            parts_out = wire.encode_parts(
                {"ids": ids, "loss_mask": mask, "offsets": offsets}, {"model": info.name, "num_tokens": tokens}
            )
        else:
            content = {
                "model": info.name,
                "ids": split_ragged(ids, offsets),
                "loss_mask": split_ragged(mask, offsets),
                "lengths": np.diff(offsets),
                "num_tokens": tokens,
            }
            parts_out = [orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)]
        return channel.DONE, Result(position, binary, count, tokens, started, seconds, math.nan, parts_out).payload()

    def _files(self, info: ModelInfo) -> Any:
        files = find_model_files(info.name, info.path, info.chat_template_path)
        if files.sha256 != info.sha256:
            raise Unavailable(
                f"model {info.name!r}: its files or chat template changed since the server started; restart it"
            )
        return files

    def chat_template(self, position: int, info: ModelInfo) -> chat.ChatTemplate:
        found = self.chats.get(position)
        if found is None:
            if info.chat_template is None:
                raise InvalidField(
                    f"model {info.name!r} has no chat template; pass --chat-template {info.name}=FILE (a Jinja "
                    "template with {% generation %} marks) to tokenize conversations",
                    field="conversations",
                )
            if info.chat_template["loss_mask"] is None:
                raise InvalidField(chat.no_mask_message(info.name), field="conversations")
            files = self._files(info)
            library = self.libraries[position]
            found = chat.ChatTemplate(info.name, files.template, library, chat.special_tokens(files, library))
            self.chats[position] = found
        return found

    def record_encoder(self, position: int, info: ModelInfo) -> chat.Records:
        found = self.records.get(position)
        if found is None:
            library = self.libraries[position]
            found = chat.Records(library, chat.special_tokens(self._files(info), library).get("eos"))
            self.records[position] = found
        return found

    # -- chunks of split requests ------------------------------------------------------------------

    def shared(
        self, share: Share, chunks: list[Chunk], units: np.ndarray, context: PackContext | None, texts: int
    ) -> tuple[int, Parts]:
        """Share every chunk but the first with the other workers (SHARE), then run the first here: its PART."""
        first = chunks[0]
        share(channel.SHARE, split_payload(first.model, first.route, texts, False, units[1:], context, chunks[1:]))
        return channel.PART, self.chunk(first, careful=False).payload()

    def chunk(self, chunk: Chunk, careful: bool) -> Result:
        started = time.monotonic()
        if chunk.route == DETOKENIZE:
            assert chunk.ids is not None and chunk.offsets is not None
            texts = self.decode(chunk.model, chunk.ids, chunk.offsets, careful, chunk.first_index)
            fragment = orjson.dumps(texts)[1:-1]
            seconds = time.monotonic() - started
            return Result(chunk.model, JSON, len(texts), len(chunk.ids), started, seconds, math.nan, [fragment])
        assert chunk.texts is not None
        ids, offsets, seconds = self.encode(chunk.model, chunk.texts, chunk.options, chunk.first_index, careful)
        lengths = np.diff(offsets)
        if chunk.binary or chunk.route == PACK:
            blobs = channel.join_blobs([memoryview(ids).cast("B"), memoryview(lengths).cast("B")])
        else:
            rows = orjson.dumps(split_ragged(ids, offsets), option=orjson.OPT_SERIALIZE_NUMPY)[1:-1]
            blobs = channel.join_blobs([rows, orjson.dumps(lengths, option=orjson.OPT_SERIALIZE_NUMPY)[1:-1]])
        content = BINARY if chunk.binary else JSON
        return Result(chunk.model, content, len(chunk.texts), int(offsets[-1]), started, seconds, math.nan, blobs)

    def finish(self, payload: bytes | bytearray) -> Result:
        """Pack the parts of a split /v1/pack request: blobs = context, then each PART payload."""
        context, parts = read_finish(payload)
        started = time.monotonic()
        id_parts, length_parts, worked = [], [], 0.0
        for part in parts:
            worked += read_result_head(part).seconds
            ids, lengths = result_blobs(part)
            id_parts.append(np.frombuffer(ids, dtype=np.int32))
            length_parts.append(np.frombuffer(lengths, dtype=np.int64))
        all_ids = np.concatenate(id_parts) if id_parts else np.zeros(0, dtype=np.int32)
        offsets = ragged_offsets(np.concatenate(length_parts) if length_parts else np.zeros(0, dtype=np.int64))
        return self.packed(context, all_ids, offsets, len(offsets) - 1, started, worked)

    # -- tokenizing ----------------------------------------------------------------------------------

    def encode(
        self, model: int, texts: Sequence[str], options: EncodeOptions, first_index: int, careful: bool
    ) -> tuple[np.ndarray, np.ndarray, float]:
        """(ids, offsets, seconds): exactly what the model's library gives for each text in-process, in order."""
        started = time.monotonic()
        library = self.libraries[model]
        texts = readable(texts, library)
        if careful:
            id_parts, length_parts = [], []
            for position, text in enumerate(texts):
                self.progress.mark(position + first_index)
                one_ids, one_length = library.encode([text], options, first_index + position)
                id_parts.append(one_ids)
                length_parts.append(one_length)
            self.progress.mark(-1)
            ids = np.concatenate(id_parts) if id_parts else np.zeros(0, dtype=np.int32)
            lengths = np.concatenate(length_parts) if length_parts else np.zeros(0, dtype=np.int64)
        else:
            ids, lengths = library.encode(texts, options, first_index)
        return ids, ragged_offsets(lengths), time.monotonic() - started

    def decode(
        self, model: int, ids: np.ndarray, offsets: np.ndarray, careful: bool, first_index: int = 0
    ) -> list[str]:
        library = self.libraries[model]
        bounds = offsets.tolist()
        rows = [ids[start:end].tolist() for start, end in itertools.pairwise(bounds)]
        if not careful:
            return decode_rows(library, rows, first_index)
        texts = []
        for position, row in enumerate(rows):
            self.progress.mark(first_index + position)
            texts.extend(decode_rows(library, [row], first_index + position))
        self.progress.mark(-1)
        return texts

    def packed(
        self, context: PackContext, ids: np.ndarray, offsets: np.ndarray, texts: int, started: float, seconds: float
    ) -> Result:
        info = self.models[context.model]
        carry = None if context.carry is None else np.asarray(context.carry, dtype=np.int32)
        if context.strategy == "concat":
            eos_id = info.eos_id if context.add_eos and info.eos_id >= 0 else None
            packed = pack_concat(
                ids,
                offsets,
                context.seq_len,
                carry=carry,
                carry_document_starts=context.carry_document_starts,
                eos_id=eos_id,
                mask_document_start=context.mask_document_start,
            )
        else:
            packed = pack_best_fit(
                ids, offsets, context.seq_len, pad_id=info.padding_id, mask_document_start=context.mask_document_start
            )
        padding = packed.stats.padding_fraction if packed.stats.rows else math.nan
        parts = pack_answer(info.name, context, packed)
        return Result(context.model, context.binary, texts, int(offsets[-1]), started, seconds, padding, parts)


def decode_rows(library: Library, rows: list[list[int]], first_index: int) -> list[str]:
    """The library's decode of each row; a row it cannot decode is named by its index in the request."""
    try:
        return library.decode(rows)
    except InvalidField as error:
        if error.index is None:
            raise
        index = error.index + first_index
        raise InvalidField(
            error.message.replace(f"ids[{error.index}]", f"ids[{index}]", 1), field="ids", index=index
        ) from None


def check_special_tokens(add_bos: bool, add_eos: bool, info: ModelInfo) -> None:
    """A model without BOS (or EOS) cannot add one: say so, naming the field (sentencepiece would raise)."""
    if add_bos and info.bos_id < 0:
        raise InvalidField(f"model {info.name!r} has no BOS token (bos_id -1): add_bos cannot be true", field="add_bos")
    if add_eos and info.eos_id < 0:
        raise InvalidField(f"model {info.name!r} has no EOS token (eos_id -1): add_eos cannot be true", field="add_eos")


EXPANSION_SLICE = 65536
# Unicode compatibility normalization grows a character's UTF-8 at most 11-fold (U+FDFA: 3 bytes -> 33),
# and no character above U+2FA1D decomposes (Unicode 15; checked by tests/test_units.py).
NFKC_MAX_GROWTH = 11
DECOMPOSING_BELOW = 0x30000


@functools.cache
def growth_table() -> np.ndarray:
    """Bytes each code point can add under NFKD (>= what NFKC adds); only those below U+30000 decompose.
    Built once a process, 0.2 s, and only when a request is large enough to need it."""
    table = np.zeros(0x110000, dtype=np.int8)  # every code point: a lookup needs no clipping
    for point in range(DECOMPOSING_BELOW):
        char = chr(point)
        if (unicodedata.decomposition(char) or 0xAC00 <= point <= 0xD7A3) and not 0xD800 <= point <= 0xDFFF:
            table[point] = max(0, len(unicodedata.normalize("NFKD", char).encode()) - len(char.encode()))
    return table


GROWTH_WINDOW = 1 << 20  # characters looked up at once: a bounded buffer however large the request


def growth_bound(texts: list[str]) -> int:
    """At most how many bytes NFKC can add to these texts: each character's own NFKD growth, summed.

    Decomposition is per character and composition only shortens, so the sum bounds every text. The
    texts are looked up a window of characters at a time, so small texts cost one numpy call together."""
    table = growth_table()
    total = 0

    def add(window: str) -> None:
        nonlocal total
        points = np.frombuffer(window.encode("utf-32-le", "surrogatepass"), dtype="<u4")
        total += int(table[points].sum(dtype=np.int64))

    pending: list[str] = []
    size = 0
    for text in texts:
        if len(text) > GROWTH_WINDOW:
            for start in range(0, len(text), GROWTH_WINDOW):
                add(text[start : start + GROWTH_WINDOW])
            continue
        pending.append(text)
        size += len(text)
        if size >= GROWTH_WINDOW:
            add("".join(pending))
            pending, size = [], 0
    if pending:
        add("".join(pending))
    return total


def check_expansion(texts: list[str], body_bytes: int, limit: int) -> None:
    """Refuse (413, naming the text) a request whose texts normalize into more than `limit` bytes.

    SentencePiece normalizes (NFKC) before it tokenizes, and some characters expand many times
    (U+FDFA becomes 18 characters): 8 MiB of them took a worker to 2.7 GiB. A request may produce at
    most as many normalized bytes as a body may have. Three steps, each only when the one before cannot
    clear the request, so ordinary text pays nothing measurable: a body that could not pass the limit
    even if every byte grew 11-fold (NFKC's worst) is not looked at; then a per-character bound
    (a table lookup over the code points); only then is an expanding text normalized, in slices, so the
    check stops as soon as the request is over the limit, without building the whole expansion.
    """
    if body_bytes * NFKC_MAX_GROWTH <= limit:
        return
    if body_bytes + growth_bound(texts) <= limit:
        return
    total = body_bytes
    for index, text in enumerate(texts):
        if unicodedata.is_normalized("NFKC", text):
            continue
        for start in range(0, len(text), EXPANSION_SLICE):
            piece = text[start : start + EXPANSION_SLICE]
            grown = len(unicodedata.normalize("NFKC", piece).encode("utf-8", "surrogatepass"))
            total += max(0, grown - len(piece.encode("utf-8", "surrogatepass")))
            if total > limit:
                raise PayloadTooLarge(
                    f"texts[{index}] expands under Unicode normalization (NFKC) so that the request would "
                    f"tokenize more than {limit} bytes of text, the request limit; send it in smaller requests",
                    field="texts",
                    index=index,
                )


def chunk_bounds(sizes: np.ndarray, max_chunks: int, min_chunk_size: int) -> list[tuple[int, int]]:
    """Split items with these sizes into at most `max_chunks` contiguous runs of similar total size.

    A run is never smaller than `min_chunk_size` (unless it is the only one), so small requests stay
    on one worker and pay one process round trip.
    """
    count = len(sizes)
    if count == 0:
        return []
    total = int(sizes.sum())
    chunks = max(1, min(max_chunks, count, total // max(min_chunk_size, 1)))
    if chunks == 1:
        return [(0, count)]
    cumulative = np.cumsum(sizes)
    targets = total * np.arange(1, chunks) / chunks
    cuts = np.searchsorted(cumulative, targets, side="left") + 1
    edges = sorted({0, count, *(int(c) for c in cuts if 0 < c < count)})
    return list(itertools.pairwise(edges))


def flatten_ids(rows: list[list[int]], vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Ragged int32 ids from JSON rows, refusing (422, with the row) any id outside the vocabulary."""
    arrays = []
    for index, row in enumerate(rows):
        try:
            array = np.asarray(row, dtype=np.int64)
        except OverflowError:
            array = None
        if array is None or (len(array) and (array.min() < 0 or array.max() >= vocab_size)):
            bad = next(i for i in row if not 0 <= i < vocab_size)
            raise InvalidField(
                f"ids[{index}] holds {bad}, outside the vocabulary [0, {vocab_size})", field="ids", index=index
            )
        arrays.append(array)
    lengths = np.fromiter((len(array) for array in arrays), dtype=np.int64, count=len(arrays))
    flat = np.concatenate(arrays).astype(np.int32) if arrays else np.zeros(0, dtype=np.int32)
    return flat, ragged_offsets(lengths)


def pack_context(request: PackRequest, info: ModelInfo, model: int, binary: bool, max_seq_len: int) -> PackContext:
    """Check a /v1/pack request's packing fields (422 naming the field) and keep what packing needs."""
    if not 2 <= request.seq_len <= max_seq_len:
        raise InvalidField(f"seq_len must be between 2 and {max_seq_len}, got {request.seq_len}", field="seq_len")
    add_eos = info.eos_id >= 0 if request.add_eos is None else request.add_eos
    check_special_tokens(request.add_bos, add_eos, info)
    check_carry_starts(request)
    if request.carry is not None:
        if request.strategy != "concat":
            raise InvalidField("carry is only meaningful with strategy 'concat'", field="carry")
        for position, token in enumerate(request.carry):
            if not 0 <= token < info.vocab_size:
                raise InvalidField(
                    f"carry[{position}] is {token}, outside the vocabulary [0, {info.vocab_size})",
                    field="carry",
                    index=position,
                )
    return PackContext(
        model=model,
        binary=binary,
        seq_len=request.seq_len,
        strategy=request.strategy,
        add_eos=add_eos,
        carry=request.carry,
        carry_document_starts=request.carry_document_starts,
        mask_document_start=request.mask_document_start,
    )


def check_carry_starts(request: PackRequest) -> None:
    """Positions in the carry where documents begin: what makes many requests pack like one."""
    starts = request.carry_document_starts
    if starts is None:
        return
    if request.strategy != "concat":
        raise InvalidField(
            "carry_document_starts is only meaningful with strategy 'concat'", field="carry_document_starts"
        )
    if request.carry is None:
        raise InvalidField("carry_document_starts needs the carry it describes", field="carry_document_starts")
    previous = -1
    for position, start in enumerate(starts):
        if not previous < start < len(request.carry):
            raise InvalidField(
                f"carry_document_starts[{position}] is {start}: starts must increase and lie in the carry "
                f"[0, {len(request.carry)})",
                field="carry_document_starts",
                index=position,
            )
        previous = start


def pack_dialogue(
    request: PackRequest,
    info: ModelInfo,
    model: int,
    binary: bool,
    max_seq_len: int,
    ids: np.ndarray,
    offsets: np.ndarray,
    mask: np.ndarray,
) -> tuple[PackContext, PackedRows]:
    """Pack conversations' ids with their loss masks: labels are -100 wherever the mask is 0. The packing fields
    are checked as for texts (pack_context); the template, not add_eos, decides each conversation's end."""
    context = dataclasses.replace(pack_context(request, info, model, binary, max_seq_len), add_eos=False)
    carry = None if request.carry is None else np.asarray(request.carry, dtype=np.int32)
    carry_mask = request.carry_loss_mask
    if carry_mask is not None and (carry is None or len(carry_mask) != len(carry)):
        raise InvalidField(
            "carry_loss_mask needs the carry it describes, one 0/1 per carried id", field="carry_loss_mask"
        )
    if carry is not None and len(carry) and carry_mask is None:  # every carried id would train: the prompts too
        raise InvalidField(
            "carry with conversations or records needs carry_loss_mask: send back the leftover_loss_mask of the "
            "answer the leftover came from (all ones to train on every carried id)",
            field="carry_loss_mask",
        )
    if request.strategy == "concat":
        packed = pack_concat(
            ids,
            offsets,
            request.seq_len,
            carry=carry,
            carry_document_starts=request.carry_document_starts,
            mask_document_start=request.mask_document_start,
            loss_mask=mask,
            carry_loss_mask=carry_mask,
        )
    else:
        packed = pack_best_fit(
            ids,
            offsets,
            request.seq_len,
            pad_id=info.padding_id,
            mask_document_start=request.mask_document_start,
            loss_mask=mask,
        )
    return context, packed


def pack_answer(model: str, context: PackContext, packed: PackedRows) -> Sequence[bytes | bytearray | memoryview]:
    if context.binary:
        arrays = packed.arrays()
        meta = {
            "model": model,
            "seq_len": context.seq_len,
            "strategy": context.strategy,
            "stats": packed.stats.as_dict(),
        }
        return wire.encode_parts(arrays, meta)
    content = {
        "model": model,
        "seq_len": context.seq_len,
        "strategy": context.strategy,
        "input_ids": packed.input_ids,
        "labels": packed.labels,
        "position_ids": packed.position_ids,
        "cu_seqlens": split_ragged(packed.cu_seqlens, packed.cu_seqlens_offsets),
        "leftover": packed.leftover,
        "leftover_document_starts": packed.leftover_document_starts,
        "stats": packed.stats.as_dict(),
    }
    if packed.leftover_loss_mask is not None:
        content["leftover_loss_mask"] = packed.leftover_loss_mask
    return [orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)]
