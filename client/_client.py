"""TokenizerClient: one httpx connection pool, binary answers by default, typed errors."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal

import httpx
import numpy as np

from client import wire
from client.errors import (
    ModelMismatchError,
    TokenizerConnectionError,
    TokenizerProtocolError,
    TokenizerServiceError,
)

try:
    import orjson
except ImportError:  # the client works with numpy and httpx alone
    orjson = None  # type: ignore[assignment]

DEFAULT_URL = "http://127.0.0.1:8000"
MODEL_SHA256_HEADER = "X-Tokenizer-Model-SHA256"
Format = Literal["binary", "json"]


@dataclass(frozen=True)
class TokenizedBatch:
    """Ragged ids of one request: sequence i is ids[offsets[i]:offsets[i + 1]]."""

    ids: np.ndarray  # int32
    offsets: np.ndarray  # int64, len + 1
    model: str
    model_sha256: str | None

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, index: int) -> np.ndarray:
        return self.ids[self.offsets[index] : self.offsets[index + 1]]

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    def to_list(self) -> list[np.ndarray]:
        return wire.split_ragged(self.ids, self.offsets)


@dataclass(frozen=True)
class PackedBatch:
    """Fixed-length training rows from /v1/pack, as numpy arrays.

    ``leftover`` is the tail of the token stream that did not fill a row (concat only): pass it as
    ``carry`` to the next pack call so that no token is lost or repeated.
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

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


