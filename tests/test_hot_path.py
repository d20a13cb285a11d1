"""The hot path's pure pieces, without a server: framing, worker handler, joined answers, Accept.

The property that matters most: a request split over workers answers byte for byte what the same
request answers unsplit, in JSON and in the binary frame, for tokenize, detokenize and pack.
"""

from __future__ import annotations

import math
import pickle
import random

import numpy as np
import orjson
import pytest
import sentencepiece as spm
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenizer_client import wire
from tokenizer_service.core import channel, process
from tokenizer_service.core.handler import Handler, Limits, TextMarker
from tokenizer_service.core.join import join_detokenize, join_tokenize, read_chunk_result, read_done
from tokenizer_service.core.protocol import CHUNK_HEAD, DETOKENIZE, PACK, REQUEST_HEAD, SPLIT_HEAD, TOKENIZE
from tokenizer_service.core.registry import inspect_model
from tokenizer_service.http.negotiation import wants_binary
from tokenizer_service.settings import BUNDLED_MODELS_DIR

MODEL = BUNDLED_MODELS_DIR / "default.model"


# -- framing -------------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.sampled_from([0, 1, 7, 100, 5000, 140_000, 300_000]), min_size=1, max_size=6),
    cuts=st.lists(st.integers(1, 200_000), min_size=1, max_size=20),
)
def test_frames_survive_any_cutting_of_the_stream(sizes, cuts):
    rng = random.Random(len(sizes))
    frames = [(number, 11 + number % 5, rng.randbytes(size)) for number, size in enumerate(sizes, start=1)]
    stream = b"".join(b"".join(channel.frame(number, kind, payload)) for number, kind, payload in frames)
    reader = channel.FrameReader()
    received = []
    position, turn = 0, 0
    while position < len(stream):
        step = cuts[turn % len(cuts)]
        turn += 1
        received.extend(reader.feed(stream[position : position + step]))
        position += step
    assert [(number, kind, bytes(payload)) for number, kind, payload in received] == frames


def test_blobs_round_trip():
    blobs = [b"", b"abc", bytes(range(256)) * 10]
    payload = b"head" + b"".join(channel.join_blobs(blobs))
    assert [bytes(blob) for blob in channel.split_blobs(payload, 4)] == blobs
    with pytest.raises(ValueError):
        channel.split_blobs(payload + b"x", 4)


# -- worker handler -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def handler() -> Handler:
    info = inspect_model("default", MODEL)
    process.load_models([info])
    limits = Limits(max_texts=8192, max_seq_len=131072, min_chunk_chars=2000)
    return Handler([info], [process.library("default")], "default", limits, TextMarker(None))


@pytest.fixture(scope="module")
def sp() -> spm.SentencePieceProcessor:
    return spm.SentencePieceProcessor(model_file=str(MODEL))


def run(handler: Handler, kind: int, payload: list, shared: list | None = None) -> tuple[int, bytes]:
    """The reply to one job; what the job shares before it (SHARE frames) goes into `shared`."""

    def share(kind: int, parts: list) -> None:
        assert shared is not None, "this job was not expected to share"
        shared.append((kind, b"".join(bytes(part) for part in parts)))

    reply, parts = handler.handle(kind, b"".join(bytes(part) for part in payload), share)
    return reply, b"".join(bytes(part) for part in parts)


def request(
    handler: Handler,
    route: int,
    document: dict,
    *,
    binary: bool = False,
    parts: int = 1,
    careful: bool = False,
    shared: list | None = None,
):
    head = REQUEST_HEAD.pack(route, binary, parts, careful)
    return run(handler, channel.REQUEST, [head, orjson.dumps(document)], shared)


def answered_whole(handler: Handler, route: int, document: dict, binary: bool) -> bytes:
    kind, payload = request(handler, route, document, binary=binary, parts=1)
    assert kind == channel.DONE
    return b"".join(bytes(part) for part in read_done(payload).body)


def answered_split(handler: Handler, route: int, document: dict, binary: bool, parts: int) -> bytes:
    """The answer as the pool builds it: the worker shares every chunk but its own, then replies its own PART."""
    shared: list = []
    kind, own = request(handler, route, document, binary=binary, parts=parts, shared=shared)
    assert [frame_kind for frame_kind, _ in shared] == [channel.SHARE], "the request should be large enough to split"
    assert kind == channel.PART
    payload = shared[0][1]
    model, split_route, texts, seeded = SPLIT_HEAD.unpack_from(payload)
    assert (split_route, seeded) == (route, False)
    blobs = channel.split_blobs(payload, SPLIT_HEAD.size)
    units, context, chunks = np.frombuffer(blobs[0], dtype=np.int64), blobs[1], blobs[2:]
    assert 1 <= len(chunks) < parts and len(chunks) == len(units)
    first = pickle.loads(chunks[0])
    assert first.first_index == read_chunk_result(own, blobs=False).texts > 0  # the worker kept texts 0.. for itself
    replies = [own]
    for chunk in chunks:
        reply, part = run(handler, channel.CHUNK, [CHUNK_HEAD.pack(False), chunk])
        assert reply == channel.PART
        replies.append(part)
    if route == DETOKENIZE:
        answer = join_detokenize(model, "default", [read_chunk_result(part, blobs=False) for part in replies])
    elif route == PACK:
        finish = channel.join_blobs([context, *replies])
        reply, done = run(handler, channel.FINISH, finish)
        assert reply == channel.DONE
        answer = read_done(done)
    else:
        answer = join_tokenize(model, "default", [read_chunk_result(part) for part in replies], binary)
    assert answer.texts == texts
    return b"".join(bytes(part) for part in answer.body)


