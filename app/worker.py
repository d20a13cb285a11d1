"""SentencePiece encoding in worker processes: the server's (app.jobs) and the pre-tokenizer's pool.

Each process loads every model once (`load_models`). `encode_texts` is the one place ids are made,
exactly as in-process `sp.encode` makes them; `encode_chunk` answers the pre-tokenizer's pool with a
TokenizedBatch: flat numpy buffers (int32 ids plus int64 offsets pickle as two memcpy'd blobs, where
lists of Python ints would cost about a quarter of the tokenization time again).
"""

from __future__ import annotations

import random
import threading
from typing import Any

import numpy as np
import sentencepiece as spm

from app.schemas import EncodeOptions
from client import TokenizedBatch
from client.wire import ragged_offsets

_processors: dict[str, spm.SentencePieceProcessor] = {}


def load_models(paths: dict[str, str]) -> None:
    """Pool initializer: load each model once per worker process."""
    _processors.clear()
    for name, path in paths.items():
        _processors[name] = spm.SentencePieceProcessor(model_file=path)


def sample_in_fresh_thread(
    processor: spm.SentencePieceProcessor, text: str, seed: int, options: dict[str, Any]
) -> np.ndarray:
    """Sample one text reproducibly: a new thread's generator is seeded from the seed set in it."""
    result: list[np.ndarray] = []

    def run() -> None:
        spm.set_random_generator_seed(seed)
        result.append(processor.encode(text, **options))

    thread = threading.Thread(target=run, name="tokenizer-sample")
    thread.start()
    thread.join()
    return result[0]


def ping() -> int:
    """A round trip that starts a worker process and proves it loaded its models (their number)."""
    return len(_processors)


def sample_seed(seed: int, index: int) -> int:
    """Seed for text `index` of a request: reproducible whichever worker and chunk the text lands in."""
    return (seed + index) % (1 << 32)


def truncate(ids: np.ndarray, max_length: int, eos_id: int | None) -> np.ndarray:
    """Keep the first `max_length` ids; when the sequence ended in EOS, EOS stays last."""
    if len(ids) <= max_length:
        return ids
    if eos_id is None or max_length == 0:
        return ids[:max_length]
    return np.concatenate([ids[: max_length - 1], np.array([eos_id], dtype=ids.dtype)])


def processor(name: str) -> spm.SentencePieceProcessor:
    return _processors[name]


def encode_texts(
    processor: spm.SentencePieceProcessor,
    texts: list[str],
    options: EncodeOptions,
    first_index: int = 0,
    *,
    one_by_one: bool = False,
) -> list[np.ndarray]:
    """Tokenize texts[i] exactly as `sp.encode(texts[i], ...)` would in-process, one array per text.

    `one_by_one` encodes each text on its own: for a few texts that is cheaper than a list, for
    which sentencepiece starts a native thread whatever `num_threads` says.
    """
    common = {"add_bos": options.add_bos, "add_eos": options.add_eos, "out_type": "numpy"}
    sample = options.sample
    if sample is not None:
        sampling = {**common, "enable_sampling": True, "alpha": float(sample.alpha), "nbest_size": sample.nbest_size}
        entropy = random.SystemRandom()
        pieces = [
            sample_in_fresh_thread(
                processor,
                text,
                entropy.getrandbits(32) if sample.seed is None else sample_seed(sample.seed, first_index + position),
                sampling,
            )
            for position, text in enumerate(texts)
        ]
    elif one_by_one:
        pieces = [processor.encode(text, **common) for text in texts]
    else:
        pieces = processor.encode(texts, num_threads=1, **common)
    if options.max_length is not None:
        eos_id = processor.eos_id() if options.add_eos else None
        pieces = [truncate(ids, options.max_length, eos_id) for ids in pieces]
    return pieces


def encode_chunk(model: str, texts: list[str], options: EncodeOptions) -> TokenizedBatch:
    """Tokenize texts[i] exactly as `sp.encode(texts[i], ...)` would in-process (the pre-tokenizer's pool)."""
    pieces = encode_texts(_processors[model], texts, options)
    lengths = np.fromiter((len(ids) for ids in pieces), dtype=np.int64, count=len(pieces))
    ids = np.concatenate(pieces).astype(np.int32, copy=False) if pieces else np.zeros(0, dtype=np.int32)
    return TokenizedBatch(ids, ragged_offsets(lengths), model, None)
