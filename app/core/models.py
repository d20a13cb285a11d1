"""What a model file is: recognized by content, one of four libraries' formats, and what it says of itself.

The four kinds, and the files each one reads (their bytes, in this order, make the model's sha256):

==============  =========================================  ===============================================
library         PATH (``--model NAME=PATH``)                files hashed, in order
==============  =========================================  ===============================================
sentencepiece   a ``.model`` (serialized ModelProto)        the ``.model``
tokenizers      a Hugging Face ``tokenizer.json``, or a     ``tokenizer.json``, then ``tokenizer_config.json``
                directory holding one (a Hub snapshot)      when it is beside it (BOS/EOS/PAD/UNK come from it)
tiktoken        BPE ranks (``*.tiktoken``: a line           the ranks, then ``<file>.json`` when it is beside
                ``base64-token rank`` per token; Meta's     it (its pattern, special tokens, BOS/EOS/PAD)
                ``tokenizer.model`` is such a file)
mistral-common  Mistral's ``tekken.json`` (a JSON object    the ``tekken.json``
                with ``config.pattern`` and ``vocab``)
==============  =========================================  ===============================================

A directory is served from the first of ``tokenizer.json``, ``tekken.json`` and ``original/tokenizer.model``
it holds (`directory_file`). Files are recognized by content, whatever their name (``*.model.v7`` too).

A tiktoken file of one of OpenAI's encodings that the installed ``tiktoken`` knows (cl100k_base,
o200k_base, ...) is recognized by its sha256 and gets that encoding's pattern and special tokens, with
``<|endoftext|>`` as EOS; so is Meta's released Llama 3 and Llama 4 ``tokenizer.model`` (`META_FILES`),
with Meta's pattern, special tokens (the reserved ones included) and BOS/EOS/PAD as Meta's ``llama_models``
Tokenizer builds them (`meta_encoding`). Any other needs the ``<file>.json`` sidecar::

    {"pat_str": "...", "special_tokens": {"<|endoftext|>": 100257}, "bos_token": null,
     "eos_token": "<|endoftext|>", "pad_token": null}

or ``{"like": "llama3"}`` (or ``"llama4"``): ranks laid out as Meta's, its special tokens after the ranks.

Nothing here loads a tokenizer library: this module reads files and says what they are
(`find_model_files`); tokenizer_service.core.libraries loads them.
"""

from __future__ import annotations

import base64
import binascii
import errno
import functools
import hashlib
import importlib.util
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import orjson

from tokenizer_service.core import cache

SENTENCEPIECE, TOKENIZERS, TIKTOKEN = "sentencepiece", "tokenizers", "tiktoken"
TEKKEN = "mistral-common"  # Mistral's tekken.json, encoded as mistral-common's Tekkenizer encodes it
LIBRARIES = (SENTENCEPIECE, TOKENIZERS, TIKTOKEN, TEKKEN)
KINDS = (
    "a SentencePiece .model, a Hugging Face tokenizer.json, tiktoken BPE ranks (*.tiktoken, Meta's "
    "tokenizer.model), a Mistral tekken.json, or a directory holding a tokenizer.json, tekken.json or "
    "original/tokenizer.model"
)
HF_FILE, HF_CONFIG = "tokenizer.json", "tokenizer_config.json"
TEKKEN_FILE, ORIGINAL_FILE = "tekken.json", "original/tokenizer.model"
DIRECTORY_FILES = (HF_FILE, TEKKEN_FILE, ORIGINAL_FILE)  # what a directory is served from: the first it holds
SPECIAL_ROLES = ("bos", "eos", "pad", "unk")

_TIKTOKEN_LINE = re.compile(rb"^[A-Za-z0-9+/]*={0,2} [0-9]+$")
# Ids travel as int32 (the binary answers, the shards' dtype, numpy downstream): every id of a served model
# lies below this, or the model is refused at start (tiktoken and fastokens take ids up to 2**32 - 1).
ID_LIMIT = 1 << 31


class ModelLoadError(RuntimeError):
    """A configured model file is missing, unreadable, or none of the kinds this service serves."""


SERVER_ONLY = frozenset(
    {"path", "files", "chat_template_path", "gate", "select"}
)  # ModelInfo's fields that /v1/models and metadata.json leave out


