"""Client of tokenizer-service; needs only numpy and httpx."""

from client._client import TokenizedBatch, TokenizerClient
from client.errors import (
    ModelMismatchError,
    TokenizerConnectionError,
    TokenizerError,
    TokenizerProtocolError,
    TokenizerServiceError,
)

__all__ = [
    "ModelMismatchError",
    "TokenizedBatch",
    "TokenizerClient",
    "TokenizerConnectionError",
    "TokenizerError",
    "TokenizerProtocolError",
    "TokenizerServiceError",
]
