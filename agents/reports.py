"""One report per process and snapshot: the agent's parts for the detector, gathered.

The core reports a snapshot in pieces: the state with the outbound counts when the process
records, then one inbound channel each time a marker closes one. Sent as they come, that is a
control-stream write per piece, and in a one-hop snapshot the markers arrive right after the
start. :class:`ReportGatherer` holds the state part until every inbound channel that was open at
the recording has reported (their markers are on the way), or until a short ``window`` passes, and
sends everything as one part. A channel whose marker never comes (its sender is no member of the
snapshot, or stopped) costs that window once, never correctness: the detector merges parts
whichever way they arrive.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from stablewatch.v1 import LocalSnapshotPart

__all__ = ["DEFAULT_REPORT_WINDOW", "ReportGatherer"]

#: Seconds a state part waits for the inbound channels still open at the recording.
DEFAULT_REPORT_WINDOW = 0.05


@dataclass(slots=True)
class _Held:
    parts: list[LocalSnapshotPart]  # the state part first
    waiting: set[str]  # inbound channels whose part has not come yet
    timer: asyncio.TimerHandle

    def merged(self) -> LocalSnapshotPart:
        """One part of them all, merged into the one with the most recorded messages: merging
        copies, and a channel state can hold thousands of messages."""
        base = max(self.parts, key=lambda part: sum(len(channel.messages) for channel in part.inbound))
        for part in self.parts:
            if part is not base:
                base.MergeFrom(part)
        return base


class ReportGatherer:
    """Merges a snapshot's parts into one before ``send``; runs on the agent's event loop."""

    def __init__(self, send: Callable[[LocalSnapshotPart], object], window: float = DEFAULT_REPORT_WINDOW) -> None:
        if window < 0:
            raise ValueError(f"the report window must not be negative, not {window}")
        self._send = send
        self._window = window
        self._held: dict[int, _Held] = {}

    @property
    def held(self) -> list[int]:
        """Snapshots whose report is being gathered."""
        return sorted(self._held)

    def add(self, part: LocalSnapshotPart, open_channels: Iterable[str] = ()) -> None:
        """Take one part from the core; ``open_channels``: inbound channels open right now (read only
        for a state part, which is held until each of them has reported, or the window passed)."""
        held = self._held.get(part.snapshot_id)
        if held is None:
            waiting = set(open_channels) - {channel.src for channel in part.inbound} if part.HasField("state") else ()
            if not waiting or not self._window:
                self._send(part)
                return
            timer = asyncio.get_running_loop().call_later(self._window, self.flush, part.snapshot_id)
            self._held[part.snapshot_id] = _Held([part], waiting, timer)
            return
        held.parts.append(part)
        held.waiting.difference_update(channel.src for channel in part.inbound)
        if not held.waiting:
            self.flush(part.snapshot_id)

    def flush(self, snapshot_id: int) -> None:
        """Send what is gathered for ``snapshot_id`` now (nothing if nothing is held)."""
        held = self._held.pop(snapshot_id, None)
        if held is not None:
            held.timer.cancel()
            self._send(held.merged())

    def drop(self, snapshot_id: int) -> None:
        """Forget ``snapshot_id``'s report (it failed or finished: the detector no longer wants it)."""
        held = self._held.pop(snapshot_id, None)
        if held is not None:
            held.timer.cancel()

    def drop_all(self) -> None:
        """Forget every report being gathered (a new detector epoch, or the agent stops)."""
        for snapshot_id in list(self._held):
            self.drop(snapshot_id)
