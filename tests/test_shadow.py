"""Shadow verification: texts a fast encoder encoded are encoded again by the reference library, and a
mismatch falls the model back to it: in-process (the sampler, the check) and in a real server, whose
workers get a fast encoder that differs on one code point after their gate (TOKENIZER_TEST_FAST_DIFFERS,
the test-only hook in tokenizer_service.core.libraries)."""

from __future__ import annotations

import re
import shutil
import time

import httpx
import numpy as np
import pytest

from tests.conftest import start_server, stop_server
from tests.test_libraries import Reference
from tokenizer_service.core import libraries
from tokenizer_service.core.models import find_model_files
from tokenizer_service.core.options import EncodeOptions
from tokenizer_service.core.shadow import Shadow

SNOWMAN = 0x2603


@pytest.fixture
def own_gate_cache(gate_cache, tmp_path, monkeypatch):
    """A copy of the session's gate cache for a test whose planted difference is kept as a verdict (a shadow
    mismatch is remembered: in the shared cache it would refuse the fast encoder to every later test)."""
    own = tmp_path / "gate-cache"
    shutil.copytree(gate_cache, own)
    monkeypatch.setenv(libraries.CACHE_DIR_ENV, str(own))
    return own


def test_a_sampled_text_that_differs_falls_the_model_back(library_models, own_gate_cache):
    library = libraries.load(find_model_files("tt", library_models["tt"]), trusted=True)
    assert libraries.is_fast(library.encoder)
    libraries.plant_difference(library, SNOWMAN)
    shadow = Shadow(rate=1.0, interval=0.0)
    shadow.watch("tt", library)
    texts = ["plain text", "a snow\u2603man", "more"]
    wrong, _ = library.encode(texts, EncodeOptions())
    (report,) = shadow.run()
    assert report.model == "tt" and report.checks == 2  # the third after the fall-back: not checked
    assert report.mismatch is not None and "U+2603" in report.mismatch
    assert library.encoder == "tiktoken" and library.fast is None
    right, _lengths = library.encode(texts, EncodeOptions())
    reference = Reference(library_models["tt"])
    assert right.tolist() == [i for text in texts for i in reference.encode(text)]
    assert right.tolist() != wrong.tolist()
    assert shadow.run() == []  # nothing sampled after the fall-back: the reference library is not watched


def test_a_mismatch_is_kept_as_the_gates_verdict_so_no_later_start_serves_that_encoder(library_models, own_gate_cache):
    """A held-out probe: shadow verification caught a fast encoder's wrong ids and fell the model back, but the
    cached verdict still said passed, so every restart served the wrong ids again until a sample caught them."""
    files = find_model_files("tt", library_models["tt"])
    library = libraries.load(files, trusted=True)
    route = library.encoder
    assert libraries.is_fast(route)
    libraries.plant_difference(library, SNOWMAN)
    shadow = Shadow(rate=1.0, interval=0.0)
    shadow.watch("tt", library)
    library.encode(["a snow\u2603man"], EncodeOptions())
    (report,) = shadow.run()
    assert report.mismatch is not None and library.encoder == "tiktoken"
    for select in (libraries.FAST, libraries.encoders.encoder_of(route)):
        verdict = libraries.cached_verdict(libraries.gate_key(files, select))
        assert verdict is not None and verdict["passed"] is False
        assert "shadow verification" in verdict["differs"] and "U+2603" in verdict["differs"]
    again = libraries.load(files)  # a later start: the reference library, with no scan
    assert again.encoder == "tiktoken" and again.fast is None


def test_the_sampler_takes_about_its_share_and_one_text_per_interval(library_models):
    library = libraries.load(find_model_files("tt", library_models["tt"]), trusted=True)
    shadow = Shadow(rate=0.01, interval=0.0, seed=1)
    shadow.watch("tt", library)
    for _ in range(100):
        library.encode(["text"] * 100, EncodeOptions())
        shadow.pending.clear()
    sampled = 0
    for _ in range(100):
        library.encode(["text"] * 100, EncodeOptions())
        sampled += len(shadow.pending)
        shadow.pending.clear()
    assert 60 <= sampled <= 140  # 10,000 texts at 1%
    never = Shadow(rate=0.0, interval=0.05)
    never.watch("tt", library)
    library.encode(["text"] * 10, EncodeOptions())
    assert not never.pending
    time.sleep(0.06)
    library.encode(["text"] * 10, EncodeOptions())
    assert len(never.pending) == 1


