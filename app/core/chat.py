"""Conversations: a model's chat template, rendered as transformers renders it, and which tokens are trained.

Where a model's template comes from (first match wins; `find_template`): ``--chat-template NAME=FILE``;
``chat_template.jinja`` beside a ``tokenizer.json``; ``tokenizer_config.json``'s ``chat_template`` (a string,
or a list of ``{name, template}``: the one named ``default``). Its bytes join the model's sha256.

Which tokens are trained (`resolve`):

1. the template's own ``{% generation %}`` marks;
2. else its training version from TRL's catalogue (app/core/catalogue/, vendored from trl by
   scripts/vendor_trl_catalogue.py), matched by the template's exact text as
   ``trl.chat_template_utils.get_training_chat_template`` matches it; conversations are then rendered with
   the training version, as TRL's SFT trainer does with ``assistant_only_loss=True``;
3. else none: a conversation request for that model is refused, never answered with an all-zero mask.

Ids and masks (`ChatTemplate.encode`) are transformers' ``apply_chat_template(conversation,
chat_template=T, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)``: the conversation is
rendered by transformers' own Jinja environment (``render_jinja_template``: its filters, globals and the
``{% generation %}`` tracker), the text is tokenized with special-token strings parsed, and a token is trained
when its characters overlap a generation span. One deliberate difference: special-token strings inside a
message's *content* are ordinary text (training data must not inject control tokens) unless
``parse_special_tokens``; only the strings the template itself writes are control tokens.

Token offsets come without a second encode where the model is lossless byte-level BPE (tiktoken ranks, a
byte-level ``tokenizer.json`` with no normalizer): the ids' byte lengths, summed, are the offsets, and the
sum must equal the text's length (else the reference library's offsets are used). The conversations of a
request are then encoded in one batch and masked in bytes (the generation spans turned into bytes; a token's
bytes overlap a span's exactly when its characters do). Otherwise (SentencePiece, a normalizing
``tokenizer.json``) the reference library gives ids and character offsets together.

The template is compiled once per worker in transformers' environment and rendered by transformers' own
inner steps (`_compile` says which lookups are made cheaper there, none of them changing what renders).

Prompt-completion records (``{"prompt", "completion"}``) are tokenized as TRL's SFT trainer does for plain
text: ``tok(prompt)`` and ``tok(prompt + completion + eos)`` (EOS appended unless the completion ends with
it), the mask covering what follows their common prefix.

Nothing here knows HTTP: refusals are InvalidField / PayloadTooLarge naming the conversation and message.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MethodType
from typing import Any

import numpy as np
import orjson

from tokenizer_service.core.errors import InvalidField, PayloadTooLarge
from tokenizer_service.core.models import (
    TEKKEN,
    TIKTOKEN,
    TOKENIZERS,
    ModelLoadError,
    TemplateFile,
    hf_special_tokens,
    tiktoken_ranks,
)

CATALOGUE = Path(__file__).resolve().parent / "catalogue"
GENERATION_TAG = re.compile(r"\{\%-?\s*generation\s*-?\%\}")  # transformers' own test for the marks
TRAIN_ON = ("assistant", "last")
MAX_MESSAGES = 8192  # per conversation


# -- which tokens are trained -------------------------------------------------------------------------------


@functools.cache
def catalogue() -> dict[str, tuple[str, str]]:
    """TRL's catalogue: a stock template's exact text -> (its name, its training version's text)."""
    pairs = {}
    for training in sorted(CATALOGUE.glob("*_training.jinja")):
        name = training.name.removesuffix("_training.jinja")
        stock = CATALOGUE / f"{name}.jinja"
        if stock.is_file():
            pairs[stock.read_text(encoding="utf-8")] = (name, training.read_text(encoding="utf-8"))
    return pairs


@dataclass(frozen=True)
class Resolved:
    """What a model renders conversations with, and where its loss mask comes from."""

    text: str  # the template rendered: the model's own, or the catalogue's training version
    loss_mask: str | None  # "template" | "catalogue:<name>" | None (conversations are refused)


def resolve(template: TemplateFile) -> Resolved:
    if GENERATION_TAG.search(template.text):
        return Resolved(template.text, "template")
    known = catalogue().get(template.text)
    if known is not None:
        name, training = known
        return Resolved(training, f"catalogue:{name}")
    return Resolved(template.text, None)


def announce(template: TemplateFile | None) -> dict[str, Any] | None:
    """`/v1/models`' `chat_template`: null, or its sha256, source and where its loss mask comes from."""
    if template is None:
        return None
    return {
        "sha256": hashlib.sha256(template.text.encode("utf-8")).hexdigest(),
        "source": template.source,
        "loss_mask": resolve(template).loss_mask,
    }


def check_syntax(template: TemplateFile) -> str | None:
    """None when transformers' Jinja environment compiles the template (and its training version), else why not."""
    from jinja2 import TemplateSyntaxError
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        _compile_jinja_template(resolve(template).text)
    except TemplateSyntaxError as exc:
        return f"the chat template {template.path} is not valid Jinja (line {exc.lineno}: {exc.message})"
    return None


def no_mask_message(model: str) -> str:
    return (
        f"model {model!r}: its chat template has no {{% generation %}} marks and is not in TRL's catalogue of "
        "templates, so the tokens to train on are unknown; pass --chat-template "
        f"{model}=FILE with a template that marks the assistant's output with {{% generation %}}"
    )


# -- tokens and their character offsets, per library ------------------------------------------------------


def _bytes_to_unicode() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte (what byte-level BPE vocabularies are written in)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}


