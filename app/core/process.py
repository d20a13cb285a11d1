"""A worker process's life: it starts deaf to Ctrl-C and bound to its parent, loads its models, then
answers jobs from its socket (tokenizer_service.core.handler does the work) until the server closes it.

Ctrl-C in a terminal sends SIGINT to the whole process group. The server drains and then stops its
workers itself; a worker that died of KeyboardInterrupt first would only look like a crash and
trigger a pointless rebuild in the middle of the shutdown.

An idle `ProcessPoolExecutor` worker waits on its call queue forever: if its parent is killed
(`kill -9`, the OOM killer), it would live on, orphaned, holding every model in memory. A daemon
thread waits on the parent's sentinel and ends the worker when the parent is gone.

A server's workers fork from a zygote that loaded the models once (tokenizer_service.core.zygote); any model it
does not hold as announced, a worker loads itself. A file replaced on disk meanwhile would give ids from another
model than the one whose sha256 the server announces, so such a worker refuses to start on a file whose sha256
changed (the pool then answers 503 until the server is restarted).

`load_models` reads each model's files again, refuses any whose bytes changed since the server
announced their sha256, and loads it in its library (tokenizer_service.core.libraries, with the fast encoder behind
its check). `encode_chunk` answers the pre-tokenizer's pool with a TokenizedBatch: flat numpy buffers
(int32 ids plus int64 offsets pickle as two memcpy'd blobs, where lists of Python ints would cost about
a quarter of the tokenization time again); a forked worker reads its chunk from, and puts its ids in, a slot of
memory it shares with the pool's process instead (tokenizer_service.core.slots), which costs a tenth of the pipe.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import select
import signal
import socket
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson

from tokenizer_client.wire import ragged_offsets
from tokenizer_service.core import channel, environment, libraries, memory, protocol
from tokenizer_service.core.libraries import Library
from tokenizer_service.core.models import ModelInfo, find_model_files
from tokenizer_service.core.options import EncodeOptions
from tokenizer_service.core.shadow import INTERVAL, RATE, Shadow, ShadowMismatch
from tokenizer_service.core.slots import IdsInSlot, Slots, TextsInSlot
from tokenizer_service.core.texts import readable

if TYPE_CHECKING:
    from tokenizer_client.batches import TokenizedBatch
    from tokenizer_service.core.handler import Limits

logger = logging.getLogger("tokenizer.pool")

INTERNAL_ERROR = orjson.dumps({"type": "internal_error", "message": "internal server error"})

Buffer = bytes | bytearray | memoryview

_libraries: dict[str, Library] = {}
_files: dict[str, Any] = {}  # each model's ModelFiles (its chat template, its special tokens)
_dialogues: dict[tuple[str, str], Any] = {}  # (model, kind) -> its ChatTemplate or Records, built once a process


# -- starting: signals, the parent's life, the models ----------------------------------------------------


def _exit_now() -> None:
    os._exit(1)


def exit_with_parent(leave: Callable[[], None] = _exit_now) -> None:
    """Call `leave` (by default: exit at once) in a daemon thread when the parent process is gone."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()
        leave()

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def start(models: Sequence[ModelInfo]) -> None:
    """Pool initializer, for the server's pools and the pre-tokenizer's."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_with_parent()
    load_models(models)


class ModelChanged(RuntimeError):
    """A model file no longer holds the bytes the server announced at startup."""


def load_models(models: Sequence[ModelInfo]) -> None:
    """Pool initializer: load each model once per worker process, single-threaded, with the encoder the
    model was announced with (fastokens passes its check again here, in the process that uses it). A model this
    process already holds (`preload`, in the parent of a forked pool) is kept as it is: loaded once."""
    libraries.single_threaded()
    held = {info.name: _libraries[info.name] for info in models if _held(info)}
    _libraries.clear()
    _libraries.update(held)
    for info in models:
        if info.name in held:
            continue
        files = find_model_files(info.name, info.path, info.chat_template_path)
        if files.sha256 != info.sha256:
            raise ModelChanged(
                f"model {info.name!r}: {info.path} changed since the server started (sha256 {files.sha256}, "
                f"announced {info.sha256}); restart the server to serve the new file"
            )
        encoder = info.encoder if libraries.is_fast(info.encoder) else libraries.REFERENCE  # the route chosen
        # trusted: the announcing process passed the whole gate on these files (sha256 checked above)
        _libraries[info.name] = libraries.load(files, encoder, trusted=True)
        _files[info.name] = files


def _held(info: ModelInfo) -> bool:
    """Does this process hold `info`'s model as announced: its files' sha256, and the encoder that encodes it?"""
    library = _libraries.get(info.name)
    return library is not None and _files[info.name].sha256 == info.sha256 and library.encoder == info.encoder


def forget_models() -> None:
    """Drop every model this process holds: the processes it forks load their own."""
    _libraries.clear()
    _files.clear()


FORK_SAFE_THREADS = {"jemalloc_bg_thd"}  # jemalloc's background threads: its fork handlers restart them in a child


def os_threads() -> int:
    """Threads of this process, the native ones included (a Rust library's pool), where Linux says; jemalloc's
    background threads (pyarrow's, gigatoken's allocator) left out."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0  # unknown
    count = 0
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as file:
                count += file.read().strip() not in FORK_SAFE_THREADS
        except OSError:  # the thread ended meanwhile
            continue
    return count


def preload(info: ModelInfo, kept: tuple[Any, Library] | None = None, reference: bool = True) -> None:
    """Load `info`'s model here, in the parent of a pool about to fork, so its workers start with it loaded: the
    encoder it was announced with (the fast encoder's check set runs here, once), and the reference library kept
    for the workers' shadow verification. `kept`: the files and the library `inspect_model` described the model
    with, adopted instead of reading and loading the files again. `reference` False, behind a fast encoder: the
    reference library is left to load in a worker when it first needs it (a text sampled for shadow
    verification), which on a small input none does."""
    libraries.single_threaded()  # before any library here first encodes: the workers inherit it
    if kept is None or kept[0].sha256 != info.sha256:
        load_models((info,))
    else:
        _files[info.name], _libraries[info.name] = kept
    library = _libraries[info.name]
    if libraries.is_fast(info.encoder):
        library.promote(info.encoder, keep_reference=True)
        libraries.plant_if_asked(library)
    if reference or library.fast is None:
        library.reference_rows(["a"], False)  # loads the reference library where promoting dropped it


def ping() -> int:
    """A round trip that starts a worker process and proves it loaded its models (their number)."""
    return len(_libraries)


def library(name: str) -> Library:
    return _libraries[name]


def share(shared: Slots | None) -> None:
    """The slots of shared memory the pool about to fork from this process passes chunks through (`slots`); None
    once that pool is gone."""
    global _slots
    _slots = shared


def encode_chunk(
    model: str,
    texts: Sequence[str] | TextsInSlot,
    options: EncodeOptions,
    encoder: str | None = None,
    verify: bool = True,
) -> tuple[TokenizedBatch | IdsInSlot, str]:
    """Tokenize texts[i] exactly as the model's library would in-process (the pre-tokenizer's pool): the ids,
    and what encoded them. `encoder` fastokens: the model's gate passed in the background since the pool
    started; this worker promotes it first (the ids are the same either way). Texts sent in a slot of shared
    memory (`share`) are read there, and their ids put back in it where they fit. `verify` False: the run's
    process checks the chunk (tokenizer_service.tools.pretokenize.verifier), this worker samples none of it."""
    from tokenizer_client.batches import TokenizedBatch  # here, not at import: the server's workers never need it

    slot = texts.slot if isinstance(texts, TextsInSlot) else None
    if isinstance(texts, TextsInSlot):
        assert _slots is not None, "a chunk in a slot reached a worker that shares none"
        texts = _slots.take_texts(texts)
    library = _libraries[model]
    shadow = _pretokenize_shadow(model, library) if verify else Shadow(0.0, 0.0)
    if libraries.is_fast(encoder) and library.fast is None and library.promote(encoder):
        shadow.watch(model, library)
    ids, lengths = library.encode(readable(texts, library), options)
    for report in shadow.run():  # before the chunk is handed back: a wrong chunk never reaches a shard
        if report.mismatch is not None:
            raise ShadowMismatch(
                f"model {model!r}: fastokens encoded a text otherwise than {library.library} "
                f"(shadow verification): {report.mismatch}"
            )
    offsets = ragged_offsets(lengths)
    if slot is not None and _slots is not None and (in_slot := _slots.put_ids(slot, ids, offsets)) is not None:
        return in_slot, library.encoder
    return TokenizedBatch(ids, offsets, model, None), library.encoder


def _dialogue_encoder(model: str, kind: str) -> Any:
    """The model's ChatTemplate (conversations) or Records (prompt-completion), compiled once a process."""
    from tokenizer_service.core import chat

    found = _dialogues.get((model, kind))
    if found is None:
        files, library = _files[model], _libraries[model]
        special = chat.special_tokens(files, library)
        if kind == "conversations":
            if files.template is None:
                raise ValueError(f"model {model!r} has no chat template: pass --chat-template FILE")
            found = chat.ChatTemplate(model, files.template, library, special)
        else:
            found = chat.Records(library, special.get("eos"))
        _dialogues[(model, kind)] = found
    return found


def encode_dialogue_chunk(
    model: str, kind: str, items: list[Any], options: Any
) -> tuple[TokenizedBatch, list[tuple[int, str]]]:
    """Conversations (`kind` "conversations") or prompt-completion records ("records") as the service's /v1/tokenize
    answers them: a TokenizedBatch with its loss_mask, and the items refused ((index in `items`, the service's
    message)), which are left out of the batch (the pre-tokenizer's bad records)."""
    from tokenizer_client.batches import TokenizedBatch
    from tokenizer_service.core.errors import InvalidField, PayloadTooLarge

    encoder = _dialogue_encoder(model, kind)
    rejected: list[tuple[int, str]] = []
    try:
        ids, lengths, mask = encoder.encode(items, options)
    except (InvalidField, PayloadTooLarge):  # one item or more: each alone, to leave out only those
        parts = []
        for index, item in enumerate(items):
            try:
                parts.append(encoder.encode([item], options))
            except (InvalidField, PayloadTooLarge) as exc:
                rejected.append((index, exc.message))
        ids = np.concatenate([part[0] for part in parts]) if parts else np.zeros(0, np.int32)
        lengths = np.concatenate([part[1] for part in parts]) if parts else np.zeros(0, np.int64)
        mask = np.concatenate([part[2] for part in parts]) if parts else np.zeros(0, np.uint8)
    batch = TokenizedBatch(ids.astype(np.int32, copy=False), ragged_offsets(lengths), model, None, loss_mask=mask)
    return batch, rejected


_shadows: dict[str, Shadow] = {}
_slots: Slots | None = None  # the pre-tokenizer's shared memory, inherited from the process that forked this one


def _pretokenize_shadow(model: str, library: Library) -> Shadow:
    """The pre-tokenizer's shadow verification, with the server's settings (TOKENIZER_SHADOW_RATE,
    TOKENIZER_SHADOW_INTERVAL_SECONDS) where they are set."""
    shadow = _shadows.get(model)
    if shadow is None:
        shadow = _shadows[model] = pretokenize_sampler()
        shadow.watch(model, library)
    return shadow


def pretokenize_sampler() -> Shadow:
    """A Shadow with the pre-tokenizer's sampling: the server's settings (TOKENIZER_SHADOW_RATE,
    TOKENIZER_SHADOW_INTERVAL_SECONDS) where they are set."""
    rate = environment.number("TOKENIZER_SHADOW_RATE", RATE, most=1)
    interval = environment.number("TOKENIZER_SHADOW_INTERVAL_SECONDS", INTERVAL)
    return Shadow(rate, interval)


# -- serving jobs ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Startup:
    """What a worker process needs to start: models (checked against their sha256), default, limits."""

    models: tuple[ModelInfo, ...]
    default: str
    limits: Limits


def serve(connection: socket.socket, startup: Startup, progress: Any) -> None:
    """A worker process's whole life: load the models, then answer jobs until the socket closes."""
    # A process group of its own: a signal to the server's group (`timeout`, `kill -- -PGID`, Ctrl-C)
    # must not kill workers ahead of the drain; the server stops them after it, by closing their
    # sockets or with SIGKILL, and a worker whose server is gone exits on its own (exit_with_parent).
    os.setpgrp()
    try:
        start(startup.models)
    except (OSError, RuntimeError) as exc:  # ModelChanged, ModelLoadError among them
        logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        logger.error("worker %d cannot start: %s", os.getpid(), exc)
        sys.exit(1)
    memory.keep_freed_memory()
    # the server's jobs (and their request schemas, pydantic): imported by its workers only, not by the
    # pre-tokenizer's, which encode chunks (`encode_chunk`) and start without them
    from tokenizer_service.core.handler import Handler, TextMarker

    libraries_of_models = [library(info.name) for info in startup.models]
    handler = Handler(startup.models, libraries_of_models, startup.default, startup.limits, TextMarker(progress))
    shadow = Shadow(startup.limits.shadow_rate, startup.limits.shadow_interval)
    for info, watched in zip(startup.models, libraries_of_models, strict=True):
        shadow.watch(info.name, watched)
    positions = {info.name: position for position, info in enumerate(startup.models)}
    reader = channel.FrameReader()
    connection.setblocking(True)
    while True:
        received = connection.recv_into(reader.buffer())
        if not received:
            return  # the server closed our socket: it is stopping
        frames = reader.advance(received)
        big = False
        while frames:
            number, kind, payload = frames.pop(0)
            if kind == channel.POISON:
                handler.remember_poison(payload)
                continue
            if kind == channel.FALLBACK:  # another worker's shadow check found fastokens wrong on this model
                libraries_of_models[protocol.read_fallback(payload)].fall_back()
                continue
            if kind == channel.PROMOTE:  # the background gate passed this model: fastokens encodes it now
                position, route = protocol.read_promotion(payload)
                if libraries_of_models[position].promote(route):
                    shadow.watch(startup.models[position].name, libraries_of_models[position])
                continue
            try:
                reply, parts = handler.handle(kind, payload, _sharer(connection, number))
            except Exception:
                traceback.print_exc()
                reply, parts = channel.FAILED, [INTERNAL_ERROR]
            big = big or len(payload) >= memory.TRIM_AFTER_BYTES
            del payload
            try:
                _send_all(connection, channel.frame_parts(number, reply, parts))
            except (BrokenPipeError, ConnectionResetError):
                return  # the server stopped while this job ran
            del parts
            if shadow.pending and not _verify(connection, shadow, positions):
                return
        if big and not _waiting(connection):  # everything of the last jobs is freed by now
            memory.trim()


def _verify(connection: socket.socket, shadow: Shadow, positions: dict[str, int]) -> bool:
    """After a reply: the sampled texts encoded again by the reference library, and what was found told
    to the server (VERIFIED), which counts it and, on a mismatch, falls the model back in every worker."""
    for report in shadow.run():  # the server logs a mismatch, once a model
        payload = protocol.verified_payload(positions[report.model], report.checks, report.mismatch)
        try:
            _send_all(connection, channel.frame(0, channel.VERIFIED, payload))
        except (BrokenPipeError, ConnectionResetError):
            return False
    return True


def _sharer(connection: socket.socket, number: int) -> Callable[[int, Sequence[Buffer]], None]:
    """Send a frame for job `number` before its reply (a SHARE); a server that is gone is not an error here."""

    def share(kind: int, parts: Sequence[Buffer]) -> None:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            _send_all(connection, channel.frame_parts(number, kind, parts))

    return share


def _waiting(connection: socket.socket) -> bool:
    """Is another job already on the socket?"""
    ready, _, _ = select.select([connection], [], [], 0)
    return bool(ready)


def _send_all(connection: socket.socket, buffers: Sequence[Buffer]) -> None:
    views = [memoryview(buffer).cast("B") for buffer in buffers if len(buffer)]
    while views:
        sent = connection.sendmsg(views[:512])
        while sent:
            if sent >= len(views[0]):
                sent -= len(views[0])
                views.pop(0)
            else:
                views[0] = views[0][sent:]
                sent = 0
