"""The agent's receive queue: messages that arrived and wait for the handler, in arrival order.

Channels put the new messages of each accepted frame here, as one run, and acknowledge them at
once while the queue has room; the agent's one delivery task takes the runs out in arrival order
and hands their messages to the handler. So acknowledgements (and the senders' windows) never wait
for a handler, not even for one blocked on a send of its own. When the queue holds
``max_entries`` messages or ``max_bytes`` bytes, the channels hold their acknowledgements back:
the senders' windows fill up and hold the senders (see :mod:`stablewatch.agents.inbound`).

For the protocol the queue is part of the channel: a message is received when the handler gets
it. At a recording the agent passes what still waits here to the core (:meth:`Inbox.undelivered`
for ``SnapshotCore.record_state``), and those messages are in flight in the cut.

Work is per run (a frame's worth of messages), never per message: one append, one count.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Sequence

from stablewatch.agents.core import AppMessage, Run

__all__ = ["Inbox", "QueuedRun"]


class QueuedRun:
    """Messages of one channel that arrived together, and how many the handler has been given."""

    __slots__ = ("counted", "first_arrival", "messages", "nbytes", "src", "taken")

    def __init__(self, src: str, messages: Sequence[AppMessage], first_arrival: int, nbytes: int) -> None:
        self.src = src
        self.messages = messages
        self.first_arrival = first_arrival  # the core's arrival index of the first message
        self.nbytes = nbytes
        self.taken = 0  # messages handed to the handler so far (a message is taken when its call begins)
        self.counted = True  # False once the sender restarted: its counts began again without these


class Inbox:
    """A queue of runs, bounded for acknowledgements by ``max_entries`` messages and ``max_bytes``."""

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        if max_entries <= 0 or max_bytes <= 0:
            raise ValueError("the receive queue's bounds must be positive")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.entries = 0  # messages of the runs still queued (the run being delivered included)
        self.nbytes = 0
        self._runs: deque[QueuedRun] = deque()
        self._ready = asyncio.Event()
        self._room_listeners: list[Callable[[], None]] = []

    def __len__(self) -> int:
        """Runs queued, the one being delivered included."""
        return len(self._runs)

    def has_room(self) -> bool:
        """Whether the channels may acknowledge what they accept."""
        return self.entries < self.max_entries and self.nbytes < self.max_bytes

    def on_room(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` whenever the queue has room again after being full."""
        self._room_listeners.append(listener)

    def put(self, src: str, messages: Sequence[AppMessage], first_arrival: int, nbytes: int) -> None:
        """Queue a run of messages that arrived on ``src -> self``, behind everything queued."""
        self._runs.append(QueuedRun(src, messages, first_arrival, nbytes))
        self.entries += len(messages)
        self.nbytes += nbytes
        if not self._ready.is_set():
            self._ready.set()

    async def next(self) -> QueuedRun:
        """The oldest run, once there is one; it stays queued until :meth:`done`."""
        while not self._runs:
            self._ready.clear()
            await self._ready.wait()
        return self._runs[0]

    def done(self, run: QueuedRun) -> None:
        """The handler has had every message of ``run``, the oldest: drop it."""
        assert self._runs and self._runs[0] is run, "runs are delivered in order"
        full = not self.has_room()
        self._runs.popleft()
        self.entries -= len(run.messages)
        self.nbytes -= run.nbytes
        if full and self.has_room():
            for listener in self._room_listeners:
                listener()

    def forget(self, src: str) -> None:
        """The sender on ``src`` restarted: its queued messages are still delivered, but no longer
        counted on its channel, whose counts begin again."""
        for run in self._runs:
            if run.src == src:
                run.counted = False

    def uncounted(self) -> str | None:
        """A channel with messages queued that its counts no longer cover (their sender restarted
        since they came, and the handler has not had them all), or None.

        While one waits here, no recording can account for it: it is neither received nor, by
        its channel's new counts, in flight; a cut taken then would lose it."""
        for run in self._runs:
            if not run.counted and run.taken < len(run.messages):
                return run.src
        return None

    def undelivered(self) -> dict[str, list[Run]]:
        """Per channel, the messages queued that the handler has not been given, in order."""
        waiting: dict[str, list[Run]] = {}
        for run in self._runs:
            if run.counted and run.taken < len(run.messages):
                rest = Run(run.messages[run.taken :], run.first_arrival + run.taken)
                waiting.setdefault(run.src, []).append(rest)
        return waiting
