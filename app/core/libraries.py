"""The tokenizer libraries behind one interface: a batch of texts to flat ids, ids back to texts, special ids.

Each model is encoded exactly as its own library encodes it in-process, then BOS first and EOS last:

- sentencepiece: ``sp.encode(text, add_bos=..., add_eos=...)``;
- tokenizers: ``tok.encode(text, add_special_tokens=False).ids`` with special-token strings in the text
  encoded as ordinary text (``tok.encode_special_tokens = True``) unless ``parse_special_tokens``;
- tiktoken: ``enc.encode_ordinary(text)``, or ``enc.encode(text, allowed_special="all")`` when
  ``parse_special_tokens``.

A ``tokenizer.json``'s own truncation and padding settings are inference settings and are not applied
(``max_length`` truncates, /v1/pack packs). Decoding is always the reference library's.

**The fast path.** `tokenizer.json`, tiktoken and tekken.json models may be encoded by fastokens, an exact
reimplementation in Rust, 10-50x cheaper per token than `tokenizers` here. It is trusted only behind a
gate: when a process loads a model, fastokens must give the reference library's ids for every text of
the built-in check set (tokenizer_service.core.checkset) in both special-token modes, and on every code point and
special-token string (`scan`; the verdict cached by `gate_key` in `cache_dir()`); otherwise that model is
encoded by the reference library, logged once, and its `encoder` says so. ``encoder="reference"`` skips
it. After the gate, shadow verification (tokenizer_service.core.shadow) watches it. A later start reads the
verdict, the model's description (`description_key`) and the digest of the check set's ids (`checkset_ids`)
from the cache: it proves the route it builds gives those ids, and loads the reference library only when
something encodes or decodes with it.

Every library runs single-threaded in a worker (`single_threaded`): one process per core already.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import importlib.util
import itertools
import json
import logging
import multiprocessing
import os
import random
import re
import statistics
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from tokenizer_client.wire import ragged_offsets
from tokenizer_service.core import cache, checkset, encoders
from tokenizer_service.core.cache import CACHE_DIR_ENV, cache_dir  # noqa: F401  # re-exported: where verdicts are
from tokenizer_service.core.errors import InvalidField, PayloadTooLarge
from tokenizer_service.core.models import (
    KINDS,
    META_ENCODINGS,
    SENTENCEPIECE,
    TEKKEN,
    TIKTOKEN,
    TOKENIZERS,
    ModelFiles,
    ModelLoadError,
    hf_model_type,
    hf_vocab_size,
    json_outline,
    parsed_json,
    tekken_spec,
    tiktoken_ranks,
    tiktoken_spec,
)

logger = logging.getLogger("tokenizer")

FAST, REFERENCE = "fast", "reference"
FASTOKENS, GIGATOKEN = encoders.FASTOKENS, encoders.GIGATOKEN
# fast: the fastest exact fast encoder by the rule (tokenizer_service.core.encoders.choose); fastokens, gigatoken:
# that one only (still behind the gate); reference: the library itself
ENCODER_CHOICES = (FAST, REFERENCE, FASTOKENS, GIGATOKEN)
is_fast = encoders.is_fast

Encoded = tuple[np.ndarray, np.ndarray]  # flat int32 ids, int64 lengths (one per text)


def single_threaded() -> None:
    """Every library on the calling thread only (set before a library first encodes in this process):
    Rayon (tokenizers, fastokens), fastokens' own BPE threads, tokenizers' batch parallelism."""
    os.environ["RAYON_NUM_THREADS"] = "1"
    os.environ["FASTOKENS_BPE_THREADS"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def flatten(rows: Sequence[Sequence[int] | np.ndarray]) -> Encoded:
    """Flat int32 ids and int64 lengths of ragged rows."""
    lengths = np.fromiter((len(row) for row in rows), dtype=np.int64, count=len(rows))
    if not rows or not lengths.sum():
        return np.zeros(0, dtype=np.int32), lengths
    return np.concatenate([np.asarray(row, dtype=np.int32) for row in rows]), lengths


def frame(ids: np.ndarray, lengths: np.ndarray, bos: int | None, eos: int | None) -> Encoded:
    """BOS before and EOS after every text of a flat batch, without a Python loop over the texts."""
    extra = (bos is not None) + (eos is not None)
    if not extra or not len(lengths):
        return ids, lengths
    framed_lengths = lengths + extra
    offsets = ragged_offsets(framed_lengths)
    out = np.empty(int(offsets[-1]), dtype=np.int32)
    # a byte a slot says which slots the texts' ids fill, in order: 8x cheaper than scattering them by int64
    # positions (a 1 MiB chunk of text: 0.5 ms against 4)
    text = np.ones(len(out), dtype=bool)
    if bos is not None:
        text[offsets[:-1]] = False
        out[offsets[:-1]] = bos
    if eos is not None:
        text[offsets[1:] - 1] = False
        out[offsets[1:] - 1] = eos
    out[text] = ids
    return out, framed_lengths


def truncate(ids: np.ndarray, lengths: np.ndarray, max_length: int, eos: int | None) -> Encoded:
    """Keep each text's first `max_length` ids; when it ended in EOS (`eos` given), EOS stays last."""
    if not len(lengths) or int(lengths.max()) <= max_length:
        return ids, lengths
    kept = np.minimum(lengths, max_length)
    within = np.arange(len(ids), dtype=np.int64) - np.repeat(ragged_offsets(lengths)[:-1], lengths)
    out = ids[within < np.repeat(kept, lengths)]
    if eos is not None and max_length > 0:
        out[ragged_offsets(kept)[1:][lengths > max_length] - 1] = eos
    return out, kept


class Library(ABC):
    """One model in one library: what a worker encodes and decodes with."""

    library: ClassVar[str]
    encoder: str  # what encodes: the library, or a fast encoder's route (gigatoken, fastokens(converted), ...)
    type: str
    vocab_size: int
    bos_id: int
    eos_id: int
    pad_id: int
    unk_id: int
    normalizes: bool  # may grow a text under Unicode normalization (the expansion bound applies)

    @abstractmethod
    def __init__(self, files: ModelFiles, encoder: str = FAST, trusted: bool = False) -> None:
        """Load the model from its files' bytes; `encoder` fast puts the fastest exact fast encoder in front where
        one passes its gate (fastokens, gigatoken: that one; a route: that route, trusted)."""

    max_text_chars: int | None = None  # a longer text is refused (413): what the encoder's memory allows
    # pieces the library matches in any text whatever parse_special_tokens says (SentencePiece's USER_DEFINED)
    user_defined_pieces: tuple[str, ...] = ()
    fast: Any | None = None  # fastokens' tokenizer, when it encodes this model
    shadow: Any | None = None  # a tokenizer_service.core.shadow.Shadow sampling what fastokens encodes

    @property
    def takes_utf8(self) -> bool:
        """Whether `encode` reads texts as UTF-8 (a `Utf8Texts` from a binary body) without decoding them: its fast
        encoder does (gigatoken), and no text length is checked in characters."""
        return self.fast is not None and getattr(self.fast, "takes_utf8", False) and self.max_text_chars is None

    def encode(self, texts: Sequence[str], options: Any, first_index: int = 0) -> Encoded:
        """Ids of each text exactly as the library gives them in-process, then BOS and EOS, then max_length."""
        if options.sample is not None:
            raise InvalidField(
                f"sample (subword regularization) is SentencePiece's; this model is a {self.library} model",
                field="sample",
            )
        if self.max_text_chars is not None:
            for position, text in enumerate(texts):
                if len(text) > self.max_text_chars:
                    raise PayloadTooLarge(
                        f"texts[{first_index + position}] has {len(text):,} characters; this model, encoded by "
                        f"{self.encoder}, takes at most {self.max_text_chars:,} a text (the library needs about 170 "
                        "bytes of memory per byte of text): split it",
                        field="texts",
                        index=first_index + position,
                    )
        ids, lengths = self.encode_plain(texts, bool(options.parse_special_tokens))
        if self.shadow is not None and self.fast is not None:
            self.shadow.sample(self, texts, bool(options.parse_special_tokens), ids, lengths)
        ids, lengths = frame(
            ids, lengths, self.bos_id if options.add_bos else None, self.eos_id if options.add_eos else None
        )
        if options.max_length is not None:
            ids, lengths = truncate(ids, lengths, options.max_length, self.eos_id if options.add_eos else None)
        return ids, lengths

    @abstractmethod
    def encode_plain(self, texts: Sequence[str], parse_special: bool) -> Encoded:
        """The library's ids of each text, nothing added."""

    @abstractmethod
    def decode(self, rows: list[list[int]]) -> list[str]:
        """The library's decode of each row (ids already checked to lie in the vocabulary)."""

    def reference_rows(self, texts: list[str], parse_special: bool) -> list[list[int]]:
        """The reference library's own ids of each text (what a fast encoder is checked against)."""
        return [list(row) for row in flatten_rows(*self.encode_plain(texts, parse_special))]

    fallen = False  # fell back after a shadow mismatch: never promoted again

    def fall_back(self, mismatch: str | None = None) -> None:
        """Encode with the reference library from now on (the fast encoder differed from it). `mismatch`: what this
        process's shadow verification found, kept as the gate's verdict on these files (`remember_mismatch`), so
        that no later start, here or elsewhere on this cache, serves that fast encoder again."""
        route = self.encoder
        self.fast = None
        self.encoder = self.library
        self.fallen = True
        if mismatch is not None and encoders.is_fast(route):
            remember_mismatch(self.files, route, mismatch)

    def promote(self, route: str = FAST, keep_reference: bool = False) -> bool:
        """Encode with the fast encoder `route` (``gigatoken``, ``fastokens(converted)``...) from now on: its gate
        passed in another process (the background scan) on these very files; the check set runs here again.
        Nothing for a model that fell back, or has no fast encoder. `keep_reference`: keep the reference library
        loaded (for processes forked from this one, whose shadow verification uses it) instead of dropping it."""
        if self.fast is not None or self.fallen or not hasattr(self, "_build_fast"):
            return self.fast is not None
        return _adopt_fast(self, trusted=True, encoder=route, keep_reference=keep_reference)

    def _fast_adopted(self) -> None:  # noqa: B027  (a hook: a subclass may override it, the default does nothing)
        """fastokens now encodes this model."""

    def special_ids(self) -> dict[str, int]:
        return {"bos": self.bos_id, "eos": self.eos_id, "pad": self.pad_id, "unk": self.unk_id}

    @classmethod
    def variant(cls, files: ModelFiles) -> type[Library]:
        """The class that loads these files (a subclass for a known encoding that encodes otherwise)."""
        return cls


