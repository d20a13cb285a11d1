"""Client of tokenizer-service; needs only numpy and httpx (torch only for as_torch and client.torch_data)."""

from client._async import AsyncTokenizerClient
from client._client import TokenizerClient
from client._protocol import PackedBatch, TokenizedBatch
from client._retry import RetryPolicy
from client.errors import (
    ModelMismatchError,
    PrefetchError,
    TokenizerConnectionError,
    TokenizerError,
    TokenizerProtocolError,
    TokenizerServiceError,
)
from client.prefetch import AsyncPrefetcher, PackSpec, Prefetcher, PrefetchStats

__all__ = [
    "AsyncPrefetcher",
    "AsyncTokenizerClient",
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
    """TokenizedIterableDataset on first use only: it imports torch. Mixture and TokenDataset on first use too."""
    if name == "TokenizedIterableDataset":
        from client.torch_data import TokenizedIterableDataset

        return TokenizedIterableDataset
    if name == "Mixture":
        from client.mixture import Mixture

        return Mixture
    if name == "TokenDataset":
        from client.dataset import TokenDataset

        return TokenDataset
    raise AttributeError(f"module 'client' has no attribute {name!r}")
