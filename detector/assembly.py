"""Global-state assembly: merge local snapshot parts into consistent global snapshots.

A snapshot is complete when every member has reported its local state and every channel between
members is *proven*: the sender's ``n`` (messages sent before its marker) equals the receiver's
``m`` (messages received before it recorded) plus the messages it recorded (DESIGN.md,
"Consistency proof per channel"). A receiver reports each inbound channel with its state, as it
stands at the recording, marked ``open`` while the channel's marker has not come; messages
recorded later follow in later parts. So a channel is proven as soon as ``m + recorded == n``,
without waiting for a marker that could only confirm it: one that had nothing in flight is proven
by the two states alone, one with messages in flight when the last of them is reported. A channel
a process's state does not list had nothing then (``m = 0``, nothing recorded yet), and an
outbound channel a sender's state does not list had ``n = 0``. Not so for a receiver in RPC mode
(``confirmed_by``): its state lists no channel, and it reports each one only once it has checked
the sender's count against its own (the same session and incarnation of the sender, DESIGN.md,
"RPC mode"), so each of its channels waits for that report, ``n = 0`` included; a piece whose
session is not the count's proves the cut inconsistent. A count that passes ``n``, or a
channel reported whole (not open) short of it, proves the cut inconsistent: the snapshot is
aborted, never returned. Membership is fixed when the snapshot begins; channels are whatever the
members report, so channels that open during a snapshot are handled. A channel whose other end
is not a member is outside the cut: its peer is kept in ``outside_peers``, with what the detector
expected (``expected_members``, ``expected_member_count``), so that evaluation can tell a closed
cut from an open one.

The assembler never trusts a part: each bad one raises :class:`PartRejected` with a reason from
:data:`REJECTION_REASONS` and leaves everything already accepted untouched. A part over the size
bounds (``max_part_bytes`` serialized, ``max_part_messages`` recorded messages) is rejected before
anything else is looked at; when its sender is a member of the running snapshot, the snapshot can
never be whole and is aborted at once. So is a part holding a string over its maximum (a process
id, a task, a counter's or an attribute's name, an attribute's text: :data:`~stablewatch.v1.bounds.MAX_ID_BYTES`
and the rest, ``name_too_long``), found where the checks first read each string, before anything
quotes it; an id or a name with a control character is ``malformed``. So is a part holding a
value the store and the archive cannot keep: a count or an arrival index (uint64) above 2**63 - 1,
or an attribute number that is NaN or infinite (JSON has none). A rejection quotes at most a
prefix of anything the part holds.
"""

from __future__ import annotations

import itertools
import operator
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from google.protobuf.struct_pb2 import Struct

from stablewatch.v1 import (
    WAIT_MODEL_AND,
    WAIT_MODEL_OR,
    AckPosition,
    ChannelSnapshot,
    EntryExtras,
    GlobalSnapshot,
    InboundChannelState,
    LocalSnapshotPart,
    LocalState,
    ProcessSnapshot,
    RecordedMessage,
)
from stablewatch.v1.bounds import (
    MAX_COUNTER_UNITS,
    MAX_ID_BYTES,
    MAX_NAME_BYTES,
    MAX_TASK_BYTES,
    MAX_TEXT_BYTES,
    has_control_character,
    names_a_wait,
    non_finite,
    quoted_prefix,
    text_problem,
    too_long,
)

#: The wait models this detector knows: 0 (unspecified, an older agent's) counts as AND.
_WAIT_MODELS = frozenset({0, WAIT_MODEL_AND, WAIT_MODEL_OR})
#: The largest count or arrival index (uint64 on the wire) the archive's int64 columns hold.
_MAX_COUNT = 2**63 - 1
_RECEIVE_INDEX = operator.attrgetter("receive_index")

__all__ = [
    "REJECTION_REASONS",
    "Aborted",
    "Assembler",
    "Completed",
    "PartRejected",
    "recorded_count",
    "recorded_messages",
]

#: Every reason a part can be rejected for (bounded: safe as a metric label).
REJECTION_REASONS = (
    # Missing ids (a wait target's process too), a channel to itself or listed twice, a channel's m
    # changed, a control character, a task named as the detector names one wait of a task.
    "malformed",
    "unknown_snapshot",  # no such snapshot was started
    "late",  # the snapshot already completed or was aborted
    "not_member",  # the process is not a member of the snapshot
    "spoofed",  # the part names another process than the stream it came on
    "duplicate_part",  # state, an outbound count or a whole channel already reported
    "inconsistent_counts",  # m + len(recorded) != n on some channel: the cut is not consistent
    "too_large",  # the part is larger than max_part_bytes
    "too_many_messages",  # the part records more than max_part_messages messages
    "name_too_long",  # an id, task or name over its maximum (stablewatch.v1.bounds), or an attribute's text
    "too_many_units",  # a counter's units in the cut add up past MAX_COUNTER_UNITS (stablewatch.v1.bounds)
)