def _uses(component: Any, kind: str) -> bool:
    if not isinstance(component, dict):
        return False
    if component.get("type") == kind:
        return True
    return any(_uses(part, kind) for part in component.get("pretokenizers", component.get("decoders", [])) or [])


def _byte_lengths_tokenizers(document: dict[str, Any], vocab_size: int) -> np.ndarray | None:
    """Byte length of each id of a lossless byte-level tokenizer.json (None when it is not one)."""
    model = document.get("model", {})
    if (
        document.get("normalizer") is not None
        or model.get("type") not in (None, "BPE")
        or not _uses(document.get("decoder"), "ByteLevel")
        or not _uses(document.get("pre_tokenizer"), "ByteLevel")
    ):
        return None
    pre = document["pre_tokenizer"]
    parts = pre.get("pretokenizers", [pre]) if isinstance(pre, dict) else []
    if any(part.get("type") == "ByteLevel" and part.get("add_prefix_space") for part in parts):
        return None
    alphabet = _bytes_to_unicode()
    lengths = np.full(vocab_size, -1, dtype=np.int64)
    for token, index in (model.get("vocab") or {}).items():
        if 0 <= index < vocab_size:
            if any(char not in alphabet for char in token):
                return None
            lengths[index] = len(token)
    for added in document.get("added_tokens") or []:  # with no normalizer, matched as the text's own characters
        if 0 <= added["id"] < vocab_size:
            lengths[added["id"]] = len(added["content"].encode("utf-8"))
    return lengths


def _char_offsets(text: str, byte_ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Character (start, end) of tokens whose byte ends in `text`'s UTF-8 are `byte_ends` (tokenizers' rule:
    a token that covers part of a character covers that whole character)."""
    if not len(byte_ends):
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    starts = np.concatenate([[0], byte_ends[:-1]]).astype(np.int64)
    ends = byte_ends.astype(np.int64)
    points = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype="<u4")
    if len(points) == int(byte_ends[-1]) if len(byte_ends) else True:  # ASCII: bytes are characters
        return starts, ends
    widths = 1 + (points >= 0x80) + (points >= 0x800) + (points >= 0x10000)
    char_of_byte = np.repeat(np.arange(len(points), dtype=np.int64), widths)
    char_of_byte = np.append(char_of_byte, len(points))
    first = char_of_byte[starts]
    last = np.where(ends > starts, char_of_byte[np.maximum(ends - 1, 0)] + 1, first)
    return first, last


def _byte_spans(text: str, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Character spans of `text` as UTF-8 byte spans (in order: one pass over the text up to the last span)."""
    if text.isascii():
        return spans
    out, previous, total = [], 0, 0
    for start, end in spans:
        if start < previous:  # out of order (nested generation blocks): each position on its own
            return [(len(text[:start].encode("utf-8")), len(text[:end].encode("utf-8"))) for start, end in spans]
        first = total + len(text[previous:start].encode("utf-8"))
        total = first + len(text[start:end].encode("utf-8"))
        out.append((first, total))
        previous = end
    return out


# What an added token's lstrip/rstrip takes (tokenizers: Rust's char::is_whitespace, Unicode's White_Space), which
# Python's \s and str.strip() exceed by U+001C..U+001F
WHITE_SPACE_CHARACTERS = (
    "\t\n\x0b\x0c\r \x85\xa0\u1680" + "".join(map(chr, range(0x2000, 0x200B))) + "\u2028\u2029\u202f\u205f\u3000"
)
WHITE_SPACE = "[" + re.escape(WHITE_SPACE_CHARACTERS) + "]"


# An added token put before a segment of a rendered text so that tokenizers encodes it as it does a part after an
# added token (Tokens._segments): private-use characters no template writes
SENTINEL = "\U000ff8f1\U000ff8f2\U000ff8f3"


