"""Answers as the server process sees them: bytes from the workers, joined without reading ids.

A small request's answer comes whole from one worker (`DONE`). A split request's answer is the
chunks' results (`PART`s) in order, joined here: JSON fragments side by side, or the binary
frame's ids laid end to end with offsets from the chunks' lengths (work per text, not per token).
Pure logic: no I/O, testable without a server.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import orjson

from tokenizer_client import wire
from tokenizer_client.wire import ragged_offsets
from tokenizer_service.core.protocol import BINARY, read_result_head, result_blobs, result_body

Buffer = bytes | bytearray | memoryview


@dataclass
class Work:
    """What a job's worker reported, for the metrics: when it started and how long it worked."""

    started: float
    seconds: float


@dataclass
class Answer:
    """A whole answer: its bytes and what the metrics record of it."""

    binary: bool
    body: Sequence[Buffer]
    model: int
    texts: int
    tokens: int
    padding: float = math.nan
    work: list[Work] = field(default_factory=list)

    @property
    def size(self) -> int:
        return sum(len(part) for part in self.body)


@dataclass(frozen=True)
class ChunkResult:
    """One chunk's result: the head fields and its blobs (views into the payload)."""

    model: int
    texts: int
    tokens: int
    work: Work
    blobs: list[memoryview]
    payload: Buffer


def read_done(payload: Buffer) -> Answer:
    head = read_result_head(payload)
    work = [Work(head.started, head.seconds)]
    return Answer(
        head.content == BINARY, [result_body(payload)], head.model, head.texts, head.tokens, head.padding, work
    )


def read_chunk_result(payload: Buffer, *, blobs: bool = True) -> ChunkResult:
    head = read_result_head(payload)
    views = result_blobs(payload) if blobs else [result_body(payload)]  # several blobs, or one fragment (detokenize)
    return ChunkResult(head.model, head.texts, head.tokens, Work(head.started, head.seconds), views, payload)


def _joined(fragments: Sequence[Buffer]) -> list[Buffer]:
    out: list[Buffer] = []
    for position, fragment in enumerate(fragments):
        if position:
            out.append(b",")
        out.append(fragment)
    return out


def join_tokenize(model: int, name: str, parts: Sequence[ChunkResult], binary: bool) -> Answer:
    """The /v1/tokenize answer of a split request, from its parts in order."""
    texts = sum(part.texts for part in parts)
    tokens = sum(part.tokens for part in parts)
    work = [part.work for part in parts]
    if binary:
        ids = [np.frombuffer(part.blobs[0], dtype=np.int32) for part in parts]
        lengths = np.concatenate([np.frombuffer(part.blobs[1], dtype=np.int64) for part in parts])
        frame = wire.encode_parts(
            {"ids": ids, "offsets": ragged_offsets(lengths)}, {"model": name, "num_tokens": tokens}
        )
        return Answer(True, frame, model, texts, tokens, work=work)
    body: list[Buffer] = [
        b'{"model":',
        orjson.dumps(name),
        b',"ids":[',
        *_joined([part.blobs[0] for part in parts]),
        b'],"lengths":[',
        *_joined([part.blobs[1] for part in parts]),
        b'],"num_tokens":',
        str(tokens).encode(),
        b"}",
    ]
    return Answer(False, body, model, texts, tokens, work=work)


def join_detokenize(model: int, name: str, parts: Sequence[ChunkResult]) -> Answer:
    """The /v1/detokenize answer of a split request."""
    body: list[Buffer] = [
        b'{"model":',
        orjson.dumps(name),
        b',"texts":[',
        *_joined([part.blobs[0] for part in parts]),
        b"]}",
    ]
    texts = sum(part.texts for part in parts)
    tokens = sum(part.tokens for part in parts)
    return Answer(False, body, model, texts, tokens, work=[part.work for part in parts])
