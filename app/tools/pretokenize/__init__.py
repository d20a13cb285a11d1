"""tokenizer-pretokenize: tokenize a corpus once, with the service's own tokenizer and packing, into shards.

The format of the output is documented in `tokenizer_client.dataset`, which also reads it (`TokenDataset`).
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """Console entry point; imported lazily so that worker processes importing this package stay light."""
    from tokenizer_service.tools.pretokenize.cli import main as cli_main

    return cli_main(argv)


__all__ = ["main"]