@dataclass(frozen=True)
class ModelInfo:
    """A model as the server announces it (/v1/models, metadata.json) and as workers load it."""

    name: str
    path: Path
    library: str  # sentencepiece | tokenizers | tiktoken | mistral-common
    encoder: str  # what encodes it in the workers: the library itself, or fastokens behind its check
    type: str  # the algorithm: unigram, bpe, wordpiece, wordlevel, char, word
    vocab_size: int  # the largest id + 1, special tokens included
    bos_id: int  # -1: the model has none
    eos_id: int
    pad_id: int
    unk_id: int
    sha256: str
    files: tuple[Path, ...] = field(default=(), compare=False)  # what sha256 covers, in order
    # null, or {"sha256", "source", "loss_mask"} (tokenizer_service.core.chat.announce)
    chat_template: dict[str, Any] | None = None
    chat_template_path: Path | None = field(default=None, compare=False)  # --chat-template's file, for workers
    # the fast encoder's gate as announced (tokenizer_service.core.libraries.announced_gate): "pending" is
    # scanned beside the work (tokenizer_service.core.gatescan) while `encoder` names the library
    gate: str | None = field(default=None, compare=False)
    # the fast encoders the gate may choose from: "fast" (all, by the rule) or the one pinned (--encoder gigatoken)
    select: str = field(default="fast", compare=False)
    # what sentencepiece matches in any text whatever parse_special_tokens says: its USER_DEFINED pieces
    # (read from the model file, which sha256 covers; () for the other libraries)
    user_defined_pieces: tuple[str, ...] = field(default=(), compare=False)

    @property
    def padding_id(self) -> int:
        """The pad id, else EOS, else 0: what best-fit packing pads with (padding is masked out of the labels)."""
        for candidate in (self.pad_id, self.eos_id):
            if candidate >= 0:
                return candidate
        return 0

    @classmethod
    def from_dict(cls, described: dict[str, Any], path: Path) -> ModelInfo:
        """The inverse of `as_dict` (a /v1/models entry, a metadata.json model), with `path` for the file.

        Outputs and servers from before tokenizers and tiktoken were served describe SentencePiece models
        without `library` and `encoder`."""
        described = {
            "library": SENTENCEPIECE,
            "encoder": described.get("library", SENTENCEPIECE),
            **described,
        }
        described.setdefault("chat_template", None)  # described before conversations were served
        described["user_defined_pieces"] = tuple(described.get("user_defined_pieces") or ())  # JSON: a list
        kept = {f.name: described[f.name] for f in fields(cls) if f.name not in SERVER_ONLY}
        return cls(path=path, **kept)

    def as_dict(self) -> dict[str, str | int]:
        """What /v1/models and metadata.json say of the model: every field but the server's own paths."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in SERVER_ONLY}


@dataclass(frozen=True)
class TiktokenSpec:
    """What a ranks file needs besides its ranks: the split pattern, special tokens, and their roles."""

    encoding: str | None  # OpenAI's encoding name when tiktoken knows the file, Meta's (llama3, llama4), else None
    pat_str: str
    special_tokens: dict[str, int]
    tokens: dict[str, str | None]  # role (bos, eos, pad) -> special token string
    known: bool = False  # recognized by its sha256 (not named by a sidecar's "like")


@dataclass(frozen=True)
class ModelFiles:
    """A model file recognized by content: its library, and every file that changes its ids, in hash order."""

    library: str
    path: Path  # what was configured (a tokenizer.json's directory stays the directory)
    files: tuple[Path, ...]
    contents: tuple[bytes, ...]
    template: TemplateFile | None = None  # its chat template (find_template), whose bytes join the sha256

    @property
    def main(self) -> Path:
        return self.files[0]

    @functools.cached_property
    def sha256(self) -> str:
        """The model's sha256: its files' bytes, then its chat template's where they are not among them."""
        if self.template is not None and self.template.hashed:
            return files_sha256((*self.contents, self.template.hashed))
        return self.contents_sha256

    # Each sha256 is taken once a ModelFiles (a 128k tokenizer.json is hashed in 10-20 ms, and a start asked for
    # these four to six times); a cached value is kept in the instance's __dict__, a frozen dataclass's too.
    @functools.cached_property
    def contents_sha256(self) -> str:
        """sha256 of the tokenizer files' bytes alone (no chat template): what the gate's verdicts are keyed by."""
        return files_sha256(self.contents)

    @functools.cached_property
    def main_sha256(self) -> str:
        """sha256 of the main file's bytes: how OpenAI's, Meta's and Mistral's released files are recognized."""
        return files_sha256(self.contents[:1])

    def special_tokens(self) -> dict[str, str | None]:
        """role (bos, eos, pad, unk) -> token string, from tokenizer_config.json or the tiktoken spec."""
        if self.library == TOKENIZERS:
            return hf_special_tokens(self)
        if self.library == TIKTOKEN:
            return {**tiktoken_spec(self).tokens, "unk": None}
        if self.library == TEKKEN:
            return tekken_spec(self).tokens
        return {}

    def recognized(self) -> str:
        """What the file was recognized as, for the start's log line: the kind, and a known encoding's name."""
        what = {
            SENTENCEPIECE: "a SentencePiece model",
            TOKENIZERS: "a Hugging Face tokenizer.json",
            TIKTOKEN: "tiktoken BPE ranks",
            TEKKEN: "a Mistral tekken.json (mistral-common's Tekkenizer)",
        }[self.library]
        if self.library == TIKTOKEN:
            spec = tiktoken_spec(self)
            if spec.encoding in META_ENCODINGS:
                how = "its sha256" if spec.known else f'{self.main.name}.json\'s "like"'
                what += f" of Meta's {META_ENCODINGS[spec.encoding].title} (recognized by {how})"
            elif spec.encoding is not None:
                what += f" of OpenAI's {spec.encoding} (recognized by its sha256)"
            else:
                what += f" (pattern and special tokens from {self.main.name}.json)"
        return f"{self.main}: {what}"


