"""Request bodies: their pydantic schemas (validated in Rust), and parsing them from bytes in the workers.

orjson parses on the fast path; every refusal says where (the field and the index).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, TypeVar

import numpy as np
import orjson
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    WithJsonSchema,
    model_validator,
)
from pydantic_core import PydanticCustomError

from tokenizer_client import wire
from tokenizer_service.core.errors import InvalidField, InvalidJSON, PayloadTooLarge
from tokenizer_service.core.options import EncodeOptions
from tokenizer_service.core.options import SampleOptions as Sampling
from tokenizer_service.core.texts import Utf8Texts, all_valid

MAX_NBEST_SIZE = 512
"""sentencepiece's kMaxNBestSize; it raises on 0, 1 or more."""

INT32_MAX = (1 << 31) - 1
"""One bound for every integer field that is a length, a position or an id: ids and lengths travel as int32."""

Id = Annotated[StrictInt, Field(ge=0, le=INT32_MAX)]  # a token id (the model's vocabulary is checked later)
Count = Annotated[StrictInt, Field(ge=0, le=INT32_MAX)]  # a length or a position


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _check_nbest_size(value: int) -> int:
    if value == -1 or 2 <= value <= MAX_NBEST_SIZE:
        return value
    raise ValueError(f"must be -1 (sample from every segmentation) or between 2 and {MAX_NBEST_SIZE}, got {value}")


NBestSize = Annotated[
    StrictInt,
    AfterValidator(_check_nbest_size),
    WithJsonSchema(
        {"anyOf": [{"type": "integer", "const": -1}, {"type": "integer", "minimum": 2, "maximum": MAX_NBEST_SIZE}]}
    ),
]


class SampleOptions(_Body):
    """SentencePiece subword regularization; the same seed gives the same ids (the schema of
    tokenizer_service.core.options.SampleOptions)."""

    alpha: Annotated[float, Field(strict=True, gt=0, le=1)] = 0.1  # strict float still takes a JSON 1
    nbest_size: NBestSize = -1
    seed: Annotated[StrictInt, Field(ge=0, lt=1 << 32)] | None = None


class EncodeFields(_Body):
    """How texts become ids: the options of /v1/tokenize, declared once; `encode_options()` is what a worker
    encodes with (tokenizer_service.core.options.EncodeOptions)."""

    add_bos: StrictBool = False
    add_eos: StrictBool = False
    max_length: Count | None = None
    sample: SampleOptions | None = None
    parse_special_tokens: StrictBool = False  # special-token strings in the text become their ids

    def encode_options(self) -> EncodeOptions:
        """The options alone, as a worker takes them (without the texts, and without pydantic)."""
        sample = self.sample
        return EncodeOptions(
            add_bos=self.add_bos,
            add_eos=self.add_eos,
            max_length=self.max_length,
            sample=None if sample is None else Sampling(sample.alpha, sample.nbest_size, sample.seed),
            parse_special_tokens=self.parse_special_tokens,
        )


# A conversation: OpenAI messages. Checked by tokenizer_service.core.chat (each refusal names the conversation and
# the message), so the schema documents them and validation leaves them as they came.
MESSAGE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"type": "string"},
        "content": {
            "anyOf": [
                {"type": "string"},
                {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["type", "text"],
                        "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
                    },
                },
                {"type": "null"},
            ]
        },
        "train": {"type": "boolean", "description": "override: train on this assistant turn or not"},
    },
    "additionalProperties": True,
}
Conversations = Annotated[
    list[Any], WithJsonSchema({"type": "array", "items": {"type": "array", "items": MESSAGE_SCHEMA}})
]
Records = Annotated[
    list[Any],
    WithJsonSchema(
        {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["prompt", "completion"],
                "properties": {"prompt": {"type": "string"}, "completion": {"type": "string"}},
                "additionalProperties": False,
            },
        }
    ),
]
INPUTS = ("texts", "conversations", "records")


class _TextsAndModel(_Body):
    texts: list[StrictStr] | None = None
    conversations: Conversations | None = None  # instead of texts: chat template, ids and loss masks
    records: Records | None = None  # instead of texts: prompt-completion records, as TRL's SFT trainer
    model: StrictStr | None = None
    train_on: Literal["assistant", "last"] = "assistant"  # conversations: every assistant turn, or the last

    @property
    def inputs(self) -> str:
        """Which of texts, conversations and records the request gave (exactly one)."""
        return next(name for name in INPUTS if getattr(self, name) is not None)

    @model_validator(mode="after")
    def _exactly_one_input(self) -> Any:
        given = [name for name in INPUTS if getattr(self, name) is not None]
        if len(given) != 1:
            raise PydanticCustomError(
                "inputs",
                "give exactly one of texts, conversations and records (got {given})",
                {"given": ", ".join(given) or "none", "field": given[1] if given else "texts"},
            )
        return self


