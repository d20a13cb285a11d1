"""Shadow verification of a local run's chunks in a process of its own, whose reference library loads while the
run's process builds the fast encoder.

A forked worker of the local pool inherits what the run's process loaded before the fork. Its shadow verification
(tokenizer_service.core.shadow) needs the reference library beside the fast encoder, so on a large input both used to
load there, one after the other: they hold the GIL, so two threads take as long as one (a 128k tokenizer.json:
gigatoken 0.41 s, then `tokenizers` 0.33 s). A `Verifier` is forked first, from the library `inspect_model` kept,
and loads the reference library while the run's process builds the fast encoder; the workers then encode without
sampling, and the run's process samples each chunk as it comes back (the same `Shadow` rule: 1 text in 1,000, and one
per interval), sends the sampled texts to the verifier, and hands the chunk to the shards only once the verifier
found their ids equal to its own. A difference raises `ShadowMismatch` there, as a worker's check did: the shard being
built is dropped, and the run goes on from the last shard written with the reference library; the mismatch is kept as
the gate's verdict (`libraries.remember_mismatch`).

It is used where it saves time: the pool forks, a fast encoder encodes from the start, and the input holds at least
`TOKENIZER_VERIFIER_MIN_BYTES` (default 16 MiB; on less, most runs sample no text and the reference library is
better not loaded at all). Otherwise each worker checks its own chunks (`process.encode_chunk`).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import signal
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from tokenizer_service.core import environment, libraries, process, registry
from tokenizer_service.core.models import ModelFiles, ModelInfo
from tokenizer_service.core.options import EncodeOptions
from tokenizer_service.core.shadow import Shadow, ShadowMismatch, mismatch_line

MIN_BYTES = 16 << 20
MIN_BYTES_ENV = "TOKENIZER_VERIFIER_MIN_BYTES"
PROCESS_NAME = "tokenizer-check"  # its name in ps -e and top (the kernel keeps 15 characters)


def min_bytes() -> int:
    return int(environment.number(MIN_BYTES_ENV, MIN_BYTES, whole=True))


class VerifierGone(RuntimeError):
    """The verifier process died (killed, out of memory): the chunks since cannot be checked."""


class Verifier:
    """The run's side: `check` samples a chunk and has its sampled texts encoded again in the verifier process."""

    def __init__(self, model: ModelInfo, files: ModelFiles, library: libraries.Library, shadow: Shadow) -> None:
        self.model, self.files, self.library_name = model, files, library.library
        self.sampler = shadow
        self.sampler.names[id(self)] = model.name
        self.checks = 0
        context = multiprocessing.get_context("fork")
        self._connection, theirs = context.Pipe()
        self._process = context.Process(target=_serve, args=(theirs, library), name=PROCESS_NAME, daemon=True)
        self._process.start()
        theirs.close()

    def check(self, texts: Any, ids: np.ndarray, offsets: np.ndarray, options: EncodeOptions, route: str) -> None:
        """ShadowMismatch if a text of this chunk sampled for checking got other ids from `route` (the fast encoder
        that encoded the chunk) than from the reference library; `ids`/`offsets` the chunk's rows, as framed."""
        self.sampler.sample(self, texts, bool(options.parse_special_tokens), ids, np.diff(offsets))
        if not self.sampler.pending:
            return
        pending, self.sampler.pending, self.sampler.pending_chars = self.sampler.pending, [], 0
        sampled = [text for _, text, _, _ in pending]
        try:
            self._connection.send((sampled, options))
            want: list[list[int] | None] = self._connection.recv()
        except (EOFError, OSError):
            self._process.join(timeout=1)
            raise VerifierGone(
                f"model {self.model.name!r}: the shadow verification process ended (exit code "
                f"{self._process.exitcode}); run the same command again to go on from the last shard written"
            ) from None
        for text, (_, _, _, got), row in zip(sampled, pending, want, strict=True):
            if row is None:  # the reference library refused this text (it says why when it encodes it): unchecked
                continue
            self.checks += 1
            if got.tolist() != row:
                line = mismatch_line(text, got.tolist(), row)
                libraries.remember_mismatch(self.files, route, line)  # no later start serves that encoder
                raise ShadowMismatch(
                    f"model {self.model.name!r}: {route} encoded a text otherwise than {self.library_name} "
                    f"(shadow verification): {line}"
                )

    def close(self) -> None:
        """End the verifier process (it also ends when this process does)."""
        with contextlib.suppress(OSError):
            self._connection.send(None)  # forked workers hold this end too: a close alone is no EOF while they live
        self._connection.close()
        self._process.join(timeout=5)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()


def start(model: ModelInfo, input_bytes: int, forking: bool) -> Verifier | None:
    """A Verifier for a local run of `input_bytes` on `model`, forked now (before the pool's process loads the fast
    encoder), or None where the workers check their own chunks: see the module's docstring."""
    if not forking or not libraries.is_fast(model.encoder) or input_bytes < min_bytes():
        return None
    shadow = process.pretokenize_sampler()
    if not shadow.samples:
        return None
    kept = registry.peek_kept(model.sha256)
    if kept is None:
        return None
    files, library = kept
    if library.encoder != library.library:  # the library inspect_model described the model with: its reference
        return None
    return Verifier(model, files, library, shadow)


def _serve(connection: Connection, library: libraries.Library) -> None:
    """The verifier process: load the reference library now, then encode each batch of sampled texts with it as the
    pool's workers would (BOS/EOS as asked) until the run's process closes the pipe."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the process group: the run's process ends this one
    process.exit_with_parent()
    with contextlib.suppress(OSError):  # multiprocessing's name is its own, not the process's: named for ps here
        Path("/proc/self/comm").write_text(PROCESS_NAME)
    library.reference_rows(["a"], False)  # the load, at once, while the run's process builds the fast encoder
    with contextlib.suppress(EOFError, OSError, KeyboardInterrupt):
        while True:
            asked = connection.recv()
            if asked is None:
                break
            texts, options = asked
            rows: list[list[int] | None] = []
            for text in texts:
                try:
                    ids, _ = library.encode([text], options)
                except Exception:  # the reference library refuses the text: not a difference to report
                    rows.append(None)
                else:
                    rows.append(ids.tolist())
            connection.send(rows)
