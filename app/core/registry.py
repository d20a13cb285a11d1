"""The models a server serves: each model file read once at startup, in the server process, and described.

What a model file is (its three kinds, recognized by content) is tokenizer_service.core.models; loading it in its
library, tokenizer_service.core.libraries. Reading a model here also runs the fast encoder's check (the workers run it
again when they load the model), so /v1/models says which encoder serves it.
"""

from __future__ import annotations

from pathlib import Path

from tokenizer_service.core import libraries
from tokenizer_service.core.models import ID_LIMIT, ModelFiles, ModelInfo, ModelLoadError, find_model_files

__all__ = ["ModelRegistry", "inspect_model", "model_info"]


def inspect_model(name: str, path: Path, encoder: str = libraries.FAST) -> ModelInfo:
    """What the model at `path` is (any of the three kinds); ModelLoadError in one line when it is none."""
    files = find_model_files(name, path)
    try:
        library = libraries.load(files, encoder)
    except ModelLoadError as exc:
        raise ModelLoadError(f"model {name!r}: {exc}") from None
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as exc:  # whatever the library raises, pyo3's PanicException (a BaseException) included
        raise ModelLoadError(
            f"model {name!r}: {files.library} cannot load {files.path}: {type(exc).__name__}: {exc}".splitlines()[0]
        ) from exc
    if library.vocab_size > ID_LIMIT:
        raise ModelLoadError(
            f"model {name!r}: {files.path} has ids up to {library.vocab_size - 1}; an id must lie in "
            f"0..{ID_LIMIT - 1} (ids are answered as int32)"
        )
    return model_info(name, files, library)


def model_info(name: str, files: ModelFiles, library: libraries.Library) -> ModelInfo:
    """The announcement of a model whose files are loaded in `library`."""
    return ModelInfo(
        name=name,
        path=files.path,
        library=files.library,
        encoder=library.encoder,
        type=library.type,
        vocab_size=library.vocab_size,
        bos_id=library.bos_id,
        eos_id=library.eos_id,
        pad_id=library.pad_id,
        unk_id=library.unk_id,
        sha256=files.sha256,
        files=files.files,
    )


class ModelRegistry:
    """The models this server serves, by name, and which one a request without a name gets."""

    def __init__(self, models: dict[str, ModelInfo], default: str) -> None:
        if default not in models:
            raise ModelLoadError(f"default model {default!r} is not among the served models {sorted(models)}")
        self.models = models
        self.default = default

    @classmethod
    def from_paths(
        cls, paths: dict[str, Path], default: str | None = None, encoder: str = libraries.FAST
    ) -> ModelRegistry:
        if not paths:
            raise ModelLoadError("no model to serve")
        models = {name: inspect_model(name, path, encoder) for name, path in paths.items()}
        return cls(models, default or ("default" if "default" in models else next(iter(models))))

    def get(self, name: str | None) -> ModelInfo | None:
        return self.models.get(self.default if name is None else name)

    def paths(self) -> dict[str, str]:
        return {name: str(info.path) for name, info in self.models.items()}
