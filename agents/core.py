"""The Chandy–Lamport snapshot protocol for one process, as a pure state machine.

Everything that affects the protocol lives in this module. It does no I/O, keeps no clock, starts
no thread and draws no random number: the gRPC transport, the simulator and the tests feed it
events and carry out the actions it returns, so all of them run exactly the same protocol. Time,
where it matters (deadlines), comes in as an argument: ``now``, in seconds of the driver's
monotonic clock.

Theory of operation
-------------------
A *channel* is one direction between two processes, ``src -> dst``; the driver guarantees that
its entries arrive reliably, in order and once. An entry is an :class:`AppMessage` or a
:class:`Marker`.

* **Recording.** A process records its local state for snapshot ``k`` when it first hears of
  ``k``: from :meth:`SnapshotCore.start_snapshot` (the detector asked; any number of processes may
  initiate the same ``k``) or from the first marker ``k`` on any inbound channel.
* **Markers.** The same call that decides to record returns, in one action list, a
  :class:`RecordState` and a marker ``k`` for every outbound channel. The driver captures the
  application's state and hands it back with :meth:`SnapshotCore.record_state` before it feeds
  any other event, so no send or delivery can slip between the recording and the markers: that
  is what makes the step atomic. Until then every other call raises :class:`LocalProtocolError`.
* **Channel states.** Once ``k`` is recorded, every application message that arrives on an
  inbound channel is recorded for ``k`` until marker ``k`` arrives on that channel (or ``k``
  ends). The channel the first marker came on is empty. A channel that opens after the recording is recorded from
  its first message; an outbound channel opened (:meth:`SnapshotCore.open_outbound`) while ``k``
  is still running gets marker ``k`` before anything else, and a report of ``n = 0``.
* **Arrived is not yet received.** A driver may queue what arrives before the application takes
  it (the agent does: its receive queue). Such a queue is part of the channel: at
  :meth:`SnapshotCore.record_state` the driver passes the messages that arrived but were not yet
  handed over (``undelivered``); they are in flight for ``k``, recorded ahead of what arrives
  later, and not counted in ``m``. So a marker is taken in as it arrives, even with messages of
  its channel still queued ahead of it: they belong to the channel's state (if this marker makes
  the process record, they are all of it). The same rules, with the queue moved from the process
  into the channel.
* **Proof counts.** For each outbound channel the part carries ``n``, the messages sent before
  the marker; for each inbound channel ``m``, the messages received before recording. The
  detector checks ``m + len(recorded) == n`` for every channel.
* **Acknowledgements.** The transport's acknowledgements travel back on a channel's stream,
  which no recording covers, so the cut alone cannot tell an acknowledgement in transit (a sender
  blocked on a full window that is about to get space). At :meth:`SnapshotCore.record_state` the
  driver passes, per channel, where acknowledgements stood at that moment: the highest one each
  inbound channel had sent (``acked``) and the highest one each outbound channel had seen
  (``acks_seen``). The parts carry them as they are; the detector compares the two ends.
* **Concurrency.** Every snapshot id has its own recording; one message may be recorded for
  several snapshots at once.
* **Bounds.** A snapshot whose recorded bytes pass ``max_recorded_bytes`` fails with a reason
  (:class:`SnapshotFailed`) and stops recording, instead of growing without limit. At most
  ``max_recordings`` snapshots record at once: beyond that a new one is refused, with a
  :class:`SnapshotFailed`, never silently.
* **Deadlines.** No recording lives forever. One started by the detector lives for the lifetime
  the start gives (its ``deadline_ms``); one begun by a marker, or started without a lifetime,
  lives ``default_lifetime`` until a start for it arrives. :meth:`SnapshotCore.expire` drops every
  recording whose deadline has passed, with its memory, and reports it as failed. The core has no
  clock: a marker or start given no ``now`` is dated by the latest ``now`` the driver passed.
* **Restarts.** When the process at the other end of a channel restarts, the two ends' counts
  start again (:meth:`SnapshotCore.reset_outbound`, :meth:`SnapshotCore.reset_inbound`) and the
  snapshots running across the restart fail: their counts can no longer be proved. Messages of
  the old sender that the driver still holds undelivered are then counted on no channel: a
  recording made while one waits could show it nowhere, so the driver passes ``unprovable`` to
  :meth:`SnapshotCore.record_state` and that snapshot fails instead of reporting a part.
* **Parts.** The process reports its contribution as :class:`ReportPart` actions. When it records:
  its state, the outbound counts, and every inbound channel it knows as it stands then (``m``
  and the messages still undelivered), marked ``open`` unless its marker came already; a channel
  it does not list had ``m = 0``. Every run of messages recorded after that is reported at once,
  in a part of its own (a driver may merge parts that queue up); a marker's arrival reports
  nothing. The detector proves each channel by its counts, ``m + recorded == n``: a channel with
  nothing in flight by the two processes' states alone, one with messages in flight as soon as the
  last of them is reported, never by waiting for a marker. So the core keeps nothing recorded: a
  recording costs its counts and ids. :meth:`SnapshotCore.finish_snapshot` then lets the core
  forget ``k`` (late markers of a finished snapshot are ignored).
* **Markers may wait.** No part waits for a marker, so a marker has one duty left: to come before
  every message sent after the recording, so that the receiver records first and never takes such
  a message for one in flight. A driver may therefore hold a detector snapshot's marker back and
  put it in front of the next entry of its channel, or drop it once :meth:`SnapshotCore.deadline`
  has passed (the detector has ended the snapshot by then): the messages in flight before it
  arrive and are reported all the same, and a receiver that has not recorded yet records before
  the next message, at the marker. A snapshot then costs a channel nothing on the wire of its
  own. Markers of local snapshots always go at once: no detector starts their other processes,
  only markers do.
* **Ids and epochs.** The detectors' ids are below :data:`LOCAL_ID_BASE`; ids at or above it are
  the agents' own (local snapshots), a separate space. Several detectors may run side by side:
  each owns an id space (:func:`stablewatch.v1.ids.id_space`), its ids increase within it, and
  every recording is keyed by its whole id, so their snapshots run independently, as concurrent
  snapshots do. Finished ids are remembered (a bounded memory; a detector's ids below the oldest
  one of its space forgotten count as finished too), so late markers start nothing. A new
  detector epoch (a new store: its ids start again) makes the old memory of its space wrong:
  :meth:`SnapshotCore.new_epoch` forgets every snapshot of that space, running or finished.

Errors say whose fault they are: :class:`LocalProtocolError` for misuse by the driver,
:class:`RemoteProtocolError` for a peer that broke the protocol (for example two markers of one
snapshot on one channel).
"""