# How many finished snapshot ids are remembered to tell "late" from "unknown".
_FINISHED_MEMORY = 4096
# How many completed snapshots keep the channels their cut counted (see Assembler.after_the_cut).
_CUTS_MEMORY = 16

Channel = tuple[str, str]  # (src, dst)


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


def _differ(incarnation: int, other: int) -> bool:
    """Whether two incarnations of one process, both known (0: not known), are different ones."""
    return incarnation != other and incarnation != 0 and other != 0


class _Link:
    """One channel between members, as far as its two ends have reported it."""

    __slots__ = ("ack_seen", "built", "counted", "m", "n", "open", "pieces", "recorded", "session")

    def __init__(self) -> None:
        self.n: int | None = None  # the sender's count; None until it says (a count, or its state)
        self.counted = False  # n came as a count (not from the state that lists no such channel)
        self.session = 0  # RPC mode: the sender's session that n counts (0 in marker mode)
        self.ack_seen: AckPosition | None = None  # at the sender's recording
        self.pieces: list[InboundChannelState] | None = None  # the receiver's reports, in order
        self.m = 0  # the first piece's: received before recording
        self.recorded = 0  # messages in all pieces
        self.open = True  # the last piece said more may follow (or none came yet)
        self.built = False  # proven and in the global snapshot


