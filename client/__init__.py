"""Client of tokenizer-service; needs only numpy and httpx (torch only for as_torch and client.torch_data).

Every public name is loaded on first use (PEP 562 module ``__getattr__``): ``import client`` and
``import client.dataset`` cost numpy at most, and httpx is imported only once a client, a batch
type or an error class is asked for (tests/test_hardening_client.py holds this).
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what the lazy attributes are, for type checkers and IDEs
    from client._retry import RetryPolicy
    from client.batches import PackedBatch, TokenizedBatch
    from client.clients import AsyncTokenizerClient, TokenizerClient
    from client.dataset import TokenDataset
    from client.errors import (
        MalformedAnswerError,
        ModelMismatchError,
        PrefetchError,
        TokenizerConnectionError,
        TokenizerError,
        TokenizerProtocolError,
        TokenizerServiceError,
    )
    from client.mixture import Mixture
    from client.prefetch import AsyncPrefetcher, PackSpec, Prefetcher, PrefetchStats

# public name -> the module that defines it
_LAZY = {
    "AsyncPrefetcher": "client.prefetch",
    "AsyncTokenizerClient": "client.clients",
    "MalformedAnswerError": "client.errors",
    "Mixture": "client.mixture",
    "ModelMismatchError": "client.errors",
    "PackSpec": "client.prefetch",
    "PackedBatch": "client.batches",
    "PrefetchError": "client.errors",
    "PrefetchStats": "client.prefetch",
    "Prefetcher": "client.prefetch",
    "RetryPolicy": "client._retry",
    "TokenDataset": "client.dataset",
    "TokenizedBatch": "client.batches",
    "TokenizedIterableDataset": "client.torch_data",  # imports torch
    "TokenizerClient": "client.clients",
    "TokenizerConnectionError": "client.errors",
    "TokenizerError": "client.errors",
    "TokenizerProtocolError": "client.errors",
    "TokenizerServiceError": "client.errors",
}

__all__ = [
    "AsyncPrefetcher",
    "AsyncTokenizerClient",
    "MalformedAnswerError",
    "Mixture",
    "ModelMismatchError",
    "PackSpec",
    "PackedBatch",
    "PrefetchError",
    "PrefetchStats",
    "Prefetcher",
    "RetryPolicy",
    "TokenDataset",
    "TokenizedBatch",
    "TokenizerClient",
    "TokenizerConnectionError",
    "TokenizerError",
    "TokenizerProtocolError",
    "TokenizerServiceError",
]


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'client' has no attribute {name!r}")
    value = getattr(_load(module), name)
    if name != "TokenizedIterableDataset":
        globals()[name] = value  # the next lookup is an ordinary attribute
    return value


def _load(module: str) -> ModuleType:
    """The module, imported now (written out, so that the imports stay visible to tools and tests)."""
    if module == "client.batches":
        import client.batches
    elif module == "client.clients":
        import client.clients
    elif module == "client._retry":
        import client._retry
    elif module == "client.dataset":
        import client.dataset
    elif module == "client.errors":
        import client.errors
    elif module == "client.mixture":
        import client.mixture
    elif module == "client.prefetch":
        import client.prefetch
    else:
        import client.torch_data  # noqa: F401 - each branch imports for sys.modules
    return sys.modules[module]


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
