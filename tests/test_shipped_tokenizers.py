"""Tokenizers as their makers ship them (issue 32): Meta's Llama 3 and Llama 4 `tokenizer.model` (tiktoken
ranks), Mistral's `tekken.json` and SentencePiece `tokenizer.model.vN`.

Each kind twice: made here (ranks converted from a BPE trained on the repository's text, laid out as Meta's
with the Llama 3 pattern and its 256 reserved tokens; a tekken.json in Mistral's format from the same BPE)
and as released, from the wheels on PyPI that ship them (llama-models: llama_models/llama3 and llama4
tokenizer.model; mistral-common: mistral_common/data). Ids are compared with each maker's own code: Meta's
`Tokenizer.encode(text, bos=False, eos=False, allowed_special=...)` and tiktoken built the same way,
mistral-common's `Tekkenizer.encode(text, bos=False, eos=False)` and its decode; on multilingual text and
edge strings, in both special-token modes. Then through a real server (`--models-dir`), the pre-tokenizer
(`--local`, `--url`), `tokenizer-shards verify` and an export.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import random
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import llama_models
import mistral_common
import pytest
import tiktoken
from llama_models.llama3.tokenizer import Tokenizer as Llama3Tokenizer
from llama_models.llama4.tokenizer import Tokenizer as Llama4Tokenizer
from llama_models.tokenizer_utils import load_bpe_file
from mistral_common.tokens.tokenizers.base import SpecialTokenPolicy
from mistral_common.tokens.tokenizers.tekken import Tekkenizer

from tests.conftest import EDGE_CASES, start_server, stop_server
from tests.tokenizer_models import BPE_SPECIAL, byte_level_bpe, bytes_to_unicode, training_texts
from tokenizer_client import TokenizerClient
from tokenizer_service.core import checkset, libraries
from tokenizer_service.core.models import (
    META_FILES,
    TEKKEN,
    TIKTOKEN,
    ModelLoadError,
    find_model_files,
    tiktoken_spec,
)
from tokenizer_service.core.registry import inspect_model
from tokenizer_service.settings import models_in

LLAMA = Path(llama_models.__file__).parent
MISTRAL = Path(mistral_common.__file__).parent / "data"
META = {
    "llama3": (LLAMA / "llama3" / "tokenizer.model", Llama3Tokenizer),
    "llama4": (LLAMA / "llama4" / "tokenizer.model", Llama4Tokenizer),
}
TEKKEN_RELEASED = ["tekken_240718.json", "tekken_240911.json"]
SENTENCEPIECE_RELEASED = [
    "tokenizer.model.v1",
    "mistral_instruct_tokenizer_240216.model.v2",
    "mistral_instruct_tokenizer_240323.model.v3",
    "mistral_instruct_tokenizer_241114.model.v7",
]
# Tekken special tokens listed in the made file (then fillers up to MADE_SPECIAL); two that are not control tokens
MADE_TEKKEN_SPECIAL = [
    ("<unk>", True), ("<s>", True), ("</s>", True), ("[INST]", True), ("[/INST]", True), ("[AVAILABLE_TOOLS]", True),
    ("[/AVAILABLE_TOOLS]", True), ("[TOOL_RESULTS]", True), ("[/TOOL_RESULTS]", True), ("[TOOL_CALLS]", True),
    ("[IMG]", True), ("<pad>", True), ("[IMG_BREAK]", True), ("[IMG_END]", True), ("[PREFIX]", True),
    ("[MIDDLE]", True), ("[SUFFIX]", True), ("[SYSTEM_PROMPT]", True), ("[/SYSTEM_PROMPT]", True),
    ("[TOOL_CONTENT]", True), ("[THINK]", False), ("[/THINK]", False),
]  # fmt: skip
MADE_SPECIAL = 40
MADE_CUT = 7  # the made tekken.json's vocab holds this many tokens more than its default_vocab_size keeps


# -- files made here -----------------------------------------------------------------------------------------


def bpe_tokens(texts: list[str], vocab_size: int) -> list[bytes]:
    """A byte-level BPE trained here, as bytes in merge order: the 256 bytes first (in byte order), then the rest."""
    tokenizer = byte_level_bpe(texts, vocab_size)
    decode = {char: byte for byte, char in bytes_to_unicode().items()}
    vocabulary = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    merged = [bytes(decode[char] for char in token) for token, _ in vocabulary if token not in BPE_SPECIAL]
    return [bytes([byte]) for byte in range(256)] + [token for token in merged if len(token) > 1]


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory, documents: list[str], multilingual: list[str]) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("shipped")
    tokens = bpe_tokens(training_texts(documents, multilingual), 3000)
    # Meta's layout: ranks in tokenizer.model under original/ (what a Hub snapshot holds), no tokenizer.json beside
    ranks = directory / "llama3like" / "original" / "tokenizer.model"
    ranks.parent.mkdir(parents=True)
    ranks.write_text("".join(f"{base64.b64encode(token).decode()} {rank}\n" for rank, token in enumerate(tokens)))
    Path(f"{ranks}.json").write_text(json.dumps({"like": "llama3"}))
    write_tekken(directory / "tekken_made.json", tokens)
    return {"llama3like": directory / "llama3like", "tekken_made": directory / "tekken_made.json"}


def write_tekken(path: Path, tokens: list[bytes]) -> Path:
    """A tekken.json in Mistral's format of `tokens` (bytes by rank, the 256 bytes first) with the pattern of
    Mistral's NeMo file: vocab by rank, listed special tokens then fillers up to MADE_SPECIAL, and a
    default_vocab_size that cuts the vocab (MADE_CUT tokens)."""
    pattern = json.loads((MISTRAL / "tekken_240911.json").read_bytes())["config"]["pattern"]
    tekken = {
        "config": {
            "pattern": pattern,
            "num_vocab_tokens": len(tokens),
            "default_vocab_size": MADE_SPECIAL + len(tokens) - MADE_CUT,
            "default_num_special_tokens": MADE_SPECIAL,
            "version": "v13",
        },
        "vocab": [
            {
                "rank": rank,
                "token_bytes": base64.b64encode(token).decode(),
                "token_str": token.decode("utf-8", "replace"),
            }
            for rank, token in enumerate(tokens)
        ],
        "special_tokens": [
            {"rank": rank, "token_str": token, "is_control": control}
            for rank, (token, control) in enumerate(MADE_TEKKEN_SPECIAL)
        ],
    }
    path.write_text(json.dumps(tekken))
    return path


def meta_reference(path: Path, version: str = "llama3") -> Llama3Tokenizer | Llama4Tokenizer:
    return META[version][1](path)


def meta_files(made: dict[str, Path]) -> dict[str, tuple[Path, str]]:
    """name -> (the tokenizer.model, Meta's version of the code that reads it)"""
    return {
        "llama3": (META["llama3"][0], "llama3"),
        "llama4": (META["llama4"][0], "llama4"),
        "llama3like": (made["llama3like"] / "original" / "tokenizer.model", "llama3"),
    }


def tekken_files(made: dict[str, Path]) -> dict[str, Path]:
    return {
        **{name.removesuffix(".json"): MISTRAL / name for name in TEKKEN_RELEASED},
        "tekken_made": made["tekken_made"],
    }


def long_texts() -> list[str]:
    """Texts that Meta's Tokenizer cuts before tiktoken sees them: runs of over 25,000 (non-)whitespace characters,
    and over 400,000 characters in all."""
    return [
        "a" * 30_000 + " " * 26_000 + "b" * 10,
        "x" * 60_001,
        "abc" * 10_001,
        ("word " * 90_000)[:410_000],
        "日本語" * 9_000 + "\u3000" * 25_001 + "end",
    ]


def special_strings(tokens: list[str]) -> list[str]:
    return checkset.texts(tokens)[len(checkset.FIXED) :]


def texts_for(multilingual: list[str], tokens: list[str]) -> list[str]:
    return multilingual + EDGE_CASES + special_strings(tokens)


# -- Meta's files ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", ["llama3", "llama4"])
def test_metas_released_files_are_known_by_sha256_with_metas_special_tokens(version):
    path, code = META[version]
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert META_FILES[digest] == (version, len(load_bpe_file(path)))  # the table was made from these very files
    reference = code(path)
    files = find_model_files(version, path)
    spec = tiktoken_spec(files)
    assert files.library == TIKTOKEN and spec.encoding == version and spec.known
    assert spec.special_tokens == reference.special_tokens  # names and ids, the reserved ones included
    assert spec.pat_str == (reference.pat_str if version == "llama3" else reference.O200K_PATTERN)
    library = libraries.load(files, libraries.REFERENCE)
    assert (library.bos_id, library.eos_id, library.pad_id, library.unk_id) == (
        reference.bos_id,
        reference.eos_id,
        reference.pad_id,
        -1,
    )
    assert library.vocab_size == reference.n_words
    title = {"llama3": "Llama 3", "llama4": "Llama 4"}[version]
    assert files.recognized() == f"{path}: tiktoken BPE ranks of Meta's {title} (recognized by its sha256)"


@pytest.mark.parametrize("name", ["llama3", "llama4", "llama3like"])
def test_meta_ids_equal_metas_tokenizer_and_tiktoken_built_the_same_way(made, multilingual, name):
    path, version = meta_files(made)[name]
    reference = meta_reference(path, version)
    built = tiktoken.Encoding(
        "built",
        pat_str=reference.model._pat_str,
        mergeable_ranks=load_bpe_file(path),
        special_tokens=reference.special_tokens,
    )
    tokens = [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|eot_id|>",
        "<|eot|>",
        "<|reserved_special_token_250|>",
        "<|image|>",
    ]
    texts = texts_for(multilingual, tokens)
    library = libraries.load(find_model_files(name, path), libraries.REFERENCE)
    assert type(library) is libraries.MetaTiktoken
    for parse_special in (False, True):
        allowed = "all" if parse_special else set()
        want = [reference.encode(text, bos=False, eos=False, allowed_special=allowed) for text in texts]
        assert want == [built.encode(text, allowed_special=allowed, disallowed_special=()) for text in texts]
        got = libraries.flatten_rows(*library.encode_plain(texts, parse_special))
        assert [row.tolist() for row in got] == want, parse_special
    rows = [reference.encode(text, bos=True, eos=True, allowed_special="all") for text in texts[:40]]
    assert library.decode(rows) == [reference.decode(row) for row in rows]


@pytest.mark.parametrize("name", ["llama3", "llama3like"])
def test_meta_ids_on_texts_metas_tokenizer_cuts_with_either_encoder(made, name):
    """Over 25,000 characters Meta's Tokenizer cuts a text (llama_models' MAX_NO_WHITESPACES_CHARS): the ids are
    Meta's, not tiktoken's on the whole text, whichever encoder serves the model."""
    path, version = meta_files(made)[name]
    reference = meta_reference(path, version)
    texts = [*long_texts(), "short <|eot_id|> text"]
    want = [reference.encode(text, bos=False, eos=False, allowed_special=set()) for text in texts]
    # the cuts change ids (tiktoken on the whole text differs): this test means something
    assert sum(row != reference.model.encode_ordinary(text) for row, text in zip(want, texts, strict=True)) >= 2
    for encoder in (libraries.REFERENCE, libraries.FAST):
        library = libraries.load(find_model_files(name, path), encoder, trusted=True)  # the check set, no scan
        for parse_special in (False, True):
            allowed = "all" if parse_special else set()
            want = [reference.encode(text, bos=False, eos=False, allowed_special=allowed) for text in texts]
            got = libraries.flatten_rows(*library.encode_plain(texts, parse_special))
            assert [row.tolist() for row in got] == want, (library.encoder, parse_special)
            assert library.reference_rows(texts, parse_special) == want


@pytest.mark.slow  # every code point, and Meta's cut in Python over 1.5 M characters (the ids tests above cut too)
def test_meta_pieces_are_metas_cuts():
    """`meta_pieces` is llama_models' `_split_whitespaces_or_nonwhitespaces` of 400,000-character chunks, found with
    Python's \\s, which is str.isspace on every code point."""
    spaces = re.compile(r"\s")
    assert all((spaces.match(chr(point)) is not None) == chr(point).isspace() for point in range(0x110000))
    generator = random.Random(32)
    texts = long_texts()
    for _ in range(6):
        texts.append(
            "".join(generator.choice(["a", " ", "\n", "\u2003", "字"]) * generator.randint(1, 30_000) for _ in range(8))
        )
    for text in texts:
        meta = [
            piece
            for start in range(0, len(text), 400_000)
            for piece in Llama3Tokenizer._split_whitespaces_or_nonwhitespaces(text[start : start + 400_000], 25_000)
        ]
        assert libraries.meta_pieces(text) == meta


def test_a_directory_holding_only_original_tokenizer_model_is_served_from_it(made, tmp_path):
    snapshot = tmp_path / "Meta-Llama-3.1-8B"
    (snapshot / "original").mkdir(parents=True)
    shutil.copy(META["llama3"][0], snapshot / "original" / "tokenizer.model")
    (snapshot / "config.json").write_text("{}")  # what else a snapshot holds: not read
    for directory, recognized in ((snapshot, "its sha256"), (made["llama3like"], 'tokenizer.model.json\'s "like"')):
        files = find_model_files("x", directory)
        assert (
            files.path == directory.absolute() and files.main == directory.absolute() / "original" / "tokenizer.model"
        )
        assert files.library == TIKTOKEN and f"Meta's Llama 3 (recognized by {recognized})" in files.recognized()
    assert len(find_model_files("x", made["llama3like"]).files) == 2  # the sidecar, hashed with it
    # a tokenizer.json beside it wins, as before; a directory with none of the three is refused naming them
    (snapshot / "tokenizer.json").write_text("{}")  # read first: JSON, but not a tokenizer.json
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json is not a model file"):
        find_model_files("x", snapshot)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelLoadError, match=r"holds no tokenizer\.json, tekken\.json or original/tokenizer\.model"):
        find_model_files("x", empty)
    # a SentencePiece snapshot (Llama 2, Gemma: tokenizer.model and its config): the file to give is named
    shutil.copy(made["llama3like"] / "original" / "tokenizer.model", empty / "tokenizer.model")
    with pytest.raises(ModelLoadError, match=rf"give the file, --model x={empty}/tokenizer\.model \(with --chat-te"):
        find_model_files("x", empty)


