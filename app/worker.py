"""The models of a worker process (the server's, app.jobs, and the pre-tokenizer's pool), loaded once.

`load_models` reads each model's files again, refuses any whose bytes changed since the server
announced their sha256, and loads it in its library (app.core.libraries, with the fast encoder behind
its check). `encode_chunk` answers the pre-tokenizer's pool with a TokenizedBatch: flat numpy buffers
(int32 ids plus int64 offsets pickle as two memcpy'd blobs, where lists of Python ints would cost about
a quarter of the tokenization time again).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from app.core import libraries
from app.core.libraries import Library
from app.core.models import ModelInfo, find_model_files
from app.schemas import EncodeOptions
from client.wire import ragged_offsets

if TYPE_CHECKING:
    from client import TokenizedBatch

_libraries: dict[str, Library] = {}


class ModelChanged(RuntimeError):
    """A model file no longer holds the bytes the server announced at startup."""


def load_models(models: Sequence[ModelInfo]) -> None:
    """Pool initializer: load each model once per worker process, single-threaded, with the encoder the
    model was announced with (fastokens passes its check again here, in the process that uses it)."""
    libraries.single_threaded()
    _libraries.clear()
    for info in models:
        files = find_model_files(info.name, info.path)
        if files.sha256 != info.sha256:
            raise ModelChanged(
                f"model {info.name!r}: {info.path} changed since the server started (sha256 {files.sha256}, "
                f"announced {info.sha256}); restart the server to serve the new file"
            )
        encoder = libraries.FAST if info.encoder == libraries.FASTOKENS else libraries.REFERENCE
        _libraries[info.name] = libraries.load(files, encoder)


def ping() -> int:
    """A round trip that starts a worker process and proves it loaded its models (their number)."""
    return len(_libraries)


def library(name: str) -> Library:
    return _libraries[name]


def encode_chunk(model: str, texts: list[str], options: EncodeOptions) -> TokenizedBatch:
    """Tokenize texts[i] exactly as the model's library would in-process (the pre-tokenizer's pool)."""
    from client import TokenizedBatch  # here, not at import: the server's workers never load the client

    ids, lengths = _libraries[model].encode(texts, options)
    return TokenizedBatch(ids, ragged_offsets(lengths), model, None)
