"""Train the bundled default model, app/models/default.model, from the public-domain text in the repo.

    python scripts/train_default_model.py

Botchan (Natsume Soseki, English translation; Project Gutenberg #8868, public domain), a unigram
model of 4,000 pieces with byte fallback so that any Unicode text round-trips. Small enough to
ship (about 300 KB) and trained in under a second; real deployments serve their own models.
"""

from __future__ import annotations

from pathlib import Path

import sentencepiece as spm

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "tests" / "data" / "botchan.txt"
OUTPUT = ROOT / "app" / "models" / "default"

TRAINER_OPTIONS = {
    "model_type": "unigram",
    "vocab_size": 4000,
    "character_coverage": 1.0,
    "byte_fallback": True,
    "num_threads": 1,
    "minloglevel": 2,
}


def main() -> None:
    OUTPUT.parent.mkdir(parents=True, exist_ok=True)
    spm.SentencePieceTrainer.train(input=str(CORPUS), model_prefix=str(OUTPUT), **TRAINER_OPTIONS)
    OUTPUT.with_suffix(".vocab").unlink()
    print(f"wrote {OUTPUT.with_suffix('.model')}")


if __name__ == "__main__":
    main()
