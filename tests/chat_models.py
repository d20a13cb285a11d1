# ruff: noqa: RUF001, RUF002  (DeepSeek's real control tokens are spelled with full-width vertical bars, on purpose)
"""A chat model trained at test time, with the special tokens real chat models ship, and conversations to test on.

``write_chat_snapshot`` trains a byte-level BPE ``tokenizer.json`` (Llama 3 / Qwen style: a split pattern,
then byte-level) on the repository's text and adds the control tokens of the template families of TRL's
catalogue (``<|im_start|>``, ``<|eot_id|>``, ``<start_of_turn>``, DeepSeek's ``<｜User｜>``, ...) as special
tokens, and ``<think>``/``</think>`` as ordinary added tokens (as Qwen 3 and DeepSeek-R1 ship them).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken

from tests.tokenizer_models import byte_level_bpe

CONTROL = [
    "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>",
    "<|user|>", "<|assistant|>", "<|system|>", "<|end|>", "<|tool|>",
    "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
    "<|START_OF_TURN_TOKEN|>", "<|END_OF_TURN_TOKEN|>", "<|USER_TOKEN|>", "<|CHATBOT_TOKEN|>", "<|SYSTEM_TOKEN|>",
    "<BOS_TOKEN>", "<|startoftext|>", "<|return|>", "<|start|>", "<|message|>", "<|channel|>",
]  # fmt: skip
ORDINARY = ["<think>", "</think>"]

# TRL catalogue family -> (bos_token, eos_token) as those models' tokenizer_config.json name them
FAMILIES: dict[str, tuple[str | None, str]] = {
    "qwen2_5": (None, "<|im_end|>"),
    "qwen3": (None, "<|im_end|>"),
    "qwen3_instruct_2507": (None, "<|im_end|>"),
    "llama3": ("<|begin_of_text|>", "<|eot_id|>"),
    "gemma": ("<bos>", "<eos>"),
    "gemma3": ("<bos>", "<eos>"),
    "phi3": ("<|endoftext|>", "<|end|>"),
    "phi3_5": ("<|endoftext|>", "<|end|>"),
    "deepseekv3": ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
    "deepseek_r1_distill": ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
    "cohere": ("<BOS_TOKEN>", "<|END_OF_TURN_TOKEN|>"),
    "glm4moe": (None, "<|endoftext|>"),
    "lfm2": ("<|startoftext|>", "<|im_end|>"),
}


def write_chat_snapshot(directory: Path, texts: list[str], eos: str = "<|im_end|>") -> Path:
    """A Hub-like snapshot: tokenizer.json and a tokenizer_config.json naming EOS (no chat template)."""
    tokenizer = byte_level_bpe(texts, 4000)
    tokenizer.add_special_tokens([AddedToken(token, special=True) for token in CONTROL])
    tokenizer.add_tokens([AddedToken(token, special=False) for token in ORDINARY])
    directory.mkdir(parents=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos}))
    return directory


def conversations(multilingual: list[str], count: int = 24) -> list[list[dict[str, Any]]]:
    """Multi-turn multilingual conversations: system prompts, empty and whitespace-only content, a final user turn."""
    out: list[list[dict[str, Any]]] = []
    for index in range(count):
        messages: list[dict[str, Any]] = []
        if index % 3 == 0:
            messages.append(
                {"role": "system", "content": "You answer briefly. " + multilingual[index % len(multilingual)][:80]}
            )
        for turn in range(1 + index % 3):
            messages.append({"role": "user", "content": multilingual[(index + turn) % len(multilingual)][:240]})
            answer = multilingual[(index + turn + 11) % len(multilingual)][:320]
            if index % 7 == 3 and turn == 0:
                answer = ""
            elif index % 7 == 5 and turn == 0:
                answer = "  \n "
            messages.append({"role": "assistant", "content": answer})
        if index % 5 == 4:
            messages.append({"role": "user", "content": "and one more question?"})
        out.append(messages)
    return out