def test_a_sidecars_like_names_a_meta_layout(made, tmp_path):
    ranks = tmp_path / "ranks.tiktoken"
    shutil.copy(made["llama3like"] / "original" / "tokenizer.model", ranks)
    Path(f"{ranks}.json").write_text(json.dumps({"like": "llama2"}))
    with pytest.raises(ModelLoadError, match="\"like\" must be one of 'llama3', 'llama4'"):
        find_model_files("x", ranks)
    Path(f"{ranks}.json").write_text(json.dumps({"like": "llama3", "eos_token": "<|eot_id|>"}))
    library = libraries.load(find_model_files("x", ranks), libraries.REFERENCE)
    reference = meta_reference(ranks)
    assert (library.bos_id, library.eos_id, library.pad_id) == (reference.bos_id, reference.eot_id, reference.pad_id)


# -- Mistral's files -------------------------------------------------------------------------------------------


def tekken_reference_rows(reference: Tekkenizer, texts: list[str], parse_special: bool) -> list[list[int]]:
    """mistral-common's ids: `encode(text, bos=False, eos=False)`; parsing special tokens, each special-token string
    in the text is mistral-common's own id of it (get_special_token) and the text between encoded by it."""
    if not parse_special:
        return [reference.encode(text, bos=False, eos=False) for text in texts]
    table = reference._special_tokens_reverse_vocab
    pattern = re.compile("|".join(re.escape(token) for token in sorted(table, key=len, reverse=True)))
    rows = []
    for text in texts:
        row, start = [], 0
        for found in pattern.finditer(text):
            row += reference.encode(text[start : found.start()], bos=False, eos=False)
            row.append(reference.get_special_token(found.group()))
            start = found.end()
        rows.append(row + reference.encode(text[start:], bos=False, eos=False))
    return rows


