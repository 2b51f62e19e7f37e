"""Snapshots of processes that talk by gRPC calls (Lai–Yang / Mattern coloring), as a pure state machine.

The sibling of :mod:`stablewatch.agents.core` for RPC mode, where no FIFO channel can carry a
marker. Everything that affects the protocol lives in this module. It does no I/O, keeps no
clock, starts no thread and draws no random number: the interceptors, the tests and their
simulator feed it events and carry out the actions it returns. Time comes in as arguments:
``now`` (seconds of the driver's monotonic clock, for deadlines) and ``wall`` (seconds since the
Unix epoch, to judge a stamp's color).

Theory of operation
-------------------
A *channel* ``q -> p`` is everything q sends p: requests, stream messages, responses, a unary
response's final status. It is not FIFO (calls overtake each other) and not reliable (a call that
ends in UNAVAILABLE may have lost its request or its response). "Received" means delivered: a
request when its handler starts, a response when the caller gets it.

* **Colors and stamps.** A process's *color* is the highest snapshot id it has recorded (0 at
  first). Every message carries the :class:`Stamp` that :meth:`ColorCore.send` returned when it
  was sent: the sender's color, incarnation, session with the receiver and process id.
* **Jump recordings.** When the color rises from ``c0`` to ``c`` — a stamp of color ``c > c0``
  arrives (:meth:`ColorCore.receive`, before the message is delivered) or the detector starts
  ``c`` (:meth:`ColorCore.start_snapshot`) — the process captures its state once: a
  :class:`RecordState` action, answered with :meth:`ColorCore.record_state` before any other
  event. That one capture is the recording for every id in ``(c0, c]``, also for ids it learns of
  only later. So a message of color >= k is always delivered after its receiver recorded k,
  whichever way k reached it: the cut is consistent.
* **Claims.** A snapshot runs here once the detector's start *claims* it. A start for
  ``k <= color`` is served from the kept jump whose range holds ``k``, or fails if none does
  (a state is never recorded late).
* **Breaks.** Once a wait of this process is broken (:meth:`ColorCore.wait_broken`, before the
  detector hears of it), no jump kept from before serves a later start: the start fails. Such a
  jump holds the broken wait, and a cut begun after the break that still showed the deadlock
  whole would make a detector break a second wait of it. Another detector's larger ids (its
  clock ahead) make such starts common: its jump covers this detector's later ids. Claims made
  before the break keep their jump (their snapshots began before the break's report).
* **Counts.** Per peer the process counts what it sent and received. A jump notes both: ``n``
  (everything sent so far has color <= c0 < k, so n holds for every k of the range) and ``m``.
  After the jump every message from the peer with color < c is recorded with its color; the state
  of channel ``q -> p`` in snapshot ``k`` is the recorded messages of color < k, in arrival order.
* **Parts.** At a claim the process reports its state and one ``OutboundCount`` (n, session) for
  every peer known at the jump, n = 0 included, so that the detector forwards every count.
* **Completion by forwarded targets.** The detector forwards each ``OutboundCount`` of q's part to
  its receiver p (:meth:`ColorCore.channel_target`). p reports the channel as soon as
  ``m + recorded(< k) == n``: at once, or when the missing messages arrive. Every message p counts
  in a session, q counted in the same session, once, and one of color < k was sent before q
  recorded k: p's messages are a subset of q's n, so equal counts mean equal sets and the channel
  is exact. A count that passes n fails k, and so does a target whose session or incarnation is
  not p's view of q (the counts cannot be compared).
* **Sessions.** A call can end without either side knowing whether its request or response
  arrived (UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED without our server's trailer); a count may then
  never match again. The side that sees such an end calls :meth:`ColorCore.reset_peer`: its own
  session with the peer rises and its sent count restarts. A count received belongs to the
  sender's session: a stamp or a target naming a newer session (or a new incarnation) of the peer
  is *adopted*: the received count restarts, and the own session rises to at least the peer's, so
  that one side's reset restarts both directions. Any restart fails the running recordings that
  counted the peer. Sessions only rise, so no count mixes two sessions.
* **Stale messages.** A message stamped with a session or incarnation older than the receiver's
  view of its sender was sent before the sender's count restarted. Delivered uncounted, it would
  be in flight for later snapshots without being in their channel: a cut completed before it
  arrived would miss it. So it is not delivered: :meth:`ColorCore.receive` raises
  :class:`StaleStamp`, changing nothing, and the driver rejects the message (to the cut, it was
  lost) with a status its sender does not take for an ambiguous end, stamped with our session so
  that the sender moves on. Only messages overtaken by a newer session of their sender are stale;
  our own reset leaves the peer's session, and its messages in flight, valid.
* **Bad stamps.** Malformed metadata (:meth:`Stamp.decode`), a color at or above
  :data:`LOCAL_ID_BASE`, or a color beyond the wall clock plus ``max_skew`` (the detector's ids
  are microseconds of wall time) raise :class:`RemoteProtocolError` before anything changes: a bad
  stamp never starts a recording. A stamp is checked once: the same stamp again (the driver decodes
  each text once) at or below the color needs no clock, and :meth:`ColorCore.receive_checked`
  takes it in without one (the common case of every call).
* **Bounds.** At most ``max_recordings`` snapshots run at once: beyond, a start is refused with
  a :class:`SnapshotFailed`. At most ``max_recordings`` jumps are kept: a new one makes room by
  dropping the oldest kept jump that no snapshot claims (a start always finds one); when every
  kept jump is claimed, a stamp still raises the color, without a recording. A jump whose
  recorded bytes pass ``max_recorded_bytes`` fails with its snapshots.
* **Deadlines.** A snapshot runs until ``lifetime`` after its start (``default_lifetime`` if none
  is given). A jump is kept ``default_lifetime`` from when it was made, and beyond that while a
  snapshot claims it: a jump whose last claim ended stays until then, as the start of another
  detector's id in its range may still come (see "Several detectors"). :meth:`ColorCore.expire`
  drops what passed its deadline, reporting unfinished snapshots as failed;
  :meth:`ColorCore.finish_snapshot` forgets one the detector completed or aborted.
* **Several detectors.** Detectors side by side each start their own snapshots, with ids of
  their own id space (:mod:`stablewatch.v1.ids`), on their own control streams. The core keeps
  one color sequence for all of them: their ids interleave in one total order (each is its
  start time in microseconds), a color is the highest id of any detector, and a jump to ``c``
  is the recording for every id ``<= c`` of its range, whichever detector's. A message of color
  ``>= k`` is still delivered only after its receiver recorded ``k``, so every detector's cuts
  stay consistent, and one capture serves the snapshots of both detectors that fall in its
  range. Claims, targets and finished ids are kept per whole id, so the detectors' snapshots
  never mix.
* **Epochs.** :meth:`ColorCore.new_epoch` (a detector started again on a new store: its ids
  start again) drops that detector's snapshots without a report and forgets its finished ids;
  other detectors' snapshots and every jump stay (a jump that lost its last claim keeps its
  deadline). The color stays: old ids still travel in other processes' stamps, and a lower
  color would let a message of higher color pass unrecorded.
* **Cost.** :meth:`ColorCore.send` and :meth:`ColorCore.receive` run for every message: a few
  comparisons and counts, plus, for a message of color below ours, one pass over the kept jumps
  (at most ``max_recordings``) and their snapshots. The :class:`RecordedMessage` is built only if a jump records it.

Errors say whose fault they are: :class:`LocalProtocolError` for misuse by the driver,
:class:`RemoteProtocolError` for a peer (or detector) that broke the protocol.
:class:`StaleStamp` is nobody's fault. Calls of a process to itself are outside the protocol: the
driver passes them through uncounted (the detector refuses a channel to itself).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from stablewatch.agents.core import (
    DEFAULT_LIFETIME,
    DEFAULT_MAX_RECORDED_BYTES,
    DEFAULT_MAX_RECORDINGS,
    LOCAL_ID_BASE,
    FinishedIds,
    LocalProtocolError,
    RecordState,
    RemoteProtocolError,
    ReportPart,
    SnapshotFailed,
)
from stablewatch.v1 import LocalSnapshotPart, LocalState, OutboundCount, RecordedMessage
from stablewatch.v1.bounds import process_id_problem
from stablewatch.v1.ids import id_space, space_problem

__all__ = [
    "DEFAULT_MAX_SKEW",
    "STAMP_KEY",
    "Action",
    "ColorCore",
    "MessageSource",
    "StaleStamp",
    "Stamp",
]

#: The one gRPC metadata key that carries a :class:`Stamp` (lower case, as gRPC requires).
STAMP_KEY = "stablewatch-stamp"
#: Seconds a stamp's color may run ahead of the receiver's wall clock (ids are its microseconds).
DEFAULT_MAX_SKEW = 600.0

Action = RecordState | ReportPart | SnapshotFailed
#: A received message as a channel state would hold it, or a function that builds it: called only
#: if the message is recorded, so that no protobuf object is built for the others.
MessageSource = RecordedMessage | Callable[[], RecordedMessage]

_NOTHING: tuple[Action, ...] = ()
_UINT64 = 1 << 64  # stamps' numbers go into uint64 fields
# Plain ASCII digits (int() alone would take signs, spaces, underscores and other scripts' digits),
# at most as many as 2**64 - 1 has; then a process id of printable ASCII, as gRPC metadata holds.
_STAMP = re.compile(r"([0-9]{1,20})\.([0-9]{1,20})\.([0-9]{1,20})\.([ -~]+)")


class StaleStamp(Exception):
    """The message belongs to a session (or incarnation) of its sender that its receiver has left.

    Nobody broke the protocol: a message sent before its sender's count restarted was overtaken by
    a newer one. The driver must not deliver it (see "Stale messages" in the module docstring).
    """


# A NamedTuple rather than a dataclass: one is built for every message sent.
class Stamp(NamedTuple):
    """What a message tells its receiver about its sender, as of the moment it was sent."""

    color: int
    incarnation: int
    session: int
    process_id: str

    def encode(self) -> str:
        """The metadata value ``color.incarnation.session.process_id`` (the id last: it may hold dots)."""
        return f"{self.color}.{self.incarnation}.{self.session}.{self.process_id}"

    @classmethod
    def decode(cls, text: str | bytes) -> Stamp:
        """Parse a metadata value; :class:`RemoteProtocolError` on anything malformed."""
        if isinstance(text, bytes):
            try:
                text = text.decode("ascii")
            except UnicodeDecodeError:
                raise RemoteProtocolError(f"stamp {text[:80]!r} is not ASCII") from None
        match = _STAMP.fullmatch(text)
        if match is None:
            raise RemoteProtocolError(f"stamp {text[:80]!r} is not color.incarnation.session.process_id")
        color, incarnation, session, process_id = match.groups()
        stamp = cls(int(color), int(incarnation), int(session), process_id)
        if stamp.color >= _UINT64 or stamp.incarnation >= _UINT64 or stamp.session >= _UINT64:
            raise RemoteProtocolError(f"stamp {text[:80]!r} has a number beyond 64 bits")
        return stamp


@dataclass(slots=True)
class _Peer:
    """This process's counts with one peer, and its view of the peer."""

    session: int = 0  # ours with the peer: stamped on what we send, the session of `sent`
    sent: int = 0
    incarnation: int | None = None  # the peer's, once a stamp or a target named it
    view: int = 0  # the peer's session with us: the one whose messages `received` counts
    received: int = 0
    stamp: Stamp | None = None  # the stamp of the next message; None once the color or `session` moved
    entry: tuple[str, str] = (STAMP_KEY, "")  # `stamp`'s metadata entry, encoded once per stamp
    # The last stamp received from it (the driver decodes each text once, so the same object comes
    # again): its checks that do not depend on the wall clock passed, and need not run again.
    checked: Stamp | None = None


