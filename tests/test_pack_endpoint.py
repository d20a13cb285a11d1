"""/v1/pack against the real server: the same rows as packing sentencepiece's own ids, both formats."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.conftest import Server
from tests.packed_rows import assert_same_rows
from tokenizer_client import AsyncTokenizerClient, TokenizerClient, TokenizerServiceError
from tokenizer_client.packing import IGNORE_INDEX, pack_best_fit, pack_concat
from tokenizer_client.wire import ragged_offsets


@pytest.fixture(scope="module")
def client(server: Server):
    with TokenizerClient(server.url, timeout=60) as client:
        yield client


def reference_ids(server: Server, model: str, texts: list[str], add_bos=False, add_eos=True):
    encoded = server.processor(model).encode(texts, add_bos=add_bos, add_eos=add_eos)
    ids = np.array([i for row in encoded for i in row], dtype=np.int32)
    return ids, ragged_offsets(np.array([len(row) for row in encoded], dtype=np.int64))


@pytest.mark.parametrize("format", ["binary", "json"])
@pytest.mark.parametrize("model", ["uni", "bpe"])
@pytest.mark.parametrize("seq_len", [64, 2048])
def test_concat_matches_packing_sentencepiece_ids(client, server, documents, model, seq_len, format):
    texts = documents[:600]
    batch = client.pack(texts, seq_len, model=model, mask_document_start=True, format=format)
    ids, offsets = reference_ids(server, model, texts)
    eos = server.processor(model).eos_id()
    assert_same_rows(batch, pack_concat(ids, offsets, seq_len, eos_id=eos, mask_document_start=True))
    assert batch.input_ids.shape[1] == seq_len and batch.input_ids.dtype == np.int32
    assert np.concatenate([batch.input_ids.reshape(-1), batch.leftover]).tolist() == ids.tolist()


@pytest.mark.parametrize("format", ["binary", "json"])
@pytest.mark.parametrize("seq_len", [32, 512])
def test_best_fit_matches_packing_sentencepiece_ids(client, server, documents, seq_len, format):
    texts = documents[:600]
    batch = client.pack(texts, seq_len, strategy="best_fit", model="uni", add_bos=True, format=format)
    ids, offsets = reference_ids(server, "uni", texts, add_bos=True)
    sp = server.processor("uni")
    pad = sp.pad_id() if sp.pad_id() >= 0 else sp.eos_id()
    assert_same_rows(batch, pack_best_fit(ids, offsets, seq_len, pad_id=pad))
    assert batch.leftover.size == 0
    assert 0 <= batch.stats["padding_fraction"] < 1
    assert int((batch.labels == IGNORE_INDEX).sum()) == batch.stats["padding_tokens"]


def test_pack_stream_threads_the_carry(client, server, documents):
    texts = documents[:700]
    batches = list(client.pack_stream(iter(texts), 128, texts_per_request=50, model="bpe"))
    assert len(batches) == 14
    ids, _ = reference_ids(server, "bpe", texts)
    rows = np.concatenate([b.input_ids.reshape(-1) for b in batches] + [batches[-1].leftover])
    assert rows.tolist() == ids.tolist()
    assert all(len(b.leftover) < 128 for b in batches)


def test_carry_continues_a_document(client, server):
    sp = server.processor("uni")
    first = client.pack(["The first document is here and it goes on."], 8, model="uni")
    second = client.pack(["A second one."], 8, model="uni", carry=first.leftover, mask_document_start=True)
    stream = sp.encode(["The first document is here and it goes on.", "A second one."], add_eos=True)
    flat = [i for row in stream for i in row]
    got = np.concatenate([first.input_ids.reshape(-1), second.input_ids.reshape(-1), second.leftover]).tolist()
    assert got == flat
    if len(second):
        assert second.position_ids[0, 0] == 0  # a row start begins a segment


@pytest.mark.parametrize("format", ["binary", "json"])
@pytest.mark.parametrize("add_eos", [True, False])
def test_pack_stream_gives_the_rows_of_one_request(client, documents, format, add_eos):
    """Threading leftover and its document starts, many requests give what one request over all gives:
    segments, positions and masked labels included (without EOS nothing marks a start in the carry)."""
    texts = documents[:120]
    options = {"model": "uni", "add_bos": True, "add_eos": add_eos, "mask_document_start": True, "format": format}
    whole = client.pack(texts, 64, **options)
    batches = list(client.pack_stream(texts, 64, texts_per_request=7, **options))
    for name in ("input_ids", "labels", "position_ids"):
        np.testing.assert_array_equal(np.concatenate([getattr(b, name) for b in batches]), getattr(whole, name))
    assert [row.tolist() for b in batches for row in b.cu_seqlens] == [row.tolist() for row in whole.cu_seqlens]
    assert batches[-1].leftover.tolist() == whole.leftover.tolist()
    assert batches[-1].leftover_document_starts.tolist() == whole.leftover_document_starts.tolist()


def boundary_texts(server: Server, documents: list[str], add_eos: bool) -> tuple[list[str], int]:
    """Texts [a, b, a] and L = len(a): the first request's only row ends exactly where b begins, so its
    leftover is b whole, a document starting at the carry's first token (the case the review found)."""
    sp = server.processor("uni")
    lengths = [len(ids) + add_eos for ids in sp.encode(documents[:40])]
    a = max(range(40), key=lambda i: lengths[i])
    b = min((i for i in range(40) if lengths[i] > 1), key=lambda i: lengths[i])
    assert 1 < lengths[b] < lengths[a]
    return [documents[a], documents[b], documents[a]], lengths[a]


