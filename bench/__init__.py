"""Benchmarks (not tests): run each as `python -m bench.NAME` from the repository root."""
