"""The models a server serves: each model file read once at startup, in the server process, and described.

What a model file is (its three kinds, recognized by content) is tokenizer_service.core.models; loading it in its
library, tokenizer_service.core.libraries. Reading a model here also runs the fast encoder's check (the workers run it
again when they load the model), so /v1/models says which encoder serves it.
"""

from __future__ import annotations

import logging
from pathlib import Path

from tokenizer_service.core import chat, libraries
from tokenizer_service.core.models import ID_LIMIT, ModelFiles, ModelInfo, ModelLoadError, find_model_files

logger = logging.getLogger("tokenizer")

__all__ = ["ModelRegistry", "inspect_model", "model_info"]


def inspect_model(
    name: str, path: Path, encoder: str = libraries.FAST, chat_template: Path | None = None
) -> ModelInfo:
    """What the model at `path` is (any of the three kinds); ModelLoadError in one line when it is none.
    `chat_template`: a --chat-template file, which overrides the model's own template."""
    files = find_model_files(name, path, chat_template)
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
    if files.template is not None and (problem := chat.check_syntax(files.template)) is not None:
        raise ModelLoadError(f"model {name!r}: {problem}")
    info = model_info(name, files, library)
    if info.chat_template is not None and info.chat_template["loss_mask"] is None:
        logger.warning("%s", chat.no_mask_message(name) + "; its texts are served, its conversations refused")
    return info


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
        user_defined_pieces=library.user_defined_pieces,
        sha256=files.sha256,
        files=files.files,
        chat_template=chat.announce(files.template),
        chat_template_path=files.template.path if files.template is not None and files.template.source == "flag" else None,
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
        cls,
        paths: dict[str, Path],
        default: str | None = None,
        encoder: str = libraries.FAST,
        chat_templates: dict[str, Path] | None = None,
    ) -> ModelRegistry:
        if not paths:
            raise ModelLoadError("no model to serve")
        templates = chat_templates or {}
        models = {name: inspect_model(name, path, encoder, templates.get(name)) for name, path in paths.items()}
        return cls(models, default or ("default" if "default" in models else next(iter(models))))

    def get(self, name: str | None) -> ModelInfo | None:
        return self.models.get(self.default if name is None else name)

    def paths(self) -> dict[str, str]:
        return {name: str(info.path) for name, info in self.models.items()}
