"""What a new user trips on in a first hour (issue 35), as they meet it: installed commands whose reader goes
away, the client's errors, /docs without the internet, what the README's examples leave behind."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tokenizer_service.settings import BUNDLED_MODELS_DIR

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "tests" / "data" / "multilingual.jsonl"
CLOSED_PIPE = 141  # 128 + SIGPIPE, as a shell reports `seq 1000000 | head -1`


def installed(command: str) -> str:
    executable = shutil.which(command)
    assert executable, f"{command} is not installed (pip install -e '.[test]')"
    return executable


def run_into_a_closed_pipe(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """`args | head -0`: stdout is a pipe whose reader has already gone."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run(args, stdout=write_end, stderr=subprocess.PIPE, text=True, cwd=cwd, timeout=120)
    finally:
        os.close(write_end)


# -- every CLI survives a closed pipe quietly ----------------------------------------------------------------


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    output = tmp_path_factory.mktemp("pipe") / "shards"
    subprocess.run(
        [
            installed("tokenizer-pretokenize"),
            str(CORPUS),
            "--local",
            "--output",
            str(output),
            "--workers",
            "1",
            "-q",
            "--model",
            str(BUNDLED_MODELS_DIR / "default.model"),
        ],
        check=True,
        capture_output=True,
    )
    return output


@pytest.mark.parametrize(
    "command",
    [
        ["tokenizer-shards", "info", "{shards}"],
        ["tokenizer-shards", "info", "--help"],
        ["tokenizer-pretokenize", str(CORPUS), "--peek"],
        ["tokenizer-server", "--help"],
        ["tokenizer-bench", "--help"],
    ],
    ids=["shards-info", "shards-help", "pretokenize-peek", "server-help", "bench-help"],
)
def test_a_command_whose_reader_went_away_ends_quietly(command: list[str], shards: Path, tmp_path: Path) -> None:
    args = [installed(command[0]), *(arg.format(shards=shards) for arg in command[1:])]
    result = run_into_a_closed_pipe(args, tmp_path)
    assert result.returncode in (0, CLOSED_PIPE), result.stderr
    assert result.stderr == "", result.stderr  # no BrokenPipeError traceback, no "Exception ignored", no "[Errno 32]"


