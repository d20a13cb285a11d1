"""Where the ids come from: a process pool running the server's own worker code, or the service over HTTP.

Both take a stream of texts and yield TokenizedBatch (the client's ragged type) in order, with a
bounded number in flight, so reading the next texts and writing shards overlap with tokenizing.
Conversations and prompt-completion records (`tokenize_dialogue_locally`, `tokenize_dialogue_via_service`)
come back with their loss mask, and with the items the chat template (or TRL's rule) refused, left out of the
batch: (index in the chunk, the service's message), which the run reports as bad records.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import signal
import sys
import threading
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from tokenizer_client.batches import TokenizedBatch
from tokenizer_client.errors import TokenizerServiceError
from tokenizer_client.wire import ragged_offsets
from tokenizer_service.core import libraries, process, registry
from tokenizer_service.core.models import ModelInfo
from tokenizer_service.core.options import EncodeOptions
from tokenizer_service.core.slots import IdsInSlot, Slots
from tokenizer_service.core.texts import Utf8Texts, as_utf8
from tokenizer_service.tools.pretokenize.verifier import Verifier

if TYPE_CHECKING:  # the client (httpx) is imported only by a run with --url
    from tokenizer_client import TokenizerClient
    from tokenizer_client._requests import TokenizeOptions

Result = TypeVar("Result")


class ServedModelChanged(Exception):
    """The service answered with another model file than the one the output was started with."""


def chunks(texts: Iterable[Any], max_chars: int, max_texts: int) -> Iterator[list[Any]]:
    """Consecutive texts (str, or memoryviews of UTF-8) in lists of at most `max_texts` texts and about `max_chars`
    characters (bytes)."""
    chunk: list[Any] = []
    size = 0
    for text in texts:
        chunk.append(text)
        size += len(text)
        if size >= max_chars or len(chunk) >= max_texts:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def start_method(model: ModelInfo) -> str:
    """fork where it is safe (Linux, no other Python thread; the native threads numpy's OpenBLAS and pyarrow's
    jemalloc start at import are rebuilt in a forked child by their own fork handlers): the
    parent loads the model once (`local_pool`) and every worker starts in milliseconds with it loaded, where a
    spawned one imports the service again (about half a second) and loads the model itself (a 128k tokenizer.json:
    0.5-2.5 CPU-s to build its fast encoder, 0.6 to load the reference library its shadow verification uses)."""
    if sys.platform == "linux" and threading.active_count() == 1:
        return "fork"
    return "spawn"


FAST_WORKER_BYTES = 128 << 20  # of input, for each spawned worker of a model a fast encoder encodes from the start


def local_workers(model: ModelInfo, input_bytes: int, workers: int) -> int:
    """How many of the `workers` asked for to start on `input_bytes` of input. All of them where they fork (they
    start loaded). Spawned, where a fast encoder encodes the model from the start (its gate's verdict cached), a
    worker's start (importing the service, loading the model, building the fast encoder: 2-5 CPU-seconds for a 128k
    tokenizer.json) costs more than the encoding it would take over (70-90 MB of text per CPU-second), so one
    worker per FAST_WORKER_BYTES of input, at least one. A model the library encodes (a gate pending, refused, or
    none) keeps every worker: it is slow enough that each one pays for itself."""
    if start_method(model) == "fork" or model.encoder == model.library:
        return workers
    return max(1, min(workers, -(-input_bytes // FAST_WORKER_BYTES)))


# of input, from which forked workers inherit the reference library behind a fast encoder (loaded once, before the
# fork) instead of each loading it when its first text is sampled for shadow verification (1 in 1,000; and one
# per 10 s of encoding): on less, most runs sample none, and the start is 0.3-0.5 s shorter for a 128k model
REFERENCE_BEFORE_FORK_BYTES = 16 << 20


def local_pool(
    model: ModelInfo,
    workers: int,
    input_bytes: int | None = None,
    slots: Slots | None = None,
    verified_apart: bool = False,
) -> ProcessPoolExecutor:
    """Start every worker now, with SIGINT ignored from birth: Ctrl-C reaches the whole process group,
    and a worker still starting up would otherwise die with a traceback instead of finishing its chunk (SIGTERM
    kills a worker at once: the command's process stops the run as on Ctrl-C, `cli.Terminated`).
    Forked workers inherit the model this process loads first (`process.preload`: the library `inspect_model`
    kept, with the fast encoder put in front of it, and its reference library from REFERENCE_BEFORE_FORK_BYTES of
    `input_bytes` where shadow verification samples texts, or when that is not known); if loading it started a native
    thread, they are spawned. Forked workers also inherit `slots` (`tokenize_locally` passes chunks through them:
    `slots.shared` says so).
    `verified_apart`: a `Verifier` checks the chunks (tokenizer_service.tools.pretokenize.verifier), so no worker
    needs the reference library."""
    method = start_method(model)
    kept = registry.kept_model(model.sha256)
    if method == "fork":
        before = process.os_threads()
        checking = process.pretokenize_sampler().samples  # shadow verification off: no worker needs it
        big = input_bytes is not None and input_bytes >= REFERENCE_BEFORE_FORK_BYTES
        reference = input_bytes is None or (big and checking and not verified_apart)
        process.preload(model, kept, reference)
        if process.os_threads() != before:  # loading it started a thread (a Rust pool): a fork would not copy it
            method = "spawn"
        elif slots is not None:
            process.share(slots)
            slots.shared = True
    del kept
    registry.release_kept()  # and the parse of its files, kept for preload's fast encoder
    pool = ProcessPoolExecutor(
        max_workers=workers,
        mp_context=multiprocessing.get_context(method),
        initializer=process.start,
        initargs=((model,),),
    )
    # Workers ignore SIGINT, and die of SIGTERM (a scheduler's) whatever this process does with it: its handler would
    # raise in a forked worker waiting for a chunk
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    previous_term = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        for _ in range(workers):  # each submit starts one more process until there are `workers`
            pool.submit(process.ping)
    finally:
        signal.signal(signal.SIGINT, previous)
        signal.signal(signal.SIGTERM, previous_term)
    return pool


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


def tokenize_locally(
    pool: ProcessPoolExecutor,
    model: str,
    texts: Iterable[str],
    options: EncodeOptions,
    *,
    chunk_chars: int,
    depth: int,
    encoder: Callable[[], str | None] = lambda: None,
    encoded_by: Counter[str] | None = None,
    slots: Slots | None = None,
    verifier: Verifier | None = None,
) -> Iterator[TokenizedBatch]:
    """Tokenize on the pool in chunks of about `chunk_chars` characters, `depth` chunks in flight.

    `encoder()`, asked as each chunk is sent: fastokens once the model's gate passed in the background (the
    worker promotes the model before it encodes that chunk). `encoded_by` counts texts by what encoded them.
    `slots` the workers share (`local_pool`, at least `depth` of them): chunk k goes in and comes back through slot
    k % depth, free again by then, as `in_order` has handed out chunk k - depth (its ids copied out below).
    `verifier`: checks each chunk a fast encoder encoded before it is handed out (its workers sample none)."""
    # each chunk travels as UTF-8 (a Parquet column's texts are that already), which gigatoken reads as it is
    shared = slots if slots is not None and slots.shared and slots.count >= depth else None

    checking: deque[Any] = deque()  # the texts of each chunk in flight, for the verifier

    def sent(number: int, chunk: list[Any]) -> Any:
        utf8 = as_utf8(chunk)  # a list of str where one text has a lone surrogate: the encoder says what of it
        if verifier is not None:
            checking.append(utf8)
        in_slot = shared.put_texts(number % depth, utf8) if shared is not None and isinstance(utf8, Utf8Texts) else None
        return in_slot if in_slot is not None else utf8

    verify = verifier is None
    submitted = (
        pool.submit(process.encode_chunk, model, sent(number, chunk), options, encoder(), verify)
        for number, chunk in enumerate(chunks(texts, chunk_chars, 1 << 16))
    )
    for batch, used in in_order(submitted, depth):
        if isinstance(batch, IdsInSlot):
            assert shared is not None
            batch = TokenizedBatch(shared.take_ids(batch), batch.offsets, model, None)
        if verifier is not None:
            chunk_texts = checking.popleft()
            if libraries.is_fast(used):  # before the chunk is handed out: a wrong chunk never reaches a shard
                verifier.check(chunk_texts, batch.ids, batch.offsets, options, used)
        if encoded_by is not None:
            encoded_by[used] += len(batch)
        yield batch


def tokenize_via_service(
    client: TokenizerClient,
    texts: Iterable[str],
    options: EncodeOptions,
    *,
    model: str,
    sha256: str,
    batch_size: int,
    depth: int,
) -> Iterator[TokenizedBatch]:
    """Tokenize through the service with the client's prefetch: `batch_size` texts a request, `depth` in
    flight, over all of the client's URLs, with its retries and failover.

    Every answer must come from the model file the output was started with (its sha256).
    """
    encode = {name: value for name, value in dataclasses.asdict(options).items() if value is not None}  # those set
    with client.prefetch(texts, batch_size=batch_size, depth=depth, model=model, **encode) as batches:
        for batch in batches:
            if not isinstance(batch, TokenizedBatch):  # only with pack=, which is not asked for here
                raise TypeError(f"prefetch handed out a {type(batch).__name__}, not a TokenizedBatch")
            answered = batch.model_sha256
            if answered is not None and answered != sha256:
                raise ServedModelChanged(
                    f"the service answered with model {model!r} sha256 {answered[:12]}…, "
                    f"but this output is tokenized with {sha256[:12]}…"
                )
            yield batch


Rejected = list[tuple[int, str]]  # items of a chunk refused: (index in the chunk, why)
DIALOGUE_CHUNK = 128  # conversations a local worker renders at a time


def item_chunks(items: Iterable[Any], size: int) -> Iterator[list[Any]]:
    chunk: list[Any] = []
    for item in items:
        chunk.append(item)
        if len(chunk) >= size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def tokenize_dialogue_locally(
    pool: ProcessPoolExecutor, model: str, kind: str, items: Iterable[Any], options: Any, *, depth: int
) -> Iterator[tuple[TokenizedBatch, Rejected]]:
    """Conversations or records (`kind`: "conversations" | "records") on the pool, with their loss masks."""
    submitted = (
        pool.submit(process.encode_dialogue_chunk, model, kind, chunk, options)
        for chunk in item_chunks(items, DIALOGUE_CHUNK)
    )
    return in_order(submitted, depth)


def _dialogue_request(
    client: TokenizerClient, items: list[Any], tokenize: TokenizeOptions, model: str, sha256: str
) -> tuple[TokenizedBatch, Rejected]:
    """One request's items through /v1/tokenize; an item the service refuses (422 naming its index) is left out
    and the rest sent again."""
    rejected: Rejected = []
    keep = list(range(len(items)))
    while True:
        try:
            batch = client._run(client._tokenize([items[i] for i in keep], tokenize, "binary"))
        except TokenizerServiceError as exc:
            if exc.status != 422 or exc.index is None or not 0 <= exc.index < len(keep):
                raise
            rejected.append((keep.pop(exc.index), exc.message))
            if keep:
                continue
            empty = np.zeros(0, np.int32)
            offsets = ragged_offsets(np.zeros(0, np.int64))
            none = TokenizedBatch(empty, offsets, model, sha256, None, None, empty.astype(np.uint8))
            return none, sorted(rejected)
        answered = batch.model_sha256
        if answered is not None and answered != sha256:
            raise ServedModelChanged(
                f"the service answered with model {model!r} sha256 {answered[:12]}…, "
                f"but this output is tokenized with {sha256[:12]}…"
            )
        if batch.loss_mask is None:
            raise ServedModelChanged(f"the service answered model {model!r}'s {tokenize.inputs} without a loss mask")
        return batch, sorted(rejected)


def tokenize_dialogue_via_service(
    client: TokenizerClient,
    kind: str,
    items: Iterable[Any],
    *,
    model: str,
    sha256: str,
    parse_special_tokens: bool,
    train_on: str,
    batch_size: int,
    depth: int,
) -> Iterator[tuple[TokenizedBatch, Rejected]]:
    """Conversations or records through the service, `batch_size` a request, `depth` requests in flight (the
    client's retries and failover over its URLs); every answer's model sha256 checked."""
    from tokenizer_client._requests import TokenizeOptions

    tokenize = TokenizeOptions(
        model,
        parse_special_tokens=parse_special_tokens,
        inputs=kind,  # type: ignore[arg-type]
        train_on=train_on if kind == "conversations" else "assistant",  # type: ignore[arg-type]
    )
    with ThreadPoolExecutor(max_workers=depth, thread_name_prefix="pretokenize") as threads:
        submitted = (
            threads.submit(_dialogue_request, client, chunk, tokenize, model, sha256)
            for chunk in item_chunks(items, batch_size)
        )
        yield from in_order(submitted, depth)
