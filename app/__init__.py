"""tokenizer-service server: batched SentencePiece tokenization on a pool of worker processes."""

__version__ = "0.1.0"