# -- sentencepiece --------------------------------------------------------------------------------------

# Fewer texts than this are encoded one by one: sentencepiece starts a native thread for every list it
# encodes, which costs more than a few texts take.
LIST_ENCODE_MIN_TEXTS = 16


class SentencePiece(Library):
    library = SENTENCEPIECE

    def __init__(self, files: ModelFiles, encoder: str = FAST, trusted: bool = False) -> None:
        import sentencepiece as spm

        self.processor = spm.SentencePieceProcessor()
        try:
            self.processor.LoadFromSerializedProto(files.contents[0])
        except (RuntimeError, OSError) as exc:
            raise ModelLoadError(f"{files.path} is not a model file; a model is {KINDS}") from exc
        self.encoder = SENTENCEPIECE
        self.type = _sentencepiece_type(files.contents[0])
        self.user_defined_pieces = _user_defined_pieces(files.contents[0])
        processor = self.processor
        self.vocab_size = processor.vocab_size()
        self.bos_id, self.eos_id = processor.bos_id(), processor.eos_id()
        self.pad_id, self.unk_id = processor.pad_id(), processor.unk_id()
        self.normalizes = True

    def encode(self, texts: list[str], options: Any, first_index: int = 0) -> Encoded:
        """`sp.encode(text, add_bos=..., add_eos=...)` for each text; sampled with `options.sample`."""
        processor = self.processor
        common = {"add_bos": options.add_bos, "add_eos": options.add_eos, "out_type": "numpy"}
        sample = options.sample
        if sample is not None:
            sampling = {
                **common,
                "enable_sampling": True,
                "alpha": float(sample.alpha),
                "nbest_size": sample.nbest_size,
            }
            entropy = random.SystemRandom()
            pieces = [
                sample_in_fresh_thread(
                    processor,
                    text,
                    entropy.getrandbits(32)
                    if sample.seed is None
                    else sample_seed(sample.seed, first_index + position),
                    sampling,
                )
                for position, text in enumerate(texts)
            ]
        elif len(texts) < LIST_ENCODE_MIN_TEXTS:
            pieces = [processor.encode(text, **common) for text in texts]
        else:
            pieces = processor.encode(texts, num_threads=1, **common)
        ids, lengths = flatten(pieces)
        if options.max_length is not None:
            ids, lengths = truncate(ids, lengths, options.max_length, self.eos_id if options.add_eos else None)
        return ids, lengths

    def encode_plain(self, texts: list[str], parse_special: bool) -> Encoded:
        return flatten(self.processor.encode(texts, num_threads=1, out_type="numpy"))

    def decode(self, rows: list[list[int]]) -> list[str]:
        return self.processor.decode(rows) if rows else []


def sample_seed(seed: int, index: int) -> int:
    """Seed for text `index` of a request: reproducible whichever worker and chunk the text lands in."""
    return (seed + index) % (1 << 32)


def sample_in_fresh_thread(processor: Any, text: str, seed: int, options: dict[str, Any]) -> np.ndarray:
    """Sample one text reproducibly: a new thread's generator is seeded from the seed set in it."""
    import sentencepiece as spm

    result: list[np.ndarray] = []

    def run() -> None:
        spm.set_random_generator_seed(seed)
        result.append(processor.encode(text, **options))

    thread = threading.Thread(target=run, name="tokenizer-sample")
    thread.start()
    thread.join()
    return result[0]


def _user_defined_pieces(serialized: bytes) -> tuple[str, ...]:
    """The model's USER_DEFINED pieces, in id order: sentencepiece encodes each of them, wherever it occurs in a
    text, as its own id (Mistral v7's `[INST]`, `[REF]`); it never matches CONTROL pieces (`<s>`) in text."""
    from sentencepiece import sentencepiece_model_pb2 as pb2

    proto = pb2.ModelProto()  # type: ignore[attr-defined]  # generated code
    proto.ParseFromString(serialized)
    user_defined = pb2.ModelProto.SentencePiece.Type.Value("USER_DEFINED")  # type: ignore[attr-defined]
    return tuple(piece.piece for piece in proto.pieces if piece.type == user_defined)


def _sentencepiece_type(serialized: bytes) -> str:
    from sentencepiece import sentencepiece_model_pb2 as pb2

    proto = pb2.ModelProto()  # type: ignore[attr-defined]  # generated code
    proto.ParseFromString(serialized)
    return str(pb2.TrainerSpec.ModelType.Name(proto.trainer_spec.model_type)).lower()  # type: ignore[attr-defined]


# -- the gate in front of a fast encoder ----------------------------------------------------------------

Rows = Callable[[list[str], bool], list[list[int]]]
GATE_BATCH_CHARS = 1 << 20  # check texts encoded together, at most (tokenizers' memory grows with a batch)
GATE_BATCH_TEXTS = 1 << 16
# Tests only (tests/test_shadow.py): "U+XXXX" makes every worker's fast encoder give one wrong id for texts
# holding that code point, after its gate: what shadow verification must catch. Never set it in production.
PLANT_ENV = "TOKENIZER_TEST_FAST_DIFFERS"


def gate(name: str, reference: Rows, fast: Rows, texts: list[str]) -> str | None:
    """None when `fast` gives `reference`'s ids for every text in both special-token modes, else what differed."""
    for parse_special in (False, True):
        expected = reference(texts, parse_special)
        try:
            got = fast(texts, parse_special)
        except Exception as exc:  # a fast encoder that cannot encode the check set is not used
            return f"failed on the check set: {exc!r}"
        for index, (want, have) in enumerate(zip(expected, got, strict=True)):
            want, have = list(want), list(have)
            if want != have:
                mode = "parsing special tokens" if parse_special else "special tokens as text"
                pairs = enumerate(zip(want, have, strict=False))  # of unequal lengths, where one ends
                at = next((i for i, (a, b) in pairs if a != b), min(len(want), len(have)))
                start = max(0, at - 2)  # the ids around the first that differs, not the text's first ids
                return (
                    f"check text {index} ({texts[index][:40]!r}, {mode}): ids from {start}: "
                    f"{have[start : start + 8]} != {want[start : start + 8]}"
                )
    return None


def check_texts(library: Any) -> list[str]:
    """The check set of `library`'s model (`checkset.texts`): the fixed texts and whitespace runs, its special-token
    strings, and for ranks (tiktoken, tekken.json) its tokens that are no merge of two others and are text
    (UTF-8) on their own, by rank, at most `checkset.PIECES` of them."""
    pieces: list[str] = []
    if library.library in (TIKTOKEN, TEKKEN):
        for token in encoders.non_merges(encoders.ranks_model(library)[0]):
            try:
                pieces.append(token.decode("utf-8"))
            except UnicodeDecodeError:  # a token no text is on its own: only ever made by merges
                continue
            if len(pieces) == checkset.PIECES:
                break
    return checkset.texts(library.special, pieces)


def _mode(parse_special: bool) -> str:
    return "parsing special tokens" if parse_special else "special tokens as text"


def _differing(reference: Rows, fast: Rows, texts: list[str], parse_special: bool) -> list[int]:
    """Indexes of the texts `fast` encodes otherwise than `reference`, in batches of bounded size."""
    found: list[int] = []
    start = 0
    while start < len(texts):
        end, size = start, 0
        while end < len(texts) and (end == start or (size < GATE_BATCH_CHARS and end - start < GATE_BATCH_TEXTS)):
            size += len(texts[end])
            end += 1
        batch = texts[start:end]
        want, have = reference(batch, parse_special), fast(batch, parse_special)
        found += [start + index for index, (a, b) in enumerate(zip(want, have, strict=True)) if list(a) != list(b)]
        start = end
    return found


