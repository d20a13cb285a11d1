"""`python -m tokenizer_service.tools.pretokenize`: the same as `tokenizer-pretokenize`."""

from tokenizer_service.entry import pretokenize

if __name__ == "__main__":
    pretokenize()
