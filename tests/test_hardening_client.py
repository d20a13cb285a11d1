"""The client from outside: malformed 200s from a stdlib fake server, numpy and float arguments, bytes
texts, the cost of `import client`, and packed streams too short for one batch.

The fake server (http.server on loopback) answers whatever a test tells it to, or tokenizes each text
into its UTF-8 bytes, so the whole client (retries, prefetch, packing) runs without a real server.
"""

from __future__ import annotations

import asyncio
import http.server
import json
import re
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import orjson
import pytest

from tests.bodies import sent_body
from tokenizer_client import (
    AsyncTokenizerClient,
    MalformedAnswerError,
    PackSpec,
    TokenizerClient,
    TokenizerError,
    TokenizerProtocolError,
    wire,
)

Canned = tuple[int, str, bytes]  # status, content type, body


def byte_tokenizer(path: str, body: dict[str, Any], accept: str) -> Canned:
    """A well-behaved server: each text's ids are its UTF-8 bytes."""
    if path == "/v1/detokenize":
        texts = [bytes(row).decode("utf-8", "replace") for row in body["ids"]]
        return 200, "application/json", orjson.dumps({"model": "bytes", "texts": texts})
    rows = [list(text.encode()) for text in body["texts"]]
    lengths = np.array([len(row) for row in rows], dtype=np.int64)
    ids = np.array([i for row in rows for i in row], dtype=np.int32)
    if wire.MEDIA_TYPE in accept:
        frame = wire.encode({"ids": ids, "offsets": wire.ragged_offsets(lengths)}, {"model": "bytes"})
        return 200, wire.MEDIA_TYPE, frame
    return 200, "application/json", orjson.dumps({"model": "bytes", "ids": rows, "num_tokens": int(ids.size)})


class FakeServer:
    """A stdlib HTTP server on 127.0.0.1 answering with `self.reply`; it keeps the last request body."""

    def __init__(self) -> None:
        self.reply: Callable[[str, dict[str, Any], str], Canned] = byte_tokenizer
        self.last_body: dict[str, Any] | None = None
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                body = sent_body(self.rfile.read(int(self.headers["content-length"])))
                fake.last_body = body
                status, content_type, content = fake.reply(self.path, body, self.headers.get("accept", ""))
                self.send_response(status)
                self.send_header("content-type", content_type)
                self.send_header("content-length", str(len(content)))
                self.end_headers()
                self.wfile.write(content)

            def do_GET(self) -> None:
                status, content_type, content = fake.reply(self.path, {}, self.headers.get("accept", ""))
                self.send_response(status)
                self.send_header("content-type", content_type)
                self.send_header("content-length", str(len(content)))
                self.end_headers()
                self.wfile.write(content)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        # shutdown() waits for serve_forever to look at its flag: every 10 ms, not the default 0.5 s
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.01,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fake() -> Iterator[FakeServer]:
    server = FakeServer()
    yield server
    server.close()


@pytest.fixture
def client(fake: FakeServer) -> Iterator[TokenizerClient]:
    with TokenizerClient(fake.url) as tokenizer:
        yield tokenizer


def answer_with(fake: FakeServer, content: bytes, content_type: str = "application/json") -> None:
    fake.reply = lambda path, body, accept: (200, content_type, content)


def frame(meta: dict[str, Any] | None = None, **arrays: Any) -> bytes:
    return wire.encode({name: np.asarray(value) for name, value in arrays.items()}, {"model": "m", **(meta or {})})


def frame_with_shape(shape: object) -> bytes:
    """A frame whose header declares `shape` for its ids (written by hand: encode would not)."""
    header = json.dumps(
        {"meta": {"model": "m"}, "arrays": [{"name": "ids", "dtype": "<i4", "shape": shape, "offset": 0}]}
    )
    head = wire._PREFIX.pack(wire.MAGIC, wire.VERSION, 0, len(header)) + header.encode()
    return head + b"\0" * (-len(head) % 8) + b"\0" * 8


# -- defect 8: malformed 200s are raised, never returned ---------------------------------------------------

JSON_TOKENIZE = {
    "fewer texts": {"model": "m", "ids": [[1, 2]]},
    "float id 1.7": {"model": "m", "ids": [[1.7], [2]]},
    "float id 1.0": {"model": "m", "ids": [[1.0], [2]]},
    "negative id": {"model": "m", "ids": [[-5], [2]]},
    "boolean id": {"model": "m", "ids": [[True], [2]]},
    "id beyond int32": {"model": "m", "ids": [[3000000000], [2]]},
    "id beyond int64": {"model": "m", "ids": [[2**70], [2]]},
    "flat ids": {"model": "m", "ids": [1, 2]},
    "string row": {"model": "m", "ids": ["ab", [2]]},
}


