"""Every input is a 4xx, never a 5xx: deep JSON, other encodings, options a model cannot honour, fuzz."""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest
import sentencepiece as spm
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from tests.conftest import DATA, start_server, stop_server

ROUTES = ["/v1/tokenize", "/v1/detokenize", "/v1/pack"]


def post(url: str, path: str, body: bytes, **headers: str) -> httpx.Response:
    return httpx.post(f"{url}{path}", content=body, headers={"content-type": "application/json", **headers}, timeout=30)


@pytest.mark.parametrize("path", ROUTES)
@pytest.mark.parametrize(
    "body",
    [
        b"[" * 100_000,
        b'{"texts": ' + b"[" * 2000 + b"]" * 2000 + b"}",
        b'{"ids": ' + b"[" * 2000 + b"]" * 2000 + b"}",
        b'{"texts": ["a"], "x": ' + b'{"a":' * 1100 + b"1" + b"}" * 1100 + b"}",
    ],
    ids=["100k-brackets", "2000-levels-in-texts", "2000-levels-in-ids", "1100-objects"],
)
def test_json_nested_too_deep_is_400(server, path, body):
    answer = post(server.url, path, body)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["type"] == "invalid_json"
    assert "nests deeper than 1024 levels" in answer.json()["error"]["message"]


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le"])
@pytest.mark.parametrize("bom", [True, False])
def test_a_body_that_is_not_utf8_is_400(server, encoding, bom):
    text = '{"texts": ["I am a cat."]}'
    body = text.encode(encoding)
    if bom and not encoding.endswith(("le", "be")):
        pass  # "utf-16" and "utf-32" write a BOM themselves
    elif bom:
        body = (codecs.BOM_UTF16_LE if "16" in encoding else codecs.BOM_UTF32_LE) + body
    answer = post(server.url, "/v1/tokenize", body)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["type"] == "invalid_json"


@pytest.mark.parametrize("path", ["/v1/tokenize", "/v1/pack"])
@pytest.mark.parametrize(
    ("body", "field", "index", "says"),
    [
        (
            b'{"conversations": [[{"role": "user", "content": "a\\ud800"}, {"role": "assistant", "content": "x"}]]}',
            "conversations",
            0,
            "conversations[0].messages[0].content has a lone surrogate at character 1",
        ),
        (
            b'{"conversations": [[{"role": "user", "content": "a"}, {"role": "assistant\\udfff", "content": "x"}]]}',
            "conversations",
            0,
            "conversations[0].messages[1].role has a lone surrogate",
        ),
        (
            b'{"records": [{"prompt": "a", "completion": "b"}, {"prompt": "a", "completion": "x\\udc00"}]}',
            "records",
            1,
            "records[1].completion has a lone surrogate",
        ),
        (b'{"texts": ["ok", "\\ud800"]}', "texts", 1, "texts[1] has a lone surrogate at character 0"),
        (b'{"texts": ["ok"], "\\ud800": 1}', None, None, "a key of the request body has a lone surrogate"),
    ],
    ids=["conversation-content", "conversation-role", "record", "text", "key"],
)
def test_a_lone_surrogate_anywhere_is_422_saying_where(server, path, body, field, index, says):
    """Not only in texts: a conversation's or record's string with a lone surrogate reached the chat template or the
    encoder and was a 500; a key with one could not even be quoted in the answer."""
    answer = post(server.url, path, body)
    assert answer.status_code == 422, answer.text
    error = answer.json()["error"]
    assert says in error["message"] and "must be valid Unicode" in error["message"]
    assert error.get("field") == field and error.get("index") == index


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/tokenize", b'{"texts": ["a"], "max_length": ' + b"1" * 4301 + b"}", "max_length"),
        ("/v1/detokenize", b'{"ids": [[' + b"9" * 5000 + b"]]}", "ids"),
        ("/v1/detokenize", b'{"ids": [[-' + b"9" * 5000 + b"]]}", "ids"),
        ("/v1/pack", b'{"texts": ["a"], "seq_len": ' + b"7" * 10_000 + b"}", "seq_len"),
    ],
    ids=["max_length", "id", "negative-id", "seq_len"],
)
def test_an_integer_of_thousands_of_digits_is_422_naming_its_field(server, path, body, field):
    """More digits than Python converts from text (4,300): it was a 400 saying "number is infinity"."""
    answer = post(server.url, path, body)
    assert answer.status_code == 422, answer.text
    assert answer.json()["error"]["field"] == field


