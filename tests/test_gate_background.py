"""The fast encoder's gate beside the work: a model with no cached verdict is served (and pre-tokenized) by
its reference library at once, scanned by one low-priority process meanwhile, and promoted to fastokens in
every worker when the scan passes; and each process loads a model once (issue 33).

The scan is held back (TOKENIZER_TEST_GATE_HOLD, the test-only hook in tokenizer_service.core.gatescan)
until the test has seen the reference library serve: the order is observed, never slept for.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.conftest import read_multilingual, start_server, stop_server
from tests.test_libraries import Reference
from tokenizer_service.core import gatescan, libraries
from tokenizer_service.tools.pretokenize import verifier as verifiers

pytestmark = pytest.mark.slow  # a cold scan of a real model each (tens of CPU-seconds on 2 cores)

SCAN_SECONDS = 600.0  # how long a held scan may take once released, at most, on a busy machine


def encoder_of(url: str, name: str) -> str:
    models = httpx.get(f"{url}/v1/models", timeout=10).json()["models"]
    return next(model["encoder"] for model in models if model["name"] == name)


def wait_for_encoder(url: str, name: str, encoder: str) -> None:
    deadline = time.monotonic() + SCAN_SECONDS

    def there(found: str) -> bool:  # "fast": whichever fast encoder the rule chose (tokenizer_service.core.encoders)
        return libraries.is_fast(found) if encoder == "fast" else found == encoder

    while not there(encoder_of(url, name)):
        assert time.monotonic() < deadline, f"{name} not promoted to {encoder} in {SCAN_SECONDS}s"
        time.sleep(0.2)


def loads(directory: Path, reference: bool = False) -> dict[tuple[int, str], collections.Counter[str]]:
    """(pid, process name) -> how many model loads and fast-encoder builds it made (and with `reference`, how many
    times it loaded the reference library: to describe a model no process described before, for a check, a shadow
    verification, or to encode)."""
    counts: dict[tuple[int, str], collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for line in (directory / "loads.txt").read_text().splitlines():
        pid, name, kind, _file = line.split(" ", 3)
        if kind != "reference" or reference:
            counts[int(pid), name][kind] += 1
    return counts


@pytest.fixture(scope="module")
def held_server(library_models, tmp_path_factory) -> Iterator[tuple[str, object, Path, Path]]:
    """A server of the tokenizer.json model with an empty gate cache, its scan held until `hold` exists."""
    base = tmp_path_factory.mktemp("gate-background")
    hold, counts = base / "release", base / "counts"
    counts.mkdir()
    env = {
        libraries.CACHE_DIR_ENV: str(base / "cache"),
        gatescan.HOLD_ENV: str(hold),
        libraries.COUNT_ENV: str(counts),
    }
    args = ["--workers", "2", "--model", f"hfbpe={library_models['hfbpe']}", "--shadow-rate", "1"]
    url, process = start_server(args, base / "server.log", env=env)
    yield url, process, hold, counts
    stop_server(process)


def test_the_server_is_ready_before_the_scan_and_promotes_when_it_passes(held_server, library_models, documents):
    url, _process, hold, _ = held_server
    assert not hold.exists()  # ready (start_server waited for /readyz) while the scan cannot have reported
    assert encoder_of(url, "hfbpe") == "tokenizers"
    assert 'encoder="tokenizers"' in httpx.get(f"{url}/metrics", timeout=10).text
    reference = Reference(library_models["hfbpe"])
    texts = documents[:200] + read_multilingual()
    for _ in range(2):  # both workers
        ids = httpx.post(f"{url}/v1/tokenize", json={"texts": texts}, timeout=60).json()["ids"]
        assert ids == [reference.encode(text) for text in texts]
    hold.touch()
    wait_for_encoder(url, "hfbpe", "fast")
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    assert f'encoder="{encoder_of(url, "hfbpe")}"' in metrics and 'encoder="tokenizers"' not in metrics
    for _ in range(4):  # every worker promoted: fast ids, checked by shadow verification at rate 1
        ids = httpx.post(f"{url}/v1/tokenize", json={"texts": texts}, timeout=60).json()["ids"]
        assert ids == [reference.encode(text) for text in texts]
    kept = [json.loads(path.read_text()) for path in (hold.parent / "cache" / "gate").glob("*.json")]
    (verdict,) = [found for found in kept if "passed" in found]  # and the model's description
    assert verdict["passed"] and "files_sha256" in verdict["key"] and len(verdict["checkset_ids"]) == 64


def test_each_process_loads_the_model_once(held_server):
    """The server process describes the model with its library (one load, no fast encoder); the zygote loads it
    once for every worker, which forks from it; each worker builds the fast encoder once, when promoted; the scan
    process loads it once."""
    url, process, hold, counts = held_server
    hold.touch()
    wait_for_encoder(url, "hfbpe", "fast")
    httpx.post(f"{url}/v1/tokenize", json={"texts": ["once more"] * 64}, timeout=60).raise_for_status()
    found = loads(counts)
    server = {key: count for key, count in found.items() if key[0] == process.pid}
    workers = {key: count for key, count in found.items() if key[1].startswith("tokenizer-tokenizer-")}
    scans = {key: count for key, count in found.items() if key[1] == "tokenizer-gate-scan"}
    zygotes = {key: count for key, count in found.items() if key[1] == "MainProcess" and key[0] != process.pid}
    # each candidate that passed is measured in a fresh process of its own (no model load counted, one build)
    measures = {key: count for key, count in found.items() if key[1] == "tokenizer-gate-measure"}
    assert all(count == collections.Counter(fast=1) for count in measures.values()), found
    # those that passed (more than one) are then raced side by side in one more process: each built once there
    races = {key: count for key, count in found.items() if key[1] == "tokenizer-gate-race"}
    assert all(count == collections.Counter(fast=len(measures)) for count in races.values()), found
    assert len(races) == (1 if len(measures) > 1 else 0), found
    assert list(server.values()) == [collections.Counter(load=1)], found
    assert len(workers) == 2, found
    assert list(zygotes.values()) == [collections.Counter(load=1)], found
    assert all(count == collections.Counter(fast=1) for count in workers.values()), found
    assert [count["load"] for count in scans.values()] == [1], found
    assert set(found) == set(server) | set(zygotes) | set(workers) | set(scans) | set(measures) | set(races), found


def test_a_cached_pass_is_fast_from_the_first_request(library_models, tmp_path, monkeypatch):
    """With the verdict settled ahead (in the foreground), a new server announces fastokens at once and
    starts no scan."""
    cache = tmp_path / "cache"
    env = {libraries.CACHE_DIR_ENV: str(cache)}
    monkeypatch.setenv(libraries.CACHE_DIR_ENV, str(cache))
    assert gatescan.main([str(library_models["tt"])]) == 0
    log = tmp_path / "server.log"
    url, process = start_server(["--workers", "1", "--model", f"tt={library_models['tt']}"], log, env=env)
    try:
        assert libraries.is_fast(encoder_of(url, "tt"))
        reference = Reference(library_models["tt"])
        ids = httpx.post(f"{url}/v1/tokenize", json={"texts": ["a snow\u2603man"]}, timeout=30).json()["ids"]
        assert ids == [reference.encode("a snow\u2603man")]
    finally:
        stop_server(process)
    assert "in the background" not in log.read_text()


def test_the_pretokenizer_switches_to_the_fast_encoder_between_chunks_with_exact_ids(
    library_models, tmp_path, monkeypatch, documents
):
    from tokenizer_client.dataset import TokenDataset
    from tokenizer_service.tools.pretokenize.run import Options, run

    hold, counts = tmp_path / "release", tmp_path / "counts"
    counts.mkdir()
    monkeypatch.setenv(libraries.CACHE_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv(gatescan.HOLD_ENV, str(hold))
    monkeypatch.setenv(libraries.COUNT_ENV, str(counts))
    monkeypatch.setenv("TOKENIZER_GATE_SCAN_MIN_BYTES", "0")  # scan even for this small corpus
    texts = [*documents, *read_multilingual()] * 6
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    verdicts = tmp_path / "cache" / "gate"

    def progress(done) -> None:
        if not hold.exists():  # after the first chunk, encoded by the reference library: let the scan report
            hold.touch()
            deadline = time.monotonic() + SCAN_SECONDS
            while not any("passed" in json.loads(path.read_text()) for path in verdicts.glob("*.json")):
                # the verdict is cached after it was sent to the run (beside the model's description)
                assert time.monotonic() < deadline
                time.sleep(0.1)

    warnings: list[str] = []
    options = Options(inputs=[str(source)], output=tmp_path / "out", model=str(library_models["tt"]), workers=2)
    summary = run(options, report_bad=warnings.append, warn=warnings.append, progress=progress)
    fast = sum(count for encoder, count in summary.encoded_by.items() if libraries.is_fast(encoder))
    assert summary.encoded_by.get("tiktoken", 0) > 0 and fast > 0, summary
    assert sum(summary.encoded_by.values()) == len(texts)
    assert any("gate passed" in line for line in warnings), warnings
    reference = Reference(library_models["tt"])
    eos = summary.metadata["model"]["eos_id"]
    dataset = TokenDataset(summary.output)
    assert len(dataset) == len(texts)
    for index, text in enumerate(texts):
        assert np.asarray(dataset[index]).tolist() == [*reference.encode(text), eos], index
    found = loads(counts)
    parent = [count for (_, name), count in found.items() if name == "MainProcess"]
    assert parent == [collections.Counter(load=1)], found  # described only: no fast encoder, no check set
    # forked workers (this process had no other thread) start with the parent's copy; spawned ones load it once
    forked = [count for (_, name), count in found.items() if name.startswith("ForkProcess")]
    spawned = [count for (_, name), count in found.items() if name.startswith("SpawnProcess")]
    assert all(count["load"] == 0 and count["fast"] == 1 for count in forked), found  # promoted once each
    assert all(count["load"] == 1 and count["fast"] <= 1 for count in spawned), found
    assert len(forked) + len(spawned) <= 2 and (forked or len(spawned) == 2), found


@pytest.mark.parametrize(("shadow_rate", "verifier"), [("0", False), ("1", False), ("1", True)])
def test_a_pretokenize_run_loads_the_model_once_in_all_and_forks_its_workers_loaded(
    library_models, tmp_path, shadow_rate, verifier
):
    """With the verdict cached, the command's process loads the model once and builds its fast encoder once,
    described from the cache and checked against the check set's digest: its reference library never loads there.
    Its two workers are forked from it with both (they load and build nothing) and give the reference's ids. On
    so small an input the reference library is left to a worker that samples a text for shadow verification:
    none at rate 0; at rate 1 (every text), each worker that encoded a chunk loads it once. On an input of
    TOKENIZER_VERIFIER_MIN_BYTES (here: any) the verifier process loads it once, and no worker does."""
    from tokenizer_client.dataset import TokenDataset

    cache, counts = tmp_path / "cache", tmp_path / "counts"
    counts.mkdir()
    env = {**os.environ, libraries.CACHE_DIR_ENV: str(cache), libraries.COUNT_ENV: str(counts)}
    env |= {"TOKENIZER_SHADOW_RATE": shadow_rate, "TOKENIZER_SHADOW_INTERVAL_SECONDS": "0"}
    env[verifiers.MIN_BYTES_ENV] = "0" if verifier else str(1 << 40)
    settle = [sys.executable, "-m", "tokenizer_service.core.gatescan", str(library_models["hfbpe"])]
    subprocess.run(settle, env={**env, libraries.COUNT_ENV: ""}, check=True, capture_output=True, timeout=SCAN_SECONDS)
    texts = read_multilingual()[:200]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    command = [sys.executable, "-m", "tokenizer_service.tools.pretokenize", str(source), "--local", "--workers", "2"]
    command += ["--model", str(library_models["hfbpe"]), "--output", str(tmp_path / "out"), "-q"]
    subprocess.run(command, env=env, check=True, capture_output=True, timeout=300)
    found = loads(counts, reference=True)
    command_process = [count for (_, name), count in found.items() if name == "MainProcess"]
    checker = [count for (_, name), count in found.items() if name == verifiers.PROCESS_NAME]
    workers = [count for (_, name), count in found.items() if name not in ("MainProcess", verifiers.PROCESS_NAME)]
    assert command_process == [collections.Counter(load=1, fast=1)], found
    assert checker == ([collections.Counter(reference=1)] if verifier else []), found
    if shadow_rate == "0" or verifier:
        assert workers == [], found
    else:
        assert workers and all(count == collections.Counter(reference=1) for count in workers), found
    reference = Reference(library_models["hfbpe"])
    dataset = TokenDataset(tmp_path / "out")
    assert libraries.is_fast(dataset.metadata["model"]["encoder"]), dataset.metadata["model"]
    eos = dataset.metadata["model"]["eos_id"]  # the pre-tokenizer ends each document with EOS by default
    assert [np.asarray(dataset[index]).tolist() for index in range(len(texts))] == [
        [*reference.encode(text), eos] for text in texts
    ]


def test_a_tekken_file_is_served_by_tiktoken_then_promoted_to_the_gates_route(tmp_path, documents):
    """A tekken.json with no cached verdict: tiktoken serves it at once, the background gate tries its converted
    routes, and every worker is promoted to the one the rule chose, which /v1/models names; mistral-common's
    ids throughout, control tokens parsed only with parse_special_tokens."""
    from mistral_common.tokens.tokenizers.tekken import Tekkenizer

    from tests.test_shipped_tokenizers import bpe_tokens, tekken_reference_rows, write_tekken
    from tests.tokenizer_models import training_texts

    multilingual = read_multilingual()
    path = write_tekken(tmp_path / "tekken.json", bpe_tokens(training_texts(documents, multilingual), 1500))
    hold = tmp_path / "release"
    env = {libraries.CACHE_DIR_ENV: str(tmp_path / "cache"), gatescan.HOLD_ENV: str(hold)}
    args = ["--workers", "2", "--model", f"tk={path}", "--shadow-rate", "1"]
    url, process = start_server(args, tmp_path / "server.log", env=env)
    reference = Tekkenizer.from_file(path)
    texts = [*documents[:100], *multilingual, "[INST] hi [/INST]</s>", "<s>[THINK]x[/THINK]<SPECIAL_39>"]

    def same_ids(rounds: int) -> None:
        for parse_special in (False, True):
            want = tekken_reference_rows(reference, texts, parse_special)
            for _ in range(rounds):
                body = {"texts": texts, "model": "tk", "parse_special_tokens": parse_special}
                assert httpx.post(f"{url}/v1/tokenize", json=body, timeout=60).json()["ids"] == want, parse_special

    try:
        assert encoder_of(url, "tk") == "tiktoken"
        same_ids(2)
        hold.touch()
        wait_for_encoder(url, "tk", "fast")
        assert encoder_of(url, "tk") in ("fastokens(converted)", "gigatoken(converted)")
        same_ids(4)  # every worker promoted, checked by shadow verification at rate 1
    finally:
        stop_server(process)