@pytest.mark.parametrize("document", list(JSON_TOKENIZE.values()), ids=list(JSON_TOKENIZE))
def test_a_malformed_json_tokenize_answer_is_raised(fake, client, document):
    answer_with(fake, json.dumps(document).encode())
    with pytest.raises(TokenizerProtocolError) as raised:
        client.tokenize(["one", "two"], format="json")
    assert isinstance(raised.value, TokenizerError)


BINARY_TOKENIZE = {
    "offsets past the end": frame(ids=np.array([1, 2], np.int32), offsets=np.array([0, 1, 5], np.int64)),
    "decreasing offsets": frame(ids=np.array([1, 2], np.int32), offsets=np.array([0, 3, 2], np.int64)),
    "fewer texts": frame(ids=np.array([1, 2], np.int32), offsets=np.array([0, 2], np.int64)),
    "float ids": frame(ids=np.array([1.5, 2.0]), offsets=np.array([0, 1, 2], np.int64)),
    "ids of 2**40": frame(ids=np.array([2**40, 1], np.int64), offsets=np.array([0, 1, 2], np.int64)),
    "negative ids": frame(ids=np.array([-1, 1], np.int32), offsets=np.array([0, 1, 2], np.int64)),
    "float offsets": frame(ids=np.array([1, 2], np.int32), offsets=np.array([0.0, 1.0, 2.0])),
    "shape 1e30": frame_with_shape([1e30]),
    "shape true": frame_with_shape([True]),
}


@pytest.mark.parametrize("content", list(BINARY_TOKENIZE.values()), ids=list(BINARY_TOKENIZE))
def test_a_malformed_binary_tokenize_answer_is_raised(fake, client, content):
    answer_with(fake, content, wire.MEDIA_TYPE)
    with pytest.raises(TokenizerProtocolError):
        client.tokenize(["one", "two"])


def test_the_error_says_what_was_wrong(fake, client):
    answer_with(fake, frame(ids=np.array([1, 2], np.int32), offsets=np.array([0, 2], np.int64)), wire.MEDIA_TYPE)
    with pytest.raises(MalformedAnswerError, match="1 sequences, 2 were asked for"):
        client.tokenize(["one", "two"])
    answer_with(fake, json.dumps({"model": "m", "ids": [[1.7], [2]]}).encode())
    with pytest.raises(MalformedAnswerError, match="float"):
        client.tokenize(["one", "two"], format="json")


def packed_json(**changes: Any) -> bytes:
    document = {
        "model": "bytes",
        "seq_len": 4,
        "strategy": "concat",
        "input_ids": [[1, 2, 3, 4]],
        "labels": [[2, 3, 4, -100]],
        "position_ids": [[0, 1, 2, 3]],
        "cu_seqlens": [[0, 4]],
        "leftover": [5],
        "leftover_document_starts": [],
        "stats": {"rows": 1},
    }
    document.update(changes)
    return json.dumps(document).encode()


PACK = {
    "seq_len not asked for": packed_json(seq_len=2, input_ids=[[1, 2]], labels=[[2, -100]], position_ids=[[0, 1]]),
    "short row": packed_json(input_ids=[[1, 2, 3]]),
    "float id": packed_json(input_ids=[[1, 2, 3, 4.5]]),
    "negative label": packed_json(labels=[[2, 3, -7, -100]]),
    "position past the row": packed_json(position_ids=[[0, 1, 2, 9]]),
    "cu_seqlens decrease": packed_json(cu_seqlens=[[0, 3, 2]]),
    "cu_seqlens past the row": packed_json(cu_seqlens=[[0, 5]]),
    "cu_seqlens for two rows": packed_json(cu_seqlens=[[0, 4], [0, 4]]),
    "negative leftover": packed_json(leftover=[-1]),
    "leftover start outside": packed_json(leftover_document_starts=[3]),
}


@pytest.mark.parametrize("content", list(PACK.values()), ids=list(PACK))
def test_a_malformed_pack_answer_is_raised(fake, client, content):
    answer_with(fake, packed_json())
    assert len(client.pack(["a"], 4, format="json")) == 1  # the well-formed answer reads
    answer_with(fake, content)
    with pytest.raises(MalformedAnswerError):
        client.pack(["a"], 4, format="json")


