"""Where the service is: the default base URL, and one or several base URLs read from what a user wrote.

Public: ``parse_urls`` is what the client's constructors and the service's own tools (tokenizer-bench,
tokenizer-pretokenize) read a ``--url`` option with.
"""

from __future__ import annotations

from collections.abc import Sequence

import httpx

__all__ = ["DEFAULT_URL", "check_url", "parse_urls"]

DEFAULT_URL = "http://127.0.0.1:8000"


def parse_urls(url: str | Sequence[str]) -> tuple[str, ...]:
    """One base URL, a comma-separated list of them, or a sequence of them; trailing slashes dropped."""
    items = url.split(",") if isinstance(url, str) else list(url)
    urls = tuple(check_url(item.strip().rstrip("/")) for item in items if item and item.strip())
    if not urls:
        raise ValueError("at least one server URL is needed")
    return urls


def check_url(url: str) -> str:
    """`url` if it starts with http:// or https://; a ValueError that suggests the fix if not.

    A URL without a scheme would be read by httpx as a scheme of its own.
    """
    try:
        scheme = httpx.URL(url).scheme
    except httpx.InvalidURL as exc:
        raise ValueError(f"url {url!r} is not a URL: {exc}") from None
    if scheme not in ("http", "https"):
        if "://" in url:  # another scheme (ftp://, grpc://): the service speaks HTTP only
            raise ValueError(f"url {url!r} is not http:// or https://: the service speaks HTTP")
        raise ValueError(f"url {url!r} has no http:// or https:// in front: did you mean 'http://{url}'?")
    return url
