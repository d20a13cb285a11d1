"""Start-up refuses what it cannot serve (issue 36, item 7): one line on stderr, exit 2, never a traceback.

Ids that do not fit int32, `--models-dir` entries that cannot be read, and whatever a tokenizer library
raises while it loads a model (pyo3's PanicException is a BaseException, not an Exception).
"""

from __future__ import annotations

import base64
import json
import logging
import os
import subprocess
import tempfile
from pathlib import Path

import pytest

from tokenizer_service import cli
from tokenizer_service.core import libraries
from tokenizer_service.core.models import ModelLoadError
from tokenizer_service.core.registry import inspect_model

CLEAN_ENV = {key: value for key, value in os.environ.items() if not key.startswith("TOKENIZER_")}
PATTERN = r"\S+|\s+"


def write_ranks(path: Path, special_tokens: dict[str, int], last_rank: int = 255) -> Path:
    """Byte-level tiktoken ranks (one token per byte; the last rank as given) and a sidecar."""
    ranks = [*range(255), last_rank]
    path.write_text("".join(f"{base64.b64encode(bytes([byte])).decode()} {ranks[byte]}\n" for byte in range(256)))
    Path(f"{path}.json").write_text(json.dumps({"pat_str": PATTERN, "special_tokens": special_tokens}))
    return path


