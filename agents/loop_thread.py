"""An asyncio event loop on a thread of its own, for the agents that serve synchronous code
(:class:`~stablewatch.agents.threaded.ThreadedAgent`, :class:`~stablewatch.agents.rpc.agent.RpcAgent`).

Stopping it finishes what still runs on the loop first, as ``asyncio.run`` does when its main
coroutine returns: a task left pending when the loop closes is destroyed later with an error in
the log ("Task was destroyed but it is pending!"). gRPC leaves such tasks behind: a call that
has just ended still has a task of its own that takes its status in.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["LoopThread"]

_log = logging.getLogger(__name__)

T = TypeVar("T")


#: How long the loop's tasks get to end once cancelled: a task still running after that is stuck.
_FINISH_SECONDS = 5.0


class LoopThread:
    """An event loop run forever by a daemon thread named ``name``, until :meth:`stop`."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._stopping = threading.Lock()

    def start(self) -> None:
        self.thread.start()

    def is_alive(self) -> bool:
        return self.thread.is_alive()

    def is_current(self) -> bool:
        """Whether the caller runs on the loop's own thread (where it must not wait for the loop)."""
        return threading.current_thread() is self.thread

    def run(self, coroutine: Coroutine[Any, Any, T], timeout: float | None) -> T:
        """Run ``coroutine`` on the loop, and wait for its result (``timeout`` seconds at most)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def stop(self, timeout: float) -> None:
        """Cancel the loop's tasks and wait for them to end, then stop the thread and close the loop.

        The tasks get at most 5 seconds to end, and the thread ``timeout``; a task still running then
        is logged and left, and a loop that does not stop is left open. Several threads may call
        this at once (one stops the loop, the others wait for it); the loop's own thread may not.
        """
        if self.is_current():
            raise RuntimeError(f"{self.thread.name} was asked to stop its own loop from inside it")
        with self._stopping:
            if self.thread.is_alive() and not self.loop.is_closed():
                self._finish(min(timeout, _FINISH_SECONDS))
                self.loop.call_soon_threadsafe(self.loop.stop)  # only stop() closes it, under the lock
                self.thread.join(timeout)
            if not self.loop.is_running() and not self.loop.is_closed():
                self.loop.close()

    def _finish(self, seconds: float) -> None:
        """Run :func:`_finish_tasks` on the loop; whatever happens, the loop is stopped after."""
        finishing = asyncio.run_coroutine_threadsafe(_finish_tasks(seconds), self.loop)
        try:
            finishing.result(seconds + 1)
        except TimeoutError:
            finishing.cancel()
            _log.warning("the loop of %s did not finish its tasks in %.0f s", self.thread.name, seconds)
        except Exception:  # the tasks' end is tidying up: it must not keep the loop from stopping
            _log.exception("the loop of %s failed to finish its tasks", self.thread.name)


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
