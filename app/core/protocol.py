"""Every payload between the server process and its workers: layout, writer and reader in one place.

A frame (tokenizer_service.core.channel: a 9-byte header, then the payload) carries one of these, by kind:

=========  ===========  ==========================================================================
kind       direction    payload
=========  ===========  ==========================================================================
REQUEST    to worker    REQUEST_HEAD (route, answer in binary, most chunks, careful), the raw body
CHUNK      to worker    CHUNK_HEAD (careful), a pickled `Chunk`
FINISH     to worker    blobs: the pickled `PackContext`, then each PART payload (a split /v1/pack)
POISON     to worker    POISON_HEAD (model index, text length), then the text's digest
FALLBACK   to worker    FALLBACK_HEAD (model index): encode it with the reference library from now on
PROMOTE    to worker    FALLBACK_HEAD (model index): encode it with fastokens from now on (its gate passed)
VERIFIED   to server    job 0, between replies: VERIFIED_HEAD (model index, texts checked, mismatch), then
                        the mismatch's log line (UTF-8; empty when none): shadow verification
DONE       to server    RESULT_HEAD, then the answer's bytes (JSON, or the binary frame)
PART       to server    RESULT_HEAD, then blobs (ids and lengths) or one JSON fragment (detokenize)
SHARE      to server    sent by a worker that splits a REQUEST, before its reply: SPLIT's layout,
                        holding every chunk but the first, for other workers; the worker runs the
                        first itself and replies with its PART (texts 0.. of the request)
SPLIT      to server    SPLIT_HEAD (model, route, texts, seeded), then blobs: chunk units (int64),
                        the pickled `PackContext` (empty but for /v1/pack), then each pickled `Chunk`
                        (a seeded request: all of it, in one chunk, for the seeded sampler)
FAILED     to server    a ServiceError's JSON (`as_dict()`)
=========  ===========  ==========================================================================

All integers little-endian. The server reads only heads and moves the rest as bytes; workers write
and read the pickled parts.
"""

from __future__ import annotations

import pickle
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from tokenizer_service.core import channel
from tokenizer_service.core.options import EncodeOptions

Buffer = bytes | bytearray | memoryview

# Routes, as the server names them to a worker
TOKENIZE, DETOKENIZE, PACK = 1, 2, 3
ROUTES = {"/v1/tokenize": TOKENIZE, "/v1/detokenize": DETOKENIZE, "/v1/pack": PACK}

# Content of an answer
JSON, BINARY = 0, 1

REQUEST_HEAD = struct.Struct("<BBHB")
CHUNK_HEAD = struct.Struct("<B")
RESULT_HEAD = struct.Struct("<HBIQddd")  # model, content, texts, tokens, started, seconds, padding (NaN: none)
POISON_HEAD = struct.Struct("<HQ")
SPLIT_HEAD = struct.Struct("<HBIB")
FALLBACK_HEAD = struct.Struct("<H")
VERIFIED_HEAD = struct.Struct("<HIB")


class ResultHead(NamedTuple):
    """What the server records of a DONE or PART: the model, content, counts, and the worker's timing."""

    model: int
    content: int
    texts: int
    tokens: int
    started: float  # when the worker started the job (time.monotonic, comparable across processes)
    seconds: float  # how long it worked
    padding: float  # padding fraction of a pack, NaN otherwise


@dataclass(frozen=True)
class Result:
    """DONE or PART, as its head plus the answer's buffers."""

    model: int
    content: int
    texts: int
    tokens: int
    started: float
    seconds: float
    padding: float
    parts: Sequence[Buffer]

    def payload(self) -> list[Buffer]:
        head = RESULT_HEAD.pack(
            self.model, self.content, self.texts, self.tokens, self.started, self.seconds, self.padding
        )
        return [head, *self.parts]


def read_result_head(payload: Buffer) -> ResultHead:
    return ResultHead(*RESULT_HEAD.unpack_from(payload))


def result_body(payload: Buffer) -> memoryview:
    """A DONE's answer bytes, or a PART's single fragment."""
    return memoryview(payload)[RESULT_HEAD.size :]


def result_blobs(payload: Buffer) -> list[memoryview]:
    """A PART's blobs."""
    return channel.split_blobs(payload, RESULT_HEAD.size)


def request_head(route: int, binary: bool, most_chunks: int, careful: bool) -> bytes:
    return REQUEST_HEAD.pack(route, binary, most_chunks, careful)


def read_request(payload: Buffer) -> tuple[int, bool, int, bool, memoryview]:
    """(route, binary, most chunks, careful, body) of a REQUEST."""
    route, binary, most_chunks, careful = REQUEST_HEAD.unpack_from(payload)
    return route, bool(binary), most_chunks, bool(careful), memoryview(payload)[REQUEST_HEAD.size :]


