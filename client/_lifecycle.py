"""Open until closed: the context-manager halves every closable object of the client shares.

A class with ``close()`` (or ``aclose()``) gets ``with`` (or ``async with``) from here, written once.
"""

from __future__ import annotations

from typing import TypeVar

C = TypeVar("C", bound="Closing")
A = TypeVar("A", bound="AsyncClosing")


class Closing:
    """``with obj:`` calls ``obj.close()`` at the end of the block."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self: C) -> C:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class AsyncClosing:
    """``async with obj:`` awaits ``obj.aclose()`` at the end of the block."""

    async def aclose(self) -> None:
        raise NotImplementedError

    async def __aenter__(self: A) -> A:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
