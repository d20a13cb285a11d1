"""Client of tokenizer-service; needs only numpy and httpx."""

from client._client import PackedBatch, TokenizedBatch, TokenizerClient
from client.errors import (
    ModelMismatchError,
    TokenizerConnectionError,
    TokenizerError,
    TokenizerProtocolError,
    TokenizerServiceError,
)

__all__ = [
    "ModelMismatchError",
    "PackedBatch",
    "TokenizedBatch",
    "TokenizerClient",
    "TokenizerConnectionError",
    "TokenizerError",
    "TokenizerProtocolError",
    "TokenizerServiceError",
]
