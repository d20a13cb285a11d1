"""The fast encoders a `tokenizer.json`, tiktoken or tekken.json model may be served by, and the rule that picks one.

Candidates (each only behind the gate, tokenizer_service.core.libraries.gate_verdict):

- ``fastokens``: fastokens' tokenizer of the model's own file (`Tokenizer.from_json_str`, `from_tiktoken`);
- ``gigatoken``: gigatoken's (`load_hf_json`; a tiktoken file of an OpenAI encoding it knows by name,
  `BPETokenizer.from_tiktoken` with that encoding's pretokenizer);
- ``fastokens(converted)``, ``gigatoken(converted)``: for tiktoken ranks that the encoder cannot load as they are
  (a pattern it has no scheme for, or ranks where some tokens are not the merge of two others, as Qwen's), the
  ranks converted in memory to an equivalent byte-level BPE `tokenizer.json` (`ranks_to_tokenizer_json`); a
  Mistral ``tekken.json`` is served by these routes only (its ranks shifted past the special tokens, which take
  ids 0..n-1 as added tokens: `ranks_model`);
- ``gigatoken(ranks)``: a byte-level BPE tokenizer.json read as the tiktoken ranks it is equivalent to (proven per
  model: `tokenizer_json_ranks`), which gigatoken builds in half the time; measured beside ``gigatoken``.

gigatoken always matches special-token strings in text; it is built without special tokens, so special-token
strings are text (``parse_special_tokens`` false), and with ``parse_special_tokens`` each text is cut at its
special-token strings (leftmost, longest), the pieces encoded and the special ids put between them, as tiktoken's
``encode(allowed_special="all")`` and tokenizers' added-token split do. The gate proves it per model.

**The rule** (`choose`): of the candidates that passed the gate, those whose resident memory per process (a
fresh process's growth while it builds the candidate and encodes the sample) is at most `MEMORY_BOUND_MIB`;
of those, the ones within `WITHIN` (25%) of the fastest in tokens per CPU-second on a fixed sample
(`sample_texts`; every candidate measured in one process, in turns); of those, the ones whose build took at most
`BUILD_WITHIN_SECONDS` (0.25 s) more than the quickest build of them; and of those the lightest (then the fastest,
then by name). None: the reference library serves. 25%, because which of two encoders is the faster depends on
the text by more than 10%: on a 32k byte-level BPE, gigatoken encodes multilingual documents 1.13-1.32x as fast as
fastokens and the Python docs 0.73x, the sample 0.86x. The build, because every worker start and every
pre-tokenizer run pays it: for a 128k model, fastokens 1.9-2.3 s, gigatoken 0.4-0.9 s.
A pinned encoder (``--encoder fastokens|gigatoken``) considers only its own routes and no memory bound.
"""

from __future__ import annotations

import base64
import functools
import os
import random
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import orjson

from tokenizer_service.core import cache
from tokenizer_service.core.models import (
    META_ENCODINGS,
    TEKKEN,
    TIKTOKEN,
    json_outline,
    parsed_json,
    tiktoken_ranks,
    without_special_added_tokens,
    without_special_tokens,
)
from tokenizer_service.core.texts import Utf8Texts

FASTOKENS, GIGATOKEN = "fastokens", "gigatoken"
ENCODERS = (FASTOKENS, GIGATOKEN)
CONVERTED = "(converted)"
AS_RANKS = "(ranks)"  # a tokenizer.json read as the tiktoken ranks it is equivalent to (`json_as_ranks`)
# The candidates each kind of model has (`routes`): part of the gate's key, so that a verdict from before a route
# existed is scanned again once.
ROUTES = (
    "tokenizer.json: fastokens, gigatoken and beside it gigatoken(ranks); ranks: direct, else converted; "
    "tekken: converted"
)
MEMORY_BOUND_MIB = 300  # a candidate holding more per worker process is not used (unless pinned)
WITHIN = 0.25  # candidates this close to the fastest count as fast: the lightest of them is used
BUILD_WITHIN_SECONDS = 0.25  # of those, the ones that build this close to the quickest build: the lightest of them
RULE = (
    f"fastest within {WITHIN:.0%}, then built within {BUILD_WITHIN_SECONDS} s of the quickest, then lightest, "
    f"at most {MEMORY_BOUND_MIB} MiB"
)
SAMPLE_CHARS = 256 * 1024
# gigatoken's pretokenizer scheme of each OpenAI encoding whose ranks it loads directly
GIGATOKEN_SCHEMES = {"cl100k_base": "gpt4", "o200k_base": "o200k", "r50k_base": "gpt2"}


