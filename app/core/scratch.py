"""Temporary directories named by the process that made them (``PREFIX<pid>-<random>``), and the removal of those
whose process is gone: a process killed outright (``kill -9``, the OOM killer) never removes its own, and a rerun
makes a new one, so without this each kill left one behind (an export's staging and cache, a pre-tokenizer's
staging: megabytes to gigabytes each).

Only this user's directories whose pid no longer runs are removed; one of a live process, of another user, or a
name without a pid is left alone.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger("tokenizer.scratch")


def make(prefix: str) -> Path:
    """A new directory under the system's temporary directory, named by `prefix`, this process's pid and a random
    part: what `remove_stale` recognizes."""
    return Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-"))


def remove_stale(prefix: str, directory: str | None = None) -> list[str]:
    """Remove the `prefix` directories (made by `make`) of processes that are gone; the paths removed."""
    directory = directory or tempfile.gettempdir()
    removed: list[str] = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    for entry in entries:
        owner, _, rest = entry.name.removeprefix(prefix).partition("-")
        if not entry.name.startswith(prefix) or not owner.isdigit() or not rest:
            continue
        try:
            if not entry.is_dir(follow_symlinks=False) or entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
            os.kill(int(owner), 0)
        except ProcessLookupError:  # its process is gone
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
        except OSError:  # alive (another user's: EPERM), or unreadable: not ours to remove
            continue
    if removed:
        logger.info("removed %d temporary directories of processes that are gone: %s", len(removed), removed)
    return removed