def _culprits(
    items: list[Any], make: Callable[[list[Any]], str], reference: Rows, fast: Rows, parse: bool
) -> list[Any]:
    """The items whose text (`make`) alone differs, by bisection; all of them when only together they differ."""
    if len(items) <= 1:
        return list(items)
    middle = len(items) // 2
    found: list[Any] = []
    for half in (items[:middle], items[middle:]):
        if _differing(reference, fast, [make(half)], parse):
            found += _culprits(half, make, reference, fast, parse)
    return found or list(items)


def _touching(texts: list[str], firsts: set[str]) -> list[int]:
    """Indexes of the texts holding the first character of a special-token string (only those can parse one)."""
    if not firsts:
        return []
    return [index for index, text in enumerate(texts) if not firsts.isdisjoint(text)]


def scan(reference: Rows, fast: Rows, special: Sequence[str], separator: tuple[str, int] | None = None) -> str | None:
    """None when `fast` gives `reference`'s ids for every code point and every special-token string, else
    what differs, naming the code points (U+XXXX) or the special-token strings.

    Every code point (`checkset.code_point_blocks`: after a space, between letters, three in a row;
    `checkset.edge_text`: at the start and the end of a text) with special tokens as text, and
    where a text holds the first character of a special-token string, parsing them too; every special-token
    string (`checkset.token_groups`) in both modes. A text that differs is bisected to what differs.

    `separator` (`edge_separator`: a special-token string and its id, for a model whose library encodes the
    text between two special tokens exactly as a text of its own): the reference library encodes the edge
    texts joined by it, parsing special tokens, and its ids are cut at the separator's; fastokens still
    encodes every edge text as a text of its own. Without it, the reference encodes them one by one."""
    tokens = [token for token in special if token]
    firsts = {token[0] for token in tokens}
    try:
        blocks = checkset.code_point_blocks()
        block_texts = [checkset.code_point_text(block) for block in blocks]
        for parse_special in (False, True):
            chosen = range(len(blocks)) if not parse_special else _touching(block_texts, firsts)
            texts = [block_texts[index] for index in chosen]
            for index in _differing(reference, fast, texts, parse_special):
                block = blocks[chosen[index]]
                points = _culprits(block, checkset.code_point_text, reference, fast, parse_special)
                return (
                    f"code point {checkset.describe(points)} (after a space, between letters, repeated; "
                    f"{_mode(parse_special)})"
                )
        del block_texts
        points = checkset.code_points()
        where = "at the start and the end of a text"
        for first in range(0, len(points), GATE_BATCH_TEXTS):  # built a batch at a time: bounded memory
            some = points[first : first + GATE_BATCH_TEXTS]
            edges = [checkset.edge_text(point) for point in some]
            touched = _touching(edges, firsts)
            alone: Sequence[int] = range(len(some))
            if separator is not None:  # the reference's ids of every untouched edge text from joined texts
                untouched = sorted(set(range(len(some))) - set(touched))
                bad = _differing_joined(reference, fast, [edges[index] for index in untouched], separator)
                if bad:
                    culprits = [some[untouched[index]] for index in bad]
                    return f"code point {checkset.describe(culprits)} ({where}; {_mode(False)})"
                alone = touched
            for parse_special in (False, True):
                chosen = alone if not parse_special else touched
                bad = _differing(reference, fast, [edges[index] for index in chosen], parse_special)
                if bad:
                    culprits = [some[chosen[index]] for index in bad]
                    return f"code point {checkset.describe(culprits)} ({where}; {_mode(parse_special)})"
        groups = checkset.token_groups(tokens)
        for parse_special in (False, True):
            bad = _differing(reference, fast, tokens, parse_special)
            if bad:
                return f"special-token string {tokens[bad[0]][:80]!r} alone ({_mode(parse_special)})"
            texts = [checkset.token_text(group) for group in groups]
            for index in _differing(reference, fast, texts, parse_special):
                culprits = _culprits(groups[index], checkset.token_text, reference, fast, parse_special)
                shown = ", ".join(repr(token[:80]) for token in culprits[:8])
                return f"special-token string {shown} in context ({_mode(parse_special)})"
    except Exception as exc:  # a fast encoder that cannot encode a text is not used
        return f"failed on the code-point scan: {exc!r}"
    return None


EDGES_PER_TEXT = 1024  # edge texts the reference encodes joined into one text (with a separator)


