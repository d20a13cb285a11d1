"""Every error case: status, JSON error body, and the server still answering correctly afterwards."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest

from tests.conftest import MAX_REQUEST_BYTES, MAX_TEXTS, Server, free_port
from tokenizer_client import AsyncTokenizerClient, TokenizerClient, TokenizerConnectionError, TokenizerServiceError

CASES = [
    # (endpoint, raw body or JSON document, status, error type, field, index)
    ("tokenize", {"texts": "not a list"}, 422, "invalid_field", "texts", None),
    ("tokenize", {"texts": ["ok", "fine", 7]}, 422, "invalid_field", "texts", 2),
    ("tokenize", {"texts": ["ok", None]}, 422, "invalid_field", "texts", 1),
    ("tokenize", {"texts": ["ok"], "max_length": -1}, 422, "invalid_field", "max_length", None),
    ("tokenize", {"texts": ["ok"], "add_bos": "yes"}, 422, "invalid_field", "add_bos", None),
    ("tokenize", {"texts": ["ok"], "sample": {"alpha": 0}}, 422, "invalid_field", "sample.alpha", None),
    ("tokenize", {"texts": ["ok"], "sample": {"alpha": 0.1, "seed": -5}}, 422, "invalid_field", "sample.seed", None),
    ("tokenize", {"texts": ["ok"], "sample": {"nbest_size": 0}}, 422, "invalid_field", "sample.nbest_size", None),
    ("tokenize", {"texts": ["ok"], "sample": {"nbest_size": 1}}, 422, "invalid_field", "sample.nbest_size", None),
    ("tokenize", {"texts": ["ok"], "sample": {"nbest_size": 513}}, 422, "invalid_field", "sample.nbest_size", None),
    ("tokenize", {"texts": ["ok"], "sample": {"nbest_size": 2**40}}, 422, "invalid_field", "sample.nbest_size", None),
    ("tokenize", {"texts": ["ok"], "unknown_option": 1}, 422, "invalid_field", "unknown_option", None),
    ("tokenize", {}, 422, "invalid_field", "texts", None),
    ("tokenize", [1, 2], 422, "invalid_field", None, None),
    ("tokenize", b'{"texts": ["fine", "lone \\ud800 surrogate"]}', 422, "invalid_field", "texts", 1),
    ("tokenize", b'{"texts": ["ok"', 400, "invalid_json", None, None),
    ("tokenize", b'{"texts": ["\xff\xfe"]}', 400, "invalid_json", None, None),
    ("tokenize", {"texts": ["ok"], "model": "missing"}, 404, "model_not_found", "model", None),
    ("detokenize", {"ids": [[5, 6], [7, 4000000]]}, 422, "invalid_field", "ids", 1),
    ("detokenize", {"ids": [[-1]]}, 422, "invalid_field", "ids", 0),
    ("detokenize", {"ids": [[1], [2], [2**70]]}, 422, "invalid_field", "ids", 2),
    ("detokenize", {"ids": [[1], ["a"]]}, 422, "invalid_field", "ids", 1),
    ("detokenize", {"ids": [1, 2]}, 422, "invalid_field", "ids", 0),
    ("detokenize", {"ids": [[1]], "model": "missing"}, 404, "model_not_found", "model", None),
]


def post(server: Server, endpoint: str, body: object, **kwargs: object) -> httpx.Response:
    content = body if isinstance(body, bytes) else None
    document = None if isinstance(body, bytes) else body
    return httpx.post(f"{server.url}/v1/{endpoint}", content=content, json=document, timeout=30, **kwargs)


def assert_still_serving(server: Server) -> None:
    assert httpx.get(f"{server.url}/healthz").status_code == 200
    answer = httpx.post(f"{server.url}/v1/tokenize", json={"texts": ["still here"], "model": "uni"}).json()
    assert answer["ids"] == [server.processor("uni").encode("still here")]


@pytest.mark.parametrize(("endpoint", "body", "status", "kind", "field", "index"), CASES)
def test_error_cases(server, endpoint, body, status, kind, field, index):
    response = post(server, endpoint, body)
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert error["type"] == kind
    assert error["message"]
    assert error.get("field") == field
    assert error.get("index") == index
    assert "Traceback" not in response.text
    assert_still_serving(server)


def test_too_many_texts(server):
    response = post(server, "tokenize", {"texts": ["a"] * (MAX_TEXTS + 1)})
    assert response.status_code == 413
    assert response.json()["error"] == {
        "type": "payload_too_large",
        "message": f"{MAX_TEXTS + 1} texts in one request exceed the limit of {MAX_TEXTS}",
        "field": "texts",
    }
    assert post(server, "detokenize", {"ids": [[1]] * (MAX_TEXTS + 1)}).status_code == 413
    assert post(server, "tokenize", {"texts": ["a"] * MAX_TEXTS}).status_code == 200
    assert_still_serving(server)


def test_body_over_the_byte_limit(server):
    body = b'{"texts": ["' + b"x" * MAX_REQUEST_BYTES + b'"]}'
    response = post(server, "tokenize", body)
    assert response.status_code == 413
    assert response.json()["error"]["type"] == "payload_too_large"
    assert_still_serving(server)


def test_chunked_body_over_the_byte_limit(server):
    def chunks():
        yield b'{"texts": ["'
        for _ in range(MAX_REQUEST_BYTES // 65536 + 2):
            yield b"y" * 65536
        yield b'"]}'

    response = httpx.post(f"{server.url}/v1/tokenize", content=chunks(), timeout=30)
    assert response.status_code == 413
    assert_still_serving(server)


def test_unknown_route_and_method(server):
    missing = httpx.get(f"{server.url}/v1/nothing")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found"
    wrong = httpx.get(f"{server.url}/v1/tokenize")
    assert wrong.status_code == 405 and wrong.json()["error"]["type"] == "method_not_allowed"


def test_client_raises_typed_errors(server):
    with TokenizerClient(server.url) as client:
        with pytest.raises(TokenizerServiceError) as caught:
            client.tokenize(["fine", "lone \ud800 surrogate"], model="uni")
        assert caught.value.status == 422
        assert caught.value.index == 1 and caught.value.field == "texts"
        assert caught.value.body["error"]["type"] == "invalid_field"
        assert not caught.value.retryable
        with pytest.raises(TokenizerServiceError) as caught:
            client.tokenize(["x"], model="missing")
        assert caught.value.status == 404
        with pytest.raises(TokenizerServiceError) as caught:
            client.detokenize([[1, 10**9]], model="uni")
        assert caught.value.status == 422 and caught.value.index == 0
        assert client.tokenize(["after errors"], model="uni")[0].tolist() == server.processor("uni").encode(
            "after errors"
        )


def test_client_connection_error_and_closed_client():
    client = TokenizerClient(f"http://127.0.0.1:{free_port()}", timeout=2)
    with pytest.raises(TokenizerConnectionError):
        client.tokenize(["x"])
    assert not client.ready()
    client.close()
    with pytest.raises(RuntimeError, match="closed"):
        client.tokenize(["x"])


def test_a_model_is_a_name_never_a_path(server):
    served = str(server.model_files["uni"])
    for name in (served, served.removesuffix(".model"), "../uni", "./uni", "/etc/passwd", "uni/../uni", "UNI", ""):
        response = post(server, "tokenize", {"texts": ["x"], "model": name})
        assert response.status_code == 404, name
        error = response.json()["error"]
        assert error["type"] == "model_not_found" and error["field"] == "model"
        assert error["message"].startswith(f"model {name!r} is not served here; served models: ")
    listing = httpx.get(f"{server.url}/v1/models").text
    assert "path" not in listing and str(server.model_files["uni"].parent) not in listing  # no file paths
    assert_still_serving(server)


MISTAKES = [
    # (what a newcomer writes, the exception, what its message says)
    (lambda c: c.tokenize("I am a cat."), TypeError, "not a single str: for one text, pass [text]"),
    (lambda c: c.tokenize_batch(b"bytes"), TypeError, "not a single bytes"),
    (lambda c: c.tokenize({"a": "text"}), TypeError, "not a dict"),
    (lambda c: c.pack("I am a cat.", 8), TypeError, "not a single str"),
    (lambda c: c.detokenize([1, 2, 3]), TypeError, "ids[0] is one id: for one text, pass [ids]"),
    (lambda c: c.detokenize(np.array([1, 2, 3])), TypeError, "a 1-D array does not: for one text, pass [ids]"),
    (lambda c: c.detokenize("abc"), TypeError, "not a str"),
    (lambda c: c.tokenize(["x"], format="xml"), ValueError, "format must be one of 'binary', 'json', not 'xml'"),
    (lambda c: c.prefetch("I am a cat."), TypeError, "not a single str"),
    (lambda c: c.prefetch(["x"], pack=2048), TypeError, "pack takes a PackSpec(seq_len=..., rows=...), not int"),
]


@pytest.mark.parametrize(("call", "error", "message"), MISTAKES)
def test_a_call_that_means_something_else_is_refused_before_any_request(call, error, message):
    # A port nothing listens on: a refusal that needed the network would be a connection error instead.
    with TokenizerClient(f"http://127.0.0.1:{free_port()}", timeout=2) as client, pytest.raises(error) as caught:
        call(client)
    assert message in str(caught.value)


@pytest.mark.parametrize("call", [lambda c: c.tokenize("abc"), lambda c: c.pack("abc", 8), lambda c: c.detokenize([1])])
def test_the_async_client_refuses_the_same(call):
    async def main() -> None:
        async with AsyncTokenizerClient(f"http://127.0.0.1:{free_port()}", timeout=2) as client:
            with pytest.raises(TypeError, match="for one text"):
                await call(client)

    asyncio.run(main())


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (
            {"url": "localhost:8000"},
            "url 'localhost:8000' has no http:// or https:// in front: did you mean 'http://localhost:8000'?",
        ),
        ({"url": ["http://a:1", "b:2"]}, "url 'b:2' has no http://"),
        ({"url": "ftp://127.0.0.1:8000"}, "url 'ftp://127.0.0.1:8000' is not http:// or https://: the service speaks"),
        (
            {"url": "http://127.0.0.1:8000", "timeout": "5"},
            "timeout is in seconds, a number above 0 (or None, or an httpx.Timeout); got '5'",
        ),
        (
            {"url": "http://127.0.0.1:8000", "timeout": 0},
            "timeout is in seconds, a number above 0 (or None, or an httpx.Timeout); got 0",
        ),
    ],
)
def test_a_client_that_could_never_work_is_refused_when_made(arguments, message):
    with pytest.raises(ValueError) as caught:
        TokenizerClient(**arguments)
    assert message in str(caught.value)
    with pytest.raises(ValueError):
        AsyncTokenizerClient(**arguments)
