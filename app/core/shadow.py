"""Shadow verification: a share of what a fast encoder encodes is encoded again by the reference library.

The gate (tokenizer_service.core.libraries) checks every code point and special-token string before
fastokens is trusted; this watches it afterwards. A `Shadow` samples texts as a library encodes them
(`rate`: each text with that chance, drawn as geometric gaps so the hot path only counts; and at least
one text per `interval` seconds of encoding), keeping the text and the fast encoder's ids. `run()`
encodes the kept texts with the reference library off the hot path (a server's worker after it sent
its reply; the pre-tokenizer's worker before it hands its chunk back) and says, per model, how many it
checked and the first text that differed. A library that differed falls back to its reference library
at once, in that process; the server tells every other worker (tokenizer_service.core.pool).
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from tokenizer_service.core.checkset import describe
from tokenizer_service.core.texts import Utf8Texts

RATE = 0.001  # share of texts checked, by default (the server's --shadow-rate, the pre-tokenizer's)
INTERVAL = 10.0  # and at least one text per this many seconds of fast encoding, by default
PENDING_MOST = 64  # texts kept for checking at most; more sampled before a check are dropped
# The largest text checked (characters, or UTF-8 bytes of a binary body's texts), and the most text kept for one
# check. The reference library re-encodes a text a thousand times slower than the fast encoder: a 32 MB text took
# `tokenizers` 15 s, while requests sent to that worker waited past their deadline and the worker was killed.
# 256 KiB takes it about 0.1 s; a larger text is never sampled (the gate checked every code point before the fast
# encoder served; shadow verification watches the ordinary traffic after it).
SAMPLE_MOST_CHARS = 256 * 1024
PENDING_MOST_CHARS = 1024 * 1024
INTERVAL_TRIES = 8  # random texts of a batch tried for the interval's sample before none is taken
SHOWN_CODE_POINTS = 64  # of a differing text, in the log line


@dataclass
class Report:
    """What `run` found for one model: texts checked, and the first that differed (its code points), if one did."""

    model: str
    checks: int
    mismatch: str | None = None


class Shadow:
    def __init__(self, rate: float, interval: float, seed: int | None = None) -> None:
        self.rate = rate
        self.interval = interval
        self.random = random.Random(seed)
        self.pending: list[tuple[Any, str, bool, np.ndarray]] = []
        self.pending_chars = 0  # the size of the texts pending (`_size`: characters, or UTF-8 bytes)
        self.worked = 0.0  # seconds of fast encoding since the last text sampled
        self.since = time.monotonic()
        self.gap = self._gap()
        self.names: dict[int, str] = {}

    @property
    def samples(self) -> bool:
        """Whether this Shadow ever samples a text (a rate or an interval is set)."""
        return self.rate > 0 or self.interval > 0

    def watch(self, name: str, library: Any) -> None:
        """Sample what `library` (model `name`) encodes while its fast encoder serves it."""
        if library.fast is not None and self.samples:
            self.names[id(library)] = name
            library.shadow = self

    def _gap(self) -> int:
        """Texts until the next sampled one: geometric with mean 1/rate (a rate of 0 samples none)."""
        if self.rate <= 0:
            return 1 << 62
        if self.rate >= 1:
            return 0
        # log1p: a rate under 1e-16 is no 0 there; a gap past 2**62 texts is as good as never
        gap = math.log(1.0 - self.random.random()) / math.log1p(-self.rate)
        return int(gap) if gap < 1 << 62 else 1 << 62

    def sample(self, library: Any, texts: list[str], parse_special: bool, ids: np.ndarray, lengths: np.ndarray) -> None:
        """Called as `library` encoded `texts` with its fast encoder: keep the sampled ones with their ids."""
        count = len(texts)
        picks = []
        while self.gap < count:
            if _size(texts, self.gap) <= SAMPLE_MOST_CHARS:
                picks.append(self.gap)
            self.gap += 1 + self._gap()
        self.gap -= count
        now = time.monotonic()
        if not picks and count and self.interval > 0 and now - self.since >= self.interval:
            tries = (self.random.randrange(count) for _ in range(INTERVAL_TRIES))  # a text not too large, if one is
            chosen = next((index for index in tries if _size(texts, index) <= SAMPLE_MOST_CHARS), None)
            if chosen is not None:
                picks.append(chosen)
        if not picks:
            return
        self.since = now
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        for index in picks:
            size = _size(texts, index)
            if len(self.pending) < PENDING_MOST and self.pending_chars + size <= PENDING_MOST_CHARS:
                row = np.array(ids[offsets[index] : offsets[index + 1]], dtype=np.int64)
                self.pending.append((library, texts[index], parse_special, row))
                self.pending_chars += size

    def run(self) -> list[Report]:
        """Check every kept text against its reference library; fall back a library that differs."""
        if not self.pending:
            return []
        pending, self.pending, self.pending_chars = self.pending, [], 0
        reports: dict[int, Report] = {}
        for library, text, parse_special, got in pending:
            report = reports.setdefault(id(library), Report(self.names.get(id(library), "?"), 0))
            if library.fast is None:  # fell back meanwhile: nothing to check
                continue
            (want,) = library.reference_rows([text], parse_special)
            report.checks += 1
            if report.mismatch is None and list(want) != got.tolist():
                report.mismatch = mismatch_line(text, got.tolist(), list(want))
                library.fall_back(report.mismatch)  # and kept as the gate's verdict: no later start serves it
        return [report for report in reports.values() if report.checks]


def _size(texts: Any, index: int) -> int:
    """What the text at `index` weighs: characters, or UTF-8 bytes of a binary body's texts (none decoded)."""
    if isinstance(texts, Utf8Texts):
        return texts.bounds[index + 1] - texts.bounds[index]
    return len(texts[index])


def mismatch_line(text: str, got: list[int], want: list[int]) -> str:
    """The differing text as code points (bounded) and both ids (bounded): what the log line says."""
    return (
        f"{len(text)} characters [{describe(map(ord, text), SHOWN_CODE_POINTS)}]: fast ids {got[:32]}, "
        f"reference ids {want[:32]}"
    )


class ShadowMismatch(Exception):
    """The pre-tokenizer's worker found a sampled text its fast encoder got wrong (it now encodes with the
    reference library); the chunk's ids are not handed out."""
