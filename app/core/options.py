"""How texts become ids: the options a worker encodes with, as plain frozen dataclasses.

The HTTP bodies that carry them are validated by their schema (tokenizer_service.core.requests, pydantic) and turned
into these; the pre-tokenizer builds them from its flags. Nothing here imports pydantic, so a process that only
encodes (the pre-tokenizer's, a worker's) starts without it (0.14 s of imports)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SampleOptions:
    """SentencePiece subword regularization; the same seed gives the same ids."""

    alpha: float = 0.1
    nbest_size: int = -1
    seed: int | None = None


@dataclass(frozen=True)
class EncodeOptions:
    """The options of /v1/tokenize (their schema: tokenizer_service.core.requests.EncodeFields)."""

    add_bos: bool = False
    add_eos: bool = False
    max_length: int | None = None
    sample: SampleOptions | None = None
    parse_special_tokens: bool = False  # special-token strings in the text become their ids

    @property
    def seed(self) -> int | None:
        return None if self.sample is None else self.sample.seed
