"""Requests without I/O: each endpoint's options and body, the headers, the httpx.Request both clients send.

Going to the transport (httpx's public `handle_request`) rather than through `httpx.Client` skips
what a data path needs none of (cookie jar, redirects, auth flows, event hooks, URL merging): about a
third of the client's CPU per request. Consequently the client connects to the service directly and
ignores HTTP(S)_PROXY.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

import httpx
import numpy as np

from tokenizer_client import wire
from tokenizer_client._inputs import id_list, id_rows, optional_integer, plain, set_flags, set_integer, texts_list
from tokenizer_client._json import dumps

API_KEY_ENV = "TOKENIZER_API_KEY"
Format = Literal["binary", "json"]
Strategy = Literal["concat", "best_fit"]
FORMATS = get_args(Format)
JSON_HEADERS = {"content-type": "application/json"}
BINARY_HEADERS = {"content-type": wire.MEDIA_TYPE, "accept": wire.MEDIA_TYPE}


@dataclass(frozen=True)
class Call:
    """One HTTP call, as either client sends it to whichever replica it picks."""

    method: str
    path: str
    content: bytes | None = None
    headers: dict[str, str] | None = None

    def __str__(self) -> str:
        return f"{self.method} {self.path}"


MODELS = Call("GET", "/v1/models")
READY = Call("GET", "/readyz")


def post(path: str, payload: dict[str, Any], format: Format | None = None) -> Call:
    """A body to `path`, asking for the binary frame or JSON as `format` says (None: JSON only). Texts go as
    a binary frame where the answer is asked for in binary (`texts_frame`), else the body is JSON."""
    if format is not None and format not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(map(repr, FORMATS))}, not {format!r}")
    if format == "binary" and (frame := texts_frame(payload)) is not None:
        return Call("POST", path, frame, BINARY_HEADERS)
    headers = JSON_HEADERS if format is None else {**JSON_HEADERS, "accept": accept_header(format)}
    return Call("POST", path, dumps(payload), headers)


def texts_frame(payload: dict[str, Any]) -> bytes | None:
    """A body with texts as a binary frame (docs/api.md, "Binary request bodies"): array ``texts`` (uint8: every
    text's UTF-8, end to end), array ``offsets`` (int64: where each text starts, then the end), the other fields
    as the frame's meta. Cheaper than JSON for both ends (no escaping, no parsing of the texts). None where the
    payload has no texts, or a text is not valid Unicode (a lone surrogate: sent as JSON, which the server
    refuses naming that text) or not a str (the JSON encoder's TypeError names it)."""
    texts = payload.get("texts")
    if not isinstance(texts, list):
        return None
    try:
        encoded = [text.encode("utf-8") for text in texts]
    except (UnicodeEncodeError, AttributeError):  # a lone surrogate, or not a str: the JSON path says which text
        return None
    offsets = wire.ragged_offsets(np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded)))
    data = np.frombuffer(b"".join(encoded), dtype=np.uint8)
    return wire.encode(
        {"texts": data, "offsets": offsets}, {key: value for key, value in payload.items() if key != "texts"}
    )


def resolve_api_key(api_key: str | None) -> str | None:
    """The key given, else TOKENIZER_API_KEY from the environment, else none."""
    if api_key is None:
        api_key = os.environ.get(API_KEY_ENV)
    return api_key or None