@pytest.mark.parametrize("binary", [False, True])
@pytest.mark.parametrize("parts", [2, 3, 5])
def test_a_split_tokenize_answers_byte_for_byte_what_a_whole_one_does(handler, sp, documents, binary, parts):
    document = {"texts": documents[:200], "add_bos": True, "max_length": 30}
    whole = answered_whole(handler, TOKENIZE, document, binary)
    assert answered_split(handler, TOKENIZE, document, binary, parts) == whole
    expected = [ids[:30] for ids in sp.encode(documents[:200], add_bos=True)]
    if binary:
        frame = wire.decode(whole)
        assert [row.tolist() for row in wire.split_ragged(frame["ids"], frame["offsets"])] == expected
        assert frame.meta == {"model": "default", "num_tokens": sum(map(len, expected))}
    else:
        assert orjson.loads(whole)["ids"] == expected


@pytest.mark.parametrize("binary", [False, True])
@pytest.mark.parametrize("strategy", ["concat", "best_fit"])
def test_a_split_pack_answers_what_a_whole_one_does(handler, documents, binary, strategy):
    document = {"texts": documents[:200], "seq_len": 128, "strategy": strategy}
    if strategy == "concat":
        document |= {"carry": [5, 6, 7], "carry_document_starts": [1]}
    assert answered_split(handler, PACK, document, binary, 3) == answered_whole(handler, PACK, document, binary)


def test_a_split_detokenize_answers_what_a_whole_one_does(handler, sp, documents):
    ids = sp.encode(documents[:60])
    whole = answered_whole(handler, DETOKENIZE, {"ids": ids}, False)
    assert orjson.loads(whole)["texts"] == sp.decode(ids)
    assert answered_split(handler, DETOKENIZE, {"ids": ids}, False, 4) == whole


def test_a_careful_run_gives_the_same_ids(handler, documents):
    document = {"texts": documents[:40]}
    kind, payload = request(handler, TOKENIZE, document, parts=4, careful=True)
    assert kind == channel.DONE  # careful: never split, one text at a time
    assert b"".join(bytes(p) for p in read_done(payload).body) == answered_whole(handler, TOKENIZE, document, False)


def test_seeded_sampling_is_handed_to_the_sampler_in_one_chunk(handler, documents):
    kind, payload = request(handler, TOKENIZE, {"texts": documents[:40], "sample": {"seed": 3}}, parts=4)
    assert kind == channel.SPLIT
    _, _, texts, seeded = SPLIT_HEAD.unpack_from(payload)
    chunks = channel.split_blobs(payload, SPLIT_HEAD.size)[2:]
    assert (texts, seeded, len(chunks)) == (40, True, 1)
    assert pickle.loads(chunks[0]).texts == documents[:40]


@pytest.mark.parametrize(
    ("document", "expected"),
    [
        (b"{", {"type": "invalid_json"}),
        (b'{"texts": ["a"], "model": "nope"}', {"type": "model_not_found", "field": "model"}),
        (b'{"texts": ["a", 3]}', {"type": "invalid_field", "field": "texts", "index": 1}),
        (b'{"texts": ["a"], "add_bos": "yes"}', {"type": "invalid_field", "field": "add_bos"}),
    ],
)
def test_bad_input_is_a_failed_reply_naming_what_was_wrong(handler, document, expected):
    kind, payload = run(handler, channel.REQUEST, [REQUEST_HEAD.pack(TOKENIZE, False, 1, False), document])
    assert kind == channel.FAILED
    error = orjson.loads(payload)
    assert {key: error[key] for key in expected} == expected and error["message"]


def test_a_remembered_poison_text_is_refused_before_tokenizing(handler):
    import hashlib
    import struct

    text = "a text that once killed a worker"
    digest = hashlib.sha256(text.encode()).digest()
    handler.remember_poison(struct.pack("<HQ", 0, len(text)) + digest)
    kind, payload = request(handler, TOKENIZE, {"texts": ["fine", text]})
    assert kind == channel.FAILED
    assert orjson.loads(payload)["type"] == "poison_input" and orjson.loads(payload)["index"] == 1


def test_done_carries_what_the_metrics_need(handler, documents):
    _, payload = request(handler, PACK, {"texts": documents[:3], "seq_len": 64})
    answer = read_done(payload)
    assert (answer.model, answer.texts, answer.binary) == (0, 3, False)
    assert answer.tokens > 0 and 0 <= answer.padding <= 1
    _, payload = request(handler, TOKENIZE, {"texts": documents[:3]})
    assert math.isnan(read_done(payload).padding)


# -- Accept ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("accept", "binary"),
    [
        (None, False),
        ("application/json", False),
        ("*/*", False),
        ("application/x-tokenizer-arrays", True),
        ("APPLICATION/X-Tokenizer-Arrays", True),
        ("application/x-tokenizer-arrays;q=0", False),
        ("application/x-tokenizer-arrays; q=0.5, application/json", False),
        ("application/json;q=0.5, application/x-tokenizer-arrays", True),
        ("application/x-tokenizer-arrays-v2", False),
        ("application/x-tokenizer-arrays, */*;q=0.1", True),
        (b"application/x-tokenizer-arrays", True),
    ],
)
def test_accept_is_a_list_of_media_ranges_with_qualities(accept, binary):
    assert wants_binary(accept) is binary
