"""Sends blocked on a full window, and the flow-control waits they add to the recorded state.

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
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager

from stablewatch.agents.outbound import OutboundChannel
from stablewatch.v1 import WAIT_MODEL_AND, Wait, WaitNode

__all__ = ["BlockedSends"]


class BlockedSends:
    """The sends of one agent now waiting for window space."""

    def __init__(self) -> None:
        self._waiting: dict[int, tuple[str, OutboundChannel]] = {}
        self._tokens = itertools.count()

    def __len__(self) -> int:
        return len(self._waiting)

    @contextmanager
    def waiting(self, waiter: str, channel: OutboundChannel) -> Iterator[None]:
        """Count ``waiter`` (a task name, or "" for the process) as blocked on ``channel`` meanwhile."""
        token = next(self._tokens)
        self._waiting[token] = (waiter, channel)
        try:
            yield
        finally:
            del self._waiting[token]

    def waits(self) -> list[Wait]:
        """The flow-control waits to record now: blocked sends whose receiver holds the window."""
        targets: dict[str, list[str]] = {}
        for waiter, channel in self._waiting.values():
            # Checked at the moment of recording: a window with space again, or a receiver that has
            # acknowledged since it held it, blocks no one (the send just has not resumed yet).
            if channel.held and not channel.has_space():
                destinations = targets.setdefault(waiter, [])
                if channel.dst not in destinations:
                    destinations.append(channel.dst)
        return [
            Wait(
                task=waiter,
                targets=[WaitNode(process=dst) for dst in destinations],
                model=WAIT_MODEL_AND,
                flow_control=True,
            )
            for waiter, destinations in targets.items()
        ]