@pytest.mark.parametrize("name", [*(name.removesuffix(".json") for name in TEKKEN_RELEASED), "tekken_made"])
def test_tekken_ids_and_decode_equal_mistral_commons(made, multilingual, name):
    path = tekken_files(made)[name]
    reference = Tekkenizer.from_file(path)
    files = find_model_files(name, path)
    assert files.library == TEKKEN
    library = libraries.load(files, libraries.REFERENCE)
    assert (library.library, library.encoder, library.type) == ("mistral-common", "tiktoken", "bpe")
    assert (library.bos_id, library.eos_id, library.pad_id, library.unk_id) == (
        reference.bos_id,
        reference.eos_id,
        reference.pad_id,
        reference.unk_id,
    )
    assert library.vocab_size == reference.n_words
    special = [token["token_str"] for token in reference._all_special_tokens]
    texts = texts_for(multilingual, [*special[:24], special[-1]])
    for parse_special in (False, True):
        got = libraries.flatten_rows(*library.encode_plain(texts, parse_special))
        assert [row.tolist() for row in got] == tekken_reference_rows(reference, texts, parse_special), parse_special
    rows = [
        *tekken_reference_rows(reference, texts, True)[:60],
        [1, 3, *reference.encode("½ π", False, False)[:1], 4, 2],
    ]
    assert library.decode(rows) == [reference.decode(row, special_token_policy=SpecialTokenPolicy.KEEP) for row in rows]


