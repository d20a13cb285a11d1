"""TokenizedIterableDataset: a text stream tokenized by tokenizer-service, for torch's DataLoader.

Importing this module imports torch; ``import client`` does not.

::

    dataset = TokenizedIterableDataset(lambda: open("corpus.txt"), "http://tokenizer:8000",
                                       batch_size=64, pack=PackSpec(seq_len=2048, rows=8))
    loader = DataLoader(dataset, batch_size=None, num_workers=4, pin_memory=True)

The dataset yields whole batches (hence ``batch_size=None``; a DataLoader left at its default
``batch_size=1`` is told so in one line instead of failing in ``default_collate``). In ragged mode
worker k of n takes blocks k, k + n, k + 2n, ... of ``batch_size`` texts, so no text goes to two
workers, and DataLoader, which takes batches from its workers in turn, hands out exactly the batches
of a single prefetcher, in stream order. Packed rows run across documents and requests (concat
carries tokens from one request into the next; best_fit regroups the rows of several requests), so
a worker packing its own share of the texts would give other rows: in packed mode worker 0 packs the
whole stream and the other workers end at once, so any ``num_workers`` gives the rows of
``num_workers=0`` (the server does the tokenizing; ``depth`` requests are in flight either way).
Each worker opens its own TokenizerClient and prefetcher. Pin with ``DataLoader(pin_memory=True)``:
pinned memory made in a worker process does not survive the trip to the main process.

``state_dict``/``load_state_dict`` follow torchdata's Stateful protocol: with ``StatefulDataLoader``
(the same ``num_workers``) a run resumed from its ``state_dict()`` hands out exactly the batches an
uninterrupted run would have. Each worker's state is its prefetcher's (see ``client.prefetch``), so
``texts`` must give the same stream again, which the resumed prefetcher checks.

``texts`` may give conversations (lists of OpenAI messages) or ``{"prompt", "completion"}`` records instead, as
``client.prefetch`` takes them (detected from the first item, or ``conversations=True``/``records=True``; ``train_on``
passes through): ragged batches then carry ``loss_mask``, packed rows' ``labels`` are -100 wherever it is 0.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch.utils.data
from torch.utils.data._utils.collate import default_collate_fn_map

from tokenizer_client.batches import PackedBatch, TokenizedBatch
from tokenizer_client.clients import TokenizerClient
from tokenizer_client.prefetch import Prefetcher

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


STATE_FORMAT = "tokenizer-iterable-dataset"
STATE_VERSION = 1


def _whole_batches(batch: Any, *, collate_fn_map: Any = None) -> Any:
    """DataLoader's default_collate, met with the dataset's batches: its batch_size was not None."""
    raise TypeError(
        f"TokenizedIterableDataset yields whole batches ({type(batch[0]).__name__}), which DataLoader cannot batch "
        "again: build it with batch_size=None, e.g. DataLoader(dataset, batch_size=None, num_workers=1)"
    )


# The torch docs' way to extend default_collate; it only changes what these types met, a TypeError either way.
for _type in (TokenizedBatch, PackedBatch):
    default_collate_fn_map.setdefault(_type, _whole_batches)


def _worker() -> tuple[int, int]:
    """This DataLoader worker's id and the number of workers; (0, 1) in the main process."""
    info = torch.utils.data.get_worker_info()
    return (info.id, info.num_workers) if info is not None else (0, 1)


class TokenizedIterableDataset(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """Batches of tokenized texts, sharded over DataLoader workers; see the module docstring.

    ``texts`` is a callable that returns a fresh iterable (safest: each worker calls it), or an
    iterable that can be iterated again in each worker (a list; a generator only with fork).
    ``prefetch_options`` are those of ``TokenizerClient.prefetch`` (``model``, ``add_eos``, ``pack``,
    ``depth``, ...); batches are torch tensors. With n workers, ``index`` and ``start`` of each batch
    are numbered as in the whole stream (ragged mode; packed, worker 0 makes every batch).
    ``state_dict()``/``load_state_dict()``: where this worker's stream stands, for torchdata's
    ``StatefulDataLoader`` (the same ``num_workers``): a resumed run continues with exactly the next batch.
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
        self._loaded: dict[str, Any] | None = None  # a state load_state_dict gave, for the next iteration
        self._prefetcher: Prefetcher | None = None  # the iteration under way (or that ended)

    @property
    def packed(self) -> bool:
        return self.prefetch_options.get("pack") is not None

    def state_dict(self) -> dict[str, Any]:
        """This worker's position: after the last batch it handed out (JSON-able)."""
        worker, workers = _worker()
        if self._prefetcher is not None:
            prefetch = self._prefetcher.state_dict()
        else:  # before the iteration starts: the state loaded, or the stream's start
            prefetch = None if self._loaded is None else self._loaded["prefetch"]
        return {
            "format": STATE_FORMAT,
            "version": STATE_VERSION,
            "worker": worker,
            "workers": workers,
            "prefetch": prefetch,
        }

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """The next iteration resumes where `state` (from ``state_dict()``, in the same worker) stopped."""
        if state is not None and (state.get("format") != STATE_FORMAT or state.get("version") != STATE_VERSION):
            raise ValueError(f"not a TokenizedIterableDataset state of version {STATE_VERSION}: {state!r:.200}")
        self._loaded, self._prefetcher = (None if state is None else dict(state)), None

    def __getstate__(self) -> dict[str, Any]:
        """What a worker started by spawn gets: everything but an iteration under way in this process."""
        return {**self.__dict__, "_prefetcher": None}

    def _resume_from(self, worker: int, workers: int) -> dict[str, Any] | None:
        """The prefetch state this worker resumes from (once: a later iteration starts the stream again)."""
        state, self._loaded = self._loaded, None
        if state is None:
            return None
        if not self.packed and (state["worker"], state["workers"]) != (worker, workers):
            raise ValueError(
                f"the state was saved by DataLoader worker {state['worker']} of {state['workers']}, this is "
                f"worker {worker} of {workers}: resume with the num_workers the state was saved with"
            )
        return state["prefetch"] if state["worker"] == worker else None

    def __iter__(self) -> Iterator[TokenizedBatch | PackedBatch]:
        worker, workers = _worker()
        state = self._resume_from(worker, workers)
        self._prefetcher = None
        if self.packed:
            if worker > 0:  # rows run across documents and requests: worker 0 packs the whole stream
                return
            workers = 1
        texts = self.texts() if callable(self.texts) else self.texts
        shard = shard_blocks(texts, self.batch_size, worker, workers)
        with (
            TokenizerClient(self.url, api_key=self.api_key, timeout=self.timeout) as client,
            client.prefetch(
                shard, batch_size=self.batch_size, as_torch=True, state=state, **self.prefetch_options
            ) as batches,
        ):
            self._prefetcher = batches
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
