"""Conversations through a real server (issue 31): /v1/tokenize (JSON and binary), /v1/pack's labels, /v1/models,
the client, and every refusal a 4xx that names the conversation and message while the server stays up."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.chat_models import conversations, write_chat_snapshot
from tests.conftest import start_server, stop_server
from tokenizer_client import TokenizerClient, TokenizerServiceError
from tokenizer_client.packing import IGNORE_INDEX
from tokenizer_service.core import chat

transformers = pytest.importorskip("transformers")

UNKNOWN = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"


@pytest.fixture(scope="module")
def chat_server(tmp_path_factory, documents, multilingual):
    directory = tmp_path_factory.mktemp("chat-server")
    snapshot = write_chat_snapshot(directory / "chat", documents[:2000] + multilingual)
    unknown = directory / "unknown.jinja"
    unknown.write_text(UNKNOWN)
    log = directory / "server.log"
    url, process = start_server(
        [
            "--workers", "2",
            "--model", f"chat={snapshot}",
            "--model", f"bare={snapshot}",
            "--model", f"unknown={snapshot}",
            "--chat-template", f"chat={chat.CATALOGUE / 'qwen3.jinja'}",
            "--chat-template", f"unknown={unknown}",
            "--default-model", "chat",
        ],
        log,
    )  # fmt: skip
    yield url, snapshot, log
    stop_server(process)


def reference(snapshot: Path, conversation):
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(snapshot / "tokenizer.json"), eos_token="<|im_end|>"
    )
    training = (chat.CATALOGUE / "qwen3_training.jinja").read_text(encoding="utf-8")
    out = tokenizer.apply_chat_template(
        conversation, chat_template=training, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    return list(out["input_ids"]), list(out["assistant_masks"])


def deep(levels: int) -> object:
    value: object = "leaf"
    for _ in range(levels):
        value = {"a": [value]} if isinstance(value, str) else [value]
    return value


def test_models_announce_their_chat_templates_and_the_start_log_says_which_cannot_train(chat_server):
    url, _, log = chat_server
    models = {m["name"]: m for m in httpx.get(f"{url}/v1/models").json()["models"]}
    assert models["chat"]["chat_template"]["loss_mask"] == "catalogue:qwen3"
    assert models["chat"]["chat_template"]["source"] == "flag"
    assert models["bare"]["chat_template"] is None
    assert models["unknown"]["chat_template"]["loss_mask"] is None
    assert models["chat"]["sha256"] != models["bare"]["sha256"]  # the template's bytes join the sha256
    lines = [line for line in log.read_text().splitlines() if "--chat-template unknown=FILE" in line]
    assert len(lines) == 1


def test_tokenize_json_and_binary_equal_transformers(chat_server, multilingual):
    url, snapshot, _ = chat_server
    batch = [c for c in conversations(multilingual, 16) if any(reference(snapshot, c)[1])]
    want = [reference(snapshot, c) for c in batch]
    with TokenizerClient(url) as client:
        for format in ("binary", "json"):
            got = client.tokenize_conversations(batch, format=format)
            assert [(ids.tolist(), mask.tolist()) for ids, mask in got] == want
    body = httpx.post(f"{url}/v1/tokenize", json={"conversations": batch[:2]}).json()
    assert body["ids"] == [want[0][0], want[1][0]] and body["loss_mask"] == [want[0][1], want[1][1]]
    assert body["lengths"] == [len(want[0][0]), len(want[1][0])]


def test_pack_labels_carry_the_mask_and_the_carry_keeps_it(chat_server, multilingual):
    url, snapshot, _ = chat_server
    batch = [c for c in conversations(multilingual, 12) if any(reference(snapshot, c)[1])]
    want = [reference(snapshot, c) for c in batch]
    ids = np.concatenate([np.array(i) for i, _ in want])
    mask = np.concatenate([np.array(m) for _, m in want])
    seq_len = 64
    rows_ids, rows_labels, carry, carry_mask, starts = [], [], None, None, None
    for half in (batch[: len(batch) // 2], batch[len(batch) // 2 :]):
        payload = {"conversations": half, "seq_len": seq_len}
        if carry is not None:
            payload |= {"carry": carry, "carry_loss_mask": carry_mask, "carry_document_starts": starts}
        answer = httpx.post(f"{url}/v1/pack", json=payload).json()
        rows_ids += answer["input_ids"]
        rows_labels += answer["labels"]
        carry, carry_mask, starts = answer["leftover"], answer["leftover_loss_mask"], answer["leftover_document_starts"]
    used = len(rows_ids) * seq_len
    assert np.array(rows_ids).reshape(-1).tolist() == ids[:used].tolist()
    expected = np.where(mask[:used] == 1, ids[:used], IGNORE_INDEX)
    assert np.array(rows_labels).reshape(-1).tolist() == expected.tolist()
    assert carry == ids[used:].tolist() and carry_mask == mask[used:].tolist()
    # a probe's: the carry sent back without its mask trained on every carried id, prompts too (200)
    refused = httpx.post(f"{url}/v1/pack", json={"conversations": batch[:1], "seq_len": seq_len, "carry": carry})
    assert refused.status_code == 422 and refused.json()["error"]["field"] == "carry_loss_mask", refused.text
    assert "leftover_loss_mask" in refused.json()["error"]["message"]
    best = httpx.post(f"{url}/v1/pack", json={"conversations": batch, "seq_len": 512, "strategy": "best_fit"}).json()
    labels = np.array(best["labels"])
    assert (labels != IGNORE_INDEX).sum() == mask.sum()


def test_records_through_the_service(chat_server):
    from tokenizers import Tokenizer

    url, snapshot, _ = chat_server
    eos = Tokenizer.from_file(str(snapshot / "tokenizer.json")).token_to_id("<|im_end|>")
    with TokenizerClient(url) as client:
        ((ids, mask),) = client.tokenize_records([{"prompt": "Question: why?", "completion": " Because."}])
    assert ids.dtype == np.int32 and ids[-1] == eos  # TRL appends the EOS to the completion
    assert mask[-1] == 1 and mask[0] == 0 and mask.sum() >= 2  # the completion and its EOS are trained


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        (
            {"conversations": [[{"role": "user", "content": "a"}, {"content": "b"}]]},
            422,
            r"conversations\[0\]\.messages\[1\] has no role",
        ),
        (
            {"conversations": [[{"role": "user", "content": 7}]]},
            422,
            r"conversations\[0\]\.messages\[0\]\.content must be",
        ),
        (
            {"conversations": [[{"role": "user", "content": "question only"}]]},
            422,
            r"conversations\[0\] has no token to train on",
        ),
        (
            {"conversations": [[{"role": "user", "content": "x"}] * 100_000]},
            413,
            r"conversations\[0\] has 100,000 messages",
        ),
        (
            {"conversations": [[{"role": "user", "content": "x"}]], "add_eos": True},
            422,
            r"add_eos cannot be used with conversations",
        ),
        ({"conversations": [], "texts": ["a"]}, 422, r"exactly one of texts, conversations and records"),
        (
            {
                "conversations": [[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]],
                "model": "bare",
            },
            422,
            r"model 'bare' has no chat template; pass --chat-template bare=FILE",
        ),
        (
            {
                "conversations": [[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]],
                "model": "unknown",
            },
            422,
            r"pass --chat-template unknown=FILE",
        ),
        ({"records": [{"prompt": "a"}]}, 422, r"records\[0\] must be"),
        (  # orjson writes 254 levels at most, Jinja's tojson and Python's recursion about 1,000: refused at 64
            {
                "conversations": [
                    [{"role": "user", "content": "a", "x": deep(100)}, {"role": "assistant", "content": "b"}]
                ]
            },
            422,
            r"conversations\[0\]\.messages\[0\] nests deeper than 64 levels",
        ),
        (  # json.dumps writes NaN, which is no JSON
            {"conversations": [[{"role": "user", "content": "a", "x": float("nan")}]]},
            400,
            r"NaN is no JSON number",
        ),
    ],
)
def test_bad_conversations_are_4xx_naming_where_and_the_server_stays_up(chat_server, body, status, message):
    import re

    url, _, _ = chat_server
    content = json.dumps(body)  # the stdlib's: it writes NaN, as some clients do
    answer = httpx.post(
        f"{url}/v1/tokenize", content=content, headers={"content-type": "application/json"}, timeout=120
    )
    assert answer.status_code == status, answer.text
    assert re.search(message, answer.json()["error"]["message"]), answer.json()
    assert httpx.post(f"{url}/v1/tokenize", json={"texts": ["still up"]}).status_code == 200


def test_integers_beyond_64_bits_render_as_transformers_renders_them(chat_server):
    """orjson reads 100000000000000000000 as 1e+20 and cannot write a 309-digit integer back: a body holding one
    in its conversations is read by the stdlib, exactly, as a user's json.loads reads it."""
    url, snapshot, _ = chat_server
    for number in (10**20, 10**308 + 7, -(2**64)):
        call = {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": number}}}
        conversation = [
            {"role": "user", "content": "add them"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
        ]
        answer = httpx.post(f"{url}/v1/tokenize", json={"conversations": [conversation]}, timeout=60)
        assert answer.status_code == 200, answer.text
        ids, mask = reference(snapshot, conversation)
        assert answer.json()["ids"] == [ids] and answer.json()["loss_mask"] == [mask], number


def test_the_client_error_names_the_conversation(chat_server):
    url, _, _ = chat_server
    with TokenizerClient(url) as client, pytest.raises(TokenizerServiceError, match=r"conversations\[1\]") as caught:
        client.tokenize_conversations(
            [[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], [{"role": "user"}]]
        )
    assert caught.value.status == 422