TEKKEN_ROUTES = ["fastokens(converted)", "gigatoken(converted)"]
RELEASED_SLOW = [pytest.param(name.removesuffix(".json"), marks=pytest.mark.slow) for name in TEKKEN_RELEASED]


def tekken_texts(reference: Tekkenizer, multilingual: list[str]) -> list[str]:
    """Multilingual text, edge strings, special-token strings (control tokens, the two that are not, a filler)
    in context, and the check set's whitespace runs."""
    special = [token["token_str"] for token in reference._all_special_tokens]
    return texts_for(multilingual, [*special[:24], special[-1]]) + checkset.whitespace_texts()


def assert_mistral_commons_ids(library: libraries.Library, reference: Tekkenizer, texts: list[str]) -> None:
    for parse_special in (False, True):  # control tokens are text unless parse_special_tokens
        got = libraries.flatten_rows(*library.encode_plain(texts, parse_special))
        want = tekken_reference_rows(reference, texts, parse_special)
        assert [row.tolist() for row in got] == want, (library.encoder, parse_special)
    rows = tekken_reference_rows(reference, texts[:60], True)
    assert library.decode(rows) == [reference.decode(row, special_token_policy=SpecialTokenPolicy.KEEP) for row in rows]


def test_a_tekken_files_converted_ranks_are_what_tokenizers_encodes_as_mistral_common_does(made, multilingual):
    """The converted route's tokenizer.json (ranks shifted past the special tokens, the special tokens added tokens
    at ids 0..n-1, which the vocabulary holds as holes) read by tokenizers itself: mistral-common's ids with
    special-token strings as text. (tokenizers numbers added tokens that the vocabulary lacks after it, whatever
    ids the file gives them: the fast encoders read the file's ids, and their routes are compared below.)"""
    import tokenizers

    from tokenizer_service.core import encoders

    path = made["tekken_made"]
    reference = Tekkenizer.from_file(path)
    library = libraries.load(find_model_files("tekken_made", path), libraries.REFERENCE)
    document = encoders._document(library, converted=True)
    added = json.loads(document)["added_tokens"]
    assert [(token["id"], token["content"]) for token in added] == list(enumerate(library.spec.special))
    converted = tokenizers.Tokenizer.from_str(document)
    converted.encode_special_tokens = True
    texts = tekken_texts(reference, multilingual)
    got = [encoding.ids for encoding in converted.encode_batch(texts, add_special_tokens=False)]
    assert got == tekken_reference_rows(reference, texts, False)


