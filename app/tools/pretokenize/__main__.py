"""`python -m app.tools.pretokenize`: the same as `tokenizer-pretokenize`."""

from app.entry import pretokenize

if __name__ == "__main__":
    pretokenize()
