"""Server configuration: one Settings class, read from flags and TOKENIZER_* environment variables."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from tokenizer_service.core.environment import usable_cpus
from tokenizer_service.core.models import model_file_name

BUNDLED_MODELS_DIR = Path(__file__).parent / "models"
BUNDLED_MODEL_NAME = "default"
BUNDLED = {BUNDLED_MODEL_NAME: BUNDLED_MODELS_DIR / f"{BUNDLED_MODEL_NAME}.model"}  # served when none is configured
# --max-queued-bytes defaults to this many full-size request bodies.
QUEUED_REQUESTS_DEFAULT = 4


class ConfigError(ValueError):
    """Settings that validate one by one but cannot be served together (a models directory with no model)."""


def option(metavar: str, description: str, default: Any = None, **constraints: Any) -> Any:
    """A Settings field: what --help shows for its value (`metavar`), what it does, its default and bounds."""
    if "default_factory" in constraints:
        return Field(description=description, json_schema_extra={"metavar": metavar}, **constraints)
    return Field(default, description=description, json_schema_extra={"metavar": metavar}, **constraints)


class Settings(BaseSettings):
    """Everything the server can be told; each field is also `--kebab-case` and `TOKENIZER_UPPER_CASE`."""

    model_config = SettingsConfigDict(
        env_prefix="TOKENIZER_",
        cli_prog_name="tokenizer-server",
        cli_kebab_case=True,
        cli_implicit_flags=True,
        extra="ignore",
    )

    host: str = option("ADDRESS", "address to bind", "127.0.0.1")
    port: int = option("PORT", "port to bind (0 picks a free one)", 8000, ge=0, le=65535)
    frontends: int = option(
        "N",
        "server processes sharing the port (SO_REUSEPORT), each with its share of --workers; one "
        "feeds about 20 busy workers",
        1,
        ge=1,
    )
    workers: int = option(
        "N", "tokenizer worker processes (default: usable CPU cores)", default_factory=usable_cpus, ge=1
    )
    model: Annotated[list[str], NoDecode] = option(
        "NAME=PATH",
        "a model to serve as NAME=PATH; repeat the flag, or comma-separate in the environment",
        default_factory=list,
    )
    chat_template: Annotated[list[str], NoDecode] = option(
        "NAME=FILE",
        "model NAME's chat template (a Jinja file, rendered as transformers renders it), for conversations; "
        "overrides the model's own (chat_template.jinja, tokenizer_config.json); repeat the flag per model",
        default_factory=list,
    )
    models_dir: Path | None = option(
        "DIR",
        "serve every *.model, *.tiktoken and tekken*.json in this directory under its file stem (Mistral's "
        "NAME.model.v7 as NAME.v7), and every subdirectory holding a tokenizer.json, a tekken.json or "
        "original/tokenizer.model under its name; every other entry is skipped, logged in a line",
        None,
    )
    empty_models_dir: Literal["refuse", "bundled"] = option(
        "{refuse,bundled}",
        "a --models-dir with no model in it: refuse to start, or serve the bundled model (what the container "
        "image does, so that an empty mounted directory serves it)",
        "refuse",
    )
    encoder: Literal["fast", "reference", "fastokens", "gigatoken"] = option(
        "{fast,reference,fastokens,gigatoken}",
        "fast: encode tokenizer.json and tiktoken models with the fastest fast encoder (fastokens, gigatoken) "
        "that reproduces the reference library's ids on every code point and special token, within a memory "
        "bound per worker (else the library); fastokens, gigatoken: that one only (still checked); reference: "
        "always the library itself",
        "fast",
    )
    shadow_rate: float = option(
        "SHARE",
        "share of texts a fast encoder encodes that the reference library encodes again, off the hot path "
        "(shadow verification; a mismatch falls the model back to the reference library in every worker)",
        0.001,
        ge=0,
        le=1,
    )
    shadow_interval_seconds: float = option(
        "SECONDS",
        "and at least one text per this many seconds of a worker's fast encoding (0: only --shadow-rate)",
        10.0,
        ge=0,
    )
    cache_dir: Path | None = option(
        "DIR",
        "where the fast encoder's gate remembers its verdicts (DIR/gate; default ~/.cache/tokenizer-service/"
        "gate, or under $XDG_CACHE_HOME); unwritable: no cache",
        None,
    )
    default_model: str | None = option("NAME", "model used when a request names none", None)
    max_request_bytes: int = option("BYTES", "largest request body accepted (413 above)", 32 * 1024 * 1024, ge=1)
    max_texts: int = option("N", "most texts in one request (413 above)", 8192, ge=1)
    max_seq_len: int = option("TOKENS", "largest seq_len /v1/pack accepts", 131072, ge=2)
    min_chunk_chars: int = option(
        "CHARS",
        "a request is split over workers only in chunks at least this many characters long (UTF-8 bytes where a "
        "binary body's texts reach the encoder undecoded)",
        16384,
        ge=1,
    )
    max_queued_bytes: int | None = option(
        "BYTES",
        "body bytes of /v1 requests admitted and not yet answered, at most; a request beyond it is "
        f"answered 503 at once (default: {QUEUED_REQUESTS_DEFAULT} x --max-request-bytes)",
        None,
        ge=1,
    )
    max_queued_texts: int | None = option(
        "N", "deprecated and ignored: the server now bounds bytes (--max-queued-bytes)", None, ge=1
    )
    max_concurrent_requests: int = option(
        "N", "/v1 requests handled at once, at most (503 above); bounds what request bodies hold", 128, ge=1
    )
    request_timeout: float = option(
        "SECONDS", "seconds a /v1 request may take; then 504, and the work it queued is withdrawn", 60.0, gt=0
    )
    stall_timeout: float = option(
        "SECONDS",
        "seconds a job may run in a worker, plus 10 microseconds a character, before the worker "
        "counts as stalled and is killed",
        15.0,
        gt=0,
    )
    drain_timeout: float = option(
        "SECONDS", "seconds in-flight requests get to finish after SIGTERM before they are cancelled", 30.0, ge=0
    )
    api_keys: Annotated[list[SecretStr], NoDecode] = option(
        "KEY",
        "API keys accepted as `Authorization: Bearer KEY` on /v1 endpoints; repeat the flag, or "
        "comma-separate in the environment (prefer TOKENIZER_API_KEYS: flags show in `ps`); none: no authentication",
        default_factory=list,
    )
    cors_origins: Annotated[list[str], NoDecode] = option(
        "ORIGIN",
        "origins browsers may call the API from (CORS), or *; repeat the flag, or comma-separate; none: CORS off",
        default_factory=list,
    )
    max_header_bytes: int = option(
        "BYTES", "largest request line plus headers accepted (431 and close above)", 64 * 1024, ge=1024
    )
    header_timeout: float = option(
        "SECONDS", "seconds a client may take to send a request's headers (408 and close after)", 10.0, gt=0
    )
    min_body_rate: int = option(
        "BYTES",
        "bytes a second a /v1 request body must arrive at, on average, once --header-timeout seconds have "
        "passed since its head; slower: 408 and close, and its bytes leave the budget (0: no minimum)",
        64 * 1024,
        ge=0,
    )
    max_connections: int | None = option(
        "N",
        "open connections at most; the next gets 503 and is closed (default: 4096, or the open-file "
        "limit less 256 when that is lower)",
        None,
        ge=1,
    )
    log_level: Literal["critical", "error", "warning", "info", "debug", "trace"] = option(
        "LEVEL",
        "log level: critical, error, warning, info, debug (also prints the traceback of a failed start) or trace",
        "info",
    )

    @property
    def queued_bytes_limit(self) -> int:
        return self.max_queued_bytes or QUEUED_REQUESTS_DEFAULT * self.max_request_bytes

    @field_validator("model", "chat_template", "api_keys", "cors_origins", mode="before")
    @classmethod
    def _split_list(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = value.strip()
            if value.startswith("["):
                import json

                return json.loads(value)
            return [item.strip() for item in value.split(",") if item.strip()]
        return value

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower_case(cls, value: Any) -> Any:
        return value.strip().lower() if isinstance(value, str) else value

    @field_validator("models_dir", "default_model", mode="before")
    @classmethod
    def _not_empty(cls, value: Any) -> Any:
        if isinstance(value, str) and not value.strip():
            raise ValueError("is set but empty: give a value, or unset it")
        return value

    @field_validator("models_dir")
    @classmethod
    def _existing_directory(cls, value: Path | None) -> Path | None:
        if value is None:
            return None
        path = value.expanduser()
        if not path.is_dir():
            raise ValueError("is not a directory" if path.exists() else "does not exist")
        return path

    @field_validator("model", "chat_template")
    @classmethod
    def _check_name_specs(cls, value: list[str], info: ValidationInfo) -> list[str]:
        flag, example, what = (
            ("--model", "tok.model", "PATH")
            if info.field_name == "model"
            else ("--chat-template", "chat.jinja", "FILE")
        )
        for spec in value:
            name, sep, path = spec.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"is not NAME={what} (for example {flag} default={spec or example})")
        return value

    def chat_template_paths(self, models: dict[str, Path] | None = None) -> dict[str, Path]:
        """--chat-template files by model name; ConfigError for a name no model has."""
        models = self.model_paths() if models is None else models
        templates: dict[str, Path] = {}
        for spec in self.chat_template:
            name, _, file = spec.partition("=")
            name = name.strip()
            if name not in models:
                raise ConfigError(
                    f"--chat-template {spec}: no model is named {name!r}; served models: {', '.join(sorted(models))}"
                )
            templates[name] = Path(file.strip()).expanduser()
        return templates

    def model_paths(self) -> dict[str, Path]:
        """Configured models by name: --models-dir first, then each --model; the bundled one if none."""
        paths: dict[str, Path] = {}
        if self.models_dir is not None:
            paths.update(models_in(self.models_dir))
            if not paths and not self.model and self.empty_models_dir == "refuse":
                raise ConfigError(
                    f"the models directory {self.models_dir} (--models-dir, TOKENIZER_MODELS_DIR) holds no model "
                    f"({MODEL_FILES}, or {MODEL_DIRECTORIES}); to serve the bundled model "
                    "then, --empty-models-dir bundled (TOKENIZER_EMPTY_MODELS_DIR=bundled)"
                )
        for spec in self.model:
            name, _, file = spec.partition("=")
            paths[name.strip()] = Path(file.strip()).expanduser()
        return paths or dict(BUNDLED)


MODEL_FILES = "*.model, *.model.vN, *.tiktoken, tekken*.json"
MODEL_DIRECTORIES = "a subdirectory holding a tokenizer.json, tekken.json or original/tokenizer.model"
_logged_skips: set[tuple[str, str]] = set()


def _why_skipped(path: Path) -> str:
    if path.is_dir():
        return "a directory holding no tokenizer.json, tekken.json or original/tokenizer.model"
    if not path.is_file():
        return "neither a file nor a directory"
    if path.suffix == ".json" and model_file_name(path.with_suffix("")) is not None and path.with_suffix("").exists():
        return f"the sidecar of {path.with_suffix('').name}, read with it"
    return f"not a model file's name ({MODEL_FILES})"


def models_in(directory: Path) -> dict[str, Path]:
    """A models directory's models by name: each *.model, *.tiktoken, Mistral's *.model.vN and tekken*.json
    (`model_file_name`), each subdirectory holding a tokenizer.json (a Hub snapshot), a tekken.json or only
    Meta's original/tokenizer.model under the subdirectory's name; sorted by name. Every other entry is
    skipped, logged once in a line naming it and why.

    An entry that cannot be read (a link leading nowhere or to itself, of any name; a subdirectory's
    tokenizer.json or tokenizer_config.json that is one) is not skipped: ConfigError names every one."""
    from tokenizer_service.core.models import HF_CONFIG, HF_FILE, directory_file, why_unreadable

    found: dict[str, Path] = {}
    unreadable: list[str] = []
    for path in sorted(directory.iterdir()):
        try:
            path.stat()
        except OSError as exc:
            unreadable.append(f"{path.name} ({why_unreadable(path) or exc.strerror})")
            continue
        inside = directory_file(path) if path.is_dir() else None
        if path.is_file() and (file_name := model_file_name(path)) is not None:
            name = file_name
        elif inside is not None:
            name = path.name
            for file in (inside, HF_CONFIG) if inside == HF_FILE else (inside,):
                if os.path.lexists(path / file) and (why := why_unreadable(path / file)) is not None:
                    unreadable.append(f"{path.name}/{file} ({why})")
        else:
            skipped = (str(directory), path.name)
            if skipped not in _logged_skips:  # the server reads its options more than once: one line each
                _logged_skips.add(skipped)
                logging.getLogger("tokenizer").info(
                    "--models-dir %s: skipping %s: %s", directory, path.name, _why_skipped(path)
                )
            continue
        if name in found:
            raise ConfigError(
                f"the models directory {directory} holds two models named {name!r}: {found[name]} and {path}"
            )
        found[name] = path
    if unreadable:
        raise ConfigError(
            f"the models directory {directory} holds {'entries' if len(unreadable) > 1 else 'an entry'} that cannot "
            f"be read: {'; '.join(unreadable)}; repair or remove {'them' if len(unreadable) > 1 else 'it'} (a Hub "
            "snapshot's files are links into its blobs/: download it again)"
        )
    return dict(sorted(found.items()))


def describe_error(error: Any, argv: Sequence[str] = ()) -> str:
    """One of a ValidationError's errors as the user wrote it: the flag, or the environment variable, and the value."""
    name = "_".join(str(part) for part in error["loc"] if isinstance(part, str)) or "settings"
    flag = "--" + name.replace("_", "-")
    variable = "TOKENIZER_" + name.upper()
    message = str(error["msg"]).removeprefix("Value error, ")
    if not any(arg == flag or arg.startswith(flag + "=") for arg in argv) and variable in os.environ:
        return f"{variable}={os.environ[variable]!r}: {message}"
    value = error.get("input")
    shown = f" {value!r}" if isinstance(value, str | int | float) else ""
    return f"{flag}{shown}: {message}"