@pytest.mark.parametrize("route", TEKKEN_ROUTES)
@pytest.mark.parametrize("name", ["tekken_made", *RELEASED_SLOW])
def test_each_fast_route_of_a_tekken_file_gives_mistral_commons_ids(made, multilingual, name, route):
    """Each converted route (as a worker told it builds it: the check set, then it encodes) against mistral-common
    on multilingual text and edge strings, in both special-token modes; decoded as mistral-common decodes."""
    path = tekken_files(made)[name]
    reference = Tekkenizer.from_file(path)
    library = libraries.load(find_model_files(name, path), route, trusted=True)
    assert library.encoder == route and library.fast is not None
    assert_mistral_commons_ids(library, reference, tekken_texts(reference, multilingual))


@pytest.mark.parametrize("name", ["tekken_made", *RELEASED_SLOW])
def test_a_tekken_file_is_served_by_what_the_gate_chose_with_mistral_commons_ids(
    made, multilingual, name, tmp_path, monkeypatch
):
    """The whole gate (every converted route, the rule) settles a tekken.json as any tiktoken model: the route it
    chose is announced (`encoder` in /v1/models) and served, by a worker reading the verdict and by one promoted;
    where none qualifies, tiktoken serves. Either way, mistral-common's ids."""
    path = tekken_files(made)[name]
    if name == "tekken_made":  # a cache of its own and a scan over part of Unicode: seconds, not a minute
        monkeypatch.setenv(libraries.CACHE_DIR_ENV, str(tmp_path / "cache"))
        monkeypatch.setattr(checkset, "code_points", lambda: list(range(0x3400)))
    files = find_model_files(name, path)
    info = inspect_model(name, path, wait=True)  # the gate, its verdict cached
    verdict = libraries.cached_verdict(libraries.gate_key(files))
    assert verdict is not None and [c["route"] for c in verdict["candidates"]] == TEKKEN_ROUTES
    route = libraries.cached_route(files)
    reference = Tekkenizer.from_file(path)
    texts = tekken_texts(reference, multilingual)
    served = libraries.load(files)  # a worker: the verdict's route, built, the check set run again
    if name == "tekken_made":
        assert route in TEKKEN_ROUTES, verdict  # both pass on the made file: the rule picks one
    if route is None:  # every route differed somewhere, or was over the memory bound: tiktoken serves
        assert info.encoder == served.encoder == "tiktoken" and not verdict["passed"], verdict
    else:
        assert info.encoder == served.encoder == route
        promoted = libraries.load(files, libraries.REFERENCE)
        assert promoted.promote(route) and promoted.encoder == route  # what a PROMOTE frame does in a worker
        assert_mistral_commons_ids(promoted, reference, texts[:50])
        promoted.fall_back()  # what shadow verification does on a mismatch: tiktoken again, for good
        assert (promoted.encoder, promoted.fast) == ("tiktoken", None) and not promoted.promote(route)
        assert_mistral_commons_ids(promoted, reference, texts[:50])
    assert_mistral_commons_ids(served, reference, texts)