@pytest.mark.parametrize("format", ["binary", "json"])
@pytest.mark.parametrize("add_eos", [True, False])
def test_a_leftover_that_begins_a_document_keeps_its_start(client, server, documents, format, add_eos):
    texts, seq_len = boundary_texts(server, documents, add_eos)
    options = {"model": "uni", "add_eos": add_eos, "mask_document_start": True, "format": format}
    whole = client.pack(texts, seq_len, **options)
    first = client.pack(texts[:2], seq_len, **options)
    assert len(first) == 1 and first.leftover_document_starts.tolist() == [0]
    assert first.leftover_document_starts.dtype == np.int32
    second = client.pack(
        texts[2:], seq_len, carry=first.leftover, carry_document_starts=first.leftover_document_starts, **options
    )
    assert second.labels[0, 0] == IGNORE_INDEX and second.position_ids[0, 0] == 0
    for name in ("input_ids", "labels", "position_ids"):
        np.testing.assert_array_equal(getattr(second, name)[0], getattr(whole, name)[1], name)
    assert second.cu_seqlens[0].tolist() == whole.cu_seqlens[1].tolist()
    np.testing.assert_array_equal(second.leftover, whole.leftover)
    np.testing.assert_array_equal(second.leftover_document_starts, whole.leftover_document_starts)
    guessed = client.pack(texts[2:], seq_len, carry=first.leftover, **options)  # the fallback: a continuation
    assert guessed.labels[0, 0] == first.leftover[0]


def test_async_pack_stream_gives_the_rows_of_one_request(server, documents):
    texts, seq_len = boundary_texts(server, documents, True)
    texts = texts + documents[40:80]
    options = {"model": "uni", "mask_document_start": True}
    with TokenizerClient(server.url) as sync:
        whole = sync.pack(texts, seq_len, **options)

    async def main() -> list:
        async with AsyncTokenizerClient(server.url) as client:
            return [batch async for batch in client.pack_stream(iter(texts), seq_len, texts_per_request=2, **options)]

    batches = asyncio.run(main())
    assert len(batches) == len(range(0, len(texts), 2))
    for name in ("input_ids", "labels", "position_ids"):
        np.testing.assert_array_equal(np.concatenate([getattr(b, name) for b in batches]), getattr(whole, name))
    assert [row.tolist() for b in batches for row in b.cu_seqlens] == [row.tolist() for row in whole.cu_seqlens]
    np.testing.assert_array_equal(batches[-1].leftover, whole.leftover)
    np.testing.assert_array_equal(batches[-1].leftover_document_starts, whole.leftover_document_starts)


