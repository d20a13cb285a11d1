"""`python -m app`: the same as `tokenizer-server`."""

from app.entry import server

if __name__ == "__main__":
    server()
