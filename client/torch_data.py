"""TokenizedIterableDataset: a text stream tokenized by tokenizer-service, for torch's DataLoader.

Importing this module imports torch; ``import client`` does not.

::

    dataset = TokenizedIterableDataset(lambda: open("corpus.txt"), "http://tokenizer:8000",
                                       batch_size=64, pack=PackSpec(seq_len=2048, rows=8))
    loader = DataLoader(dataset, batch_size=None, num_workers=4, pin_memory=True)

The dataset yields whole batches (hence ``batch_size=None``). Worker k of n takes blocks k, k + n,
k + 2n, ... of ``batch_size`` texts, so no text goes to two workers. In ragged mode DataLoader, which
takes batches from its workers in turn, then hands out exactly the batches of a single prefetcher,
in stream order. Each worker opens its own TokenizerClient and prefetcher. Pin with
``DataLoader(pin_memory=True)``: pinned memory made in a worker process does not survive the trip
to the main process. Resuming from a saved state is not supported here; use ``client.prefetch``.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch.utils.data

from tokenizer_client.batches import PackedBatch, TokenizedBatch
from tokenizer_client.clients import TokenizerClient

__all__ = ["TokenizedIterableDataset", "shard_blocks"]


def shard_blocks(texts: Iterable[str], block: int, worker: int, workers: int) -> Iterator[str]:
    """Texts of blocks ``worker, worker + workers, ...`` of ``block`` texts each (all of them for one worker)."""
    if workers == 1:
        yield from texts
        return
    iterator = iter(texts)
    for number in itertools.count():
        chunk = list(itertools.islice(iterator, block))
        if not chunk:
            return
        if number % workers == worker:
            yield from chunk


def global_text_index(position: int, block: int, worker: int, workers: int) -> int:
    """Stream index of the text at `position` in a worker's shard."""
    return ((position // block) * workers + worker) * block + position % block


class TokenizedIterableDataset(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """Batches of tokenized texts, sharded over DataLoader workers; see the module docstring.

    ``texts`` is a callable that returns a fresh iterable (safest: each worker calls it), or an
    iterable that can be iterated again in each worker (a list; a generator only with fork).
    ``prefetch_options`` are those of ``TokenizerClient.prefetch`` (``model``, ``add_eos``, ``pack``,
    ``depth``, ...); batches are torch tensors. With n workers, ``index`` and ``start`` of each batch
    are numbered as in the whole stream (ragged mode; for packing, ``index`` only).
    """

    def __init__(
        self,
        texts: Callable[[], Iterable[str]] | Iterable[str],
        url: str | Sequence[str],
        *,
        batch_size: int = 64,
        api_key: str | None = None,
        timeout: float = 60.0,
        **prefetch_options: Any,
    ) -> None:
        super().__init__()
        for option in ("as_torch", "state", "texts"):
            if option in prefetch_options:
                raise ValueError(f"{option}= is decided by the dataset")
        if prefetch_options.get("pin_memory"):
            raise ValueError("pin with DataLoader(pin_memory=True): pinned memory does not cross processes")
        self.texts = texts
        self.url = url
        self.batch_size = batch_size
        self.api_key = api_key
        self.timeout = timeout
        self.prefetch_options = prefetch_options

    def __iter__(self) -> Iterator[TokenizedBatch | PackedBatch]:
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        texts = self.texts() if callable(self.texts) else self.texts
        shard = shard_blocks(texts, self.batch_size, worker, workers)
        with (
            TokenizerClient(self.url, api_key=self.api_key, timeout=self.timeout) as client,
            client.prefetch(shard, batch_size=self.batch_size, as_torch=True, **self.prefetch_options) as batches,
        ):
            for batch in batches:
                yield self._renumber(batch, worker, workers)

    def _renumber(self, batch: TokenizedBatch | PackedBatch, worker: int, workers: int) -> TokenizedBatch | PackedBatch:
        if workers == 1 or batch.index is None:
            return batch
        index = batch.index * workers + worker
        if isinstance(batch, TokenizedBatch) and batch.start is not None:
            return dataclasses.replace(
                batch, index=index, start=global_text_index(batch.start, self.batch_size, worker, workers)
            )
        return dataclasses.replace(batch, index=index, start=None)
