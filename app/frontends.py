"""Several front-end processes on one port (`--frontends N`), for machines with more cores than one feeds.

One server process keeps about 20 busy workers fed (docs/design.md). Beyond that, N
front-ends each bind the same address with SO_REUSEPORT, so the kernel spreads new connections
over them, and each runs its share of the workers: the server's whole design, N times, with
nothing shared between front-ends but the port and the metrics (prometheus_client's multiprocess
mode, in a directory of this supervisor's, so /metrics adds every front-end up).

This process supervises: SIGTERM or SIGINT (Ctrl-C) is passed on to every front-end as SIGTERM, so
each drains as a single server does; a front-end that dies takes the others down and this process
exits non-zero, for the orchestrator to restart the whole (a half-size server would be a silent
loss of capacity). Front-ends run in a process group of their own, so a terminal's Ctrl-C reaches
them once, through here, and they exit when this process is killed outright. A signal that arrives
while front-ends start reaches every one started, and none starts after it. The metrics directory
(`tokenizer-metrics-PID-*`) is removed on the way out; one left by a supervisor killed outright is
removed by the next supervisor's start, once its PID no longer runs.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import threading
from typing import Any

import uvicorn
from prometheus_client import multiprocess

from tokenizer_service.core import scratch, zygote
from tokenizer_service.core.process import exit_with_parent
from tokenizer_service.metrics import MULTIPROCESS_DIR_ENV, Metrics
from tokenizer_service.settings import Settings

logger = logging.getLogger("tokenizer")


def shares(workers: int, frontends: int) -> list[int]:
    """Workers per front-end: as even as possible, at least one each."""
    return [max(1, workers // frontends + (1 if index < workers % frontends else 0)) for index in range(frontends)]


def shortfall(workers: int, frontends: int) -> str | None:
    """What to say where `shares` runs more workers than asked for (a front-end each at least), else None."""
    if workers >= frontends:
        return None
    return (
        f"--frontends {frontends} with --workers {workers}: each front-end feeds workers of its own, so {frontends} "
        f"workers run; give --workers {frontends} or more, or fewer --frontends, to match the cores you asked for"
    )


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound with SO_REUSEPORT, so that every front-end can bind the same address."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


METRICS_DIR_PREFIX = "tokenizer-metrics-"  # then the supervisor's pid, then mkdtemp's suffix


def remove_stale_metrics_dirs(directory: str | None = None) -> list[str]:
    """Remove the metrics directories of supervisors that are gone (killed outright, they leave theirs behind):
    `scratch.remove_stale`'s rule. The paths removed."""
    return scratch.remove_stale(METRICS_DIR_PREFIX, directory)


def _drain() -> None:
    os.kill(os.getpid(), signal.SIGTERM)  # drain as usual: the workers stop with us


def frontend(settings: dict[str, Any], index: int, workers: int) -> None:
    """One front-end process: the whole server on its share of the workers."""
    os.setpgrp()
    exit_with_parent(_drain)
    from tokenizer_service.http.connections import uvicorn_options
    from tokenizer_service.http.factory import create_app

    config = Settings.model_validate({**settings, "workers": workers, "frontends": 1})
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    paths = config.model_paths()
    zygote.start(paths, config.encoder, config.chat_template_paths(paths))  # its workers fork from it
    sock = listening_socket(config.host, config.port)
    metrics = Metrics()  # the app's, where the connections' own refusals are counted too
    server = uvicorn.Server(uvicorn.Config(create_app(config, metrics=metrics), **uvicorn_options(config, metrics)))
    logger.info("front-end %d: %d workers on %s:%d (SO_REUSEPORT)", index, workers, config.host, config.port)
    server.run(sockets=[sock])


def supervise(settings: Settings) -> int:
    """Run `settings.frontends` front-ends until they stop; the exit status for the command."""
    if settings.port == 0:
        print("tokenizer-server: --frontends above 1 needs a fixed --port (each front-end binds it)", file=sys.stderr)
        return 2
    stopping = threading.Event()
    processes: list[multiprocessing.process.BaseProcess] = []  # those started, each appended once its pid is known

    def stop(signum: int, frame: object) -> None:
        stopping.set()
        for process in processes:
            if process.exitcode is None:
                os.kill(process.pid, signal.SIGTERM)  # type: ignore[arg-type]  # started: it has a pid

    # First of all, so that a signal at any moment of start-up is a stop: one that arrives while a front-end
    # starts (its pid not known yet) is passed on once it is, and no front-end starts after it.
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    own_dir = None
    if not os.environ.get(MULTIPROCESS_DIR_ENV):
        remove_stale_metrics_dirs()
        own_dir = str(scratch.make(METRICS_DIR_PREFIX))
        os.environ[MULTIPROCESS_DIR_ENV] = own_dir
    if (short := shortfall(settings.workers, settings.frontends)) is not None:
        logger.warning(short)
    context = multiprocessing.get_context("spawn")
    dump = settings.model_dump(mode="json")
    dump["api_keys"] = [key.get_secret_value() for key in settings.api_keys]
    try:
        for index, share in enumerate(shares(settings.workers, settings.frontends)):
            if stopping.is_set():
                break
            process = context.Process(target=frontend, args=(dump, index, share), name=f"tokenizer-frontend-{index}")
            process.start()
            processes.append(process)
            if stopping.is_set():  # asked to stop while it started: `stop` could not reach it then
                os.kill(process.pid, signal.SIGTERM)  # type: ignore[arg-type]  # a second one is harmless
        status = 0
        remaining = list(processes)
        while remaining:
            sentinels = {process.sentinel: process for process in remaining}
            for ready in multiprocessing.connection.wait(list(sentinels)):
                process = sentinels[ready]
                process.join()
                remaining.remove(process)
                multiprocess.mark_process_dead(process.pid)
                if not stopping.is_set():
                    logger.error("front-end %s exited (code %s); stopping the others", process.name, process.exitcode)
                    status = 1
                    stop(signal.SIGTERM, None)
        return status
    finally:
        for process in processes:
            if process.exitcode is None and process.pid is not None:
                process.kill()
        if own_dir is not None:
            shutil.rmtree(own_dir, ignore_errors=True)
