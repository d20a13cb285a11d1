"""The installed `tokenizer-server` command: bare start on the bundled model, configured by environment."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import sentencepiece as spm

from tests.conftest import free_port, stop_server, wait_ready
from tokenizer_service import cli
from tokenizer_service.settings import BUNDLED_MODELS_DIR
from tokenizer_service.tools.launcher import ServerProcess

CLEAN_ENV = {key: value for key, value in os.environ.items() if not key.startswith("TOKENIZER_")}


@pytest.mark.slow  # a server process of its own; .ci/run's slow stage
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
        result.stderr.strip()
        == "tokenizer-server: --max-header-bytes '10': Input should be greater than or equal to 1024"
    )


@pytest.mark.parametrize(
    ("command", "says"),
    [
        (["tokenizer-server", "--bogus"], "tokenizer-server: error: unrecognized arguments: --bogus"),
        (["tokenizer-pretokenize", "--bogus", "in.jsonl"], "tokenizer-pretokenize: error: unrecognized arguments"),
        (["tokenizer-shards"], "tokenizer-shards: error: the following arguments are required: command"),
        (["tokenizer-shards", "export", "DIR"], "tokenizer-shards export: error: the following arguments are"),
        (["tokenizer-bench", "--rounds", "x"], "tokenizer-bench: error: argument --rounds: invalid int value"),
    ],
    ids=lambda item: " ".join(item) if isinstance(item, list) else "",
)
def test_a_command_line_argparse_refuses_is_one_line_naming_the_help(command, says):
    """argparse's refusal, without the usage it prints first (14 lines for tokenizer-pretokenize): one line
    saying what was wrong and where the help is, exit 2; a subcommand's names the subcommand."""
    program = shutil.which(command[0]) or os.path.join(os.path.dirname(sys.executable), command[0])
    result = subprocess.run([program, *command[1:]], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(says), result.stderr
    prog = says.partition(": error:")[0]
    assert lines[0].endswith(f"(see {prog} --help)"), lines[0]


def test_help_reads_as_a_person_wrote_it():
    output = subprocess.run(["tokenizer-server", "--help"], capture_output=True, text=True, check=True).stdout
    for leak in ("null", "{Path", "{int", "{str", "default factory", "list[", "SecretStr", "PydanticUndefined"):
        assert leak not in output, leak
    for shown in ("--model NAME=PATH", "--models-dir DIR", "--workers N", "--request-timeout SECONDS", "TOKENIZER_"):
        assert shown in output, shown


def _start(args: list[str], env: dict[str, str], tmp_path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["tokenizer-server", "--port", "0", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**CLEAN_ENV, **env},
        cwd=tmp_path,
    )


def _models(tmp_path, kind: str) -> dict[str, str]:
    if kind == "empty":
        (tmp_path / "empty").mkdir()
    elif kind == "not-a-model":
        (tmp_path / "notes.model").write_text("not a model\n")
    elif kind == "no-sidecar":
        (tmp_path / "qwen.tiktoken").write_text("IQ== 0\nIg== 1\n")
    elif kind == "other-json":
        (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "vocab": {}}')
    elif kind == "empty-snapshot":
        (tmp_path / "snapshot").mkdir()
    elif kind == "config-token":
        from tokenizers import Tokenizer, models, pre_tokenizers, trainers

        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel()
        tokenizer.train_from_iterator(["a few words of text"] * 10, trainers.BpeTrainer(vocab_size=300))
        (tmp_path / "snapshot").mkdir()
        tokenizer.save(str(tmp_path / "snapshot" / "tokenizer.json"))
        (tmp_path / "snapshot" / "tokenizer_config.json").write_text('{"eos_token": {"content": "<|eot|>"}}')
    return {}


@pytest.mark.parametrize(
    ("args", "env", "setup", "expected"),
    [
        (["--models-dir", "nodir"], {}, None, "tokenizer-server: --models-dir 'nodir': does not exist"),
        (
            ["--models-dir", "empty"],
            {},
            "empty",
            "the models directory empty (--models-dir, TOKENIZER_MODELS_DIR) holds no model (*.model, *.model.vN, "
            "*.tiktoken, tekken*.json, or a subdirectory holding a tokenizer.json, tekken.json or "
            "original/tokenizer.model)",
        ),
        ([], {"TOKENIZER_MODELS_DIR": ""}, None, "TOKENIZER_MODELS_DIR='': is set but empty"),
        ([], {"TOKENIZER_MODELS_DIR": "nodir"}, None, "TOKENIZER_MODELS_DIR='nodir': does not exist"),
        (["--model", "foo=nope.model"], {}, None, "model 'foo': cannot read nope.model: No such file or directory"),
        (
            ["--model", "foo=notes.model"],
            {},
            "not-a-model",
            "model 'foo': notes.model is not a model file; a model is a SentencePiece .model, a Hugging Face "
            "tokenizer.json, tiktoken BPE ranks (*.tiktoken, Meta's tokenizer.model), a Mistral tekken.json, or a "
            "directory holding a tokenizer.json, tekken.json or original/tokenizer.model",
        ),
        (
            ["--model", "qwen=qwen.tiktoken"],
            {},
            "no-sidecar",
            "qwen.tiktoken is tiktoken ranks of an encoding tiktoken does not know: add ",
        ),
        (["--model", "x=tokenizer.json"], {}, "other-json", "model 'x': tokenizer.json is not a model file; a model"),
        (["--model", "x=snapshot"], {}, "empty-snapshot", "model 'x': the directory snapshot holds no tokenizer.json"),
        (
            ["--model", "x=snapshot"],
            {},
            "config-token",
            "tokenizer_config.json names eos_token '<|eot|>', which ",
        ),
        (
            ["--model", "tok.model"],
            {},
            None,
            "--model 'tok.model': is not NAME=PATH (for example --model default=tok.model)",
        ),
        ([], {"TOKENIZER_WORKERS": "abc"}, None, "TOKENIZER_WORKERS='abc': Input should be a valid integer"),
        (["--workers", "abc"], {"TOKENIZER_WORKERS": "2"}, None, "--workers 'abc': Input should be a valid integer"),
        (["--log-level", "loud"], {}, None, "--log-level 'loud': Input should be 'critical', 'error'"),
        (["--default-model", "other"], {}, None, "default model 'other' is not among the served models ['default']"),
    ],
    ids=[
        "missing-dir",
        "empty-dir",
        "empty-env",
        "missing-dir-env",
        "missing-file",
        "not-a-model",
        "tiktoken-without-sidecar",
        "json-not-a-tokenizer",
        "directory-without-tokenizer-json",
        "config-names-a-missing-token",
        "no-name",
        "workers-env",
        "workers-flag",
        "log-level",
        "default-model",
    ],
)
def test_a_start_it_cannot_serve_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys, args, env, setup, expected):
    """tokenizer_service.cli.main in this process, as the command runs it
    (the installed command itself: the test below)."""
    if setup:
        _models(tmp_path, setup)
    for key in [key for key in os.environ if key.startswith("TOKENIZER_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["--port", "0", *args]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tokenizer-server: "), lines
    assert expected in lines[0]


def test_the_installed_command_refuses_in_one_line_and_exit_2(tmp_path):
    result = _start(["--models-dir", "missing"], {"TOKENIZER_WORKERS": "1"}, tmp_path)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tokenizer-server: ") and "missing" in lines[0], result.stderr


@pytest.mark.slow  # a server process of its own; .ci/run's slow stage
def test_log_level_debug_adds_the_traceback(tmp_path):
    result = _start(["--model", "foo=nope.model", "--log-level", "debug"], {}, tmp_path)
    assert result.returncode == 2
    assert "Traceback" in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "tokenizer-server: model 'foo': cannot read nope.model: No such file or directory"
    )


