"""Waiting for a condition in tests: poll it with a deadline, never sleep a fixed time and hope."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

DEFAULT_TIMEOUT = 20.0  # an upper bound for slow shared machines, not an expected duration


def poll(
    condition: Callable[[], T], what: str = "the condition", timeout: float = DEFAULT_TIMEOUT, interval: float = 0.005
) -> T:
    """Return ``condition()`` once it is truthy; raise TimeoutError naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)
    return value


async def async_poll(
    condition: Callable[[], T], what: str = "the condition", timeout: float = DEFAULT_TIMEOUT, interval: float = 0.002
) -> T:
    """The same from a coroutine: the event loop keeps running between looks."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(interval)
    return value


def run(coroutine: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
    """Run an in-process scenario on a fresh event loop, failing after ``timeout`` seconds."""
    return asyncio.run(asyncio.wait_for(coroutine, timeout))