def test_tekken_files_mistral_common_refuses_are_refused_in_one_line(made, tmp_path):
    document = json.loads(made["tekken_made"].read_bytes())
    cases = {
        "v11-unlisted": (
            {**document, "special_tokens": None},
            "a tekken.json of version v13 must list its special_tokens",
        ),
        "bad-version": ({**document, "config": {**document["config"], "version": "13"}}, "is not a tokenizer version"),
        "too-many": ({**document, "config": {**document["config"], "default_num_special_tokens": 3}}, "at most"),
    }
    for name, (changed, message) in cases.items():
        path = tmp_path / f"tekken_{name}.json"
        if changed.get("special_tokens", ...) is None:
            changed = {key: value for key, value in changed.items() if key != "special_tokens"}
        path.write_text(json.dumps(changed))
        with pytest.raises(ModelLoadError, match=re.escape(message)):
            find_model_files(name, path)


@pytest.mark.parametrize("file", SENTENCEPIECE_RELEASED)
def test_mistrals_versioned_sentencepiece_files_are_recognized_by_content(multilingual, file):
    from mistral_common.tokens.tokenizers.sentencepiece import SentencePieceTokenizer

    files = find_model_files("m", MISTRAL / file)
    assert files.library == "sentencepiece"
    library = libraries.load(files)
    reference = SentencePieceTokenizer(str(MISTRAL / file))
    texts = multilingual[:40] + EDGE_CASES
    got = libraries.flatten_rows(*library.encode_plain(texts, False))
    assert [row.tolist() for row in got] == [reference.encode(text, bos=False, eos=False) for text in texts]
    assert (library.bos_id, library.eos_id) == (reference.bos_id, reference.eos_id)


# -- --models-dir ----------------------------------------------------------------------------------------------


