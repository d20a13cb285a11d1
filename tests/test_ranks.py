"""Pre-tokenizing as ranks of a cluster job: the split, the rank conventions, kill and rerun, merge."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tokenizer_client.dataset import TokenDataset
from tokenizer_service.settings import BUNDLED_MODELS_DIR
from tokenizer_service.tools.pretokenize.ranks import RankError, blocks, rank_from_environment
from tokenizer_service.tools.pretokenize.shards_cli import main as shards

pytestmark = pytest.mark.slow  # ranks as processes, killed and rerun; part of .ci/run's slow stage

MODEL = BUNDLED_MODELS_DIR / "default.model"


def test_blocks_are_contiguous_and_balanced_by_bytes():
    assert blocks([10, 10, 10, 10], 2) == [(0, 2), (2, 4)]
    assert blocks([100, 1, 1, 1, 100], 2) == [(0, 2), (2, 5)]
    spans = blocks([5, 50, 5, 5, 5, 50, 5], 3)
    assert spans[0][0] == 0 and spans[-1][1] == 7
    assert all(end == start for (_, end), (start, _) in itertools.pairwise(spans))
    assert blocks([1, 1], 4) == [(0, 0), (0, 1), (1, 1), (1, 2)]  # more ranks than files: some get none
    assert blocks([], 3) == [(0, 0), (0, 0), (0, 0)]


@pytest.mark.parametrize(
    ("flags", "environ", "expected"),
    [
        ((2, 4), {}, (2, 4)),
        ((None, None), {"RANK": "1", "WORLD_SIZE": "3"}, (1, 3)),
        (
            (None, None),
            {"SLURM_ARRAY_TASK_ID": "7", "SLURM_ARRAY_TASK_MIN": "5", "SLURM_ARRAY_TASK_COUNT": "4"},
            (2, 4),
        ),
        ((None, 5), {"JOB_COMPLETION_INDEX": "4"}, (4, 5)),
        ((None, None), {}, None),
        ((0, 2), {"RANK": "1", "WORLD_SIZE": "2"}, (0, 2)),  # flags win
    ],
)
def test_rank_and_world_size_come_from_flags_or_the_job_system(flags, environ, expected):
    assert rank_from_environment(*flags, environ=environ) == expected


@pytest.mark.parametrize(
    ("flags", "environ", "message"),
    [
        ((None, None), {"JOB_COMPLETION_INDEX": "1"}, "needs a world size"),
        ((3, 3), {}, "not in [0, 3)"),
        ((None, 2), {}, "needs a rank"),
        ((None, None), {"RANK": "x", "WORLD_SIZE": "2"}, "not an integer"),
    ],
)
def test_bad_ranks_are_refused(flags, environ, message):
    with pytest.raises(RankError, match=message.replace("[", r"\[").replace(")", r"\)")):
        rank_from_environment(*flags, environ=environ)


@pytest.fixture(scope="module")
def inputs(documents: list[str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Seven files of uneven size: enough work for a rank to be killed half way."""
    directory = tmp_path_factory.mktemp("inputs")
    for part in range(7):
        with (directory / f"part-{part}.jsonl").open("w", encoding="utf-8") as file:
            for copy in range(1 + part % 3):
                for number, text in enumerate(documents):
                    file.write(json.dumps({"text": f"{part}.{copy}.{number} {text}"}) + "\n")
    return directory


def command(inputs: Path, output: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "tokenizer_service.tools.pretokenize", str(inputs), "--local", "--model", str(MODEL),
        "--workers", "1", "--shard-tokens", "30000", "--output", str(output), "-q", *extra,
    ]  # fmt: skip