@dataclass(slots=True)
class _Pending:
    snapshot_id: int
    members: frozenset[str]
    expected: frozenset[str] = frozenset()
    expected_count: int = 0
    # Receivers whose channels are proven only once they report them (RPC mode): their states list
    # no channel, so a channel they have not reported is unknown, not empty.
    confirming: frozenset[str] = frozenset()
    # The global snapshot, grown as parts come: each state when it arrives, each channel when it is
    # proven (so that completing a snapshot of many members is a sort, not a build).
    snapshot: GlobalSnapshot = field(default_factory=GlobalSnapshot)
    rebuild: bool = False  # a built channel was reported again: build them all afresh at the end
    outside: set[str] = field(default_factory=set)  # channel peers that are not members
    states: dict[str, LocalState] = field(default_factory=dict)
    links: dict[Channel, _Link] = field(default_factory=dict)  # channels between members either end named
    of: dict[str, list[Channel]] = field(default_factory=dict)  # the links, per member at either end
    built: int = 0  # links proven (and built)
    units: dict[str, int] = field(default_factory=dict)  # per counter: the magnitude of its units so far

    def count_units(self, state: LocalState | None, pieces: Iterable[InboundChannelState]) -> tuple[str, int] | None:
        """Add the units of `state` and of the messages recorded in `pieces` to :attr:`units`; the
        first counter whose units then add up past ``MAX_COUNTER_UNITS``, with its units."""
        units = self.units
        over: tuple[str, int] | None = None

        def add(counters: Mapping[str, int]) -> None:
            nonlocal over
            for name, amount in counters.items():
                total = units[name] = units.get(name, 0) + abs(amount)
                if total > MAX_COUNTER_UNITS and over is None:
                    over = (name, total)

        if state is not None and state.counters:
            add(state.counters)
        for piece in pieces:
            for message in piece.messages:
                if message.counters:
                    add(message.counters)
            for extra in piece.extras:
                if extra.counters:
                    add(extra.counters)
        return over

    def is_complete(self) -> bool:
        return len(self.states) == len(self.members) and self.built == len(self.links)

    def link(self, channel: Channel) -> _Link:
        """The link of ``channel``, new (and filed under both its ends) if none yet."""
        link = self.links.get(channel)
        if link is None:
            link = self.links[channel] = _Link()
            if channel[0] in self.states:
                link.n = 0  # the sender's state lists every channel it had: this one carried nothing
            for process in channel:
                self.of.setdefault(process, []).append(channel)
        return link

    def settle(self, channel: Channel, link: _Link) -> str | None:
        """Build ``link`` into the snapshot once proven; describe it if it fails the proof: a count
        past ``n``, or a channel reported whole short of it."""
        n = link.n
        if n is None:
            return None
        pieces = link.pieces
        if link.counted and pieces is not None and pieces[0].session != link.session:
            # Counts of two sessions of the sender: the receiver counted other messages than n did.
            return (
                f"snapshot {self.snapshot_id} channel {channel[0]}->{channel[1]} is inconsistent: "
                f"n counts session {link.session} of {channel[0]}, m session {pieces[0].session}"
            )
        acked = pieces[0].acked if pieces is not None and pieces[0].HasField("acked") else None
        seen = link.ack_seen
        if (
            acked is not None
            and seen is not None
            and (
                _differ(acked.sender_incarnation, seen.sender_incarnation)
                or _differ(acked.receiver_incarnation, seen.receiver_incarnation)
            )
        ):
            # The two ends recorded talking to different incarnations of each other: one of them
            # restarted between the recordings (its counts started again), so m and n count other
            # messages, and m + recorded may still reach n by chance.
            return (
                f"snapshot {self.snapshot_id} channel {channel[0]}->{channel[1]} is inconsistent: {channel[0]} "
                f"recorded as incarnation {seen.sender_incarnation} talking to {channel[1]} incarnation "
                f"{seen.receiver_incarnation}, {channel[1]} as incarnation {acked.receiver_incarnation} "
                f"hearing from {channel[0]} incarnation {acked.sender_incarnation}"
            )
        total = link.m + link.recorded
        if total > n or (not link.open and total != n):
            relation = ">" if total > n else "!="
            return (
                f"snapshot {self.snapshot_id} channel {channel[0]}->{channel[1]} is inconsistent: "
                f"m={link.m} + recorded={link.recorded} {relation} n={n}"
            )
        if link.built:
            self.rebuild = True  # reported again: what was built may be out of date
        elif (
            total == n
            and channel[1] in self.states  # the receiver's state may still list it
            and (pieces is not None or channel[1] not in self.confirming)  # RPC mode: reported, checked
        ):
            self.build(channel, link)
            link.built = True
            self.built += 1
        return None

    def build(self, channel: Channel, link: _Link) -> None:
        """Add the proven ``channel`` to the global snapshot (in place: no recorded message is copied twice)."""
        src, dst = channel
        pieces = link.pieces
        first = pieces[0] if pieces else None
        added = self.snapshot.channels.add(
            src=src,
            dst=dst,
            sent_before_marker=link.n or 0,
            received_before_recording=link.m,
            receiver_acked=first.acked if first is not None and first.HasField("acked") else None,
            sender_ack_seen=link.ack_seen,
        )
        if pieces:
            for piece in pieces:
                _add_recorded(added.messages, piece)

    def counts(self, channel: Channel) -> tuple[int | None, int, int, bool]:
        """(n, m, recorded, open) of ``channel`` as far as known: n is None until its sender has
        reported its state, which lists every channel it had (one it does not list carried nothing,
        n = 0); a receiver that has reported nothing of it had m = 0 and recorded nothing yet."""
        link = self.links.get(channel)
        if link is None:
            return (0 if channel[0] in self.states else None), 0, 0, True
        return link.n, link.m, link.recorded, link.open