def test_a_detokenize_answer_with_fewer_texts_is_raised(fake, client):
    answer_with(fake, json.dumps({"model": "m", "texts": ["only one"]}).encode())
    with pytest.raises(MalformedAnswerError, match="1 texts answered, 2 id rows"):
        client.detokenize([[1], [2]])


@pytest.mark.parametrize(
    ("content", "content_type"),
    [
        (b"<html>sign in</html>", "text/html"),  # another web app behind a replica's URL (Grafana answers 200)
        (b"[1, 2, 3]", "application/json"),
        (b'{"models": 5}', "application/json"),
        (b'{"models": [{"sha256": "ab"}]}', "application/json"),
        (b'{"models": [], "default": 3}', "application/json"),
    ],
)
def test_a_models_answer_that_is_not_the_services_is_a_protocol_error(fake, client, content, content_type):
    """models() and check_replicas(), sync and async, raised orjson's, AttributeError or TypeError: now the client's
    own error, naming the replica."""
    answer_with(fake, content, content_type)
    for call in (client.models, client.check_replicas):
        with pytest.raises(TokenizerProtocolError, match=re.escape(fake.url)):
            call()

    async def asynchronous() -> None:
        async with AsyncTokenizerClient(fake.url) as remote:
            for call in (remote.models, remote.check_replicas):
                with pytest.raises(TokenizerProtocolError, match=re.escape(fake.url)):
                    await call()

    asyncio.run(asynchronous())


def test_well_formed_answers_still_read(client):
    assert [row.tolist() for row in client.tokenize(["ab", "", "é"])] == [[97, 98], [], [195, 169]]
    assert [row.tolist() for row in client.tokenize(["ab", "c"], format="json")] == [[97, 98], [99]]
    assert client.detokenize([[104, 105]]) == ["hi"]


# -- defect 7: numpy scalars are their Python values; floats are refused at the call ------------------------


def test_numpy_scalars_are_sent_as_python_values(fake, client):
    client.tokenize(["a"], max_length=np.int64(3), add_bos=np.True_, add_eos=np.bool_(False))
    assert fake.last_body == {"texts": ["a"], "max_length": 3, "add_bos": True}
    client.tokenize(["a"], sample={"alpha": np.float64(0.5), "seed": np.int64(7)})
    assert fake.last_body["sample"] == {"alpha": 0.5, "seed": 7}
    client.detokenize([[np.int64(104), np.int32(105)], np.array([33], np.int64)])
    assert fake.last_body["ids"] == [[104, 105], [33]]
    answer_with(fake, packed_json())
    client.pack(["a"], np.int64(4), carry=[np.int64(5)], carry_document_starts=np.array([0]), format="json")
    assert fake.last_body["seq_len"] == 4 and fake.last_body["carry"] == [5]
    assert fake.last_body["carry_document_starts"] == [0]


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda c: c.tokenize(["a"], max_length=3.0), "max_length"),
        (lambda c: c.pack(["a"], 64.0), "seq_len"),
        (lambda c: c.detokenize([[1.7]]), r"ids\[0\]\[0\]"),
        (lambda c: c.pack(["a"], 8, carry=[1.0]), r"carry\[0\]"),
        (lambda c: PackSpec(seq_len=64.0, rows=2), "seq_len"),
        (lambda c: PackSpec(seq_len=64, rows=2.5), "rows"),
        (lambda c: c.prefetch(["a"], batch_size=8.0), "batch_size"),
        (lambda c: c.prefetch(["a"], depth=np.float64(2)), "depth"),
    ],
    ids=["max_length", "seq_len", "detokenize-id", "carry", "PackSpec.seq_len", "PackSpec.rows", "batch_size", "depth"],
)
def test_a_float_argument_is_a_value_error_naming_it(client, call, name):
    with pytest.raises(ValueError, match=name):
        call(client)


def test_a_non_bool_flag_is_a_type_error_naming_it(client):
    with pytest.raises(TypeError, match="add_eos"):
        client.tokenize(["a"], add_eos="yes")