def route(encoder: str, converted: bool = False, ranks: bool = False) -> str:
    return encoder + (CONVERTED if converted else "") + (AS_RANKS if ranks else "")


def encoder_of(name: str | None) -> str | None:
    """The fast encoder a route names (``fastokens(converted)``, ``gigatoken(ranks)`` -> its encoder), None for
    anything else."""
    if not name:
        return None
    base = name.removesuffix(CONVERTED).removesuffix(AS_RANKS)
    return base if base in ENCODERS else None


def is_fast(name: str | None) -> bool:
    """Whether `name` (an announcement's ``encoder``) is a fast encoder's route, not a reference library's."""
    return encoder_of(name) is not None


def installed(encoder: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(encoder) is not None


@functools.cache  # read once a process (importlib.metadata parses each package's METADATA)
def versions() -> str:
    """The fast encoders and their versions, as the gate's key names them."""
    import importlib.metadata

    found = []
    for encoder in ENCODERS:
        try:
            found.append(f"{encoder} {importlib.metadata.version(encoder)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{encoder} none")
    return "; ".join(found)


def choose(measured: Sequence[dict[str, Any]], pinned: bool = False) -> str | None:
    """The route to serve (the rule above) from each candidate's `{"route", "passed", "mtps", "rss_mib",
    "load_seconds"}`; None when none qualifies. Deterministic: the same measurements always give the same route."""
    eligible = [m for m in measured if m.get("passed") and (pinned or m["rss_mib"] <= MEMORY_BOUND_MIB)]
    if not eligible:
        return None
    fastest = max(m["mtps"] for m in eligible)
    near = [m for m in eligible if m["mtps"] >= (1 - WITHIN) * fastest]
    quickest = min(m.get("load_seconds", 0.0) for m in near)
    quick = [m for m in near if m.get("load_seconds", 0.0) <= quickest + BUILD_WITHIN_SECONDS]
    return min(quick, key=lambda m: (m["rss_mib"], -m["mtps"], m["route"]))["route"]


# -- tiktoken ranks as a tokenizer.json ---------------------------------------------------------------------


def _byte_table() -> list[str]:
    """GPT-2's byte -> printable character table (byte-level BPE vocabularies are written in it)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table, extra = [], 0
    for byte in range(256):
        if byte in printable:
            table.append(chr(byte))
        else:
            table.append(chr(256 + extra))
            extra += 1
    return table


# The vocabulary entry of an id below the highest rank that no token has (a gap in the ranks; a tekken.json's ids
# 0..n-1, its special tokens'): fastokens loads a BPE vocabulary only without gaps. U+E000 lies outside the
# byte-level alphabet, so no text ever becomes such an entry; the special tokens are still added tokens.
HOLE = "\ue000{id}"


def ranks_to_tokenizer_json(ranks: dict[bytes, int], pat_str: str, special_tokens: dict[str, int]) -> str:
    """An equivalent byte-level BPE `tokenizer.json` of tiktoken ranks: the vocabulary is the ranks; a merge
    (left, right) for every split of a token into two tokens, ranked by the merged token's rank (tiktoken
    merges the adjacent pair whose concatenation has the lowest rank); `ignore_merges` takes a whole piece that
    is a token as that token, as tiktoken does, which is how a token that is no merge of two (Qwen has 232) is
    ever produced. The split pattern, then byte-level; the special tokens as special added tokens, with their
    ids (fastokens reads them; tokenizers itself numbers an added token the vocabulary lacks after the vocabulary:
    only where the special ids follow the ranks does its reading of the file give them too); an id below the
    highest rank that no token has as a `HOLE`."""
    table = _byte_table()

    def text(token: bytes) -> str:
        return "".join(table[byte] for byte in token)

    merges: list[tuple[int, int, int, str, str]] = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = ranks.get(token[:cut]), ranks.get(token[cut:])
            if left is not None and right is not None:
                merges.append((rank, left, right, text(token[:cut]), text(token[cut:])))
    merges.sort()
    vocab = {text(token): rank for token, rank in ranks.items()}
    top = max(ranks.values(), default=-1)
    if len(vocab) <= top:  # ids no token has (a tekken.json's special tokens come first): filled, see HOLE
        taken = set(ranks.values())
        vocab.update({HOLE.format(id=token_id): token_id for token_id in range(top + 1) if token_id not in taken})
    document = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": token_id,
                "content": content,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for content, token_id in sorted(special_tokens.items(), key=lambda item: item[1])
        ],
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": pat_str}, "behavior": "Isolated", "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
            ],
        },
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": True,
            "vocab": vocab,
            "merges": [[left, right] for *_, left, right in merges],
        },
    }
    return orjson.dumps(document).decode("utf-8")  # the stdlib's json.dumps takes about 5 times as long


def non_merges(ranks: dict[bytes, int]) -> list[bytes]:
    """The tokens of two or more bytes that are not the concatenation of two tokens, by rank (Qwen's ranks hold
    232): tiktoken gives one only for a piece of text that is the whole token, which an encoder that only
    merges never does."""
    found = [
        (rank, token)
        for token, rank in ranks.items()
        if len(token) > 1 and not any(token[:cut] in ranks and token[cut:] in ranks for cut in range(1, len(token)))
    ]
    return [token for _, token in sorted(found)]


# -- gigatoken behind fastokens' call --------------------------------------------------------------------------


class Gigatoken:
    """A gigatoken tokenizer built without special tokens, answering fastokens' `encode_batch_flat` (flat uint32
    ids, uint64 offsets) on the calling thread; `special`: the special-token strings and ids that
    ``split_special_tokens=False`` cuts texts at."""

    takes_utf8 = True  # texts as UTF-8 bytes (`Utf8Texts`), which is how every text reaches its encode

    def __init__(self, backend: Any, special: dict[str, int]) -> None:
        self.backend = backend
        self.special = dict(special)
        tokens = sorted((token for token in special if token), key=lambda token: (-len(token), token))
        self._cut = re.compile("|".join(re.escape(token) for token in tokens)) if tokens else None

    def _flat(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        # One `encode` a text (a uint32 array each), not `encode_batch`: that builds an awkward Array, 0.25 ms a
        # call whatever the batch (a single text costs 0.03 ms this way), and its first call imports awkward
        # (0.16 s); on 256 documents the two take the same time. Every text goes in as UTF-8 bytes, as a binary
        # body's texts arrive (the gate checks this very call); a str is encoded to them first.
        encode = self.backend.encode
        items = texts.each_utf8() if isinstance(texts, Utf8Texts) else (text.encode("utf-8") for text in texts)
        rows = [encode(item) for item in items]  # one text's bytes at a time: no second copy of the request
        offsets = np.zeros(len(rows) + 1, dtype=np.uint64)
        np.cumsum(np.fromiter(map(len, rows), dtype=np.uint64, count=len(rows)), out=offsets[1:])
        ids = np.concatenate(rows) if rows else np.zeros(0, dtype=np.uint32)
        return ids.astype(np.uint32, copy=False), offsets

    def encode_batch_flat(
        self, texts: Sequence[str], add_special_tokens: bool = False, split_special_tokens: bool = True
    ) -> tuple[np.ndarray, np.ndarray]:
        cut = self._cut
        if split_special_tokens or cut is None:
            return self._flat(texts)
        pieces: list[str] = []
        plans: list[list[int]] = []  # per text: piece indexes (>= 0) and special ids (-1 - id)
        for text in texts:
            plan, last = [], 0
            for found in cut.finditer(text):
                if found.start() > last:
                    plan.append(len(pieces))
                    pieces.append(text[last : found.start()])
                plan.append(-1 - self.special[found.group()])
                last = found.end()
            if last < len(text):
                plan.append(len(pieces))
                pieces.append(text[last:] if last else text)
            plans.append(plan)
        ids, offsets = self._flat(pieces)
        parts: list[np.ndarray] = []
        lengths = np.zeros(len(texts), dtype=np.uint64)
        for index, plan in enumerate(plans):
            total = 0
            for step in plan:
                part = ids[offsets[step] : offsets[step + 1]] if step >= 0 else np.array([-1 - step], dtype=np.uint32)
                parts.append(part)
                total += len(part)
            lengths[index] = total
        flat = np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint32)
        bounds = np.zeros(len(texts) + 1, dtype=np.uint64)
        np.cumsum(lengths, out=bounds[1:])
        return flat, bounds


# -- building a candidate ------------------------------------------------------------------------------------


def routes(library: Any, encoder: str) -> list[str]:
    """The routes of `encoder` for `library`'s model, in the order tried: a tokenizer.json directly; tiktoken
    ranks directly, then converted where the encoder cannot load them as they are; a tekken.json converted (no
    encoder reads its JSON)."""
    if library.library == TIKTOKEN:
        return [route(encoder), route(encoder, converted=True)]
    if library.library == TEKKEN:
        return [route(encoder, converted=True)]
    if encoder == GIGATOKEN:  # a tokenizer.json: also as its ranks, which gigatoken builds in half the time
        return [route(encoder), route(encoder, ranks=True)]
    return [route(encoder)]


def measured_beside(name: str) -> bool:
    """Whether route `name` is a candidate of its own beside the encoder's route before it (a tokenizer.json as
    ranks: the same encoder, built quicker), not one tried only where that one could not load."""
    return name.endswith(AS_RANKS)


def build(library: Any, name: str, module: Any) -> Any:
    """The fast encoder `name` (a route) of `library`'s model, answering fastokens' `encode_batch_flat`, from
    `module` (fastokens, or gigatoken's `gigatoken_rs`); raises whatever the encoder raises (pyo3's
    PanicException, a BaseException, included)."""
    encoder, converted = encoder_of(name), name.endswith(CONVERTED)
    kind = library.library
    if name == route(GIGATOKEN, ranks=True):
        if kind in (TIKTOKEN, TEKKEN):
            raise ValueError(f"{name} reads a tokenizer.json as ranks; this model's are ranks already")
        ranks_file, scheme = json_as_ranks(library.files)
        _, special = _json_special(library)
        return Gigatoken(module.BPETokenizer.from_tiktoken(str(ranks_file), scheme, None), special)
    if kind == TEKKEN and not converted:
        raise ValueError(f"{encoder} reads no tekken.json: its ranks are converted ({route(str(encoder), True)})")
    if encoder == FASTOKENS:
        fastokens = module
        if kind == TIKTOKEN and not converted:
            return fastokens.Tokenizer.from_tiktoken(
                str(library.files.main), pattern=library.spec.pat_str, special_tokens=library.spec.special_tokens
            )
        fast = fastokens.Tokenizer.from_json_str(_document(library, converted))
        fast.no_truncation()
        fast.no_padding()
        return fast
    if encoder == GIGATOKEN:
        BPETokenizer, load_hf_json = module.BPETokenizer, module.load_hf_json

        if kind in (TIKTOKEN, TEKKEN):
            special = dict(library.spec.special_tokens) if kind == TIKTOKEN else library.special_tokens
            if not converted:
                scheme = GIGATOKEN_SCHEMES.get(library.spec.encoding or "")
                if scheme is None:
                    raise ValueError(f"gigatoken has no pretokenizer for {library.spec.encoding or 'this'} pattern")
                return Gigatoken(BPETokenizer.from_tiktoken(str(library.files.main), scheme, None), special)
            return Gigatoken(load_hf_json(_document(library, True, specials=False)), special)
        content = library.files.contents[0]
        outline, special = _json_special(library)
        spliced = without_special_added_tokens(content, outline)
        backend = load_hf_json(spliced if spliced is not None else without_special_tokens(parsed_json(content)))
        if type(backend).__name__ != "BPETokenizer":
            raise ValueError(f"gigatoken loads it as a {type(backend).__name__}, not byte-level BPE")
        return Gigatoken(backend, special)
    raise ValueError(f"no fast encoder {name!r}")


def ranks_model(library: Any) -> tuple[dict[bytes, int], str, dict[str, int]]:
    """(ranks, split pattern, special tokens) of a tiktoken or tekken.json model, as its tiktoken encoding holds
    them: a tekken.json's ranks shifted by its number of special tokens, which take ids 0..n-1 (fillers too)."""
    if library.library == TEKKEN:
        spec = library.spec
        return spec.ranks(), spec.pattern, library.special_tokens
    ranks = tiktoken_ranks(library.files.contents[0], library.files.main)
    return ranks, library.spec.pat_str, dict(library.spec.special_tokens)


