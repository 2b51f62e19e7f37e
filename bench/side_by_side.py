"""Run stablewatch's observer and a naive poller side by side, as the phantom benchmarks do."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

__all__ = ["watch_side_by_side"]


async def watch_side_by_side(
    observe: Callable[[asyncio.Event], Awaitable[object]],
    poll: Callable[[asyncio.Event], Awaitable[object]],
    max_seconds: float,
) -> tuple[bool, float]:
    """Run ``observe(done)`` and ``poll(stop)`` until the observer sets ``done``, ``max_seconds``
    pass, or either fails; then stop the poller (it finishes its round) and cancel the observer.

    Returns whether the observer finished, and the ``time.monotonic()`` at which watching ended.
    An error of either is raised after both are stopped.
    """
    done, stop = asyncio.Event(), asyncio.Event()
    observer = asyncio.ensure_future(observe(done))
    naive = asyncio.ensure_future(poll(stop))
    waiting = asyncio.ensure_future(done.wait())
    try:
        await asyncio.wait({waiting, observer, naive}, timeout=max_seconds, return_when=asyncio.FIRST_COMPLETED)
    finally:
        ended = time.monotonic()
        finished = done.is_set()
        waiting.cancel()
        stop.set()
        try:
            await asyncio.wait_for(naive, 30)
        finally:
            observer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await observer
    return finished, ended