class Assembler:
    """Collects the parts of running snapshots and returns each one when it is complete."""

    def __init__(self, *, max_part_bytes: int | None = None, max_part_messages: int | None = None) -> None:
        self._max_part_bytes = max_part_bytes
        self._max_part_messages = max_part_messages
        self._pending: dict[int, _Pending] = {}
        self._finished: set[int] = set()
        self._finished_order: deque[int] = deque()
        self._cuts: dict[int, frozenset[Channel]] = {}  # the channels each recent completed cut counted

    @property
    def running(self) -> list[int]:
        """Snapshots begun and neither completed nor aborted."""
        return sorted(self._pending)

    def begin(
        self,
        snapshot_id: int,
        members: Iterable[str],
        *,
        expected: Iterable[str] = (),
        expected_count: int = 0,
        confirmed_by: Iterable[str] = (),
    ) -> None:
        """Start collecting snapshot ``snapshot_id`` from exactly these member processes.

        ``expected`` names processes the cut should hold besides them (declared, not attached)
        and ``expected_count`` how many processes the system has, when only a number is known;
        both travel in the global snapshot, for evaluation to judge the cut's coverage.
        ``confirmed_by`` names the members in RPC mode: each channel towards one of them is proven
        only by its own report, never by its state alone (see the module docstring).
        """
        if snapshot_id in self._pending or snapshot_id in self._finished:
            raise ValueError(f"snapshot {snapshot_id} was already begun")
        member_set = frozenset(members)
        if not member_set or "" in member_set:
            raise ValueError(f"snapshot {snapshot_id} needs non-empty member ids, got {sorted(member_set)}")
        if expected_count < 0:
            raise ValueError(f"expected_count must be >= 0, not {expected_count}")
        every = frozenset(expected) | member_set
        pending = _Pending(snapshot_id, member_set, every, expected_count, member_set & frozenset(confirmed_by))
        pending.snapshot.snapshot_id = snapshot_id
        pending.snapshot.expected_members.extend(sorted(every))
        pending.snapshot.expected_member_count = expected_count
        self._pending[snapshot_id] = pending

    def add_part(self, part: LocalSnapshotPart, sender: str | None = None) -> Completed | None:
        """Merge ``part`` (from the agent registered as ``sender``, when known).

        Returns :class:`Completed` when this part completes the snapshot, else None. Raises
        :class:`PartRejected` for a bad part; when the part proves the cut inconsistent the
        snapshot is aborted as well, and the exception's ``aborted`` says so.

        Costs O(channels the part names), plus O(channels of its process) for a state part.
        """
        self._check_bounds(part, sender)
        pending, counts = self._validate(part, sender)
        pieces = self._check_pieces(pending, part)
        # Every check that would leave the snapshot running is done: the part is taken whole. A
        # channel that then fails the proof ends the snapshot, so nothing is left to keep apart.
        # (Fields are read once, by the checks: every part of every snapshot passes here.)
        process = part.process_id
        touched: list[Channel] = []
        with_state = part.HasField("state")
        members = pending.members
        member_pieces = (piece for src, piece, *_ in pieces if src in members)
        over = pending.count_units(part.state if with_state else None, member_pieces)
        if over is not None:
            detail = (
                f"{_Where(part)}: the units of counter {quoted_prefix(over[0])} in snapshot {pending.snapshot_id} "
                f"add up to {over[1]} (amounts by magnitude), past the {MAX_COUNTER_UNITS} a total is counted in"
            )
            raise PartRejected("too_many_units", detail, aborted=self.abort(pending.snapshot_id, detail))
        if with_state:
            pending.states[process] = part.state
            pending.snapshot.processes.add(process_id=process, state=part.state)
        for dst, n, ack_seen, session in counts:
            if dst not in members:
                # Channels to or from non-members are outside the cut: the other end never reports.
                # Their peers are remembered: a cut that names them is open.
                pending.outside.add(dst)
                continue
            channel = (process, dst)
            link = pending.link(channel)
            link.n = n
            link.counted = True
            link.ack_seen = ack_seen
            link.session = session
            touched.append(channel)
        for src, piece, m, recorded, still_open in pieces:
            if src not in members:
                pending.outside.add(src)
                continue
            channel = (src, process)
            link = pending.link(channel)
            if link.pieces is None:
                link.pieces = [piece]
                link.m = m
            else:
                link.pieces.append(piece)
            link.recorded += recorded
            link.open = still_open
            touched.append(channel)
        links = pending.links
        if with_state:  # every channel of this process: its n (sender) or its receiver is in now
            touched = pending.of.get(process, [])
            for channel in touched:
                if channel[0] == process:
                    link = links[channel]
                    if link.n is None:
                        link.n = 0  # its state lists every channel it had: this one carried nothing
        failure: tuple[Channel, str] | None = None
        for channel in touched:
            problem = pending.settle(channel, links[channel])
            if problem is not None and (failure is None or channel < failure[0]):
                failure = (channel, problem)  # the first in order, so the reason does not vary
        if failure is not None:
            aborted = self.abort(pending.snapshot_id, failure[1])
            raise PartRejected("inconsistent_counts", failure[1], aborted=aborted)
        if not pending.is_complete():
            return None
        del self._pending[pending.snapshot_id]
        self._remember_finished(pending.snapshot_id)
        self._cuts[pending.snapshot_id] = frozenset(links)
        if len(self._cuts) > _CUTS_MEMORY:
            del self._cuts[next(iter(self._cuts))]  # the oldest completed
        return Completed(_global_snapshot(pending))

    def after_the_cut(self, part: LocalSnapshotPart) -> bool:
        """Whether late ``part`` only reports messages on channels that opened after a completed cut.

        A sender that heard the snapshot ended opens a channel without its marker, while the
        receiver, not told yet, still records the channel from its first message. Such a part
        (no state, no count, each channel with m = 0 and unknown to the cut) belongs after the cut
        and changes nothing. A channel the cut counted is not excused: a message past its n would
        mean a broken FIFO.
        """
        counted = self._cuts.get(part.snapshot_id)
        if counted is None or part.HasField("state") or part.outbound:
            return False
        return all(
            channel.received_before_recording == 0 and (channel.src, part.process_id) not in counted
            for channel in part.inbound
        )

    def changes_nothing(self, part: LocalSnapshotPart) -> bool:
        """Whether a part refused as late would change nothing in its snapshot, and so is no rejection:
        it reports only empty channels (opened while the snapshot ran), or only channels that opened
        after its completed cut (:meth:`after_the_cut`)."""
        return _only_empty_channels(part) or self.after_the_cut(part)

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
        pieces = []
        if states:
            pieces.append(f"state of {', '.join(states)}")
        channels = []
        for channel in sorted(channel for channel, link in pending.links.items() if not link.built):
            n, m, recorded, _ = pending.counts(channel)
            have = f"{m + recorded} of {n}" if n is not None else f"{m + recorded} of n unknown"
            if channel[1] in pending.confirming and pending.links[channel].pieces is None:
                have += f", not reported by {channel[1]}"
            channels.append(f"{channel[0]}->{channel[1]} ({have})")
        if channels:
            pieces.append(f"channels {', '.join(channels)}")
        return "waiting for " + "; ".join(pieces) if pieces else "nothing missing"

    # -- internals -----------------------------------------------------------------------------

    def _check_bounds(self, part: LocalSnapshotPart, sender: str | None) -> None:
        """Reject a part over the size bounds; abort its snapshot when the sender is a member."""
        where = _Where(part, sender)
        reason = detail = None
        size = part.ByteSize()
        if self._max_part_bytes is not None and size > self._max_part_bytes:
            reason, detail = "too_large", f"{where} is {size} bytes, above the limit of {self._max_part_bytes}"
        # Every recorded message takes two bytes at least: a smaller part cannot pass the count.
        elif self._max_part_messages is not None and size >= 2 * self._max_part_messages:
            messages = sum(map(recorded_count, part.inbound))
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

    def _validate(
        self, part: LocalSnapshotPart, sender: str | None
    ) -> tuple[_Pending, list[tuple[str, int, AckPosition | None, int]]]:
        """The running snapshot ``part`` belongs to, and its outbound counts (dst, n, ack position, session),
        after every check on the part's process, its state's strings and its counts. Each string is
        checked (:func:`_text_problem`) before anything quotes it."""
        snapshot_id, process = part.snapshot_id, part.process_id
        where = _Where(part)
        if not process:
            raise PartRejected("malformed", f"{where}: process_id is empty")
        if (problem := _text_problem(process, MAX_ID_BYTES)) is not None:
            raise self._bad_text(None, where, "process id", process, problem)  # never a member's
        if sender is not None and sender != process:
            raise PartRejected("spoofed", f"{where} arrived on the stream of {sender}")
        pending = self._pending.get(snapshot_id)
        if pending is None:
            reason = "late" if snapshot_id in self._finished else "unknown_snapshot"
            state = "already finished" if reason == "late" else "not running"
            raise PartRejected(reason, f"{where}: snapshot {snapshot_id} is {state}")
        if process not in pending.members:
            raise PartRejected("not_member", f"{where}: {process} is not a member of snapshot {snapshot_id}")
        if part.HasField("state"):
            if process in pending.states:
                raise PartRejected("duplicate_part", f"{where}: its state was already reported")
            if (found := _state_problem(part.state)) is not None:
                raise self._bad_text(pending, where, *found)
        links, recorded = pending.links, process in pending.states
        counts: list[tuple[str, int, AckPosition | None, int]] = []
        dsts: set[str] = set()
        for count in part.outbound:
            dst = count.dst
            if not dst or dst == process:
                raise PartRejected("malformed", f"{where}: an outbound channel has no peer or is to itself")
            if (problem := _text_problem(dst, MAX_ID_BYTES)) is not None:
                raise self._bad_text(pending, where, "process id", dst, problem)
            if dst in dsts:
                raise PartRejected("malformed", f"{where}: an outbound channel is listed twice")
            dsts.add(dst)
            link = links.get((process, dst))
            if link is not None and link.counted:
                raise PartRejected("duplicate_part", f"{where}: channel {process}->{dst} already reported")
            n = count.sent_before_marker
            if n > _MAX_COUNT:
                raise PartRejected("malformed", f"{where}: channel {process}->{dst} counts n={n}, above {_MAX_COUNT}")
            if n and recorded:
                # A channel opened after the recording carries nothing before its marker.
                raise PartRejected("malformed", f"{where}: channel {process}->{dst} counts n={n} after its state")
            counts.append((dst, n, count.ack_seen if count.HasField("ack_seen") else None, count.session))
        return pending, counts

    def _check_pieces(
        self, pending: _Pending, part: LocalSnapshotPart
    ) -> list[tuple[str, InboundChannelState, int, int, bool]]:
        """The inbound channels ``part`` reports (src, piece, m, messages, open), checked against
        what came before, touching nothing: a channel continues only after an open piece, with the
        same m. The strings of its recorded messages are checked too."""
        process = part.process_id
        where = _Where(part)
        members = pending.members
        pieces: list[tuple[str, InboundChannelState, int, int, bool]] = []
        # Per channel this part reports: (m, whether the last piece so far is open, listed here before).
        ends: dict[str, tuple[int, bool, bool]] = {}
        for piece in part.inbound:
            src = piece.src
            if not src or src == process:
                raise PartRejected("malformed", f"{where}: an inbound channel has no peer or is to itself")
            if (problem := _text_problem(src, MAX_ID_BYTES)) is not None:
                raise self._bad_text(pending, where, "process id", src, problem)
            payloads = len(piece.payloads)
            extras = piece.extras
            if payloads or piece.run_lengths or piece.run_starts or extras:
                problem = _column_problem(piece)
                if problem is not None:
                    raise PartRejected("malformed", f"{where}: channel {src}->{process} {problem}")
            messages = piece.messages
            if (messages or extras) and (found := _message_problem(messages, extras)) is not None:
                raise self._bad_text(pending, where, *found)
            m, still_open = piece.received_before_recording, piece.open
            if (count := _count_problem(piece, m, messages)) is not None:
                raise PartRejected("malformed", f"{where}: channel {src}->{process} {count}")
            pieces.append((src, piece, m, len(messages) + payloads, still_open))
            if src not in members:
                continue
            end = ends.get(src)
            if end is None:
                link = pending.links.get((src, process))
                if link is None or link.pieces is None:
                    ends[src] = (m, still_open, True)
                    continue
                end = (link.m, link.open, False)
            first_m, was_open, here = end
            name = f"channel {src}->{process}"
            if not was_open:
                if here:
                    raise PartRejected("malformed", f"{where}: {name} is listed twice")
                raise PartRejected("duplicate_part", f"{where}: {name} already reported")
            if m != first_m:
                raise PartRejected("malformed", f"{where}: {name} continues with m={m}, not m={first_m}")
            ends[src] = (first_m, still_open, True)
        return pieces

    def _bad_text(
        self, pending: _Pending | None, where: _Where, what: str, text: str, problem: tuple[str, str]
    ) -> PartRejected:
        """The rejection of a part holding ``text`` (a ``what``) with ``problem`` (a reason and what is
        wrong); a string over its maximum aborts ``pending``, which can never be whole then."""
        reason, wrong = problem
        detail = f"{where}: the {what} {quoted_prefix(text)} {wrong}"
        if reason == "malformed" or pending is None:  # as every malformed part: the snapshot goes on
            return PartRejected(reason, detail)
        aborted = self.abort(pending.snapshot_id, f"{detail}: the snapshot cannot be whole")
        return PartRejected(reason, detail, aborted=aborted)

    def _remember_finished(self, snapshot_id: int) -> None:
        if snapshot_id in self._finished:
            return
        self._finished.add(snapshot_id)
        self._finished_order.append(snapshot_id)
        if len(self._finished_order) > _FINISHED_MEMORY:
            self._finished.discard(self._finished_order.popleft())