def _differing_joined(reference: Rows, fast: Rows, texts: list[str], separator: tuple[str, int]) -> list[int]:
    """Indexes of the texts (none holding a special-token string) that `fast`, encoding each alone, encodes
    otherwise than `reference` encodes them joined by the separator (its ids cut at the separator's id;
    a joined text whose cut does not give one row a text is encoded again text by text)."""
    token, token_id = separator
    joined = [token.join(texts[start : start + EDGES_PER_TEXT]) for start in range(0, len(texts), EDGES_PER_TEXT)]
    want: list[list[int]] = []
    for start in range(0, len(joined), max(1, GATE_BATCH_CHARS // (16 * EDGES_PER_TEXT))):
        batch = joined[start : start + max(1, GATE_BATCH_CHARS // (16 * EDGES_PER_TEXT))]
        for offset, row in enumerate(reference(batch, True)):
            first = (start + offset) * EDGES_PER_TEXT
            group = texts[first : first + EDGES_PER_TEXT]
            rows = _cut(list(row), token_id)
            want += rows if len(rows) == len(group) else reference(group, False)
    have = fast(texts, False)
    return [index for index, (a, b) in enumerate(zip(want, have, strict=True)) if list(a) != list(b)]


def _cut(row: list[int], token_id: int) -> list[list[int]]:
    rows: list[list[int]] = [[]]
    for token in row:
        if token == token_id:
            rows.append([])
        else:
            rows[-1].append(token)
    return rows


def edge_separator(library: Any) -> tuple[str, int] | None:
    """A special-token string (the shortest) between whose occurrences the reference library encodes a text
    exactly as a text of its own, with its id; None where that is not known to hold.

    tiktoken encodes the pieces between special tokens one by one (its `encode`; a tekken.json's too). tokenizers
    pre-tokenizes each piece between added tokens on its own, unless the model prepends something to the first
    piece only (Metaspace's prepend_scheme "first", a Prepend normalizer: start-of-text behaviour, so edge texts are
    encoded one by one) or the token strips the whitespace beside it (lstrip/rstrip)."""
    if library.library in (TIKTOKEN, TEKKEN):
        tokens = library.spec.special_tokens if library.library == TIKTOKEN else library.special_tokens
        if not tokens:
            return None
        shortest = min(tokens, key=lambda token: (len(token), token))
        return shortest, tokens[shortest]
    if library.library != TOKENIZERS:
        return None
    document = json.loads(library.files.contents[0])
    shaped = json.dumps([document.get("normalizer"), document.get("pre_tokenizer")])
    if '"Metaspace"' in shaped or '"Prepend"' in shaped:
        return None
    candidates = [
        (added.content, token_id)
        for token_id, added in library.reference.get_added_tokens_decoder().items()
        if added.special and added.content and not (added.lstrip or added.rstrip or added.single_word)
    ]
    if not candidates:
        return None
    return min(candidates, key=lambda found: (len(found[0]), found[0]))


@functools.cache  # importlib.metadata reads and parses the package's METADATA: 3 ms a call, 18 calls a start
def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def gate_key(files: ModelFiles, encoder: str = FAST) -> dict[str, Any]:
    """What a gate verdict depends on: the fast encoders and their versions, the reference library and its
    version, the tokenizer files' bytes (not a chat template's, which the model's sha256 also covers: a new
    template is no reason to scan again), the check set, which encoders were candidates (`encoder`: fast, or
    the one pinned), their routes and the rule that chose among them."""
    return {
        "fast": encoders.versions(),
        "reference": f"{files.library} {_version(TIKTOKEN if files.library == TEKKEN else files.library)}",
        "files_sha256": files.contents_sha256,
        "checkset": checkset.VERSION,
        "select": encoder if encoder in (FASTOKENS, GIGATOKEN) else FAST,
        "rule": encoders.RULE,
        "routes": encoders.ROUTES,
    }


def cached_verdict(key: dict[str, Any]) -> dict[str, Any] | None:
    """An earlier gate's verdict for exactly this key, or None (no cache, unreadable, another key)."""
    verdict = cache.read(key)
    return verdict if verdict is not None and isinstance(verdict.get("passed"), bool) else None


def remember_verdict(
    key: dict[str, Any],
    differs: str | None,
    seconds: float,
    route: str | None = None,
    candidates: Sequence[dict[str, Any]] = (),
    checkset_ids: str | None = None,
) -> None:
    """Keep a verdict (written atomically): passed or not, the route chosen (`encoder`), what each candidate
    measured, and the digest of the check set's ids (`checkset_ids`), so a later start builds the chosen one
    without measuring again, nor loading the reference library; a cache that cannot be written is silently no
    cache."""
    verdict = {
        "key": key,
        "passed": differs is None,
        "differs": differs,
        "seconds": round(seconds, 3),
        "encoder": route if differs is None else None,
        "candidates": list(candidates),
    }
    if checkset_ids is not None:
        verdict["checkset_ids"] = checkset_ids
    cache.write(key, verdict)


def remember_mismatch(files: ModelFiles, route: str, mismatch: str) -> None:
    """Shadow verification found the fast encoder `route` giving other ids than the reference library on a text it
    served: the gate's verdict on these files becomes that refusal, for every choice that could pick the route (the
    fastest of all, and that encoder pinned). The check set had passed it; a start reading this verdict serves the
    reference library, and a new check set or encoder version (other keys) scans again."""
    differs = f"{route} differs from {files.library} on a text it served (shadow verification): {mismatch}"
    for select in dict.fromkeys((FAST, encoders.encoder_of(route) or FAST)):
        remember_verdict(gate_key(files, select), differs, 0.0)


def checkset_ids(rows: Rows, texts: list[str]) -> str:
    """A digest of the ids `rows` gives the check set in both special-token modes. Kept in a verdict that passed
    (the reference's ids and the chosen route's were the same), so a later start proves the route it builds gives
    them again without loading the reference library (`gate_verdict`)."""
    digest = hashlib.sha256(_version(SERVICE).encode())  # a new release checks its routes against the library again
    for parse_special in (False, True):
        for row in rows(texts, parse_special):
            ids = np.asarray(row, dtype="<i8")
            digest.update(len(ids).to_bytes(8, "little"))
            digest.update(ids.tobytes())
    return digest.hexdigest()


# -- what a model is, kept beside the verdicts ------------------------------------------------------------

DESCRIPTION = 1  # what a cached description holds; a new one reads no older file
SERVICE = "tokenizer-service"  # this distribution, whose version keys what the cache keeps


def description_key(files: ModelFiles) -> dict[str, Any]:
    """What a model's description (`FastEncoded.describe`) depends on: its reference library and that library's
    version, the tokenizer files' bytes and the special-token roles its files name."""
    return {
        "description": DESCRIPTION,
        "service": _version(SERVICE),  # its own code reads some of it (Meta's and Mistral's tables, vocab sizes)
        "reference": f"{files.library} {_version(TIKTOKEN if files.library == TEKKEN else files.library)}",
        "files_sha256": files.contents_sha256,
        "roles": files.special_tokens(),
    }


def _sized(found: dict[str, Any]) -> bool:
    """Whether a kept description holds a vocabulary size (all tiktoken ranks' holds)."""
    return type(found.get("vocab_size")) is int


def _whole_hf(found: dict[str, Any]) -> bool:
    """Whether a kept description holds all a tokenizer.json's does: its type, vocabulary size, special tokens and
    each role's id."""
    ids = found.get("ids")
    return (
        _sized(found)
        and isinstance(found.get("type"), str)
        and isinstance(found.get("special"), list)
        and isinstance(ids, dict)
        and all(type(ids.get(role)) is int for role in ("bos", "eos", "pad", "unk"))
    )


def cached_description(key: dict[str, Any]) -> dict[str, Any] | None:
    """The description a process that loaded these very files in the same reference library kept, or None."""
    found = cache.read(key)
    return found["description"] if found is not None and isinstance(found.get("description"), dict) else None


def _fastokens() -> Any | None:
    try:
        import fastokens
    except ImportError:
        return None
    return fastokens


def _gigatoken() -> Any | None:
    try:
        from gigatoken import gigatoken_rs
    except ImportError:
        return None
    return gigatoken_rs


def _module(encoder: str) -> Any | None:
    """The fast encoder's module (fastokens, gigatoken's gigatoken_rs), None where it is not installed."""
    return _fastokens() if encoder == FASTOKENS else _gigatoken() if encoder == GIGATOKEN else None


def _candidates(encoder: str) -> tuple[str, ...]:
    """The fast encoders `encoder` (fast, or one pinned) lets the gate try, in order."""
    return (encoder,) if encoder in (FASTOKENS, GIGATOKEN) else encoders.ENCODERS


PENDING, PASSED, REFUSED = "pending", "passed", "refused"  # a model's gate, as the announcing process sees it
NOT_INSTALLED = "fastokens is not installed"


def _not_installed(encoder: str) -> str | None:
    """Why no candidate of `encoder` (fast, or one pinned) can run here, None where one is installed."""
    candidates = _candidates(encoder)
    if any(importlib.util.find_spec(name) is not None for name in candidates):
        return None
    return NOT_INSTALLED if candidates == encoders.ENCODERS else f"{candidates[0]} is not installed"


def announced_gate(files: ModelFiles, encoder: str = FAST) -> tuple[str | None, str | None]:
    """(the gate's state, what differs) for a process that announces a model without encoding it: PASSED or
    REFUSED from the cached verdict, PENDING where there is none (to be scanned beside the work), None where
    no gate applies (SentencePiece, `encoder` reference). Loads nothing: no fast encoder is even imported.
    `cached_route` names the route a PASSED verdict chose."""
    if encoder == REFERENCE or files.library not in (TOKENIZERS, TIKTOKEN, TEKKEN):
        return None, None
    missing = _not_installed(encoder)
    if missing is not None:
        return REFUSED, missing
    verdict = cached_verdict(gate_key(files, encoder))
    if verdict is None:
        return PENDING, None
    return (PASSED, None) if verdict["passed"] else (REFUSED, verdict["differs"])


def cached_route(files: ModelFiles, encoder: str = FAST) -> str | None:
    """The fast encoder's route (``gigatoken``, ``fastokens(converted)``...) a cached passing verdict chose."""
    verdict = cached_verdict(gate_key(files, encoder))
    if verdict is None or not verdict["passed"]:
        return None
    return verdict.get("encoder") if encoders.is_fast(verdict.get("encoder")) else None


def refusal_line(path: Path, library: str, differs: str) -> str:
    """The warning, logged once, of a model the gate refused (its `library` encodes it): what each candidate
    found (`fastokens differs from tiktoken (code point U+180E ...)`, `gigatoken cannot load it (...)`)."""
    return f"{path}: {differs}; encoding with {library}"


# Tests only (tests/test_gate_background.py): a directory where each process notes every model it loads and every
# fast encoder it builds, one line each ("PID PROCESS-NAME load|fast FILE"): what counts loads per process.
COUNT_ENV = "TOKENIZER_TEST_COUNT_LOADS"


def _count(kind: str, files: ModelFiles) -> None:
    directory = os.environ.get(COUNT_ENV)
    if directory:
        with open(Path(directory) / "loads.txt", "a") as file:
            name = multiprocessing.current_process().name
            file.write(f"{os.getpid()} {name} {kind} {files.main.name}\n")


def _build_fast(library: Any, route: str = FASTOKENS) -> tuple[Any | None, str | None]:
    """The fast encoder `route` of `library`'s model, built and made to encode a probe text in both
    special-token modes, else (None, why not). Whatever it raises is a fallback: pyo3's PanicException (a
    BaseException, which gigatoken raises on ranks where some tokens are not the merge of two) included."""
    encoder = encoders.encoder_of(route) or FASTOKENS
    module = _module(encoder)
    if module is None:
        return None, f"{encoder} is not installed"
    _count("fast", library.files)
    try:
        fast = library._build_fast(module, route)
        for parse_special in (False, True):
            fast.encode_batch_flat(["probe: a b 1"], add_special_tokens=False, split_special_tokens=not parse_special)
        return fast, None
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as exc:  # a model it does not support (a normalizer, a pattern, the ranks), pyo3's panics
        return None, f"{encoder} cannot load it ({type(exc).__name__}: {exc})".splitlines()[0]


def _safe_rows(fast: Any) -> Rows:
    """`_fast_rows`, with whatever the encoder raises (a panic, a BaseException) as an Exception: the gate's."""
    rows = _fast_rows(fast)

    def safe(texts: list[str], parse_special: bool) -> list[list[int]]:
        try:
            return rows(texts, parse_special)
        except (KeyboardInterrupt, SystemExit, GeneratorExit):
            raise
        except Exception:
            raise
        except BaseException as exc:
            raise RuntimeError(f"{type(exc).__name__}: {exc}") from exc

    return safe


class _Remembered:
    """The reference library's rows of each batch, kept (flat int32) for the next candidate's scan: every
    candidate is checked against the same texts, and the reference library is the scan's dearest part."""

    def __init__(self, rows: Rows) -> None:
        self.rows = rows
        self.kept: dict[tuple[bool, bytes], tuple[np.ndarray, np.ndarray]] = {}

    def __call__(self, texts: list[str], parse_special: bool) -> list[list[int]]:
        digest = hashlib.blake2b(b"\0".join(text.encode("utf-8", "surrogatepass") for text in texts)).digest()
        found = self.kept.get((parse_special, digest))
        if found is None:
            rows = self.rows(texts, parse_special)
            ids, lengths = flatten(rows)
            self.kept[(parse_special, digest)] = (ids, ragged_offsets(lengths))
            return rows
        ids, offsets = found
        return [ids[offsets[i] : offsets[i + 1]].tolist() for i in range(len(offsets) - 1)]


def _try_candidates(library: Any, encoder: str, texts: list[str]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every candidate route of `encoder` (fast: all of them) through the whole gate, and each one that passed
    measured: M tokens per CPU-second on `encoders.sample_texts`, the growth of this process's resident memory
    while it was built and encoded the sample, its build time. A route the encoder cannot load goes on to the
    converted ranks (tiktoken); one that passed, to a route measured beside it (a tokenizer.json as ranks).
    `texts`: the model's check set. (what each measured, {route: the built encoder of
    each that passed})."""
    reference: Rows = library._reference_rows
    candidates = _candidates(encoder)
    if len(candidates) > 1:
        reference = _Remembered(reference)
    special, separator = library.special, edge_separator(library)
    sample = encoders.sample_texts()
    single_threaded()  # measured as a worker runs it
    results: list[dict[str, Any]] = []
    built: dict[str, Any] = {}
    for candidate in candidates:
        if _module(candidate) is None:
            results.append({"route": candidate, "passed": False, "differs": f"{candidate} is not installed"})
            continue
        passed_one = False
        for route in encoders.routes(library, candidate):
            if passed_one and not encoders.measured_beside(route):
                break
            before, started = encoders.rss_mib(), time.perf_counter()
            fast, differs = _build_fast(library, route)
            load_seconds = time.perf_counter() - started
            if fast is None:
                results.append({"route": route, "passed": False, "differs": differs})
                continue  # the converted ranks next, where there are

            def encode(texts: Sequence[str], fast: Any = fast) -> int:
                return len(_fast_flat(fast, texts, False)[0])

            try:
                encode(sample)  # what a worker holds once it has encoded: measured before the scan allocates
            except (KeyboardInterrupt, SystemExit, GeneratorExit):
                raise
            except BaseException as exc:
                results.append({"route": route, "passed": False, "differs": f"{route} failed on the sample ({exc!r})"})
                break
            rss = max(0.0, encoders.rss_mib() - before)  # this process's: a fresh one measures it below
            rows = _safe_rows(fast)
            found = gate(str(library.files.path), reference, rows, texts)
            if found is None:
                found = scan(reference, rows, special, separator)
            if found is not None:
                results.append(
                    {"route": route, "passed": False, "differs": f"{route} differs from {library.library} ({found})"}
                )
                break
            measured = _measure_apart(library.files, route)
            if measured is not None:
                rss, mtps, load_seconds = measured
            else:  # no process could be started: measured here (memory freed earlier may hide some of it)
                mtps = encoders.tokens_per_cpu_second(encode, encoders.as_read(fast, sample))
            results.append(
                {"route": route, "passed": True, "differs": None, "mtps": round(mtps, 3), "rss_mib": round(rss, 1),
                 "load_seconds": round(load_seconds, 3)}
            )  # fmt: skip
            built[route] = fast
            passed_one = True  # a route measured beside it (gigatoken(ranks)) next, where there is one
    passed = [result for result in results if result["passed"]]
    if len(passed) > 1:  # their speeds measured side by side, where apart they were measured at other moments
        raced = _race_apart(library.files, [result["route"] for result in passed])
        for result in passed:
            if raced is not None and result["route"] in raced:
                result["mtps"] = round(raced[result["route"]], 3)
    return results, built


def _measure_apart(files: ModelFiles, route: str) -> tuple[float, float, float] | None:
    """(resident MiB, M tokens per CPU-second, build seconds) of the fast encoder `route` in a fresh process, as a
    worker holds and runs it: the process's growth from the reference library loaded to the encoder built and
    the sample encoded once, then the best of three passes over the sample; None where it could not run."""
    found = _run_apart("_measure_main", (files, route))
    return (float(found[0]), float(found[1]), float(found[2])) if isinstance(found, list) else None


RACE_ROUNDS = 5


def _race_apart(files: ModelFiles, routes: list[str]) -> dict[str, float] | None:
    """M tokens per CPU-second of each fast encoder route in `routes`, measured in one fresh process in turns (a
    pass of each over the sample, RACE_ROUNDS times, the order reversed every other round), the median of its
    passes: two routes measured in processes of their own at different moments of a shared machine differed by
    40% where side by side they differ by 10%. None where no process could be started."""
    found = _run_apart("_race_main", (files, routes))
    if not isinstance(found, dict):
        return None
    return {str(route): float(mtps) for route, mtps in found.items()}


def race(built: dict[str, Any], texts: list[str], rounds: int = RACE_ROUNDS) -> dict[str, float]:
    """The median M tokens per CPU-second of each built fast encoder (route -> encoder) over `texts`, a pass of each
    in turn, `rounds` times, the order reversed every other round (each warmed by one pass first, as a worker is
    once it has encoded): the gate's race (`_race_apart`), and bench/encoder_race.py's."""
    read = {route: encoders.as_read(fast, texts) for route, fast in built.items()}
    for route, fast in built.items():
        _fast_flat(fast, read[route], False)
    passes: dict[str, list[float]] = {route: [] for route in built}
    order = list(built)
    for round_ in range(rounds):
        for route in order if round_ % 2 == 0 else reversed(order):

            def encode(texts: Sequence[str], fast: Any = built[route]) -> int:
                return len(_fast_flat(fast, texts, False)[0])

            passes[route].append(encoders.tokens_per_cpu_second(encode, read[route], 1))
    return {route: statistics.median(speeds) for route, speeds in passes.items()}


def _started_apart(name: str) -> tuple[Any, Library, list[str]]:
    """In a measuring process (`_run_apart`): named `name`, single-threaded and nice as a worker's neighbour;
    (what its starter pickled on stdin besides the files, the model's reference library, the gate's sample)."""
    import pickle
    import sys

    multiprocessing.current_process().name = name
    single_threaded()
    with contextlib.suppress(OSError):
        os.nice(19)
    files, argument = pickle.loads(sys.stdin.buffer.read())  # from the process that started this one
    return argument, LIBRARIES[files.library].variant(files)(files, REFERENCE), encoders.sample_texts()


def _race_main() -> None:
    """The racing process (`_race_apart`): (files, routes) pickled on stdin, {route: M tokens per CPU-second}
    on stdout."""
    routes, library, sample = _started_apart("tokenizer-gate-race")
    built = {route: fast for route in routes if (fast := _build_fast(library, route)[0]) is not None}
    print(json.dumps(race(built, sample)), flush=True)


def _run_apart(main: str, argument: Any) -> Any:
    """What `main` of this module prints last (JSON), run in a fresh Python process given `argument` pickled on
    stdin; None where it could not run. A plain subprocess: the background scan is a daemonic process, which
    multiprocessing lets have no children."""
    import pickle
    import subprocess
    import sys

    command = [sys.executable, "-c", f"from tokenizer_service.core import libraries; libraries.{main}()"]
    try:
        done = subprocess.run(command, input=pickle.dumps(argument), capture_output=True, timeout=600, check=False)
        return json.loads(done.stdout.decode().strip().splitlines()[-1]) if done.returncode == 0 else None
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


def _measure_main() -> None:
    """The measuring process (`_measure_apart`): (files, route) pickled on stdin, the measurements on stdout."""
    route, library, sample = _started_apart("tokenizer-gate-measure")
    before, started = encoders.rss_mib(), time.perf_counter()
    fast, _ = _build_fast(library, route)
    seconds = time.perf_counter() - started
    if fast is None:
        print(json.dumps(None))
        return

    def encode(texts: Sequence[str]) -> int:
        return len(_fast_flat(fast, texts, False)[0])

    encode(sample)
    rss = max(0.0, encoders.rss_mib() - before)
    print(
        json.dumps([rss, encoders.tokens_per_cpu_second(encode, encoders.as_read(fast, sample)), seconds]), flush=True
    )


def _refusal(results: Sequence[dict[str, Any]], pinned: bool) -> str:
    """What each candidate found, in one line, for a model no candidate serves."""
    parts = []
    for result in results:
        if result["passed"] and not pinned:
            parts.append(
                f"{result['route']} holds {result['rss_mib']:.0f} MiB a process, "
                f"over the {encoders.MEMORY_BOUND_MIB} MiB bound"
            )
        elif not result["passed"]:
            parts.append(str(result["differs"]))
    return "; ".join(parts) or "no fast encoder"


def gate_verdict(
    library: Any,
    trusted: bool = False,
    report: Callable[[str | None, float, str | None], None] | None = None,
    encoder: str = FAST,
) -> tuple[Any | None, str | None, str | None]:
    """(the fast encoder, None, its route) when one passes the gate for `library`'s model, else (None, what
    each candidate found, None). `encoder`: fast (every candidate, then the rule: `encoders.choose`), one pinned
    (fastokens, gigatoken: its routes only), or a route (``gigatoken(converted)``: that one, trusted).

    The gate: each candidate loads the model, gives the reference ids on the check set (both modes), then on
    every code point and special-token string (`scan`); those that pass are measured and the rule picks one.
    The verdict (a refusal too), with the route chosen and every candidate's measurements, is remembered in the
    cache (`cache_dir`) by `gate_key`: a cached refusal builds nothing, a cached pass builds the chosen route
    and runs the check set only. One process scans a key at a time (a lock file beside the verdict): another
    one that wants the same verdict waits for it. `trusted`: the process that announced the model passed the
    whole gate on these very files (a worker): the check set only, nothing cached. `report(differs, seconds,
    route)` hears a verdict as it is settled (scanned or read), before it is remembered. Logs nothing."""
    select = encoder if encoder in (FASTOKENS, GIGATOKEN) or encoders.is_fast(encoder) else FAST
    if encoders.is_fast(select) and select not in (FASTOKENS, GIGATOKEN):
        trusted = True  # a route: the announcing process chose it through the whole gate
    key = None if trusted else gate_key(library.files, select)
    verdict = None if key is None else cached_verdict(key)
    if verdict is not None and not verdict["passed"]:
        if report is not None:
            report(verdict["differs"], 0.0, None)
        return None, verdict["differs"], None
    if trusted or verdict is not None:
        chosen = select if trusted and select != FAST and select not in (FASTOKENS, GIGATOKEN) else None
        if chosen is None and verdict is not None:
            chosen = verdict.get("encoder") if encoders.is_fast(verdict.get("encoder")) else None
        if chosen is None and trusted:
            chosen = cached_route(library.files, select)
        # without a route chosen, each encoder's routes in turn as fallbacks; a route measured beside another (a
        # tokenizer.json as ranks) is served only where a scan chose it
        names = (
            [chosen]
            if chosen
            else [
                name
                for candidate in _candidates(select)
                for name in encoders.routes(library, candidate)
                if not encoders.measured_beside(name)
            ]
        )
        differs: str | None = None
        texts: list[str] | None = None
        kept_key, kept = _passed_verdict(library.files, key, verdict, select)
        for name in names:
            fast, differs = _build_fast(library, name)
            if fast is not None:
                texts = check_texts(library) if texts is None else texts
                ours = kept is not None and kept["encoder"] == name
                recorded = kept.get("checkset_ids") if kept is not None and ours else None
                differs, digest = _check_set(library, fast, texts, recorded)
                if differs is None:
                    if kept_key is not None and kept is not None and ours and digest != recorded:
                        # a verdict from before digests (or a stale one): kept with this one, so the next start
                        # needs no reference library
                        cache.write(kept_key, {**kept, "checkset_ids": digest})
                    if report is not None:
                        report(None, 0.0, name)
                    return fast, None, name
                differs = f"{name} differs from {library.library} ({differs})"
        if report is not None:
            report(differs, 0.0, None)
        return None, differs, None
    missing = _not_installed(select)
    if missing is not None:
        return None, missing, None  # not a verdict on the model: never remembered
    started = time.monotonic()
    assert key is not None
    with _scan_lock(key):
        verdict = cached_verdict(key)  # another process may have scanned it while this one waited
        if verdict is not None:
            return gate_verdict(library, trusted, report, select)
        texts = check_texts(library)  # for ranks: 0.6 s of finding the tokens that are no merge of two (Llama 3)
        results, built = _try_candidates(library, select, texts)
        route = encoders.choose(results, pinned=select != FAST)
        differs = None if route is not None else _refusal(results, select != FAST)
        seconds = time.monotonic() - started
        if report is not None:
            report(differs, seconds, route)
        fast = built.get(route) if route else None
        digest = checkset_ids(_safe_rows(fast), texts) if fast is not None else None
        remember_verdict(key, differs, seconds, route, results, digest)
        return fast, differs, route


def _passed_verdict(
    files: ModelFiles, key: dict[str, Any] | None, verdict: dict[str, Any] | None, select: str
) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(its key, the verdict) that passed a fast encoder for these files: `verdict` read for `key`, else (a worker
    told its route) the one the announcing process read, for its candidates or every one; else (None, None)."""
    keys = [key] if key is not None else [gate_key(files, select), gate_key(files, FAST)]
    for found_key in keys:
        found = verdict if found_key is key and verdict is not None else cached_verdict(found_key)
        if found is not None and found["passed"]:
            return found_key, found
    return None, None


def _check_set(library: Any, fast: Any, texts: list[str], recorded: str | None) -> tuple[str | None, str | None]:
    """(None, the digest of its ids) when the route `fast`, built again for a model whose gate passed it, gives the
    check set's ids: those whose digest its verdict kept (`recorded`; the reference library need not load), else
    the reference library's. A digest that differs is checked against the reference library, which says what
    differs: (what differs, None)."""
    rows = _safe_rows(fast)
    if recorded is not None:
        try:
            if checkset_ids(rows, texts) == recorded:
                return None, recorded
        except Exception:  # the gate below runs it again and says what it raised
            pass
    differs = gate(str(library.files.path), library._reference_rows, rows, texts)
    return differs, (checkset_ids(rows, texts) if differs is None else None)


@contextlib.contextmanager
def _scan_lock(key: dict[str, Any]) -> Any:
    """Held while a key is scanned (an exclusive lock on a file beside its verdict); no cache, no lock."""
    try:
        import fcntl

        path = cache.cache_file(key).with_suffix(".lock")
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path, "a+b")  # noqa: SIM115  # closed below, after the lock
    except (ImportError, OSError):
        yield
        return
    with handle:
        with contextlib.suppress(OSError):
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _adopt_fast(library: Any, trusted: bool = False, encoder: str = FAST, keep_reference: bool = False) -> bool:
    """Put the fast encoder in front of `library` if one passes the gate (`gate_verdict`; `encoder` fast, one
    pinned, or the route a worker was told); else log why not, once. On success the reference library's copy is
    dropped unless `keep_reference` (loaded again only to decode or verify) and `library.encoder` names the route."""
    fast, differs, route = gate_verdict(library, trusted, encoder=encoder)
    if fast is None:
        logger.warning("%s", refusal_line(library.files.path, library.library, differs or "?"))
        return False
    library.fast, library.encoder = fast, route
    if not keep_reference:
        library._reference = None
    library._fast_adopted()
    return True


def plant_difference(library: Library, point: int) -> None:
    """Tests only (PLANT_ENV): the fast encoder gives one wrong id in each text holding `point`."""
    fast = getattr(library, "fast", None)
    if fast is not None:
        library.fast = _Planted(fast, chr(point))  # type: ignore[attr-defined]


class _Planted:
    def __init__(self, fast: Any, char: str) -> None:
        self.inner, self.char = fast, char

    def encode_batch_flat(self, texts: list[str], **options: Any) -> tuple[Any, Any]:
        ids, offsets = self.inner.encode_batch_flat(texts, **options)
        bounds = np.frombuffer(offsets, dtype="<u8")
        changed = np.frombuffer(ids, dtype="<u4").copy()
        for index, text in enumerate(texts):
            if self.char in text and bounds[index + 1] > bounds[index]:
                changed[bounds[index]] ^= 1
        return changed.tobytes(), offsets


class FastEncoded:
    """A library a fast encoder may serve (`encoders.build` builds it): its reference library's copy is dropped
    once one does (`_adopt_fast`) and loaded again when something needs it (a decode, a shadow check). A model
    described before by the same library (`_described`) does not load it at all until then."""

    files: ModelFiles
    _reference: Any | None = None

    def _load_reference(self) -> Any:
        raise NotImplementedError

    def _new_reference(self) -> Any:
        _count("reference", self.files)
        return self._load_reference()

    @property
    def reference(self) -> Any:
        if self._reference is None:  # dropped after the gate passed, or never loaded: loaded for a decode or a check
            self._reference = self._new_reference()
        return self._reference

    def _described(
        self, describe: Callable[[Any], dict[str, Any]], whole: Callable[[dict[str, Any]], bool] = lambda found: True
    ) -> dict[str, Any]:
        """What `describe` reads from the reference library of the model (its vocabulary size, special tokens' ids),
        kept beside the gate's verdicts (`description_key`): a later process reads it there instead of loading the
        library (0.3-0.5 s for a 128k tokenizer.json), which then loads only when something encodes or decodes
        with it. Loaded here, the library is kept. A kept description that is not `whole` is read again."""
        key = description_key(self.files)
        found = cached_description(key)
        if found is not None and whole(found):
            return found
        self._reference = self._new_reference()
        described = describe(self._reference)  # a ModelLoadError here: nothing kept
        cache.write(key, {"key": key, "description": described})
        return described

    def _build_fast(self, module: Any, route: str) -> Any:
        return encoders.build(self, route, module)


# -- Hugging Face tokenizers ------------------------------------------------------------------------------

REFERENCE_GROUP_CHARS = 1 << 20
# tokenizers holds about 170 bytes per byte of text while it encodes one (offsets, tokens, word ids):
# a text encoded by tokenizers itself is refused above this (a 4 MiB text: about 0.7 GiB in a worker)
REFERENCE_MAX_TEXT_CHARS = 4 << 20


class HuggingFace(FastEncoded, Library):
    library = TOKENIZERS

    def __init__(self, files: ModelFiles, encoder: str = FAST, trusted: bool = False) -> None:
        self.files = files
        outline = json_outline(files.contents[0], files.main_sha256)  # kept: the file is not parsed again
        if outline is None or outline["library"] != TOKENIZERS:
            raise ModelLoadError(f"{files.main} is not a tokenizer.json")
        if outline["dropout"] not in (None, 0, 0.0):
            raise ModelLoadError(
                f"{files.main}: BPE dropout ({outline['dropout']}) makes its ids random; set "
                '"dropout": null in the file to serve it'
            )
        described = self._described(
            lambda reference: self._describe(parsed_json(files.contents[0]), reference), _whole_hf
        )
        self.type, self.vocab_size, ids = described["type"], described["vocab_size"], described["ids"]
        self.bos_id, self.eos_id, self.pad_id, self.unk_id = ids["bos"], ids["eos"], ids["pad"], ids["unk"]
        self.normalizes = bool(outline["normalizer"])
        self.special: list[str] = described["special"]
        self._holes: frozenset[int] | None = None
        self.fast: Any | None = None
        self.encoder = TOKENIZERS
        self.max_text_chars = REFERENCE_MAX_TEXT_CHARS
        if encoder != REFERENCE:
            _adopt_fast(self, trusted, encoder)

    def _describe(self, document: dict[str, Any], reference: Any) -> dict[str, Any]:
        ids: dict[str, int] = {}
        for role, token in self.files.special_tokens().items():
            if token is None:
                ids[role] = -1
                continue
            found = reference.token_to_id(token)
            if found is None:
                raise ModelLoadError(
                    f"{self.files.files[-1]} names {role}_token {token!r}, which {self.files.main} does not have"
                )
            ids[role] = found
        return {
            "type": hf_model_type(document, reference),
            "vocab_size": hf_vocab_size(document, reference),
            "ids": ids,
            "special": [added.content for added in reference.get_added_tokens_decoder().values()],
        }

    def _load_reference(self) -> Any:
        import tokenizers

        try:
            reference = tokenizers.Tokenizer.from_str(self.files.contents[0].decode("utf-8"))
        except Exception as exc:  # the library's own parse error, whatever its type
            raise ModelLoadError(f"{self.files.main} is not a tokenizer.json that tokenizers can load: {exc}") from exc
        reference.no_truncation()
        reference.no_padding()
        return reference

    def _fast_adopted(self) -> None:
        self.max_text_chars = None

    def fall_back(self, mismatch: str | None = None) -> None:
        super().fall_back(mismatch)
        self.max_text_chars = REFERENCE_MAX_TEXT_CHARS

    def reference_rows(self, texts: list[str], parse_special: bool) -> list[list[int]]:
        return self._reference_rows(texts, parse_special)

    def _reference_rows(self, texts: list[str], parse_special: bool) -> list[list[int]]:
        reference = self.reference
        reference.encode_special_tokens = not parse_special
        # encode_batch_fast (tokenizers 0.21+): the same ids, without the offsets nobody reads here
        encode = getattr(reference, "encode_batch_fast", reference.encode_batch)
        return [encoding.ids for encoding in encode(texts, add_special_tokens=False)]

    def encode_plain(self, texts: list[str], parse_special: bool) -> Encoded:
        if self.fast is not None:
            return _fast_flat(self.fast, texts, parse_special)
        # tokenizers keeps an Encoding (offsets, tokens, masks) of every text of a batch alive: encoded a
        # group of about 1 MiB of text at a time, so its memory is bounded by the group, not the request
        id_parts, length_parts, group, size = [], [], [], 0
        for text in texts:
            group.append(text)
            size += len(text)
            if size >= REFERENCE_GROUP_CHARS:
                ids, lengths = flatten(self._reference_rows(group, parse_special))
                id_parts.append(ids)
                length_parts.append(lengths)
                group, size = [], 0
        if group or not id_parts:
            ids, lengths = flatten(self._reference_rows(group, parse_special))
            id_parts.append(ids)
            length_parts.append(lengths)
        if len(id_parts) == 1:
            return id_parts[0], length_parts[0]
        return np.concatenate(id_parts), np.concatenate(length_parts)

    def decode(self, rows: list[list[int]]) -> list[str]:
        if not rows:
            return []
        reference = self.reference
        holes = self._holes
        if holes is None:  # ids below vocab_size that no token has (a vocabulary with gaps): found once
            size = self.vocab_size
            self._holes = holes = frozenset(i for i in range(size) if reference.id_to_token(i) is None)
        if holes:
            for index, row in enumerate(rows):
                missing = next((i for i in row if i in holes), None)
                if missing is not None:
                    raise InvalidField(
                        f"ids[{index}] holds {missing}, an id no token of this model has", field="ids", index=index
                    )
        return list(reference.decode_batch(rows, skip_special_tokens=False))


def _fast_rows(fast: Any) -> Callable[[list[str], bool], list[list[int]]]:
    def rows(texts: list[str], parse_special: bool) -> list[list[int]]:
        ids, lengths = _fast_flat(fast, texts, parse_special)
        offsets = ragged_offsets(lengths)
        return [ids[offsets[i] : offsets[i + 1]].tolist() for i in range(len(texts))]

    return rows


def _fast_flat(fast: Any, texts: Sequence[str], parse_special: bool) -> Encoded:
    if not texts:
        return np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.int64)
    ids, offsets = fast.encode_batch_flat(texts, add_special_tokens=False, split_special_tokens=not parse_special)
    lengths = np.diff(np.frombuffer(offsets, dtype="<u8")).astype(np.int64)
    return np.frombuffer(ids, dtype="<u4").view(np.int32), lengths  # ids < 2**31: the same bytes