from __future__ import annotations

import operator
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from stablewatch.v1 import (
    AckPosition,
    LocalSnapshotPart,
    LocalState,
    OutboundCount,
)
from stablewatch.v1.bounds import process_id_problem
from stablewatch.v1.ids import LOCAL_ID_BASE, id_space

__all__ = [
    "DEFAULT_LIFETIME",
    "DEFAULT_MAX_RECORDINGS",
    "LOCAL_ID_BASE",
    "Action",
    "AppMessage",
    "Entry",
    "FinishedIds",
    "LocalProtocolError",
    "Marker",
    "RecordState",
    "RemoteProtocolError",
    "ReportPart",
    "Run",
    "SendEntry",
    "SnapshotCore",
    "SnapshotFailed",
    "apply_recording",
    "payload_bytes",
]

DEFAULT_MAX_RECORDED_BYTES = 64 * 1024 * 1024
#: Seconds a recording lives that no start with a lifetime claimed (begun by a marker, say).
DEFAULT_LIFETIME = 60.0
#: Snapshots one process records at once; a further one is refused.
DEFAULT_MAX_RECORDINGS = 16
# Bytes charged per counter entry of a recorded message, so counters-only messages are bounded too.
_COUNTER_COST = 16
# How many finished snapshot ids are remembered, to ignore their late markers, starts and targets.
_FINISHED_MEMORY = 4096


