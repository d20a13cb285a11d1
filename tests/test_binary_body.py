"""Binary request bodies (docs/api.md, "Binary request bodies"): texts as a frame of UTF-8 bytes and offsets,
the client's default with format="binary". The same answers as JSON bodies, and every malformed frame a 4xx
that says what and where, the server staying up."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import EDGE_CASES, MAX_TEXTS, Server
from tokenizer_client import TokenizerClient, wire
from tokenizer_client._requests import post, texts_frame
from tokenizer_service.core.errors import InvalidField, InvalidJSON, PayloadTooLarge
from tokenizer_service.core.requests import PackRequest, TokenizeRequest, parse_request

HEADERS = {"content-type": wire.MEDIA_TYPE, "accept": wire.MEDIA_TYPE}


def frame(texts_bytes: bytes, offsets: list[int], meta: dict | None = None, **arrays: np.ndarray) -> bytes:
    found = {"texts": np.frombuffer(texts_bytes, dtype=np.uint8), "offsets": np.array(offsets, dtype=np.int64)}
    return wire.encode({**found, **arrays}, meta or {})


# -- without a server -------------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(), max_size=20), st.booleans())
def test_a_frame_stands_for_the_same_request_as_its_json(texts, add_eos):
    payload = {"texts": texts, "model": "m", "add_eos": add_eos}
    body = texts_frame(payload)
    assert body is not None and body.startswith(wire.MAGIC)
    assert parse_request(body, TokenizeRequest, "texts", 1000) == TokenizeRequest.model_validate(payload)


def test_the_client_sends_a_frame_for_binary_answers_and_json_otherwise():
    assert post("/v1/tokenize", {"texts": ["a"]}, "binary").headers["content-type"] == wire.MEDIA_TYPE
    assert post("/v1/tokenize", {"texts": ["a"]}, "json").headers["content-type"] == "application/json"
    # a lone surrogate cannot be UTF-8: sent as JSON, which the server refuses naming the text
    assert post("/v1/tokenize", {"texts": ["a", "\ud800"]}, "binary").headers["content-type"] == "application/json"
    assert post("/v1/detokenize", {"ids": [[1]]}).headers["content-type"] == "application/json"


def test_pack_options_travel_in_the_meta():
    payload = {"texts": ["a b", "c"], "seq_len": 8, "carry": [1, 2], "carry_document_starts": [0]}
    body = texts_frame(payload)
    assert body is not None
    assert parse_request(body, PackRequest, "texts", 10) == PackRequest.model_validate(payload)


@pytest.mark.parametrize(
    ("body", "error", "says"),
    [
        (wire.MAGIC + b"\1\0", InvalidJSON, "is not a valid application/x-tokenizer-arrays frame"),
        (frame(b"ab", [0, 1]), InvalidField, "offsets must run from 0 to the 2 bytes"),
        (frame(b"ab", [1, 2]), InvalidField, "offsets must run from 0"),
        (frame(b"abc", [0, 2, 1, 3]), InvalidField, "texts[1]: its offsets go down (2 to 1)"),
        (frame(b"a\xffb", [0, 1, 3]), InvalidField, "texts[1] is not valid UTF-8 (its byte 0)"),
        (frame(b"ab", [0, 2], {"texts": ["x"]}), InvalidField, "texts cannot be in a binary body's meta"),
        (frame(b"ab", [0, 2], extra=np.zeros(1, np.int32)), InvalidField, "carries two arrays"),
        (wire.encode({"texts": np.zeros(2, np.int32), "offsets": np.array([0, 2])}), InvalidField, "1-D uint8"),
        (frame(b"ab", [0, 2], {"add_eos": "yes"}), InvalidField, "add_eos"),
        (frame(b"a" * 11, list(range(12))), PayloadTooLarge, "11 texts in one request exceed the limit of 10"),
    ],
)
def test_a_malformed_frame_is_refused_saying_where(body, error, says):
    with pytest.raises(error) as raised:
        parse_request(body, TokenizeRequest, "texts", 10)
    assert says in raised.value.message


def test_invalid_utf8_names_the_text():
    with pytest.raises(InvalidField) as raised:
        parse_request(frame(b"ok" + b"\xe2\x82", [0, 2, 4]), TokenizeRequest, "texts", 10)
    assert (raised.value.field, raised.value.index) == ("texts", 1)


# -- through a server --------------------------------------------------------------------------------------


def test_a_frame_gets_the_answer_a_json_body_gets(server: Server, documents):
    texts = documents[:40] + EDGE_CASES
    payload = {"texts": texts, "model": "bpe", "add_bos": True, "max_length": 64}
    as_frame = httpx.post(f"{server.url}/v1/tokenize", content=texts_frame(payload), headers=HEADERS, timeout=60)
    as_json = httpx.post(f"{server.url}/v1/tokenize", json=payload, headers={"accept": wire.MEDIA_TYPE}, timeout=60)
    assert as_frame.status_code == as_json.status_code == 200
    assert as_frame.content == as_json.content  # the same frame, byte for byte
    pack = {"texts": texts, "model": "bpe", "seq_len": 128, "carry": [5, 6, 7]}
    packed = [
        httpx.post(f"{server.url}/v1/pack", content=texts_frame(pack), headers=HEADERS, timeout=60),
        httpx.post(f"{server.url}/v1/pack", json=pack, headers={"accept": wire.MEDIA_TYPE}, timeout=60),
    ]
    assert [answer.status_code for answer in packed] == [200, 200]
    assert packed[0].content == packed[1].content


def test_the_client_default_sends_frames_with_exact_ids(server: Server, documents):
    texts = documents[:300] + EDGE_CASES
    with TokenizerClient(server.url, timeout=60) as client:
        got = client.tokenize(texts, model="uni")
    assert [ids.tolist() for ids in got] == server.processor("uni").encode(texts)


def test_a_bad_frame_is_a_4xx_saying_where_and_the_server_stays_up(server: Server):
    cases = [
        (frame(b"a\xffb", [0, 1, 3]), 422, "texts[1] is not valid UTF-8"),
        (wire.MAGIC + b"\1\0\0\0\xff\xff\xff\x7f", 400, "truncated inside its header"),
        (frame(b"a" * (MAX_TEXTS + 1), list(range(MAX_TEXTS + 2))), 413, f"exceed the limit of {MAX_TEXTS}"),
    ]
    for body, status, says in cases:
        answer = httpx.post(f"{server.url}/v1/tokenize", content=body, headers=HEADERS, timeout=60)
        assert answer.status_code == status, answer.text
        assert says in answer.json()["error"]["message"]
    refused = httpx.post(f"{server.url}/v1/detokenize", content=frame(b"a", [0, 1]), headers=HEADERS, timeout=60)
    assert refused.status_code == 400 and "this endpoint takes JSON" in refused.json()["error"]["message"]
    ok = httpx.post(f"{server.url}/v1/tokenize", json={"texts": ["still up"]}, timeout=60)
    assert ok.status_code == 200