# -- tiktoken ---------------------------------------------------------------------------------------------


def tiktoken_rows(encoding: Any, texts: list[str], parse_special: bool) -> list[list[int]]:
    """A tiktoken encoding's ids of each text: `encode(text, allowed_special="all")` when special-token strings
    are parsed, else `encode_ordinary(text)` (tiktoken ranks and Tekken alike)."""
    if parse_special:
        return [encoding.encode(text, allowed_special="all") for text in texts]
    return [encoding.encode_ordinary(text) for text in texts]


class Tiktoken(FastEncoded, Library):
    library = TIKTOKEN

    @classmethod
    def variant(cls, files: ModelFiles) -> type[Library]:
        """Meta's files (a known Llama 3 or 4 encoding) are encoded as Meta's own Tokenizer encodes them."""
        return MetaTiktoken if tiktoken_spec(files).encoding in META_ENCODINGS else cls

    def __init__(self, files: ModelFiles, encoder: str = FAST, trusted: bool = False) -> None:
        self.files = files
        self.spec = tiktoken_spec(files)
        self.type = "bpe"
        described = self._described(lambda reference: {"vocab_size": reference.n_vocab}, _sized)
        self.vocab_size = described["vocab_size"]
        ids = {"unk": -1}
        for role, token in self.spec.tokens.items():
            if token is None:
                ids[role] = -1
            elif token in self.spec.special_tokens:
                ids[role] = self.spec.special_tokens[token]
            else:
                raise ModelLoadError(
                    f"{files.path}: {role}_token {token!r} is not among its special tokens "
                    f"({', '.join(sorted(self.spec.special_tokens)) or 'none'})"
                )
        self.bos_id, self.eos_id, self.pad_id, self.unk_id = ids["bos"], ids["eos"], ids["pad"], ids["unk"]
        self.normalizes = False
        self.fast: Any | None = None
        self.encoder = TIKTOKEN
        if encoder != REFERENCE:
            _adopt_fast(self, trusted, encoder)

    def _load_reference(self) -> Any:
        import tiktoken

        ranks = tiktoken_ranks(self.files.contents[0], self.files.main)
        taken = set(ranks.values())
        overlap = sorted(token for token, rank in self.spec.special_tokens.items() if rank in taken)
        if overlap:
            raise ModelLoadError(
                f"{self.files.path}: special token {overlap[0]!r} has id {self.spec.special_tokens[overlap[0]]}, "
                "which an ordinary token already has; special tokens need ids of their own"
            )
        try:
            return tiktoken.Encoding(
                self.spec.encoding or self.files.main.stem,
                pat_str=self.spec.pat_str,
                mergeable_ranks=ranks,
                special_tokens=self.spec.special_tokens,
            )
        except ValueError as exc:  # a bad pattern, ranks and special tokens that overlap
            raise ModelLoadError(f"{self.files.path}: tiktoken cannot load it: {exc}") from exc

    @property
    def special(self) -> list[str]:
        return list(self.spec.special_tokens)

    def reference_rows(self, texts: list[str], parse_special: bool) -> list[list[int]]:
        return self._reference_rows(texts, parse_special)

    def _reference_rows(self, texts: list[str], parse_special: bool) -> list[list[int]]:
        return tiktoken_rows(self.reference, texts, parse_special)

    def encode_plain(self, texts: list[str], parse_special: bool) -> Encoded:
        if self.fast is not None:
            return _fast_flat(self.fast, texts, parse_special)
        return flatten(self._reference_rows(texts, parse_special))

    def decode(self, rows: list[list[int]]) -> list[str]:
        reference = self.reference
        texts = []
        for index, row in enumerate(rows):
            try:
                texts.append(reference.decode(row))
            except KeyError:  # an id in a gap of the ranks: no token has it
                missing = next((i for i in row if not _has_token(reference, i)), None)
                raise InvalidField(
                    f"ids[{index}] holds {missing}, an id no token of this model has", field="ids", index=index
                ) from None
        return texts


