"""JSON in and out of the client: orjson when it is installed, else the stdlib (the client needs neither)."""

from __future__ import annotations

import json
from typing import Any

try:
    import orjson
except ImportError:  # the client works with numpy and httpx alone
    orjson = None  # type: ignore[assignment]


def dumps(document: Any) -> bytes:
    if orjson is not None:
        try:
            return orjson.dumps(document)
        except TypeError:
            pass  # e.g. a lone surrogate: let the stdlib escape it and the server say which text
    try:
        return json.dumps(document).encode()
    except TypeError:
        _explain_unserializable(document)
        raise


def _explain_unserializable(document: Any) -> None:
    """A TypeError naming the text that is not a str (a bytes text most likely), if that is what failed."""
    texts = document.get("texts") if isinstance(document, dict) else None
    if not isinstance(texts, list):
        return
    for index, text in enumerate(texts):
        if isinstance(text, bytes | bytearray | memoryview):
            raise TypeError(
                f"texts[{index}] is {type(text).__name__}, not str: decode it first, e.g. text.decode('utf-8')"
            ) from None
        if not isinstance(text, str):
            raise TypeError(f"texts[{index}] is a {type(text).__name__}, not a str") from None


def loads(content: bytes) -> Any:
    return orjson.loads(content) if orjson is not None else json.loads(content)
