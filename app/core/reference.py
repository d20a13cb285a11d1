"""Each library called in-process as its users call it: the baselines of tokenizer-bench and bench/.

`InProcess(files, threads)` holds the model in its own library (never fastokens) and offers the two
ways a training script tokenizes: one text at a time (`one`), and the library's batch call on
`threads` threads (`batch`), with the same ids the service gives (special-token strings as text).
"""

from __future__ import annotations

import os
from typing import Any

from tokenizer_service.core.models import SENTENCEPIECE, TEKKEN, TIKTOKEN, TOKENIZERS, ModelFiles


class InProcess:
    """A model in its reference library, in this process."""

    def __init__(self, files: ModelFiles, threads: int) -> None:
        # a tekken.json is a tiktoken encoding (mistral-common's Tekkenizer.encode is tiktoken's encode)
        self.library = TIKTOKEN if files.library == TEKKEN else files.library
        self.threads = threads
        if files.library == TOKENIZERS:
            # Rayon reads its thread count once, when tokenizers first encodes a batch in this process.
            os.environ.setdefault("RAYON_NUM_THREADS", str(threads))
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        from tokenizer_service.core import libraries

        library = libraries.load(files, libraries.REFERENCE)
        self.model = library
        if isinstance(library, libraries.HuggingFace):
            self.tokenizer = library.reference
            self.tokenizer.encode_special_tokens = True
        elif isinstance(library, libraries.Tiktoken | libraries.Tekken):
            self.encoding = library.reference
        elif isinstance(library, libraries.SentencePiece):
            self.processor = library.processor

    @property
    def batch_call(self) -> str:
        """The batch call, as a user writes it."""
        return {
            SENTENCEPIECE: f"sp.encode(docs, num_threads={self.threads})",
            TOKENIZERS: f"tok.encode_batch(docs), {os.environ.get('RAYON_NUM_THREADS')} Rayon threads",
            TIKTOKEN: f"enc.encode_ordinary_batch(docs, num_threads={self.threads})",
        }[self.library]

    @property
    def one_call(self) -> str:
        return {
            SENTENCEPIECE: "for text in docs: sp.encode(text)",
            TOKENIZERS: "for text in docs: tok.encode(text)",
            TIKTOKEN: "for text in docs: enc.encode_ordinary(text)",
        }[self.library]

    def one(self, text: str) -> list[int]:
        if self.library == TOKENIZERS:
            return list(self.tokenizer.encode(text, add_special_tokens=False).ids)
        if self.library == TIKTOKEN:
            return list(self.encoding.encode_ordinary(text))
        return list(self.processor.encode(text))

    def batch(self, texts: list[str]) -> list[Any]:
        """Each text's ids (lists, or numpy arrays where the library hands them out)."""
        if self.library == TOKENIZERS:
            return [encoding.ids for encoding in self.tokenizer.encode_batch(texts, add_special_tokens=False)]
        if self.library == TIKTOKEN:
            return list(self.encoding.encode_ordinary_batch(texts, num_threads=self.threads))
        return list(self.processor.encode(texts, num_threads=self.threads, out_type="numpy"))

    def tokens(self, texts: list[str]) -> int:
        return int(sum(len(ids) for ids in self.batch(texts)))