class LocalProtocolError(Exception):
    """The driver misused the core (a call out of order, a send to itself)."""


class RemoteProtocolError(Exception):
    """A peer broke the protocol (for example a second marker of one snapshot on one channel)."""


# Entries are NamedTuples rather than dataclasses: one is built per message on the hot path.
class AppMessage(NamedTuple):
    """An application message: opaque payload, units in transit, and whether it can wake anyone."""

    payload: bytes
    counters: Mapping[str, int] | None = None
    no_wake: bool = False


class Marker(NamedTuple):
    """The marker of snapshot ``snapshot_id``."""

    snapshot_id: int


Entry = AppMessage | Marker


class Run(NamedTuple):
    """Messages that arrived in a row on one channel, and the arrival index of the first."""

    messages: Sequence[AppMessage]
    first_arrival: int


@dataclass(frozen=True, slots=True)
class SendEntry:
    """Put ``entry`` on the outbound channel to ``dst``, after everything already queued there."""

    dst: str
    entry: Entry


@dataclass(frozen=True, slots=True)
class RecordState:
    """Capture the application's state now and pass it to ``record_state(snapshot_id, ...)``."""

    snapshot_id: int


@dataclass(frozen=True, slots=True)
class ReportPart:
    """Send this piece of the local snapshot to the detector; ``recorded_bytes``: what the messages
    it records in flight were charged against ``max_recorded_bytes`` (for the driver's metrics)."""

    part: LocalSnapshotPart
    recorded_bytes: int = 0


@dataclass(frozen=True, slots=True)
class SnapshotFailed:
    """This process cannot contribute to ``snapshot_id``; the detector should abort it."""

    snapshot_id: int
    reason: str


Action = SendEntry | RecordState | ReportPart | SnapshotFailed

_NOTHING: tuple[Action, ...] = ()
_payload = operator.attrgetter("payload")
_counters = operator.attrgetter("counters")
_no_wake = operator.attrgetter("no_wake")


@dataclass(slots=True)
class _Recording:
    """What one process keeps for one snapshot between recording and finish (or deadline)."""

    snapshot_id: int
    received_at_record: dict[str, int]  # m per inbound channel
    deadline: float
    started: bool  # a start with a lifetime set the deadline (a marker's default can still be replaced)
    closed: set[str] = field(default_factory=set)  # inbound channels whose marker arrived
    # Channels closed by a sender incarnation that restarted since: the new one's marker is its first.
    closed_before_reset: set[str] = field(default_factory=set)
    recorded_bytes: int = 0
    failed: bool = False


class FinishedIds:
    """Snapshot ids a process is done with, remembered up to a bound: the oldest is forgotten first."""

    def __init__(self, bound: int = _FINISHED_MEMORY) -> None:
        self._bound = bound
        self._ids: set[int] = set()
        self._order: deque[int] = deque()

    def __contains__(self, snapshot_id: object) -> bool:
        return snapshot_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def add(self, snapshot_id: int) -> int | None:
        """Remember ``snapshot_id``; the id forgotten to keep the bound, if one was."""
        if snapshot_id in self._ids:
            return None
        self._ids.add(snapshot_id)
        self._order.append(snapshot_id)
        if len(self._order) <= self._bound:
            return None
        forgotten = self._order.popleft()
        self._ids.discard(forgotten)
        return forgotten

    def keep_only(self, wanted: Callable[[int], bool]) -> None:
        """Forget every id ``wanted`` says no to, keeping the others in their order."""
        self._order = deque(filter(wanted, self._order))
        self._ids = set(self._order)


def payload_bytes(messages: Sequence[AppMessage]) -> int:
    """The payload bytes of a run of messages (summed in C: every run delivered passes here)."""
    return sum(map(len, map(_payload, messages)))


def _size(messages: Sequence[AppMessage]) -> int:
    """The bytes a run of messages is charged against ``max_recorded_bytes``."""
    return payload_bytes(messages) + _COUNTER_COST * sum(map(len, filter(None, map(_counters, messages))))