def _has_token(encoding: Any, token: int) -> bool:
    try:
        encoding.decode_single_token_bytes(token)
    except KeyError:
        return False
    return True


# -- Meta's Llama 3 and Llama 4 ranks ---------------------------------------------------------------------

# llama_models' Tokenizer.encode cuts a text before tiktoken sees it: into chunks of TIKTOKEN_MAX_ENCODE_CHARS,
# each cut again inside every run of more than MAX_NO_WHITESPACES_CHARS whitespace or non-whitespace characters
# (str.isspace, which Python's \s matches exactly), every that many characters; the pieces are encoded one by one.
META_MAX_CHARS, META_MAX_RUN = 400_000, 25_000
_LONG_RUN = re.compile(rf"\s{{{META_MAX_RUN + 1},}}|\S{{{META_MAX_RUN + 1},}}")


def meta_pieces(text: str) -> list[str]:
    """The pieces Meta's `Tokenizer.encode` encodes one by one (`_split_whitespaces_or_nonwhitespaces` of each
    400,000-character chunk): the text itself unless it is longer than 25,000 characters."""
    if len(text) <= META_MAX_RUN:
        return [text]
    pieces = []
    for start in range(0, len(text), META_MAX_CHARS):
        chunk = text[start : start + META_MAX_CHARS]
        cuts = [0]
        for run in _LONG_RUN.finditer(chunk):
            cuts.extend(range(run.start() + META_MAX_RUN, run.end(), META_MAX_RUN))
        cuts.append(len(chunk))
        pieces += [chunk[first:last] for first, last in itertools.pairwise(cuts)]
    return pieces