class TokenizeRequest(EncodeFields, _TextsAndModel):  # texts and model first, as before the options
    pass


class DetokenizeRequest(_Body):
    ids: list[list[Id]]
    model: StrictStr | None = None


def openapi_body(model: type[BaseModel]) -> dict[str, object]:
    """`openapi_extra` for a route that parses its own body, so the schema still documents it."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    definitions = schema.pop("$defs", {})
    return {
        "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
        "x-components": definitions,
    }


# What JSON Schema can say of /v1/pack beyond each field: the carry and its document starts belong to
# concat, and the starts need the carry they describe (the server refuses the rest with a 422).
PACK_CONSTRAINTS: dict[str, object] = {
    "dependentRequired": {"carry_document_starts": ["carry"]},
    "if": {"properties": {"strategy": {"const": "best_fit"}}, "required": ["strategy"]},
    "then": {"properties": {"carry": {"type": "null"}, "carry_document_starts": {"type": "null"}}},
}


class PackRequest(_TextsAndModel):
    model_config = ConfigDict(extra="forbid", frozen=True, json_schema_extra=PACK_CONSTRAINTS)

    seq_len: Annotated[StrictInt, Field(ge=2, le=INT32_MAX)]  # and at most --max-seq-len (in the published schema)
    strategy: Literal["concat", "best_fit"] = "concat"
    add_bos: StrictBool = False
    add_eos: StrictBool | None = None  # EOS after each document when the model has one
    carry: list[Id] | None = None
    carry_document_starts: list[Count] | None = None
    carry_loss_mask: list[Annotated[StrictInt, Field(ge=0, le=1)]] | None = None  # the carry's loss mask
    mask_document_start: StrictBool = False
    parse_special_tokens: StrictBool = False


# -- parsing a body --------------------------------------------------------------------------------

Body = TypeVar("Body", bound=BaseModel)

JSON_MAX_DEPTH = 1024  # orjson's limit; the stdlib fallback never sees a deeper body


def parse_request(raw: bytes | bytearray | memoryview, model: type[Body], items: str, max_items: int) -> Body:
    """Parse and validate a body whose list field `items` (texts, id rows) is capped at `max_items`.

    Runs in a worker process; the server checked the byte limit. Every refusal says where: 413 over
    the item limit, 400 for bad JSON, 422 with the field and index (a lone surrogate in a text
    included, which SentencePiece cannot take).
    """
    if bytes(raw[: len(wire.MAGIC)]) == wire.MAGIC:  # a binary frame (JSON never starts so): texts as UTF-8 arrays
        if items != "texts":
            raise InvalidJSON(f"an {wire.MEDIA_TYPE} request body carries texts; this endpoint takes JSON")
        document = texts_document(raw, max_items)
        texts = document.pop("texts")
        # validated without its texts (each checked UTF-8 already, and kept so: tokenizer_service.core.texts)
        return validate(model, {**document, "texts": []}).model_copy(update={"texts": texts})
    document, lenient = parse_json(raw)
    check_item_count(document, items, max_items)
    if items == "texts":
        check_item_count(document, "conversations", max_items)
        check_item_count(document, "records", max_items)
    # only the stdlib fallback lets a lone surrogate through (orjson refuses one): found wherever it is
    if lenient and isinstance(document, dict) and (found := find_lone_surrogate(document)) is not None:
        path, position = found
        where = _path_text(path)
        names = [part for part in path if isinstance(part, str)]
        indices = [part for part in path if isinstance(part, int)]
        if position < 0:
            what = f"a key of {where or 'the request body'} has a lone surrogate"
        else:
            what = f"{where} has a lone surrogate at character {position}"
        raise InvalidField(
            f"{what}; text must be valid Unicode",
            field=names[0] if names else None,
            index=indices[0] if indices else None,
        )
    return validate(model, document)


def texts_document(raw: bytes | bytearray | memoryview, max_items: int) -> dict[str, Any]:
    """The request a binary body (tokenizer_client's `texts_frame`) stands for: its meta's fields, with `texts`
    (a `Utf8Texts`: each text checked to be UTF-8, none decoded) from the frame's arrays ``texts`` (uint8, the
    texts' UTF-8 end to end) and ``offsets`` (int64, one more than there are texts: each text's first byte, then
    the end). Every refusal says what and where."""
    try:
        frame = wire.decode(raw)
    except wire.WireFormatError as exc:
        raise InvalidJSON(f"request body is not a valid {wire.MEDIA_TYPE} frame: {exc}") from None
    if not isinstance(frame.meta, dict):
        raise InvalidField(f"an {wire.MEDIA_TYPE} body's meta must be an object of the request's fields")
    if set(frame.arrays) != {"texts", "offsets"}:
        raise InvalidField(
            f"an {wire.MEDIA_TYPE} body carries two arrays, texts (uint8, the texts' UTF-8 end to end) and offsets "
            f"(int64, where each text starts, then the end), not {sorted(frame.arrays)}",
            field="texts",
        )
    if inside := sorted(set(frame.meta) & {"texts", "conversations", "records"}):
        raise InvalidField(
            f"{inside[0]} cannot be in a binary body's meta: the texts travel as its arrays", field=inside[0]
        )
    data, offsets = frame.arrays["texts"], frame.arrays["offsets"]
    if data.dtype != np.uint8 or data.ndim != 1 or offsets.dtype != np.int64 or offsets.ndim != 1 or not len(offsets):
        raise InvalidField(
            f"a binary body's texts must be 1-D uint8 and its offsets 1-D int64 with at least one entry, not "
            f"{data.dtype} {list(data.shape)} and {offsets.dtype} {list(offsets.shape)}",
            field="texts",
        )
    count = len(offsets) - 1
    if count > max_items:
        raise PayloadTooLarge(f"{count} texts in one request exceed the limit of {max_items}", field="texts")
    bounds = offsets.tolist()
    if bounds[0] != 0 or bounds[-1] != len(data):
        raise InvalidField(
            f"a binary body's offsets must run from 0 to the {len(data)} bytes of its texts, not {bounds[0]} to "
            f"{bounds[-1]}",
            field="texts",
        )
    text_bytes = data.tobytes()
    if not (bool(np.all(offsets[1:] >= offsets[:-1])) and all_valid(text_bytes, offsets)):
        refuse_texts(text_bytes, bounds)
    texts = Utf8Texts(text_bytes, bounds)
    return {**frame.meta, "texts": texts}


def refuse_texts(data: bytes, bounds: list[int]) -> None:
    """Raise the 422 for the first text whose offsets go down or whose bytes are not UTF-8."""
    view = memoryview(data)
    for index in range(len(bounds) - 1):
        start, end = bounds[index], bounds[index + 1]
        if end < start:
            raise InvalidField(f"texts[{index}]: its offsets go down ({start} to {end})", field="texts", index=index)
        try:
            str(view[start:end], "utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidField(
                f"texts[{index}] is not valid UTF-8 (its byte {exc.start}); text must be valid Unicode",
                field="texts",
                index=index,
            ) from None
    raise AssertionError("refuse_texts found every text valid")


def check_item_count(document: object, field: str, limit: int) -> None:
    """413 before validation, so an oversized list costs no per-item work."""
    if isinstance(document, dict):
        items = document.get(field)
        if isinstance(items, list) and len(items) > limit:
            raise PayloadTooLarge(f"{len(items)} {field} in one request exceed the limit of {limit}", field=field)


def parse_json(raw: bytes | bytearray | memoryview) -> tuple[Any, bool]:
    """Parse with orjson; fall back to the stdlib only to explain what orjson refused, or where orjson would change
    what a chat template renders.

    Returns the document and whether it came from the fallback (which, unlike orjson, lets lone
    surrogates through as str, so the caller must look for them). The body must be UTF-8: the
    stdlib would also take UTF-16 and UTF-32, which the API does not. JSON nested deeper than
    orjson's limit (1,024 levels) is refused as such, never parsed by a recursive fallback. NaN and
    Infinity, which the stdlib reads, are not JSON: refused. orjson reads an integer beyond 64 bits as a float
    (100000000000000000000 as 1e+20): in conversations and records, which a template renders as a user's
    json.loads would read them, such a body is read again by the stdlib, whose integers are exact.
    """
    fast_error: orjson.JSONDecodeError | None = None
    try:
        document = orjson.loads(raw)
        if not _inexact_integers(document):
            return document, False
    except orjson.JSONDecodeError as error:
        if "depth limit" in str(error):
            raise InvalidJSON(f"request body nests deeper than {JSON_MAX_DEPTH} levels") from None
        fast_error = error
    try:
        text = bytes(raw).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidJSON(f"request body is not valid UTF-8 (byte {exc.start})") from exc
    try:
        return json.loads(text, parse_int=_integer, parse_constant=_not_json), True
    except RecursionError:
        raise InvalidJSON(f"request body nests deeper than {JSON_MAX_DEPTH} levels") from None
    except _NotJSON as exc:
        raise InvalidJSON(f"request body is not valid JSON: {exc}") from None
    except ValueError as exc:
        raise InvalidJSON(f"request body is not valid JSON: {fast_error or exc}") from fast_error


class _NotJSON(ValueError):
    pass


def _not_json(constant: str) -> Any:
    raise _NotJSON(f"{constant} is no JSON number (a number is finite and written in digits)")


_INEXACT = float(2**63)  # orjson reads integers from -2**63 to 2**64 - 1 exactly, larger ones as floats


def _inexact_integers(document: Any) -> bool:
    """Whether the conversations or records of a parsed body hold a float as large as an integer orjson would
    not read exactly (walked without recursion; their strings are not read)."""
    if not isinstance(document, dict):
        return False
    stack = [document.get(name) for name in ("conversations", "records") if document.get(name) is not None]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
        elif isinstance(value, float) and abs(value) >= _INEXACT and value.is_integer():
            return True
    return False


# An integer of more digits than Python converts from text (4,300) stands for itself as one of this size: it is
# then refused by the field's bounds, a 422 naming the field, like any other integer too large for it.
_DIGITS_MOST = 4000
_TOO_LARGE = 10**_DIGITS_MOST


def _integer(digits: str) -> int:
    if len(digits) <= _DIGITS_MOST:
        return int(digits)
    return -_TOO_LARGE if digits.startswith("-") else _TOO_LARGE


def _field_path(location: tuple[int | str, ...]) -> tuple[str, int | None]:
    names = [str(part) for part in location if isinstance(part, str)]
    indices = [part for part in location if isinstance(part, int)]
    return ".".join(names), (indices[0] if indices else None)


def validate(model: type[Body], document: Any) -> Body:
    """Validate a parsed document, turning the first pydantic error into a 422 naming field and index."""
    if not isinstance(document, dict):
        raise InvalidField(f"request body must be a JSON object, not {type(document).__name__}")
    tries = 0
    while True:
        try:
            return model.model_validate(document)
        except ValidationError as exc:
            error = exc.errors(include_url=False)[0]
        tries += 1
        if tries > _EXACT_AGAIN_MOST or not _exact_again(document, error):
            break
    field, index = _field_path(tuple(error["loc"]))
    if error["type"] == "inputs":  # which of texts, conversations and records: the body as a whole
        field = error["ctx"]["field"]
    message = error["msg"]
    if index is not None:
        message = f"{field}[{index}]: {message}"
    elif field:
        message = f"{field}: {message}"
    raise InvalidField(message, field=field or None, index=index)


_EXACT_AGAIN_MOST = 4  # fields whose integer beyond 64 bits is put back, one after the other, for their bounds' message


def _exact_again(document: Any, error: Any) -> bool:
    """An integer beyond 64 bits, which orjson read as a float (seq_len 1e+23), refused as "a valid integer": put
    back as an integer at its place, so that validating again says what the field's bound is, as it does for
    any other integer too large for it. Whether it was one."""
    value = error.get("input")
    if error["type"] != "int_type" or not isinstance(value, float) or not value.is_integer() or abs(value) < _INEXACT:
        return False
    *path, last = error["loc"]
    holder = document
    try:
        for part in path:
            holder = holder[part]
        if holder[last] is not value:
            return False
        holder[last] = int(value)
    except (KeyError, IndexError, TypeError):
        return False
    return True


def find_lone_surrogate(document: Any) -> tuple[tuple[str | int, ...], int] | None:
    """Where the first lone surrogate of a parsed JSON document is, which no tokenizer can take as text: the path
    to its string (keys and list indexes: ``("texts", 3)``, ``("conversations", 0, 1, "content")``), and the
    character's index in that string; for a key that has one, the path to its object and -1 (no message may quote
    it: it cannot be written as UTF-8). Walked without recursion: a document may nest 1,024 levels."""
    stack: list[tuple[tuple[str | int, ...], Any]] = [((), document)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as exc:
                return path, exc.start
        elif isinstance(value, dict):
            for key in value:
                try:
                    key.encode("utf-8")
                except UnicodeEncodeError:
                    return path, -1
            stack.extend(((*path, key), item) for key, item in reversed(list(value.items())))
        elif isinstance(value, list):
            stack.extend(((*path, index), item) for index, item in reversed(list(enumerate(value))))
    return None


def _path_text(path: tuple[str | int, ...]) -> str:
    """``texts[3]``, ``conversations[0].messages[1].content``: a place in a request body, as messages name it (a
    conversation's message as the chat template's refusals name it, tokenizer_service.core.chat, where the body
    gives the conversation as its list of messages)."""
    if len(path) >= 3 and path[0] == "conversations" and isinstance(path[1], int) and isinstance(path[2], int):
        path = (path[0], path[1], "messages", *path[2:])
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else part)
    return text
