"""Worker processes forked from a zygote that loaded the models once, instead of each spawned worker importing the
service and loading every model again.

`start(models, encoder)`, in the process that will own the workers (the server, or each front-end), before any
other process starts: it launches multiprocessing's fork server now, a fresh interpreter with no thread and no
event loop, which imports this module first. There, `_load_here` describes each model as the announcing process
does (`inspect_model`, the same function) and loads it with the encoder that gives (`process.preload`: the fast
encoder built and its check set run once, the reference library kept for shadow verification), while the
server goes on with its own start-up on the other core. `context()` is then the fork server's: each worker (and
each one started again after a crash) is a fork of the zygote, its models already loaded. A 128k tokenizer.json
takes a spawned worker about 1.5 CPU-s to import and load; a fork, milliseconds.

A worker still checks what it was given (`process.load_models`): a model the zygote holds with the sha256 and the
encoder announced is kept, any other (a file changed between the two reads, a gate verdict that arrived between
them, a zygote that failed) is loaded by the worker itself, as before. A zygote whose loading started a native
thread (which a fork would not copy) forgets what it loaded, so its workers load their own.
"""

from __future__ import annotations

import os
import signal

if "TOKENIZER_ZYGOTE_MODELS" in os.environ:  # MODELS_ENV: in the fork server, which imports this first, before all
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the server's to handle: here, only a traceback

import contextlib
import logging
import multiprocessing
import multiprocessing.forkserver
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import orjson

MODELS_ENV = "TOKENIZER_ZYGOTE_MODELS"  # set only while the fork server starts: what it loads

logger = logging.getLogger("tokenizer.pool")

_started = False


def start(models: Mapping[str, Path], encoder: str, chat_templates: Mapping[str, Path] | None = None) -> None:
    """Launch the zygote, loading `models` (name -> path) as `inspect_model(name, path, encoder, template)`
    describes them; workers started from now on fork from it. One that cannot start leaves workers spawned."""
    global _started
    templates = chat_templates or {}
    spec = [[name, str(path), str(templates[name]) if name in templates else None] for name, path in models.items()]
    os.environ[MODELS_ENV] = orjson.dumps({"models": spec, "encoder": encoder}).decode()
    try:
        server = multiprocessing.forkserver._forkserver  # type: ignore[attr-defined]
        server._stop()  # one started earlier in this process (tests start servers in-process) preloaded others
        server.set_forkserver_preload([__name__])
        server.ensure_running()
        _started = True
    except Exception as exc:  # no fork server here: workers are spawned, each loading its models
        logger.warning("workers will be spawned, each loading its models: no fork server (%s)", exc)
    finally:
        del os.environ[MODELS_ENV]  # the fork server has its copy; nothing started later inherits it


def stop() -> None:
    """Stop the zygote (a start refused after it was launched): workers are spawned again."""
    global _started
    multiprocessing.forkserver._forkserver._stop()  # type: ignore[attr-defined]
    _started = False


def context() -> Any:
    """The multiprocessing context workers start in: the zygote's once started, else spawn."""
    return multiprocessing.get_context("forkserver" if _started else "spawn")


def _load_here(spec: str) -> None:
    """In the zygote, at its start: load every model as the server announces it; whatever fails is left to the
    workers, which load what the zygote does not hold. Its log lines are the announcing process's to say."""
    import tokenizer_service.core.handler  # noqa: F401  # what each worker it forks imports to serve: once, here
    from tokenizer_service.core import libraries, process, registry

    with contextlib.suppress(ImportError):  # texts.all_valid's, where installed (the corpora extra)
        import pyarrow  # noqa: F401

    quiet = logging.getLogger("tokenizer")
    quiet.disabled = True
    try:
        wanted = orjson.loads(spec)
        before = process.os_threads()
        libraries.single_threaded()
        for name, path, template in wanted["models"]:
            try:
                info = registry.inspect_model(
                    name, Path(path), wanted["encoder"], Path(template) if template else None, keep=True
                )
                process.preload(info, registry.kept_model(info.sha256))
            except Exception:  # the worker loads it, and says why it cannot
                continue
            finally:
                registry.release_kept()
        if process.os_threads() != before:  # a native pool started: a fork would not copy it
            process.forget_models()
    except Exception:  # a zygote that loads nothing still forks workers that load their own
        process.forget_models()
    finally:
        quiet.disabled = False


if (_spec := os.environ.pop(MODELS_ENV, None)) is not None and multiprocessing.parent_process() is None:
    _load_here(_spec)  # in the fork server: imported by it first of all, as its preload