def files_sha256(contents: tuple[bytes, ...] | list[bytes]) -> str:
    """sha256 over the files' bytes end to end, in their order (one file: that file's sha256)."""
    digest = hashlib.sha256()
    for content in contents:
        digest.update(content)
    return digest.hexdigest()


def _read(name: str, path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ModelLoadError(f"model {name!r}: cannot read {path}: {why_unreadable(path) or exc.strerror}") from exc


def why_unreadable(path: Path) -> str | None:
    """Why `path` cannot be read as a file (a link leading nowhere, a link loop, no permission), or None.

    None also for a path that does not exist at all: what is missing is the caller's to say."""
    try:
        if path.is_symlink():
            try:
                path.stat()
            except FileNotFoundError:
                return f"a link to {os.readlink(path)}, which does not exist"
        with path.open("rb"):
            return None
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "a link that leads back to itself"
        if exc.errno == errno.EISDIR:
            return "a directory"
        return exc.strerror or str(exc)


def find_model_files(name: str, path: Path, chat_template: Path | None = None) -> ModelFiles:
    """Recognize the model at `path` by its content (not its name), with every file that changes its ids, and
    its chat template (`chat_template`: the --chat-template file, else the model's own; `find_template`)."""
    given = path.expanduser()  # what messages name: the path as the user wrote it
    inside = directory_file(given) if given.is_dir() else None
    if given.is_dir() and inside is None:
        beside = next((found for found in sorted(given.glob("*.model")) if found.is_file()), None)
        hint = (  # a snapshot of a SentencePiece model (Llama 2, Gemma) names no file the directory form reads
            f": give the file, --model {name}={beside} (with --chat-template {name}=FILE for conversations: the "
            f"directory's {HF_CONFIG} is not read for a .model)"
            if beside is not None
            else f"; a model is {KINDS}"
        )
        raise ModelLoadError(
            f"model {name!r}: the directory {given} holds no {', '.join(DIRECTORY_FILES[:-1])} or "
            f"{DIRECTORY_FILES[-1]}{hint}"
        )
    content = _read(name, given / inside if inside is not None else given)
    digest = hashlib.sha256(content)  # taken once (10-20 ms for a 128k tokenizer.json): main_sha256, contents_sha256
    main_sha256 = digest.hexdigest()
    library = sniff(content, main_sha256)
    if library is None:
        raise ModelLoadError(
            f"model {name!r}: {given / inside if inside is not None else given} is not a model file; a model is {KINDS}"
        )
    # Absolute but not resolved: a Hub cache links snapshots/REV/tokenizer.json to blobs/HASH, and the
    # config or sidecar beside the link is what belongs to it (workers read the model again by this path).
    path = given.absolute()
    main = path / inside if inside is not None else path
    files, contents = [main], [content]
    beside = {
        TOKENIZERS: main.parent / HF_CONFIG,
        TIKTOKEN: main.with_name(main.name + ".json"),
    }.get(library)
    if beside is not None and os.path.lexists(beside):  # a dangling link beside is refused, not skipped
        files.append(beside)
        contents.append(_read(name, beside))
    config = contents[1] if library == TOKENIZERS and len(contents) > 1 else None
    try:
        template = find_template(library, main, config, chat_template)
    except ModelLoadError as exc:
        raise ModelLoadError(f"model {name!r}: {exc}") from None
    found = ModelFiles(library, path, tuple(files), tuple(contents), template)
    for more in contents[1:]:
        digest.update(more)
    # the cached_properties, already known (files_sha256: the files' bytes end to end)
    found.__dict__.update(main_sha256=main_sha256, contents_sha256=digest.hexdigest())
    if library == TIKTOKEN:
        tiktoken_spec(found, name)  # refuse a file without its pattern now, in one line
    if library == TEKKEN:
        tekken_spec(found, name)
    return found


# Mistral's SentencePiece files: tokenizer.model.v3, mistral_instruct_tokenizer_241114.model.v7m1, ...
_VERSIONED_MODEL = re.compile(r"^(?P<stem>.+)\.model\.(?P<version>v[0-9]+[A-Za-z0-9]*)$")


def model_file_name(path: Path) -> str | None:
    """The name a models directory serves the file `path` under, None for a file it does not serve: NAME.model
    and NAME.tiktoken as NAME, Mistral's NAME.model.v7 as NAME.v7, a tekken*.json (as mistral-common names
    them: tekken.json, tekken_240911.json) under its stem."""
    if path.suffix in (".model", ".tiktoken"):
        return path.stem
    if (versioned := _VERSIONED_MODEL.match(path.name)) is not None:
        return f"{versioned['stem']}.{versioned['version']}"
    if path.suffix == ".json" and path.name.startswith("tekken"):
        return path.stem
    return None


def directory_file(directory: Path) -> str | None:
    """The file a model directory is served from (relative to it): the first of `DIRECTORY_FILES` it holds
    (a dangling link counts: reading it is refused, naming it), else None."""
    return next((file for file in DIRECTORY_FILES if os.path.lexists(directory / file)), None)


@functools.lru_cache(maxsize=2)
def parsed_json(content: bytes) -> Any:
    """`content` parsed as JSON once for the steps of loading one model (recognizing it, its library, its special
    tokens: a 128k tokenizer.json takes 0.1-0.2 s a parse); read only. `tokenizer_service.core.libraries.load`
    empties the cache when the model is loaded, so the parsed document is not kept. orjson, or the stdlib where
    orjson refuses the text (a lone surrogate escaped in a string)."""
    try:
        return orjson.loads(content)
    except orjson.JSONDecodeError:
        return json.loads(content)


def sniff(content: bytes, sha256: str | None = None) -> str | None:
    """Which library's format these bytes are in, or None. SentencePiece is only a candidate: loading decides.
    `sha256`: the content's, where known (a JSON file's outline is kept by it: `json_outline`)."""
    if content[:4096].lstrip().startswith(b"{"):
        outline = json_outline(content, sha256)
        if outline is not None:
            return outline["library"]  # a tokenizer.json, a tekken.json, or JSON that is neither (None)
    if _TIKTOKEN_LINE.match(content[:4096].split(b"\n", 1)[0].rstrip(b"\r")):
        return TIKTOKEN
    if content[:1] == b"\n":  # a serialized ModelProto starts with field 1 (pieces), length-delimited
        return SENTENCEPIECE
    return None


# -- a JSON model file's outline ---------------------------------------------------------------------------------

OUTLINE = 1  # what a kept outline holds; a new one reads no older entry
_OUTLINES: dict[str, dict[str, Any] | None] = {}  # this process's, by sha256: read or made once (sniff, load, build)
OUTLINES_MOST = 64


def json_outline(content: bytes, sha256: str | None = None) -> dict[str, Any] | None:
    """What a start needs of a JSON model file, short of its vocabulary: `library` (TOKENIZERS, TEKKEN, or None for
    JSON that is neither); for a tokenizer.json, its model's `dropout`, whether it has a `normalizer`, its
    `added_tokens`, and `span`, the [start, end) bytes of that added_tokens array in `content` (None where it was
    not found as it parsed). None: not JSON. Kept in the cache (tokenizer_service.core.cache) by the content's
    sha256: the first process to read the file parses it (orjson: 0.1-0.2 s for a 128k tokenizer.json, and 0.04 s
    to free the parse), later ones read the outline."""
    digest = sha256 or hashlib.sha256(content).hexdigest()
    if digest in _OUTLINES:
        return _OUTLINES[digest]
    key = {"outline": OUTLINE, "sha256": digest}
    kept = cache.read(key)
    outline: dict[str, Any] | None = None
    if kept is not None and isinstance(kept.get("outline"), dict):
        outline = kept["outline"]
    else:
        try:
            outline = _outline_of(parsed_json(content), content)
        except ValueError:  # not JSON
            outline = None
        if outline is not None:
            cache.write(key, {"key": key, "outline": outline})
    if len(_OUTLINES) >= OUTLINES_MOST:
        _OUTLINES.clear()
    _OUTLINES[digest] = outline
    return outline


def _outline_of(document: Any, content: bytes) -> dict[str, Any]:
    if not isinstance(document, dict):
        return {"library": None}
    model = document.get("model")
    if isinstance(model, dict) and ("type" in model or "vocab" in model):  # older files have no type
        added = document.get("added_tokens") or []
        return {
            "library": TOKENIZERS,
            "dropout": model.get("dropout"),
            "normalizer": document.get("normalizer") is not None,
            "added_tokens": added,
            "span": _array_span(content, b'"added_tokens"', added) if isinstance(added, list) and added else None,
        }
    config = document.get("config")
    if isinstance(config, dict) and "pattern" in config and isinstance(document.get("vocab"), list):
        return {"library": TEKKEN}  # Mistral's tekken.json
    return {"library": None}


SPAN_TRIES = 64  # closing brackets tried as an array's end, for each of the first 4 places its key is written


def _array_span(content: bytes, key: bytes, value: list[Any]) -> list[int] | None:
    """[start, end) of the JSON array `value` written after `key` in `content`: the first place where the bytes from
    a `[` after `key:` to a `]` parse as exactly `value`, or None."""
    at = 0
    for _ in range(4):
        at = content.find(key, at)
        if at < 0:
            return None
        at += len(key)
        start = at
        while start < len(content) and content[start] in b" \t\r\n:":
            start += 1
        if start >= len(content) or content[start : start + 1] != b"[":
            continue
        end = start
        for _ in range(SPAN_TRIES):
            end = content.find(b"]", end + 1)
            if end < 0:
                break
            try:
                if orjson.loads(content[start : end + 1]) == value:
                    return [start, end + 1]
            except orjson.JSONDecodeError:
                continue
    return None


def ordinary_added_tokens(added_tokens: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A tokenizer.json's added tokens without its special ones."""
    return [added for added in added_tokens if not added.get("special")]


def without_special_tokens(document: str | dict[str, Any]) -> str:
    """A tokenizer.json (its text, or parsed) with its special added tokens left out (ordinary ones kept)."""
    parsed = dict(parsed_json(document) if isinstance(document, str | bytes) else document)
    parsed["added_tokens"] = ordinary_added_tokens(parsed.get("added_tokens") or [])
    try:
        return orjson.dumps(parsed).decode("utf-8")
    except TypeError:  # a lone surrogate in a string (orjson writes UTF-8 only)
        return json.dumps(parsed, ensure_ascii=False)


def without_special_added_tokens(content: bytes, outline: dict[str, Any]) -> str | None:
    """`without_special_tokens` of the tokenizer.json `content`, written by splicing its added_tokens array
    (`json_outline`'s span), not by parsing and writing the whole file again; None where the outline found no
    span."""
    span = outline.get("span")
    if span is None:
        return None
    kept = ordinary_added_tokens(outline["added_tokens"])
    return (content[: span[0]] + orjson.dumps(kept) + content[span[1] :]).decode("utf-8")


# -- chat templates ------------------------------------------------------------------------------------

TEMPLATE_FILE = "chat_template.jinja"


@dataclass(frozen=True)
class TemplateFile:
    """A model's chat template: its text, where it came from, and the bytes that join the model's sha256."""

    text: str
    source: str  # "flag" | "snapshot" | "tokenizer_config"
    path: Path
    hashed: bytes  # b"" when its bytes are hashed already (tokenizer_config.json is one of the model's files)


def _template_text(path: Path, content: bytes) -> str:
    try:
        return content.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ModelLoadError(f"the chat template {path} is not UTF-8 (byte {exc.start})") from None


def find_template(library: str, main: Path, config: bytes | None, flag: Path | None) -> TemplateFile | None:
    """A model's chat template, first match wins: the --chat-template file (any kind of model), then a
    tokenizer.json's chat_template.jinja beside it, then its tokenizer_config.json's `chat_template` (a
    string, or a list of {name, template}: the one named default)."""
    if flag is not None:
        flag = flag.expanduser()
        try:
            content = flag.read_bytes()
        except OSError as exc:
            raise ModelLoadError(f"cannot read the chat template {flag}: {exc.strerror}") from None
        return TemplateFile(_template_text(flag, content), "flag", flag.absolute(), content)
    if library != TOKENIZERS:
        return None
    beside = main.parent / TEMPLATE_FILE
    if beside.is_file():
        content = beside.read_bytes()
        return TemplateFile(_template_text(beside, content), "snapshot", beside, content)
    if config is None:
        return None
    try:
        document = json.loads(config)
    except ValueError:
        return None  # hf_special_tokens refuses a config that is not JSON, naming it
    value = document.get("chat_template") if isinstance(document, dict) else None
    if isinstance(value, list):
        named = {item.get("name"): item.get("template") for item in value if isinstance(item, dict)}
        value = named.get("default")
    if not isinstance(value, str):
        return None
    return TemplateFile(value, "tokenizer_config", main.parent / HF_CONFIG, b"")


# -- Hugging Face tokenizer.json -----------------------------------------------------------------------


def json_object(path: Path, content: bytes) -> dict[str, Any]:
    """A config or sidecar file's JSON object; ModelLoadError naming the file otherwise."""
    try:
        document = json.loads(content)
    except ValueError as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(document, dict):
        raise ModelLoadError(f"{path} is not a JSON object")
    return document


def hf_special_tokens(files: ModelFiles, names: Sequence[str] = SPECIAL_ROLES) -> dict[str, str | None]:
    """BOS, EOS, PAD and UNK (or the roles `names`: sep, cls, mask) as tokenizer_config.json names them, `<role>_token`:
    a string or an AddedToken object; None where it names none."""
    roles: dict[str, str | None] = dict.fromkeys(names)
    if len(files.files) < 2:
        return roles
    config = json_object(files.files[1], files.contents[1])
    for role in names:
        value = config.get(f"{role}_token")
        if isinstance(value, dict):
            value = value.get("content")
        if value is not None and not isinstance(value, str):
            raise ModelLoadError(f"{files.files[1]}: {role}_token is neither a string nor an AddedToken object")
        roles[role] = value
    return roles


def hf_model_type(document: dict[str, Any], loaded: Any = None) -> str:
    """The algorithm a parsed tokenizer.json names (older tokenizers releases wrote none: then the loaded model's)."""
    if "type" in document["model"]:
        return str(document["model"]["type"]).lower()
    return type(loaded.model).__name__.lower() if loaded is not None else "unknown"


def hf_vocab_size(document: dict[str, Any], loaded: Any) -> int:
    """One more than the highest id of a parsed tokenizer.json, its added tokens included, read from the document
    (the loaded model's `get_vocab` builds a dict of every token: 0.1 s for 128k); the loaded model's where the
    document's vocabulary has a shape this does not know."""
    vocab = document["model"].get("vocab")
    top: int | None = None
    if isinstance(vocab, dict) and all(type(value) is int for value in vocab.values()):
        top = max(vocab.values(), default=-1)
    elif isinstance(vocab, list):  # Unigram: [piece, score] pairs, ids by position
        top = len(vocab) - 1
    added = document.get("added_tokens") or []
    # tokenizers gives an added token the file's id only where that id follows the ones before it (else the next
    # free one): where any differs, the library counts
    if top is not None and all(
        type(token.get("id")) is int and loaded.token_to_id(token.get("content")) == token["id"] for token in added
    ):
        return max([top, *(token["id"] for token in added)]) + 1
    return max(loaded.get_vocab(with_added_tokens=True).values(), default=-1) + 1


# -- tiktoken ranks ------------------------------------------------------------------------------------


def tiktoken_ranks(content: bytes, path: Path) -> dict[bytes, int]:
    """The ranks of a `.tiktoken` file, parsed as tiktoken's own loader does.

    Not `tiktoken.load.load_tiktoken_bpe`: it keeps a copy of every file it reads in a cache keyed by the
    file's *path*, so a file replaced at the same path would load its old ranks (the cache is only
    checked against a hash that a local file does not have)."""
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(content.splitlines(), 1):
        if not line:
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error) as exc:
            raise ModelLoadError(f"{path}:{number}: not a tiktoken ranks line ('base64-token rank')") from exc
        if int(rank) >= ID_LIMIT:
            raise ModelLoadError(f"{path}:{number}: rank {int(rank)} is not an int32 id (at most {ID_LIMIT - 1})")
    return ranks


@dataclass(frozen=True)
class MetaEncoding:
    """How Meta's `llama_models` Tokenizer builds an encoding around its ranks (llama3/tokenizer.py,
    llama4/tokenizer.py): the split pattern, the special tokens it names, then reserved ones up to
    `reserved` tokens in all, numbered from the number of ranks on; BOS, EOS and PAD among them."""

    title: str
    pat_str: str
    named: tuple[str, ...]
    reserved: int
    first_reserved: int  # the number of the first <|reserved_special_token_N|> that fills up to `reserved`
    tokens: dict[str, str | None]  # role (bos, eos, pad) -> special token string

    def special_tokens(self, ranks: int) -> dict[str, int]:
        fill = [f"<|reserved_special_token_{self.first_reserved + i}|>" for i in range(self.reserved - len(self.named))]
        return {token: ranks + index for index, token in enumerate((*self.named, *fill))}


def _numbered(kind: str, start: int, count: int) -> tuple[str, ...]:
    return tuple(f"<|{kind}_reserved_special_token_{i}|>" for i in range(start, start + count))


_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA4_PATTERN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
    r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
META_ENCODINGS = {
    "llama3": MetaEncoding(
        "Llama 3",
        _LLAMA3_PATTERN,
        (
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|reserved_special_token_0|>",
            "<|reserved_special_token_1|>",
            "<|finetune_right_pad_id|>",
            "<|step_id|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eom_id|>",
            "<|eot_id|>",
            "<|python_tag|>",
            "<|image|>",
        ),
        256,
        2,
        {"bos": "<|begin_of_text|>", "eos": "<|end_of_text|>", "pad": "<|finetune_right_pad_id|>"},
    ),
    "llama4": MetaEncoding(
        "Llama 4",
        _LLAMA4_PATTERN,
        (
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|fim_prefix|>",
            "<|fim_middle|>",
            "<|fim_suffix|>",
            # text post-training
            "<|header_start|>",
            "<|header_end|>",
            "<|eom|>",
            "<|eot|>",
            "<|step|>",
            *_numbered("text_post_train", 0, 6),
            "<|python_start|>",
            "<|python_end|>",
            "<|finetune_right_pad|>",
            *_numbered("text_post_train", 8, 61),
            # vision
            "<|image_start|>",
            "<|image_end|>",
            *_numbered("vision", 0, 2),
            "<|tile_x_separator|>",
            "<|tile_y_separator|>",
            *_numbered("vision", 2, 4),
            "<|image|>",
            *_numbered("vision", 6, 1),
            "<|patch|>",
            *_numbered("vision", 7, 1041),
            # reasoning
            *_numbered("reasoning", 0, 8),
            "<|reasoning_thinking_start|>",
            "<|reasoning_thinking_end|>",
        ),
        2048,
        0,
        {"bos": "<|begin_of_text|>", "eos": "<|end_of_text|>", "pad": "<|finetune_right_pad|>"},
    ),
}
# Meta's released tokenizer.model files (the one of every Llama 3.x, and Llama 4's), by sha256, with their
# number of ranks: as shipped in the llama-models wheel on PyPI (llama_models/llama3/tokenizer.model,
# llama_models/llama4/tokenizer.model) and in the Hub snapshots' original/tokenizer.model.
META_FILES = {
    "82e9d31979e92ab929cd544440f129d9ecd797b69e327f80f17e1c50d5551b55": ("llama3", 128000),
    "d0bdbaf59b0762c8c807617e2d8ea51420eb1b1de266df2495be755c8e0ed6ed": ("llama4", 200000),
}


def meta_encoding(name: str, ranks: int) -> tuple[str, str, dict[str, int]]:
    """(name, pat_str, special tokens) of Meta's encoding `name` around `ranks` ranks."""
    meta = META_ENCODINGS[name]
    return name, meta.pat_str, meta.special_tokens(ranks)


def known_encoding(sha256: str) -> tuple[str, str, dict[str, int]] | None:
    """(name, pat_str, special tokens) of the encoding whose ranks file has this sha256: Meta's released
    Llama 3 and Llama 4 files (`META_FILES`), or an OpenAI encoding when tiktoken knows it.

    tiktoken's constructors name each file's sha256 as they load it: each is run with a loader that
    answers only for this file (and loads nothing), which yields its pattern and special tokens offline.
    """
    if sha256 in META_FILES:
        return meta_encoding(*META_FILES[sha256])
    try:
        spec = importlib.util.find_spec("tiktoken_ext.openai_public")
    except ImportError:
        return None
    if spec is None or spec.loader is None:
        return None
    # A private copy of tiktoken's module, so that patching its loaders touches nothing anyone else uses.
    openai_public = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(openai_public)

    class NotThisOne(Exception):
        pass

    def loader(_url: str, expected_hash: str | None = None) -> dict[bytes, int]:
        if expected_hash == sha256:
            return {}
        raise NotThisOne

    def never(*_args: Any, **_kwargs: Any) -> dict[bytes, int]:
        raise NotThisOne

    openai_public.load_tiktoken_bpe, openai_public.data_gym_to_mergeable_bpe_ranks = loader, never  # type: ignore[attr-defined]
    for name, constructor in openai_public.ENCODING_CONSTRUCTORS.items():
        try:
            encoding = constructor()
        except NotThisOne:
            continue
        except Exception:  # a constructor that loads its file another way (a newer tiktoken): not known here
            continue
        return name, encoding["pat_str"], dict(encoding["special_tokens"])
    return None


_RANK_COUNTS: dict[str, int] = {}


def _rank_count(files: ModelFiles) -> int:
    """How many distinct tokens a ranks file holds (Meta numbers its special tokens from there), parsed once."""
    digest = files.main_sha256
    if digest not in _RANK_COUNTS:
        if len(_RANK_COUNTS) >= 8:
            _RANK_COUNTS.clear()
        _RANK_COUNTS[digest] = len(tiktoken_ranks(files.contents[0], files.main))
    return _RANK_COUNTS[digest]


def tiktoken_spec(files: ModelFiles, name: str | None = None) -> TiktokenSpec:
    """The pattern and special tokens of a ranks file: its known encoding's (Meta's or OpenAI's, by sha256;
    Meta's layout named by the sidecar's "like"), then whatever its sidecar sets."""
    known = known_encoding(files.main_sha256)
    recognized = known is not None
    sidecar: dict[str, Any] = {}
    sidecar_path = files.main.with_name(files.main.name + ".json")
    if len(files.files) > 1:
        sidecar = json_object(sidecar_path, files.contents[1])
    like = sidecar.get("like")
    if like is not None and like not in META_ENCODINGS:
        raise ModelLoadError(f'{sidecar_path}: "like" must be one of {", ".join(map(repr, META_ENCODINGS))}')
    if known is None and like is not None:  # Meta's layout around ranks of its own (as Meta's Tokenizer counts them)
        known = meta_encoding(like, _rank_count(files))
    if known is None and "pat_str" not in sidecar:
        what = f"model {name!r}: " if name else ""
        raise ModelLoadError(
            f"{what}{files.main} is tiktoken ranks of an encoding tiktoken does not know: add {sidecar_path} with "
            '{"pat_str": ..., "special_tokens": {...}, "bos_token": ..., "eos_token": ..., "pad_token": ...}'
        )
    encoding, pat_str, special_tokens = known if known is not None else (None, "", {})
    pat_str = sidecar.get("pat_str", pat_str)
    special_tokens = sidecar.get("special_tokens", special_tokens)
    if not isinstance(pat_str, str) or not pat_str:
        raise ModelLoadError(f"{sidecar_path}: pat_str must be a non-empty string (the split pattern)")
    if not isinstance(special_tokens, dict) or not all(
        isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) for k, v in special_tokens.items()
    ):
        raise ModelLoadError(f"{sidecar_path}: special_tokens must map token strings to integer ids")
    for token, token_id in special_tokens.items():
        if not 0 <= token_id < ID_LIMIT:  # tiktoken panics or overflows on some, fastokens on others
            raise ModelLoadError(
                f"{sidecar_path}: special token {token!r} has id {token_id}; an id must lie in 0..{ID_LIMIT - 1} "
                "(ids are answered as int32)"
            )
    default_eos = "<|endoftext|>" if known is not None and "<|endoftext|>" in special_tokens else None
    defaults: dict[str, str | None] = {"bos": None, "eos": default_eos, "pad": None}
    if encoding in META_ENCODINGS:
        defaults = {
            role: (token if token in special_tokens else None)
            for role, token in META_ENCODINGS[encoding].tokens.items()
        }
    tokens: dict[str, str | None] = {role: sidecar.get(f"{role}_token", default) for role, default in defaults.items()}
    for role, token in tokens.items():
        if token is not None and not isinstance(token, str):
            raise ModelLoadError(f"{sidecar_path}: {role}_token must be a string or null")
    return TiktokenSpec(encoding, pat_str, dict(special_tokens), tokens, recognized)


