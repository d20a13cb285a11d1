"""Temporary: app/ (diagnose.py, pretokenize/run.py) still imports parse_urls from here.

parse_urls lives in client.urls; delete this module once app/ imports it from there.
"""

from __future__ import annotations

from client.urls import parse_urls

__all__ = ["parse_urls"]