class MetaTiktoken(Tiktoken):
    """Meta's ranks (`tokenizer.model` of Llama 3 or 4, or a sidecar's "like"): ids exactly Meta's
    `Tokenizer.encode(text, bos=False, eos=False, allowed_special=set())` (or "all" with parse_special_tokens),
    which is tiktoken's on every text but those over 25,000 characters that `meta_pieces` cuts."""

    def _pieced(self, encode: Callable[[list[str], bool], Encoded], texts: list[str], parse_special: bool) -> Encoded:
        if all(len(text) <= META_MAX_RUN for text in texts):
            return encode(texts, parse_special)
        pieces, owners = [], []
        for index, text in enumerate(texts):
            for piece in meta_pieces(text):
                pieces.append(piece)
                owners.append(index)
        ids, lengths = encode(pieces, parse_special)  # a text's pieces are side by side: its ids are too
        return ids, np.bincount(np.asarray(owners, dtype=np.int64), weights=lengths, minlength=len(texts)).astype(
            np.int64
        )

    def _reference_rows(self, texts: list[str], parse_special: bool) -> list[list[int]]:
        if all(len(text) <= META_MAX_RUN for text in texts):
            return super()._reference_rows(texts, parse_special)
        plain = super()._reference_rows

        def rows(pieces: list[str], parse: bool) -> Encoded:
            return flatten(plain(pieces, parse))

        return [row.tolist() for row in flatten_rows(*self._pieced(rows, texts, parse_special))]

    def encode_plain(self, texts: list[str], parse_special: bool) -> Encoded:
        return self._pieced(super().encode_plain, texts, parse_special)