# -- Mistral's tekken.json -----------------------------------------------------------------------------

# The special tokens of a tekken.json of version v7 or older that lists none (mistral-common's
# Tekkenizer.DEPRECATED_SPECIAL_TOKENS, ranks 0..19); the rest up to default_num_special_tokens are fillers.
TEKKEN_DEPRECATED_SPECIAL = (
    "<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]", "[IMG_END]", "[PREFIX]", "[MIDDLE]",
    "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[TOOL_CONTENT]",
)  # fmt: skip
TEKKEN_FILLER = "<SPECIAL_{id}>"
_TEKKEN_ROLES = {"bos": "<s>", "eos": "</s>", "pad": "<pad>", "unk": "<unk>"}
_VERSION = re.compile(r"^v([0-9]+)$")


@dataclass(frozen=True)
class TekkenSpec:
    """A tekken.json as mistral-common's Tekkenizer reads it: special tokens first (ids 0..num_special - 1, the
    file's own list, then fillers), then the vocabulary's first `vocab_size - num_special` tokens, each id its
    rank plus num_special."""

    pattern: str
    version: str
    special: tuple[str, ...]  # the special token strings, by id
    vocab: tuple[str, ...]  # base64 token bytes, by rank (before the shift)
    vocab_size: int
    tokens: dict[str, str | None]  # role (bos, eos, pad, unk) -> special token string

    @property
    def num_special(self) -> int:
        return len(self.special)

    def ranks(self) -> dict[bytes, int]:
        """token bytes -> id (rank + num_special): tiktoken's mergeable ranks, shifted (their order is kept)."""
        shift = self.num_special
        return {base64.b64decode(token): rank + shift for rank, token in enumerate(self.vocab)}