def test_numpy_pack_spec_gives_a_plain_json_state(client):
    spec = PackSpec(seq_len=np.int64(4), rows=np.int32(2), add_eos=np.False_)
    with client.prefetch(["abcdefghij", "klmnopqrstu"], batch_size=np.int64(1), pack=spec) as prefetcher:
        batch = next(prefetcher)
        state = prefetcher.state_dict()
    assert batch.input_ids.shape == (2, 4)
    assert json.loads(json.dumps(state)) == state  # plain JSON, no numpy inside
    assert state["options"]["seq_len"] == 4 and type(state["options"]["seq_len"]) is int


def test_a_resume_beyond_the_end_of_the_stream_is_an_error(client):
    spec = PackSpec(seq_len=4, rows=2, add_eos=False)
    with client.prefetch(["a" * 40], pack=spec) as prefetcher:
        next(prefetcher)
        state = prefetcher.state_dict()
    assert state["text"] == 0 and state["skip"] == 8  # stopped inside the first text
    with pytest.raises(ValueError, match="inside text 0"), client.prefetch([], pack=spec, state=state) as resumed:
        next(resumed)
    with client.prefetch(["a" * 40], pack=spec, state=state) as resumed:  # the same texts resume fine
        assert sum(len(batch) for batch in resumed) == 8


# -- issue 23 item 3: a bytes text says to decode it ------------------------------------------------------


@pytest.mark.parametrize("method", ["tokenize", "tokenize_batch", "pack"])
def test_a_bytes_text_is_a_type_error_naming_its_index(client, method):
    call = getattr(client, method)
    arguments = (["fine", b"raw bytes"],) if method != "pack" else (["fine", b"raw bytes"], 8)
    with pytest.raises(TypeError, match=r"texts\[1\] is bytes, not str: decode it"):
        call(*arguments)


# -- issue 23 item 7: importing the client costs numpy only ---------------------------------------------


def test_importing_client_and_its_dataset_loads_neither_httpx_nor_torch():
    code = (
        "import sys, tokenizer_client, tokenizer_client.dataset\n"
        "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'httpx', 'httpcore', 'orjson', 'torch', 'anyio'})\n"
        "assert not heavy, heavy\n"
        "from tokenizer_client import TokenDataset\n"
        "assert 'httpx' not in sys.modules\n"
        "from tokenizer_client import TokenizerClient\n"
        "assert 'httpx' in sys.modules and tokenizer_client.TokenizerClient is TokenizerClient\n"
        "assert set(tokenizer_client.__all__) <= set(dir(tokenizer_client))\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# -- issue 23 item 11: a packed stream shorter than one batch ---------------------------------------------


def test_a_packed_stream_shorter_than_one_batch_yields_its_partial_batch(client):
    spec = PackSpec(seq_len=4, rows=8, add_eos=False)
    with client.prefetch(["abcdefghij"], pack=spec) as prefetcher:  # 10 tokens: 2 rows of 4, 2 left over
        batches = list(prefetcher)
        leftover = prefetcher.leftover
    assert [len(batch) for batch in batches] == [2]
    assert leftover.tolist() == [105, 106]


def test_drop_last_drops_the_partial_batch_and_says_so(client):
    spec = PackSpec(seq_len=4, rows=8, add_eos=False, drop_last=True)
    with (
        pytest.warns(UserWarning, match="drop_last=True dropped them"),
        client.prefetch(["abcdefghij"], pack=spec) as p,
    ):
        assert list(p) == []
    full = PackSpec(seq_len=4, rows=2, add_eos=False, drop_last=True)
    with client.prefetch(["abcdefghij"], pack=full) as prefetcher:  # 2 full rows: one whole batch, kept
        assert [len(batch) for batch in prefetcher] == [2]


@pytest.mark.parametrize(
    ("texts", "reason"),
    [(["abc"], "3 tokens fill no row of seq_len=4"), ([], "no texts")],
    ids=["fewer-tokens-than-a-row", "no-texts"],
)
def test_a_packed_stream_that_gives_no_batch_says_why(client, texts, reason):
    with pytest.warns(UserWarning, match=reason), client.prefetch(texts, pack=PackSpec(4, 8, add_eos=False)) as p:
        assert list(p) == []


def test_the_async_prefetcher_says_why_too(fake):
    from tokenizer_client import AsyncTokenizerClient

    async def run() -> list[Any]:
        async with AsyncTokenizerClient(fake.url) as client:
            return [batch async for batch in client.prefetch(["ab"], pack=PackSpec(4, 8, add_eos=False))]

    with pytest.warns(UserWarning, match="fill no row"):
        assert asyncio.run(run()) == []
