"""/v1/tokenize and /v1/detokenize against in-process sentencepiece, on real text, through the client."""

from __future__ import annotations

import itertools

import httpx
import numpy as np
import pytest
import sentencepiece as spm
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import EDGE_CASES, Server
from tokenizer_client import TokenizerClient
from tokenizer_client.wire import MEDIA_TYPE, decode

MODELS = ["uni", "bpe", "default"]
OPTIONS = [
    {},
    {"add_bos": True},
    {"add_eos": True},
    {"add_bos": True, "add_eos": True},
    {"max_length": 16},
    {"add_bos": True, "add_eos": True, "max_length": 16},
    {"add_eos": True, "max_length": 1},
    {"max_length": 0},
]


def reference(sp: spm.SentencePieceProcessor, texts: list[str], add_bos=False, add_eos=False, max_length=None):
    """What a training script gets in-process, truncated as the API documents it."""
    result = []
    for ids in sp.encode(texts, add_bos=add_bos, add_eos=add_eos):
        if max_length is not None and len(ids) > max_length:
            ids = [*ids[: max_length - 1], sp.eos_id()] if add_eos and max_length > 0 else ids[:max_length]
        result.append(ids)
    return result


@pytest.fixture(scope="module")
def client(server: Server):
    with TokenizerClient(server.url, timeout=60) as client:
        yield client


@pytest.mark.parametrize("format", ["binary", "json"])
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "plain")
@pytest.mark.parametrize("model", MODELS)
def test_ids_match_sentencepiece(client, server, documents, model, options, format):
    texts = documents + EDGE_CASES
    assert len(documents) >= 1000
    got = client.tokenize(texts, model=model, format=format, **options)
    expected = reference(server.processor(model), texts, **options)
    assert len(got) == len(texts)
    for index, (ids, want) in enumerate(zip(got, expected, strict=False)):
        assert ids.dtype == np.int32
        assert ids.tolist() == want, f"text {index}: {texts[index][:80]!r}"


def test_default_model_is_used_without_a_name(client, server, documents):
    batch = client.tokenize_batch(documents[:50])
    assert batch.model == "default"
    assert [row.tolist() for row in batch.to_list()] == server.processor("default").encode(documents[:50])


def test_json_answer_shape(server, documents):
    texts = documents[:3]
    response = httpx.post(f"{server.url}/v1/tokenize", json={"texts": texts, "model": "uni", "add_eos": True})
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    expected = server.processor("uni").encode(texts, add_eos=True)
    assert body == {
        "model": "uni",
        "ids": expected,
        "lengths": [len(ids) for ids in expected],
        "num_tokens": sum(len(ids) for ids in expected),
    }


def test_binary_answer_decodes_without_copy(server, documents):
    response = httpx.post(
        f"{server.url}/v1/tokenize", json={"texts": documents[:10], "model": "bpe"}, headers={"accept": MEDIA_TYPE}
    )
    assert response.headers["content-type"] == MEDIA_TYPE
    frame = decode(response.content)
    ids, offsets = frame["ids"], frame["offsets"]
    assert ids.dtype == np.dtype("<i4") and offsets.dtype == np.dtype("<i8")
    assert not ids.flags.owndata and not ids.flags.writeable  # a view into the response bytes
    assert frame.meta == {"model": "bpe", "num_tokens": int(offsets[-1])}
    expected = server.processor("bpe").encode(documents[:10])
    assert [ids[a:b].tolist() for a, b in itertools.pairwise(offsets)] == expected


def test_every_answer_carries_the_model_fingerprint(server, model_files):
    import hashlib

    for model in MODELS:
        sha256 = hashlib.sha256(model_files[model].read_bytes()).hexdigest()
        tokenized = httpx.post(f"{server.url}/v1/tokenize", json={"texts": ["a"], "model": model})
        detokenized = httpx.post(f"{server.url}/v1/detokenize", json={"ids": [[5]], "model": model})
        assert tokenized.headers["x-tokenizer-model-sha256"] == sha256
        assert detokenized.headers["x-tokenizer-model-sha256"] == sha256


