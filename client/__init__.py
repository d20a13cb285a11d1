"""Client of tokenizer-service; needs only numpy and httpx (torch only for as_torch and tokenizer_client.torch_data).

Every public name is loaded on first use (PEP 562 module ``__getattr__``): ``import tokenizer_client`` and
``import tokenizer_client.dataset`` cost numpy at most, and httpx is imported only once a client, a batch
type or an error class is asked for (tests/test_hardening_client.py holds this).
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what the lazy attributes are, for type checkers and IDEs
    from tokenizer_client._retry import RetryPolicy
    from tokenizer_client.batches import PackedBatch, TokenizedBatch
    from tokenizer_client.clients import AsyncTokenizerClient, TokenizerClient
    from tokenizer_client.dataset import TokenDataset
    from tokenizer_client.errors import (
        MalformedAnswerError,
        ModelMismatchError,
        PrefetchError,
        TokenizerConnectionError,
        TokenizerError,
        TokenizerProtocolError,
        TokenizerServiceError,
    )
    from tokenizer_client.mixture import Mixture
    from tokenizer_client.prefetch import AsyncPrefetcher, PackSpec, Prefetcher, PrefetchStats

# public name -> the module that defines it
_LAZY = {
    "AsyncPrefetcher": "tokenizer_client.prefetch",
    "AsyncTokenizerClient": "tokenizer_client.clients",
    "MalformedAnswerError": "tokenizer_client.errors",
    "Mixture": "tokenizer_client.mixture",
    "ModelMismatchError": "tokenizer_client.errors",
    "PackSpec": "tokenizer_client.prefetch",
    "PackedBatch": "tokenizer_client.batches",
    "PrefetchError": "tokenizer_client.errors",
    "PrefetchStats": "tokenizer_client.prefetch",
    "Prefetcher": "tokenizer_client.prefetch",
    "RetryPolicy": "tokenizer_client._retry",
    "TokenDataset": "tokenizer_client.dataset",
    "TokenizedBatch": "tokenizer_client.batches",
    "TokenizedIterableDataset": "tokenizer_client.torch_data",  # imports torch
    "TokenizerClient": "tokenizer_client.clients",
    "TokenizerConnectionError": "tokenizer_client.errors",
    "TokenizerError": "tokenizer_client.errors",
    "TokenizerProtocolError": "tokenizer_client.errors",
    "TokenizerServiceError": "tokenizer_client.errors",
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
        raise AttributeError(f"module 'tokenizer_client' has no attribute {name!r}")
    value = getattr(_load(module), name)
    if name != "TokenizedIterableDataset":
        globals()[name] = value  # the next lookup is an ordinary attribute
    return value


def _load(module: str) -> ModuleType:
    """The module, imported now (written out, so that the imports stay visible to tools and tests)."""
    if module == "tokenizer_client.batches":
        import tokenizer_client.batches
    elif module == "tokenizer_client.clients":
        import tokenizer_client.clients
    elif module == "tokenizer_client._retry":
        import tokenizer_client._retry
    elif module == "tokenizer_client.dataset":
        import tokenizer_client.dataset
    elif module == "tokenizer_client.errors":
        import tokenizer_client.errors
    elif module == "tokenizer_client.mixture":
        import tokenizer_client.mixture
    elif module == "tokenizer_client.prefetch":
        import tokenizer_client.prefetch
    else:
        import tokenizer_client.torch_data  # noqa: F401 - each branch imports for sys.modules
    return sys.modules[module]


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