@pytest.mark.parametrize(
    ("path", "body", "field", "says"),
    [
        ("/v1/tokenize", b'{"texts": ["a"], "max_length": ' + b"1" * 25 + b"}", "max_length", "less than or equal"),
        ("/v1/pack", b'{"texts": ["a"], "seq_len": ' + b"7" * 300 + b"}", "seq_len", "less than or equal"),
        ("/v1/pack", b'{"texts": ["a"], "seq_len": -' + b"7" * 21 + b"}", "seq_len", "greater than or equal"),
        ("/v1/detokenize", b'{"ids": [[5, ' + b"9" * 40 + b"]]}", "ids", "less than or equal"),
    ],
    ids=["max_length", "seq_len", "negative-seq_len", "id"],
)
def test_an_integer_beyond_64_bits_is_refused_by_its_fields_bound(server, path, body, field, says):
    """orjson reads an integer of 20 to 300 digits as a float, which the fields' strict integers refused as "not a
    valid integer": the field's bound says what is wrong, as for any other integer too large for it."""
    answer = post(server.url, path, body)
    assert answer.status_code == 422, answer.text
    error = answer.json()["error"]
    assert error["field"] == field and says in error["message"] and "valid integer" not in error["message"], error


@pytest.mark.parametrize("encoding", ["gzip", "br", "gzip, chunked", "deflate"])
def test_a_compressed_body_is_415_and_identity_is_read_as_sent(server, encoding):
    """A probe's plain body with Content-Encoding: gzip was answered 200 as if plain, and a real gzip body got a
    400 about JSON: bodies are read as sent, and a Content-Encoding saying otherwise is refused naming it."""
    import gzip

    body = b'{"texts": ["I am a cat."]}'
    for sent in (body, gzip.compress(body)):
        answer = post(server.url, "/v1/tokenize", sent, **{"content-encoding": encoding})
        assert answer.status_code == 415, answer.text
        error = answer.json()["error"]
        assert error["type"] == "unsupported_encoding" and encoding in error["message"]
    assert post(server.url, "/v1/tokenize", body, **{"content-encoding": "identity"}).status_code == 200


def test_a_utf8_bom_is_400(server):
    answer = post(server.url, "/v1/tokenize", codecs.BOM_UTF8 + b'{"texts": ["a"]}')
    assert answer.status_code == 400 and answer.json()["error"]["type"] == "invalid_json"


@pytest.mark.parametrize(
    ("accept", "binary"),
    [
        ("application/x-tokenizer-arrays;q=0", False),
        ("application/json, application/x-tokenizer-arrays;q=0.5", False),
        ("application/x-tokenizer-arrays-v2", False),
        ("APPLICATION/X-TOKENIZER-ARRAYS", True),
    ],
)
def test_accept_is_negotiated_not_matched_as_a_substring(server, accept, binary):
    answer = post(server.url, "/v1/tokenize", b'{"texts": ["a cat"]}', accept=accept)
    assert answer.status_code == 200
    assert answer.headers["content-type"].startswith("application/x-tokenizer-arrays" if binary else "application/json")


# -- a model without BOS and EOS --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bare_model(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("bare")
    spm.SentencePieceTrainer.train(
        input=str(DATA / "botchan.txt"),
        model_prefix=str(directory / "bare"),
        vocab_size=1000,
        bos_id=-1,
        eos_id=-1,
        minloglevel=2,
        num_threads=2,
    )
    return directory / "bare.model"


@pytest.fixture(scope="module")
def bare(tmp_path_factory, bare_model) -> Iterator[str]:
    url, process = start_server(
        ["--workers", "1", "--model", f"bare={bare_model}"], tmp_path_factory.mktemp("bare-server") / "log"
    )
    yield url
    stop_server(process)


@pytest.mark.parametrize(
    ("path", "field", "document"),
    [
        ("/v1/tokenize", "add_eos", {"texts": ["a"], "add_eos": True}),
        ("/v1/tokenize", "add_bos", {"texts": ["a"], "add_bos": True}),
        ("/v1/pack", "add_eos", {"texts": ["a"], "seq_len": 8, "add_eos": True}),
        ("/v1/pack", "add_bos", {"texts": ["a"], "seq_len": 8, "add_bos": True}),
    ],
)
@pytest.mark.slow  # a server of its own; .ci/run's slow stage
def test_special_tokens_the_model_lacks_are_422_naming_the_field(bare, path, field, document):
    answer = post(bare, path, orjson.dumps(document))
    assert answer.status_code == 422, answer.text
    error = answer.json()["error"]
    assert error["type"] == "invalid_field" and error["field"] == field
    assert "has no" in error["message"]


def packed_tokens(answer: httpx.Response) -> list[int]:
    """Every token of a concat answer, rows then leftover (concat pads nothing)."""
    document = answer.json()
    return [token for row in document["input_ids"] for token in row] + document["leftover"]


