"""Snapshot ids of several detectors side by side: each detector's ids live in their own space.

A detector's snapshot id is its start time in microseconds since the Unix epoch, raised above the
last id it handed out. With several detectors (replicas) those ids would collide, so each replica
owns an *id space*: the ids whose remainder modulo :data:`ID_SPACES` is its space number. An id
carries its detector's identity, needs nothing new on the wire, stays within 128 µs of its start
time (agents judge RPC stamps by that) and orders with the other replicas' ids by time. Replica 0
hands out exactly the ids a single detector always did. Ids from :data:`LOCAL_ID_BASE` on are an
agent's own local snapshots and belong to no detector.
"""

from __future__ import annotations

__all__ = ["ID_SPACES", "LOCAL_ID_BASE", "id_space", "next_id", "space_problem"]

#: How many detectors can run side by side over the same agents: replicas 0 .. ID_SPACES - 1.
ID_SPACES = 128
#: Snapshot ids from here on (uint64 on the wire) are local ones, never a detector's.
LOCAL_ID_BASE = 1 << 63


def id_space(snapshot_id: int) -> int:
    """The replica whose id space holds the detector id ``snapshot_id``."""
    return snapshot_id % ID_SPACES


def next_id(last: int, now_us: int, space: int) -> int:
    """The smallest id of ``space`` above ``last`` and at least ``now_us`` rounded down to a multiple
    of :data:`ID_SPACES`: within 127 µs of ``now_us`` unless ``last`` is ahead of the clock."""
    floor = max(last + 1, now_us - now_us % ID_SPACES)
    return floor + (space - floor) % ID_SPACES


def space_problem(space: int) -> str | None:
    """Why ``space`` is not a replica number, or None when it is one."""
    if isinstance(space, bool) or not isinstance(space, int):
        return f"a replica number is an integer, not {space!r}"
    if not 0 <= space < ID_SPACES:
        return f"replica {space} is out of range: replicas are numbered 0 to {ID_SPACES - 1}"
    return None
