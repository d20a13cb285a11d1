"""Answers without I/O: error statuses to exceptions, and 200 answers read and checked against their request.

A binary answer (wire.MEDIA_TYPE) or a JSON one becomes a TokenizedBatch, a PackedBatch or a list of
texts, or raises: a TokenizerServiceError for an error status, a MalformedAnswerError for an answer
that does not fit its request, a TokenizerProtocolError for one that cannot be read at all.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any, TypeVar

import httpx
import numpy as np

from tokenizer_client import wire
from tokenizer_client._json import loads
from tokenizer_client.batches import ROW_FIELDS, PackedBatch, TokenizedBatch
from tokenizer_client.errors import MalformedAnswerError, TokenizerProtocolError, TokenizerServiceError
from tokenizer_client.packing import IGNORE_INDEX

MODEL_SHA256_HEADER = "X-Tokenizer-Model-SHA256"


def retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("retry-after")
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


def raise_for_error(response: httpx.Response, base: str | None = None, path: str = "") -> None:
    """A TokenizerServiceError for an error status, naming the URL requested (`base` + `path`) when given."""
    if response.status_code < 400:
        return
    try:
        body = loads(response.content)
    except ValueError:
        body = {"error": {"type": "http_error", "message": response.text[:500]}}
    body = body if isinstance(body, dict) else None
    url = None if base is None else base + path
    hint = _hint(response.status_code, body, base, path) if base is not None else None
    raise TokenizerServiceError(response.status_code, body, retry_after(response), url=url, hint=hint)


def _hint(status: int, body: dict[str, Any] | None, base: str, path: str) -> str | None:
    """What to give instead, for a 404 that says the path is not there (not a model the service lacks)."""
    error = (body or {}).get("error")
    kind = error.get("type") if isinstance(error, dict) else None
    if status != 404 or kind == "model_not_found":
        return None
    parsed = httpx.URL(base)
    root = str(parsed.copy_with(path="/", query=None, fragment=None)).rstrip("/")
    if parsed.path.strip("/"):
        return f"the client adds {path} to the URL it is given: give the server's root URL, e.g. {root}"
    return f"no {path} there: give the root URL of a tokenizer-service, e.g. http://127.0.0.1:8000"


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
        # what the answer says besides the ids agrees with them (a reader of those fields would be misled)
        if "lengths" in document and document["lengths"] != lengths.tolist():
            raise MalformedAnswerError("lengths are not the lengths of the ids' rows")
        if "num_tokens" in document and document["num_tokens"] != len(flat):
            raise MalformedAnswerError(f"num_tokens is {document['num_tokens']!r:.40}, the ids hold {len(flat)}")
    ids = _ids(ids, "ids")
    count = len(offsets) - 1 if texts is None else texts
    offsets = _offsets(offsets, "offsets", count, len(ids))
    if not isinstance(model, str):
        raise MalformedAnswerError(f"model is {model!r:.40}, not a name")
    mask = None
    if frame is not None and "loss_mask" in frame.arrays:
        mask = frame["loss_mask"]
    elif document is not None and "loss_mask" in document:
        mask, _ = _json_rows(document["loss_mask"], "loss_mask")
    if mask is not None:
        mask = _integers(mask, "loss_mask", 1)
        if len(mask) != len(ids) or (mask.size and (int(mask.min()) < 0 or int(mask.max()) > 1)):
            raise MalformedAnswerError("loss_mask does not hold one 0 or 1 per id")
        mask = mask.astype(np.uint8, copy=False)
    return TokenizedBatch(ids, offsets, model, sha256, loss_mask=mask)


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


def read_json(response: httpx.Response, what: str) -> Any:
    """A JSON answer's document; a TokenizerProtocolError if it cannot be read."""
    try:
        return loads(response.content)
    except ValueError as exc:
        raise TokenizerProtocolError(f"unreadable {what} answer: {exc}") from exc


def models_document(response: httpx.Response, url: str) -> dict[str, Any]:
    """A /v1/models answer: an object whose `models` are objects with a `name` (and a `sha256`) and whose `default`
    is a name or null; a TokenizerProtocolError naming the replica for anything else (another web app behind the
    URL answers 200 with HTML)."""
    document = read_json(response, f"/v1/models (from {url})")
    models = document.get("models") if isinstance(document, dict) else None
    valid = isinstance(models, list) and all(
        isinstance(info, dict) and isinstance(info.get("name"), str) and isinstance(info.get("sha256"), str | None)
        for info in models
    )
    if not valid or not isinstance(document.get("default"), str | None):
        raise TokenizerProtocolError(
            f"the /v1/models answer from {url} is not the tokenizer service's (an object of models, each with a name)"
        )
    return document  # type: ignore[no-any-return]
