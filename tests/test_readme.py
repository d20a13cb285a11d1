"""README.md's code blocks run as written against a real server (issue 23, item 4).

A block preceded by an ``<!-- excerpt: why -->`` line is not run: it needs something of the reader's (their
model files, datasets, training loop, docker or a cluster), or serves until stopped. Every other block runs,
in order, in one scratch directory that looks like the repository's root (``tests/`` linked in), with the
test server's URL in place of ``http://127.0.0.1:8000``: bash blocks with ``bash -euo pipefail``, Python
blocks with this interpreter. docs/pretokenize.md's blocks follow the same rule and run after README's,
whose output directory they read; every block of the other documents (and of pretokenize.md's "Mixtures",
which needs the reader's datasets) is marked as an excerpt.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import ROOT, Server

FENCE = re.compile(r"^[ \t]*```(\w*)\n(.*?)^[ \t]*```$", re.MULTILINE | re.DOTALL)
EXCERPT = "<!-- excerpt"
README_URL = "http://127.0.0.1:8000"


def blocks(path: Path, stop_at: str | None = None) -> list[tuple[str, str, bool]]:
    """(language, code, excerpt) of every fenced block, up to the heading `stop_at`."""
    text = path.read_text(encoding="utf-8")
    if stop_at is not None and stop_at in text:
        text = text[: text.index(stop_at)]
    found = []
    for match in FENCE.finditer(text):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        found.append((match[1], textwrap.dedent(match[2]), before.lstrip().startswith(EXCERPT)))
    return found


def run_block(language: str, code: str, cwd: Path, url: str) -> str:
    code = code.replace(README_URL, url)
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    if language == "python":
        command = [sys.executable, "-c", code]
    elif language == "bash":
        command = ["bash", "-euo", "pipefail", "-c", code]
    else:
        pytest.fail(f"a {language or 'plain'} block that is not marked as an excerpt:\n{code}")
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{code}\n--- stdout\n{result.stdout[-2000:]}\n--- stderr\n{result.stderr[-3000:]}"
    return result.stdout


def test_every_block_is_run_or_marked_as_an_excerpt() -> None:
    for path, stop in ((ROOT / "README.md", None), (ROOT / "docs" / "pretokenize.md", "### Mixtures")):
        for language, code, excerpt in blocks(path, stop):
            assert excerpt or language in ("bash", "python"), f"{path.name}: a {language!r} block:\n{code}"
    # The other documents' blocks are not run here: each must say it is an excerpt, and why.
    pretokenize = (ROOT / "docs" / "pretokenize.md").read_text(encoding="utf-8")
    others = [(path.name, path.read_text(encoding="utf-8")) for path in sorted((ROOT / "docs").glob("*.md"))]
    others = [(name, text) for name, text in others if name != "pretokenize.md"]
    others.append(("pretokenize.md (Mixtures)", pretokenize[pretokenize.index("### Mixtures") :]))
    for name, text in others:
        for match in FENCE.finditer(text):
            before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
            assert before.lstrip().startswith(EXCERPT), f"{name}: a block neither run nor marked:\n{match[2][:200]}"


def test_readme_and_pretokenize_docs_run_as_written(server: Server, tmp_path: Path) -> None:
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "data").symlink_to(ROOT / "tests" / "data")
    ran = []
    for language, code, excerpt in blocks(ROOT / "README.md"):
        if not excerpt:
            ran.append(run_block(language, code, tmp_path, server.url))
    assert len(ran) >= 4
    assert '"ids":[[' in ran[0].replace(" ", "")  # the curl example's answer
    assert (tmp_path / "scratch" / "megatron" / "web_text_document.idx").exists()
    assert (tmp_path / "scratch" / "megatron" / "web_text_document_val.idx").exists()
    docs = [block for block in blocks(ROOT / "docs" / "pretokenize.md", "### Mixtures") if not block[2]]
    for language, code, _ in docs:
        run_block(language, code, tmp_path, server.url)
    # Run from a checkout, the examples leave nothing git would show: they write under scratch/ alone,
    # which .gitignore names.
    assert sorted(path.name for path in tmp_path.iterdir()) == ["scratch", "tests"]
    assert sorted(path.name for path in (tmp_path / "tests").iterdir()) == ["data"]
    written = ["scratch/shards/metadata.json", "scratch/megatron/web_text_document.bin"]
    if (ROOT / ".git").exists():
        ignored = subprocess.run(["git", "check-ignore", *written], cwd=ROOT, capture_output=True, text=True)
        assert ignored.stdout.split() == written, f"README's scratch/ is not ignored by git: {ignored}"