def packed_from_response(response: httpx.Response) -> PackedBatch:
    sha256 = response.headers.get(MODEL_SHA256_HEADER)
    content_type = response.headers.get("content-type", "")
    try:
        if content_type.startswith(wire.MEDIA_TYPE):
            frame = wire.decode(response.content)
            meta = frame.meta
            return PackedBatch(
                input_ids=frame["input_ids"],
                labels=frame["labels"],
                position_ids=frame["position_ids"],
                cu_seqlens=wire.split_ragged(frame["cu_seqlens"], frame["cu_seqlens_offsets"]),
                leftover=frame["leftover"],
                stats=meta["stats"],
                model=meta["model"],
                seq_len=meta["seq_len"],
                strategy=meta["strategy"],
                model_sha256=sha256,
            )
        document = loads(response.content)
        seq_len = document["seq_len"]

        def matrix(name: str) -> np.ndarray:
            return np.asarray(document[name], dtype=np.int32).reshape(-1, seq_len)

        return PackedBatch(
            input_ids=matrix("input_ids"),
            labels=matrix("labels"),
            position_ids=matrix("position_ids"),
            cu_seqlens=[np.asarray(row, dtype=np.int32) for row in document["cu_seqlens"]],
            leftover=np.asarray(document["leftover"], dtype=np.int32),
            stats=document["stats"],
            model=document["model"],
            seq_len=seq_len,
            strategy=document["strategy"],
            model_sha256=sha256,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise TokenizerProtocolError(f"unreadable pack answer ({content_type}): {exc}") from exc


def dumps(document: Any) -> bytes:
    if orjson is not None:
        try:
            return orjson.dumps(document)
        except TypeError:
            pass  # e.g. a lone surrogate: let the stdlib escape it and the server say which text
    return json.dumps(document).encode()


def loads(content: bytes) -> Any:
    return orjson.loads(content) if orjson is not None else json.loads(content)


def tokenize_payload(
    texts: Sequence[str],
    model: str | None,
    add_bos: bool,
    add_eos: bool,
    max_length: int | None,
    sample: dict[str, Any] | None,
) -> dict[str, Any]:
    payload: dict[str, Any] = {"texts": texts if isinstance(texts, list) else list(texts)}
    if model is not None:
        payload["model"] = model
    if add_bos:
        payload["add_bos"] = True
    if add_eos:
        payload["add_eos"] = True
    if max_length is not None:
        payload["max_length"] = max_length
    if sample is not None:
        payload["sample"] = sample
    return payload


def _retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("retry-after")
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def raise_for_error(response: httpx.Response) -> None:
    if response.status_code < 400:
        return
    try:
        body = loads(response.content)
    except ValueError:
        body = {"error": {"type": "http_error", "message": response.text[:500]}}
    raise TokenizerServiceError(response.status_code, body if isinstance(body, dict) else None, _retry_after(response))


def batch_from_response(response: httpx.Response) -> TokenizedBatch:
    sha256 = response.headers.get(MODEL_SHA256_HEADER)
    content_type = response.headers.get("content-type", "")
    try:
        if content_type.startswith(wire.MEDIA_TYPE):
            frame = wire.decode(response.content)
            return TokenizedBatch(frame["ids"], frame["offsets"], frame.meta["model"], sha256)
        document = loads(response.content)
        rows = document["ids"]
        lengths = np.fromiter((len(row) for row in rows), dtype=np.int64, count=len(rows))
        flat = np.fromiter((i for row in rows for i in row), dtype=np.int32, count=int(lengths.sum()))
        return TokenizedBatch(flat, wire.ragged_offsets(lengths), document["model"], sha256)
    except (KeyError, TypeError, ValueError) as exc:
        raise TokenizerProtocolError(f"unreadable tokenize answer ({content_type}): {exc}") from exc


class ModelFingerprints:
    """Remembers each model's sha256 so that replicas serving different files are caught."""

    def __init__(self) -> None:
        self._seen: dict[str, str] = {}

    def check(self, model: str, sha256: str | None, source: str) -> None:
        if sha256 is None:
            return
        known = self._seen.setdefault(model, sha256)
        if known != sha256:
            raise ModelMismatchError(
                f"model {model!r} from {source} has sha256 {sha256[:12]}…, earlier answers had {known[:12]}…"
            )


def _chunks(items: Iterable[str], size: int) -> Iterator[list[str]]:
    chunk: list[str] = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


class TokenizerClient:
    """Client of a tokenizer-service. Use as a context manager, or call close()."""

    def __init__(self, url: str = DEFAULT_URL, *, timeout: float = 60.0, transport: httpx.BaseTransport | None = None):
        self.url = url.rstrip("/")
        self._http = httpx.Client(base_url=self.url, timeout=timeout, transport=transport)
        self._fingerprints = ModelFingerprints()
        self._closed = False

    def __enter__(self) -> TokenizerClient:
        self._ensure_open()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._http.close()

    def _ensure_open(self) -> None:
        if self._closed:
            raise RuntimeError("this TokenizerClient is closed")

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        self._ensure_open()
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise TokenizerConnectionError(f"{method} {self.url}{path} failed: {exc!r}") from exc
        raise_for_error(response)
        return response

    def tokenize_batch(
        self,
        texts: Sequence[str],
        *,
        model: str | None = None,
        add_bos: bool = False,
        add_eos: bool = False,
        max_length: int | None = None,
        sample: dict[str, Any] | None = None,
        format: Format = "binary",
    ) -> TokenizedBatch:
        """Tokenize into one flat ids array plus offsets (the cheapest form to consume)."""
        payload = tokenize_payload(texts, model, add_bos, add_eos, max_length, sample)
        accept = wire.MEDIA_TYPE if format == "binary" else "application/json"
        response = self._request(
            "POST",
            "/v1/tokenize",
            content=dumps(payload),
            headers={"content-type": "application/json", "accept": accept},
        )
        batch = batch_from_response(response)
        self._fingerprints.check(batch.model, batch.model_sha256, self.url)
        return batch

    def tokenize(
        self,
        texts: Sequence[str],
        *,
        model: str | None = None,
        add_bos: bool = False,
        add_eos: bool = False,
        max_length: int | None = None,
        sample: dict[str, Any] | None = None,
        format: Format = "binary",
    ) -> list[np.ndarray]:
        """Token ids of each text (int32 arrays), exactly as sentencepiece's encode gives them."""
        batch = self.tokenize_batch(
            texts, model=model, add_bos=add_bos, add_eos=add_eos, max_length=max_length, sample=sample, format=format
        )
        return batch.to_list()

    def pack(
        self,
        texts: Sequence[str],
        seq_len: int,
        *,
        strategy: Literal["concat", "best_fit"] = "concat",
        model: str | None = None,
        add_bos: bool = False,
        add_eos: bool = True,
        carry: Sequence[int] | np.ndarray | None = None,
        mask_document_start: bool = False,
        format: Format = "binary",
    ) -> PackedBatch:
        """Tokenize and pack texts into rows of exactly `seq_len` tokens (see /v1/pack)."""
        payload: dict[str, Any] = {
            "texts": texts if isinstance(texts, list) else list(texts),
            "seq_len": seq_len,
            "strategy": strategy,
            "add_bos": add_bos,
            "add_eos": add_eos,
            "mask_document_start": mask_document_start,
        }
        if model is not None:
            payload["model"] = model
        if carry is not None:
            payload["carry"] = carry.tolist() if isinstance(carry, np.ndarray) else list(carry)
        accept = wire.MEDIA_TYPE if format == "binary" else "application/json"
        response = self._request(
            "POST", "/v1/pack", content=dumps(payload), headers={"content-type": "application/json", "accept": accept}
        )
        packed = packed_from_response(response)
        self._fingerprints.check(packed.model, packed.model_sha256, self.url)
        return packed

    def pack_stream(
        self, texts: Iterable[str], seq_len: int, *, texts_per_request: int = 256, **options: Any
    ) -> Iterator[PackedBatch]:
        """Pack a long stream of texts with concat over several requests, threading the carry through.

        Each yielded batch's `leftover` is what the stream holds beyond its rows so far; after the
        last batch it is the stream's remainder, shorter than one row.
        """
        carry: np.ndarray | None = None
        for chunk in _chunks(texts, texts_per_request):
            packed = self.pack(chunk, seq_len, strategy="concat", carry=carry, **options)
            carry = packed.leftover
            yield packed

    def detokenize(self, ids: Sequence[Sequence[int]] | Sequence[np.ndarray], *, model: str | None = None) -> list[str]:
        rows = [row.tolist() if isinstance(row, np.ndarray) else list(row) for row in ids]
        payload: dict[str, Any] = {"ids": rows}
        if model is not None:
            payload["model"] = model
        response = self._request(
            "POST", "/v1/detokenize", content=dumps(payload), headers={"content-type": "application/json"}
        )
        texts: list[str] = loads(response.content)["texts"]
        return texts

    def models(self) -> dict[str, Any]:
        """The server's /v1/models answer: default name and each model's ids and sha256."""
        document: dict[str, Any] = loads(self._request("GET", "/v1/models").content)
        return document

    def ready(self) -> bool:
        """Whether the server says it is ready (models loaded, workers answering)."""
        try:
            return self._request("GET", "/readyz").status_code == 200
        except (TokenizerConnectionError, TokenizerServiceError):
            return False