class SnapshotCore:
    """The protocol state of one process. See the module docstring for the rules it follows."""

    def __init__(
        self,
        process_id: str,
        outbound: Iterable[str] = (),
        *,
        max_recorded_bytes: int = DEFAULT_MAX_RECORDED_BYTES,
        max_recordings: int = DEFAULT_MAX_RECORDINGS,
        default_lifetime: float = DEFAULT_LIFETIME,
    ) -> None:
        problem = process_id_problem(process_id)
        if problem is not None:
            raise LocalProtocolError(problem)
        if max_recorded_bytes <= 0:
            raise LocalProtocolError(f"max_recorded_bytes must be positive, got {max_recorded_bytes}")
        if max_recordings <= 0:
            raise LocalProtocolError(f"max_recordings must be positive, got {max_recordings}")
        if not default_lifetime > 0:
            raise LocalProtocolError(f"default_lifetime must be positive, got {default_lifetime}")
        self.process_id = process_id
        self.max_recorded_bytes = max_recorded_bytes
        self.max_recordings = max_recordings
        self.default_lifetime = default_lifetime
        self._sent: dict[str, int] = {}  # application messages sent per outbound channel
        self._received: dict[str, int] = {}  # application messages arrived per inbound channel
        self._arrivals = 0  # application messages arrived on all channels
        self._recordings: dict[int, _Recording] = {}
        self._finished = FinishedIds()
        # Per id space, a detector's ids older than its finished ones forgotten from memory count as
        # finished too (a detector's ids increase; local ones come from many agents, so not theirs).
        self._forgotten_below: dict[int, int] = {}
        self._now = 0.0  # the latest time the driver passed
        self._awaiting_state: int | None = None
        for dst in outbound:
            self._check_peer(dst)
            self._sent.setdefault(dst, 0)

    # -- what the driver can ask ---------------------------------------------------------------

    @property
    def outbound_channels(self) -> list[str]:
        """Destinations of the outbound channels, in the order markers are sent on them."""
        return sorted(self._sent)

    @property
    def active_snapshots(self) -> list[int]:
        """Snapshots recorded here and not yet finished."""
        return sorted(self._recordings)

    @property
    def remembered_snapshots(self) -> int:
        """How many finished snapshot ids are remembered (bounded), to ignore their late markers."""
        return len(self._finished)

    @property
    def next_deadline(self) -> float | None:
        """When :meth:`expire` next has something to drop, or None while nothing records."""
        return min((r.deadline for r in self._recordings.values()), default=None)

    def deadline(self, snapshot_id: int) -> float | None:
        """When the recording of ``snapshot_id`` ends unless finished first; None if it is not recording."""
        recording = self._recordings.get(snapshot_id)
        return None if recording is None else recording.deadline

    @property
    def arrivals(self) -> int:
        """Application messages arrived so far on all channels (the last one's arrival index)."""
        return self._arrivals

    def sent_count(self, dst: str) -> int:
        """Application messages sent so far on ``self -> dst``."""
        return self._sent.get(dst, 0)

    def received_count(self, src: str) -> int:
        """Application messages arrived so far on ``src -> self``."""
        return self._received.get(src, 0)

    # -- events --------------------------------------------------------------------------------

    def open_outbound(self, dst: str) -> tuple[Action, ...]:
        """Declare the channel ``self -> dst``; running snapshots put their markers on it first."""
        self._check_ready()
        self._check_peer(dst)
        if dst in self._sent:
            return _NOTHING
        self._sent[dst] = 0
        return self._markers_for_new_channel(dst)

    def send(self, dst: str, messages: int = 1) -> None:
        """``messages`` application messages are sent on ``self -> dst``; the driver puts them on that
        channel next, in order, with nothing between them.

        The channel must be open (constructor or :meth:`open_outbound`), so that the markers of
        running snapshots are already on it. Only the count matters to the protocol, not the content.
        """
        if self._awaiting_state is not None:  # _check_ready, inlined: this runs for every message
            self._check_ready()
        count = self._sent.get(dst)
        if count is None:
            raise LocalProtocolError(f"channel {self.process_id} -> {dst} is not open: call open_outbound first")
        self._sent[dst] = count + messages

    def start_snapshot(
        self, snapshot_id: int, *, now: float | None = None, lifetime: float | None = None
    ) -> tuple[Action, ...]:
        """The detector asks this process to take part in ``snapshot_id`` (idempotent).

        The recording is dropped ``lifetime`` seconds after ``now`` (``default_lifetime`` when
        None or 0). A recording a marker began takes this deadline instead of its default one.
        """
        self._check_ready()
        now = self._clock(now)
        if lifetime is not None and lifetime < 0:
            raise LocalProtocolError(f"lifetime must not be negative, got {lifetime}")
        recording = self._recordings.get(snapshot_id)
        if recording is not None:
            if not recording.started and lifetime:
                recording.deadline = now + lifetime
                recording.started = True
            return _NOTHING
        if self._is_finished(snapshot_id):
            return _NOTHING
        return self._begin_recording(snapshot_id, None, now + (lifetime or self.default_lifetime), bool(lifetime))

    def record_state(
        self,
        snapshot_id: int,
        state: LocalState,
        undelivered: Mapping[str, Sequence[Run]] | None = None,
        *,
        acked: Mapping[str, AckPosition] | None = None,
        acks_seen: Mapping[str, AckPosition] | None = None,
        unprovable: str | None = None,
    ) -> tuple[Action, ...]:
        """Hand over the state captured for the :class:`RecordState` action just returned.

        ``undelivered`` holds, per inbound channel, the runs of messages that arrived but that the
        application has not received yet, in arrival order: they are in flight for this snapshot.
        ``acked`` holds, per inbound channel, the highest acknowledgement sent on it by now, and
        ``acks_seen``, per outbound channel, the highest one received (channels without one are
        left out); the parts carry them to the detector. ``unprovable``, when given, says why the
        driver cannot vouch for this moment (a message it holds that no channel counts, say): the
        snapshot then fails with that reason and reports no part, as no part could be true.
        """
        if self._awaiting_state != snapshot_id:
            expected = "no state" if self._awaiting_state is None else f"snapshot {self._awaiting_state}"
            raise LocalProtocolError(f"record_state({snapshot_id}) called, but the core awaits {expected}")
        recording = self._recordings[snapshot_id]
        if unprovable is not None:
            self._awaiting_state = None
            return (self._fail(recording, unprovable),)
        in_flight = self._take_undelivered(recording, undelivered) if undelivered else {}
        self._awaiting_state = None
        if recording.recorded_bytes > self.max_recorded_bytes:
            bound = f"({recording.recorded_bytes} > {self.max_recorded_bytes})"
            return (self._fail(recording, f"undelivered bytes exceeded the bound {bound}"),)
        part = LocalSnapshotPart(snapshot_id=snapshot_id, process_id=self.process_id)
        part.state.CopyFrom(state)
        seen = acks_seen or {}
        part.outbound.extend(
            OutboundCount(dst=dst, sent_before_marker=self._sent[dst], ack_seen=seen.get(dst))
            for dst in self.outbound_channels
        )
        # Every inbound channel as it stands: one with nothing to say (m = 0, nothing in flight, no
        # acknowledgement) is left out, which tells the detector the same.
        received, acks = recording.received_at_record, acked or {}
        for src in sorted(received.keys() | in_flight.keys() | acks.keys()):
            if received.get(src) or src in in_flight or src in acks:
                self._add_channel(part, recording, src, in_flight.get(src, ()), acks.get(src))
        return (ReportPart(part, recording.recorded_bytes),)

    def receive_message(self, src: str, message: AppMessage) -> tuple[Action, ...]:
        """An application message arrived on ``src -> self``."""
        self._check_ready()
        count = self._received.get(src)
        if count is None:
            self._check_peer(src)
            count = 0
        self._received[src] = count + 1
        self._arrivals += 1
        if not self._recordings:
            return _NOTHING
        return self._record(src, (message,), self._arrivals)

    def receive_messages(self, src: str, messages: Sequence[AppMessage]) -> tuple[Action, ...]:
        """A run of application messages arrived on ``src -> self``, in order (no marker among them).

        The same as :meth:`receive_message` for each, in one call (the transport's hot path).
        """
        self._check_ready()
        if src not in self._received:
            self._check_peer(src)
            self._received[src] = 0
        first = self._arrivals + 1
        self._received[src] += len(messages)
        self._arrivals += len(messages)
        if not self._recordings:
            return _NOTHING
        return self._record(src, messages, first)

    def receive_marker(self, src: str, snapshot_id: int, *, now: float | None = None) -> tuple[Action, ...]:
        """Marker ``snapshot_id`` arrived on ``src -> self`` (at ``now``, if it begins a recording)."""
        self._check_ready()
        if src not in self._received:
            self._check_peer(src)
            self._received[src] = 0
        recording = self._recordings.get(snapshot_id)
        if recording is None:
            if self._is_finished(snapshot_id):
                return _NOTHING
            return self._begin_recording(snapshot_id, src, self._clock(now) + self.default_lifetime, False)
        if src in recording.closed:
            if src in recording.closed_before_reset:
                # The sender restarted after its old incarnation's marker closed the channel; the
                # new incarnation is a new sender, which records on that snapshot's marker (resent
                # to it) and sends its own. The channel's state was complete before the restart.
                recording.closed_before_reset.discard(src)
                return _NOTHING
            channel = f"{src} -> {self.process_id}"
            raise RemoteProtocolError(f"second marker of snapshot {snapshot_id} on channel {channel}")
        recording.closed.add(src)  # everything recorded on it was reported as it came
        return _NOTHING

    def receive(self, src: str, entry: Entry, *, now: float | None = None) -> tuple[Action, ...]:
        """Either kind of entry arrived on ``src -> self`` (dispatches to the two methods above)."""
        if isinstance(entry, Marker):
            return self.receive_marker(src, entry.snapshot_id, now=now)
        return self.receive_message(src, entry)

    def expire(self, now: float) -> tuple[Action, ...]:
        """Drop every recording whose deadline is ``now`` or earlier, reporting each as failed.

        The driver calls it now and then (see :attr:`next_deadline`); a dropped snapshot's late
        markers are ignored like a finished one's. A recording that had failed already was
        reported then and goes quietly.
        """
        self._check_ready()
        now = self._clock(now)
        expired = sorted(k for k, recording in self._recordings.items() if recording.deadline <= now)
        failures: list[Action] = []
        for snapshot_id in expired:
            recording = self._recordings.pop(snapshot_id)
            self._remember(snapshot_id)
            if not recording.failed:
                reason = f"process {self.process_id}: dropped its recording at the deadline, unfinished"
                failures.append(SnapshotFailed(snapshot_id, reason))
        return tuple(failures)

    def new_epoch(self, space: int = 0) -> None:
        """The detector of id space ``space`` started again (a new store): forget its old snapshots.

        Its running recordings are dropped without a report (the new detector never heard of
        them), and its finished ids are forgotten, so the new detector's ids, however small, are
        recorded again. Other detectors' snapshots and local ones (ids from
        :data:`LOCAL_ID_BASE`) are kept.
        """
        self._check_ready()

        def other(snapshot_id: int) -> bool:
            return snapshot_id >= LOCAL_ID_BASE or id_space(snapshot_id) != space

        for snapshot_id in [k for k in self._recordings if not other(k)]:
            del self._recordings[snapshot_id]
        self._finished.keep_only(other)
        self._forgotten_below.pop(space, None)

    def reset_outbound(self, dst: str, in_transit: int) -> tuple[Action, ...]:
        """The receiver on ``self -> dst`` restarted and will see only ``in_transit`` of our messages.

        Its counts start again, so ours must too; running snapshots that counted this channel can
        no longer prove it and fail.
        """
        self._check_ready()
        if dst not in self._sent:
            raise LocalProtocolError(f"channel {self.process_id} -> {dst} is not open")
        self._sent[dst] = in_transit
        reason = f"channel {self.process_id} -> {dst} restarted (its receiver restarted)"
        return self._fail_running(reason)

    def reset_inbound(self, src: str) -> tuple[Action, ...]:
        """The sender on ``src -> self`` restarted: its counts start again from zero, so do ours.

        Running snapshots still recording that channel can no longer prove it and fail. Messages
        of the old sender that are still undelivered must not be passed to :meth:`record_state`.
        A snapshot whose marker on that channel came from the old sender takes one more marker of
        it, the new sender's, as no error: the new sender never sent the first.
        """
        self._check_ready()
        self._check_peer(src)
        self._received[src] = 0
        for recording in self._recordings.values():
            if src in recording.closed:
                recording.closed_before_reset.add(src)
        reason = f"channel {src} -> {self.process_id} restarted (its sender restarted)"
        return self._fail_running(reason, unless_closed=src)

    def finish_snapshot(self, snapshot_id: int) -> None:
        """The detector completed or aborted ``snapshot_id``: forget it and ignore its late markers."""
        self._check_ready()
        self._recordings.pop(snapshot_id, None)
        self._remember(snapshot_id)

    # -- internals -----------------------------------------------------------------------------

    def _check_ready(self) -> None:
        if self._awaiting_state is not None:
            raise LocalProtocolError(f"record_state({self._awaiting_state}, ...) must be called before any other event")

    def _check_peer(self, peer: str) -> None:
        if not peer:
            raise LocalProtocolError("a channel needs a non-empty peer id")
        if peer == self.process_id:
            raise LocalProtocolError(f"process {self.process_id} cannot have a channel to itself")

    def _clock(self, now: float | None) -> float:
        """``now``, remembered as the latest time; the latest time passed before when None."""
        if now is not None and now > self._now:
            self._now = now
        return self._now

    def _is_finished(self, snapshot_id: int) -> bool:
        if snapshot_id in self._finished:
            return True
        return snapshot_id < LOCAL_ID_BASE and snapshot_id < self._forgotten_below.get(id_space(snapshot_id), 0)

    def _remember(self, snapshot_id: int) -> None:
        """Remember ``snapshot_id`` as finished, forgetting the oldest beyond the bounded memory."""
        forgotten = self._finished.add(snapshot_id)
        if forgotten is not None and forgotten < LOCAL_ID_BASE:
            space = id_space(forgotten)
            self._forgotten_below[space] = max(self._forgotten_below.get(space, 0), forgotten + 1)

    def _record(self, src: str, messages: Sequence[AppMessage], first_arrival: int) -> tuple[Action, ...]:
        """Record a run of messages from ``src`` for every snapshot still recording that channel, and
        report it at once (in flight: the detector's proof of the channel may wait for it)."""
        actions: list[Action] = []
        size = -1
        run = (Run(messages, first_arrival),)
        for recording in self._recordings.values():
            if recording.failed or src in recording.closed:
                continue
            if size < 0:
                size = _size(messages)
            recording.recorded_bytes += size
            if recording.recorded_bytes > self.max_recorded_bytes:
                bound = f"({recording.recorded_bytes} > {self.max_recorded_bytes})"
                actions.append(self._fail(recording, f"recorded bytes exceeded the bound {bound}"))
                continue
            part = LocalSnapshotPart(snapshot_id=recording.snapshot_id, process_id=self.process_id)
            self._add_channel(part, recording, src, run)
            actions.append(ReportPart(part, size))
        return tuple(actions)

    def _take_undelivered(
        self, recording: _Recording, undelivered: Mapping[str, Sequence[Run]]
    ) -> dict[str, Sequence[Run]]:
        """Move messages that arrived but were not received yet from ``m`` into the channel states;
        returns them per channel."""
        in_flight: dict[str, Sequence[Run]] = {}
        for src, runs in undelivered.items():
            count = sum(len(run.messages) for run in runs)
            if not count:
                continue
            arrived = recording.received_at_record.get(src, 0)
            if count > arrived:
                raise LocalProtocolError(
                    f"{count} messages undelivered on {src} -> {self.process_id}, but only {arrived} arrived"
                )
            recording.received_at_record[src] = arrived - count
            in_flight[src] = runs
            recording.recorded_bytes += sum(_size(run.messages) for run in runs)
        return in_flight

    def _begin_recording(
        self, snapshot_id: int, first_marker_from: str | None, deadline: float, started: bool
    ) -> tuple[Action, ...]:
        if len(self._recordings) >= self.max_recordings:
            # Refused for good: remembered as finished, so its other markers start nothing either.
            self._remember(snapshot_id)
            running = f"{len(self._recordings)} snapshots are recording, the bound (max_recordings)"
            return (SnapshotFailed(snapshot_id, f"process {self.process_id}: refused, {running}"),)
        recording = _Recording(snapshot_id, dict(self._received), deadline, started)
        if first_marker_from is not None:
            recording.closed.add(first_marker_from)
        self._recordings[snapshot_id] = recording
        self._awaiting_state = snapshot_id
        marker = Marker(snapshot_id)  # one for every channel: channels may keep it a while
        return (RecordState(snapshot_id), *(SendEntry(dst, marker) for dst in self.outbound_channels))

    def _markers_for_new_channel(self, dst: str) -> tuple[Action, ...]:
        """Markers (and n = 0 reports) that a channel opening mid-snapshot must carry first."""
        actions: list[Action] = []
        for snapshot_id, recording in sorted(self._recordings.items()):
            actions.append(SendEntry(dst, Marker(snapshot_id)))
            if not recording.failed:
                part = LocalSnapshotPart(snapshot_id=snapshot_id, process_id=self.process_id)
                part.outbound.append(OutboundCount(dst=dst, sent_before_marker=0))
                actions.append(ReportPart(part))
        return tuple(actions)

    @staticmethod
    def _add_channel(
        part: LocalSnapshotPart, recording: _Recording, src: str, runs: Sequence[Run], acked: AckPosition | None = None
    ) -> None:
        """Add channel ``src`` to ``part`` (open until its marker came) with the messages of ``runs``,
        by column: every message in flight passes here at each snapshot, so a run costs a few
        repeated-field extends done in C, and one object only per message with extras."""
        state = part.inbound.add(
            src=src,
            received_before_recording=recording.received_at_record.get(src, 0),
            acked=acked,
            open=src not in recording.closed,
        )
        for run, first_arrival in runs:
            position = len(state.payloads)
            state.payloads.extend(map(_payload, run))
            state.run_starts.append(first_arrival)
            state.run_lengths.append(len(run))
            if any(map(_counters, run)) or any(map(_no_wake, run)):
                for offset, (_, counters, no_wake) in enumerate(run, start=position):
                    if counters or no_wake:
                        state.extras.add(position=offset, counters=counters, no_wake=no_wake)

    def _fail_running(self, reason: str, unless_closed: str | None = None) -> tuple[Action, ...]:
        """Fail every running snapshot (but those whose marker on ``unless_closed`` already came)."""
        return tuple(
            self._fail(recording, reason)
            for recording in self._recordings.values()
            if not recording.failed and (unless_closed is None or unless_closed not in recording.closed)
        )

    def _fail(self, recording: _Recording, reason: str) -> SnapshotFailed:
        recording.failed = True
        return SnapshotFailed(recording.snapshot_id, f"process {self.process_id}: {reason}")


def apply_recording(
    core: SnapshotCore, actions: Sequence[Action], capture: Callable[[int], LocalState]
) -> list[Action]:
    """Carry out every :class:`RecordState` in ``actions`` with ``capture`` and splice in the result.

    A convenience for drivers that can capture the application's state synchronously.
    """
    resolved: list[Action] = []
    for action in actions:
        if isinstance(action, RecordState):
            resolved.extend(core.record_state(action.snapshot_id, capture(action.snapshot_id)))
        else:
            resolved.append(action)
    return resolved