@pytest.mark.parametrize(
    ("entry", "missing", "extra"),
    [
        ("server", "uvicorn", "server"),
        ("pretokenize", "tqdm", "tools"),
        ("bench", "orjson", "tools"),
        ("shards", "tqdm", "tools"),
    ],
)
def test_a_missing_extra_names_what_to_install(entry, missing, extra):
    # None in sys.modules is how Python itself marks a module as absent: its import raises ModuleNotFoundError.
    program = f"import sys; sys.modules[{missing!r}] = None; from tokenizer_service.entry import {entry}; {entry}()"
    result = subprocess.run([sys.executable, "-c", program, "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"tokenizer-{entry}: the Python package {missing!r} is missing; tokenizer-{entry} needs the {extra!r} "
        f"extra: pip install 'tokenizer-service[{extra}]'"
    ]


@pytest.mark.parametrize(("given", "seen"), [(None, "1"), ("4", "4")])
def test_commands_import_numpy_without_openblas_threads_unless_asked(given, seen):
    """Every command's processes (its workers inherit it) run OpenBLAS on one thread: none multiplies matrices,
    and its threads cost each process 0.1 CPU-s at import on 2 cores. A user's own setting stands."""
    program = (
        "import os, sys; from tokenizer_service.tools import bench; "
        "bench.main = lambda: print(os.environ.get('OPENBLAS_NUM_THREADS')) or 0; "
        "from tokenizer_service.entry import bench as command; command()"
    )
    environment = {key: value for key, value in os.environ.items() if key != "OPENBLAS_NUM_THREADS"}
    if given is not None:
        environment["OPENBLAS_NUM_THREADS"] = given
    result = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=60, env=environment
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == seen


@pytest.mark.slow  # a server process of its own; .ci/run's slow stage
@pytest.mark.parametrize("to", ["server", "process-group"])
def test_sigterm_is_a_clean_stop(tmp_path, to):
    """compose down / Kubernetes send SIGTERM: exit 0; sent to the whole group (`timeout`), no worker dies first."""
    server = ServerProcess(["--workers", "2"], log=tmp_path / "server.log").start()
    assert server.process is not None
    if to == "server":
        server.process.send_signal(signal.SIGTERM)
    else:
        os.killpg(server.process.pid, signal.SIGTERM)
    try:
        assert server.process.wait(timeout=60) == 0
    finally:
        server.stop()
    log = server.log.read_text()
    assert "Finished server process" in log
    assert "died" not in log and "restarting" not in log, log


@pytest.mark.slow  # a server process of its own; .ci/run's slow stage
def test_a_port_in_use_or_an_address_not_here_is_one_line_before_any_worker_starts(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            ["tokenizer-server", "--port", str(port)], capture_output=True, text=True, timeout=60, env=CLEAN_ENV
        )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"tokenizer-server: cannot listen on 127.0.0.1:{port}: Address already in use; another process listens "
        "there (another tokenizer-server?): stop it, or choose another --port"
    ]
    # 192.0.2.0/24 is TEST-NET-1 (RFC 5737): never an address of this machine
    result = subprocess.run(
        ["tokenizer-server", "--host", "192.0.2.1"], capture_output=True, text=True, timeout=60, env=CLEAN_ENV
    )
    assert result.returncode == 2
    assert "cannot listen on 192.0.2.1:8000: Cannot assign requested address; no interface" in result.stderr


