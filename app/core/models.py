"""What a model file is: recognized by content, one of three libraries' formats, and what it says of itself.

The three kinds, and the files each one reads (their bytes, in this order, make the model's sha256):

==============  =========================================  ===============================================
library         PATH (``--model NAME=PATH``)                files hashed, in order
==============  =========================================  ===============================================
sentencepiece   a ``.model`` (serialized ModelProto)        the ``.model``
tokenizers      a Hugging Face ``tokenizer.json``, or a     ``tokenizer.json``, then ``tokenizer_config.json``
                directory holding one (a Hub snapshot)      when it is beside it (BOS/EOS/PAD/UNK come from it)
tiktoken        BPE ranks (``*.tiktoken``: a line           the ranks, then ``<file>.json`` when it is beside
                ``base64-token rank`` per token)            it (its pattern, special tokens, BOS/EOS/PAD)
==============  =========================================  ===============================================

A tiktoken file of one of OpenAI's encodings that the installed ``tiktoken`` knows (cl100k_base,
o200k_base, ...) is recognized by its sha256 and gets that encoding's pattern and special tokens, with
``<|endoftext|>`` as EOS; any other needs the ``<file>.json`` sidecar::

    {"pat_str": "...", "special_tokens": {"<|endoftext|>": 100257}, "bos_token": null,
     "eos_token": "<|endoftext|>", "pad_token": null}

Nothing here loads a tokenizer library: this module reads files and says what they are
(`find_model_files`); tokenizer_service.core.libraries loads them.
"""

from __future__ import annotations

import base64
import binascii
import errno
import hashlib
import importlib.util
import json
import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

SENTENCEPIECE, TOKENIZERS, TIKTOKEN = "sentencepiece", "tokenizers", "tiktoken"
LIBRARIES = (SENTENCEPIECE, TOKENIZERS, TIKTOKEN)
KINDS = (
    "a SentencePiece .model, a Hugging Face tokenizer.json (or a directory holding one), "
    "or tiktoken BPE ranks (*.tiktoken)"
)
HF_FILE, HF_CONFIG = "tokenizer.json", "tokenizer_config.json"
SPECIAL_ROLES = ("bos", "eos", "pad", "unk")

_TIKTOKEN_LINE = re.compile(rb"^[A-Za-z0-9+/]*={0,2} [0-9]+$")
# Ids travel as int32 (the binary answers, the shards' dtype, numpy downstream): every id of a served model
# lies below this, or the model is refused at start (tiktoken and fastokens take ids up to 2**32 - 1).
ID_LIMIT = 1 << 31


class ModelLoadError(RuntimeError):
    """A configured model file is missing, unreadable, or none of the kinds this service serves."""


SERVER_ONLY = frozenset({"path", "files", "chat_template_path", "gate"})  # ModelInfo's fields that /v1/models and metadata.json leave out


@dataclass(frozen=True)
class ModelInfo:
    """A model as the server announces it (/v1/models, metadata.json) and as workers load it."""

    name: str
    path: Path
    library: str  # sentencepiece | tokenizers | tiktoken
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

    encoding: str | None  # OpenAI's encoding name when tiktoken knows the file, else None
    pat_str: str
    special_tokens: dict[str, int]
    tokens: dict[str, str | None]  # role (bos, eos, pad) -> special token string


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

    @property
    def sha256(self) -> str:
        if self.template is not None and self.template.hashed:
            return files_sha256((*self.contents, self.template.hashed))
        return files_sha256(self.contents)

    def special_tokens(self) -> dict[str, str | None]:
        """role (bos, eos, pad, unk) -> token string, from tokenizer_config.json or the tiktoken spec."""
        if self.library == TOKENIZERS:
            return hf_special_tokens(self)
        if self.library == TIKTOKEN:
            return {**tiktoken_spec(self).tokens, "unk": None}
        return {}


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
    if given.is_dir() and not os.path.lexists(given / HF_FILE):
        raise ModelLoadError(f"model {name!r}: the directory {given} holds no {HF_FILE}; a model is {KINDS}")
    content = _read(name, given / HF_FILE if given.is_dir() else given)
    library = sniff(content)
    if library is None:
        raise ModelLoadError(f"model {name!r}: {given} is not a model file; a model is {KINDS}")
    # Absolute but not resolved: a Hub cache links snapshots/REV/tokenizer.json to blobs/HASH, and the
    # config or sidecar beside the link is what belongs to it (workers read the model again by this path).
    path = given.absolute()
    main = path / HF_FILE if path.is_dir() else path
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
    if library == TIKTOKEN:
        tiktoken_spec(found, name)  # refuse a file without its pattern now, in one line
    return found


def sniff(content: bytes) -> str | None:
    """Which library's format these bytes are in, or None. SentencePiece is only a candidate: loading decides."""
    if content[:4096].lstrip().startswith(b"{"):
        try:
            document = json.loads(content)
        except ValueError:
            document = None
        model = document.get("model") if isinstance(document, dict) else None
        if isinstance(model, dict) and ("type" in model or "vocab" in model):  # older files have no type
            return TOKENIZERS
        if document is not None:
            return None  # JSON, but not a tokenizer.json
    if _TIKTOKEN_LINE.match(content[:4096].split(b"\n", 1)[0].rstrip(b"\r")):
        return TIKTOKEN
    if content[:1] == b"\n":  # a serialized ModelProto starts with field 1 (pieces), length-delimited
        return SENTENCEPIECE
    return None


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


def hf_special_tokens(files: ModelFiles) -> dict[str, str | None]:
    """BOS, EOS, PAD and UNK as tokenizer_config.json names them (a string or an AddedToken object)."""
    roles: dict[str, str | None] = dict.fromkeys(SPECIAL_ROLES)
    if len(files.files) < 2:
        return roles
    config = json_object(files.files[1], files.contents[1])
    for role in SPECIAL_ROLES:
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


def known_encoding(sha256: str) -> tuple[str, str, dict[str, int]] | None:
    """(name, pat_str, special tokens) of the OpenAI encoding whose ranks file has this sha256, if tiktoken knows it.

    tiktoken's constructors name each file's sha256 as they load it: each is run with a loader that
    answers only for this file (and loads nothing), which yields its pattern and special tokens offline.
    """
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


def tiktoken_spec(files: ModelFiles, name: str | None = None) -> TiktokenSpec:
    """The pattern and special tokens of a ranks file: from tiktoken when it knows the file, else its sidecar."""
    known = known_encoding(files_sha256(files.contents[:1]))
    sidecar: dict[str, Any] = {}
    sidecar_path = files.main.with_name(files.main.name + ".json")
    if len(files.files) > 1:
        sidecar = json_object(sidecar_path, files.contents[1])
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
    tokens: dict[str, str | None] = {
        "bos": sidecar.get("bos_token"),
        "eos": sidecar.get("eos_token", default_eos),
        "pad": sidecar.get("pad_token"),
    }
    for role, token in tokens.items():
        if token is not None and not isinstance(token, str):
            raise ModelLoadError(f"{sidecar_path}: {role}_token must be a string or null")
    return TiktokenSpec(encoding, pat_str, dict(special_tokens), tokens)
