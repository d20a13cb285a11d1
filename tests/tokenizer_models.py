"""Hugging Face and tiktoken models trained at test time from the repository's text, as they are shipped.

- ``bpe/``: a byte-level BPE ``tokenizer.json`` as Llama 3 and Qwen ship theirs (a split pattern, then
  byte-level), with special tokens, one ordinary added token, a post-processor that adds BOS (which
  ``add_special_tokens=False`` leaves out) and a ``tokenizer_config.json`` naming BOS, EOS (as an
  AddedToken object) and PAD: a Hub snapshot directory.
- ``unigram.json``: NFKC, Metaspace and a unigram model, as T5-style tokenizers are.
- ``wordpiece.json``: BERT's normalizer, pre-tokenizer and WordPiece.
- ``ranks.tiktoken``: the byte-level BPE's ranks as a tiktoken file, with ``ranks.tiktoken.json``.
- ``wide/``: a byte-level BPE with 70,000 added tokens: a vocabulary over 65,536 (int32 ids downstream).
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

# The split pattern of cl100k_base (and Llama 3): what the byte-level BPE and the tiktoken file use.
PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"""
    r"""\s+(?!\S)|\s+"""
)
BPE_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|pad|>", "<|start_header_id|>", "<|end_header_id|>"]
ADDED = "<tool_call>"  # an added token that is not special: it matches in both special-token modes
TIKTOKEN_SPECIAL = ["<|endoftext|>", "<|fim_prefix|>"]
WIDE_EXTRA = 70_000


def training_texts(documents: list[str], multilingual: list[str]) -> list[str]:
    return documents + multilingual


def byte_level_bpe(texts: list[str], vocab_size: int) -> Tokenizer:
    return _byte_level_bpe(texts, vocab_size, BPE_SPECIAL)


def byte_level_bpe_without_specials(texts: list[str], vocab_size: int) -> Tokenizer:
    """Trained without special tokens (ids 0..n-1 all the vocabulary's), as Llama 3's: add them after."""
    return _byte_level_bpe(texts, vocab_size, [])


def _byte_level_bpe(texts: list[str], vocab_size: int, special: list[str]) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def write_bpe_snapshot(directory: Path, texts: list[str]) -> Path:
    tokenizer = byte_level_bpe(texts, 3000)
    tokenizer.add_tokens([AddedToken(ADDED, special=False)])
    bos = tokenizer.token_to_id(BPE_SPECIAL[0])
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BPE_SPECIAL[0]} $A", special_tokens=[(BPE_SPECIAL[0], bos)]
    )
    directory.mkdir(parents=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {
        "bos_token": BPE_SPECIAL[0],
        "eos_token": {"__type": "AddedToken", "content": BPE_SPECIAL[1], "lstrip": False, "rstrip": False},
        "pad_token": BPE_SPECIAL[2],
        "model_max_length": 131072,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def write_unigram(path: Path, texts: list[str]) -> Path:
    tokenizer = Tokenizer(models.Unigram())
    tokenizer.normalizer = normalizers.NFKC()
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.UnigramTrainer(
        vocab_size=1500,
        special_tokens=["<unk>", "<s>", "</s>"],
        unk_token="<unk>",
        show_progress=False,
        shrinking_factor=0.5,  # fewer, coarser EM rounds: 3 CPU-seconds instead of 12, a unigram model all the same
        n_sub_iterations=1,
    )
    tokenizer.train_from_iterator(texts[-600:], trainer)  # the multilingual ones and some English
    tokenizer.save(str(path))
    return path


def write_wordpiece(path: Path, texts: list[str]) -> Path:
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(
        vocab_size=2000, special_tokens=["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"], show_progress=False
    )
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.save(str(path))
    return path


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, which byte-level BPE vocabularies are written in."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


def write_tiktoken(path: Path, texts: list[str]) -> Path:
    """A byte-level BPE's ranks as a .tiktoken file (ranks in id order, from 0), and its sidecar."""
    tokenizer = byte_level_bpe(texts, 2500)
    decode = {char: byte for byte, char in bytes_to_unicode().items()}
    special = set(BPE_SPECIAL)
    vocabulary = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    tokens = [bytes(decode[char] for char in token) for token, _ in vocabulary if token not in special]
    path.write_text("".join(f"{base64.b64encode(raw).decode()} {rank}\n" for rank, raw in enumerate(tokens)))
    sidecar = {
        "pat_str": PATTERN,
        "special_tokens": {token: len(tokens) + index for index, token in enumerate(TIKTOKEN_SPECIAL)},
        "bos_token": None,
        "eos_token": TIKTOKEN_SPECIAL[0],
        "pad_token": None,
    }
    Path(f"{path}.json").write_text(json.dumps(sidecar))
    return path


def write_wide(directory: Path, texts: list[str]) -> Path:
    tokenizer = byte_level_bpe(texts, 1000)
    tokenizer.add_tokens([f"<extra_{index}>" for index in range(WIDE_EXTRA)])
    directory.mkdir(parents=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": BPE_SPECIAL[1]}))
    return directory


def write_all(directory: Path, documents: list[str], multilingual: list[str]) -> dict[str, Path]:
    texts = training_texts(documents, multilingual)
    return {
        "hfbpe": write_bpe_snapshot(directory / "hfbpe", texts),
        "hfuni": write_unigram(directory / "unigram.json", texts),
        "hfwp": write_wordpiece(directory / "wordpiece.json", texts),
        "tt": write_tiktoken(directory / "ranks.tiktoken", texts),
    }
