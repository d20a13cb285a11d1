"""The serving core: models and their tokenizer libraries, request parsing, the worker protocol, the worker
processes and the pool that feeds them. No HTTP here (tests/test_layers.py holds the rule)."""
