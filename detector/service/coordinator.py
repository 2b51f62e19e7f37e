"""The detector's side of the control streams: membership and one-hop snapshots.

Agents dial in on ``Control.Attach`` and register. A snapshot begins with the agents attached at
that moment as its members: the coordinator tells all of them at once (a one-hop snapshot: every
marker crosses one channel), feeds their parts to the :class:`Assembler`, and answers when the
snapshot is complete or gives up on it: at its deadline, when a member is lost, when a member
fails, or when a part proves the cut inconsistent, always with the reason. The members learn that
a snapshot ended (so they can forget it) from the next start, which goes to all of them anyway, or,
when none comes within ``ended_notice_delay`` (:data:`ENDED_NOTICE_DELAY`), from one
``SnapshotsEnded`` message: a steady
schedule costs each member one message in per snapshot and one part out, not a third for its end.

Parts are never trusted: each rejected one is reported to ``on_rejected`` with its reason, and its
sender is told to abort that snapshot unless it is a member of it still running (which is told of
its end anyway): every recording an agent keeps ends. A process id that is attached from
elsewhere is refused. Registration answers with the detector's epoch, and every start carries
the snapshot's deadline, so an agent can drop what no detector will ever finish.

An agent that still follows another detector's ids (its Register's ``known_epoch`` is another
epoch) would take this detector's new ids for old finished ones and drop their markers, which
reach it over its peers' channels, not this stream. It is *joining* until a heartbeat carries this
detector's epoch (it has forgotten the old ids), and only then a member that snapshots include.

Breaking deadlocks (DESIGN.md): :meth:`Coordinator.send_break` sends a ``BreakWait`` on one
member's stream; its ``BreakReport`` goes to ``on_break_report`` and an agent's long-wait hints
to ``on_hint``, each with the sender's registered process id. Registration states the detector's
``resolve_policy``: an agent attached to detectors side by side whose policies differ refuses
their automatic breaks, which would make two victims of one deadlock.

RPC mode (DESIGN.md, "RPC mode"): a member that registered with ``rpc_mode`` learns the counts other
members report towards it. For every accepted part from q, each ``OutboundCount(dst=p)`` whose p is
such a member is forwarded to p as a ``ChannelTarget`` (with q's registered incarnation and the
count's session), so that p can report its end of the channel once ``m + recorded == n``.

Who may attach: with an :class:`~.auth.Authorizer` (mutual TLS), a certificate that names no
process is refused before its stream takes a slot, and the registered process id must be one the
agent's certificate names, or the stream ends with PERMISSION_DENIED; parts are then taken only for
that process (the assembler rejects a part naming another as ``spoofed``). A Register whose process
id is empty, too long or holds a control character ends with INVALID_ARGUMENT before anything
quotes it, and every refusal quotes at most a prefix of what the agent sent. The
:class:`~.limits.Limits` bound the streams open, those one identity holds before they register,
the agents attached, the time to register and the size of each part. Every refused stream is
reported to ``on_refused`` with a reason from :data:`~.limits.REFUSAL_REASONS`.

What waits to be written to an agent is bounded too: a member's queue holds at most one
AbortSnapshot per snapshot id, and at most :data:`OUTBOX_LIMIT` messages. A member whose stream is
that far behind (an agent that does not read it) is detached, as a slow watcher is ended, and
reported to ``on_detached`` (``outbox_full``): nothing it was owed is dropped silently, it attaches
again and the usual rules apply (its running snapshots abort, as for any member that leaves).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import NoReturn

import grpc

from stablewatch.agents.breaking import OFF
from stablewatch.detector.assembly import Assembler, Completed, PartRejected
from stablewatch.detector.service.auth import Authorizer, Denied, peer_identity
from stablewatch.detector.service.limits import Limits
from stablewatch.v1 import (
    AgentMessage,
    DetectorMessage,
    GlobalSnapshot,
    LocalSnapshotPart,
    control_pb2,
    control_pb2_grpc,
)
from stablewatch.v1.bounds import (
    MAX_ADDRESS_BYTES,
    MAX_ID_BYTES,
    MAX_NAME_BYTES,
    process_id_problem,
    quoted_prefix,
    text_problem,
    too_long,
)
from stablewatch.v1.ids import id_space, next_id, space_problem

__all__ = [
    "ABORT_KINDS",
    "DETACH_REASONS",
    "ENDED_NOTICE_DELAY",
    "OUTBOX_LIMIT",
    "Coordinator",
    "Member",
    "NoAgents",
    "SnapshotAborted",
]


#: Why snapshots are aborted, in a bounded set (safe as a metric label).
ABORT_KINDS = (
    "deadline",
    "member_detached",
    "member_failed",
    "inconsistent",
    "part_too_large",  # a member's part was over the detector's size bounds (its bytes, messages or a string)
    "no_members",
    "shutdown",
    "too_many_units",  # a counter's units in the cut add up past what a total is counted in
    "store_error",  # the completed snapshot could not be stored
)
#: Why a member was detached by the detector, in a bounded set (safe as a metric label).
DETACH_REASONS = (
    "no_heartbeat",  # silent longer than the heartbeat timeout
    "outbox_full",  # OUTBOX_LIMIT messages queued that its agent has not read
)
#: Messages queued for one member and not yet written to its stream. A member that reads its
#: stream holds a few (a start, ends, one ChannelTarget per peer reporting towards it); the
#: transport buffers megabytes more before a member that stops reading makes the queue grow.
OUTBOX_LIMIT = 4096
#: Seconds the news that a snapshot ended waits for a start to ride on before it goes on its own.
ENDED_NOTICE_DELAY = 0.1
# The most a valid Register takes, encoded: its three strings at their maxima, with room for the tags,
# lengths and numbers.
_MAX_REGISTER_BYTES = MAX_ID_BYTES + MAX_ADDRESS_BYTES + MAX_NAME_BYTES + 64
# The abort kind of a snapshot that a rejected part aborted, by the part's rejection reason.
_ABORT_KIND_OF_REJECTION = {
    "too_large": "part_too_large",
    "too_many_messages": "part_too_large",
    "name_too_long": "part_too_large",
    "too_many_units": "too_many_units",
}


class NoAgents(Exception):
    """A snapshot was requested while no agent is attached."""


class SnapshotAborted(Exception):
    """A snapshot was given up; ``reason`` says why, ``kind`` is one of :data:`ABORT_KINDS`."""

    def __init__(self, snapshot_id: int, reason: str, kind: str) -> None:
        super().__init__(f"snapshot {snapshot_id} aborted: {reason}")
        self.snapshot_id = snapshot_id
        self.reason = reason
        self.kind = kind


@dataclass
class Member:
    """An attached agent."""

    process_id: str
    address: str
    incarnation: int
    attached_at: float  # wall-clock seconds
    last_heartbeat: float  # wall-clock seconds
    rpc_mode: bool = False  # wants a ChannelTarget for every count aimed at it
    outbox: asyncio.Queue[DetectorMessage] = field(repr=False, default_factory=asyncio.Queue)
    pongs: dict[int, asyncio.Future[None]] = field(repr=False, default_factory=dict)
    ended: list[int] = field(repr=False, default_factory=list)  # snapshots that ended, not yet told
    outbox_limit: int = OUTBOX_LIMIT
    #: Called once when the outbox overflows (the stream is ending): the coordinator detaches it.
    on_overflow: Callable[[Member], None] | None = field(repr=False, default=None)
    overflowed: bool = field(repr=False, default=False)
    aborts_queued: set[int] = field(repr=False, default_factory=set)  # snapshot ids of queued aborts
    reader: asyncio.Future[None] | None = field(repr=False, default=None)  # reads the agent's stream

    def send(self, message: DetectorMessage) -> None:
        """Queue ``message`` (the empty one ends the stream); past :data:`OUTBOX_LIMIT`, end it instead."""
        if self.overflowed:
            return  # its stream is ending: the agent attaches again and hears the present then
        kind = message.WhichOneof("kind")
        if kind == "abort":
            # One pending abort per snapshot says all: parts for it may come faster than it is read.
            if message.abort.snapshot_id in self.aborts_queued:
                return
            self.aborts_queued.add(message.abort.snapshot_id)
        if kind and self.outbox.qsize() >= self.outbox_limit:
            self._overflow()
            return
        self.outbox.put_nowait(message)

    def taken(self, message: DetectorMessage) -> None:
        """Note that ``message`` left the outbox for the stream."""
        if message.WhichOneof("kind") == "abort":
            self.aborts_queued.discard(message.abort.snapshot_id)

    def _overflow(self) -> None:
        """End the stream the way a slow watcher's is: drop what is queued, queue the end."""
        self.overflowed = True
        while not self.outbox.empty():
            self.outbox.get_nowait()
        self.aborts_queued.clear()
        self.outbox.put_nowait(DetectorMessage())
        if self.on_overflow is not None:
            self.on_overflow(self)

    def tell_ended(self) -> None:
        """Send the ends not yet told, on their own (no start came to carry them)."""
        if self.ended:
            self.send(DetectorMessage(ended=control_pb2.SnapshotsEnded(snapshot_ids=self.ended)))
            self.ended = []