class Tokens:
    """A model's ids and character offsets of texts, and its special-token strings (what the template writes)."""

    def __init__(self, library: Any) -> None:
        self.library = library
        self.kind = library.library
        self.byte_lengths: np.ndarray | None = None
        self._follower_tokenizer: tuple[Any, int] | None = None
        self.strip: dict[str, tuple[bool, bool]] = {}  # special string -> (lstrip, rstrip), tokenizers only
        if self.kind == TOKENIZERS:
            document = json.loads(library.files.contents[0])
            added = document.get("added_tokens") or []
            self.special = {token["content"]: token["id"] for token in added if token.get("special")}
            self.strip = {
                token["content"]: (bool(token.get("lstrip")), bool(token.get("rstrip")))
                for token in added
                if token.get("special")
            }
            self.byte_lengths = _byte_lengths_tokenizers(document, library.vocab_size)
        elif self.kind == TIKTOKEN:
            self.special = dict(library.spec.special_tokens)
            lengths = np.full(library.vocab_size, -1, dtype=np.int64)
            for token, rank in tiktoken_ranks(library.files.contents[0], library.files.main).items():
                lengths[rank] = len(token)
            for token, rank in self.special.items():
                lengths[rank] = len(token.encode("utf-8"))
            self.byte_lengths = lengths
        elif (
            self.kind == TEKKEN
        ):  # a tiktoken encoding, its special tokens first (tokenizer_service.core.libraries.Tekken)
            self.kind = TIKTOKEN
            self.special = {token: index for index, token in enumerate(library.spec.special)}
            lengths = np.full(library.vocab_size, -1, dtype=np.int64)
            for token, rank in library.spec.ranks().items():
                lengths[rank] = len(token)
            for token, rank in self.special.items():
                lengths[rank] = len(token.encode("utf-8"))
            self.byte_lengths = lengths
        else:  # sentencepiece: its control pieces (<s>, </s>, ...), which it never matches in text itself
            processor = library.processor
            self.special = {
                processor.id_to_piece(i): i for i in range(processor.get_piece_size()) if processor.is_control(i)
            }
        self._pattern = self._special_pattern()
        self._any = re.compile("|".join(re.escape(token) for token in self.special)) if self.special else None
        # a few special tokens: each looked for as bytes in the messages' JSON (a substring search each, faster
        # than the regex's alternation; UTF-8 bytes hold a string's bytes exactly where the text holds the string)
        self._needles = [token.encode("utf-8") for token in self.special] if len(self.special) <= 16 else None
        # every special-token string appears as itself in JSON (no character JSON escapes): one search of the
        # messages' JSON finds whether any is in a conversation
        self.json_safe = all(json.dumps(token, ensure_ascii=False)[1:-1] == token for token in self.special)

    def _special_pattern(self) -> re.Pattern[str] | None:
        if not self.special:
            return None
        alternatives = []
        for token in sorted(self.special, key=len, reverse=True):
            lstrip, rstrip = self.strip.get(token, (False, False))
            alternatives.append(
                (f"{WHITE_SPACE}*" if lstrip else "") + re.escape(token) + (f"{WHITE_SPACE}*" if rstrip else "")
            )
        return re.compile("|".join(f"({alternative})" for alternative in alternatives))

    @property
    def splits_always(self) -> bool:
        """SentencePiece never matches control pieces in text: the template's are found here, always."""
        return self.kind not in (TOKENIZERS, TIKTOKEN)

    def encode(self, texts: list[str], parse_special: bool) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """(ids, char starts, char ends) of each text, exactly the library's ids."""
        if not texts:
            return []
        if self.byte_lengths is not None:
            ids, lengths = self.library.encode_plain(texts, parse_special)
            out, offset = [], 0
            for text, length in zip(texts, lengths.tolist(), strict=True):
                row = ids[offset : offset + length]
                offset += length
                widths = self.byte_lengths[row]
                byte_ends = np.cumsum(widths)
                if (widths < 0).any() or (int(byte_ends[-1]) if length else 0) != len(text.encode("utf-8")):
                    out.append(self._reference([text], parse_special)[0])
                    continue
                starts, ends = _char_offsets(text, byte_ends)
                out.append((row.astype(np.int32), starts, ends))
            return out
        return self._reference(texts, parse_special)

    def encode_masked(
        self, texts: list[str], spans: list[list[tuple[int, int]]], parse_special: bool
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(flat ids, lengths, flat mask) of a batch: 1 on each token overlapping one of its text's `spans`
        (character offsets, sorted), transformers' rule. For lossless byte-level models the rule is applied in
        bytes (a token's bytes overlap a span's bytes exactly when its characters overlap the span's), so no
        character offset of any token is built: a few numpy passes over the batch, spans turned into bytes."""
        if self.byte_lengths is not None and texts:
            ids, lengths = self.library.encode_plain(texts, parse_special)
            widths = self.byte_lengths[ids]
            ends = np.cumsum(widths)
            offsets = np.concatenate([[0], np.cumsum(lengths)])
            sizes = np.fromiter((len(text.encode("utf-8")) for text in texts), dtype=np.int64, count=len(texts))
            starts_of_texts = np.concatenate([[0], np.cumsum(sizes)])
            # every token at least one byte, each text's tokens exactly its bytes: else text by text, in characters
            if (widths > 0).all() and (np.concatenate([[0], ends])[offsets] == starts_of_texts).all():
                byte_spans = np.array(
                    [
                        (base + start, base + end)
                        for base, text, chosen in zip(starts_of_texts.tolist(), texts, spans, strict=False)
                        for start, end in _byte_spans(text, chosen)
                    ],
                    dtype=np.int64,
                ).reshape(-1, 2)
                return ids.astype(np.int32), lengths, _covered(ends - widths, ends, byte_spans)
            rows = self.encode(texts, parse_special)
        else:
            rows = self._reference(texts, parse_special)
        flat, lengths, starts, ends = _flat(rows, texts)
        shift = np.concatenate([[0], np.cumsum([len(text) for text in texts])]).astype(np.int64)
        char_spans = np.array(
            [(start + shift[i], end + shift[i]) for i, chosen in enumerate(spans) for start, end in chosen],
            dtype=np.int64,
        ).reshape(-1, 2)
        return flat, lengths, overlap_mask(starts, ends, char_spans)

    def _reference(self, texts: list[str], parse_special: bool) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        if self.kind == TOKENIZERS:
            reference = self.library.reference
            reference.encode_special_tokens = not parse_special
            out = []
            for encoding in reference.encode_batch(texts, add_special_tokens=False):
                offsets = np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2)
                out.append((np.asarray(encoding.ids, dtype=np.int32), offsets[:, 0], offsets[:, 1]))
            return out
        if self.kind == TIKTOKEN:
            reference = self.library.reference
            out = []
            for text in texts:
                ids = (
                    reference.encode(text, allowed_special="all") if parse_special else reference.encode_ordinary(text)
                )
                widths = np.array([len(reference.decode_single_token_bytes(i)) for i in ids], dtype=np.int64)
                starts, ends = _char_offsets(text, np.cumsum(widths)) if ids else (np.zeros(0, np.int64),) * 2
                out.append((np.asarray(ids, dtype=np.int32), starts, ends))
            return out
        out = []
        for text in texts:
            proto = _sentencepiece_proto(self.library.processor, text)
            ids = np.array([piece.id for piece in proto.pieces], dtype=np.int32)
            begins = np.array([piece.begin for piece in proto.pieces], dtype=np.int64)
            ends = np.array([piece.end for piece in proto.pieces], dtype=np.int64)
            _byte_pieces_span_their_character(self.library.processor, ids, begins, ends)
            out.append((ids, *_bytes_to_chars(text, begins, ends)))
        return out

    def _segments(
        self, segments: list[str], at_start: list[bool], parse_special: bool
    ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Each segment of a rendered text encoded as the library encodes it in the whole text. tokenizers treats
        a part after an added token otherwise than a text of its own (a Metaspace pre-tokenizer with
        prepend_scheme "first" puts its "▁" before the text's first part only): each segment but one at the
        text's start is encoded after a sentinel added token (`_follower`), whose id is then dropped."""
        if self.kind != TOKENIZERS or all(at_start):
            return self.encode(segments, parse_special)
        rows = iter(
            self.encode([segment for segment, first in zip(segments, at_start, strict=True) if first], parse_special)
        )
        follower, sentinel = self._follower()
        follower.encode_special_tokens = not parse_special
        out = []
        for segment, first in zip(segments, at_start, strict=True):
            if first:
                out.append(next(rows))
                continue
            encoding = follower.encode(SENTINEL + segment, add_special_tokens=False)
            if SENTINEL in segment or not encoding.ids or encoding.ids[0] != sentinel:  # never seen: as before
                out.append(self._reference([segment], parse_special)[0])
                continue
            offsets = np.asarray(encoding.offsets[1:], dtype=np.int64).reshape(-1, 2) - len(SENTINEL)
            out.append((np.asarray(encoding.ids[1:], dtype=np.int32), offsets[:, 0], offsets[:, 1]))
        return out

    def _follower(self) -> tuple[Any, int]:
        """A copy of the reference tokenizer with SENTINEL as one more (not special) added token, and its id: built
        once, the first time content holds a special-token string."""
        if self._follower_tokenizer is None:
            from tokenizers import AddedToken, Tokenizer

            follower = Tokenizer.from_str(self.library.reference.to_str())
            follower.add_tokens([AddedToken(SENTINEL, special=False, normalized=False)])
            self._follower_tokenizer = (follower, follower.token_to_id(SENTINEL))
        return self._follower_tokenizer

    def with_template_specials(
        self, text: str, restore: dict[str, str], parse_special: bool
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Ids and offsets of a rendered text whose special-token strings are the template's (control tokens),
        its other pieces encoded as text (`restore` turns placeholders back into the content's strings)."""
        pieces: list[tuple[int, int, int | None]] = []  # (start, end, special id or None for text)
        position = 0
        if self._pattern is not None:
            for match in self._pattern.finditer(text):
                if match.start() > position:
                    pieces.append((position, match.start(), None))
                token = next(group for group in match.groups() if group is not None).strip(WHITE_SPACE_CHARACTERS)
                found = self.special.get(token)
                if found is None:  # a stripped match of a token that is itself whitespace-bounded
                    found = self.special[match.group(0)]
                pieces.append((match.start(), match.end(), found))
                position = match.end()
        if position < len(text) or not pieces:
            pieces.append((position, len(text), None))
        segments = [text[start:end] for start, end, special in pieces if special is None]
        for placeholder, original in restore.items():
            segments = [segment.replace(placeholder, original) for segment in segments]
        at_start = [start == 0 for start, _, special in pieces if special is None]
        encoded = iter(self._segments(segments, at_start, parse_special and not restore))
        ids, starts, ends = [], [], []
        for start, end, special in pieces:
            if special is not None:
                ids.append(np.array([special], np.int32))
                starts.append(np.array([start], np.int64))
                ends.append(np.array([end], np.int64))
                continue
            row, row_starts, row_ends = next(encoded)
            ids.append(row)
            starts.append(row_starts + start)
            ends.append(row_ends + start)
        return np.concatenate(ids), np.concatenate(starts), np.concatenate(ends)


def _flat(rows: list[tuple[np.ndarray, np.ndarray, np.ndarray]], texts: list[str]) -> tuple[np.ndarray, ...]:
    """Per-text (ids, starts, ends) as one batch, offsets shifted to the texts joined end to end."""
    shift = np.concatenate([[0], np.cumsum([len(text) for text in texts])]).astype(np.int64)
    lengths = np.fromiter((len(row[0]) for row in rows), dtype=np.int64, count=len(rows))
    if not rows or not lengths.sum():
        empty = np.zeros(0, np.int64)
        return np.zeros(0, np.int32), lengths, empty, empty
    return (
        np.concatenate([row[0] for row in rows]).astype(np.int32),
        lengths,
        np.concatenate([row[1] + shift[i] for i, row in enumerate(rows)]),
        np.concatenate([row[2] + shift[i] for i, row in enumerate(rows)]),
    )


def overlap_mask(starts: np.ndarray, ends: np.ndarray, spans: np.ndarray) -> np.ndarray:
    """1 on each token (char `starts`/`ends`) overlapping one of `spans` (sorted, not overlapping, shape (n, 2)):
    transformers' rule for return_assistant_tokens_mask, over a whole batch at once."""
    if not len(spans) or not len(starts):
        return np.zeros(len(starts), np.uint8)
    first = np.searchsorted(spans[:, 1], starts, side="right")  # the first span ending after the token starts
    inside = first < len(spans)
    return (inside & (spans[np.minimum(first, len(spans) - 1), 0] < ends)).astype(np.uint8)


def _covered(starts: np.ndarray, ends: np.ndarray, spans: np.ndarray) -> np.ndarray:
    """overlap_mask where the tokens' starts and ends are non-decreasing (byte offsets of consecutive tokens): the
    tokens a span overlaps are those from the first ending after its start to the last starting before its end,
    found by two searches per span (not one per token), in any order of spans."""
    if not len(spans) or not len(starts):
        return np.zeros(len(starts), np.uint8)
    first = np.searchsorted(ends, spans[:, 0], side="right")
    last = np.searchsorted(starts, spans[:, 1], side="left")
    keep = first < last
    edges = np.zeros(len(starts) + 1, np.int32)
    np.add.at(edges, first[keep], 1)
    np.add.at(edges, last[keep], -1)
    return (np.cumsum(edges[:-1]) > 0).astype(np.uint8)


def _sentencepiece_proto(processor: Any, text: str) -> Any:
    try:
        return processor.encode(text, return_type="proto")
    except (TypeError, ValueError):  # sentencepiece before return_type
        return processor.encode(text, out_type="immutable_proto")


def _byte_pieces_span_their_character(processor: Any, ids: np.ndarray, begins: np.ndarray, ends: np.ndarray) -> None:
    """SentencePiece gives the byte-fallback pieces of one character zero width but the last (`<0xE7>` (0, 0),
    `<0xAD>` (0, 0), `<0x94>` (0, 3)): each is given the character's span here, as transformers' tokenizer of the
    model gives each of them, so a mask span that starts at that character trains all its bytes (in place)."""
    for index in range(len(ids) - 2, -1, -1):
        if begins[index] == ends[index] == begins[index + 1] and processor.is_byte(int(ids[index])):
            ends[index] = ends[index + 1]


def _bytes_to_chars(text: str, begins: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    points = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype="<u4")
    widths = 1 + (points >= 0x80) + (points >= 0x800) + (points >= 0x10000)
    char_of_byte = np.append(np.repeat(np.arange(len(points), dtype=np.int64), widths), len(points))
    first = char_of_byte[begins]
    last = np.where(ends > begins, char_of_byte[np.maximum(ends - 1, 0)] + 1, first)
    return first, last


# the named special tokens transformers hands a template besides bos/eos/pad/unk (its special_tokens_map)
TEMPLATE_ONLY_ROLES = ("sep", "cls", "mask")


def special_tokens(files: Any, library: Any) -> dict[str, str | None]:
    """role (bos, eos, pad, unk; and sep, cls, mask where tokenizer_config.json names them) -> the token's string:
    what templates see as bos_token, eos_token, ... (transformers' special_tokens_map)."""
    found = dict(files.special_tokens())
    if library.library == TOKENIZERS:
        try:
            named = hf_special_tokens(files, TEMPLATE_ONLY_ROLES)
        except ModelLoadError:  # one that is no string (bos..unk were checked at load): not handed to templates
            named = {}
        found.update((role, token) for role, token in named.items() if token is not None)
    if library.library not in (TOKENIZERS, TIKTOKEN, TEKKEN):  # sentencepiece: its own pieces
        processor = library.processor
        for role, token in (
            ("bos", library.bos_id),
            ("eos", library.eos_id),
            ("pad", library.pad_id),
            ("unk", library.unk_id),
        ):
            found[role] = processor.id_to_piece(token) if token >= 0 else None
    return found


# -- conversations --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChatOptions:
    parse_special_tokens: bool = False
    train_on: str = "assistant"


Encoded = tuple[np.ndarray, np.ndarray, np.ndarray]  # flat int32 ids, int64 lengths, flat uint8 loss mask


def _template_failure(exc: Exception) -> str:
    """What the chat template did: raised on purpose (its `raise_exception`: jinja2's TemplateError itself, the
    template's own message), or failed on this conversation (an undefined attribute, a bad value: the error's type)."""
    from jinja2.exceptions import TemplateError

    if type(exc) is TemplateError:
        return f"the chat template raised: {exc}"
    return f"the chat template failed on it ({type(exc).__name__}: {exc})"


def _where(index: int, message: int | None = None) -> str:
    return f"conversations[{index}]" + ("" if message is None else f".messages[{message}]")


def check_conversation(conversation: Any, index: int) -> list[dict[str, Any]]:
    """The messages as the template sees them (None values dropped, our `train` key taken off); refusals name
    the conversation and the message."""
    if not isinstance(conversation, list):
        raise InvalidField(f"{_where(index)} must be a list of messages", field="conversations", index=index)
    if not conversation:
        raise InvalidField(f"{_where(index)} has no message", field="conversations", index=index)
    if len(conversation) > MAX_MESSAGES:
        raise PayloadTooLarge(
            f"{_where(index)} has {len(conversation):,} messages, over the limit of {MAX_MESSAGES:,}",
            field="conversations",
            index=index,
        )
    messages = []
    for position, message in enumerate(conversation):
        if type(message) is dict and type(message.get("role")) is str and message["role"]:
            content = message.get("content")
            if type(content) is str and len(message) == 2:  # the usual message: role and text content only
                messages.append(message)  # templates cannot change it (an immutable sandbox)
                continue
        messages.append(_checked_message(message, index, position))
    return messages


def _checked_message(message: Any, index: int, position: int) -> dict[str, Any]:
    where = _where(index, position)
    if not isinstance(message, dict):
        raise InvalidField(f"{where} must be an object with a role", field="conversations", index=index)
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise InvalidField(f"{where} has no role (a string)", field="conversations", index=index)
    content = message.get("content")
    if (
        content is not None
        and not isinstance(content, str)
        and (
            not isinstance(content, list)
            or not all(
                isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
                for part in content
            )
        )
    ):
        raise InvalidField(
            f'{where}.content must be a string or a list of {{"type": "text", "text": string}} parts',
            field="conversations",
            index=index,
        )
    if _depth(message) > MAX_MESSAGE_DEPTH:  # the strings' walks, orjson and Jinja's tojson recurse
        raise InvalidField(f"{where} nests deeper than {MAX_MESSAGE_DEPTH} levels", field="conversations", index=index)
    train = message.get("train")
    if train is not None and not isinstance(train, bool):
        raise InvalidField(f"{where}.train must be true or false", field="conversations", index=index)
    if train and role != "assistant":
        raise InvalidField(
            f"{where}.train is true on a {role!r} message; only assistant turns are trained",
            field="conversations",
            index=index,
        )
    return {key: value for key, value in message.items() if value is not None and key != "train"}


MAX_MESSAGE_DEPTH = 64  # levels of objects and lists in one message (tool calls' arguments nest a few)


def _depth(value: Any) -> int:
    """How many levels of objects and lists `value` nests (a string, number: 0), walked without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        value, level = stack.pop()
        if isinstance(value, dict):
            stack.extend((item, level + 1) for item in value.values())
        elif isinstance(value, list):
            stack.extend((item, level + 1) for item in value)
        else:
            continue
        deepest = max(deepest, level + 1)
        if deepest > MAX_MESSAGE_DEPTH:
            break
    return deepest


def _json(value: Any) -> bytes | None:
    """`value` as orjson writes it, None where it cannot (an integer beyond 64 bits, which JSON may hold)."""
    try:
        return orjson.dumps(value)
    except TypeError:
        return None


def _strings(value: Any) -> list[str]:
    """Every string a message carries (content, reasoning, tool calls...), where content special tokens hide."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [string for item in value.values() for string in _strings(item)]
    if isinstance(value, list):
        return [string for item in value for string in _strings(item)]
    return []


def _replace(value: Any, table: list[tuple[str, str]]) -> Any:
    if isinstance(value, str):
        for old, new in table:
            value = value.replace(old, new)
        return value
    if isinstance(value, dict):
        return {key: _replace(item, table) for key, item in value.items()}
    if isinstance(value, list):
        return [_replace(item, table) for item in value]
    return value


PLACEHOLDER_BASE = 0x10FF00  # private use, plane 16: placeholders for special-token strings inside content
_PRIVATE = re.compile("[\U0010ff00-\U0010ffff]")


@functools.cache
def _inner_render() -> tuple[Any, Any] | None:
    try:
        from transformers.utils.chat_template_utils import _alias_reasoning_fields, _render_with_assistant_indices
    except ImportError:
        return None
    return _render_with_assistant_indices, _alias_reasoning_fields


def _compile(text: str) -> Any:
    """The template compiled in transformers' Jinja environment (its filters, globals, {% generation %} tracker and
    loop controls), a copy of this process's own where transformers builds one per call (5.x), with two lookups
    made cheaper that cannot change what renders (tests/test_chat.py compares with apply_chat_template itself):

    - the template's globals as one dict: jinja keeps a ChainMap over the environment's globals, copied into
      every render's context by iterating it in Python; nothing changes those globals after transformers builds
      the environment (and this environment is ours alone);
    - ``message.role`` on a plain dict (what JSON gives): the sandbox tries ``getattr(message, "role")`` first,
      which raises AttributeError for any name a dict has no attribute of, then ``message["role"]``; for those
      names the item is looked up directly (undefined when absent, as the sandbox returns). Names a dict does
      have (``items``, ``get``...) still go through the sandbox's checks;
    - ``{% generation %}``'s call of transformers' tracker: the sandbox asks whether that method is safe to call
      (attributes it looks up on it, which the tracker never has) on every assistant turn; it is called directly.
      Every other call in a template goes through the sandbox as before."""
    try:
        from transformers.utils.chat_template_utils import _cached_compile_jinja_template
    except ImportError:  # transformers 4.x: its cached, shared compile, left as it is
        from transformers.utils.chat_template_utils import _compile_jinja_template

        return _compile_jinja_template(text)
    compiled = _cached_compile_jinja_template(text)
    compiled.globals = dict(compiled.globals)
    environment = compiled.environment
    sandboxed = environment.getattr
    undefined = environment.undefined
    absent: set[str] = set()  # names a plain dict has no attribute of (the same for every plain dict), as met

    def getattr_(obj: Any, attribute: Any) -> Any:
        if type(obj) is dict and type(attribute) is str:
            if attribute in absent:
                try:
                    return obj[attribute]
                except KeyError:
                    return undefined(obj=obj, name=attribute)
            if not hasattr({}, attribute) and len(absent) < 4096:
                absent.add(attribute)
        return sandboxed(obj, attribute)

    environment.getattr = getattr_
    sandboxed_call = environment.call
    trackers = [ext for ext in environment.extensions.values() if "_generation_support" in type(ext).__dict__]
    if len(trackers) == 1 and environment.is_safe_callable(trackers[0]._generation_support):
        generation = type(trackers[0]).__dict__["_generation_support"]

        def call(context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
            if type(obj) is MethodType and obj.__func__ is generation:  # the sandbox's answer, once for all
                return context.call(obj, *args, **kwargs)
            return sandboxed_call(context, obj, *args, **kwargs)

        environment.call = call
    return compiled


class ChatTemplate:
    """A model's template compiled once per process, and its conversations' ids and loss masks."""

    def __init__(self, name: str, template: TemplateFile, library: Any, special_tokens: dict[str, str | None]) -> None:
        self.name = name
        self.resolved = resolve(template)
        self.compiled = _compile(self.resolved.text)
        self.kwargs = {f"{role}_token": token for role, token in special_tokens.items() if token}
        self.tokens = Tokens(library)

    def render(self, messages: list[dict[str, Any]], index: int) -> tuple[str, list[tuple[int, int]]]:
        """transformers' render_jinja_template(..., return_assistant_tokens_mask=True) of one conversation.

        Messages parsed from JSON are plain data already, so where transformers has them (5.x) its own inner
        steps are called directly: the reasoning-field aliases, then the compiled template's generation with the
        {% generation %} tracker; what render_jinja_template adds around them is copying the input into plain JSON
        types, which JSON is (tests/test_chat.py compares with apply_chat_template itself)."""
        try:
            inner = _inner_render()
            if inner is not None:
                with_indices, alias = inner
                rendered_one, spans_one = with_indices(
                    compiled_template=self.compiled,
                    # role and content only (the usual message): no reasoning field to alias
                    messages=messages if all(len(m) == 2 and "content" in m for m in messages) else alias(messages),
                    tools=None,
                    documents=None,
                    add_generation_prompt=False,
                    **self.kwargs,
                )
                return rendered_one, [tuple(span) for span in spans_one]
            from transformers.utils.chat_template_utils import render_jinja_template

            rendered, spans = render_jinja_template(
                conversations=[messages],
                chat_template=self.resolved.text,
                return_assistant_tokens_mask=True,
                **self.kwargs,
            )
        except RecursionError:
            raise InvalidField(
                f"{_where(index)}: the chat template recursed too deep", field="conversations", index=index
            ) from None
        except Exception as exc:  # the template's raise_exception, a jinja error, a bad value
            raise InvalidField(
                f"{_where(index)}: {_template_failure(exc)}", field="conversations", index=index
            ) from None
        return rendered[0], [tuple(span) for span in spans[0]]

    def encode(self, conversations: Sequence[Any], options: ChatOptions, first_index: int = 0) -> Encoded:
        if self.resolved.loss_mask is None:
            raise InvalidField(no_mask_message(self.name), field="conversations")
        if options.train_on not in TRAIN_ON:
            raise InvalidField(f"train_on must be one of {list(TRAIN_ON)}", field="train_on")
        ids: list[np.ndarray | None] = []
        masks: list[np.ndarray | None] = []
        plain: list[tuple[int, str, list[tuple[int, int]]]] = []  # conversations tokenized together, below
        checked = [
            check_conversation(conversation, first_index + position)
            for position, conversation in enumerate(conversations)
        ]
        anywhere = self._special_anywhere(checked, options)
        for position, (conversation, messages) in enumerate(zip(conversations, checked, strict=True)):
            index = first_index + position
            flags = [message.get("train") if isinstance(message, dict) else None for message in conversation]
            table = self._placeholders(messages, index, options) if anywhere else []
            rendered, spans = self.render(_replace(messages, table) if table else messages, index)
            spans = self._selected(spans, messages, flags, options, index)
            if table or self.tokens.splits_always:
                restore = {placeholder: original for original, placeholder in table}
                row, starts, ends = self.tokens.with_template_specials(rendered, restore, options.parse_special_tokens)
                ids.append(row)
                masks.append(overlap_mask(starts, ends, np.array(spans, dtype=np.int64).reshape(-1, 2)))
            else:
                ids.append(None)
                masks.append(None)
                plain.append((position, rendered, spans))
        if plain:
            flat, lengths, flat_mask = self.tokens.encode_masked(
                [rendered for _, rendered, _ in plain], [chosen for _, _, chosen in plain], True
            )
            offsets = np.concatenate([[0], np.cumsum(lengths)])
            for i, (position, _, _) in enumerate(plain):
                ids[position] = flat[offsets[i] : offsets[i + 1]]
                masks[position] = flat_mask[offsets[i] : offsets[i + 1]]
        lengths = np.fromiter((len(row) for row in ids), dtype=np.int64, count=len(ids))
        if not ids:
            return np.zeros(0, np.int32), lengths, np.zeros(0, np.uint8)
        mask = np.concatenate(masks)
        # per conversation (a last one of no token at all is one too: np.add.reduceat cannot take its empty row)
        trained = np.fromiter((int(np.count_nonzero(row)) for row in masks), dtype=np.int64, count=len(masks))
        empty = np.flatnonzero(trained == 0)
        if len(empty):
            index = first_index + int(empty[0])
            raise InvalidField(
                f"{_where(index)} has no token to train on (no assistant output is selected)",
                field="conversations",
                index=index,
            )
        return np.concatenate(ids).astype(np.int32), lengths, mask

    def _special_anywhere(self, checked: list[list[dict[str, Any]]], options: ChatOptions) -> bool:
        """Whether any special-token string may be in these conversations' content (one search of their JSON)."""
        if options.parse_special_tokens or self.tokens._any is None:
            return False
        if not self.tokens.json_safe or self.tokens.splits_always:
            return True
        data = _json(checked)
        if data is None:
            return True  # each string searched (_placeholders)
        if self.tokens._needles is not None:
            return any(needle in data for needle in self.tokens._needles)
        return self.tokens._any.search(data.decode("utf-8")) is not None

    def _placeholders(self, messages: list[dict[str, Any]], index: int, options: ChatOptions) -> list[tuple[str, str]]:
        """(special-token string, placeholder) for those inside the content, unless they are to be parsed."""
        if options.parse_special_tokens or not self.tokens.special:
            return []
        pattern = self.tokens._any
        data = (
            _json(messages) if pattern is not None and self.tokens.json_safe and not self.tokens.splits_always else None
        )
        if pattern is not None and data is not None and pattern.search(data.decode("utf-8")) is None:
            return []  # one search: the usual case
        strings = _strings(messages)
        found = sorted(
            {match.group(0) for string in strings for match in pattern.finditer(string)} if pattern else set(),
            key=len,
            reverse=True,
        )
        if not found and not self.tokens.splits_always:
            return []
        if any(_PRIVATE.search(string) for string in strings):
            raise InvalidField(
                f"{_where(index)} holds characters U+10FF00..U+10FFFF (private use) beside special-token strings; "
                "these cannot be told apart: pass parse_special_tokens or drop them",
                field="conversations",
                index=index,
            )
        return [(token, chr(PLACEHOLDER_BASE + number) * len(token)) for number, token in enumerate(found)]

    def _selected(
        self,
        spans: list[tuple[int, int]],
        messages: list[dict[str, Any]],
        flags: list[Any],
        options: ChatOptions,
        index: int,
    ) -> list[tuple[int, int]]:
        """The generation spans to train on: every one, or by train_on='last' and the messages' train flags."""
        assistants = [position for position, message in enumerate(messages) if message["role"] == "assistant"]
        overridden = any(flags[position] is not None for position in assistants)
        if options.train_on == "last" or overridden:
            if len(spans) != len(assistants):
                raise InvalidField(
                    f"{_where(index)}: the chat template marks {len(spans)} generation spans for "
                    f"{len(assistants)} assistant messages, so train_on='last' and train flags cannot name turns",
                    field="conversations",
                    index=index,
                )
            chosen = []
            for number, (position, span) in enumerate(zip(assistants, spans, strict=True)):
                default = options.train_on == "assistant" or number == len(assistants) - 1
                if flags[position] if flags[position] is not None else default:
                    chosen.append(span)
            spans = chosen
        return spans


def _post_processor(library: Any) -> tuple[list[int], list[int]]:
    """The ids `tok(text)` adds around a text (add_special_tokens=True), as transformers' tokenizer call does."""
    if library.library == TOKENIZERS:
        reference = library.reference
        reference.encode_special_tokens = True
        plain = reference.encode("a", add_special_tokens=False).ids
        full = reference.encode("a", add_special_tokens=True).ids
        for start in range(len(full) - len(plain) + 1):
            if full[start : start + len(plain)] == plain:
                return full[:start], full[start + len(plain) :]
        return [], []
    if library.library == TIKTOKEN:
        return [], []
    return ([library.bos_id] if library.bos_id >= 0 else []), []


class Records:
    """A model's prompt-completion records, as TRL's SFT trainer tokenizes plain-text ones."""

    def __init__(self, library: Any, eos_token: str | None) -> None:
        self.library = library
        self.eos_id = library.eos_id
        self.eos_token = eos_token
        self.prefix, self.suffix = _post_processor(library)

    def encode(self, records: Sequence[Any], options: ChatOptions, first_index: int = 0) -> Encoded:
        return encode_records(self, records, options, first_index)


def encode_records(model: Records, records: Sequence[Any], options: ChatOptions, first_index: int = 0) -> Encoded:
    """TRL's SFT trainer on plain prompt-completion data: ids of tok(prompt + completion + eos), trained after
    the common prefix with tok(prompt). The EOS is appended unless the completion ends with its string (then
    that string is the EOS, as in TRL)."""
    eos_id, eos_token, prefix, suffix = model.eos_id, model.eos_token, model.prefix, model.suffix
    if eos_id < 0 or eos_token is None:
        raise InvalidField("prompt-completion records need a model with an EOS token (TRL appends it)", field="records")
    prompts, fulls = [], []
    for position, record in enumerate(records):
        index = first_index + position
        if (
            not isinstance(record, dict)
            or set(record) - {"prompt", "completion"}
            or not isinstance(record.get("prompt"), str)
            or not isinstance(record.get("completion"), str)
        ):
            raise InvalidField(
                f'records[{index}] must be {{"prompt": string, "completion": string}}', field="records", index=index
            )
        prompts.append(record["prompt"])
        ends = record["completion"].endswith(eos_token)
        fulls.append(record["prompt"] + (record["completion"][: -len(eos_token)] if ends else record["completion"]))
    parse = options.parse_special_tokens
    prompt_rows = model.library.encode_plain(prompts, parse)
    full_rows = model.library.encode_plain(fulls, parse)
    ids, masks = [], []
    p_offsets = np.concatenate([[0], np.cumsum(prompt_rows[1])])
    f_offsets = np.concatenate([[0], np.cumsum(full_rows[1])])
    for position in range(len(prompts)):
        prompt = [*prefix, *prompt_rows[0][p_offsets[position] : p_offsets[position + 1]].tolist(), *suffix]
        full = [*prefix, *full_rows[0][f_offsets[position] : f_offsets[position + 1]].tolist(), eos_id, *suffix]
        common = 0
        for want, have in zip(prompt, full, strict=False):
            if want != have:
                break
            common += 1
        mask = np.zeros(len(full), np.uint8)
        mask[common:] = 1
        if not mask.any():
            raise InvalidField(f"records[{first_index + position}] has no token to train on", field="records")
        ids.append(np.asarray(full, np.int32))
        masks.append(mask)
    lengths = np.fromiter((len(row) for row in ids), dtype=np.int64, count=len(ids))
    if not ids:
        return np.zeros(0, np.int32), lengths, np.zeros(0, np.uint8)
    return np.concatenate(ids), lengths, np.concatenate(masks)