def _models_folder(root: Path, made: dict[str, Path]) -> Path:
    models = root / "models"
    (models / "llama3" / "original").mkdir(parents=True)
    shutil.copy(META["llama3"][0], models / "llama3" / "original" / "tokenizer.model")
    shutil.copytree(made["llama3like"], models / "llama3like")
    (models / "nemo").mkdir()
    shutil.copy(MISTRAL / "tekken_240911.json", models / "nemo" / "tekken.json")
    shutil.copy(made["tekken_made"], models / "tekken_made.json")
    shutil.copy(
        MISTRAL / "mistral_instruct_tokenizer_240323.model.v3", models / "mistral_instruct_tokenizer_240323.model.v3"
    )
    (models / "notes.txt").write_text("")
    (models / "weights").mkdir()
    (models / "weights" / "config.json").write_text("{}")
    (models / ".cache").mkdir()
    return models


EXPECTED_SKIPS = [
    "skipping .cache: a directory holding no tokenizer.json, tekken.json or original/tokenizer.model",
    "skipping notes.txt: not a model file's name (*.model, *.model.vN, *.tiktoken, tekken*.json)",
    "skipping weights: a directory holding no tokenizer.json, tekken.json or original/tokenizer.model",
]


def test_models_dir_serves_the_new_kinds_and_logs_each_skip_once(made, tmp_path, caplog):
    models = _models_folder(tmp_path, made)
    (models / "cl100k.tiktoken").write_text("")
    (models / "cl100k.tiktoken.json").write_text("{}")
    with caplog.at_level(logging.INFO, logger="tokenizer"):
        found = models_in(models)
        models_in(models)  # read again (the server reads its options twice): no second line
    assert found == {
        "cl100k": models / "cl100k.tiktoken",
        "llama3": models / "llama3",
        "llama3like": models / "llama3like",
        "mistral_instruct_tokenizer_240323.v3": models / "mistral_instruct_tokenizer_240323.model.v3",
        "nemo": models / "nemo",
        "tekken_made": models / "tekken_made.json",
    }
    lines = [record.getMessage() for record in caplog.records if "skipping" in record.getMessage()]
    assert lines == [f"--models-dir {models}: {skip}" for skip in [
        EXPECTED_SKIPS[0],
        "skipping cl100k.tiktoken.json: the sidecar of cl100k.tiktoken, read with it",
        *EXPECTED_SKIPS[1:],
    ]]  # fmt: skip


# -- through a server, the pre-tokenizer, verify and an export --------------------------------------------------


@pytest.fixture(scope="module")
def shipped_server(made, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, Path]]:
    root = tmp_path_factory.mktemp("shipped-server")
    models = _models_folder(root, made)
    log = root / "server.log"
    url, process = start_server(["--models-dir", str(models), "--workers", "2", "--encoder", "reference"], log)
    yield url, models, log
    stop_server(process)


def _references(models: Path) -> dict[str, object]:
    return {
        "llama3": meta_reference(models / "llama3" / "original" / "tokenizer.model"),
        "llama3like": meta_reference(models / "llama3like" / "original" / "tokenizer.model"),
        "nemo": Tekkenizer.from_file(models / "nemo" / "tekken.json"),
        "tekken_made": Tekkenizer.from_file(models / "tekken_made.json"),
    }


def _want(reference: object, texts: list[str], parse_special: bool) -> list[list[int]]:
    if isinstance(reference, Tekkenizer):
        return tekken_reference_rows(reference, texts, parse_special)
    allowed = "all" if parse_special else set()
    return [reference.encode(text, bos=False, eos=False, allowed_special=allowed) for text in texts]  # type: ignore[attr-defined]