_TEKKEN_SPECS: dict[str, TekkenSpec] = {}


def tekken_spec(files: ModelFiles, name: str | None = None) -> TekkenSpec:
    """What a tekken.json says, checked as mistral-common checks it; ModelLoadError in one line otherwise."""
    digest = files.main_sha256
    if digest in _TEKKEN_SPECS:
        return _TEKKEN_SPECS[digest]
    where = f"model {name!r}: {files.main}" if name else str(files.main)
    document = json_object(files.main, files.contents[0])
    config = document.get("config")
    try:
        pattern, version = config["pattern"], config["version"]
        vocab_size, num_special = int(config["default_vocab_size"]), int(config["default_num_special_tokens"])
        vocab = document["vocab"]
        listed = document.get("special_tokens")
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"{where}: not a tekken.json mistral-common reads (config or vocab: {exc!r})") from None
    matched = _VERSION.match(version) if isinstance(version, str) else None
    if matched is None:
        raise ModelLoadError(f"{where}: config.version {version!r} is not a tokenizer version (v1, v3, v7, v13, ...)")
    if listed is None:
        if int(matched.group(1)) > 7:
            raise ModelLoadError(f"{where}: a tekken.json of version {version} must list its special_tokens")
        special = list(TEKKEN_DEPRECATED_SPECIAL)
    else:
        if not isinstance(listed, list) or not all(
            isinstance(token, dict) and isinstance(token.get("token_str"), str) for token in listed
        ):
            raise ModelLoadError(f"{where}: special_tokens must be a list of {{rank, token_str, is_control}}")
        for position, token in enumerate(listed):
            if token.get("rank") != position:
                raise ModelLoadError(
                    f"{where}: special token {token['token_str']!r} has rank {token.get('rank')}, not {position}"
                )
        special = [token["token_str"] for token in listed]
    if len(set(special)) != len(special) or len(special) > num_special:
        raise ModelLoadError(
            f"{where}: its {len(special)} special tokens must be unique "
            f"and at most default_num_special_tokens ({num_special})"
        )
    special += [TEKKEN_FILLER.format(id=i) for i in range(len(special), num_special)]
    inner = vocab_size - num_special
    if not isinstance(vocab, list) or not 256 <= inner <= len(vocab) or vocab_size > ID_LIMIT:
        raise ModelLoadError(
            f"{where}: default_vocab_size {vocab_size} less default_num_special_tokens {num_special} must lie between "
            f"256 and the number of its vocab entries ({len(vocab) if isinstance(vocab, list) else '?'})"
        )
    tokens: list[str] = []
    for rank, entry in enumerate(vocab[:inner]):
        try:
            token = entry["token_bytes"]
            raw = base64.b64decode(token, validate=True)
        except (KeyError, TypeError, binascii.Error):
            raise ModelLoadError(f"{where}: vocab[{rank}] has no base64 token_bytes") from None
        if entry.get("rank") != rank or (rank < 256 and raw != bytes([rank])):
            raise ModelLoadError(
                f"{where}: vocab[{rank}] has rank {entry.get('rank')} (ranks run 0, 1, ... from the 256 bytes)"
            )
        tokens.append(token)
    roles = {role: (token if token in special else None) for role, token in _TEKKEN_ROLES.items()}
    spec = TekkenSpec(pattern, version, tuple(special), tuple(tokens), vocab_size, roles)
    if len(_TEKKEN_SPECS) >= 8:
        _TEKKEN_SPECS.clear()
    _TEKKEN_SPECS[digest] = spec
    return spec
