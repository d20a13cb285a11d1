"""The models a server serves: each model file read once at startup, in the server process, and described.

What a model file is (its four kinds, recognized by content) is tokenizer_service.core.models; loading it in its
library, tokenizer_service.core.libraries. Reading a model here loads its reference library only, to describe it, and
reads the fast encoder's cached gate verdict, so /v1/models says which encoder serves it; with none cached the model is
announced with its library and its gate runs beside the work (tokenizer_service.core.gatescan).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from tokenizer_service.core import chat, libraries
from tokenizer_service.core.models import ID_LIMIT, ModelFiles, ModelInfo, ModelLoadError, find_model_files, parsed_json

logger = logging.getLogger("tokenizer")

__all__ = ["ModelRegistry", "inspect_model", "model_info"]


# sha256 -> the files inspect_model(keep=True) read and the library it loaded them in
_kept: dict[str, tuple[ModelFiles, libraries.Library]] = {}


def kept_model(sha256: str) -> tuple[ModelFiles, libraries.Library] | None:
    """The files `inspect_model(..., keep=True)` read and the library it loaded them in (handed over once). The
    parsed document of its files is kept until `release_kept()`."""
    return _kept.pop(sha256, None)


def peek_kept(sha256: str) -> tuple[ModelFiles, libraries.Library] | None:
    """What `kept_model` would hand over, left kept."""
    return _kept.get(sha256)


def release_kept() -> None:
    """Forget every library `inspect_model(..., keep=True)` kept, and the parse of its files."""
    _kept.clear()
    parsed_json.cache_clear()


def inspect_model(
    name: str,
    path: Path,
    encoder: str = libraries.FAST,
    chat_template: Path | None = None,
    wait: bool = False,
    keep: bool = False,
    serving: bool = True,
) -> ModelInfo:
    """What the model at `path` is (any of the four kinds); ModelLoadError in one line when it is none.
    `chat_template`: a --chat-template file, which overrides the model's own template.

    The announcing process loads the reference library only, to describe the model, and never builds the
    fast encoder: `encoder` fastokens where the gate's cached verdict passed it, else the library, with
    `gate` "pending" where no verdict is cached (scanned beside the work: tokenizer_service.core.gatescan).
    A cached refusal is logged once. `wait`: a pending gate is run here instead, blocking (seconds to a minute).
    `keep`: keep the loaded library, and its parsed files, for `kept_model` (the pre-tokenizer's pool adopts it
    instead of loading the files again, and builds its fast encoder without parsing them again). `serving` False:
    not for the server (the pre-tokenizer), which says itself what it cannot do with the model."""
    files = find_model_files(name, path, chat_template)
    try:
        library = libraries.load(files, libraries.REFERENCE, keep_parsed=keep)
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
    gate, differs = libraries.announced_gate(files, encoder)
    route = libraries.cached_route(files, encoder) if gate == libraries.PASSED else None
    if gate == libraries.PENDING and wait:
        fast, differs, route = libraries.gate_verdict(library, encoder=encoder)
        gate = libraries.PASSED if fast is not None else libraries.REFUSED
    if gate == libraries.REFUSED:
        logger.warning("%s", libraries.refusal_line(files.path, files.library, differs or "?"))
    if gate == libraries.PASSED and route is None:  # a verdict that names no route (a cache of another release)
        route = libraries.FASTOKENS
    info = model_info(name, files, library, route if gate == libraries.PASSED else library.encoder, gate)
    if gate == libraries.PENDING and encoder != libraries.FAST:
        info = dataclasses.replace(info, select=encoder)
    if serving and info.chat_template is not None and info.chat_template["loss_mask"] is None:
        logger.warning("%s", chat.no_mask_message(name) + "; its texts are served, its conversations refused")
    logger.info("model %r: %s", name, files.recognized())  # which file, and which known encoding
    if keep:
        _kept[files.sha256] = files, library
    return info


def model_info(
    name: str, files: ModelFiles, library: libraries.Library, encoder: str | None = None, gate: str | None = None
) -> ModelInfo:
    """The announcement of a model whose files are loaded in `library` (`encoder`: what will encode it, when
    not the one `library` encodes with)."""
    return ModelInfo(
        name=name,
        path=files.path,
        library=files.library,
        encoder=encoder or library.encoder,
        gate=gate,
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
        chat_template_path=files.template.path
        if files.template is not None and files.template.source == "flag"
        else None,
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

    def pending(self) -> list[tuple[int, ModelInfo]]:
        """The models (position, announcement) whose fast encoder's gate is still to run."""
        return [
            (position, info) for position, info in enumerate(self.models.values()) if info.gate == libraries.PENDING
        ]

    def paths(self) -> dict[str, str]:
        return {name: str(info.path) for name, info in self.models.items()}