@dataclass(slots=True)
class _Channel:
    """A jump's record of the channel from one peer: m, then what arrived after the jump."""

    received_before: int  # m
    recorded: list[tuple[int, int, RecordedMessage]] = field(default_factory=list)  # (color, arrival, message)


@dataclass(slots=True)
class _Jump:
    """One capture of the local state: the recording of every snapshot id in ``(lo, hi]``."""

    lo: int
    hi: int
    deadline: float  # applies while no start claims it
    outbound: tuple[tuple[str, int, int], ...]  # (peer, n, our session) for every peer known at the jump
    # Per peer whose counts this jump relies on (known at the jump, or recorded from since): any
    # restart of that peer's counts fails the jump.
    channels: dict[str, _Channel]
    state: LocalState | None = None
    claims: dict[int, _Claim] = field(default_factory=dict)
    recorded_bytes: int = 0
    failure: str | None = None


@dataclass(slots=True)
class _Claim:
    """A snapshot the detector started here, served from a jump."""

    snapshot_id: int
    jump: _Jump
    deadline: float
    pending: dict[str, int] = field(default_factory=dict)  # per source with a target: messages still missing
    closed: set[str] = field(default_factory=set)  # sources whose channel state was reported
    failed: bool = False


class ColorCore:
    """The RPC-mode protocol state of one process. See the module docstring for its rules."""

    def __init__(
        self,
        process_id: str,
        *,
        incarnation: int,
        max_recordings: int = DEFAULT_MAX_RECORDINGS,
        max_recorded_bytes: int = DEFAULT_MAX_RECORDED_BYTES,
        default_lifetime: float = DEFAULT_LIFETIME,
        max_skew: float = DEFAULT_MAX_SKEW,
    ) -> None:
        problem = process_id_problem(process_id)
        if problem is not None:
            raise LocalProtocolError(problem)
        if not 0 <= incarnation < _UINT64:
            raise LocalProtocolError(f"incarnation must fit in 64 bits, got {incarnation}")
        if max_recordings <= 0:
            raise LocalProtocolError(f"max_recordings must be positive, got {max_recordings}")
        if max_recorded_bytes <= 0:
            raise LocalProtocolError(f"max_recorded_bytes must be positive, got {max_recorded_bytes}")
        if not default_lifetime > 0:
            raise LocalProtocolError(f"default_lifetime must be positive, got {default_lifetime}")
        if not max_skew >= 0:
            raise LocalProtocolError(f"max_skew must not be negative, got {max_skew}")
        self.process_id = process_id
        self.incarnation = incarnation
        self.max_recordings = max_recordings
        self.max_recorded_bytes = max_recorded_bytes
        self.default_lifetime = default_lifetime
        self.max_skew = max_skew
        self._color = 0
        self._peers: dict[str, _Peer] = {}
        self._jumps: list[_Jump] = []  # kept jumps, in increasing ranges
        self._claims: dict[int, _Claim] = {}
        self._finished = FinishedIds()
        self._arrivals = 0  # messages delivered from all peers
        self._awaiting: _Jump | None = None  # the jump whose state record_state must bring
        self._color_at_break = 0  # kept jumps up to this color hold a wait broken since: they serve no start

    # -- what the driver can ask ---------------------------------------------------------------

    @property
    def color(self) -> int:
        """The highest snapshot id this process has passed (recorded, or refused)."""
        return self._color

    @property
    def active_snapshots(self) -> list[int]:
        """Snapshots claimed here and not yet finished or expired (failed ones included)."""
        return sorted(self._claims)

    @property
    def recorded_ranges(self) -> list[tuple[int, int]]:
        """The id range ``(lo, hi]`` of every kept jump."""
        return [(jump.lo, jump.hi) for jump in self._jumps]

    @property
    def next_deadline(self) -> float | None:
        """When :meth:`expire` next has something to drop, or None."""
        deadlines = [claim.deadline for claim in self._claims.values()]
        deadlines.extend(jump.deadline for jump in self._jumps if not jump.claims)
        return min(deadlines, default=None)

    def peers(self) -> list[str]:
        """Every peer sent to, received from or named by a target, sorted."""
        return sorted(self._peers)

    def session(self, peer: str) -> int:
        """Our session with ``peer``: the one stamped on what we send it."""
        known = self._peers.get(peer)
        return known.session if known else 0

    def view(self, peer: str) -> tuple[int | None, int]:
        """``peer``'s incarnation (None until one is named) and the session of its messages we count."""
        known = self._peers.get(peer)
        return (known.incarnation, known.view) if known else (None, 0)

    def sent_count(self, peer: str) -> int:
        """Messages sent to ``peer`` in our current session with it."""
        known = self._peers.get(peer)
        return known.sent if known else 0

    def received_count(self, peer: str) -> int:
        """Messages received from ``peer`` in its current session."""
        known = self._peers.get(peer)
        return known.received if known else 0

    # -- events --------------------------------------------------------------------------------

    def send(self, peer: str) -> Stamp:
        """Count one message to ``peer``, sent now, and return the stamp it must carry."""
        self.send_entry(peer)
        return self._peers[peer].stamp  # type: ignore[return-value]  # send_entry set it

    def send_entry(self, peer: str) -> tuple[str, str]:
        """:meth:`send`, returning the stamp as the metadata entry that carries it,
        ``(STAMP_KEY, stamp.encode())`` (the same tuple while the stamp stays the same)."""
        if self._awaiting is not None:  # _check_ready, inlined: this runs for every message
            self._check_ready()
        known = self._peers.get(peer)
        if known is None:
            known = self._new_peer(peer)
        known.sent += 1
        if known.stamp is None:  # one Stamp (and one encoding) per color and session, not per message
            stamp = known.stamp = Stamp(self._color, self.incarnation, known.session, self.process_id)
            known.entry = (STAMP_KEY, stamp.encode())
        return known.entry

    def receive_checked(self, stamp: Stamp, message: MessageSource) -> tuple[Action, ...] | None:
        """:meth:`receive` for the common case that needs no clock: ``stamp`` is the one last checked
        from its sender, its incarnation and session are the ones counted, and its color is at or
        below ours (a checked stamp passed the color's bound when it was checked, and the bound only
        grows; a color at or below ours begins no jump). Returns None, with nothing changed, when
        :meth:`receive` must run instead.
        """
        if self._awaiting is not None:
            self._check_ready()
        color, incarnation, session, src = stamp
        peer = self._peers.get(src)
        if (
            peer is None
            or peer.checked is not stamp
            or color > self._color
            or peer.incarnation != incarnation
            or peer.view != session
        ):
            return None
        peer.received += 1
        self._arrivals += 1
        if color < self._color and self._jumps:  # only jumps above the message's color record it
            recorded = self._record(src, color, message)
            if recorded:
                return tuple(recorded)
        return _NOTHING

    def receive(self, stamp: Stamp, message: MessageSource, now: float, wall: float) -> tuple[Action, ...]:
        """A message with ``stamp`` is about to be delivered (at ``now``; ``wall`` judges its color).

        Raises :class:`RemoteProtocolError` for a bad stamp and :class:`StaleStamp` for a stale one,
        both before anything changes: the driver rejects the message. Otherwise the message is
        counted (and recorded where a jump needs it). If its color is above ours, the actions end
        with a :class:`RecordState`: the driver captures the state and calls :meth:`record_state`
        before it delivers the message. A stamp with this process's own id is a bad stamp: calls
        to itself are the driver's to pass through.
        """
        if self._awaiting is not None:
            self._check_ready()
        color, incarnation, session, src = stamp
        peer = self._peers.get(src)
        actions: list[Action] | tuple[Action, ...]
        if peer is not None and peer.checked is stamp and peer.incarnation == incarnation and peer.view == session:
            # Checked before, and of the session counted: only the color's bound is left.
            if color > (wall + self.max_skew) * 1_000_000:
                raise self._bad_stamp(stamp, wall)
            actions = _NOTHING
        else:
            peer, actions = self._admit(stamp, wall)
            peer.checked = stamp
        if color > self._color:
            recording = self._jump(color, now)  # before the count: m excludes this message
            peer.received += 1
            self._arrivals += 1
            return (*actions, *recording)
        peer.received += 1
        self._arrivals += 1
        if color < self._color and self._jumps:  # only jumps above the message's color record it
            recorded = self._record(src, color, message)
            if recorded:
                return (*actions, *recorded)
        return actions if actions is _NOTHING else tuple(actions)

    def _admit(self, stamp: Stamp, wall: float) -> tuple[_Peer, list[Action] | tuple[Action, ...]]:
        """Check `stamp` whole (:class:`RemoteProtocolError`, :class:`StaleStamp`, before anything
        changes) and adopt its sender's incarnation and session if they are new: the peer, and the
        actions of adopting them."""
        color, incarnation, session, src = stamp
        if (
            not (0 <= color < LOCAL_ID_BASE and 0 <= incarnation < _UINT64 and 0 <= session < _UINT64)
            or color > (wall + self.max_skew) * 1_000_000
            or not src
            or src == self.process_id
        ):
            raise self._bad_stamp(stamp, wall)
        peer = self._peers.get(src)
        if peer is not None and peer.incarnation == incarnation and peer.view == session:
            return peer, _NOTHING
        if peer is None:
            peer = self._new_peer(src)
        elif peer.incarnation is not None and (
            incarnation < peer.incarnation or (incarnation == peer.incarnation and session < peer.view)
        ):
            raise StaleStamp(
                f"message from {src} of incarnation {incarnation}, session {session}: "
                f"{self.process_id} counts incarnation {peer.incarnation}, session {peer.view}"
            )
        return peer, self._adopt(src, peer, incarnation, session)

    def record_state(self, color: int, state: LocalState) -> tuple[Action, ...]:
        """Hand over the state captured for the :class:`RecordState` just returned.

        Returns a :class:`ReportPart` for every snapshot the jump serves already (the one a start
        began; none for a jump a stamp began, until starts claim it).
        """
        jump = self._awaiting
        if jump is None or jump.hi != color:
            expected = "no state" if jump is None else f"the state for color {jump.hi}"
            raise LocalProtocolError(f"record_state({color}) called, but the core awaits {expected}")
        self._awaiting = None
        jump.state = state
        return tuple(ReportPart(self._state_part(claim)) for claim in jump.claims.values())

    def start_snapshot(self, snapshot_id: int, *, now: float, lifetime: float | None = None) -> tuple[Action, ...]:
        """The detector asks this process to take part in ``snapshot_id`` (idempotent).

        The snapshot runs until ``lifetime`` seconds after ``now`` (``default_lifetime`` when None
        or 0). Above the color it begins a jump (:class:`RecordState`); at or below it, it is
        served from the jump that covers it (:class:`ReportPart`) or fails.
        """
        self._check_ready()
        if not 0 < snapshot_id < LOCAL_ID_BASE:
            raise LocalProtocolError(f"snapshot id {snapshot_id} is not a detector id (1 .. LOCAL_ID_BASE - 1)")
        if lifetime is not None and lifetime < 0:
            raise LocalProtocolError(f"lifetime must not be negative, got {lifetime}")
        if snapshot_id in self._claims or snapshot_id in self._finished:
            return _NOTHING
        if len(self._claims) >= self.max_recordings:
            running = f"{len(self._claims)} snapshots are running, the bound (max_recordings)"
            return (self._refuse(snapshot_id, f"refused, {running}"),)
        deadline = now + (lifetime or self.default_lifetime)
        if snapshot_id > self._color:
            # Its jump is kept for sure: fewer snapshots run than the bound, so if the kept jumps
            # reach the bound, one of them is unclaimed and makes room.
            recording = self._jump(snapshot_id, now)
            self._claim(self._jumps[-1], snapshot_id, deadline)  # its part comes with the state
            return recording
        jump = next((jump for jump in self._jumps if jump.lo < snapshot_id <= jump.hi), None)
        if jump is None:
            passed = f"its color passed {snapshot_id} (it is {self._color}) and no kept recording covers it"
            return (self._refuse(snapshot_id, passed),)
        if jump.failure is not None:
            return (self._refuse(snapshot_id, jump.failure),)
        if jump.hi <= self._color_at_break:
            before = f"its recording (color {jump.hi}) was made before a wait of this process was broken"
            return (self._refuse(snapshot_id, f"{before}: a cut begun since must not show that wait"),)
        return (ReportPart(self._state_part(self._claim(jump, snapshot_id, deadline))),)

    def channel_target(
        self, snapshot_id: int, src: str, sent: int, src_incarnation: int, session: int
    ) -> tuple[Action, ...]:
        """The detector forwards ``src``'s count for ``snapshot_id``: it sent ``sent`` messages here,
        in its session ``session``, before it recorded.

        The channel's state is reported as soon as it holds that many messages (perhaps at once).
        """
        self._check_ready()
        numbers = (sent, src_incarnation, session)
        if not src or src == self.process_id or min(numbers) < 0 or max(numbers) >= _UINT64:
            raise RemoteProtocolError(f"malformed channel target: src {src!r}, sent {sent}, session {session}")
        claim = self._claims.get(snapshot_id)
        if claim is None:
            if snapshot_id in self._finished:
                return _NOTHING
            return (self._refuse(snapshot_id, f"a target from {src} came for a snapshot not started here"),)
        if claim.failed:
            return _NOTHING
        channel_name = f"channel {src} -> {self.process_id}"
        if src in claim.pending or src in claim.closed:
            return (self._fail_claim(claim, f"{channel_name}: a second target"),)
        peer = self._peers.get(src)
        if peer is None:
            peer = self._new_peer(src)
        actions: list[Action] = []
        if (
            peer.incarnation is None
            or src_incarnation > peer.incarnation
            or (src_incarnation == peer.incarnation and session > peer.view)
        ):
            actions.extend(self._adopt(src, peer, src_incarnation, session))
            if claim.failed:
                return tuple(actions)
        if src_incarnation != peer.incarnation or session != peer.view:
            counted = f"counts incarnation {peer.incarnation}, session {peer.view}"
            mismatch = f"{channel_name}: the target is of incarnation {src_incarnation}, session {session}; {counted}"
            return (*actions, self._fail_claim(claim, mismatch))
        jump = claim.jump
        channel = jump.channels.get(src)
        if channel is None:
            # src was unknown at the jump and sent nothing below its top since: m = 0. Entered now,
            # so that a restart of src's counts fails the jump.
            channel = jump.channels[src] = _Channel(0)
        count = channel.received_before + sum(1 for color, _, _ in channel.recorded if color < snapshot_id)
        if count > sent:
            return (*actions, self._fail_claim(claim, f"{channel_name}: {count} messages counted, {src} sent {sent}"))
        if count == sent:
            claim.closed.add(src)
            actions.append(ReportPart(self._channel_part(claim, src, channel)))
        else:
            claim.pending[src] = sent - count
        return tuple(actions)

    def wait_broken(self) -> None:
        """A wait of this process was broken (call it before the break's report goes out).

        Jumps kept from before serve no later start (see "Breaks" in the module docstring); their
        running claims go on. Costs nothing per message: the starts compare one number.
        """
        self._check_ready()
        self._color_at_break = self._color  # every kept jump's range ends at or below the color

    def reset_peer(self, peer: str, reason: str) -> tuple[Action, ...]:
        """A call with ``peer`` ended without telling what arrived (``reason`` says how).

        Our session with it rises and our count restarts; the peer restarts its own when it sees
        the new session. Running recordings that counted the peer fail.
        """
        self._check_ready()
        known = self._peers.get(peer)
        if known is None:
            known = self._new_peer(peer)
        known.session += 1
        known.sent, known.stamp = 0, None
        return tuple(self._restarted(peer, f"{reason}; channel counts restarted (session {known.session})"))

    def expire(self, now: float) -> tuple[Action, ...]:
        """Drop what passed its deadline by ``now``, reporting each unfinished snapshot as failed."""
        self._check_ready()
        failures: list[Action] = []
        for snapshot_id in sorted(k for k, claim in self._claims.items() if claim.deadline <= now):
            claim = self._claims.pop(snapshot_id)
            self._end_claim(claim)
            if not claim.failed:
                reason = f"process {self.process_id}: dropped its recording at the deadline, unfinished"
                failures.append(SnapshotFailed(snapshot_id, reason))
        self._jumps = [jump for jump in self._jumps if jump.claims or jump.deadline > now]
        return tuple(failures)

    def finish_snapshot(self, snapshot_id: int) -> None:
        """The detector completed or aborted ``snapshot_id``: forget it, ignore its late starts and targets."""
        self._check_ready()
        claim = self._claims.pop(snapshot_id, None)
        if claim is not None:
            self._end_claim(claim)
        else:
            self._finished.add(snapshot_id)

    def new_epoch(self, space: int = 0) -> None:
        """The detector of id space ``space`` started again (a new store): forget its snapshots.

        Its running snapshots are dropped without a report (the new detector never heard of them)
        and its finished ids are forgotten, so its new ids, however small, run again. Other
        detectors' snapshots stay, and so does every jump: one whose last claim went is kept
        until its deadline. The color stays (see "Epochs" in the module docstring); so do the
        channel counts.
        """
        self._check_ready()
        problem = space_problem(space)
        if problem is not None:
            raise LocalProtocolError(problem)
        for snapshot_id in [k for k in self._claims if id_space(k) == space]:
            claim = self._claims.pop(snapshot_id)
            del claim.jump.claims[snapshot_id]
        self._finished.keep_only(lambda k: id_space(k) != space)

    # -- internals -----------------------------------------------------------------------------

    def _check_ready(self) -> None:
        if self._awaiting is not None:
            raise LocalProtocolError(f"record_state({self._awaiting.hi}, ...) must be called before any other event")

    def _new_peer(self, peer: str) -> _Peer:
        if not peer:
            raise LocalProtocolError("a peer needs a non-empty id")
        if peer == self.process_id:
            raise LocalProtocolError(f"process {self.process_id} cannot count calls to itself")
        known = self._peers[peer] = _Peer()
        return known

    def _bad_stamp(self, stamp: Stamp, wall: float) -> RemoteProtocolError:
        color, incarnation, session, src = stamp
        if not src:
            return RemoteProtocolError("stamp without a process id")
        if src == self.process_id:
            return RemoteProtocolError(f"stamp from {src!r}, this process's own id")
        if min(color, incarnation, session) < 0 or max(color, incarnation, session) >= _UINT64:
            return RemoteProtocolError(f"stamp {stamp.encode()!r} has a number outside 0 .. 2**64 - 1")
        if color >= LOCAL_ID_BASE:
            return RemoteProtocolError(f"stamp from {src}: color {color} is a local snapshot id, not the detector's")
        limit = int((wall + self.max_skew) * 1_000_000)
        return RemoteProtocolError(f"stamp from {src}: color {color} is beyond the detector's ids (> {limit})")

    def _adopt(self, src: str, peer: _Peer, incarnation: int, session: int) -> list[Action]:
        """Take ``(incarnation, session)`` as the peer's current one (callers ruled out an older one)."""
        if peer.incarnation is None:
            # Nothing was ever received from the peer: its first session name restarts no count of ours,
            # unless it is ahead of our own session (it reset, and our direction must restart too).
            peer.incarnation, peer.view = incarnation, session
            if session <= peer.session:
                return []
            peer.session, peer.sent, peer.stamp = session, 0, None
            reason = f"{src} is in session {session}"
        elif incarnation != peer.incarnation:
            peer.incarnation, peer.view, peer.received = incarnation, session, 0
            # Our count went partly to the old incarnation: a session neither side has used restarts it.
            peer.session, peer.sent = max(peer.session, session) + 1, 0
            reason = f"{src} restarted (incarnation {incarnation})"
        else:
            peer.view, peer.received = session, 0
            if session > peer.session:
                peer.session, peer.sent = session, 0
            reason = f"{src} moved to session {session}"
        peer.stamp = None  # our session may have moved
        return self._restarted(src, f"{reason}; channel counts restarted")

    def _restarted(self, peer: str, reason: str) -> list[Action]:
        """Fail every running jump that counted ``peer``: its counts restarted."""
        failures: list[Action] = []
        for jump in self._jumps:
            if jump.failure is None and peer in jump.channels:
                failures.extend(self._fail_jump(jump, reason))
        return failures

    def _make_room(self) -> bool:
        """Whether a new jump may be kept, after dropping the oldest unclaimed one if the bound needs it."""
        if len(self._jumps) < self.max_recordings:
            return True
        for index, jump in enumerate(self._jumps):
            if not jump.claims:
                del self._jumps[index]
                return True
        return False

    def _jump(self, hi: int, now: float) -> tuple[Action, ...]:
        """Raise the color to ``hi``, keeping a jump for ``(color, hi]`` unless the bound refuses it."""
        lo, self._color = self._color, hi
        for peer in self._peers.values():  # their next stamps carry the new color
            peer.stamp = None
        if not self._make_room():
            return _NOTHING  # the ids passed unrecorded: their starts will fail
        peers = sorted(self._peers.items())
        jump = _Jump(
            lo,
            hi,
            now + self.default_lifetime,
            outbound=tuple((name, peer.sent, peer.session) for name, peer in peers),
            channels={name: _Channel(peer.received) for name, peer in peers},
        )
        self._jumps.append(jump)
        self._awaiting = jump
        return (RecordState(hi),)

    def _claim(self, jump: _Jump, snapshot_id: int, deadline: float) -> _Claim:
        claim = jump.claims[snapshot_id] = self._claims[snapshot_id] = _Claim(snapshot_id, jump, deadline)
        return claim

    def _end_claim(self, claim: _Claim) -> None:
        """Forget a claim. Its jump stays until its own deadline, even after its last claim: another
        detector's start for an id of its range may still come (its control stream is not ordered
        with this one's), and only this jump can serve it."""
        del claim.jump.claims[claim.snapshot_id]
        self._finished.add(claim.snapshot_id)

    def _record(self, src: str, color: int, message: MessageSource) -> list[Action]:
        """Record a message of ``color`` from ``src`` in every jump above it; report channels it completes."""
        actions: list[Action] = []
        recorded: RecordedMessage | None = None
        size = 0
        for jump in self._jumps:
            if jump.hi <= color or jump.failure is not None:
                continue
            if recorded is None:
                recorded = message() if callable(message) else message
                size = recorded.ByteSize()
            channel = jump.channels.get(src)
            if channel is None:  # src first heard of after the jump: m = 0, in whatever session
                channel = jump.channels[src] = _Channel(0)
            channel.recorded.append((color, self._arrivals, recorded))
            jump.recorded_bytes += size
            if jump.recorded_bytes > self.max_recorded_bytes:
                bound = f"({jump.recorded_bytes} > {self.max_recorded_bytes})"
                actions.extend(self._fail_jump(jump, f"recorded bytes exceeded the bound {bound}"))
                continue
            for claim in jump.claims.values():
                if claim.snapshot_id <= color or claim.failed:
                    continue
                missing = claim.pending.get(src)
                if missing is None:
                    if src in claim.closed:
                        more = f"channel {src} -> {self.process_id}: more messages than {src} counted"
                        actions.append(self._fail_claim(claim, more))
                elif missing > 1:
                    claim.pending[src] = missing - 1
                else:
                    del claim.pending[src]
                    claim.closed.add(src)
                    actions.append(ReportPart(self._channel_part(claim, src, channel)))
        return actions

    def _state_part(self, claim: _Claim) -> LocalSnapshotPart:
        jump = claim.jump
        part = LocalSnapshotPart(snapshot_id=claim.snapshot_id, process_id=self.process_id)
        if jump.state is not None:
            part.state.CopyFrom(jump.state)
        part.outbound.extend(
            OutboundCount(dst=dst, sent_before_marker=sent, session=session) for dst, sent, session in jump.outbound
        )
        return part

    def _channel_part(self, claim: _Claim, src: str, channel: _Channel) -> LocalSnapshotPart:
        part = LocalSnapshotPart(snapshot_id=claim.snapshot_id, process_id=self.process_id)
        # Built in place: appending a finished channel state would copy every recorded message.
        # The view is still the one the counts were taken in: a change would have failed the jump.
        view = self._peers[src].view
        state = part.inbound.add(src=src, received_before_recording=channel.received_before, session=view)
        add = state.messages.add
        for color, arrival, message in channel.recorded:
            if color < claim.snapshot_id:
                entry = add()
                entry.CopyFrom(message)
                entry.receive_index = arrival
        return part

    def _fail_jump(self, jump: _Jump, reason: str) -> list[Action]:
        """Fail a jump and every snapshot it serves; later claims of it fail with the same reason."""
        jump.failure = reason
        jump.channels.clear()
        return [self._fail_claim(claim, reason) for claim in jump.claims.values() if not claim.failed]

    def _fail_claim(self, claim: _Claim, reason: str) -> SnapshotFailed:
        claim.failed = True
        claim.pending.clear()
        return SnapshotFailed(claim.snapshot_id, f"process {self.process_id}: {reason}")

    def _refuse(self, snapshot_id: int, reason: str) -> SnapshotFailed:
        """Fail a snapshot for good: remembered as finished, so its later starts and targets do nothing."""
        self._finished.add(snapshot_id)
        return SnapshotFailed(snapshot_id, f"process {self.process_id}: {reason}")