@pytest.mark.slow  # a real server of the new kinds; .ci/run's slow stage
def test_the_server_serves_them_with_the_makers_ids(shipped_server, multilingual):
    url, models, log = shipped_server
    described = {model["name"]: model for model in httpx.get(f"{url}/v1/models").json()["models"]}
    ranks = len(load_bpe_file(models / "llama3like" / "original" / "tokenizer.model"))
    assert {name: (m["library"], m["bos_id"], m["eos_id"]) for name, m in described.items()} == {
        "llama3": ("tiktoken", 128000, 128001),
        "llama3like": ("tiktoken", ranks, ranks + 1),  # Meta's special tokens after the ranks
        "mistral_instruct_tokenizer_240323.v3": ("sentencepiece", 1, 2),
        "nemo": ("mistral-common", 1, 2),
        "tekken_made": ("mistral-common", 1, 2),
    }
    text = log.read_text()
    assert (
        f"model 'llama3': {models}/llama3/original/tokenizer.model: "
        "tiktoken BPE ranks of Meta's Llama 3 (recognized by its sha256)" in text
    )
    assert f"model 'nemo': {models}/nemo/tekken.json: a Mistral tekken.json" in text
    for skip in EXPECTED_SKIPS:
        assert text.count(f"--models-dir {models}: {skip}") == 1, skip
    texts = multilingual + EDGE_CASES + special_strings(["<|begin_of_text|>", "<|eot_id|>", "[INST]", "</s>", "<s>"])
    with TokenizerClient(url) as client:
        for name, reference in _references(models).items():
            for parse_special in (False, True):
                for format in ("binary", "json"):
                    got = client.tokenize(texts, model=name, format=format, parse_special_tokens=parse_special)
                    assert [ids.tolist() for ids in got] == _want(reference, texts, parse_special), (
                        name,
                        parse_special,
                    )
            rows = _want(reference, texts[:30], True)
            decoded = [
                reference.decode(row, special_token_policy=SpecialTokenPolicy.KEEP)  # type: ignore[call-arg]
                if isinstance(reference, Tekkenizer)
                else reference.decode(row)  # type: ignore[attr-defined]
                for row in rows
            ]
            assert client.detokenize(rows, model=name) == decoded
            framed = client.tokenize(texts[:5], model=name, add_bos=True, add_eos=True)
            bos, eos = described[name]["bos_id"], described[name]["eos_id"]
            assert [ids.tolist() for ids in framed] == [[bos, *row, eos] for row in _want(reference, texts[:5], False)]
        packed = httpx.post(
            f"{url}/v1/pack", json={"texts": texts[:20], "model": "nemo", "seq_len": 256, "add_eos": True}
        )
        assert packed.status_code == 200, packed.text


@pytest.mark.slow  # runs of the pre-tokenizer; .ci/run's slow stage
def test_pretokenize_verify_and_export_take_the_new_kinds(shipped_server, made, multilingual, tmp_path):
    from tokenizer_client import TokenDataset
    from tokenizer_service.tools.pretokenize.cli import main as pretokenize
    from tokenizer_service.tools.pretokenize.shards_cli import main as shards

    url, models, _ = shipped_server
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": text}) + "\n" for text in multilingual))
    local = tmp_path / "local"
    common = [str(corpus), "-q"]
    # --local: a Tekken file (its fast encoder's gate scanned beside the run); --url: Meta's and the Tekken file
    assert pretokenize([*common, "--output", str(local), "--local", "--model", str(made["tekken_made"])]) == 0
    assert pretokenize([*common, "--output", str(tmp_path / "served"), "--url", url, "--model", "tekken_made"]) == 0
    assert pretokenize([*common, "--output", str(tmp_path / "llama3"), "--url", url, "--model", "llama3"]) == 0
    reference = Tekkenizer.from_file(made["tekken_made"])
    for output in (local, tmp_path / "served"):
        dataset = TokenDataset(output)
        assert dataset.metadata["model"]["library"] == "mistral-common"
        assert [dataset[i].tolist() for i in range(len(dataset))] == [
            reference.encode(text, bos=False, eos=True) for text in multilingual
        ]
    llama = meta_reference(models / "llama3" / "original" / "tokenizer.model")
    dataset = TokenDataset(tmp_path / "llama3")
    assert [dataset[i].tolist() for i in range(len(dataset))] == [
        llama.encode(text, bos=False, eos=True, allowed_special=set()) for text in multilingual
    ]
    assert shards(["verify", str(local), "--sample", "30"]) == 0
    assert shards(["verify", str(tmp_path / "llama3"), "--sample", "30", "--model", str(models / "llama3")]) == 0
    out = tmp_path / "megatron" / "docs"
    assert shards(["export", str(local), "--to", "megatron", "--output", str(out)]) == 0
    assert Path(f"{out}.bin").stat().st_size > 0 and Path(f"{out}.idx").stat().st_size > 0
