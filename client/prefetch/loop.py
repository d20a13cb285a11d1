"""An event loop on a daemon thread of its own: coroutines submitted from other threads, and a clean stop.

Prefetcher runs its requests here, so that they go on while the thread that calls ``next()`` trains.
This module knows nothing of the client.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

STOP_TIMEOUT_S = 10.0


class LoopThread:
    """One daemon thread running one event loop, until ``close()``.

    Holds no reference to whoever owns it, so that an owner's finalizer can close it.
    """

    def __init__(self, name: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._closed = False
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
        finally:
            self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            self._loop.close()

    def submit(self, coroutine: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run `coroutine` on the loop; its outcome, for any thread to wait on (or to cancel it by)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)

    def close(self, cleanup: Callable[[], Coroutine[Any, Any, None]] | None = None) -> None:
        """Await `cleanup()` on the loop, cancel every task left there, stop the loop and join the thread.

        Called on the loop thread itself (a finalizer run there by garbage collection), it cannot wait
        for all that: it schedules it and returns.
        """
        if self._closed:
            return
        self._closed = True
        if not self._thread.is_alive():
            return
        if threading.current_thread() is self._thread:
            self._loop.create_task(self._shutdown(cleanup, stop=True))
            return
        try:
            self.submit(self._shutdown(cleanup, stop=False)).result(timeout=STOP_TIMEOUT_S)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=STOP_TIMEOUT_S)
        if self._thread.is_alive():
            raise RuntimeError(f"the {self._thread.name} thread did not stop within {STOP_TIMEOUT_S}s")

    async def _shutdown(self, cleanup: Callable[[], Coroutine[Any, Any, None]] | None, stop: bool) -> None:
        try:
            if cleanup is not None:
                await cleanup()
            left = asyncio.all_tasks() - {asyncio.current_task()}
            for task in left:
                task.cancel()
            await asyncio.gather(*left, return_exceptions=True)
        finally:
            if stop:
                self._loop.stop()