ERRORS = [
    ({"texts": ["a"], "seq_len": 1}, "seq_len", None),
    ({"texts": ["a"], "seq_len": 10**9}, "seq_len", None),
    ({"texts": ["a"], "seq_len": "64"}, "seq_len", None),
    ({"texts": ["a"], "seq_len": 64, "strategy": "greedy"}, "strategy", None),
    ({"texts": ["a"], "seq_len": 64, "carry": [1, 2, 10**7]}, "carry", 2),
    ({"texts": ["a"], "seq_len": 64, "carry": [-3]}, "carry", 0),
    ({"texts": ["a"], "seq_len": 64, "strategy": "best_fit", "carry": [5]}, "carry", None),
    ({"texts": ["a"], "seq_len": 64, "carry_document_starts": [0]}, "carry_document_starts", None),
    ({"texts": ["a"], "seq_len": 64, "carry": [5, 6], "carry_document_starts": [1, 1]}, "carry_document_starts", 1),
    ({"texts": ["a"], "seq_len": 64, "carry": [5, 6], "carry_document_starts": [2]}, "carry_document_starts", 0),
    ({"texts": ["a"], "seq_len": 64, "carry": [5, 6], "carry_document_starts": [-1]}, "carry_document_starts", 0),
    ({"texts": ["a"], "seq_len": 64, "carry": [5, 6], "carry_document_starts": [1, 0]}, "carry_document_starts", 1),
    ({"texts": ["a"], "seq_len": 64, "carry": [5], "carry_document_starts": ["0"]}, "carry_document_starts", 0),
    (
        {"texts": ["a"], "seq_len": 64, "strategy": "best_fit", "carry": [5], "carry_document_starts": [0]},
        "carry_document_starts",
        None,
    ),
    (
        {"texts": ["a"], "seq_len": 64, "strategy": "best_fit", "carry_document_starts": []},
        "carry_document_starts",
        None,
    ),
    ({"texts": ["a", 5], "seq_len": 64}, "texts", 1),
    # texts have no loss mask: a carry_loss_mask was ignored, and a carried id it masked kept its label
    ({"texts": ["a"], "seq_len": 8, "carry": [5, 6, 7], "carry_loss_mask": [1, 0, 1]}, "carry_loss_mask", None),
    ({"texts": ["a"], "seq_len": 8, "carry_loss_mask": [1]}, "carry_loss_mask", None),
]


@pytest.mark.parametrize(("body", "field", "index"), ERRORS)
def test_pack_errors_name_the_field(server, body, field, index):
    response = httpx.post(f"{server.url}/v1/pack", json={"model": "uni", **body})
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_field" and error["field"] == field and error.get("index") == index
    assert httpx.post(f"{server.url}/v1/pack", json={"texts": ["ok"], "seq_len": 4, "model": "uni"}).status_code == 200


def test_pack_error_through_client(client):
    with pytest.raises(TokenizerServiceError) as caught:
        client.pack(["a"], 64, strategy="best_fit", carry=[1])
    assert caught.value.status == 422 and caught.value.field == "carry"


def _documented_answers() -> list[dict]:
    """The JSON answers docs/api.md shows (each ```json block after a line that mentions an answer)."""
    text = (Path(__file__).parent.parent / "docs" / "api.md").read_text()
    answers = []
    pattern = r"JSON answer[^\n]*\n(?:[^\n]*\n)*?\n(?:<!-- excerpt[^\n]*-->\n)?```json\n(.*?)```"
    for block in re.findall(pattern, text, flags=re.S):
        answers.append(json.loads(block.replace("[...]", "[]")))
    return answers


def test_the_documented_json_answers_have_every_field_the_server_sends(server: Server):
    tokenize, pack = _documented_answers()
    real = httpx.post(f"{server.url}/v1/tokenize", json={"texts": ["I am a cat."]}).json()
    assert set(tokenize) == set(real)
    real = httpx.post(f"{server.url}/v1/pack", json={"texts": ["I am a cat."], "seq_len": 4}).json()
    assert set(pack) == set(real)
    assert set(pack["stats"]) == set(real["stats"])