class _Where:
    """Names a part in a rejection (\"part of snapshot 7 from p\"), formatted only if one is raised."""

    __slots__ = ("part", "sender")

    def __init__(self, part: LocalSnapshotPart, sender: str | None = None) -> None:
        self.part, self.sender = part, sender

    def __str__(self) -> str:
        process = self.sender or self.part.process_id
        if not process:
            process = "<no process id>"
        elif too_long(process, MAX_ID_BYTES) or has_control_character(process):
            process = quoted_prefix(process)  # not checked yet: the part itself may be the culprit
        return f"part of snapshot {self.part.snapshot_id} from {process}"


def _text_problem(text: str, limit: int) -> tuple[str, str] | None:
    """What is wrong with an id or a name of at most ``limit`` bytes (:func:`text_problem`), as
    (rejection reason, what is wrong): ``name_too_long`` when it is longer, else ``malformed``."""
    problem = text_problem(text, limit)
    if problem is None:
        return None
    return ("name_too_long" if too_long(text, limit) else "malformed"), problem


def _state_problem(state: LocalState) -> tuple[str, str, tuple[str, str]] | None:
    """The first string of ``state`` that is not acceptable, as (what it is, the string, the
    problem): a wait's task or target, a counter's or an attribute's name, an attribute's text.

    Every part with a state passes here: its ids and names are looked at all at once (two C
    calls), and one by one only when one of them may be long or is not printable.

    Three more make a wait mean something else than it says: a target without a process (taken for
    a free node outside the cut, it would release an OR wait), a task named as the wait-for
    graph names one wait of a task (``stablewatch.v1.bounds.names_a_wait``: the two would be
    one node), and a model this detector does not know (a newer agent's, say: taken for AND, the
    most blocking, it could make a deadlock up). All are ``malformed``.
    """
    ids: list[str] = []
    tasks: list[str] = []
    for wait in state.waits:
        tasks.append(wait.task)
        for target in wait.targets:
            ids.append(target.process)
            tasks.append(target.task)
    names = list(state.counters)
    attributes = state.attributes if state.HasField("attributes") else None
    if attributes is not None:
        names.extend(attributes.fields)
    found = _first_problem(
        (
            ("process id", ids, MAX_ID_BYTES),
            ("task", tasks, MAX_TASK_BYTES),
            ("counter or attribute name", names, MAX_NAME_BYTES),
        )
    )
    if found is not None:
        return found
    # Below MAX_TEXT_BYTES in all, the attributes hold no string over it.
    if attributes is not None and attributes.ByteSize() > MAX_TEXT_BYTES:
        text = _long_text(attributes)
        if text is not None:
            return "attribute text", text, ("name_too_long", f"is longer than {MAX_TEXT_BYTES} bytes")
    if attributes is not None and (number := non_finite(attributes)) is not None:
        name, value = number
        return "attribute", name, ("malformed", f"holds {value}, not a finite number (JSON has none)")
    if not all(ids):
        return "wait target", "", ("malformed", "names no process")
    for wait in state.waits:
        if wait.model not in _WAIT_MODELS:
            return "wait model", str(wait.model), ("malformed", "is not one this detector knows (AND or OR)")
    if tasks and "[wait " in "".join(tasks):
        for task in tasks:
            if names_a_wait(task):
                return "task", task, ("malformed", "is named as the detector names one wait of a task")
    return None


