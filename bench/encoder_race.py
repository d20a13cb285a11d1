"""The fast encoders of one model side by side, on several kinds of text: what the gate's rule decides by.

    python -m bench.encoder_race [--model PATH] [--rounds 5]

Builds every fast encoder route of the model as the gate builds it (`libraries._build_fast`: fastokens and
gigatoken for a tokenizer.json), single-threaded as a worker runs it, then measures each route's M tokens per
CPU-second in one process, a pass of each over the same texts in turn, `--rounds` times (the order reversed every
other round), and prints the median of each and their ratio, on:

  sample        the gate's fixed speed sample (`encoders.sample_texts`: made-up words of the check set's scripts)
  vocabulary    words drawn (Zipf) from the model's own tokens, decoded, joined as the sample's words are
  multilingual  documents of the shared multilingual corpus, 1 MB and 256 KB (bench.inputs.load_documents)
  python docs   documents of the Python docs corpus, 256 KB

and the CPU seconds each route took to build. Which encoder is the faster depends on the text: this is why the
rule counts candidates within 25% of the fastest as equally fast (app/core/encoders.py, docs/operations.md).
Without --model: the 128k byte-level BPE of bench/peers.py (trained once, bench/results/).
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.inputs import MULTILINGUAL_CORPUS, RESULTS, load_documents, python_docs_corpus
from tokenizer_service.core import encoders, libraries
from tokenizer_service.core.models import find_model_files

DEFAULT_MODEL = RESULTS / "bpe-128k-debian_reference_multilingual" / "tokenizer.json"


def take(documents: Sequence[str], size: int) -> list[str]:
    """The first documents of `documents` up to `size` characters."""
    taken, total = [], 0
    for document in documents:
        if total >= size:
            break
        taken.append(document)
        total += len(document)
    return taken


def vocabulary_words(library: Any, count: int = 20_000, size: int = 256 * 1024) -> list[str]:
    """Documents of words that are the model's own tokens decoded (ids drawn uniformly, words by Zipf's law), joined
    with spaces and the sample's marks: text whose words the model holds whole."""
    generator = random.Random(20261127)
    words: list[str] = []
    while len(words) < count:
        ids = [generator.randrange(256, library.vocab_size) for _ in range(1000)]
        for word in library.decode([[token] for token in ids]):
            word = word.strip()
            if word and not any(char.isspace() for char in word) and "\ufffd" not in word:
                words.append(word)
    words = words[:count]
    weights = [1 / rank for rank in range(1, len(words) + 1)]
    documents, total = [], 0
    while total < size:
        chosen = generator.choices(words, weights, k=generator.randint(50, 400))
        document = " ".join(word + ("," if generator.random() < 0.1 else "") for word in chosen)
        documents.append(document)
        total += len(document)
    return documents


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="a tokenizer.json (default: the 128k BPE)")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    libraries.single_threaded()
    files = find_model_files("race", args.model)
    library = libraries.load(files, libraries.REFERENCE)
    built, builds = {}, {}
    for encoder in encoders.ENCODERS:
        for route in encoders.routes(library, encoder):
            started = time.process_time()
            fast, why = libraries._build_fast(library, route)
            if fast is not None:
                built[route], builds[route] = fast, time.process_time() - started
                break
            print(f"{route}: {why}")
    if len(built) < 2:
        raise SystemExit(f"fewer than two fast encoders load {args.model}: nothing to race")
    multilingual = load_documents(MULTILINGUAL_CORPUS, 4000) if MULTILINGUAL_CORPUS.exists() else []
    python_docs = load_documents(python_docs_corpus(), 2000)
    texts = {
        "the gate's sample (made-up words, 256 KB)": encoders.sample_texts(),
        "words of the model's own vocabulary, 256 KB": vocabulary_words(library),
        "multilingual documents, 1 MB": take(multilingual, 1 << 20),
        "multilingual documents, 256 KB": take(multilingual, 256 * 1024),
        "Python docs, 256 KB": take(python_docs, 256 * 1024),
    }
    routes = list(built)
    print(f"model {args.model}, {args.rounds} rounds, M tokens per CPU-second (median of passes in turn)\n")
    print(f"| text | {' | '.join(routes)} | {routes[1]} / {routes[0]} |")
    print(f"|---|{'---:|' * len(routes)}---:|")
    for name, documents in texts.items():
        if not documents:
            continue
        speeds = libraries.race(built, documents, args.rounds)  # as the gate races them
        cells = " | ".join(f"{speeds[route]:.1f}" for route in routes)
        print(f"| {name} | {cells} | {speeds[routes[1]] / speeds[routes[0]]:.2f} |", flush=True)
    print(f"| build (CPU-s) | {' | '.join(f'{builds[route]:.2f}' for route in routes)} | |")


if __name__ == "__main__":
    main()
