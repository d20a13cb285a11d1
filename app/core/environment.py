"""What a process reads of its environment without pydantic (tokenizer_service.settings reads the server's flags
and variables with it): the CPU cores it may use, and numbers of TOKENIZER_* variables that no flag sets (the
pre-tokenizer's thresholds and its shadow verification's sampling), where a value that is not a number in range is
refused with what to give, where a bare int() would end a run in a traceback."""

from __future__ import annotations

import os
import sys


def usable_cpus() -> int:
    """CPU cores this process may run on (respects taskset and cgroup cpusets)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class EnvironmentValueError(ValueError):
    """A TOKENIZER_* variable holds what is not a number in its range; the message names it and what to give."""


def number(name: str, default: float, *, whole: bool = False, most: float | None = None) -> float:
    """The variable `name` as a number at least 0 (and at most `most`), `default` where unset or empty;
    `whole`: an integer (bytes)."""
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    what = "a whole number of bytes" if whole else "a number"
    bound = f"from 0 to {most:g}" if most is not None else "at least 0"
    shown = f"{int(default)}" if whole else f"{default:g}"
    try:
        found: float = int(value) if whole else float(value)
    except ValueError:
        found = -1.0
    if not 0 <= found <= (most if most is not None else sys.float_info.max):  # NaN and infinity too
        raise EnvironmentValueError(f"{name}={value!r}: give {what} {bound}, or unset it (default {shown})")
    return found
