"""`python -m tokenizer_service`: the same as `tokenizer-server`."""

from tokenizer_service.entry import server

if __name__ == "__main__":
    server()