def _message_problem(
    messages: Iterable[RecordedMessage], extras: Iterable[EntryExtras]
) -> tuple[str, str, tuple[str, str]] | None:
    """The first unacceptable string of recorded messages (the task one wakes, its counters' names)
    or of column extras (counters' names), as :func:`_state_problem` gives one.

    One pass over the messages gathers their strings; they are looked at one by one only when
    one of them may be long or is not printable (as in :func:`_state_problem`).
    """
    tasks: list[str] = []
    names: list[str] = []
    for message in messages:
        tasks.append(message.wakes_task)
        counters = message.counters
        if counters:
            names.extend(counters)
    for extra in extras:
        names.extend(extra.counters)
    return _first_problem((("task", tasks, MAX_TASK_BYTES), ("counter name", names, MAX_NAME_BYTES)))


def _first_problem(
    groups: tuple[tuple[str, list[str], int], ...],
) -> tuple[str, str, tuple[str, str]] | None:
    """The first unacceptable string of `groups` (what they are, the strings, their maximum), as
    (what it is, the string, the problem). All are looked at at once (two C calls), and one by one
    only when one may be long or is not printable: no string a quarter as long as the smallest
    maximum is over one."""
    every = [text for _, strings, _ in groups for text in strings]
    smallest = min(limit for _, _, limit in groups)
    if not every or (max(map(len, every)) * 4 <= smallest and "".join(every).isprintable()):
        return None
    for what, strings, limit in groups:
        for text in strings:
            if (problem := _text_problem(text, limit)) is not None:
                return what, text, problem
    return None


