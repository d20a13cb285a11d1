"""Conversations and prompt-completion records through the pre-tokenizer (issue 31): shards with loss masks beside
the ids (format version 2), equal to transformers' apply_chat_template(..., return_assistant_tokens_mask=True) with
the template in use (a stock template renders with TRL's training version), --local and --url alike; ShareGPT;
bad conversations as bad records; TokenDataset.loss_mask; info's trainable share; verify --sample; Mixture labels;
exports refusing masks; outputs without masks still version 1."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.chat_models import conversations, write_chat_snapshot
from tests.conftest import start_server, stop_server
from tokenizer_client import Mixture, TokenDataset
from tokenizer_client.dataset import write_dataset
from tokenizer_client.mixture import epoch_permutation
from tokenizer_client.packing import IGNORE_INDEX
from tokenizer_service.core import chat
from tokenizer_service.tools.pretokenize import cli, shards_cli

transformers = pytest.importorskip("transformers")

STOCK = chat.CATALOGUE / "qwen3.jinja"
TRAINING = (chat.CATALOGUE / "qwen3_training.jinja").read_text(encoding="utf-8")
EOS = "<|im_end|>"
BAD_NO_ROLE = {"messages": [{"content": "who am I?"}, {"role": "assistant", "content": "nobody"}]}
BAD_NOTHING_TO_TRAIN = {"messages": [{"role": "user", "content": "only a question"}]}  # the template's mask is empty


def sharegpt(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    speaker = {"system": "system", "user": "human", "assistant": "gpt"}
    return [{"from": speaker[m["role"]], "value": m["content"]} for m in conversation]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, documents, multilingual):
    directory = tmp_path_factory.mktemp("pretokenize-chat")
    snapshot = write_chat_snapshot(directory / "chat", documents[:2000] + multilingual)
    chats = conversations(multilingual)
    lines = [{"messages": c} for c in chats]
    lines.insert(3, BAD_NO_ROLE)
    lines.insert(7, BAD_NOTHING_TO_TRAIN)
    (directory / "chats.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    (directory / "sharegpt.jsonl").write_text(
        "".join(json.dumps({"id": i, "conversations": sharegpt(c)}) + "\n" for i, c in enumerate(chats)),
        encoding="utf-8",
    )
    records = [{"prompt": multilingual[i][:200], "completion": " " + multilingual[i + 1][:200]} for i in range(20)]
    (directory / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(snapshot / "tokenizer.json"), eos_token=EOS)
    expected = []
    for conversation in chats:
        out = tokenizer.apply_chat_template(
            conversation, chat_template=TRAINING, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        assert any(out["assistant_masks"])
        expected.append((list(out["input_ids"]), list(out["assistant_masks"])))
    return directory, snapshot, chats, records, tokenizer, expected


def pretokenize(directory: Path, *args: str) -> int:
    return cli.main([*args, "--quiet", "--workers", "1"])


def contents(dataset: TokenDataset) -> list[tuple[list[int], list[int]]]:
    return [(dataset[i].tolist(), dataset.loss_mask(i).tolist()) for i in range(len(dataset))]


@pytest.fixture(scope="module")
def local_output(setup, tmp_path_factory):
    directory, snapshot, *_ = setup
    out = tmp_path_factory.mktemp("local") / "out"
    code = pretokenize(
        directory, str(directory / "chats.jsonl"), "--conversations", "--local", "--model", str(snapshot),
        "--chat-template", str(STOCK), "--output", str(out),
    )  # fmt: skip
    assert code == 0
    return out


def test_local_conversations_equal_transformers_and_bad_ones_are_bad_records(setup, local_output):
    _directory, _snapshot, chats, _, _, expected = setup
    dataset = TokenDataset(local_output)
    assert dataset.metadata["version"] == 2 and dataset.masked
    assert contents(dataset) == expected
    meta = dataset.metadata
    assert meta["bad_records"] == 2 and meta["sources"][0]["bad_records"] == 2
    assert meta["sources"][0]["documents"] == len(chats)
    described = meta["loss_mask"]
    assert described["input"] == "conversations" and described["train_on"] == "assistant"
    assert described["chat_template"]["text"] == STOCK.read_text(encoding="utf-8")
    assert described["chat_template"]["loss_mask"] == "catalogue:qwen3"
    names = sorted(path.name for path in local_output.iterdir())
    assert names == ["00000.bin", "00000.idx", "00000.mask", "metadata.json"]


def test_bad_conversations_are_named_by_file_and_line(setup, tmp_path, capsys):
    directory, snapshot, *_ = setup
    args = [str(directory / "chats.jsonl"), "--conversations", "--local", "--model", str(snapshot)]
    args += ["--chat-template", str(STOCK)]
    assert pretokenize(directory, *args, "--output", str(tmp_path / "a")) == 0
    err = capsys.readouterr().err
    chats = directory / "chats.jsonl"
    assert f"{chats}:4: messages[0] has no role (a string)" in err
    assert f"{chats}:8: has no token to train on" in err
    assert pretokenize(directory, *args, "--strict", "--output", str(tmp_path / "b")) == 1
    assert f"bad record (--strict): {chats}:4: messages[0] has no role" in capsys.readouterr().err
    # texts where a conversation is: the field is an array, and only --conversations reads it
    texts = [str(chats), "--text-field", "messages", "--local", "--model", str(snapshot)]
    texts += ["--output", str(tmp_path / "c")]
    assert pretokenize(directory, *texts) == 1
    assert "field 'messages' is an array, not a string" in capsys.readouterr().err


def test_bad_records_are_said_in_the_order_of_the_input(setup, tmp_path, capsys):
    """A conversation the template refuses (line 2, known when its chunk comes back) is said before a record the
    reader refuses later in the file (line 5, known as it is read), as before the records after them."""
    directory, snapshot, chats, *_ = setup
    lines = [{"messages": chats[0]}, BAD_NOTHING_TO_TRAIN, {"messages": chats[1]}, {"messages": chats[2]}]
    lines += [BAD_NO_ROLE, {"messages": chats[3]}]
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text("".join(json.dumps(line) + "\n" for line in lines) + "{not json\n", encoding="utf-8")
    args = [str(mixed), "--conversations", "--local", "--model", str(snapshot), "--chat-template", str(STOCK)]
    assert pretokenize(directory, *args, "--output", str(tmp_path / "out")) == 0
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith(f"{mixed}:")]
    assert [line.split(":")[1] for line in said] == ["2", "5", "7"], said
    assert TokenDataset(tmp_path / "out").metadata["bad_records"] == 3


def test_a_template_without_marks_is_said_once_in_the_pre_tokenizers_terms(setup, tmp_path, capsys):
    """The server's warning (with its --chat-template NAME=FILE) was printed by every run of the pre-tokenizer of
    a model whose own template has no marks, of texts too."""
    import shutil

    directory, snapshot, *_ = setup
    unmarked = tmp_path / "snapshot"
    shutil.copytree(snapshot, unmarked)
    config = json.loads((unmarked / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["chat_template"] = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    (unmarked / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    texts = tmp_path / "texts.jsonl"
    texts.write_text(json.dumps({"text": "a document"}) + "\n", encoding="utf-8")
    args = ["--local", "--model", str(unmarked)]
    command = [sys.executable, "-m", "tokenizer_service.tools.pretokenize", str(texts), *args, "-q"]
    done = subprocess.run([*command, "--output", str(tmp_path / "texts")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stderr == "", done.stderr  # as the command logs, in a process of its own
    conversations = [str(directory / "chats.jsonl"), "--conversations", *args, "--output", str(tmp_path / "chats")]
    assert pretokenize(directory, *conversations) != 0
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and "=FILE" not in said[0] and "served" not in said[0], said


def test_url_writes_the_same_shards_as_local(setup, local_output, tmp_path):
    directory, snapshot, *_ = setup
    url, process = start_server(
        ["--workers", "1", "--model", f"chat={snapshot}", "--chat-template", f"chat={STOCK}"], tmp_path / "server.log"
    )
    try:
        out = tmp_path / "url"
        code = pretokenize(
            directory, str(directory / "chats.jsonl"), "--conversations", "--url", url, "--model", "chat",
            "--output", str(out),
        )  # fmt: skip
        assert code == 0
    finally:
        stop_server(process)
    for name in ("00000.bin", "00000.idx", "00000.mask"):
        assert (out / name).read_bytes() == (local_output / name).read_bytes(), name
    remote, local = (json.loads((path / "metadata.json").read_text()) for path in (out, local_output))
    assert remote["loss_mask"]["chat_template"]["text"] is None  # a service's template text is not known here
    assert remote["loss_mask"]["chat_template"]["sha256"] == local["loss_mask"]["chat_template"]["sha256"]
    assert remote["bad_records"] == local["bad_records"] == 2
    # verify --sample renders them again with the template given (a service's is not recorded)
    verify = ["verify", str(out), "--sample", "5", "--model", str(snapshot), "--chat-template", str(STOCK)]
    assert shards_cli.main(verify) == 0


def test_sharegpt_and_packed_rows(setup, local_output, tmp_path):
    directory, snapshot, _chats, _, _, expected = setup
    out = tmp_path / "sharegpt"
    args = [str(directory / "sharegpt.jsonl"), "--conversations", "--local", "--model", str(snapshot)]
    args += ["--chat-template", str(STOCK)]
    assert pretokenize(directory, *args, "--output", str(out)) == 0
    assert contents(TokenDataset(out)) == expected
    # packed with concat over several shards: the rows' masks are the documents' masks end to end, cut the same way
    packed = tmp_path / "packed"
    assert pretokenize(directory, *args, "--seq-len", "128", "--shard-tokens", "1024", "--output", str(packed)) == 0
    dataset = TokenDataset(packed)
    assert dataset.num_shards > 2
    stream = np.concatenate([np.asarray(ids) for ids, _ in expected])
    mask = np.concatenate([np.asarray(m) for _, m in expected])
    for row in range(len(dataset)):
        want = slice(row * 128, (row + 1) * 128)
        assert dataset[row].tolist() == stream[want].tolist()
        assert dataset.loss_mask(row).tolist() == mask[want].tolist()
        assert dataset.row(row).labels.tolist() == np.where(mask[want] == 1, stream[want], IGNORE_INDEX).tolist()
    leftover = dataset.metadata["leftover"]
    assert leftover["loss_mask"] == mask[len(dataset) * 128 :].tolist()


def test_prompt_completion_records_as_trl_tokenizes_them(setup, tmp_path):
    directory, snapshot, _, records, tokenizer, _ = setup
    out = tmp_path / "records"
    args = [str(directory / "records.jsonl"), "--prompt-completion", "--local", "--model", str(snapshot)]
    code = pretokenize(directory, *args, "--output", str(out))
    assert code == 0
    dataset = TokenDataset(out)
    assert dataset.metadata["loss_mask"]["input"] == "prompt_completion"
    for index, record in enumerate(records):
        prompt = tokenizer(record["prompt"])["input_ids"]
        full = tokenizer(record["prompt"] + record["completion"] + EOS)["input_ids"]
        common = next(
            (i for i, (a, b) in enumerate(zip(prompt, full, strict=False)) if a != b), min(len(prompt), len(full))
        )
        assert dataset[index].tolist() == full
        assert dataset.loss_mask(index).tolist() == [0] * common + [1] * (len(full) - common)
    assert shards_cli.main(["verify", str(out), "--sample", "20"]) == 0


def test_info_prints_the_trainable_share_and_verify_catches_a_corrupt_mask(setup, local_output, tmp_path, capsys):
    _, _, _, _, _, expected = setup
    trained = sum(sum(mask) for _, mask in expected)
    tokens = sum(len(ids) for ids, _ in expected)
    assert shards_cli.main(["info", str(local_output)]) == 0
    share = f"loss mask: {trained:,} of {tokens:,} tokens stored are trained ({trained / tokens:.1%}"
    assert share in capsys.readouterr().out
    assert shards_cli.main(["verify", str(local_output), "--sample", "30"]) == 0
    assert "24 sampled conversations tokenized again to the same ids and loss masks" in capsys.readouterr().out
    corrupt = tmp_path / "corrupt"
    shutil.copytree(local_output, corrupt)
    mask_file = corrupt / "00000.mask"
    mask_file.chmod(0o644)
    mask = np.fromfile(mask_file, np.uint8)
    offsets = np.concatenate([[0], np.cumsum([len(ids) for ids, _ in expected])])
    flipped = int(offsets[5] + np.flatnonzero(mask[offsets[5] : offsets[6]])[0])
    mask[flipped] = 0
    mask.tofile(mask_file)
    assert shards_cli.main(["verify", str(corrupt)]) == 0  # values 0/1: only re-rendering finds it
    assert shards_cli.main(["verify", str(corrupt), "--sample", "30"]) == 1
    assert "document 5: its loss mask differs" in capsys.readouterr().err
    mask[flipped] = 7
    mask.tofile(mask_file)
    assert shards_cli.main(["verify", str(corrupt)]) == 1
    assert "00000.mask: value 7" in capsys.readouterr().err


def test_mixture_labels_are_ignored_exactly_where_masks_are_zero(setup, local_output, tmp_path):
    _, _, _, _, _, expected = setup
    dataset = TokenDataset(local_output)
    seq_len = 64
    mix = Mixture({"chat": dataset}, seq_len=seq_len, seed=7)
    order = epoch_permutation(len(dataset), 7, "chat", 0)
    stream = np.concatenate([np.asarray(expected[i][0]) for i in order])
    mask = np.concatenate([np.asarray(expected[i][1]) for i in order])
    rows = len(stream) // seq_len
    batch = mix.rows(0, rows)
    assert batch.input_ids.reshape(-1).tolist() == stream[: rows * seq_len].tolist()
    want = np.where(mask[: rows * seq_len] == 1, stream[: rows * seq_len], IGNORE_INDEX)
    assert batch.labels.reshape(-1).tolist() == want.tolist()
    # beside a source without masks: its rows' labels are its ids, the masked source's as above
    texts = write_dataset(tmp_path / "texts", stream, [0, len(stream)], model=dataset.model)
    assert texts.metadata["version"] == 1 and texts.loss_mask(0) is None
    both = Mixture({"chat": dataset, "texts": texts}, seq_len=seq_len, seed=7, weights={"chat": 1, "texts": 1})
    mixed = both.rows(0, 40)
    alone = mix.rows(0, 20)
    chat_rows = mixed.sources == 0
    assert (mixed.labels[~chat_rows] == mixed.input_ids[~chat_rows]).all()
    assert (mixed.labels[chat_rows] == alone.labels[: int(chat_rows.sum())]).all()


def test_exports_refuse_a_masked_dataset_unless_drop_mask(local_output, tmp_path, capsys):
    for to in ("megatron", "nanogpt", "llmc"):  # litdata carries the masks (tests/test_export.py reads them back)
        target = tmp_path / to / "out"
        assert shards_cli.main(["export", str(local_output), "--to", to, "--output", str(target)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "has loss masks" in err and "--drop-mask" in err, err
        assert not (tmp_path / to).exists() or not any((tmp_path / to).iterdir())
    prefix = tmp_path / "megatron" / "chat"
    dropped = ["export", str(local_output), "--to", "megatron", "--output", str(prefix), "--drop-mask", "-q"]
    assert shards_cli.main(dropped) == 0
    assert (tmp_path / "megatron" / "chat.bin").read_bytes() == (local_output / "00000.bin").read_bytes()


def test_outputs_without_masks_are_version_1_and_masked_write_dataset_rows(tmp_path):
    model = {"name": "m", "sha256": "0" * 64, "vocab_size": 100, "bos_id": -1, "eos_id": 1, "pad_id": 0}
    ids = np.arange(2, 42) % 100
    offsets = [0, 10, 25, 40]
    plain = write_dataset(tmp_path / "plain", ids, offsets, model=model)
    assert plain.metadata["version"] == 1 and "loss_mask" not in plain.metadata
    assert plain.loss_mask(0) is None and plain.mask_range(0, 5) is None
    assert not any(path.suffix == ".mask" for path in (tmp_path / "plain").iterdir())
    # a version 1 output as an earlier release wrote it (its idx header is the same) still reads
    meta = json.loads((tmp_path / "plain" / "metadata.json").read_text())
    assert meta["version"] == 1 and TokenDataset(tmp_path / "plain")[1].tolist() == ids[10:25].tolist()
    mask = (np.arange(40) % 3 == 0).astype(np.uint8)
    packed = write_dataset(
        tmp_path / "packed", ids, offsets, model=model, seq_len=16, strategy="best_fit", loss_mask=mask
    )
    assert packed.metadata["version"] == 2
    seen = 0
    for row in range(len(packed)):
        stored = packed.row(row)
        used = int(stored.cu_seqlens[-1])
        assert (packed.loss_mask(row)[used:] == 0).all()  # padding
        assert ((stored.labels == IGNORE_INDEX) == (packed.loss_mask(row) == 0)).all()
        seen += int(packed.loss_mask(row).sum())
    assert seen == int(mask.sum())


@pytest.mark.parametrize("weight", [2, 0.5, "0", True, None])
def test_a_sharegpt_weight_is_0_or_1_or_the_record_is_bad(weight):
    """axolotl's `weight` trains a turn (1) or not (0); any other value was ignored without a word, and the turn
    trained."""
    from tokenizer_service.tools.pretokenize.sources import from_sharegpt

    assert from_sharegpt({"from": "gpt", "value": "x", "weight": 0}, 1) == {
        "role": "assistant",
        "content": "x",
        "train": False,
    }
    assert from_sharegpt({"from": "human", "value": "q", "weight": 1}, 0) == {"role": "user", "content": "q"}
    message = {"from": "gpt", "value": "x", "weight": weight}
    if weight is None:
        assert from_sharegpt(message, 1) == {"role": "assistant", "content": "x"}
        return
    with pytest.raises(ValueError, match=r"messages\[1\]: 'weight' .* is not 0 or 1"):
        from_sharegpt(message, 1)