@dataclass
class _Running:
    members: frozenset[str]
    result: asyncio.Future[GlobalSnapshot]


class Coordinator(control_pb2_grpc.ControlServicer):
    """Serves ``Control.Attach`` and runs snapshots over the attached agents."""

    def __init__(
        self,
        *,
        detector_id: str = "stablewatch",
        heartbeat_interval: float = 1.0,
        epoch: int = 0,
        id_space: int = 0,
        first_snapshot_id: int = 1,
        on_rejected: Callable[[PartRejected], None] | None = None,
        on_membership: Callable[[], None] | None = None,
        on_refused: Callable[[str, str], None] | None = None,
        on_break_report: Callable[[str, control_pb2.BreakReport], None] | None = None,
        on_hint: Callable[[str, control_pb2.WaitHint], None] | None = None,
        on_detached: Callable[[str, str], None] | None = None,
        limits: Limits | None = None,
        authorizer: Authorizer | None = None,
        ended_notice_delay: float = ENDED_NOTICE_DELAY,
        resolve_policy: str = OFF,
    ) -> None:
        self.detector_id = detector_id
        #: Stated to every agent that registers: the victim policy of this detector's automatic
        #: breaks (``--resolve``), or "off" when it breaks none unasked.
        self.resolve_policy = resolve_policy
        self.ended_notice_delay = ended_notice_delay
        self.heartbeat_interval = heartbeat_interval
        self.epoch = epoch
        problem = space_problem(id_space)
        if problem is not None:
            raise ValueError(problem)
        #: This detector's replica: its snapshot ids are those of this id space (stablewatch.v1.ids).
        self.id_space = id_space
        self.members: dict[str, Member] = {}
        self.joining: dict[str, Member] = {}  # registered, still forgetting another detector's ids
        self.limits = limits or Limits()
        self._authorizer = authorizer
        self._streams = 0  # control streams open, registered or not
        self._unregistered: dict[str, int] = {}  # control streams open and not registered yet, per identity
        self._assembler = Assembler(
            max_part_bytes=self.limits.max_part_bytes, max_part_messages=self.limits.max_part_messages
        )
        self._running: dict[int, _Running] = {}
        self._ended_notice: asyncio.TimerHandle | None = None  # flushes members' untold ends
        self._next_id = first_snapshot_id
        self._nonces = iter(range(1, 1 << 63))
        self._on_rejected = on_rejected or (lambda rejected: None)
        self._on_membership = on_membership or (lambda: None)
        self._on_refused = on_refused or (lambda reason, detail: None)
        self._on_break_report = on_break_report or (lambda process_id, report: None)
        self._on_hint = on_hint or (lambda process_id, hint: None)
        self._on_detached = on_detached or (lambda reason, detail: None)
        #: Messages a member's queue may hold (:data:`OUTBOX_LIMIT`), for members that register from now on.
        self.outbox_limit = OUTBOX_LIMIT

    # -- snapshots -----------------------------------------------------------------------------

    def begin_snapshot(
        self,
        snapshot_id: int | None = None,
        *,
        deadline: float = 0.0,
        expected: frozenset[str] = frozenset(),
        expected_count: int = 0,
    ) -> tuple[int, asyncio.Future[GlobalSnapshot]]:
        """Tell every attached agent to record; returns the id and a future of the global snapshot.

        Ids must increase and lie in this detector's id space; by default the next one of the space
        after the last. The future fails with
        :class:`SnapshotAborted` when the snapshot is given up. ``deadline`` (seconds) travels to
        the agents, which drop their recording after it; ``expected`` and ``expected_count`` say
        which processes the cut should hold besides the attached ones (see the assembler).
        """
        if snapshot_id is None:
            snapshot_id = next_id(self._next_id - 1, 0, self.id_space)
        if id_space(snapshot_id) != self.id_space:
            raise ValueError(f"snapshot id {snapshot_id} is not in this detector's id space {self.id_space}")
        if snapshot_id < self._next_id:
            raise ValueError(f"snapshot id {snapshot_id} is not above the last one ({self._next_id - 1})")
        self._next_id = snapshot_id + 1
        if not self.members:
            raise SnapshotAborted(snapshot_id, "no agent is attached", "no_members")
        members = frozenset(self.members)
        # An RPC-mode member proves each channel towards it by its own report (see assembly.py).
        rpc = frozenset(name for name, member in self.members.items() if member.rpc_mode)
        self._assembler.begin(snapshot_id, members, expected=expected, expected_count=expected_count, confirmed_by=rpc)
        result = asyncio.get_running_loop().create_future()
        self._running[snapshot_id] = _Running(members, result)
        deadline_ms = min(max(0, round(deadline * 1000)), 2**32 - 1)
        start = DetectorMessage(start=control_pb2.StartSnapshot(snapshot_id=snapshot_id, deadline_ms=deadline_ms))
        for member in self.members.values():
            if member.ended:  # the ends it was not told of yet ride on this start
                told = control_pb2.StartSnapshot(snapshot_id=snapshot_id, deadline_ms=deadline_ms, ended=member.ended)
                member.send(DetectorMessage(start=told))
                member.ended = []
            else:
                member.send(start)
        if self._ended_notice is not None:  # every end was told: nothing left for the timer
            self._ended_notice.cancel()
            self._ended_notice = None
        return snapshot_id, result

    async def snapshot(
        self,
        timeout: float,
        snapshot_id: int | None = None,
        *,
        expected: frozenset[str] = frozenset(),
        expected_count: int = 0,
    ) -> GlobalSnapshot:
        """Take one snapshot of every attached agent, aborting it after ``timeout`` seconds.

        Raises :class:`SnapshotAborted` (with its reason) when it cannot complete.
        """
        snapshot_id, result = self.begin_snapshot(
            snapshot_id, deadline=timeout, expected=expected, expected_count=expected_count
        )
        # Awaited directly, so that the caller runs as soon as the last part completes the snapshot,
        # before the members are told it is done (a timeout wrapper would cost loop turns).
        deadline = asyncio.get_running_loop().call_later(timeout, self._deadline_passed, snapshot_id, timeout)
        try:
            return await result
        finally:
            deadline.cancel()

    def _deadline_passed(self, snapshot_id: int, timeout: float) -> None:
        missing = self._assembler.missing(snapshot_id)
        self.abort(snapshot_id, f"deadline of {timeout:g}s passed, {missing}", "deadline")

    def abort(self, snapshot_id: int, reason: str, kind: str) -> None:
        """Give up a running snapshot: tell its members, fail its future."""
        if self._assembler.abort(snapshot_id, reason) is not None:
            self._finish(snapshot_id, SnapshotAborted(snapshot_id, reason, kind))

    @property
    def running(self) -> list[int]:
        return sorted(self._running)

    @property
    def open_streams(self) -> int:
        """Control streams open now, registered or not (bounded by ``limits.max_control_streams``)."""
        return self._streams

    @property
    def unregistered_streams(self) -> int:
        """Control streams open now that have not registered yet (each identity holds at most
        ``limits.max_unregistered_per_identity``)."""
        return sum(self._unregistered.values())

    async def ping_all(self, timeout: float) -> float:
        """Send a no-op to every member and wait for every reply: the broadcast round trip, in seconds."""
        members = list(self.members.values())
        nonce = next(self._nonces)
        loop = asyncio.get_running_loop()
        waits = []
        started = time.perf_counter()
        for member in members:
            member.pongs[nonce] = loop.create_future()
            waits.append(member.pongs[nonce])
            member.send(DetectorMessage(ping=control_pb2.Ping(nonce=nonce)))
        try:
            await asyncio.wait_for(asyncio.gather(*waits), timeout)
        finally:
            for member in members:
                member.pongs.pop(nonce, None)
        return time.perf_counter() - started

    def send_break(self, process_id: str, order: control_pb2.BreakWait) -> bool:
        """Send ``order`` on the control stream of ``process_id``; False when it is not attached."""
        member = self._attached(process_id)
        if member is None:
            return False
        member.send(DetectorMessage(break_wait=order))
        return True

    def detach(self, process_id: str) -> None:
        """End a member's (or joining agent's) stream; its snapshots abort as it leaves. For silent ones."""
        member = self._attached(process_id)
        if member is not None:
            member.send(DetectorMessage())
            self._lose(member)

    def expire_silent(self, now: float, timeout: float) -> list[str]:
        """Detach every member or joining agent whose last heartbeat is older than ``timeout`` seconds."""
        attached = [*self.members.values(), *self.joining.values()]
        silent = [m.process_id for m in attached if now - m.last_heartbeat > timeout]
        for process_id in silent:
            self.detach(process_id)
        return silent

    # -- the control service -------------------------------------------------------------------

    async def Attach(
        self, request_iterator: AsyncIterator[AgentMessage], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[DetectorMessage]:
        """One agent's control stream: registration first, then parts, failures, heartbeats, pongs.

        Who may attach is checked before the stream takes a slot, and one identity holds at most
        ``limits.max_unregistered_per_identity`` streams that have not registered yet: a client
        that opens streams and never registers cannot lock the agents out.
        """
        if self._authorizer is not None:
            try:
                self._authorizer.check_agent(context)
            except Denied as denied:
                await self._refuse(context, denied.code, denied.reason, str(denied))
        identity = peer_identity(context)
        waiting = self._unregistered.get(identity, 0)
        if waiting >= self.limits.max_unregistered_per_identity:
            await self._refuse(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "too_many_unregistered",
                f"{quoted_prefix(identity, 128)} has {waiting} control streams open that have not registered, "
                "the most one client may",
            )
        if self._streams >= self.limits.max_control_streams:
            await self._refuse(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "too_many_streams",
                f"the detector has {self._streams} control streams open, its limit",
            )
        self._streams += 1
        self._unregistered[identity] = waiting + 1
        try:
            try:
                member = await self._register(request_iterator, context)
            finally:
                if self._unregistered[identity] == 1:
                    del self._unregistered[identity]
                else:
                    self._unregistered[identity] -= 1
            if isinstance(member, control_pb2.Refused):
                yield DetectorMessage(refused=member)
                return
            # Closed here, not when collected: its end detaches the member at once.
            async with contextlib.aclosing(self._serve(member, request_iterator)) as messages:
                async for message in messages:
                    yield message
        finally:
            self._streams -= 1

    async def _register(
        self, request_iterator: AsyncIterator[AgentMessage], context: grpc.aio.ServicerContext
    ) -> Member | control_pb2.Refused:
        """Read and check the Register; the new member, or a refusal to send when its id is attached.

        An id attached already is refused with a message, not a status: the agent retries, as the
        stream holding it may be one of its own that is dying. Every other refusal ends the stream.
        The Register's strings are checked before anything quotes them (:func:`_register_problem`).
        """
        try:
            first = await asyncio.wait_for(anext(aiter(request_iterator), None), self.limits.register_timeout)
        except TimeoutError:
            timeout = f"no Register within {self.limits.register_timeout:g} s"
            await self._refuse(context, grpc.StatusCode.DEADLINE_EXCEEDED, "no_register", timeout)
        if first is None or first.WhichOneof("kind") != "register":
            await self._refuse(
                context, grpc.StatusCode.INVALID_ARGUMENT, "no_register", "the first message must be a Register"
            )
        register = first.register
        problem = _register_problem(register)
        if problem is not None:
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "bad_register", problem)
        if self._authorizer is not None:
            try:
                self._authorizer.check_process(context, register.process_id)
            except Denied as denied:
                await self._refuse(context, denied.code, denied.reason, str(denied))
        if self._attached(register.process_id) is not None:
            reason = f"process id {quoted_prefix(register.process_id)} is already attached"
            self._on_refused("already_attached", reason)
            return control_pb2.Refused(reason=reason)
        attached = len(self.members) + len(self.joining)
        if attached >= self.limits.max_agents:
            await self._refuse(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "too_many_agents",
                f"{attached} agents are attached, the detector's limit; "
                f"{quoted_prefix(register.process_id)} is refused",
            )
        now = time.time()
        member = Member(
            register.process_id,
            register.address,
            register.incarnation,
            now,
            now,
            register.rpc_mode,
            outbox_limit=self.outbox_limit,
            on_overflow=self._overflowed,
        )
        if register.known_epoch in (0, self.epoch):
            self._admit(member)
        else:
            self.joining[member.process_id] = member
        interval_ms = round(self.heartbeat_interval * 1000)
        registered = control_pb2.Registered(
            detector_id=self.detector_id,
            heartbeat_interval_ms=interval_ms,
            detector_epoch=self.epoch,
            id_space=self.id_space,
            resolve_policy=self.resolve_policy,
        )
        member.send(DetectorMessage(registered=registered))
        return member

    async def _refuse(
        self, context: grpc.aio.ServicerContext, code: grpc.StatusCode, reason: str, detail: str
    ) -> NoReturn:
        self._on_refused(reason, f"{context.peer()}: {detail}")
        await context.abort(code, detail)
        raise AssertionError("unreachable")  # context.abort raises

    async def _serve(
        self, member: Member, request_iterator: AsyncIterator[AgentMessage]
    ) -> AsyncIterator[DetectorMessage]:
        """Send the member its messages while reading its stream, until either ends."""
        reader = member.reader = asyncio.ensure_future(self._read(member, request_iterator))
        # The reader's end queues the same empty message as detach(): one queue to wait on, and no
        # task or wait per message sent (a snapshot sends one to every member, several times).
        reader.add_done_callback(lambda _: member.send(DetectorMessage()))
        try:
            while True:
                message = await member.outbox.get()
                if not message.WhichOneof("kind"):  # detach() or the agent's stream ended
                    break
                member.taken(message)
                yield message
        finally:
            reader.cancel()
            try:
                with contextlib.suppress(asyncio.CancelledError, grpc.RpcError):
                    await reader  # a refused request's error goes on to the handler, which sends it
            finally:
                self._lose(member)

    async def _read(self, member: Member, request_iterator: AsyncIterator[AgentMessage]) -> None:
        async for message in request_iterator:
            kind = message.WhichOneof("kind")
            if kind == "part":
                self._add_part(message.part, member.process_id)
            elif kind == "heartbeat":
                member.last_heartbeat = time.time()
                if message.heartbeat.epoch == self.epoch and self.joining.get(member.process_id) is member:
                    del self.joining[member.process_id]
                    self._admit(member)
            elif kind == "failure":
                failure = message.failure
                running = self._running.get(failure.snapshot_id)
                if running is not None and member.process_id in running.members:
                    reason = f"process {member.process_id} failed: {quoted_prefix(failure.reason, 256)}"
                    self.abort(failure.snapshot_id, reason, "member_failed")
            elif kind == "pong":
                waiter = member.pongs.get(message.pong.nonce)
                if waiter is not None and not waiter.done():
                    waiter.set_result(None)
            elif kind == "break_report":
                self._on_break_report(member.process_id, message.break_report)
            elif kind == "hint":
                self._on_hint(member.process_id, message.hint)

    def _add_part(self, part: LocalSnapshotPart, sender: str) -> None:
        try:
            outcome = self._assembler.add_part(part, sender=sender)
        except PartRejected as rejected:
            if rejected.reason == "late" and self._assembler.changes_nothing(part):
                return  # channels that opened while or after the snapshot ran: nothing on them belongs to it
            self._on_rejected(rejected)
            running = self._running.get(part.snapshot_id)
            attached = self._attached(sender)
            if (running is None or sender not in running.members) and attached is not None:
                # The agent records a snapshot that no one will finish for it (one we are done
                # with, never started, or that it is no member of): tell it to forget, or it
                # would record until its deadline or bound.
                abort = control_pb2.AbortSnapshot(snapshot_id=part.snapshot_id, reason=rejected.detail)
                attached.send(DetectorMessage(abort=abort))
            if rejected.aborted is not None:
                kind = _ABORT_KIND_OF_REJECTION.get(rejected.reason, "inconsistent")
                aborted = SnapshotAborted(part.snapshot_id, rejected.aborted.reason, kind)
                self._finish(rejected.aborted.snapshot_id, aborted)
            return
        self._forward_targets(part, sender)
        if isinstance(outcome, Completed):
            self._finish(outcome.snapshot.snapshot_id, outcome.snapshot)

    def _forward_targets(self, part: LocalSnapshotPart, sender: str) -> None:
        """Send each RPC-mode member the count an accepted part of ``sender`` reports towards it."""
        source = self.members.get(sender)
        if source is None:
            return
        for count in part.outbound:
            member = self.members.get(count.dst)
            if member is None or not member.rpc_mode:
                continue
            target = control_pb2.ChannelTarget(
                snapshot_id=part.snapshot_id,
                src=sender,
                sent=count.sent_before_marker,
                src_incarnation=source.incarnation,
                session=count.session,
            )
            member.send(DetectorMessage(channel_target=target))

    def _finish(self, snapshot_id: int, outcome: GlobalSnapshot | SnapshotAborted) -> None:
        running = self._running.pop(snapshot_id, None)
        if running is None:
            return
        result = running.result
        if not result.done():  # a caller that was cancelled cancelled it
            if isinstance(outcome, SnapshotAborted):
                result.set_exception(outcome)
                result.exception()  # the caller may have stopped waiting: no "never retrieved" noise
            else:
                result.set_result(outcome)
        for process in running.members:
            member = self.members.get(process)
            if member is not None:
                member.ended.append(snapshot_id)
        if self._ended_notice is None:
            loop = asyncio.get_running_loop()
            self._ended_notice = loop.call_later(self.ended_notice_delay, self._tell_ended)

    def _tell_ended(self) -> None:
        """Tell every member the ends that no start carried to it in time."""
        self._ended_notice = None
        for member in self.members.values():
            member.tell_ended()

    def _attached(self, process_id: str) -> Member | None:
        """The member or joining agent registered as ``process_id``, if any."""
        return self.members.get(process_id) or self.joining.get(process_id)

    def _admit(self, member: Member) -> None:
        """Make ``member`` one that the next snapshots include."""
        self.members[member.process_id] = member
        self._on_membership()

    def _overflowed(self, member: Member) -> None:
        """Detach a member whose agent does not read its stream (its outbox is full)."""
        if member.reader is not None:
            member.reader.cancel()  # read no more of a stream that nothing can be written to
        if self._attached(member.process_id) is member:
            self._lose(member)
            self._on_detached(
                "outbox_full",
                f"{quoted_prefix(member.process_id)}: {member.outbox_limit} messages queued that its agent has "
                "not read; it may attach again",
            )

    def _lose(self, member: Member) -> None:
        if self.joining.get(member.process_id) is member:
            del self.joining[member.process_id]
            return
        if self.members.get(member.process_id) is not member:
            return
        del self.members[member.process_id]
        self._on_membership()
        for snapshot_id, running in list(self._running.items()):
            if member.process_id in running.members:
                self.abort(snapshot_id, f"member {member.process_id} detached", "member_detached")