def _json_special(library: Any) -> tuple[dict[str, Any], dict[str, int]]:
    """A tokenizer.json's outline (what loading it read: models.json_outline) and its special added tokens' ids."""
    outline = json_outline(library.files.contents[0], library.files.main_sha256)
    if outline is None:
        raise ValueError(f"{library.files.main} is not JSON")
    return outline, {added["content"]: added["id"] for added in outline["added_tokens"] if added.get("special")}


def _document(library: Any, converted: bool, specials: bool = True) -> str:
    if not converted:
        return library.files.contents[0].decode("utf-8")
    ranks, pattern, special = ranks_model(library)
    return ranks_to_tokenizer_json(ranks, pattern, special if specials else {})


# -- a tokenizer.json as tiktoken ranks ---------------------------------------------------------------------

RANKS_FORMAT = 1  # of the ranks files kept in the cache
# gigatoken's pretokenizer scheme of each split pattern a byte-level tokenizer.json may carry: Llama 3's (which is
# cl100k_base's pattern as first published) and cl100k_base's as tiktoken now writes it, the same split. The gate
# still proves every model's route on the check set's code points.
_CL100K_SPLIT = (
    r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|"
    r"\s+(?!\S)|\s"
)
GIGATOKEN_SPLITS = {META_ENCODINGS["llama3"].pat_str: "gpt4", _CL100K_SPLIT: "gpt4"}


