"""Global-state assembly: merge local snapshot parts into consistent global snapshots.

A snapshot is complete when every member has reported its local state and every channel has both
ends: the sender's ``n`` (messages sent before its marker) and the receiver's ``m`` (messages
received before it recorded) with the messages it recorded. Every channel must satisfy
``m + len(recorded) == n`` (DESIGN.md, "Consistency proof per channel"); a snapshot that fails it
is aborted, never returned. Membership is fixed when the snapshot begins; channels are whatever
the members report, so channels that open during a snapshot are handled. A channel whose other
end is not a member is outside the cut: its peer is kept in ``outside_peers``, with what the
detector expected (``expected_members``, ``expected_member_count``), so that evaluation can tell
a closed cut from an open one.

The assembler never trusts a part: each bad one raises :class:`PartRejected` with a reason from
:data:`REJECTION_REASONS` and leaves everything already accepted untouched. A part over the size
bounds (``max_part_bytes`` serialized, ``max_part_messages`` recorded messages) is rejected before
anything else is looked at; when its sender is a member of the running snapshot, the snapshot can
never be whole and is aborted at once.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from stablewatch.v1 import (
    AckPosition,
    GlobalSnapshot,
    InboundChannelState,
    LocalSnapshotPart,
    LocalState,
)

__all__ = ["REJECTION_REASONS", "Aborted", "Assembler", "Completed", "PartRejected"]

#: Every reason a part can be rejected for (bounded: safe as a metric label).
REJECTION_REASONS = (
    "malformed",  # missing ids, a channel to itself, a channel listed twice
    "unknown_snapshot",  # no such snapshot was started
    "late",  # the snapshot already completed or was aborted
    "not_member",  # the process is not a member of the snapshot
    "spoofed",  # the part names another process than the stream it came on
    "duplicate_part",  # state or a channel already reported
    "inconsistent_counts",  # m + len(recorded) != n on some channel: the cut is not consistent
    "too_large",  # the part is larger than max_part_bytes
    "too_many_messages",  # the part records more than max_part_messages messages
)

# How many finished snapshot ids are remembered to tell "late" from "unknown".
_FINISHED_MEMORY = 4096


class PartRejected(Exception):
    """A local snapshot part was refused; ``reason`` is one of :data:`REJECTION_REASONS`."""

    def __init__(self, reason: str, detail: str, *, aborted: Aborted | None = None) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
        self.aborted = aborted  # set when the part proved the whole snapshot inconsistent


@dataclass(frozen=True, slots=True)
class Completed:
    """The snapshot is whole and every channel passed the proof."""

    snapshot: GlobalSnapshot


@dataclass(frozen=True, slots=True)
class Aborted:
    """The snapshot can never be whole; ``reason`` says why."""

    snapshot_id: int
    reason: str


@dataclass(slots=True)
class _Pending:
    snapshot_id: int
    members: frozenset[str]
    expected: frozenset[str] = frozenset()
    expected_count: int = 0
    outside: set[str] = field(default_factory=set)  # channel peers that are not members
    states: dict[str, LocalState] = field(default_factory=dict)
    sent: dict[tuple[str, str], int] = field(default_factory=dict)  # (src, dst) -> n
    ack_seen: dict[tuple[str, str], AckPosition] = field(default_factory=dict)  # (src, dst) -> at src's recording
    inbound: dict[tuple[str, str], InboundChannelState] = field(default_factory=dict)

    def is_complete(self) -> bool:
        return len(self.states) == len(self.members) and self.sent.keys() == self.inbound.keys()


class Assembler:
    """Collects the parts of running snapshots and returns each one when it is complete."""

    def __init__(self, *, max_part_bytes: int | None = None, max_part_messages: int | None = None) -> None:
        self._max_part_bytes = max_part_bytes
        self._max_part_messages = max_part_messages
        self._pending: dict[int, _Pending] = {}
        self._finished: set[int] = set()
        self._finished_order: deque[int] = deque()

    @property
    def running(self) -> list[int]:
        """Snapshots begun and neither completed nor aborted."""
        return sorted(self._pending)

    def begin(
        self, snapshot_id: int, members: Iterable[str], *, expected: Iterable[str] = (), expected_count: int = 0
    ) -> None:
        """Start collecting snapshot ``snapshot_id`` from exactly these member processes.

        ``expected`` names processes the cut should hold besides them (declared, not attached)
        and ``expected_count`` how many processes the system has, when only a number is known;
        both travel in the global snapshot, for evaluation to judge the cut's coverage.
        """
        if snapshot_id in self._pending or snapshot_id in self._finished:
            raise ValueError(f"snapshot {snapshot_id} was already begun")
        member_set = frozenset(members)
        if not member_set or "" in member_set:
            raise ValueError(f"snapshot {snapshot_id} needs non-empty member ids, got {sorted(member_set)}")
        if expected_count < 0:
            raise ValueError(f"expected_count must be >= 0, not {expected_count}")
        self._pending[snapshot_id] = _Pending(snapshot_id, member_set, frozenset(expected) | member_set, expected_count)

    def add_part(self, part: LocalSnapshotPart, sender: str | None = None) -> Completed | None:
        """Merge ``part`` (from the agent registered as ``sender``, when known).

        Returns :class:`Completed` when this part completes the snapshot, else None. Raises
        :class:`PartRejected` for a bad part; when the part proves the cut inconsistent the
        snapshot is aborted as well, and the exception's ``aborted`` says so.
        """
        self._check_bounds(part, sender)
        pending = self._validate(part, sender)
        channels_checked = self._check_counts(pending, part)
        if channels_checked is not None:
            aborted = self.abort(pending.snapshot_id, channels_checked)
            raise PartRejected("inconsistent_counts", channels_checked, aborted=aborted)
        process = part.process_id
        if part.HasField("state"):
            pending.states[process] = part.state
        # Channels to or from non-members are outside the cut: the other end never reports. Their
        # peers are remembered: a cut that names them is open.
        for count in part.outbound:
            if count.dst in pending.members:
                pending.sent[(process, count.dst)] = count.sent_before_marker
                if count.HasField("ack_seen"):
                    pending.ack_seen[(process, count.dst)] = count.ack_seen
            else:
                pending.outside.add(count.dst)
        for channel in part.inbound:
            if channel.src in pending.members:
                pending.inbound[(channel.src, process)] = channel
            else:
                pending.outside.add(channel.src)
        if not pending.is_complete():
            return None
        del self._pending[pending.snapshot_id]
        self._remember_finished(pending.snapshot_id)
        return Completed(_global_snapshot(pending))

    def fail(self, snapshot_id: int, process_id: str, reason: str) -> Aborted | None:
        """A member cannot contribute (its recording failed): abort the snapshot, if still running."""
        return self.abort(snapshot_id, f"process {process_id} failed: {reason}")

    def abort(self, snapshot_id: int, reason: str) -> Aborted | None:
        """Give up on a running snapshot (deadline, lost member, inconsistency); None if not running."""
        if self._pending.pop(snapshot_id, None) is None:
            return None
        self._remember_finished(snapshot_id)
        return Aborted(snapshot_id, reason)

    def missing(self, snapshot_id: int) -> str:
        """What a running snapshot still waits for, for abort reasons and progress displays."""
        pending = self._pending.get(snapshot_id)
        if pending is None:
            return f"snapshot {snapshot_id} is not running"
        states = sorted(pending.members - pending.states.keys())
        channels = sorted(pending.sent.keys() ^ pending.inbound.keys())
        pieces = []
        if states:
            pieces.append(f"state of {', '.join(states)}")
        if channels:
            pieces.append(f"channels {', '.join(f'{s}->{d}' for s, d in channels)}")
        return "waiting for " + "; ".join(pieces) if pieces else "nothing missing"

    # -- internals -----------------------------------------------------------------------------

    def _check_bounds(self, part: LocalSnapshotPart, sender: str | None) -> None:
        """Reject a part over the size bounds; abort its snapshot when the sender is a member."""
        where = f"part of snapshot {part.snapshot_id} from {sender or part.process_id or '<no process id>'}"
        reason = detail = None
        if self._max_part_bytes is not None and (size := part.ByteSize()) > self._max_part_bytes:
            reason, detail = "too_large", f"{where} is {size} bytes, above the limit of {self._max_part_bytes}"
        elif self._max_part_messages is not None:
            messages = sum(len(channel.messages) for channel in part.inbound)
            if messages > self._max_part_messages:
                limit = self._max_part_messages
                reason, detail = "too_many_messages", f"{where} records {messages} messages, above the limit of {limit}"
        if reason is None or detail is None:
            return
        pending = self._pending.get(part.snapshot_id)
        aborted = None
        if pending is not None and (sender or part.process_id) in pending.members:
            aborted = self.abort(part.snapshot_id, f"{detail}: the snapshot cannot be whole")
        raise PartRejected(reason, detail, aborted=aborted)

    def _validate(self, part: LocalSnapshotPart, sender: str | None) -> _Pending:
        snapshot_id, process = part.snapshot_id, part.process_id
        where = f"part of snapshot {snapshot_id} from {process or '<no process id>'}"
        if not process:
            raise PartRejected("malformed", f"{where}: process_id is empty")
        if sender is not None and sender != process:
            raise PartRejected("spoofed", f"{where} arrived on the stream of {sender}")
        pending = self._pending.get(snapshot_id)
        if pending is None:
            reason = "late" if snapshot_id in self._finished else "unknown_snapshot"
            state = "already finished" if reason == "late" else "not running"
            raise PartRejected(reason, f"{where}: snapshot {snapshot_id} is {state}")
        if process not in pending.members:
            raise PartRejected("not_member", f"{where}: {process} is not a member of snapshot {snapshot_id}")
        dsts = [count.dst for count in part.outbound]
        srcs = [channel.src for channel in part.inbound]
        for kind, peers in (("outbound", dsts), ("inbound", srcs)):
            if "" in peers or process in peers:
                raise PartRejected("malformed", f"{where}: an {kind} channel has no peer or is to itself")
            if len(set(peers)) != len(peers):
                raise PartRejected("malformed", f"{where}: an {kind} channel is listed twice")
        if part.HasField("state") and process in pending.states:
            raise PartRejected("duplicate_part", f"{where}: its state was already reported")
        for dst in dsts:
            if (process, dst) in pending.sent:
                raise PartRejected("duplicate_part", f"{where}: channel {process}->{dst} already reported")
        for src in srcs:
            if (src, process) in pending.inbound:
                raise PartRejected("duplicate_part", f"{where}: channel {src}->{process} already reported")
        return pending

    @staticmethod
    def _check_counts(pending: _Pending, part: LocalSnapshotPart) -> str | None:
        """The per-channel proof for every channel this part closes; a description if one fails."""
        process = part.process_id
        pairs: list[tuple[tuple[str, str], int, InboundChannelState]] = []
        for count in part.outbound:
            channel = pending.inbound.get((process, count.dst))
            if channel is not None:
                pairs.append(((process, count.dst), count.sent_before_marker, channel))
        for channel in part.inbound:
            sent = pending.sent.get((channel.src, process))
            if sent is not None:
                pairs.append(((channel.src, process), sent, channel))
        for (src, dst), sent, channel in pairs:
            received = channel.received_before_recording + len(channel.messages)
            if received != sent:
                return (
                    f"snapshot {pending.snapshot_id} channel {src}->{dst} is inconsistent: "
                    f"m={channel.received_before_recording} + recorded={len(channel.messages)} "
                    f"!= n={sent}"
                )
        return None

    def _remember_finished(self, snapshot_id: int) -> None:
        if snapshot_id in self._finished:
            return
        self._finished.add(snapshot_id)
        self._finished_order.append(snapshot_id)
        if len(self._finished_order) > _FINISHED_MEMORY:
            self._finished.discard(self._finished_order.popleft())


def _global_snapshot(pending: _Pending) -> GlobalSnapshot:
    snapshot = GlobalSnapshot(
        snapshot_id=pending.snapshot_id,
        expected_members=sorted(pending.expected),
        expected_member_count=pending.expected_count,
        outside_peers=sorted(pending.outside),
    )
    # Built in place with add(): append() would copy each channel's recorded messages once more.
    for process in sorted(pending.states):
        snapshot.processes.add(process_id=process, state=pending.states[process])
    for (src, dst), sent in sorted(pending.sent.items()):
        channel = pending.inbound[(src, dst)]
        snapshot.channels.add(
            src=src,
            dst=dst,
            sent_before_marker=sent,
            received_before_recording=channel.received_before_recording,
            messages=channel.messages,
            receiver_acked=channel.acked if channel.HasField("acked") else None,
            sender_ack_seen=pending.ack_seen.get((src, dst)),
        )
    return snapshot