def _register_problem(register: control_pb2.Register) -> str | None:
    """What makes ``register`` unacceptable, quoting a prefix of the culprit; None when nothing does.

    A process id is malformed when it is empty, over :data:`~stablewatch.v1.bounds.MAX_ID_BYTES` or holds a
    control character; an address over :data:`~stablewatch.v1.bounds.MAX_ADDRESS_BYTES` or with a control
    character, or an agent version over :data:`~stablewatch.v1.bounds.MAX_NAME_BYTES`, is malformed too.
    """
    size = register.ByteSize()
    if size > _MAX_REGISTER_BYTES:  # told from the encoding: a huge id is not copied into a str to be refused
        return (
            f"the Register takes {size} bytes, more than a valid one can ({_MAX_REGISTER_BYTES}): its process id "
            f"(at most {MAX_ID_BYTES} bytes), address ({MAX_ADDRESS_BYTES}) or agent version ({MAX_NAME_BYTES}) "
            "is too long"
        )
    problem = process_id_problem(register.process_id)  # the rule the agents' cores apply to themselves
    if problem is not None:
        return f"the Register's {problem}"
    address = register.address
    if (problem := text_problem(address, MAX_ADDRESS_BYTES)) is not None:
        return f"the address {quoted_prefix(address)} {problem}"
    if too_long(register.agent_version, MAX_NAME_BYTES):
        return f"the agent version {quoted_prefix(register.agent_version)} is longer than {MAX_NAME_BYTES} bytes"
    return None
