"""Server configuration: one Settings class, read from flags and TOKENIZER_* environment variables."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

BUNDLED_MODELS_DIR = Path(__file__).parent / "models"
BUNDLED_MODEL_NAME = "default"


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
    log_level: str = Field("info", description="uvicorn log level")

    @field_validator("model", mode="before")
    @classmethod
    def _split_model_list(cls, value: Any) -> Any:
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
            name, _, path = spec.partition("=")
            paths[name.strip()] = Path(path.strip()).expanduser()
        if not paths:
            paths[BUNDLED_MODEL_NAME] = BUNDLED_MODELS_DIR / f"{BUNDLED_MODEL_NAME}.model"
        return paths