# -- Mistral's tekken.json --------------------------------------------------------------------------------


class Tekken(FastEncoded, Library):
    """A tekken.json, encoded as mistral-common's Tekkenizer encodes a text (`encode(text, bos=False, eos=False)`):
    tiktoken over the vocabulary's ranks shifted past the special tokens, which it never matches in text; with
    parse_special_tokens every special-token string (fillers included) is its id, as tiktoken's
    `encode(text, allowed_special="all")` matches them. Decoded as `Tekkenizer.decode(ids,
    special_token_policy=SpecialTokenPolicy.KEEP)`: special tokens as their strings. mistral-common itself
    (which pulls pillow, pycountry and an older numpy) is the tests' reference, not a dependency.

    Its fast encoders are the converted routes (`encoders.routes`: the shifted ranks as a byte-level BPE
    tokenizer.json, the special tokens as added tokens at ids 0..n-1), behind the same gate as tiktoken ranks:
    until one passes, and after a fall back, tiktoken encodes (`encoder` "tiktoken")."""

    library = TEKKEN

    def __init__(self, files: ModelFiles, encoder: str = FAST, trusted: bool = False) -> None:
        self.files = files
        self.spec = tekken_spec(files)
        self.type = "bpe"
        self.vocab_size = self.spec.vocab_size
        self.num_special = self.spec.num_special
        ids = self.special_tokens
        self.bos_id, self.eos_id, self.pad_id, self.unk_id = (
            ids[token] if token is not None else -1
            for token in (self.spec.tokens[r] for r in ("bos", "eos", "pad", "unk"))
        )
        self.normalizes = False
        self.encoder = TIKTOKEN
        self._described(lambda reference: {})  # tiktoken loads these files (or said why not) once
        self.fast: Any | None = None
        if encoder != REFERENCE:
            _adopt_fast(self, trusted, encoder)

    @property
    def special_tokens(self) -> dict[str, int]:
        """Each special-token string (fillers included) and its id, 0..num_special - 1."""
        return {token: index for index, token in enumerate(self.spec.special)}

    @property
    def special(self) -> list[str]:
        return list(self.spec.special)

    def _load_reference(self) -> Any:
        import tiktoken

        try:
            return tiktoken.Encoding(
                self.files.main.name.removesuffix(".json"),
                pat_str=self.spec.pattern,
                mergeable_ranks=self.spec.ranks(),
                special_tokens=self.special_tokens,
            )
        except ValueError as exc:  # a pattern tiktoken's regex engine refuses
            raise ModelLoadError(f"{self.files.path}: tiktoken cannot load it: {exc}") from exc

    def fall_back(self, mismatch: str | None = None) -> None:
        super().fall_back(mismatch)
        self.encoder = TIKTOKEN  # what encodes it then, as before any fast encoder

    def reference_rows(self, texts: list[str], parse_special: bool) -> list[list[int]]:
        return self._reference_rows(texts, parse_special)

    def _reference_rows(self, texts: list[str], parse_special: bool) -> list[list[int]]:
        return tiktoken_rows(self.reference, texts, parse_special)

    def encode_plain(self, texts: list[str], parse_special: bool) -> Encoded:
        if self.fast is not None:
            return _fast_flat(self.fast, texts, parse_special)
        return flatten(self._reference_rows(texts, parse_special))

    def decode(self, rows: list[list[int]]) -> list[str]:
        """Runs of ordinary ids decoded together (invalid UTF-8 replaced), special ids as their strings."""
        reference, special, shift = self.reference, self.spec.special, self.num_special
        texts = []
        for row in rows:
            parts, run = [], []
            for token in row:
                if token < shift:
                    if run:
                        parts.append(reference.decode(run))
                        run = []
                    parts.append(special[token])
                else:
                    run.append(token)
            if run:
                parts.append(reference.decode(run))
            texts.append("".join(parts))
        return texts


LIBRARIES: dict[str, type[Library]] = {
    SENTENCEPIECE: SentencePiece,
    TOKENIZERS: HuggingFace,
    TIKTOKEN: Tiktoken,
    TEKKEN: Tekken,
}


def load(files: ModelFiles, encoder: str = FAST, trusted: bool = False, keep_parsed: bool = False) -> Library:
    """The model in its library, with fastokens in front when `encoder` is fast and it passes the gate
    (`trusted`: the announcing process passed the whole gate on these files; the check set only). Untrusted,
    a gate with no cached verdict scans here, blocking (the server and the pre-tokenizer scan beside their
    work instead: tokenizer_service.core.gatescan). `keep_parsed`: keep the parsed document of its files for
    a fast encoder built next in this process (`parsed_json.cache_clear()` once it is)."""
    _count("load", files)
    try:
        library = LIBRARIES[files.library].variant(files)(files, encoder, trusted)
    finally:
        if not keep_parsed:
            parsed_json.cache_clear()  # the document of its files is not kept once it is loaded
    if trusted:
        plant_if_asked(library)
    return library


def plant_if_asked(library: Library) -> None:
    """Tests only (PLANT_ENV set): a fast encoder put in front after its gate, which then differs (in a worker
    that loads the model, or in the process its workers fork from, once the fast encoder is in front)."""
    planted = os.environ.get(PLANT_ENV)
    if planted:
        plant_difference(library, int(planted.removeprefix("U+"), 16))


def flatten_rows(ids: np.ndarray, lengths: np.ndarray) -> list[np.ndarray]:
    offsets = ragged_offsets(lengths)
    return [ids[offsets[i] : offsets[i + 1]] for i in range(len(lengths))]
