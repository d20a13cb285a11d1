"""Where the ids come from: a process pool running the server's own worker code, or the service over HTTP.

Both take a stream of texts and yield (ids, offsets) batches in order with a bounded number in flight,
so reading the next texts and writing shards overlap with tokenizing.
"""

from __future__ import annotations

import itertools
import multiprocessing
import signal
import time
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from typing import TypeVar

import numpy as np

from app import worker
from client import TokenizedBatch, TokenizerClient
from client.errors import TokenizerConnectionError, TokenizerError, TokenizerServiceError

Batch = tuple[np.ndarray, np.ndarray]  # int32 ids end to end, int64 offsets

RETRIES = 8
Result = TypeVar("Result")


class ServiceError(Exception):
    """The service failed for good (after retries), or answered with another model than the output's."""


def chunks(texts: Iterable[str], max_chars: int, max_texts: int) -> Iterator[list[str]]:
    """Consecutive texts in lists of at most `max_texts` texts and about `max_chars` characters."""
    chunk: list[str] = []
    size = 0
    for text in texts:
        chunk.append(text)
        size += len(text)
        if size >= max_chars or len(chunk) >= max_texts:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def start_worker(model_paths: dict[str, str]) -> None:
    """Pool initializer: Ctrl-C is the parent's to handle; then load the models as the server's workers do."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    worker.load_models(model_paths)


def local_pool(model_name: str, model_path: str, workers: int) -> ProcessPoolExecutor:
    return ProcessPoolExecutor(
        max_workers=workers,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=start_worker,
        initargs=({model_name: model_path},),
    )


def in_order(submitted: Iterator[Future[Result]], depth: int) -> Iterator[Result]:
    """Results of futures in submission order, keeping at most `depth` submitted ahead."""
    pending: deque[Future[Result]] = deque()
    try:
        for future in submitted:
            pending.append(future)
            if len(pending) >= depth:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        for future in pending:
            future.cancel()


def _encode(model: str, texts: list[str], options: worker.EncodeOptions) -> Batch:
    encoded = worker.encode_chunk(model, texts, options)
    return encoded.ids, encoded.offsets


def tokenize_locally(
    pool: ProcessPoolExecutor,
    model: str,
    texts: Iterable[str],
    *,
    add_bos: bool,
    add_eos: bool,
    chunk_chars: int,
    depth: int,
) -> Iterator[Batch]:
    """Tokenize on the pool in chunks of about `chunk_chars` characters, `depth` chunks in flight."""
    options = worker.EncodeOptions(add_bos=add_bos, add_eos=add_eos)
    submitted = (pool.submit(_encode, model, chunk, options) for chunk in chunks(texts, chunk_chars, 1 << 16))
    return in_order(submitted, depth)


def tokenize_with_retries(
    clients: list[TokenizerClient], start: int, texts: list[str], model: str, add_bos: bool, add_eos: bool
) -> TokenizedBatch:
    """Tokenize on `clients[start]`; on overload or a lost connection wait and try the next URL, a few times."""
    for attempt in itertools.count():
        client = clients[(start + attempt) % len(clients)]
        try:
            return client.tokenize_batch(texts, model=model, add_bos=add_bos, add_eos=add_eos)
        except TokenizerServiceError as exc:
            if not exc.retryable or attempt >= RETRIES:
                raise ServiceError(f"{client.url}: {exc}") from exc
            delay = exc.retry_after if exc.retry_after is not None else 0.1 * 2**attempt
        except TokenizerConnectionError as exc:
            if attempt >= RETRIES:
                raise ServiceError(f"{client.url}: {exc}") from exc
            delay = 0.1 * 2**attempt
        except TokenizerError as exc:
            raise ServiceError(f"{client.url}: {exc}") from exc
        time.sleep(min(delay, 10.0))
    raise AssertionError("unreachable")  # itertools.count() never ends


def tokenize_via_service(
    clients: list[TokenizerClient],
    texts: Iterable[str],
    *,
    model: str,
    sha256: str,
    add_bos: bool,
    add_eos: bool,
    batch_size: int,
    depth: int,
) -> Iterator[Batch]:
    """Tokenize through the service: `batch_size` texts a request over the URLs in turn, `depth` in flight.

    Every answer must come from the model file the output was started with (its sha256).
    """
    with ThreadPoolExecutor(depth, thread_name_prefix="pretokenize-request") as threads:
        submitted = (
            threads.submit(tokenize_with_retries, clients, index, chunk, model, add_bos, add_eos)
            for index, chunk in enumerate(chunks(texts, 1 << 22, batch_size))
        )
        for batch in in_order(submitted, depth):
            answered = batch.model_sha256
            if answered is not None and answered != sha256:
                raise ServiceError(
                    f"the service answered with model {model!r} sha256 {answered[:12]}…, "
                    f"but this output is tokenized with {sha256[:12]}…"
                )
            yield batch.ids, batch.offsets
