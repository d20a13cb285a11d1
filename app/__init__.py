"""tokenizer-service server: batched tokenization (SentencePiece, tokenizer.json, tiktoken, tekken.json) on a pool of
worker processes."""

__version__ = "0.1.0"