def test_empty_request(client):
    batch = client.tokenize_batch([])
    assert len(batch) == 0 and batch.num_tokens == 0 and batch.offsets.tolist() == [0]
    assert client.detokenize([]) == []


SAMPLE = {"alpha": 0.5, "nbest_size": -1}


@pytest.mark.parametrize("model", ["uni", "bpe"])
def test_seeded_sampling_is_reproducible(client, server, documents, model):
    texts = documents[:400]
    first = client.tokenize(texts, model=model, sample={**SAMPLE, "seed": 1234})
    again = client.tokenize(texts, model=model, sample={**SAMPLE, "seed": 1234}, format="json")
    other = client.tokenize(texts, model=model, sample={**SAMPLE, "seed": 99})
    assert [a.tolist() for a in first] == [a.tolist() for a in again]
    assert [a.tolist() for a in first] != [a.tolist() for a in other]
    # Text i of a request is sampled with seed + i, whatever else the request holds.
    alone = [
        client.tokenize([text], model=model, sample={**SAMPLE, "seed": 1234 + i})[0]
        for i, text in enumerate(texts[:40])
    ]
    assert [a.tolist() for a in alone] == [a.tolist() for a in first[:40]]
    # Sampling changes the segmentation, never the text, and does segment differently.
    sp = server.processor(model)
    assert [sp.decode(ids.tolist()) for ids in first] == [sp.decode(sp.encode(text)) for text in texts]
    assert [a.tolist() for a in first] != sp.encode(texts)


def test_unseeded_sampling_varies(client, documents):
    texts = documents[:200]
    runs = {tuple(tuple(ids.tolist()) for ids in client.tokenize(texts, model="uni", sample=SAMPLE)) for _ in range(3)}
    assert len(runs) == 3


def test_sampling_with_options(client, server, documents):
    ids = client.tokenize(
        documents[:50], model="uni", add_bos=True, add_eos=True, max_length=8, sample={**SAMPLE, "seed": 5}
    )
    sp = server.processor("uni")
    for row in ids:
        assert row[0] == sp.bos_id() and row[-1] == sp.eos_id() and len(row) <= 8


@pytest.mark.parametrize("model", MODELS)
def test_detokenize_matches_sentencepiece(client, server, documents, model):
    sp = server.processor(model)
    texts = documents[:500] + EDGE_CASES
    ids = sp.encode(texts, add_bos=True, add_eos=True)
    assert client.detokenize(ids, model=model) == sp.decode(ids)
    assert client.detokenize([np.asarray(row, dtype=np.int32) for row in ids], model=model) == sp.decode(ids)


def test_models_lists_each_model(client, server, model_files):
    import hashlib

    listing = client.models()
    assert listing["default"] == "default"
    by_name = {model["name"]: model for model in listing["models"]}
    assert set(by_name) == set(MODELS)
    for name, entry in by_name.items():
        sp = server.processor(name)
        assert entry == {
            "name": name,
            "library": "sentencepiece",
            "encoder": "sentencepiece",
            "type": {"uni": "unigram", "bpe": "bpe", "default": "unigram"}[name],
            "vocab_size": sp.vocab_size(),
            "bos_id": sp.bos_id(),
            "eos_id": sp.eos_id(),
            "pad_id": sp.pad_id(),
            "unk_id": sp.unk_id(),
            "sha256": hashlib.sha256(model_files[name].read_bytes()).hexdigest(),
            "chat_template": None,
            "user_defined_pieces": [],
        }


def test_health_and_readiness(server):
    assert httpx.get(f"{server.url}/healthz").json() == {"status": "ok"}
    ready = httpx.get(f"{server.url}/readyz")
    assert ready.status_code == 200 and ready.json()["status"] == "ready"


@pytest.mark.slow  # 150 generated requests; .ci/run's slow stage
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(texts=st.lists(st.text(max_size=200), min_size=1, max_size=8))
def test_round_trip_matches_sentencepiece(client, server, texts):
    for model in ("uni", "bpe"):
        sp = server.processor(model)
        ids = client.tokenize(texts, model=model)
        assert [row.tolist() for row in ids] == sp.encode(texts)
        assert client.detokenize(ids, model=model) == sp.decode(sp.encode(texts))