def refusal(args: list[str], cwd: Path) -> str:
    """The installed command's one line on stderr; asserts exit 2, one line, no traceback."""
    result = subprocess.run(
        ["tokenizer-server", "--port", "0", "--workers", "1", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=CLEAN_ENV,
        cwd=cwd,
    )
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith("tokenizer-server: ")
    return lines[0]


@pytest.mark.parametrize("special_id", [2**31, 2**32 - 1, 2**32, -1], ids=["2^31", "2^32-1", "2^32", "negative"])
def test_a_special_id_beyond_int32_is_refused_at_start(tmp_path, special_id):
    """2^31 started and then answered 500s; 2^32-1 ended in fastokens' PanicException, 2^32 in tiktoken's
    OverflowError, both tracebacks."""
    write_ranks(tmp_path / "big.tiktoken", {"<|endoftext|>": 256, "<|far|>": special_id})
    line = refusal(["--model", "big=big.tiktoken"], tmp_path)
    assert f"special token '<|far|>' has id {special_id}; an id must lie in 0..2147483647" in line, line
    assert "big.tiktoken.json" in line


def test_a_rank_beyond_int32_is_refused_at_start(tmp_path):
    write_ranks(tmp_path / "big.tiktoken", {"<|endoftext|>": 256}, last_rank=2**31)
    line = refusal(["--model", "big=big.tiktoken"], tmp_path)
    assert "big.tiktoken:256: rank 2147483648 is not an int32 id" in line, line


def test_unreadable_models_dir_entries_are_named_not_skipped(tmp_path, model_files):
    """Dangling links in a Hub snapshot and a link to itself were skipped silently; requests for them got 404."""
    models = tmp_path / "models"
    models.mkdir()
    (models / "good.model").symlink_to(model_files["uni"])
    (models / "loop.model").symlink_to("loop.model")  # a link to itself
    snapshot = models / "llama"  # a Hub snapshot whose blobs were not (all) downloaded
    snapshot.mkdir()
    (snapshot / "tokenizer.json").symlink_to("../../blobs/0a1b2c")
    partial = models / "qwen"
    partial.mkdir()
    (partial / "tokenizer.json").symlink_to(tmp_path / "no-such-dir" / "tokenizer.json")
    (models / "gone").symlink_to(tmp_path / "nothing-here")  # a snapshot directory link that leads nowhere
    line = refusal(["--models-dir", "models"], tmp_path)
    assert line.startswith("tokenizer-server: the models directory models holds entries that cannot be read: ")
    assert "gone (a link to " in line and "nothing-here, which does not exist)" in line
    assert "loop.model (a link that leads back to itself)" in line
    assert "llama/tokenizer.json (a link to ../../blobs/0a1b2c, which does not exist)" in line
    assert "qwen/tokenizer.json (a link to " in line
    assert "good.model" not in line


def test_a_dangling_config_beside_a_tokenizer_json_is_refused_not_skipped(tmp_path, library_models):
    """tokenizer_config.json names BOS/EOS/PAD: a snapshot whose config link leads nowhere would serve without them."""
    snapshot = tmp_path / "snap"
    snapshot.mkdir()
    (snapshot / "tokenizer.json").symlink_to(library_models["hfbpe"] / "tokenizer.json")
    (snapshot / "tokenizer_config.json").symlink_to("../blobs/ffff")
    line = refusal(["--model", "snap=snap"], tmp_path)
    assert line.startswith("tokenizer-server: model 'snap': cannot read "), line
    assert line.endswith("snap/tokenizer_config.json: a link to ../blobs/ffff, which does not exist"), line


def panic_exception() -> type[BaseException]:
    """pyo3's PanicException, as fastokens raises it (a ranks file with a special id it cannot index)."""
    import fastokens

    try:
        with tempfile.TemporaryDirectory() as directory:
            ranks = write_ranks(Path(directory) / "panic.tiktoken", {"<|x|>": 2**32 - 1})
            fastokens.Tokenizer.from_tiktoken(str(ranks), pattern=PATTERN, special_tokens={"<|x|>": 2**32 - 1})
    except BaseException as exc:
        assert not isinstance(exc, Exception)
        return type(exc)
    raise AssertionError("fastokens no longer panics here: raise another BaseException subclass below")


class FakeFastokens:
    """fastokens whose loader panics, as the real one does on some inputs."""

    class Tokenizer:
        @staticmethod
        def from_tiktoken(*args, **kwargs):
            raise PANIC("index out of bounds: the len is 0 but the index is 4294967295")

        @staticmethod
        def from_json_str(*args, **kwargs):
            raise PANIC("index out of bounds")


PANIC = panic_exception()


def test_a_fast_encoder_that_panics_at_load_is_a_fallback(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(libraries, "_fastokens", lambda: FakeFastokens)
    monkeypatch.setattr(libraries, "_gigatoken", lambda: None)  # fastokens the only candidate
    monkeypatch.setenv(libraries.CACHE_DIR_ENV, str(tmp_path / "cache"))  # the refusal is not the real fastokens'
    ranks = write_ranks(tmp_path / "r.tiktoken", {"<|endoftext|>": 256})
    with caplog.at_level(logging.WARNING, logger="tokenizer"):
        info = inspect_model("r", ranks, wait=True)  # the gate here, as the background scan runs it
    assert info.encoder == "tiktoken"
    assert "fastokens cannot load it" in caplog.text


def test_a_library_that_panics_at_load_is_one_line_exit_2(tmp_path, monkeypatch, capsys):
    """The reference library itself raising a BaseException: a refusal in one line, not a traceback."""
    import tiktoken

    def panics(*args, **kwargs):
        raise PANIC("called `Option::unwrap()` on a `None` value\nnote: run with RUST_BACKTRACE=1")

    monkeypatch.setattr(tiktoken, "Encoding", panics)
    write_ranks(tmp_path / "r.tiktoken", {"<|endoftext|>": 256})
    monkeypatch.chdir(tmp_path)
    for key in [key for key in os.environ if key.startswith("TOKENIZER_")]:
        monkeypatch.delenv(key)
    # a cache of its own: one where these ranks were described before would not load the library to describe them
    monkeypatch.setenv(libraries.CACHE_DIR_ENV, str(tmp_path / "cache"))
    assert cli.main(["--port", "0", "--model", "r=r.tiktoken"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tokenizer-server: model 'r': tiktoken cannot load "), lines
    assert lines[0].endswith("r.tiktoken: PanicException: called `Option::unwrap()` on a `None` value"), lines


@pytest.mark.parametrize("stop", [KeyboardInterrupt, SystemExit])
def test_a_stop_asked_for_while_loading_is_not_turned_into_a_refusal(tmp_path, monkeypatch, stop):
    import tiktoken

    def stopped(*args, **kwargs):
        raise stop()

    monkeypatch.setattr(tiktoken, "Encoding", stopped)
    monkeypatch.setenv(libraries.CACHE_DIR_ENV, str(tmp_path / "cache"))  # no description of these ranks kept
    with pytest.raises(stop):
        inspect_model("r", write_ranks(tmp_path / "r.tiktoken", {"<|endoftext|>": 256}))
    with pytest.raises(ModelLoadError):  # and anything else is one
        monkeypatch.setattr(tiktoken, "Encoding", lambda *a, **k: (_ for _ in ()).throw(PANIC("boom")))
        inspect_model("r", tmp_path / "r.tiktoken")
