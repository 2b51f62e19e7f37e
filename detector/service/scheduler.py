"""The snapshot schedule: one snapshot every interval, with jitter, a few at a time at most.

The scheduler only decides *when*; taking the snapshot is the ``take`` callable it is given. A
tick is skipped while ``ready()`` says no (too few agents attached) or while ``max_concurrent``
scheduled snapshots still run, so a slow system is never flooded with snapshots.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Awaitable, Callable

__all__ = ["Scheduler", "next_tick"]

_log = logging.getLogger(__name__)


def next_tick(previous: float, now: float, period: float) -> float:
    """When the tick after ``previous`` is due: on a timetable, so that the loop's lag at each tick
    does not stretch every period; a schedule fallen behind skips the ticks it missed (one tick
    at once, not a burst)."""
    return max(previous + period, now)


class Scheduler:
    """Runs ``take()`` every ``interval`` seconds, stretched or shrunk by up to ``jitter`` of it."""

    def __init__(
        self,
        take: Callable[[], Awaitable[object]],
        *,
        interval: float,
        jitter: float = 0.1,
        max_concurrent: int = 2,
        ready: Callable[[], bool] = lambda: True,
        seed: int | None = None,
        quiet: tuple[type[BaseException], ...] = (),
    ) -> None:
        if interval <= 0:
            raise ValueError(f"interval must be positive, not {interval}")
        if not 0 <= jitter < 1:
            raise ValueError(f"jitter must be in [0, 1), not {jitter}")
        if max_concurrent < 1:
            raise ValueError(f"max_concurrent must be at least 1, not {max_concurrent}")
        self._take = take
        self._interval = interval
        self._jitter = jitter
        self._max_concurrent = max_concurrent
        self._ready = ready
        self._random = random.Random(seed)
        self._quiet = quiet  # exceptions of a scheduled snapshot that are not worth a log line
        self._task: asyncio.Task[None] | None = None
        self._running: set[asyncio.Task[object]] = set()

    @property
    def running(self) -> int:
        """Scheduled snapshots still running."""
        return len(self._running)

    def start(self) -> None:
        """Start ticking on the running loop."""
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        """Stop ticking and cancel the scheduled snapshots still running (they abort as shutdown)."""
        tasks = [t for t in (self._task, *self._running) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, *self._quiet):
                await task
        self._task = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            stretch = 1 + self._jitter * (2 * self._random.random() - 1)
            next_at = next_tick(next_at, loop.time(), self._interval * stretch)
            await asyncio.sleep(next_at - loop.time())
            if len(self._running) >= self._max_concurrent or not self._ready():
                continue
            task = asyncio.ensure_future(self._take())
            self._running.add(task)
            task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[object]) -> None:
        self._running.discard(task)
        if task.cancelled():
            return
        error = task.exception()
        if error is not None and not isinstance(error, self._quiet):
            _log.error("scheduled snapshot failed", exc_info=error)
