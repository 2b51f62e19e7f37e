"""Sends blocked on a full window, the flow-control waits they add to the recorded state, and how
such a wait is broken.

A send waits for window space until the receiver acknowledges. Receivers acknowledge what they
queue, so a full window usually means acknowledgements on their way; only when the receiver has
said it holds the window (its receive queue is full, :attr:`OutboundChannel.held`) is the sender
waiting for the receiver to consume. Exactly then the recorded state carries a ``Wait`` with
``flow_control=True`` on the destination process (the detector never discounts such an edge by a
message in flight: only the receiver consuming releases it, or an acknowledgement it sent before
its recording that had not arrived at ours, which the two ends' acknowledgement positions in the
cut reveal). The waiter is the process itself
when the send is inside a message handler (the process then takes no message until it returns),
else the asyncio task that sends, by its name.

Each blocked send is one wait instance (:mod:`stablewatch.agents.breaking`), reported as a
``Wait`` of its own with its instance and the time it began blocking. :class:`BlockedSends` is a
:class:`~stablewatch.agents.breaking.WaitSource`: breaking a blocked send cancels its task where it
awaits space, and the send raises :class:`~stablewatch.agents.breaking.DeadlockVictim` without
sending (a cancel scope, :class:`~stablewatch.agents.state.TaskInterrupt`). A broken send is no
longer reported as a wait: it no longer waits for the receiver, it is on its way to raise.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from stablewatch.agents import breaking
from stablewatch.agents.breaking import Broken, DeadlockVictim, OpenWait
from stablewatch.agents.outbound import OutboundChannel
from stablewatch.agents.state import TaskInterrupt
from stablewatch.v1 import WAIT_MODEL_AND, Wait, WaitNode
from stablewatch.v1.control_pb2 import BREAK_OUTCOME_ALREADY_BROKEN, BREAK_OUTCOME_BROKEN, BreakWait

__all__ = ["BlockedSends"]


class _Blocked:
    """One send waiting for window space."""

    __slots__ = ("began_at_us", "channel", "instance", "interrupt", "victim", "waiter")

    def __init__(self, waiter: str, channel: OutboundChannel, interrupt: TaskInterrupt | None) -> None:
        self.instance = breaking.new_instance()
        self.began_at_us = breaking.now_us()
        self.waiter = waiter
        self.channel = channel
        self.interrupt = interrupt
        self.victim: DeadlockVictim | None = None

    def recorded(self) -> bool:
        """Whether a recording now carries it: not broken, and the receiver holds the full window."""
        # Checked at the moment of recording: a window with space again, or a receiver that has
        # acknowledged since it held it, blocks no one (the send just has not resumed yet).
        return self.victim is None and self.channel.held and not self.channel.has_space()


class BlockedSends:
    """The sends of one agent now waiting for window space."""

    def __init__(self) -> None:
        self._waiting: dict[int, _Blocked] = {}  # by instance
        self._resuming = 0  # handlers' sends with space, waiting for the recording lock
        # Sends block and resume on the agent's loop; a break may come from any thread.
        self._lock = threading.Lock()
        #: Rung after a send blocks (its BreakDispatcher sets it, for the hint loop).
        self.doorbell = breaking.Doorbell()

    def __len__(self) -> int:
        return len(self._waiting)

    @contextmanager
    def waiting(self, waiter: str, channel: OutboundChannel) -> Iterator[None]:
        """Count ``waiter`` (a task name, or "" for the process) as blocked on ``channel`` meanwhile.

        Entered by the sending task on the agent's loop. If the wait is broken, the block raises
        :class:`DeadlockVictim`: in place of the cancellation the break caused, or as it ends
        without one (space came first, but the break was already reported): either way, what
        follows the block, the send, does not happen.
        """
        blocked = _Blocked(waiter, channel, TaskInterrupt.here())
        with self._lock:
            self._waiting[blocked.instance] = blocked
        self.doorbell.ring()  # not hintable until recorded, but no longer idle: the loop watches it
        try:
            yield
        except BaseException as error:
            victim = self._leave(blocked, error)
            if victim is not None:
                raise victim from error
            raise
        self._leave(blocked, None)
        if blocked.victim is not None:  # broken from another thread, and space came first
            raise blocked.victim

    def _leave(self, blocked: _Blocked, error: BaseException | None) -> DeadlockVictim | None:
        """End the wait; the error to raise instead when ``error`` is the cancellation its break caused."""
        with self._lock:
            del self._waiting[blocked.instance]
        if blocked.interrupt is not None and blocked.interrupt.leave(error):
            return blocked.victim  # set before the interrupt
        return None

    def waits(self) -> list[Wait]:
        """The flow-control waits to record now: one per blocked send whose receiver holds the window."""
        with self._lock:
            blocked = list(self._waiting.values())
        return [
            Wait(
                task=b.waiter,
                targets=[WaitNode(process=b.channel.dst)],
                model=WAIT_MODEL_AND,
                flow_control=True,
                instance=b.instance,
                began_at_us=b.began_at_us,
            )
            for b in blocked
            if b.recorded()
        ]

    # -- breaking (a breaking.WaitSource) ---------------------------------------------------------

    def break_wait(self, order: BreakWait) -> Broken | None:
        """Break the blocked send ``order.instance``, once: its task is cancelled where it awaits
        space and the send raises :class:`DeadlockVictim`, its message not sent. None when no send
        of this instance is blocked (it has resumed), or it cannot be interrupted (no asyncio task)."""
        with self._lock:
            blocked = self._waiting.get(order.instance)
            if blocked is None or blocked.interrupt is None:
                return None
            if blocked.victim is not None:
                return Broken(BREAK_OUTCOME_ALREADY_BROKEN, f"wait {order.instance} was broken before: nothing done")
            blocked.victim = DeadlockVictim.of(order)
        blocked.interrupt.interrupt()
        who = f"task {blocked.waiter!r}" if blocked.waiter else "the message handler"
        return Broken(
            BREAK_OUTCOME_BROKEN,
            f"send of {who} to {blocked.channel.dst}, blocked on a full window, broken: "
            "DeadlockVictim raised, the message not sent",
        )

    @contextmanager
    def resuming(self) -> Iterator[None]:
        """A handler's send that got window space, waiting to take the recording lock back to send."""
        with self._lock:
            self._resuming += 1
        try:
            yield
        finally:
            with self._lock:
                self._resuming -= 1

    def going_on(self) -> bool:
        """Whether a send is blocked that no recording carries: the receiver does not hold its
        window (acknowledgements are on their way, or its stream is being reconnected), or it has
        space and its handler waits for the recording lock (:meth:`resuming`), so it is about to go
        on without anything more from another process. Its process is then recorded as active:
        passive, its other tasks' waits would stand for the whole process (the quiet rule) though
        this task is about to send."""
        with self._lock:
            if self._resuming:
                return True
            blocked = list(self._waiting.values())
        return any(not b.recorded() for b in blocked)

    def open_waits(self) -> list[OpenWait]:
        """The blocked sends a recording would now carry as flow-control waits (for the hints):
        a send blocked while acknowledgements are on their way cannot be part of a deadlock."""
        with self._lock:
            blocked = list(self._waiting.values())
        return [OpenWait(b.instance, b.waiter, b.began_at_us) for b in blocked if b.recorded()]

    def idle(self) -> bool:
        """True when no send is blocked (recorded or not)."""
        with self._lock:
            return not self._waiting