def default_headers(api_key: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {api_key}"} if api_key else {}


class RequestBuilder:
    """Builds the httpx.Request both clients hand straight to their transport (see the module).

    Each URL is parsed, and each set of headers normalized, once per client, not per request: for a
    single text they were a third of the client's own CPU.
    """

    def __init__(self, api_key: str | None, timeout: float) -> None:
        self.headers = default_headers(api_key)
        self.extensions = {"timeout": httpx.Timeout(timeout).as_dict()}
        self._urls: dict[tuple[str, str], httpx.URL] = {}
        self._header_sets: dict[tuple[tuple[str, str], ...], httpx.Headers] = {}

    def build(self, base_url: str, call: Call) -> httpx.Request:
        """`call` to the replica at `base_url`."""
        url = self._urls.get((base_url, call.path))
        if url is None:
            url = self._urls[(base_url, call.path)] = httpx.URL(f"{base_url}{call.path}")
        key = tuple(call.headers.items()) if call.headers else ()
        headers = self._header_sets.get(key)
        if headers is None:
            headers = self._header_sets[key] = httpx.Headers({**self.headers, **dict(key)})
        return httpx.Request(call.method, url, content=call.content, headers=headers, extensions=self.extensions)


def accept_header(format: Format) -> str:
    return wire.MEDIA_TYPE if format == "binary" else "application/json"


Inputs = Literal["texts", "conversations", "records"]
TrainOn = Literal["assistant", "last"]


def items_list(items: Iterable[Any], inputs: str) -> list[Any]:
    """Conversations (lists of message dicts) or records (dicts), as a list; the server checks each message and
    names the one that is wrong, the client only the shape that cannot be sent."""
    listed = list(items)
    kind = list if inputs == "conversations" else dict
    for index, item in enumerate(listed):
        if not isinstance(item, kind):
            what = "a list of messages" if inputs == "conversations" else 'a {"prompt", "completion"} dict'
            raise TypeError(f"{inputs}[{index}] is {type(item).__name__}, not {what}")
    return listed


@dataclass(frozen=True)
class TokenizeOptions:
    """/v1/tokenize's options as the client sends them: made once from a method's keywords, passed whole."""

    model: str | None = None
    add_bos: bool = False
    add_eos: bool = False
    max_length: int | None = None
    sample: dict[str, Any] | None = None
    parse_special_tokens: bool = False
    inputs: Inputs = "texts"  # what the items are: texts, conversations (OpenAI messages) or prompt-completion records
    train_on: TrainOn = "assistant"  # conversations: every assistant turn, or the last

    def __post_init__(self) -> None:
        """Numpy integers and bools become Python values; a float length or a non-bool flag is refused here."""
        set_flags(self, "add_bos", "add_eos", "parse_special_tokens")
        if self.inputs not in get_args(Inputs):
            raise ValueError(f"inputs must be one of {list(get_args(Inputs))}, not {self.inputs!r}")
        if self.train_on not in get_args(TrainOn):
            raise ValueError(f"train_on must be one of {list(get_args(TrainOn))}, not {self.train_on!r}")
        object.__setattr__(self, "max_length", optional_integer(self.max_length, "max_length", minimum=0))
        if self.sample is not None:
            if not isinstance(self.sample, dict):
                raise TypeError(f"sample must be a dict of options, not {type(self.sample).__name__}")
            object.__setattr__(self, "sample", plain(self.sample))

    def payload(self, texts: Iterable[Any]) -> dict[str, Any]:
        """The request body; options at their defaults are left out."""
        payload: dict[str, Any] = {
            self.inputs: texts_list(texts) if self.inputs == "texts" else items_list(texts, self.inputs)
        }
        if self.train_on != "assistant":
            payload["train_on"] = self.train_on
        if self.model is not None:
            payload["model"] = self.model
        if self.add_bos:
            payload["add_bos"] = True
        if self.add_eos:
            payload["add_eos"] = True
        if self.max_length is not None:
            payload["max_length"] = self.max_length
        if self.sample is not None:
            payload["sample"] = self.sample
        if self.parse_special_tokens:
            payload["parse_special_tokens"] = True
        return payload


@dataclass(frozen=True)
class PackOptions:
    """/v1/pack's options but the carry (which changes with every request of a stream)."""

    seq_len: int
    strategy: Strategy = "concat"
    model: str | None = None
    add_bos: bool = False
    add_eos: bool = True
    mask_document_start: bool = False
    parse_special_tokens: bool = False
    inputs: Inputs = "texts"  # conversations and records: the chat template decides BOS/EOS (add_bos/add_eos unsent)
    train_on: TrainOn = "assistant"

    def __post_init__(self) -> None:
        set_integer(self, "seq_len", minimum=2)
        set_flags(self, "add_bos", "add_eos", "mask_document_start", "parse_special_tokens")
        if self.inputs not in get_args(Inputs):
            raise ValueError(f"inputs must be one of {list(get_args(Inputs))}, not {self.inputs!r}")
        if self.train_on not in get_args(TrainOn):
            raise ValueError(f"train_on must be one of {list(get_args(TrainOn))}, not {self.train_on!r}")

    def payload(
        self,
        texts: Iterable[Any],
        carry: Sequence[int] | np.ndarray | None = None,
        carry_document_starts: Sequence[int] | np.ndarray | None = None,
        carry_loss_mask: Sequence[int] | np.ndarray | None = None,
    ) -> dict[str, Any]:
        items = texts_list(texts) if self.inputs == "texts" else items_list(texts, self.inputs)
        payload: dict[str, Any] = {self.inputs: items, **vars(self)}
        del payload["inputs"]
        if self.model is None:
            del payload["model"]
        if not self.parse_special_tokens:  # its default: a server from before it stays usable
            del payload["parse_special_tokens"]
        if self.train_on == "assistant":  # its default; sent only with conversations
            del payload["train_on"]
        if self.inputs != "texts":  # the chat template (or TRL's rule for records) decides the special tokens
            del payload["add_bos"], payload["add_eos"]
        carried = {"carry": carry, "carry_document_starts": carry_document_starts, "carry_loss_mask": carry_loss_mask}
        for name, ids in carried.items():
            if ids is not None:
                payload[name] = id_list(ids, name)
        return payload


def chunked(items: Iterable[str], size: int) -> Iterator[list[str]]:
    """Consecutive lists of `size` items (the last may be shorter), read lazily."""
    chunk: list[str] = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def detokenize_payload(ids: Sequence[Sequence[int]] | Sequence[np.ndarray], model: str | None) -> dict[str, Any]:
    payload: dict[str, Any] = {"ids": id_rows(ids)}
    if model is not None:
        payload["model"] = model
    return payload