@pytest.mark.slow  # a server of its own; .ci/run's slow stage
def test_pack_defaults_to_eos_only_when_the_model_has_one(bare, bare_model, server, documents):
    texts = documents[:20]
    answer = post(bare, "/v1/pack", orjson.dumps({"texts": texts, "seq_len": 64}))
    assert answer.status_code == 200, answer.text
    sp = spm.SentencePieceProcessor(model_file=str(bare_model))
    assert packed_tokens(answer) == [token for ids in sp.encode(texts) for token in ids]  # no EOS added
    with_eos = post(server.url, "/v1/pack", orjson.dumps({"texts": texts, "seq_len": 64, "model": "uni"}))
    uni = server.processor("uni")
    assert packed_tokens(with_eos) == [token for ids in uni.encode(texts, add_eos=True) for token in ids]


# -- fuzz --------------------------------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)
bodies = st.one_of(
    st.binary(max_size=200),
    json_values.map(lambda value: json.dumps(value).encode()),  # big integers, NaN and all
    st.fixed_dictionaries(
        {},
        optional={
            "texts": st.lists(st.text(max_size=30) | st.integers(-(2**63), 2**63) | st.none(), max_size=5),
            "ids": st.lists(st.lists(st.integers(-5, 5000), max_size=5) | st.text(max_size=3), max_size=4),
            "model": st.sampled_from([None, "uni", "nope", 3]),
            "add_bos": st.booleans() | st.integers(-9, 9),
            "add_eos": st.booleans() | st.none(),
            "max_length": st.integers(-3, 5) | st.none(),
            "seq_len": st.integers(-3, 300000) | st.text(max_size=2),
            "strategy": st.sampled_from(["concat", "best_fit", "other"]),
            "carry": st.lists(st.integers(-2, 4000), max_size=3) | st.none(),
            "carry_document_starts": st.lists(st.integers(-2, 4), max_size=3) | st.none(),
            "sample": st.none()
            | st.fixed_dictionaries(
                {}, optional={"alpha": st.floats(allow_nan=False), "seed": st.integers(-(2**63), 2**63)}
            ),
        },
    ).map(lambda document: orjson.dumps(document)),
)


@pytest.mark.slow  # fuzzing; .ci/run's slow stage
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(ROUTES), body=bodies)
def test_fuzzed_bodies_get_a_4xx_or_a_200_never_a_5xx(server, path, body):
    answer = post(server.url, path, body)
    assert answer.status_code < 500, (body[:300], answer.text[:300])
    if answer.status_code >= 400:
        assert set(answer.json()["error"]) >= {"type", "message"}


def test_a_text_that_expands_beyond_the_limit_under_normalization_is_413_naming_it(server):
    texts = ["an ordinary text", "\ufdfa" * 200_000]  # 600 KB of body; 18 characters each once normalized
    answer = post(server.url, "/v1/tokenize", orjson.dumps({"texts": texts, "model": "uni"}))
    assert answer.status_code == 413, answer.text[:300]
    error = answer.json()["error"]
    assert (error["type"], error["field"], error["index"]) == ("payload_too_large", "texts", 1)
    assert "normalization" in error["message"]
    few = post(server.url, "/v1/tokenize", orjson.dumps({"texts": ["\ufdfa" * 100], "model": "uni"}))
    assert few.status_code == 200 and few.json()["ids"] == server.processor("uni").encode(["\ufdfa" * 100])


@pytest.mark.parametrize("path", [*ROUTES, "/healthz"])
def test_a_websocket_handshake_is_a_json_400_saying_the_server_speaks_none(server, path):
    """A probe's WebSocket client on /v1/tokenize got uvicorn's bare 403 (its WebSocket protocol, with no route to
    accept): now the service's JSON error, 400 (RFC 6455 section 4.2.2), saying it speaks no WebSocket."""
    with pytest.raises(InvalidStatus) as refused:
        connect(server.url.replace("http://", "ws://") + path, open_timeout=30)
    answer = refused.value.response
    assert answer.status_code == 400
    assert answer.headers["content-type"] == "application/json"
    error = orjson.loads(answer.body)["error"]
    assert error["type"] == "invalid_request"
    assert error["message"].startswith(f"this server does not speak WebSocket, on {path} or anywhere"), error


def test_a_post_offering_a_websocket_upgrade_is_served_over_http(server):
    """Not a handshake (RFC 6455 section 4.1: that is a GET): the upgrade is ignored, as RFC 9110 section 7.8
    allows, and the request served (it hung on uvicorn's WebSocket protocol)."""
    upgrade = {"connection": "Upgrade", "upgrade": "websocket", "sec-websocket-version": "13"}
    answer = post(server.url, "/v1/tokenize", orjson.dumps({"texts": ["upgrade me not"]}), **upgrade)
    assert answer.status_code == 200, answer.text
    assert answer.json()["num_tokens"] > 0
