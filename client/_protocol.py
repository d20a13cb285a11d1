"""What travels over HTTP, without doing any I/O: request bodies, answers parsed into batches, errors.

Shared by the sync and async clients so that both build the same requests and read the same answers.
The batch types turn their arrays into torch tensors with client._torch, which knows arrays only.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, TypeVar

import httpx
import numpy as np

from client import wire
from client._inputs import check_url, flag, id_list, id_rows, integer, optional_integer, plain, texts_list
from client._torch import tensors
from client.errors import MalformedAnswerError, ModelMismatchError, TokenizerProtocolError, TokenizerServiceError

try:
    import orjson
except ImportError:  # the client works with numpy and httpx alone
    orjson = None  # type: ignore[assignment]

DEFAULT_URL = "http://127.0.0.1:8000"
MODEL_SHA256_HEADER = "X-Tokenizer-Model-SHA256"
API_KEY_ENV = "TOKENIZER_API_KEY"
Format = Literal["binary", "json"]
Strategy = Literal["concat", "best_fit"]


@dataclass(frozen=True)
class TokenizedBatch:
    """Ragged ids of one request: sequence i is ids[offsets[i]:offsets[i + 1]].

    From a prefetcher, ``index`` is the batch's number in the stream and ``start`` the stream
    index of its first text (both None from ``tokenize_batch``); with ``as_torch=True`` ``ids``
    and ``offsets`` are torch tensors.
    """

    ids: np.ndarray  # int32
    offsets: np.ndarray  # int64, len + 1
    model: str
    model_sha256: str | None
    index: int | None = None
    start: int | None = None

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, index: int) -> np.ndarray:
        return self.ids[self.offsets[index] : self.offsets[index + 1]]

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(np.asarray(self.offsets))

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    def to_list(self) -> list[np.ndarray]:
        return wire.split_ragged(self.ids, self.offsets)

    def pin_memory(self) -> TokenizedBatch:
        """The batch as pinned torch tensors (what DataLoader(pin_memory=True) calls); needs an accelerator."""
        return self._to_torch(pin_memory=True)

    def _to_torch(self, pin_memory: bool) -> TokenizedBatch:
        """The same batch with torch tensors in place of its arrays (int32 ids, int64 offsets)."""
        ids, offsets = tensors([self.ids, self.offsets], pin_memory)
        return replace(self, ids=ids, offsets=offsets)


@dataclass(frozen=True)
class PackedBatch:
    """Fixed-length training rows from /v1/pack, as numpy arrays.

    ``leftover`` is the tail of the token stream that did not fill a row (concat only): pass it as
    ``carry``, and ``leftover_document_starts`` as ``carry_document_starts``, to the next pack call so
    that no token is lost or repeated and every document start stays a segment start. From a prefetcher,
    ``index`` is the batch's number in the stream and ``start`` the stream index of the first text
    with tokens in it (concat) or of the first text of the request its first row came from (best_fit).
    """

    input_ids: np.ndarray  # [rows, seq_len] int32
    labels: np.ndarray  # [rows, seq_len] int32, -100 where no loss is taken
    position_ids: np.ndarray  # [rows, seq_len] int32
    cu_seqlens: list[np.ndarray]  # per row: [0, end of segment 1, ..., start of padding]
    leftover: np.ndarray  # int32
    stats: dict[str, Any]
    model: str
    seq_len: int
    strategy: str
    model_sha256: str | None
    index: int | None = None
    start: int | None = None
    leftover_document_starts: np.ndarray = field(default_factory=lambda: np.empty(0, np.int32))

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_tokens(self) -> int:
        """Tokens in the rows that are not padding."""
        return int(sum(int(row[-1]) for row in self.cu_seqlens))

    def pin_memory(self) -> PackedBatch:
        """The batch as pinned torch tensors (what DataLoader(pin_memory=True) calls); needs an accelerator."""
        return self._to_torch(pin_memory=True)

    def _to_torch(self, pin_memory: bool) -> PackedBatch:
        """The same batch with int32 torch tensors in place of its rows and cu_seqlens (and leftover, never pinned)."""
        input_ids, labels, position_ids, *cu_seqlens = tensors(
            [self.input_ids, self.labels, self.position_ids, *self.cu_seqlens], pin_memory
        )
        (leftover,) = tensors([self.leftover], pin_memory=False)
        return replace(
            self,
            input_ids=input_ids,
            labels=labels,
            position_ids=position_ids,
            cu_seqlens=cu_seqlens,
            leftover=leftover,
        )


Batch = TokenizedBatch | PackedBatch


def dumps(document: Any) -> bytes:
    if orjson is not None:
        try:
            return orjson.dumps(document)
        except TypeError:
            pass  # e.g. a lone surrogate: let the stdlib escape it and the server say which text
    try:
        return json.dumps(document).encode()
    except TypeError:
        _explain_unserializable(document)
        raise


def _explain_unserializable(document: Any) -> None:
    """A TypeError naming the text that is not a str (a bytes text most likely), if that is what failed."""
    texts = document.get("texts") if isinstance(document, dict) else None
    if not isinstance(texts, list):
        return
    for index, text in enumerate(texts):
        if isinstance(text, bytes | bytearray | memoryview):
            raise TypeError(
                f"texts[{index}] is {type(text).__name__}, not str: decode it first, e.g. text.decode('utf-8')"
            ) from None
        if not isinstance(text, str):
            raise TypeError(f"texts[{index}] is a {type(text).__name__}, not a str") from None


def loads(content: bytes) -> Any:
    return orjson.loads(content) if orjson is not None else json.loads(content)


def resolve_api_key(api_key: str | None) -> str | None:
    """The key given, else TOKENIZER_API_KEY from the environment, else none."""
    if api_key is None:
        api_key = os.environ.get(API_KEY_ENV)
    return api_key or None


def default_headers(api_key: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {api_key}"} if api_key else {}


class Requests:
    """Builds the requests both clients hand straight to their httpx transport.

    Going to the transport (httpx's public `handle_request`) rather than through `httpx.Client`
    skips what a data path needs none of (cookie jar, redirects, auth flows, event hooks, URL
    merging): about a third of the client's CPU per request. Consequently the client connects to the
    service directly and ignores HTTP(S)_PROXY.
    """

    def __init__(self, api_key: str | None, timeout: float) -> None:
        self.headers = default_headers(api_key)
        self.extensions = {"timeout": httpx.Timeout(timeout).as_dict()}

    def build(
        self, method: str, url: str, content: bytes | None = None, headers: dict[str, str] | None = None
    ) -> httpx.Request:
        merged = {**self.headers, **headers} if headers else self.headers
        return httpx.Request(method, url, content=content, headers=merged, extensions=self.extensions)


def parse_urls(url: str | Sequence[str]) -> tuple[str, ...]:
    """One base URL, a comma-separated list of them, or a sequence of them; trailing slashes dropped."""
    items = url.split(",") if isinstance(url, str) else list(url)
    urls = tuple(check_url(item.strip().rstrip("/")) for item in items if item and item.strip())
    if not urls:
        raise ValueError("at least one server URL is needed")
    return urls


def accept_header(format: Format) -> str:
    return wire.MEDIA_TYPE if format == "binary" else "application/json"


@dataclass(frozen=True)
class TokenizeOptions:
    """/v1/tokenize's options as the client sends them: made once from a method's keywords, passed whole."""

    model: str | None = None
    add_bos: bool = False
    add_eos: bool = False
    max_length: int | None = None
    sample: dict[str, Any] | None = None
    parse_special_tokens: bool = False

    def __post_init__(self) -> None:
        """Numpy integers and bools become Python values; a float length or a non-bool flag is refused here."""
        for name in ("add_bos", "add_eos", "parse_special_tokens"):
            object.__setattr__(self, name, flag(getattr(self, name), name))
        object.__setattr__(self, "max_length", optional_integer(self.max_length, "max_length", minimum=0))
        if self.sample is not None:
            if not isinstance(self.sample, dict):
                raise TypeError(f"sample must be a dict of options, not {type(self.sample).__name__}")
            object.__setattr__(self, "sample", plain(self.sample))

    def payload(self, texts: Iterable[str]) -> dict[str, Any]:
        """The request body; options at their defaults are left out."""
        payload: dict[str, Any] = {"texts": texts_list(texts)}
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

    def __post_init__(self) -> None:
        object.__setattr__(self, "seq_len", integer(self.seq_len, "seq_len", minimum=2))
        for name in ("add_bos", "add_eos", "mask_document_start", "parse_special_tokens"):
            object.__setattr__(self, name, flag(getattr(self, name), name))

    def payload(
        self,
        texts: Iterable[str],
        carry: Sequence[int] | np.ndarray | None = None,
        carry_document_starts: Sequence[int] | np.ndarray | None = None,
    ) -> dict[str, Any]:
        payload: dict[str, Any] = {"texts": texts_list(texts), **vars(self)}
        if self.model is None:
            del payload["model"]
        if not self.parse_special_tokens:  # its default: a server from before it stays usable
            del payload["parse_special_tokens"]
        for name, ids in (("carry", carry), ("carry_document_starts", carry_document_starts)):
            if ids is not None:
                payload[name] = id_list(ids, name)
        return payload


def check_replica_models(fingerprints: ModelFingerprints, answers: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """Raise ModelMismatchError unless every replica's /v1/models names the same files and default.

    `answers` are (url, /v1/models document) for every replica; returns the first document.
    """
    for url, document in answers:
        for info in document.get("models", []):
            fingerprints.check(info["name"], info.get("sha256"), url, requested=info["name"])
        if (default := document.get("default")) is not None:
            fingerprints.check(default, None, url, requested=None)
    return answers[0][1]


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


def retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("retry-after")
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


def raise_for_error(response: httpx.Response) -> None:
    if response.status_code < 400:
        return
    try:
        body = loads(response.content)
    except ValueError:
        body = {"error": {"type": "http_error", "message": response.text[:500]}}
    raise TokenizerServiceError(response.status_code, body if isinstance(body, dict) else None, retry_after(response))


T = TypeVar("T")


def _read_answer(
    response: httpx.Response, what: str, read: Callable[[wire.Frame | None, Any, str | None], T], *args: Any
) -> T:
    """`read(frame, None, sha256, *args)` for a binary answer, `read(None, document, sha256, *args)` for JSON;
    any missing or malformed part is a TokenizerProtocolError (a MalformedAnswerError when it is checked)."""
    sha256 = response.headers.get(MODEL_SHA256_HEADER)
    content_type = response.headers.get("content-type", "")
    try:
        if content_type.startswith(wire.MEDIA_TYPE):
            return read(wire.decode(response.content), None, sha256, *args)
        return read(None, loads(response.content), sha256, *args)
    except (KeyError, TypeError, ValueError, OverflowError, IndexError, AttributeError) as exc:
        raise TokenizerProtocolError(f"unreadable {what} answer ({content_type}): {exc}") from exc


# -- every answer checked against its request (vectorized: a few array passes, no Python loop per id) ----

ID_LIMIT = 1 << 31  # ids travel as int32


def _integers(array: np.ndarray, what: str, ndim: int) -> np.ndarray:
    if not isinstance(array, np.ndarray) or array.dtype.kind not in "iu":
        kind = array.dtype if isinstance(array, np.ndarray) else type(array).__name__
        raise MalformedAnswerError(f"{what} are {kind}, not integers")
    if array.ndim != ndim:
        raise MalformedAnswerError(f"{what} have {array.ndim} dimensions, not {ndim}")
    return array


def _ids(array: np.ndarray, what: str, ndim: int = 1) -> np.ndarray:
    """Token ids: integers in [0, 2**31), as int32."""
    array = _integers(array, what, ndim)
    if array.size and (int(array.min()) < 0 or int(array.max()) >= ID_LIMIT):
        raise MalformedAnswerError(
            f"{what} hold {int(array.min())}..{int(array.max())}, outside the int32 ids [0, {ID_LIMIT})"
        )
    return array if array.dtype == np.int32 else array.astype(np.int32)


def _offsets(offsets: np.ndarray, what: str, count: int, total: int) -> np.ndarray:
    """Offsets of `count` sequences over `total` items: from 0 to `total`, never decreasing."""
    offsets = _integers(offsets, what, 1)
    if len(offsets) != count + 1:
        raise MalformedAnswerError(f"{what} describe {len(offsets) - 1} sequences, {count} were asked for")
    if int(offsets[0]) != 0 or int(offsets[-1]) != total:
        raise MalformedAnswerError(f"{what} run from {int(offsets[0])} to {int(offsets[-1])}, not 0 to {total}")
    if count > 1 and bool((offsets[1:] < offsets[:-1]).any()):
        raise MalformedAnswerError(f"{what} decrease")
    return offsets if offsets.dtype == np.int64 else offsets.astype(np.int64)


def _json_integers(values: Any, what: str) -> np.ndarray:
    """A JSON list of integers as int64: a float (1.7, 1.0), a bool or an integer beyond int64 is refused."""
    if not isinstance(values, list):
        raise MalformedAnswerError(f"{what} are a {type(values).__name__}, not a list")
    kinds = set(map(type, values))  # one pass in C
    if kinds - {int}:
        odd = sorted(kind.__name__ for kind in kinds - {int})
        raise MalformedAnswerError(f"{what} hold {', '.join(odd)} values, not only integers")
    try:
        return np.array(values, dtype=np.int64) if values else np.zeros(0, np.int64)
    except OverflowError:
        raise MalformedAnswerError(f"{what} hold an integer beyond 64 bits") from None


def _json_rows(rows: Any, what: str) -> tuple[np.ndarray, np.ndarray]:
    """A JSON list of lists of integers: (flat int64 values, lengths)."""
    if not isinstance(rows, list) or set(map(type, rows)) - {list}:
        raise MalformedAnswerError(f"{what} are not a list of lists")
    lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    return _json_integers(list(itertools.chain.from_iterable(rows)), what), lengths


def _batch(frame: wire.Frame | None, document: Any, sha256: str | None, texts: int | None = None) -> TokenizedBatch:
    if frame is not None:
        ids, offsets, model = frame["ids"], frame["offsets"], frame.meta["model"]
    else:
        flat, lengths = _json_rows(document["ids"], "ids")
        ids, offsets, model = flat, wire.ragged_offsets(lengths), document["model"]
    ids = _ids(ids, "ids")
    count = len(offsets) - 1 if texts is None else texts
    offsets = _offsets(offsets, "offsets", count, len(ids))
    if not isinstance(model, str):
        raise MalformedAnswerError(f"model is {model!r:.40}, not a name")
    return TokenizedBatch(ids, offsets, model, sha256)


ROW_FIELDS = ("input_ids", "labels", "position_ids")  # PackedBatch's [rows, seq_len] arrays
IGNORE_INDEX = -100


def _packed(frame: wire.Frame | None, document: Any, sha256: str | None, seq_len: int | None = None) -> PackedBatch:
    meta = frame.meta if frame is not None else document
    answered = meta["seq_len"]
    if type(answered) is not int or (seq_len is not None and answered != seq_len):
        raise MalformedAnswerError(f"seq_len {answered!r:.40} answered, {seq_len} asked for")
    seq_len = answered
    arrays: dict[str, np.ndarray] = {}
    if frame is not None:
        for name in ROW_FIELDS:
            arrays[name] = _integers(frame[name], name, 2)
        cu_flat = _integers(frame["cu_seqlens"], "cu_seqlens", 1)
        cu_offsets = frame["cu_seqlens_offsets"]
        arrays["leftover"] = frame["leftover"]
        arrays["leftover_document_starts"] = frame["leftover_document_starts"]
    else:
        for name in ROW_FIELDS:
            flat, lengths = _json_rows(document[name], name)
            if len(lengths) and bool((lengths != seq_len).any()):
                raise MalformedAnswerError(f"{name} has rows that are not {seq_len} tokens long")
            arrays[name] = flat.reshape(len(lengths), seq_len)
        cu_flat, cu_lengths = _json_rows(document["cu_seqlens"], "cu_seqlens")
        cu_offsets = wire.ragged_offsets(cu_lengths)
        for name in ("leftover", "leftover_document_starts"):
            arrays[name] = _json_integers(document.get(name, []), name)
    rows = arrays["input_ids"].shape[0]
    for name in ROW_FIELDS:
        if arrays[name].shape != (rows, seq_len):
            raise MalformedAnswerError(f"{name} has shape {arrays[name].shape}, not ({rows}, {seq_len})")
    input_ids = _ids(arrays["input_ids"], "input_ids", 2)
    labels = _integers(arrays["labels"], "labels", 2)
    if labels.size and (bool(((labels < 0) & (labels != IGNORE_INDEX)).any()) or int(labels.max()) >= ID_LIMIT):
        raise MalformedAnswerError(f"labels hold values that are neither ids nor {IGNORE_INDEX}")
    positions = _integers(arrays["position_ids"], "position_ids", 2)
    if positions.size and (int(positions.min()) < 0 or int(positions.max()) >= seq_len):
        raise MalformedAnswerError(f"position_ids leave [0, {seq_len})")
    cu_offsets = _offsets(cu_offsets, "cu_seqlens_offsets", rows, len(cu_flat))
    if cu_flat.size and (int(cu_flat.min()) < 0 or int(cu_flat.max()) > seq_len):
        raise MalformedAnswerError(f"cu_seqlens leave [0, {seq_len}]")
    firsts = cu_offsets[:-1][cu_offsets[1:] > cu_offsets[:-1]]
    if bool(cu_flat[firsts].any()):
        raise MalformedAnswerError("cu_seqlens of a row do not start at 0")
    if len(cu_flat) > 1:
        steps = cu_flat[1:] < cu_flat[:-1]
        steps[firsts[firsts > 0] - 1] = False  # a row's first entry (0) is below the previous row's last
        if bool(steps.any()):
            raise MalformedAnswerError("cu_seqlens decrease within a row")
    leftover = _ids(arrays["leftover"], "leftover")
    starts = _integers(arrays["leftover_document_starts"], "leftover_document_starts", 1)
    if starts.size and (
        int(starts.min()) < 0 or int(starts.max()) >= len(leftover) or bool((starts[1:] <= starts[:-1]).any())
    ):
        raise MalformedAnswerError("leftover_document_starts do not increase within the leftover")
    strategy = meta["strategy"]
    if strategy not in ("concat", "best_fit") or not isinstance(meta["model"], str):
        raise MalformedAnswerError(f"strategy {strategy!r:.40} or model {meta['model']!r:.40} is not valid")
    stats = meta["stats"]
    if not isinstance(stats, dict):
        raise MalformedAnswerError("stats are not an object")
    return PackedBatch(
        input_ids=input_ids,
        labels=labels if labels.dtype == np.int32 else labels.astype(np.int32),
        position_ids=positions if positions.dtype == np.int32 else positions.astype(np.int32),
        leftover=leftover,
        leftover_document_starts=starts.astype(np.int32, copy=False),
        cu_seqlens=[row.astype(np.int32, copy=False) for row in wire.split_ragged(cu_flat, cu_offsets)],
        stats=stats,
        model=meta["model"],
        seq_len=seq_len,
        strategy=strategy,
        model_sha256=sha256,
    )


def batch_from_response(response: httpx.Response, texts: int | None = None) -> TokenizedBatch:
    """The answer to a /v1/tokenize request of `texts` texts, checked against it."""
    return _read_answer(response, "tokenize", _batch, texts)


def packed_from_response(response: httpx.Response, seq_len: int | None = None) -> PackedBatch:
    """The answer to a /v1/pack request for rows of `seq_len`, checked against it."""
    return _read_answer(response, "pack", _packed, seq_len)


def texts_from_document(document: Any, rows: int | None = None) -> list[str]:
    """The texts of a /v1/detokenize answer to `rows` id rows, checked against it."""
    texts = document["texts"] if isinstance(document, dict) else None
    if not isinstance(texts, list) or set(map(type, texts)) - {str}:
        raise MalformedAnswerError("texts are not a list of strings")
    if rows is not None and len(texts) != rows:
        raise MalformedAnswerError(f"{len(texts)} texts answered, {rows} id rows were sent")
    return texts


class ModelFingerprints:
    """Remembers each model's sha256, and which model a request without one got, per client.

    Replicas behind one client must serve the same files: an answer whose sha256 differs from an
    earlier one for the same model name, or a default model that differs between replicas, raises
    ModelMismatchError. Safe to share between threads (one dict operation per check).
    """

    def __init__(self) -> None:
        self._seen: dict[str, tuple[str, str]] = {}
        self._default: tuple[str, str] | None = None

    def check(self, model: str, sha256: str | None, source: str, *, requested: str | None) -> None:
        """`requested` is the model name the request gave (None: the server's default)."""
        if requested is None:
            if self._default is None:
                self._default = (model, source)
            elif self._default[0] != model:
                raise ModelMismatchError(
                    f"{source} serves {model!r} as its default model, {self._default[1]} served {self._default[0]!r}"
                )
        if sha256 is None:
            return
        known, known_source = self._seen.setdefault(model, (sha256, source))
        if known != sha256:
            raise ModelMismatchError(
                f"model {model!r} from {source} has sha256 {sha256[:12]}…, "
                f"earlier answers from {known_source} had {known[:12]}…"
            )

    def expect(self, model: str, sha256: str, source: str) -> None:
        """Pin a model's sha256 before any answer (a resumed prefetch must see the file it started with)."""
        self._seen.setdefault(model, (sha256, source))