@dataclass(frozen=True)
class Chunk:
    """Part of a split request, as pickled into a CHUNK job."""

    route: int
    model: int
    options: EncodeOptions
    first_index: int
    binary: bool
    texts: Sequence[str] | None = None  # tokenize, pack (a list, or a binary body's `Utf8Texts`)
    ids: np.ndarray | None = None  # detokenize: ragged ids and offsets
    offsets: np.ndarray | None = None


def chunk_head(careful: bool) -> bytes:
    return CHUNK_HEAD.pack(careful)


def read_chunk(payload: Buffer) -> tuple[bool, Chunk]:
    (careful,) = CHUNK_HEAD.unpack_from(payload)
    return bool(careful), load_chunk(memoryview(payload)[CHUNK_HEAD.size :])


def load_chunk(blob: Buffer) -> Chunk:
    """A pickled Chunk, as a SPLIT carries it."""
    chunk: Chunk = pickle.loads(blob)
    return chunk


@dataclass(frozen=True)
class PackContext:
    """What a FINISH job needs besides the parts: the request's packing fields."""

    model: int
    binary: bool
    seq_len: int
    strategy: str
    add_eos: bool
    carry: list[int] | None
    carry_document_starts: list[int] | None
    mask_document_start: bool


def split_payload(
    model: int,
    route: int,
    texts: int,
    seeded: bool,
    units: np.ndarray,
    context: PackContext | None,
    chunks: list[Chunk],
) -> list[Buffer]:
    blobs: list[Buffer] = [
        units.tobytes(),
        b"" if context is None else pickle.dumps(context, protocol=5),
        *(pickle.dumps(chunk, protocol=5) for chunk in chunks),
    ]
    return [SPLIT_HEAD.pack(model, route, texts, seeded), *channel.join_blobs(blobs)]


class Split(NamedTuple):
    """A SPLIT or SHARE as the server reads it: the chunks stay pickled bytes, to be handed to workers."""

    model: int
    route: int
    texts: int  # in the whole request
    seeded: bool
    units: list[int]  # work in each chunk (characters or ids), for the stall clock
    context: memoryview  # the pickled PackContext, empty but for /v1/pack
    chunks: list[memoryview]

    def jobs(self) -> list[tuple[memoryview, int]]:
        """Each pickled chunk with its units of work."""
        return list(zip(self.chunks, self.units, strict=True))


def read_split(payload: Buffer) -> Split:
    model, route, texts, seeded = SPLIT_HEAD.unpack_from(payload)
    blobs = channel.split_blobs(payload, SPLIT_HEAD.size)
    units = np.frombuffer(blobs[0], dtype=np.int64).tolist()
    return Split(model, route, texts, bool(seeded), units, blobs[1], blobs[2:])


def read_context(blob: Buffer) -> PackContext:
    context: PackContext = pickle.loads(blob)
    return context


def finish_payload(context: Buffer, parts: Sequence[Buffer]) -> list[Buffer]:
    return channel.join_blobs([context, *parts])


def read_finish(payload: Buffer) -> tuple[PackContext, list[memoryview]]:
    """The FINISH job's context and each PART payload."""
    blobs = channel.split_blobs(payload)
    return read_context(blobs[0]), blobs[1:]


def poison_payload(model: int, length: int, digest: bytes) -> bytes:
    return POISON_HEAD.pack(model, length) + digest


def read_poison(payload: Buffer) -> tuple[int, int, bytes]:
    """(model index, text length, the text's digest) of a POISON."""
    model, length = POISON_HEAD.unpack_from(payload)
    return model, length, bytes(payload[POISON_HEAD.size :])


def verified_payload(model: int, checks: int, mismatch: str | None) -> bytes:
    line = b"" if mismatch is None else mismatch.encode("utf-8", "backslashreplace")
    return VERIFIED_HEAD.pack(model, checks, mismatch is not None) + line


def read_verified(payload: Buffer) -> tuple[int, int, str | None]:
    """(model index, texts checked, the mismatch's line or None) of a VERIFIED."""
    model, checks, mismatched = VERIFIED_HEAD.unpack_from(payload)
    line = bytes(payload[VERIFIED_HEAD.size :]).decode("utf-8")
    return model, checks, line if mismatched else None


def fallback_payload(model: int) -> bytes:
    return FALLBACK_HEAD.pack(model)


def promotion_payload(model: int, route: str = "fastokens") -> bytes:
    """A PROMOTE: the model's index, then the fast encoder's route the gate chose (``gigatoken(converted)``)."""
    return FALLBACK_HEAD.pack(model) + route.encode("ascii")


def read_promotion(payload: Buffer) -> tuple[int, str]:
    """(model index, route) of a PROMOTE."""
    return read_fallback(payload), bytes(payload[FALLBACK_HEAD.size :]).decode("ascii") or "fastokens"


def read_fallback(payload: Buffer) -> int:
    """The model index of a FALLBACK or a PROMOTE."""
    (model,) = FALLBACK_HEAD.unpack_from(payload)
    return int(model)
