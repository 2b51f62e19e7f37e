"""The agent for threaded (synchronous) services: an :class:`Agent` on its own event-loop thread.

Every call hops onto the agent's loop and waits for the result, so the guarantees of
:class:`~stablewatch.agents.agent.Agent` hold unchanged. The message handler runs on the agent's
thread: keep it short, or hand the work to the service's own threads (and report that queued
work in the local state).

A service thread that waits declares it with ``with agent.state.waiting(...) as wait:`` and
learns that stablewatch broke the wait to end a proven deadlock through the handle (a thread
cannot be interrupted): wait on ``wait.broken`` beside what it waits for, or register
``wait.on_break(callback)`` to wake itself, then ``wait.check()`` raises
:class:`~stablewatch.agents.breaking.DeadlockVictim`. A broken blocked :meth:`ThreadedAgent.send`
raises it directly, its message not sent.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, TypeVar

from stablewatch.agents.agent import Agent, MessageHandler
from stablewatch.agents.detectors import DetectorStatus
from stablewatch.agents.loop_thread import LoopThread
from stablewatch.agents.metrics import AgentMetrics
from stablewatch.agents.state import LocalStateKeeper

__all__ = ["ThreadedAgent"]

T = TypeVar("T")


class ThreadedAgent:
    """Runs an :class:`Agent` (same arguments, ``hint_after`` among them) on a background thread;
    its methods block."""

    def __init__(self, process_id: str, *, call_timeout: float = 30.0, **agent_options: Any) -> None:
        self.agent = Agent(process_id, **agent_options)
        self._call_timeout = call_timeout
        self._loop_thread = LoopThread(f"stablewatch-agent-{process_id}")
        self._loop = self._loop_thread.loop

    def start(self) -> None:
        """Start the agent's thread, listen for peers and dial the detector."""
        self._loop_thread.start()
        self._call(self.agent.start())

    def stop(self) -> None:
        """Stop the agent and its thread."""
        if not self._loop_thread.is_alive():
            return
        if self._loop_thread.is_current():
            raise RuntimeError("ThreadedAgent.stop() was called from its own handler; stop it from another thread")
        try:
            self._call(self.agent.stop())
        finally:
            self._loop_thread.stop(self._call_timeout)

    def __enter__(self) -> ThreadedAgent:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def process_id(self) -> str:
        return self.agent.process_id

    @property
    def address(self) -> str:
        return self.agent.address

    @property
    def state(self) -> LocalStateKeeper:
        """The local state; thread-safe, so service threads may change it directly."""
        return self.agent.state

    @property
    def metrics(self) -> AgentMetrics:
        return self.agent.metrics

    @property
    def detector_connected(self) -> bool:
        """Whether a detector (at least one, when several are given) has accepted this agent."""
        return self._read(lambda: self.agent.detector_connected)

    @property
    def detectors(self) -> tuple[DetectorStatus, ...]:
        """Each detector's control stream, as :attr:`Agent.detectors` gives it."""
        return self._read(lambda: self.agent.detectors)

    def on_message(self, handler: MessageHandler) -> MessageHandler:
        """Register the handler; it runs on the agent's thread."""
        return self.agent.on_message(handler)

    def send(
        self,
        dest: str,
        payload: bytes,
        *,
        counters: Mapping[str, int] | None = None,
        wakes: bool = True,
        timeout: float | None = None,
    ) -> None:
        """Send, blocking while the channel's window is full (up to ``timeout`` seconds).

        Raises TimeoutError when it is not sent by then: it is then not sent at all (its counters
        still this process's), not left waiting to go later. Raises
        :class:`~stablewatch.agents.breaking.DeadlockVictim`, the message not sent, when
        stablewatch breaks the wait to end a proven deadlock."""
        self._call(self.agent.send(dest, payload, counters=counters, wakes=wakes), timeout)

    def start_snapshot(self, snapshot_id: int | None = None) -> int:
        """Record this process for a snapshot and send its markers (see :meth:`Agent.start_snapshot`)."""
        return self._call(self.agent.start_snapshot(snapshot_id))

    def _read(self, read: Callable[[], T]) -> T:
        """``read()`` where the agent's loop does not change what it reads meanwhile: on that loop, or
        directly when no loop runs (before start, after stop) or from the loop's own thread."""
        if self._loop_thread.is_current() or not self._loop_thread.is_alive():
            return read()
        return self._call(_returning(read))

    def _call(self, coroutine: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coroutine`` on the agent's loop and wait for its result, ``timeout`` seconds at most.

        A call that times out is cancelled on the loop, and its outcome awaited, before
        TimeoutError is raised: a send the thread was told timed out must not go on blocked and
        leave later (its message and counters gone behind the thread's back). If it finished
        just as it timed out, its result stands instead.
        """
        if self._loop_thread.is_current():
            coroutine.close()
            raise RuntimeError("a ThreadedAgent method was called from its own handler; use the Agent's async API")
        limit = self._call_timeout if timeout is None else timeout
        created: concurrent.futures.Future[asyncio.Task[T]] = concurrent.futures.Future()
        outcome: concurrent.futures.Future[T] = concurrent.futures.Future()

        def start() -> None:  # on the loop
            task = self._loop.create_task(coroutine)
            task.add_done_callback(lambda done: _settle(outcome, done))
            created.set_result(task)

        self._loop.call_soon_threadsafe(start)
        try:
            return outcome.result(limit)
        except concurrent.futures.CancelledError:
            raise TimeoutError("the agent's loop cancelled the call") from None
        except TimeoutError:
            pass
        task = created.result(self._call_timeout)
        self._loop.call_soon_threadsafe(task.cancel)
        try:
            return outcome.result(self._call_timeout)  # it finished before the cancellation came
        except concurrent.futures.CancelledError:
            raise TimeoutError(f"the call did not finish within {limit} s; it was cancelled") from None


def _settle(outcome: concurrent.futures.Future[T], task: asyncio.Task[T]) -> None:
    """Pass a finished task's result, error or cancellation on to ``outcome`` (a thread waits on it)."""
    if task.cancelled():
        outcome.cancel()
    elif (error := task.exception()) is not None:
        outcome.set_exception(error)
    else:
        outcome.set_result(task.result())


async def _returning(read: Callable[[], T]) -> T:
    """``read()``'s value, as a coroutine for :meth:`ThreadedAgent._call`."""
    return read()
