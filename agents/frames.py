"""Channel frames: the wire form of a run of channel entries, and its validation.

A :class:`~stablewatch.v1.ChannelFrame` stores entries by column (payloads in one repeated field,
markers and extras by position), so a frame of many small messages costs a few repeated fields
rather than one protobuf object per message. This module is the one place that converts between
frames and the core's entries.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import repeat

from stablewatch.agents.core import AppMessage, Entry, Marker
from stablewatch.v1 import ChannelFrame, ChannelHello

#: What a sender queues: an entry, or a plain message as its bare payload (saves an object per message).
Outgoing = bytes | Entry

__all__ = [
    "COUNTER_OVERHEAD",
    "ENTRY_OVERHEAD",
    "FRAME_ERRORS",
    "MAX_FRAME_ENTRIES",
    "FrameError",
    "Outgoing",
    "decode",
    "encode",
    "entry_size",
]

#: The most entries one frame may carry (part of the wire contract): a frame of many tiny entries
#: would otherwise make a receiver hold any number of them past its read-ahead. Markers count.
MAX_FRAME_ENTRIES = 65_536

#: Every reason a frame can be refused for (bounded: safe as a metric label).
FRAME_ERRORS = ("no_hello", "unknown_channel", "sequence_gap", "malformed", "spoofed", "superseded")

# Bytes an entry is charged beyond its payload, for windows and size limits.
ENTRY_OVERHEAD = 8
COUNTER_OVERHEAD = 16


class FrameError(Exception):
    """A frame from a peer is unacceptable; ``reason`` is one of :data:`FRAME_ERRORS`."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def entry_size(entry: Entry) -> int:
    """The bytes an entry occupies in a window: its payload plus a small fixed charge."""
    if type(entry) is Marker:
        return ENTRY_OVERHEAD
    counters = entry.counters
    return len(entry.payload) + ENTRY_OVERHEAD + (COUNTER_OVERHEAD * len(counters) if counters else 0)


def encode(first_seq: int, entries: Sequence[Outgoing], hello: ChannelHello | None = None) -> ChannelFrame:
    """The frame carrying ``entries``, the first with sequence number ``first_seq``.

    A plain message (no counters, wakes) may be given as its payload alone: it is encoded the same.
    """
    frame = ChannelFrame(first_seq=first_seq)
    if hello is not None:
        frame.hello.CopyFrom(hello)
    try:
        frame.payloads.extend(entries)  # the common case, all bare payloads, at C speed
        return frame
    except TypeError:  # some entry is a marker or carries extras; extend added nothing
        pass
    payloads = []
    for position, entry in enumerate(entries):
        if type(entry) is bytes:
            payloads.append(entry)
            continue
        if type(entry) is Marker:
            payloads.append(b"")
            frame.markers.add(position=position, snapshot_id=entry.snapshot_id)
            continue
        payloads.append(entry.payload)
        if entry.counters or entry.no_wake:
            extras = frame.extras.add(position=position, no_wake=entry.no_wake)
            if entry.counters:
                extras.counters.update(entry.counters)
    frame.payloads.extend(payloads)
    return frame


def decode(frame: ChannelFrame) -> list[Entry]:
    """The entries of ``frame``, in order; raises :class:`FrameError` when it is malformed."""
    payloads = list(frame.payloads)
    entries: list[Entry] = _plain_messages(payloads)
    if not frame.markers and not frame.extras:
        return entries
    taken: set[int] = set()
    for marker in frame.markers:
        _claim(taken, marker.position, len(payloads), "marker")
        if payloads[marker.position]:
            raise FrameError("malformed", f"marker at position {marker.position} carries a payload")
        entries[marker.position] = Marker(marker.snapshot_id)
    for extras in frame.extras:
        _claim(taken, extras.position, len(payloads), "extras")
        entries[extras.position] = AppMessage(payloads[extras.position], dict(extras.counters) or None, extras.no_wake)
    return entries


def _plain_messages(payloads: list[bytes]) -> list[Entry]:
    """``[AppMessage(p) for p in payloads]``, built in C: every received message passes here."""
    return list(map(_new_tuple, repeat(AppMessage), zip(payloads, repeat(None), repeat(False))))


_new_tuple = tuple.__new__


def _claim(taken: set[int], position: int, count: int, what: str) -> None:
    if position >= count:
        raise FrameError("malformed", f"{what} at position {position} but the frame has {count} entries")
    if position in taken:
        raise FrameError("malformed", f"two annotations claim position {position}")
    taken.add(position)
