"""Offline tools over the serving core: the pre-tokenizer and shard tools, tokenizer-bench, a server launcher."""