def json_as_ranks(files: Any) -> tuple[Any, str]:
    """The tiktoken ranks file that encodes as the byte-level BPE tokenizer.json of `files` does, and gigatoken's
    scheme for its split pattern: kept in the cache by the file's sha256 (the first process writes it); ValueError
    saying why where there is none (`tokenizer_json_ranks`)."""
    key = {"ranks": RANKS_FORMAT, "sha256": files.main_sha256}
    kept = cache.read(key)
    if kept is not None and isinstance(kept.get("scheme"), str) and isinstance(kept.get("file"), str):
        path = cache.cache_dir() / kept["file"]
        if path.is_file():
            return path, kept["scheme"]
    ranks, scheme = tokenizer_json_ranks(parsed_json(files.contents[0]))
    ordered = sorted(ranks.items(), key=lambda item: item[1])
    text = "".join(f"{base64.b64encode(token).decode()} {rank}\n" for token, rank in ordered)
    path = cache.write_file(f"{files.main_sha256}.tiktoken", text.encode())
    if path is None:
        raise ValueError("gigatoken(ranks) keeps its ranks file in the cache, and the cache cannot be written")
    cache.write(key, {"key": key, "scheme": scheme, "file": path.name})
    return path, scheme


def tokenizer_json_ranks(document: Any) -> tuple[dict[bytes, int], str]:
    """The ranks (token bytes -> id) of a byte-level BPE tokenizer.json that tiktoken's rank order encodes exactly
    as its merges do, and gigatoken's scheme for its split; ValueError naming what stands in the way.

    tiktoken merges, in a piece, the adjacent pair whose concatenation has the lowest rank, and takes a piece that
    is a token whole; BPE merges the pair earliest in its merge list, only pairs listed. They agree on every text
    when, token by token in id order, tiktoken's merging of the token's own bytes with the ranks below it ends in
    exactly the pair the merge list gives for it, at that place in the list (derived here, all of them: the rank of
    a merge then orders pairs as the list does, and a token can only be reached by its own listed pair). A token
    that is no merge of two (a special token in the vocabulary) is left out of the ranks: BPE never makes it either,
    unless `ignore_merges` takes a piece whole (then refused). No normalizer, no non-special added token, all 256
    bytes, and the ranks numbered 0 to n-1 (gigatoken reads no others: special tokens after them, as Llama 3's)."""
    if not isinstance(document, dict) or document.get("normalizer") is not None:
        raise ValueError("only a tokenizer.json without a normalizer is read as ranks")
    model = document.get("model")
    if not isinstance(model, dict) or model.get("type", "BPE") != "BPE" or not isinstance(model.get("vocab"), dict):
        raise ValueError("only a BPE tokenizer.json is read as ranks")
    if model.get("dropout") or model.get("byte_fallback") or model.get("continuing_subword_prefix"):
        raise ValueError("dropout, byte fallback and subword prefixes have no ranks")
    if model.get("end_of_word_suffix"):
        raise ValueError("an end-of-word suffix has no ranks")
    added = document.get("added_tokens") or []
    if any(not token.get("special") for token in added):
        raise ValueError("a non-special added token has no rank")
    scheme = _split_scheme(document.get("pre_tokenizer"))
    table = {char: byte for byte, char in enumerate(_byte_table())}
    special_ids = {token.get("id") for token in added}
    ranks: dict[bytes, int] = {}
    try:
        for token, token_id in model["vocab"].items():
            if token_id not in special_ids:
                ranks[bytes(table[char] for char in token)] = int(token_id)
    except KeyError:
        raise ValueError("a vocabulary entry is not byte-level") from None
    if any(bytes([byte]) not in ranks for byte in range(256)):
        raise ValueError("the vocabulary lacks some of the 256 bytes")
    merges = model.get("merges") or []
    listed = [tuple(merge.split(" ", 1)) if isinstance(merge, str) else tuple(merge) for merge in merges]
    try:
        given = [(bytes(table[c] for c in left), bytes(table[c] for c in right)) for left, right in listed]
    except (KeyError, ValueError):
        raise ValueError("a merge is not byte-level") from None
    derived: list[tuple[bytes, bytes]] = []  # the merge tiktoken's rank order makes each token by
    wholes: list[bytes] = []  # tokens no merge of two makes
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) == 1:
            continue
        parts = _merged(token, rank, ranks)
        if len(parts) == 2:
            derived.append((parts[0], parts[1]))
        else:
            wholes.append(token)
    if derived != given:
        pairs = zip(derived, given, strict=False)
        at = next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(derived), len(given)))
        raise ValueError(f"its merges are not tiktoken's rank order (merge {at} of {len(given)})")
    if wholes and model.get("ignore_merges"):
        raise ValueError(f"ignore_merges takes whole {len(wholes)} tokens that no merge makes")
    if wholes and not set(wholes).isdisjoint(part for pair in derived for part in pair):
        raise ValueError("a merge is of a token that no merge makes")
    for token in wholes:
        del ranks[token]
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError("gigatoken reads ranks numbered 0 to n-1, and these have gaps (special tokens among them)")
    return ranks, scheme