@pytest.mark.slow  # a server process of its own; .ci/run's slow stage
def test_an_empty_models_dir_serves_the_bundled_model_only_when_asked(tmp_path):
    """The image sets TOKENIZER_EMPTY_MODELS_DIR=bundled: an empty mounted /models serves the bundled model."""
    (tmp_path / "models").mkdir()
    args = ["--models-dir", str(tmp_path / "models"), "--workers", "1"]
    assert _start(args, {}, tmp_path).returncode == 2
    with ServerProcess(args, env={"TOKENIZER_EMPTY_MODELS_DIR": "bundled"}, log=tmp_path / "server.log") as server:
        assert httpx.get(f"{server.url}/v1/models").json()["default"] == "default"
    assert "serving the bundled model as 'default' (--empty-models-dir bundled)" in server.log.read_text()


@pytest.mark.parametrize(
    "command",
    [
        ["tokenizer-server"],
        ["tokenizer-pretokenize"],
        ["tokenizer-bench"],
        ["tokenizer-shards"],
        *(["tokenizer-shards", sub] for sub in ("info", "verify", "merge", "export")),
    ],
    ids=" ".join,
)
def test_every_help_prints(command):
    """--help of every command and subcommand prints its text (a help string with a bare %, as in a Jinja
    `{% generation %}`, is an argparse format error: a traceback instead of the help)."""
    program = shutil.which(command[0]) or os.path.join(os.path.dirname(sys.executable), command[0])
    result = subprocess.run([program, *command[1:], "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage:") and not result.stderr


@pytest.mark.parametrize(
    ("command", "module", "status", "says"),
    [
        ("shards", "tokenizer_service.tools.pretokenize.shards_cli", 130, "tokenizer-shards: interrupted"),
        ("bench", "tokenizer_service.tools.bench", 130, "tokenizer-bench: interrupted"),
        ("server", "tokenizer_service.cli", 0, "tokenizer-server: stopped"),
    ],
)
def test_ctrl_c_where_a_command_has_no_handling_of_its_own_is_one_line(
    monkeypatch, capsys, command, module, status, says
):
    """A probe's Ctrl-C in `tokenizer-shards verify --sample`, or in any command while it imported, was a
    KeyboardInterrupt traceback: now one line, exit 130 (a server: stopped, exit 0, as its own handling says)."""
    import importlib

    from tokenizer_service import entry

    def interrupted() -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(importlib.import_module(module), "main", interrupted)
    with pytest.raises(SystemExit) as stopped:
        getattr(entry, command)()
    assert stopped.value.code == status
    error = capsys.readouterr().err.strip().splitlines()
    assert error == [says]


# -- stdout that cannot be written -------------------------------------------------------------------------

CLOSED_PIPE = 141  # 128 + SIGPIPE, as a shell reports `seq 1000000 | head -1`
CORPUS = Path(__file__).resolve().parent / "data" / "multilingual.jsonl"


@pytest.fixture(scope="module")
def small_dataset(tmp_path_factory) -> Path:
    corpus = tmp_path_factory.mktemp("corpus") / "in.jsonl"
    corpus.write_text("".join(f'{{"text": "document {n}, a few words long"}}\n' for n in range(50)))
    output = corpus.parent / "dataset"
    subprocess.run(
        [_installed("tokenizer-pretokenize"), str(corpus), "--local", "--output", str(output), "--workers", "1", "-q"],
        check=True,
        capture_output=True,
        timeout=120,
        env=CLEAN_ENV,
    )
    return output


def _installed(command: str) -> str:
    return shutil.which(command) or os.path.join(os.path.dirname(sys.executable), command)


STDOUT_COMMANDS = [
    # every entry point of pyproject.toml's [project.scripts], and the commands that print data
    ["tokenizer-server", "--help"],
    ["tokenizer-pretokenize", "--help"],
    ["tokenizer-bench", "--help"],
    ["tokenizer-shards", "--help"],
    ["tokenizer-shards", "info", "{dataset}"],
    ["tokenizer-pretokenize", str(CORPUS), "--peek"],
]
STDOUT_IDS = ["server-help", "pretokenize-help", "bench-help", "shards-help", "shards-info", "pretokenize-peek"]


@pytest.mark.parametrize("command", STDOUT_COMMANDS, ids=STDOUT_IDS)
def test_stdout_on_a_full_device_is_one_line_and_exit_1(command, small_dataset):
    """A probe's `tokenizer-shards info DS > /dev/full` was an OSError traceback; `--help > /dev/full` exit 0,
    the help lost without a word (argparse swallows the OSError)."""
    args = [_installed(command[0]), *(arg.format(dataset=small_dataset) for arg in command[1:])]
    with open("/dev/full", "w") as full:
        result = subprocess.run(args, stdout=full, stderr=subprocess.PIPE, text=True, timeout=120, env=CLEAN_ENV)
    assert result.returncode == 1, result.stderr
    assert result.stderr.splitlines() == [
        f"{command[0]}: cannot write stdout: the device is full (No space left on device); free space there, "
        "or send stdout elsewhere"
    ], result.stderr


@pytest.mark.parametrize("command", STDOUT_COMMANDS, ids=STDOUT_IDS)
def test_stdout_whose_reader_went_away_ends_quietly_with_141(command, small_dataset):
    """`... | head -0`: the pipe's reader has gone before the first write; no BrokenPipeError traceback."""
    args = [_installed(command[0]), *(arg.format(dataset=small_dataset) for arg in command[1:])]
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = subprocess.run(args, stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120, env=CLEAN_ENV)
    finally:
        os.close(write_end)
    assert result.returncode == CLOSED_PIPE, result.stderr
    assert result.stderr == ""