def test_info_into_head_through_a_shell(shards: Path, tmp_path: Path) -> None:
    """The line from the issue: `tokenizer-shards info DS | head -1` prints one line and nothing on stderr."""
    installed("tokenizer-shards")
    result = subprocess.run(
        ["bash", "-c", f"tokenizer-shards info '{shards}' | head -1; echo \"status ${{PIPESTATUS[0]}}\" >&2"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert result.stdout.count("\n") == 1
    assert result.stderr.strip() in ("status 0", f"status {CLOSED_PIPE}"), result.stderr


# -- the client's errors name the URL they requested ---------------------------------------------------------


def test_a_base_url_with_a_path_the_service_lacks_says_to_give_the_root(server) -> None:
    from tokenizer_client import AsyncTokenizerClient, PrefetchError, TokenizerClient, TokenizerServiceError

    with TokenizerClient(f"{server.url}/v1") as client, pytest.raises(TokenizerServiceError) as refused:
        client.tokenize(["I am a cat."])
    message = str(refused.value)
    assert message.startswith(f"{server.url}/v1/v1/tokenize: 404 "), message
    assert message.endswith(f"give the server's root URL, e.g. {server.url}"), message
    assert "\n" not in message and refused.value.url == f"{server.url}/v1/v1/tokenize"

    with TokenizerClient(f"{server.url}/v1/") as client, pytest.raises(PrefetchError) as failed:
        list(client.prefetch(["a text"] * 3, batch_size=2))
    assert f"{server.url}/v1/v1/tokenize: 404" in str(failed.value)
    assert f"e.g. {server.url}" in str(failed.value)

    import asyncio

    async def detokenize() -> None:
        async with AsyncTokenizerClient(f"{server.url}/tokenizer") as client:
            await client.detokenize([[5, 6]])

    with pytest.raises(TokenizerServiceError, match=rf"^{server.url}/tokenizer/v1/detokenize: 404 .*root URL"):
        asyncio.run(detokenize())


def test_every_service_error_names_the_url_it_requested(server) -> None:
    from tokenizer_client import TokenizerClient, TokenizerServiceError

    with TokenizerClient(server.url) as client:
        with pytest.raises(TokenizerServiceError) as refused:
            client.tokenize(["a"], model="no-such-model")
        assert str(refused.value).startswith(f"{server.url}/v1/tokenize: 404 model_not_found")
        assert "root URL" not in str(refused.value)  # the path was right: the model is what is missing
        with pytest.raises(TokenizerServiceError, match=rf"^{server.url}/v1/detokenize: 4\d\d "):
            client.detokenize([[10**9]])


# -- /docs works offline ---------------------------------------------------------------------------------------


def asset_urls(page: str) -> list[str]:
    import re

    return re.findall(r"""(?:src|href)\s*=\s*["']([^"']+)["']""", page)


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_the_docs_pages_load_every_asset_from_the_server_itself(server, page: str) -> None:
    import httpx

    answer = httpx.get(f"{server.url}{page}")
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/html")
    urls = asset_urls(answer.text)
    assert any(url.endswith(".js") for url in urls), answer.text
    assert "cdn" not in answer.text and "fonts.googleapis" not in answer.text
    for url in urls:
        assert url.startswith("/") and not url.startswith("//"), f"{page} loads {url} from elsewhere"
        asset = httpx.get(f"{server.url}{url}")
        assert asset.status_code == 200 and len(asset.content) > 1000, url
        kind = {"js": "text/javascript", "css": "text/css", "png": "image/png"}[url.rpartition(".")[2]]
        assert asset.headers["content-type"].startswith(kind), (url, asset.headers["content-type"])
    if page == "/docs":
        bundle = httpx.get(f"{server.url}/docs/assets/swagger-ui-bundle.js").text
        assert "SwaggerUIBundle" in bundle and '"5.' in bundle  # Swagger UI 5: it reads OpenAPI 3.1
        assert httpx.get(f"{server.url}/openapi.json").json()["openapi"].startswith("3.1")


def test_with_api_keys_the_docs_and_their_assets_stay_open() -> None:
    from tests.test_edge_inprocess import Edge

    guarded = Edge(api_keys=["docs-test-key"])
    try:
        docs = guarded.request("GET", "/docs")
        assert docs.status_code == 200
        for url in asset_urls(docs.text):
            assert guarded.request("GET", url).status_code == 200, url
        assert guarded.request("POST", "/v1/tokenize", json={"texts": ["a"]}).status_code == 401
        assert guarded.request("GET", "/docs/assets/nothing.js").status_code in (401, 404)
    finally:
        guarded.close()


def test_the_asset_paths_left_open_are_those_served() -> None:
    from tokenizer_service.http.auth import OPEN_PATHS
    from tokenizer_service.http.docs_ui import ASSET_PATHS, asset_directory

    assert ASSET_PATHS <= OPEN_PATHS
    assert {path for path in OPEN_PATHS if path.startswith("/docs/assets/")} == ASSET_PATHS
    assert asset_directory() is not None, "the server extra installs fastapi-offline, which ships the assets"


# -- what a models folder serves, as the docs say --------------------------------------------------------------


def test_a_models_folder_serves_what_the_docs_say_and_nothing_else(tmp_path: Path) -> None:
    from tokenizer_service.settings import models_in

    for name in ("llama2.model", "cl100k_base.tiktoken", "cl100k_base.tiktoken.json", "tokenizer.json", "notes.txt"):
        (tmp_path / name).write_text("{}")
    (tmp_path / "qwen2.5").mkdir()
    (tmp_path / "qwen2.5" / "tokenizer.json").write_text("{}")
    (tmp_path / "no-tokenizer-here").mkdir()
    (tmp_path / "no-tokenizer-here" / "config.json").write_text("{}")
    assert models_in(tmp_path) == {
        "cl100k_base": tmp_path / "cl100k_base.tiktoken",
        "llama2": tmp_path / "llama2.model",
        "qwen2.5": tmp_path / "qwen2.5",
    }
    # Every place that tells a user what to put in the folder names the three kinds, not "*.model" alone.
    for path in ("docker-compose.yml", "Dockerfile", "deploy/k8s/deployment.yaml", "docs/operations.md"):
        text = (ROOT / path).read_text(encoding="utf-8")
        assert "*.tiktoken" in text and "tokenizer.json" in text, path
        assert "every `*.model` in it" not in text and "Put *.model files" not in text, path