def _split_scheme(pre_tokenizer: Any) -> str:
    """gigatoken's scheme for a split pattern, then byte-level (`GIGATOKEN_SPLITS`); ValueError for any other."""
    steps = pre_tokenizer.get("pretokenizers") if isinstance(pre_tokenizer, dict) else None
    if not (isinstance(steps, list) and len(steps) == 2 and all(isinstance(step, dict) for step in steps)):
        raise ValueError("gigatoken has no scheme for its pre-tokenizer")
    split, level = steps
    pattern = split.get("pattern")
    regex = pattern.get("Regex") if isinstance(pattern, dict) else None
    plain = split.get("type") == "Split" and split.get("behavior") == "Isolated" and not split.get("invert")
    bytes_only = level.get("type") == "ByteLevel" and not level.get("use_regex", True)
    if pre_tokenizer.get("type") != "Sequence" or not plain or not bytes_only or level.get("add_prefix_space"):
        raise ValueError("gigatoken has no scheme for its pre-tokenizer")
    if regex not in GIGATOKEN_SPLITS:
        raise ValueError("gigatoken has no scheme for its split pattern")
    return GIGATOKEN_SPLITS[regex]


def _merged(token: bytes, rank: int, ranks: dict[bytes, int]) -> list[bytes]:
    """tiktoken's merging of `token`'s bytes with the ranks below `rank` only: the parts it ends in."""
    parts = [token[index : index + 1] for index in range(len(token))]
    while len(parts) > 1:
        best, at = rank, -1
        for index in range(len(parts) - 1):
            found = ranks.get(parts[index] + parts[index + 1])
            if found is not None and found < best:
                best, at = found, index
        if at < 0:
            break
        parts[at : at + 2] = [parts[at] + parts[at + 1]]
    return parts