def run_rank(inputs: Path, output: Path, environ: dict[str, str], *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command(inputs, output, *extra), cwd=ROOT, env={**os.environ, **environ}, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip


def test_ranks_killed_rerun_and_merged_equal_one_run(inputs: Path, tmp_path: Path) -> None:
    single, ranked = tmp_path / "single", tmp_path / "ranked"
    assert run_rank(inputs, single, {}).returncode == 0
    # Rank 1 is killed with SIGKILL once its first shard is written, then run again.
    environ = {"SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_MIN": "0", "SLURM_ARRAY_TASK_COUNT": "3"}
    process = subprocess.Popen(
        command(inputs, ranked), cwd=ROOT, env={**os.environ, **environ}, stderr=subprocess.PIPE,
        start_new_session=True,
    )  # fmt: skip
    metadata = ranked / "rank-00001" / "metadata.json"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and process.poll() is None:
            try:
                if json.loads(metadata.read_text())["shards"]:
                    break
            except (FileNotFoundError, ValueError):
                pass
            time.sleep(0.002)
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert not json.loads(metadata.read_text())["complete"], "rank 1 finished before it could be killed"
    # The others, each from another convention; merging refuses while rank 1 is incomplete.
    assert run_rank(inputs, ranked, {"RANK": "0", "WORLD_SIZE": "3"}).returncode == 0
    assert run_rank(inputs, ranked, {"JOB_COMPLETION_INDEX": "2"}, "--world-size", "3").returncode == 0
    refused = subprocess.run(
        [sys.executable, "-m", "tokenizer_service.tools.pretokenize.shards_cli", "merge", str(ranked)],
        capture_output=True,
        text=True,
    )
    assert refused.returncode == 2 and "incomplete: rank-00001" in refused.stderr
    assert run_rank(inputs, ranked, environ).returncode == 0  # resumes
    assert run_rank(inputs, ranked, environ).returncode == 0  # finished: a no-op
    assert shards(["merge", str(ranked)]) == 0
    merged, whole = TokenDataset(ranked), TokenDataset(single)
    assert len(merged) == len(whole) and merged.num_tokens == whole.num_tokens
    assert all(merged[i].tolist() == whole[i].tolist() for i in range(len(whole)))
    assert merged.metadata["merged"]["world_size"] == 3
    assert {shard["name"].split("/")[0] for shard in merged.metadata["shards"]} == {
        "rank-00000",
        "rank-00001",
        "rank-00002",
    }


def test_merge_refuses_missing_and_disagreeing_ranks(inputs: Path, tmp_path: Path, capsys) -> None:
    ranked = tmp_path / "ranked"
    assert run_rank(inputs, ranked, {}, "--rank", "0", "--world-size", "3").returncode == 0
    assert shards(["merge", str(ranked)]) == 2
    assert "missing: rank-00001, rank-00002" in capsys.readouterr().err
    other = run_rank(inputs, ranked, {}, "--rank", "1", "--world-size", "2")  # another world size: refused at once
    assert other.returncode == 2 and "is a rank of 3 ranks; this run is a rank of 2" in other.stderr
    assert not (ranked / "rank-00001").exists()
    elsewhere = tmp_path / "elsewhere"  # a rank of W=2 made elsewhere and moved in: the merge still refuses
    assert run_rank(inputs, elsewhere, {}, "--rank", "1", "--world-size", "2").returncode == 0
    shutil.move(elsewhere / "rank-00001", ranked / "rank-00001")
    assert shards(["merge", str(ranked)]) == 2
    assert "disagree on the world size" in capsys.readouterr().err
    again = run_rank(inputs, ranked, {}, "--rank", "0", "--world-size", "2")  # into rank 0's output of W=3
    assert again.returncode == 2 and "ranks of another world size never mix" in again.stderr
    # a rank made with another option: the refusal names it
    options = tmp_path / "options"
    assert run_rank(inputs, options, {}, "--rank", "0", "--world-size", "2").returncode == 0
    assert run_rank(inputs, options, {}, "--rank", "1", "--world-size", "2", "--no-add-eos").returncode == 0
    assert shards(["merge", str(options)]) == 2
    assert "(option add_eos: rank-00000 has True, rank-00001 False)" in capsys.readouterr().err


def test_ray_local_runs_every_rank_and_merges_to_one_run(inputs: Path, tmp_path: Path) -> None:
    try:
        import ray  # noqa: F401
    except ImportError:
        if os.environ.get("TOKENIZER_CI") == "1":
            pytest.fail("ray is not installed, and TOKENIZER_CI=1 says this test must run")
        pytest.skip("ray is not installed (pip install 'tokenizer-service[ray]')")
    single, on_ray = tmp_path / "single", tmp_path / "ray"
    assert run_rank(inputs, single, {}).returncode == 0
    result = run_rank(inputs, on_ray, {}, "--ray", "local", "--world-size", "3")
    assert result.returncode == 0, result.stderr[-2000:]
    merged, whole = TokenDataset(on_ray), TokenDataset(single)
    assert merged.metadata["merged"]["world_size"] == 3
    assert len(merged) == len(whole) and all(merged[i].tolist() == whole[i].tolist() for i in range(len(whole)))


def test_ray_needs_a_world_size_and_no_rank(inputs: Path, tmp_path: Path) -> None:
    result = run_rank(inputs, tmp_path / "x", {}, "--ray", "local")
    assert result.returncode == 2 and "--ray runs every rank" in result.stderr
