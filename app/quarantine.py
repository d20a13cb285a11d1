"""Worker side of quarantine: run a suspect chunk one text at a time, noting which text it is on.

A chunk whose worker died twice is run once more on a process of its own. Before each text, that
process writes the text's position into memory shared with the server; if the process dies or
stalls, the server reads the position back and names the poison text: one more crash at most, and
no bisection. Running texts one by one costs about what a batch does (sentencepiece's batch encode
is a loop over texts too).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from app import worker, worker_start
from client.wire import ragged_offsets

# Position of the text being worked on, -1 between tasks: a ctypes integer in shared memory.
_progress: dict[str, Any] = {}


def start(paths: dict[str, str], sha256: dict[str, str] | None, progress: Any) -> None:
    """Pool initializer: load every model (as app.worker_start does), keep the shared progress counter."""
    worker_start.start(paths, sha256)
    _progress["value"] = progress


def _mark(position: int) -> None:
    _progress["value"].value = position


def encode_each(model: str, texts: list[str], options: worker.EncodeOptions, first_index: int) -> worker.Encoded:
    """`worker.encode_chunk` text by text: the same ids, and the culprit known if the process dies."""
    parts = []
    for position, text in enumerate(texts):
        _mark(position)
        parts.append(worker.encode_chunk(model, [text], options, first_index + position))
    _mark(-1)
    lengths = np.fromiter((len(part.ids) for part in parts), dtype=np.int64, count=len(parts))
    ids = np.concatenate([part.ids for part in parts]) if parts else np.zeros(0, dtype=np.int32)
    started = parts[0].started if parts else 0.0
    seconds = sum(part.seconds for part in parts)
    return worker.Encoded(ids=ids, offsets=ragged_offsets(lengths), started=started, seconds=seconds)


def decode_each(model: str, ids: np.ndarray, offsets: np.ndarray) -> worker.Decoded:
    """`worker.decode_chunk` row by row, for the same reason."""
    texts: list[str] = []
    started, seconds = 0.0, 0.0
    for row in range(len(offsets) - 1):
        _mark(row)
        start, end = int(offsets[row]), int(offsets[row + 1])
        part = worker.decode_chunk(model, ids[start:end], np.array([0, end - start], dtype=np.int64))
        texts.extend(part.texts)
        started = started or part.started
        seconds += part.seconds
    _mark(-1)
    return worker.Decoded(texts=texts, started=started, seconds=seconds)