# -- measuring ------------------------------------------------------------------------------------------------


def rss_mib() -> float:
    """This process's resident memory, MiB (0 where /proc is not there)."""
    try:
        with open("/proc/self/statm") as file:
            return int(file.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return 0.0


def sample_texts() -> list[str]:
    """The fixed sample speed is measured on: about 256 KB of documents drawn by a seeded generator (the same
    texts in every process): a lexicon of 20,000 made-up words, each of the letters of one of the check set's
    texts (many scripts), drawn by Zipf's law as words of real text are (so that an encoder's cache of words
    helps it as much as on real text, no more), with the check set's punctuation, digits and spaces."""
    from tokenizer_service.core import checkset

    generator = random.Random(20261126)
    alphabets = [sorted({char for char in text if char.isalpha()}) for text in checkset.FIXED]
    alphabets = [letters for letters in alphabets if len(letters) >= 5]
    lexicon = []
    for _ in range(20_000):
        letters = generator.choice(alphabets)
        lexicon.append("".join(generator.choice(letters) for _ in range(generator.randint(1, 10))))
    weights = [1 / rank for rank in range(1, len(lexicon) + 1)]
    marks = [",", ".", "!", "?", ":", ";", " 42", " 2026", " 3.14", "\n", "\n\n", "  ", " (", ")", "'s", " -"]
    documents, size = [], 0
    while size < SAMPLE_CHARS:
        words = generator.choices(lexicon, weights, k=generator.randint(50, 400))
        document = " ".join(word + (generator.choice(marks) if generator.random() < 0.15 else "") for word in words)
        documents.append(document)
        size += len(document)
    return documents


def as_read(fast: Any, texts: list[str]) -> Sequence[str]:
    """`texts` in the form `fast` reads them fastest, made before a clock starts: their UTF-8 for an encoder that
    takes it (gigatoken, as a binary body's texts reach it), else the str themselves."""
    return Utf8Texts.of(texts) if getattr(fast, "takes_utf8", False) else texts


def tokens_per_cpu_second(encode: Callable[[Sequence[str]], int], texts: Sequence[str], rounds: int = 3) -> float:
    """M tokens per CPU-second of this process (every thread of it), the best of `rounds` passes over `texts`."""
    best = 0.0
    for _ in range(rounds):
        started = time.process_time()
        tokens = encode(texts)
        spent = max(time.process_time() - started, 1e-6)
        best = max(best, tokens / spent / 1e6)
    return best
