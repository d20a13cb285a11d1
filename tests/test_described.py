"""What a start reads from the gate's cache instead of loading the reference library (issue 33): a model's
description (its vocabulary size, its special tokens and their ids), and the digest of the check set's ids that
a route passed with. The reference library then loads only when something encodes or decodes with it, and a
route whose ids are not those of its digest is checked against it again, and refused where it differs.

Loads are counted as the server's tests count them (TOKENIZER_TEST_COUNT_LOADS): one line per load."""

from __future__ import annotations

import collections
import json
from pathlib import Path

import mistral_common
import pytest

from tests.conftest import EDGE_CASES, read_multilingual
from tokenizer_service.core import cache, checkset, libraries
from tokenizer_service.core.models import find_model_files

TEKKEN = Path(mistral_common.__file__).parent / "data" / "tekken_240911.json"
DESCRIBED = ("type", "vocab_size", "bos_id", "eos_id", "pad_id", "unk_id", "special", "normalizes")


def counted(directory: Path) -> collections.Counter[str]:
    """How many of each kind (load, reference, fast) this test's processes counted."""
    path = directory / "loads.txt"
    lines = path.read_text().splitlines() if path.exists() else []
    return collections.Counter(line.split(" ")[2] for line in lines)


@pytest.fixture
def counts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "counts"
    directory.mkdir()
    monkeypatch.setenv(libraries.CACHE_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv(libraries.COUNT_ENV, str(directory))
    return directory


def model_paths(library_models: dict[str, Path]) -> dict[str, Path]:
    return {"tokenizer.json": library_models["hfbpe"], "tiktoken": library_models["tt"], "tekken.json": TEKKEN}


@pytest.mark.parametrize("kind", ["tokenizer.json", "tiktoken", "tekken.json"])
def test_a_model_described_once_is_described_again_without_its_reference_library(library_models, counts, kind):
    files = find_model_files(kind, model_paths(library_models)[kind])
    first = libraries.load(files, libraries.REFERENCE)
    assert counted(counts)["reference"] == 1
    again = libraries.load(files, libraries.REFERENCE)
    assert counted(counts)["reference"] == 1  # described from the cache
    for name in DESCRIBED:
        assert getattr(again, name, None) == getattr(first, name, None), name
    texts = read_multilingual()[:20] + EDGE_CASES
    for parse_special in (False, True):  # the library loads when it encodes, with the same ids
        assert again.reference_rows(texts, parse_special) == first.reference_rows(texts, parse_special)
    assert counted(counts)["reference"] == 2


def test_a_description_holds_for_the_files_bytes_only(library_models, counts, tmp_path):
    source = library_models["hfbpe"] / "tokenizer.json"
    copy = tmp_path / "copy"
    copy.mkdir()
    for path in library_models["hfbpe"].iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    libraries.load(find_model_files("m", copy), libraries.REFERENCE)
    (copy / "tokenizer.json").write_text(json.dumps(json.loads(source.read_text()), indent=1))  # the same model
    libraries.load(find_model_files("m", copy), libraries.REFERENCE)
    assert counted(counts)["reference"] == 2  # other bytes: described again
    for path in (tmp_path / "cache" / "gate").glob("*.json"):  # a cache that is not one: as if none
        path.write_text('{"key": "not this", "description": {}}')
    libraries.load(find_model_files("m", copy), libraries.REFERENCE)
    assert counted(counts)["reference"] == 3
    key = libraries.description_key(find_model_files("m", copy))
    for broken in ({}, {"type": "bpe", "vocab_size": 7}, {"type": "bpe", "vocab_size": 7, "special": [], "ids": {}}):
        cache.write(key, {"key": key, "description": broken})  # its key, not all of it: described again
        described = libraries.load(find_model_files("m", copy), libraries.REFERENCE)
        assert described.vocab_size > 7 and described.eos_id >= 0
    assert counted(counts)["reference"] == 6


@pytest.fixture
def settled(library_models, counts, monkeypatch):
    """The tokenizer.json model's verdict, passed, scanned here on fewer code points (the scan is not under test)."""
    monkeypatch.setattr(checkset, "code_points", lambda: list(range(0x800)))
    files = find_model_files("hfbpe", library_models["hfbpe"])
    fast, differs, route = libraries.gate_verdict(libraries.load(files, libraries.REFERENCE))
    assert fast is not None and differs is None, differs
    verdict = libraries.cached_verdict(libraries.gate_key(files))
    assert verdict["encoder"] == route and len(verdict["checkset_ids"]) == 64
    return files, route


def test_a_cached_pass_checks_its_route_against_the_digest_without_the_reference_library(settled, counts):
    files, route = settled
    before = counted(counts)["reference"]
    library = libraries.load(files)  # described from the cache, the route built and checked against the digest
    assert library.encoder == route and counted(counts)["reference"] == before
    texts = read_multilingual()[:20] + EDGE_CASES
    ids, lengths = library.encode_plain(texts, False)
    rows = [row.tolist() for row in libraries.flatten_rows(ids, lengths)]
    assert rows == library.reference_rows(texts, False)  # the reference library, loaded now: the same ids
    assert counted(counts)["reference"] == before + 1


def test_a_route_whose_ids_are_not_its_digests_is_checked_against_the_reference_and_refused(
    settled, counts, monkeypatch
):
    files, _route = settled
    build = libraries._build_fast

    def planted(library, name="fastokens"):  # one wrong id in every check text holding "a"
        fast, why = build(library, name)
        return (libraries._Planted(fast, "a") if fast is not None else None), why

    monkeypatch.setattr(libraries, "_build_fast", planted)
    before = counted(counts)["reference"]
    library = libraries.load(files)
    assert library.fast is None and library.encoder == "tokenizers"
    assert counted(counts)["reference"] == before + 1  # loaded to say what differs


def test_a_verdict_kept_before_digests_gets_one_at_its_next_start(settled, counts):
    files, route = settled
    path = cache.cache_file(libraries.gate_key(files))
    verdict = json.loads(path.read_text())
    digest = verdict.pop("checkset_ids")
    path.write_text(json.dumps(verdict))
    before = counted(counts)["reference"]
    assert libraries.load(files).encoder == route
    assert counted(counts)["reference"] == before + 1  # checked against the reference library, as before digests
    assert json.loads(path.read_text())["checkset_ids"] == digest
    assert libraries.load(files).encoder == route
    assert counted(counts)["reference"] == before + 1