def metric(url: str, name: str, model: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    found = re.search(rf'^{name}{{model="{model}"}} (\S+)$', text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def test_a_text_too_large_to_check_quickly_is_never_sampled(library_models):
    """The reference library re-encodes a text a thousand times slower than the fast encoder: a 32 MB text held a
    server's worker for 15 s after its reply, past the deadline of the requests queued behind it. A text over
    SAMPLE_MOST_CHARS is never sampled, the interval's sample takes a smaller one of the batch, and no more than
    PENDING_MOST_CHARS wait for one check."""
    from tokenizer_service.core import shadow as shadows
    from tokenizer_service.core.texts import Utf8Texts

    library = libraries.load(find_model_files("tt", library_models["tt"]), trusted=True)
    big = "a long text " * (shadows.SAMPLE_MOST_CHARS // 12 + 1)
    every = Shadow(rate=1.0, interval=0.0)
    every.watch("tt", library)
    library.encode([big, "small", big], EncodeOptions())
    assert [text for _, text, _, _ in every.pending] == ["small"]
    every.pending.clear()
    every.pending_chars = 0
    library.encode(Utf8Texts.of([big, "small"]), EncodeOptions())  # a binary body's texts: weighed in bytes
    assert [text for _, text, _, _ in every.pending] == ["small"]
    every.pending.clear()
    every.pending_chars = 0

    interval = Shadow(rate=0.0, interval=0.001, seed=3)
    interval.watch("tt", library)
    time.sleep(0.01)
    library.encode([big] * 3 + ["small"] + [big] * 3, EncodeOptions())
    assert [text for _, text, _, _ in interval.pending] in ([], ["small"])  # 8 random tries may all miss it
    interval.pending.clear()
    time.sleep(0.01)
    library.encode([big] * 4, EncodeOptions())
    assert not interval.pending  # nothing small enough: none

    every.watch("tt", library)  # the library's sampler again (one a library)
    medium = "b" * (shadows.SAMPLE_MOST_CHARS - 1)
    library.encode([medium] * 8, EncodeOptions())
    assert every.pending_chars <= shadows.PENDING_MOST_CHARS
    assert len(every.pending) == shadows.PENDING_MOST_CHARS // len(medium)
    (report,) = every.run()
    assert report.checks == shadows.PENDING_MOST_CHARS // len(medium) and report.mismatch is None
    assert every.pending_chars == 0


@pytest.mark.slow
def test_a_server_catches_a_mismatch_at_run_time_and_serves_the_reference_ids_in_every_worker(
    library_models, tmp_path, own_gate_cache
):
    log = tmp_path / "server.log"
    args = ["--workers", "2", "--model", f"tt={library_models['tt']}", "--shadow-rate", "1"]
    url, process = start_server(args, log, env={libraries.PLANT_ENV: "U+2603"})
    try:
        served = httpx.get(f"{url}/v1/models", timeout=10).json()["models"]
        assert libraries.is_fast(served[0]["encoder"])
        reference = Reference(library_models["tt"])
        text = "a snow\u2603man in the garden"
        httpx.post(f"{url}/v1/tokenize", json={"texts": [text, "plain"]}, timeout=30).raise_for_status()
        deadline = time.monotonic() + 20
        while metric(url, "tokenizer_shadow_mismatches_total", "tt") < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert metric(url, "tokenizer_shadow_mismatches_total", "tt") == 1
        assert metric(url, "tokenizer_shadow_checks_total", "tt") >= 1
        served = httpx.get(f"{url}/v1/models", timeout=10).json()["models"]
        assert served[0]["encoder"] == "tiktoken"
        assert 'encoder="tiktoken"' in httpx.get(f"{url}/metrics", timeout=10).text
        time.sleep(0.5)  # the FALLBACK frames reach the other worker
        for _ in range(8):  # both workers, concurrently and in turn
            answers = [
                httpx.post(f"{url}/v1/tokenize", json={"texts": [text] * 4}, timeout=30).json()["ids"] for _ in range(2)
            ]
            assert all(ids == reference.encode(text) for answer in answers for ids in answer)
        assert metric(url, "tokenizer_shadow_mismatches_total", "tt") == 1  # the reference library is not watched
    finally:
        stop_server(process)
    lines = [line for line in log.read_text().splitlines() if "shadow verification" in line]
    assert len(lines) == 1 and "U+2603" in lines[0], lines


@pytest.mark.slow
@pytest.mark.parametrize("verifier", [False, True], ids=["workers-check", "verifier-process"])
def test_the_pretokenizer_restarts_the_shard_with_the_reference_library_on_a_mismatch(
    library_models, tmp_path, multilingual, own_gate_cache, verifier
):
    """Each worker checks its own chunks, or (an input of TOKENIZER_VERIFIER_MIN_BYTES) the run's process has the
    verifier process check them: either way the shard holding the wrong ids is never written. The command runs in
    a process of its own, as users run it: one thread, so its workers fork (the verifier is forked where they are)."""
    import os
    import subprocess
    import sys

    from tests.conftest import DATA
    from tokenizer_client.dataset import TokenDataset
    from tokenizer_service.tools.pretokenize import verifier as verifiers

    counts = tmp_path / "counts"
    counts.mkdir()
    env = {
        **os.environ,
        libraries.PLANT_ENV: "U+00F2",  # first in document 61 of 120: shards before it are written, its own is not
        "TOKENIZER_SHADOW_RATE": "1",
        verifiers.MIN_BYTES_ENV: "0" if verifier else str(1 << 40),
        libraries.COUNT_ENV: str(counts),
    }
    command = [sys.executable, "-m", "tokenizer_service.tools.pretokenize", str(DATA / "multilingual.jsonl"), "--local"]
    command += ["--model", str(library_models["tt"]), "--workers", "2", "--shard-tokens", "2000"]
    command += ["--output", str(tmp_path / "out"), "-q"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    (line,) = [line for line in done.stderr.splitlines() if "shadow verification" in line]  # 64 code points shown
    assert "restarting the shard being written" in line
    reference = Reference(library_models["tt"])
    dataset = TokenDataset(tmp_path / "out")
    eos = dataset.metadata["model"]["eos_id"]
    assert len(dataset.metadata["shards"]) > 2 and len(dataset) == len(multilingual)
    for index, text in enumerate(multilingual):
        assert np.asarray(dataset[index]).tolist() == [*reference.encode(text), eos], index
    # who loaded the reference library to check (the command's process loads it too, to encode after the mismatch)
    lines = (counts / "loads.txt").read_text().splitlines()
    checked_by = {line.split()[1] for line in lines if line.split()[2] == "reference"} - {"MainProcess"}
    if verifier:  # the verifier process, and no worker
        assert checked_by == {verifiers.PROCESS_NAME}, lines
    else:
        assert checked_by and verifiers.PROCESS_NAME not in checked_by, lines
    verdict = libraries.cached_verdict(libraries.gate_key(find_model_files("tt", library_models["tt"]), libraries.FAST))
    assert verdict is not None and verdict["passed"] is False and "shadow verification" in verdict["differs"]


@pytest.mark.parametrize("rate", [1e-17, 5e-324, 1e-300])
def test_a_rate_too_small_for_log_of_one_minus_it_samples_as_good_as_never(rate):
    """log(1 - rate) is 0 for a rate under about 1e-16: the gap used to divide by it (ZeroDivisionError at every
    worker's start, the server's and the pre-tokenizer's)."""
    shadow = Shadow(rate, 0.0, seed=1)
    assert all(shadow._gap() > 10**9 for _ in range(100))  # a gap below it: 1 chance in 10**7 a draw
