"""The batches the client hands out: TokenizedBatch (ragged ids) and PackedBatch (fixed-length rows).

Public types (``from client import TokenizedBatch, PackedBatch``). Their arrays become torch tensors
with tokenizer_client._torch, which knows arrays only.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from tokenizer_client import wire
from tokenizer_client._torch import tensors

__all__ = ["ROW_FIELDS", "Batch", "PackedBatch", "TokenizedBatch"]

ROW_FIELDS = ("input_ids", "labels", "position_ids")  # PackedBatch's [rows, seq_len] arrays


@dataclass(frozen=True)
class TokenizedBatch:
    """Ragged ids of one request: sequence i is ids[offsets[i]:offsets[i + 1]].

    From a prefetcher, ``index`` is the batch's number in the stream and ``start`` the stream
    index of its first text (both None from ``tokenize_batch``); with ``as_torch=True`` ``ids``
    and ``offsets`` are torch tensors.
    """

    ids: np.ndarray  # int32
    offsets: np.ndarray  # int64, len + 1
    model: str
    model_sha256: str | None
    index: int | None = None
    start: int | None = None
    loss_mask: np.ndarray | None = None  # uint8, like ids (conversations and records): 1 where the loss is taken

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, index: int) -> np.ndarray:
        return self.ids[self.offsets[index] : self.offsets[index + 1]]

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(np.asarray(self.offsets))

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    def to_list(self) -> list[np.ndarray]:
        return wire.split_ragged(self.ids, self.offsets)

    def masked_list(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """(ids, loss_mask) of each sequence: conversations' and records' answers."""
        if self.loss_mask is None:
            raise ValueError("this batch has no loss mask: it is the answer to texts, not conversations or records")
        return list(zip(self.to_list(), wire.split_ragged(self.loss_mask, self.offsets), strict=True))

    def pin_memory(self) -> TokenizedBatch:
        """The batch as pinned torch tensors (what DataLoader(pin_memory=True) calls); needs an accelerator."""
        return self._to_torch(pin_memory=True)

    def _to_torch(self, pin_memory: bool) -> TokenizedBatch:
        """The same batch with torch tensors in place of its arrays (int32 ids, int64 offsets, uint8 loss_mask)."""
        if self.loss_mask is None:
            ids, offsets = tensors([self.ids, self.offsets], pin_memory)
            return replace(self, ids=ids, offsets=offsets)
        ids, offsets, loss_mask = tensors([self.ids, self.offsets, self.loss_mask], pin_memory)
        return replace(self, ids=ids, offsets=offsets, loss_mask=loss_mask)


@dataclass(frozen=True)
class PackedBatch:
    """Fixed-length training rows from /v1/pack, as numpy arrays.

    ``leftover`` is the tail of the token stream that did not fill a row (concat only): pass it as
    ``carry``, and ``leftover_document_starts`` as ``carry_document_starts``, to the next pack call so
    that no token is lost or repeated and every document start stays a segment start (conversations and records:
    ``leftover_loss_mask`` as ``carry_loss_mask``, so that no token's mask is lost). From a prefetcher,
    ``index`` is the batch's number in the stream and ``start`` the stream index of the first text
    with tokens in it (concat) or of the first text of the request its first row came from (best_fit).
    """

    input_ids: np.ndarray  # [rows, seq_len] int32
    labels: np.ndarray  # [rows, seq_len] int32, -100 where no loss is taken
    position_ids: np.ndarray  # [rows, seq_len] int32
    cu_seqlens: list[np.ndarray]  # per row: [0, end of segment 1, ..., start of padding]
    leftover: np.ndarray  # int32
    stats: dict[str, Any]
    model: str
    seq_len: int
    strategy: str
    model_sha256: str | None
    index: int | None = None
    start: int | None = None
    leftover_document_starts: np.ndarray = field(default_factory=lambda: np.empty(0, np.int32))
    leftover_loss_mask: np.ndarray | None = None  # uint8, the leftover's loss mask (conversations and records)

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_tokens(self) -> int:
        """Tokens in the rows that are not padding."""
        return int(sum(int(row[-1]) for row in self.cu_seqlens))

    def pin_memory(self) -> PackedBatch:
        """The batch as pinned torch tensors (what DataLoader(pin_memory=True) calls); needs an accelerator."""
        return self._to_torch(pin_memory=True)

    def _to_torch(self, pin_memory: bool) -> PackedBatch:
        """The same batch with int32 torch tensors in place of its rows and cu_seqlens (and leftover, never pinned)."""
        input_ids, labels, position_ids, *cu_seqlens = tensors(
            [self.input_ids, self.labels, self.position_ids, *self.cu_seqlens], pin_memory
        )
        (leftover,) = tensors([self.leftover], pin_memory=False)
        leftover_loss_mask = self.leftover_loss_mask
        if leftover_loss_mask is not None:
            (leftover_loss_mask,) = tensors([leftover_loss_mask], pin_memory=False)
        return replace(
            self,
            input_ids=input_ids,
            labels=labels,
            position_ids=position_ids,
            cu_seqlens=cu_seqlens,
            leftover=leftover,
            leftover_loss_mask=leftover_loss_mask,
        )


Batch = TokenizedBatch | PackedBatch
