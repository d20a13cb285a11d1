"""Arguments Python would accept that mean something else: refused before any request is made.

A ``str`` is a sequence of one-character strings, so ``tokenize("some text")`` would tokenize each
character as its own text; a flat list of ids given to ``detokenize`` is one text, not many; a URL
without a scheme is read by httpx as a scheme of its own. These checks look at the container only
(constant time): what is inside each text is the server's to check, with the text's index.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import httpx
import numpy as np

ONE_TEXT = "for one text, pass [text]"
ONE_ROW = "for one text, pass [ids]"


def check_texts(texts: object) -> None:
    """TypeError unless `texts` can be many texts: a str, bytes or a mapping is one thing."""
    if isinstance(texts, str | bytes | bytearray):
        kind = type(texts).__name__
        raise TypeError(f"texts must be a list (or any iterable) of str, not a single {kind}: {ONE_TEXT}")
    if isinstance(texts, dict):
        raise TypeError("texts must be a list (or any iterable) of str, not a dict: pass its values or keys")


def texts_list(texts: Iterable[str]) -> list[str]:
    """`texts` as the list a request sends."""
    check_texts(texts)
    return texts if isinstance(texts, list) else list(texts)


def id_rows(ids: Sequence[Sequence[int]] | Sequence[np.ndarray] | np.ndarray) -> list[list[int]]:
    """`ids` as a list of rows, one a text; a flat sequence of ids is a TypeError naming the fix."""
    if isinstance(ids, np.ndarray) and ids.dtype != object:
        if ids.ndim == 1 and ids.size == 0:
            return []
        if ids.ndim != 2:
            raise TypeError(f"ids must hold one sequence of ids per text; a {ids.ndim}-D array does not: {ONE_ROW}")
        rows: list[list[int]] = ids.tolist()
        return rows
    if isinstance(ids, str | bytes | bytearray | dict):
        raise TypeError(f"ids must be a list of id sequences, one per text, not a {type(ids).__name__}")
    out = []
    for index, row in enumerate(ids):
        if isinstance(row, np.ndarray):
            out.append(row.tolist())
        elif isinstance(row, int | np.integer):
            raise TypeError(f"ids must be a list of id sequences, one per text; ids[{index}] is one id: {ONE_ROW}")
        elif isinstance(row, str | bytes):
            raise TypeError(f"ids must be a list of id sequences; ids[{index}] is a {type(row).__name__}")
        else:
            out.append(list(row))
    return out


def check_url(url: str) -> str:
    """`url` if it starts with http:// or https://; a ValueError that suggests the fix if not."""
    try:
        scheme = httpx.URL(url).scheme
    except httpx.InvalidURL as exc:
        raise ValueError(f"url {url!r} is not a URL: {exc}") from None
    if scheme not in ("http", "https"):
        raise ValueError(f"url {url!r} has no http:// or https:// in front: did you mean 'http://{url}'?")
    return url
