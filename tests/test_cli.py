"""The installed `tokenizer-server` command: bare start on the bundled model, configured by environment."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import httpx
import sentencepiece as spm

from app.settings import BUNDLED_MODELS_DIR
from tests.conftest import free_port, stop_server, wait_ready


def test_bare_command_serves_the_bundled_model(tmp_path):
    executable = shutil.which("tokenizer-server")
    assert executable, "tokenizer-server is not installed (pip install -e '.[test]')"
    port = free_port()
    log = (tmp_path / "server.log").open("wb")
    process = subprocess.Popen(
        [executable],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={
            **{key: value for key, value in os.environ.items() if not key.startswith("TOKENIZER_")},
            "TOKENIZER_PORT": str(port),
            "TOKENIZER_WORKERS": "1",
        },
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, process, tmp_path / "server.log")
        listing = httpx.get(f"{url}/v1/models").json()
        assert listing["default"] == "default" and [m["name"] for m in listing["models"]] == ["default"]
        sp = spm.SentencePieceProcessor(model_file=str(BUNDLED_MODELS_DIR / "default.model"))
        answer = httpx.post(f"{url}/v1/tokenize", json={"texts": ["I am a cat."]}).json()
        assert answer["ids"] == [sp.encode("I am a cat.")]
    finally:
        stop_server(process)


def test_help_lists_every_option():
    output = subprocess.run(["tokenizer-server", "--help"], capture_output=True, text=True, check=True).stdout
    for flag in (
        "--host",
        "--port",
        "--workers",
        "--model",
        "--models-dir",
        "--default-model",
        "--max-request-bytes",
        "--max-texts",
        "--max-queued-bytes",
        "--max-concurrent-requests",
        "--request-timeout",
        "--stall-timeout",
        "--drain-timeout",
        "--api-keys",
        "--cors-origins",
        "--frontends",
        "--max-header-bytes",
        "--header-timeout",
        "--max-connections",
    ):
        # the whole flag, not a prefix of another (--model is one of --models-dir)
        assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", output), flag


def test_a_bad_flag_is_one_line_not_a_traceback():
    result = subprocess.run(
        ["tokenizer-server", "--max-header-bytes", "10"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2
    assert (
        result.stderr.strip() == "tokenizer-server: --max-header-bytes: Input should be greater than or equal to 1024"
    )
