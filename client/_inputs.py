"""Arguments Python would accept that mean something else: refused before any request is made.

A ``str`` is a sequence of one-character strings, so ``tokenize("some text")`` would tokenize each
character as its own text; a flat list of ids given to ``detokenize`` is one text, not many (a URL
without a scheme: tokenizer_client.urls). These checks look at the container only
(constant time): what is inside each text is the server's to check, with the text's index.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence
from typing import Any, cast

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


def integer(value: object, name: str, *, minimum: int | None = None) -> int:
    """`value` as a Python int (an int or numpy integer); a float (even 64.0), bool or str is refused naming `name`."""
    if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Integral):
        if isinstance(value, numbers.Real):
            raise ValueError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
        raise TypeError(f"{name} must be an integer, not {type(value).__name__} {value!r:.80}")
    number = int(value)
    if minimum is not None and number < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {number}")
    return number


def optional_integer(value: object, name: str, *, minimum: int | None = None) -> int | None:
    return None if value is None else integer(value, name, minimum=minimum)


def flag(value: object, name: str) -> bool:
    """`value` as a Python bool: a bool, a numpy bool, or the integer 0 or 1; else a TypeError naming `name`."""
    if isinstance(value, bool | np.bool_) or (isinstance(value, numbers.Integral) and value in (0, 1)):
        return bool(value)
    raise TypeError(f"{name} must be True or False, not {type(value).__name__} {value!r:.80}")


def set_integer(instance: object, name: str, minimum: int) -> None:
    """The named attribute of a frozen dataclass `instance` as a Python int of at least `minimum` (see `integer`)."""
    object.__setattr__(instance, name, integer(getattr(instance, name), name, minimum=minimum))


def set_flags(instance: object, *names: str) -> None:
    """Each named attribute of a frozen dataclass `instance` as a Python bool (see `flag`), set in place."""
    for name in names:
        object.__setattr__(instance, name, flag(getattr(instance, name), name))


def plain(value: Any) -> Any:
    """`value` with numpy scalars and arrays inside dicts and lists turned into Python values (for JSON)."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, dict):
        return {key: plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [plain(item) for item in value]
    return value


def id_list(row: object, name: str) -> list[int]:
    """One sequence of ids as Python ints: from a list, a tuple, any iterable or a numpy array of integers.

    A float id (1.7, or 1.0), a bool or a str is refused naming `name` and the position.
    """
    array = (
        row
        if isinstance(row, np.ndarray)
        else np.asarray(list(cast(Iterable[Any], row)) if not isinstance(row, list) else row)
    )
    if array.size == 0:
        return []
    if array.ndim != 1:
        raise TypeError(f"{name} must be one sequence of ids, not a {array.ndim}-D array")
    if array.dtype.kind in "iu":
        values: list[int] = array.tolist()
        return values
    if array.dtype.kind == "O" and all(type(item) is int for item in array.tolist()):
        return array.tolist()  # type: ignore[no-any-return]  # ints beyond int64: the server says which
    for position, item in enumerate(array.tolist()):
        if isinstance(item, bool) or not isinstance(item, int):
            kind = "a float" if isinstance(item, float) else f"a {type(item).__name__}"
            raise ValueError(f"{name}[{position}] is {kind} ({item!r:.40}): ids are integers")
    raise ValueError(f"{name} holds values that are not integer ids")


def id_rows(ids: Sequence[Sequence[int]] | Sequence[np.ndarray] | np.ndarray) -> list[list[int]]:
    """`ids` as a list of rows, one a text; a flat sequence of ids is a TypeError naming the fix."""
    if isinstance(ids, np.ndarray) and ids.dtype != object:
        if ids.ndim == 1 and ids.size == 0:
            return []
        if ids.ndim != 2:
            raise TypeError(f"ids must hold one sequence of ids per text; a {ids.ndim}-D array does not: {ONE_ROW}")
        if ids.dtype.kind not in "iu":
            raise ValueError(f"ids must be integers, not an array of {ids.dtype}")
        rows: list[list[int]] = ids.tolist()
        return rows
    if isinstance(ids, str | bytes | bytearray | dict):
        raise TypeError(f"ids must be a list of id sequences, one per text, not a {type(ids).__name__}")
    out = []
    for index, row in enumerate(ids):
        if isinstance(row, int | np.integer):
            raise TypeError(f"ids must be a list of id sequences, one per text; ids[{index}] is one id: {ONE_ROW}")
        elif isinstance(row, str | bytes):
            raise TypeError(f"ids must be a list of id sequences; ids[{index}] is a {type(row).__name__}")
        else:
            out.append(id_list(row, f"ids[{index}]"))
    return out