def _long_text(attributes: Struct) -> str | None:
    """A string below the names of ``attributes`` (a value, or a key of a struct inside one) over
    :data:`~stablewatch.v1.bounds.MAX_TEXT_BYTES`, if any."""
    values = list(attributes.fields.values())
    while values:
        value = values.pop()
        kind = value.WhichOneof("kind")
        if kind == "string_value":
            if too_long(value.string_value, MAX_TEXT_BYTES):
                return value.string_value
        elif kind == "struct_value":
            fields = value.struct_value.fields
            for key in fields:
                if too_long(key, MAX_TEXT_BYTES):
                    return key
            values.extend(fields.values())
        elif kind == "list_value":
            values.extend(value.list_value.values)
    return None


def _count_problem(piece: InboundChannelState, m: int, messages: Any) -> str | None:
    """What is wrong with the counts of ``piece`` (m, the arrival indices of its messages), if one is
    above :data:`_MAX_COUNT`."""
    if m > _MAX_COUNT:
        return f"counts m={m}, above {_MAX_COUNT}"
    top = max(map(_RECEIVE_INDEX, messages), default=0)
    if piece.run_starts:  # the column form: each run's indices start at its start
        top = max(top, max(map(operator.add, piece.run_starts, piece.run_lengths)) - 1)
    if top > _MAX_COUNT:
        return f"records a message of arrival index {top}, above {_MAX_COUNT}"
    return None


