"""An asyncio event loop on a thread of its own, for the agents that serve synchronous code
(:class:`~stablewatch.agents.threaded.ThreadedAgent`, :class:`~stablewatch.agents.rpc.agent.RpcAgent`).

Stopping it finishes what still runs on the loop first, as ``asyncio.run`` does when its main
coroutine returns: a task left pending when the loop closes is destroyed later with an error in
the log ("Task was destroyed but it is pending!"). gRPC leaves such tasks behind: a call that
has just ended still has a task of its own that takes its status in.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["LoopThread"]

_log = logging.getLogger(__name__)

T = TypeVar("T")


class LoopThread:
    """An event loop run forever by a daemon thread named ``name``, until :meth:`stop`."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def is_alive(self) -> bool:
        return self.thread.is_alive()

    def run(self, coroutine: Coroutine[Any, Any, T], timeout: float | None) -> T:
        """Run ``coroutine`` on the loop, and wait for its result (``timeout`` seconds at most)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def stop(self, timeout: float) -> None:
        """Cancel the loop's tasks and wait for them to end, then stop the thread and close the loop.

        Each step waits ``timeout`` seconds at most; a task that does not end by then is left, and logged.
        """
        if self.thread.is_alive():
            try:
                self.run(_finish_tasks(timeout), timeout + 1)
            except (concurrent.futures.TimeoutError, RuntimeError):
                _log.warning("the loop of %s did not finish its tasks in time", self.thread.name)
            finally:
                self.loop.call_soon_threadsafe(self.loop.stop)
                self.thread.join(timeout)
        if not self.loop.is_running():
            self.loop.close()


async def _finish_tasks(timeout: float) -> None:
    """Cancel every other task of the running loop, wait for them, and close its async generators."""
    loop = asyncio.get_running_loop()
    tasks = asyncio.all_tasks(loop) - {asyncio.current_task(loop)}
    for task in tasks:
        task.cancel()
    if tasks:
        done, pending = await asyncio.wait(tasks, timeout=timeout)
        for task in done:  # retrieved here, or asyncio logs it when the task is freed
            if not task.cancelled() and (error := task.exception()) is not None:
                _log.warning("a task of the loop failed as it stopped: %r", error, exc_info=error)
        for task in pending:
            _log.warning("a task of the loop did not end as it stopped: %r", task)
    await loop.shutdown_asyncgens()
