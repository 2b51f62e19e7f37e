"""Checks of a completed global snapshot of token-passing processes, from its proto alone."""

from __future__ import annotations

from stablewatch.v1 import GlobalSnapshot


def assert_consistent(snapshot: GlobalSnapshot, total: int | None, counter: str = "tokens") -> int:
    """Every channel proved (received before recording + recorded == sent before the marker), and
    the ``counter`` held by the processes plus that in flight equal to ``total`` (unless None);
    that sum."""
    for channel in snapshot.channels:
        received = channel.received_before_recording + len(channel.messages)
        assert received == channel.sent_before_marker, f"snapshot {snapshot.snapshot_id} {channel.src}->{channel.dst}"
    held = sum(process.state.counters[counter] for process in snapshot.processes)
    in_flight = sum(message.counters[counter] for channel in snapshot.channels for message in channel.messages)
    if total is not None:
        assert held + in_flight == total, f"snapshot {snapshot.snapshot_id}: {held} + {in_flight} != {total}"
    return held + in_flight
