"""A prefetch's saved position: the JSON-able state_dict and the Resume read back from it.

A state names the first text with something not yet delivered and how many of its tokens (concat) or
of its request's rows (best_fit) were, so a resumed run re-reads the stream from its start, skips
what was delivered and goes on with the very next batch. It also carries the model's name and
sha256 and the options that decide the ids, which a resumed run must repeat, and the fingerprint of the
last text the saved run read (the text it stopped inside, else the one before the position): a resumed
run checks that its stream has that text there, so a stream that does not continue where the state
stopped (a generator already partly consumed, a changed source) is a ValueError, not other batches.
A state saved before fingerprints were kept has none, and resumes unchecked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenizer_client.prefetch.options import PrefetchOptions
from tokenizer_client.prefetch.rows import StreamPosition
from tokenizer_client.prefetch.texts import TextCheck

STATE_FORMAT = "tokenizer-prefetch"
STATE_VERSION = 1


@dataclass(frozen=True)
class Resume:
    """Where a prefetcher starts: a position in the stream and the number of batches already handed out."""

    position: StreamPosition
    batches: int
    model: str | None
    model_sha256: str | None
    check: TextCheck | None = None

    @classmethod
    def from_state(cls, state: dict[str, Any] | None, options: PrefetchOptions) -> Resume:
        """The start of the stream for None; else the saved position, once the state matches `options`."""
        if state is None:
            return cls(StreamPosition(0, 0), 0, None, None)
        if state.get("format") != STATE_FORMAT or state.get("version") != STATE_VERSION:
            raise ValueError(f"not a prefetch state of version {STATE_VERSION}: {state!r:.200}")
        if state["mode"] != options.mode:
            raise ValueError(f"the state is of a {state['mode']!r} prefetch, this one is {options.mode!r}")
        if state["options"] != options.fingerprint():
            raise ValueError(f"the state was saved with other options: {options_differ(state['options'], options)}")
        position = StreamPosition(int(state["text"]), int(state["skip"]))
        saved = state.get("last_text")  # absent from states saved before it was kept: resumed unchecked
        check = TextCheck(int(saved["text"]), str(saved["fingerprint"])) if saved else None
        return cls(position, int(state["batches"]), state["model"], state["sha256"], check)

    def reading_from(self) -> tuple[int, bool, TextCheck | None]:
        """The stream index to read texts from, whether the state stopped inside that text, and the text to check."""
        return self.position.text, self.position.skip > 0, self.check

    def state_dict(self, options: PrefetchOptions) -> dict[str, Any]:
        return state_dict(options, self.position, self.batches, self.model, self.model_sha256, self.check)


def options_differ(saved: dict[str, Any], options: PrefetchOptions) -> str:
    """The options a state was saved with that this prefetch does not repeat, each saved value and the one now."""
    now = options.fingerprint()
    names = [*now, *(name for name in saved if name not in now)]
    differ = [
        f"{name}={saved.get(name)!r} (now {now.get(name)!r})" for name in names if saved.get(name) != now.get(name)
    ]
    return ", ".join(differ) + "; pass the same options to resume, or start without state="


def state_dict(
    options: PrefetchOptions,
    position: StreamPosition,
    batches: int,
    model: str | None,
    sha256: str | None,
    check: TextCheck | None = None,
) -> dict[str, Any]:
    return {
        "format": STATE_FORMAT,
        "version": STATE_VERSION,
        "mode": options.mode,
        "text": position.text,
        "skip": position.skip,
        "batches": batches,
        "model": model,
        "sha256": sha256,
        "options": options.fingerprint(),
        "last_text": None if check is None else {"text": check.text, "fingerprint": check.fingerprint},
    }
