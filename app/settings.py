"""Server configuration: one Settings class, read from flags and TOKENIZER_* environment variables."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

BUNDLED_MODELS_DIR = Path(__file__).parent / "models"
BUNDLED_MODEL_NAME = "default"
# --max-queued-bytes defaults to this many full-size request bodies.
QUEUED_REQUESTS_DEFAULT = 4


def usable_cpus() -> int:
    """CPU cores this process may run on (respects taskset and cgroup cpusets)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class Settings(BaseSettings):
    """Everything the server can be told; each field is also `--kebab-case` and `TOKENIZER_UPPER_CASE`."""

    model_config = SettingsConfigDict(
        env_prefix="TOKENIZER_",
        cli_prog_name="tokenizer-server",
        cli_kebab_case=True,
        cli_implicit_flags=True,
        extra="ignore",
    )

    host: str = Field("127.0.0.1", description="address to bind")
    port: int = Field(8000, ge=0, le=65535, description="port to bind (0 picks a free one)")
    frontends: int = Field(
        1,
        ge=1,
        description="server processes sharing the port (SO_REUSEPORT), each with its share of --workers; one "
        "feeds about 20 busy workers",
    )
    workers: int = Field(
        default_factory=usable_cpus, ge=1, description="tokenizer worker processes (default: usable CPU cores)"
    )
    model: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="a model to serve as NAME=PATH; repeat the flag, or comma-separate in the environment",
    )
    models_dir: Path | None = Field(None, description="serve every *.model in this directory under its file stem")
    default_model: str | None = Field(None, description="model used when a request names none")
    max_request_bytes: int = Field(32 * 1024 * 1024, ge=1, description="largest request body accepted (413 above)")
    max_texts: int = Field(8192, ge=1, description="most texts in one request (413 above)")
    max_seq_len: int = Field(131072, ge=2, description="largest seq_len /v1/pack accepts")
    min_chunk_chars: int = Field(
        16384, ge=1, description="a request is split over workers only in chunks at least this many characters long"
    )
    max_queued_bytes: int | None = Field(
        None,
        ge=1,
        description="body bytes of /v1 requests admitted and not yet answered, at most; a request beyond it is "
        f"answered 503 at once (default: {QUEUED_REQUESTS_DEFAULT} x --max-request-bytes)",
    )
    max_queued_texts: int | None = Field(
        None, ge=1, description="deprecated and ignored: the server now bounds bytes (--max-queued-bytes)"
    )
    max_concurrent_requests: int = Field(
        128, ge=1, description="/v1 requests handled at once, at most (503 above); bounds what request bodies hold"
    )
    request_timeout: float = Field(
        60.0, gt=0, description="seconds a /v1 request may take; then 504, and the work it queued is withdrawn"
    )
    stall_timeout: float = Field(
        15.0,
        gt=0,
        description="seconds a job may run in a worker, plus 10 microseconds a character, before the worker "
        "counts as stalled and is killed",
    )
    drain_timeout: float = Field(
        30.0, ge=0, description="seconds in-flight requests get to finish after SIGTERM before they are cancelled"
    )
    api_keys: Annotated[list[SecretStr], NoDecode] = Field(
        default_factory=list,
        description="API keys accepted as `Authorization: Bearer KEY` on /v1 endpoints; repeat the flag, or "
        "comma-separate in the environment (prefer TOKENIZER_API_KEYS: flags show in `ps`); none: no authentication",
    )
    cors_origins: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="origins browsers may call the API from (CORS), or *; repeat the flag, or comma-separate; "
        "none: CORS off",
    )
    max_header_bytes: int = Field(
        64 * 1024, ge=1024, description="largest request line plus headers accepted (431 and close above)"
    )
    header_timeout: float = Field(
        10.0, gt=0, description="seconds a client may take to send a request's headers (408 and close after)"
    )
    max_connections: int | None = Field(
        None,
        ge=1,
        description="open connections at most; the next gets 503 and is closed (default: 4096, or the open-file "
        "limit less 256 when that is lower)",
    )
    log_level: str = Field("info", description="uvicorn log level")

    @property
    def queued_bytes_limit(self) -> int:
        return self.max_queued_bytes or QUEUED_REQUESTS_DEFAULT * self.max_request_bytes

    @field_validator("model", "api_keys", "cors_origins", mode="before")
    @classmethod
    def _split_list(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = value.strip()
            if value.startswith("["):
                import json

                return json.loads(value)
            return [item.strip() for item in value.split(",") if item.strip()]
        return value

    @field_validator("model")
    @classmethod
    def _check_model_specs(cls, value: list[str]) -> list[str]:
        for spec in value:
            name, sep, path = spec.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"model {spec!r} is not NAME=PATH")
        return value

    def model_paths(self) -> dict[str, Path]:
        """Configured models by name: --models-dir first, then each --model; the bundled one if none."""
        paths: dict[str, Path] = {}
        if self.models_dir is not None:
            for path in sorted(self.models_dir.glob("*.model")):
                paths[path.stem] = path
        for spec in self.model:
            name, _, file = spec.partition("=")
            paths[name.strip()] = Path(file.strip()).expanduser()
        if not paths:
            paths[BUNDLED_MODEL_NAME] = BUNDLED_MODELS_DIR / f"{BUNDLED_MODEL_NAME}.model"
        return paths