def _only_empty_channels(part: LocalSnapshotPart) -> bool:
    """Whether a part only reports channels with nothing before their marker (n = 0, m = 0, empty).

    Such reports come from channels opened while a snapshot ran, and can arrive after it completed.
    """
    return (
        not part.HasField("state")
        and all(count.sent_before_marker == 0 for count in part.outbound)
        and all(channel.received_before_recording == 0 and not recorded_count(channel) for channel in part.inbound)
    )


def recorded_count(piece: InboundChannelState) -> int:
    """How many messages ``piece`` records, in either form."""
    return len(piece.messages) + len(piece.payloads)


def recorded_messages(piece: InboundChannelState) -> list[RecordedMessage]:
    """The messages ``piece`` records, in arrival order, as RecordedMessages (for tests and tools)."""
    holder = ChannelSnapshot()
    _add_recorded(holder.messages, piece)
    return list(holder.messages)


def _add_recorded(target: Any, piece: InboundChannelState) -> None:
    """Append the messages ``piece`` records to ``target`` (a repeated RecordedMessage field), in
    arrival order: the column form an agent sends becomes one object per message here, once."""
    target.extend(piece.messages)
    if not piece.payloads:
        return
    # The arrival index of each message, run after run (validated: the runs cover the payloads).
    ends = map(operator.add, piece.run_starts, piece.run_lengths)
    indices = itertools.chain.from_iterable(map(range, piece.run_starts, ends))
    add = target.add
    extras = {extra.position: extra for extra in piece.extras}
    if not extras:
        for payload, index in zip(piece.payloads, indices, strict=True):
            add(payload=payload, receive_index=index)
        return
    for position, (payload, index) in enumerate(zip(piece.payloads, indices, strict=True)):
        extra = extras.get(position)
        if extra is None:
            add(payload=payload, receive_index=index)
        else:
            add(payload=payload, counters=extra.counters, no_wake=extra.no_wake, receive_index=index)


def _column_problem(piece: InboundChannelState) -> str | None:
    """What is wrong with the column form of ``piece``, if anything."""
    if not (piece.payloads or piece.run_lengths or piece.run_starts or piece.extras):
        return None
    count = len(piece.payloads)
    if len(piece.run_starts) != len(piece.run_lengths) or sum(piece.run_lengths) != count:
        return f"has {count} payloads but runs of {list(piece.run_lengths)} from {list(piece.run_starts)}"
    positions = [extra.position for extra in piece.extras]
    if len(set(positions)) != len(positions) or any(position >= count for position in positions):
        return f"has extras at {positions} for {count} messages"
    return None


def _global_snapshot(pending: _Pending) -> GlobalSnapshot:
    """The complete global snapshot: what the parts built, in order (processes by id, channels by
    their ends)."""
    snapshot = pending.snapshot
    snapshot.outside_peers.extend(sorted(pending.outside))
    snapshot.processes.sort(key=_process_id)
    if pending.rebuild:
        del snapshot.channels[:]
        for channel, link in pending.links.items():
            pending.build(channel, link)
    snapshot.channels.sort(key=_ends)
    return snapshot


def _process_id(process: ProcessSnapshot) -> str:
    return process.process_id


def _ends(channel: ChannelSnapshot) -> tuple[str, str]:
    return channel.src, channel.dst
