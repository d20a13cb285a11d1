"""SentencePiece model files: what each one is, read once at startup in the server process."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import sentencepiece as spm


class ModelLoadError(RuntimeError):
    """A configured model file is missing or is not a SentencePiece model."""


SERVER_ONLY = frozenset({"path"})  # ModelInfo's fields that /v1/models and metadata.json leave out


@dataclass(frozen=True)
class ModelInfo:
    name: str
    path: Path
    type: str
    vocab_size: int
    bos_id: int
    eos_id: int
    pad_id: int
    unk_id: int
    sha256: str

    @property
    def padding_id(self) -> int:
        """The pad id, else EOS, else 0: what best-fit packing pads with (padding is masked out of the labels)."""
        for candidate in (self.pad_id, self.eos_id):
            if candidate >= 0:
                return candidate
        return 0

    @classmethod
    def from_dict(cls, described: dict[str, Any], path: Path) -> ModelInfo:
        """The inverse of `as_dict` (a /v1/models entry, a metadata.json model), with `path` for the file."""
        described = {field.name: described[field.name] for field in fields(cls) if field.name not in SERVER_ONLY}
        return cls(path=path, **described)

    def as_dict(self) -> dict[str, str | int]:
        """What /v1/models and metadata.json say of the model: every field but the server's own path."""
        return {field.name: getattr(self, field.name) for field in fields(self) if field.name not in SERVER_ONLY}


def _model_type(serialized: bytes) -> str:
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(serialized)
    return sentencepiece_model_pb2.TrainerSpec.ModelType.Name(proto.trainer_spec.model_type).lower()


def inspect_model(name: str, path: Path) -> ModelInfo:
    try:
        serialized = path.read_bytes()
    except OSError as exc:
        raise ModelLoadError(f"model {name!r}: cannot read {path}: {exc.strerror}") from exc
    processor = spm.SentencePieceProcessor()
    try:
        processor.LoadFromSerializedProto(serialized)
    except (RuntimeError, OSError) as exc:
        raise ModelLoadError(f"model {name!r}: {path} is not a SentencePiece model file") from exc
    return ModelInfo(
        name=name,
        path=path.resolve(),
        type=_model_type(serialized),
        vocab_size=processor.vocab_size(),
        bos_id=processor.bos_id(),
        eos_id=processor.eos_id(),
        pad_id=processor.pad_id(),
        unk_id=processor.unk_id(),
        sha256=hashlib.sha256(serialized).hexdigest(),
    )


class ModelRegistry:
    """The models this server serves, by name, and which one a request without a name gets."""

    def __init__(self, models: dict[str, ModelInfo], default: str) -> None:
        if default not in models:
            raise ModelLoadError(f"default model {default!r} is not among the served models {sorted(models)}")
        self.models = models
        self.default = default

    @classmethod
    def from_paths(cls, paths: dict[str, Path], default: str | None = None) -> ModelRegistry:
        if not paths:
            raise ModelLoadError("no model to serve")
        models = {name: inspect_model(name, path) for name, path in paths.items()}
        return cls(models, default or ("default" if "default" in models else next(iter(models))))

    def get(self, name: str | None) -> ModelInfo | None:
        return self.models.get(self.default if name is None else name)

    def paths(self) -> dict[str, str]:
        return {name: str(info.path) for name, info in self.models.items()}
