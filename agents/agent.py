"""The embeddable agent for asyncio services: channels to peers, the snapshot core, the control stream.

A service creates one :class:`Agent` with its process id, where it listens, how to reach its
peers and the detector; registers a message handler; and sends with :meth:`Agent.send`. The agent
keeps the protocol core and carries out its actions on real gRPC channels.

The contract with the service
-----------------------------
* **Received** means handed to the handler: a message is part of the receiver's state from the
  moment its handler is called. Messages that arrived but still wait in the agent's receive queue
  are in flight: a snapshot records them in their channel's state. A handler that queues work
  must report the queued work in its state.
* **Recording is atomic.** The agent captures the local state on its event loop and puts the
  markers on every channel in the same step: no send and no delivery can fall between. It records
  (for a ``StartSnapshot``, for the first marker of a snapshot, or for :meth:`Agent.start_snapshot`)
  only at one of two kinds of moment:

  1. no message handler is running: while the receive queue is empty, or between two runs of
     messages (the new messages of one frame are handled as a run, without a recording between);
  2. the running handler, an ``async`` one, is blocked in :meth:`Agent.send` waiting for window
     space. Its message is then received, the send it waits in has not happened (its counters are
     still this process's), and the state says what it waits on (see *Flow-control waits*).

  Never while a handler runs otherwise, nor while it awaits anything but window space: a start or
  a marker then waits until the handler returns or blocks in ``send`` (a synchronous handler is
  never interrupted). So a handler's changes between two awaits other than ``send`` are never
  seen half done. The state comes from :attr:`Agent.state` (a :class:`LocalStateKeeper`) or from a
  ``state_provider`` callback, which must be quick, must not block and must not send; the agent
  appends its flow-control waits to either.
* **Activity and set-up are the service's.** :attr:`Agent.state` exists from construction and
  starts *active*: a process that never said it is idle is taken as busy, so termination is never
  claimed on its silence. The agent never changes activity: the service sets it passive when idle,
  and active in the handler of a message that brings work. State set before :meth:`Agent.start`
  is there from the first snapshot, so none sees the process without its counters.
* **Counters on a message are units in transit.** With the built-in state keeper, ``send`` takes
  them out of this process's counters and delivery adds them to the receiver's, each atomically
  with the send or delivery, so tokens are conserved without extra care.
* **Backpressure.** ``send`` waits while the channel's window of unacknowledged entries is full.
  A receiver acknowledges what it has queued for its handler, up to its receive queue's bound
  (``ChannelSettings.inbox_entries`` and ``inbox_bytes``), not what its handler has finished: so
  handlers may send to each other, and a send waits for the receiver's handler only once the
  receiver's queue is full. (So messages acknowledged but not yet handled die with their
  process, as its state does; a queue bounded at one message acknowledges only what was handled.)
  A handler that raises is logged, and delivery goes on with the next message.
* **Flow-control waits.** While a send waits for window space and the receiver has said its queue
  is full (it holds the window), the recorded state carries a ``Wait`` with ``flow_control=True``
  (one per blocked send) on the destination process, removed the moment the window has space.
  Its waiter is the process itself when the send is inside a message handler (the process then
  takes no message until the handler returns), else the asyncio task that sends (named by its
  task name, or ``asyncio task 0x...`` when the detector would refuse that name as a task).
  Handlers blocked sending to each other with full windows and full receive queues are a
  deadlock: the detector reports it, with its cycle. With the state go the channels'
  acknowledgement positions (the highest acknowledgement each inbound channel sent, or owes
  with room in the receive queue; each outbound channel received), so that the detector can
  tell an acknowledgement in transit that will give a blocked send space.
* **Recordings end.** A recording ends when the detector finishes it, or at its deadline: the
  lifetime its ``StartSnapshot`` gives, or ``recording_lifetime`` for one begun by a marker (or a
  local one), checked every ``expire_interval`` seconds and reported as a failure. At most
  ``max_recordings`` run at once; beyond that a snapshot is refused, with a reason. A detector
  with a new store (a new epoch) makes the agent forget every snapshot of the old one.
* **Several detectors.** ``detector`` may name several (a sequence, or addresses separated by
  commas): the agent attaches to each on its own control stream and takes part in all their
  snapshots, whose ids never collide (:mod:`stablewatch.agents.detectors`). ``agent.detectors``
  tells where each stream stands, and the resolve policy each detector stated; one detector down
  never holds up the others. While two detectors state different policies (``--resolve youngest``
  on one, ``oldest`` on the other: they would break two different waits of one deadlock), the
  agent refuses their automatic breaks, reporting ``BREAK_OUTCOME_POLICIES_DISAGREE`` with the
  policies, and logs it once; an operator's break still goes through.
* **One report per snapshot**, mostly: the part sent at the recording holds the state, the
  outbound counts and every inbound channel as it stands, which is all the detector needs for a
  channel that had nothing in flight. Only a channel whose in-flight messages arrive later sends
  one more part, when its marker comes.
* **Breaking a proven deadlock.** Every wait the state reports (an application wait of
  :attr:`Agent.state`, a send blocked on a full window) has an instance id and the time it began.
  A detector that proves a deadlock (with ``--resolve``, or for an operator) may send a
  ``BreakWait`` naming one of them; the agent breaks it at most once, only while it still waits,
  and reports what it did. A blocked :meth:`Agent.send` raises
  :class:`~stablewatch.agents.breaking.DeadlockVictim` and its message is not sent; an application
  wait entered with ``state.waiting(...)`` in an asyncio task raises it where the task awaits; a
  thread learns of it through the wait's :class:`~stablewatch.agents.state.WaitHandle`. Either way
  the waiter may retry after a back-off. A wait lasting longer than ``hint_after`` seconds is
  hinted to the detector, once, which then takes a snapshot at once rather than at its next
  scheduled one.
* The agent never blocks the service on the detector: while it is unreachable, no snapshot runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any

import grpc
import prometheus_client

from stablewatch import __version__
from stablewatch.agents import breaking
from stablewatch.agents.blocked import BlockedSends
from stablewatch.agents.breaking import BreakDispatcher, Broken, Doorbell, HintWatch, OpenWait, WaitSource
from stablewatch.agents.certificates import TlsConfig
from stablewatch.agents.control import ControlClient
from stablewatch.agents.core import (
    LOCAL_ID_BASE,
    Action,
    AppMessage,
    Entry,
    Marker,
    RecordState,
    ReportPart,
    SendEntry,
    SnapshotCore,
    SnapshotFailed,
    payload_bytes,
)
from stablewatch.agents.detectors import DetectorLinks, DetectorStatus, detector_addresses
from stablewatch.agents.frames import COUNTER_OVERHEAD, ENTRY_OVERHEAD, entry_size
from stablewatch.agents.inbound import InboundChannels
from stablewatch.agents.inbox import Inbox, QueuedRun
from stablewatch.agents.metrics import AgentMetrics
from stablewatch.agents.outbound import ChannelSettings, OutboundChannel
from stablewatch.agents.state import LocalStateKeeper, task_problem
from stablewatch.v1 import LocalSnapshotPart, LocalState, Wait, channel_pb2_grpc
from stablewatch.v1.control_pb2 import BREAK_OUTCOME_BROKEN, BreakWait, WaitHint

__all__ = ["Agent", "MessageHandler", "MessageTooLarge"]

_log = logging.getLogger(__name__)

MessageHandler = Callable[[str, AppMessage], Awaitable[None] | None]
PeerResolver = Mapping[str, str] | Callable[[str], str]

DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024
# Frames around a maximal message need a little room beyond it.
_GRPC_SLACK = 64 * 1024


class MessageTooLarge(ValueError):
    """A message is larger than the agent's ``max_message_bytes``."""


def _task_waiter(task: asyncio.Task[Any]) -> str:
    """The name a flow-control wait of ``task`` is reported under: the task's name, unless the
    detector refuses it as a task name (then every part recorded while the send is blocked would
    be refused, and a deadlock behind the window never found): then one made from the task's
    identity, unique among the tasks alive."""
    name = task.get_name()
    # "" names the message handler (the process): a task asyncio let go unnamed is not it.
    return name if name and task_problem(name) is None else f"asyncio task {id(task):#x}"


class _Counted:
    """A wait source whose breaks are counted in the agent's metrics, by kind."""

    def __init__(self, source: WaitSource, kind: str, metrics: AgentMetrics) -> None:
        self._source = source
        self._kind = kind
        self._metrics = metrics

    def break_wait(self, order: BreakWait) -> Broken | None:
        done = self._source.break_wait(order)
        if done is not None and done.outcome == BREAK_OUTCOME_BROKEN:
            self._metrics.broke(self._kind)
        return done

    def open_waits(self) -> Iterable[OpenWait]:
        return self._source.open_waits()

    @property
    def doorbell(self) -> Doorbell:
        return self._source.doorbell

    @doorbell.setter
    def doorbell(self, doorbell: Doorbell) -> None:
        self._source.doorbell = doorbell

    def idle(self) -> bool:
        return self._source.idle()


class Agent:
    """One process's agent: see the module docstring for what it promises the service.

    ``hint_after``: a wait lasting this many seconds is hinted to the detector, once, so that it
    takes a snapshot at once (None: no hints).
    """

    def __init__(
        self,
        process_id: str,
        *,
        listen: str = "127.0.0.1:0",
        advertise: str | None = None,
        peers: PeerResolver | None = None,  # id -> "host:port", or a callable resolving an id
        detector: str | Sequence[str] | None = None,
        handler: MessageHandler | None = None,
        state_provider: Callable[[], LocalState] | None = None,
        tls: TlsConfig | None = None,
        metrics_registry: prometheus_client.CollectorRegistry | None = None,
        metrics_port: int | None = None,
        metrics_address: str = "127.0.0.1",
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        max_recorded_bytes: int | None = None,
        max_recordings: int | None = None,
        recording_lifetime: float | None = None,
        expire_interval: float = 1.0,
        channel_settings: ChannelSettings | None = None,
        heartbeat_interval: float = 1.0,
        incarnation: int | None = None,
        hint_after: float | None = breaking.DEFAULT_HINT_AFTER,
    ) -> None:
        self.process_id = process_id
        self.state = LocalStateKeeper()
        self.metrics = AgentMetrics(metrics_registry)
        self._blocked = BlockedSends()
        #: Breaks a detector's ``BreakWait`` (the control stream's ``on_break``): the waits of
        #: ``agent.state`` and the blocked sends.
        self.breaks = BreakDispatcher(
            [_Counted(self.state, "application", self.metrics), _Counted(self._blocked, "send", self.metrics)]
        )
        self._hint_watch = HintWatch(hint_after) if hint_after is not None else None
        self._hints: asyncio.Task[None] | None = None
        self._metrics_port = metrics_port
        self._metrics_bind = metrics_address
        self._metrics_server: Any = None
        self._listen = listen
        self._advertise = advertise
        self._peers: PeerResolver = peers if peers is not None else {}
        self._detector_addresses = detector_addresses(detector)
        self._handler: MessageHandler | None = None
        self._handler_is_async = False
        if handler is not None:
            self.on_message(handler)
        self._state_provider = state_provider
        self._tls = tls
        self._max_message_bytes = max_message_bytes
        self._settings = channel_settings or ChannelSettings()
        self._heartbeat_interval = heartbeat_interval
        # A new incarnation per start of the process tells peers that its counts start again. It
        # must be greater than every earlier one of the process (the start time in nanoseconds
        # is): peers refuse a smaller one, an older process still running, as a zombie's.
        self.incarnation = incarnation if incarnation is not None else time.time_ns()
        options: dict[str, Any] = {
            "max_recorded_bytes": max_recorded_bytes,
            "max_recordings": max_recordings,
            "default_lifetime": recording_lifetime,
        }
        self._core = SnapshotCore(process_id, **{k: v for k, v in options.items() if v is not None})
        self._expire_interval = expire_interval
        self._expiry: asyncio.Task[None] | None = None
        self._grpc_options = [
            ("grpc.max_send_message_length", max_message_bytes + _GRPC_SLACK),
            ("grpc.max_receive_message_length", max_message_bytes + _GRPC_SLACK),
        ]
        self._outbound: dict[str, OutboundChannel] = {}
        # The recording lock: held by the delivery task while an async handler runs, except while
        # that handler is blocked in send; taken by whatever may make the process record.
        self._lock: asyncio.Lock | None = None
        self._inbox = Inbox(self._settings.inbox_entries, self._settings.inbox_bytes)
        self._delivery: asyncio.Task[None] | None = None
        self._in_run = False  # the delivery task is inside a run of the (async) message handler
        self._server: grpc.aio.Server | None = None
        self._inbound: InboundChannels | None = None
        self._links: DetectorLinks | None = None
        self._port = 0
        self._part_listeners: list[Callable[[LocalSnapshotPart], None]] = []
        # Local snapshot ids live in their own space, from 2**63: the detector's are below.
        self._local_ids = itertools.count(LOCAL_ID_BASE)

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        """Listen for peers, and dial the detector if one is configured (without waiting for it)."""
        self._lock = asyncio.Lock()
        self._inbound = InboundChannels(
            self.process_id,
            self.incarnation,
            lock=self._lock,
            inbox=self._inbox,
            accept=self._accept,
            on_sender_restart=self._sender_restarted,
            metrics=self.metrics,
            read_ahead_entries=self._settings.read_ahead_entries,
            read_ahead_bytes=self._settings.read_ahead_bytes,
            ack_delay=self._settings.ack_delay,
        )
        loop = asyncio.get_running_loop()
        self._delivery = loop.create_task(self._deliver_forever(), name=f"delivery-{self.process_id}")
        await self._start_server()
        self._expiry = loop.create_task(self._expire_forever(), name=f"expiry-{self.process_id}")
        if self._metrics_port is not None:
            self._metrics_server, _ = self.metrics.serve_http(self._metrics_port, self._metrics_bind)
        if self._detector_addresses:
            self._links = DetectorLinks(self._detector_addresses, self._control_client, self._detector_changed)
            await self._links.start()
            if self._hint_watch is not None:
                hints = breaking.hint_forever(self.breaks, self._hint_watch, self._send_hint)
                self._hints = loop.create_task(hints, name=f"hints-{self.process_id}")

    async def stop(self) -> None:
        """Close the control stream, every channel and the server."""
        if self._hints is not None:
            self._hints.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._hints
        if self._links is not None:
            await self._links.stop()
        for task in (self._expiry, self._delivery):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        for channel in self._outbound.values():
            await channel.close()
        if self._server is not None:
            await self._server.stop(grace=0.5)
        if self._metrics_server is not None:
            await asyncio.to_thread(self._metrics_server.shutdown)
            self._metrics_server.server_close()

    async def restart_server(self) -> None:
        """Stop listening and listen again on the same port (to reload certificates, say).

        Channel sequence state is kept, so senders resume exactly where they were.
        """
        if self._server is not None:
            await self._server.stop(grace=0)
        self._listen = f"{self._listen.rsplit(':', 1)[0]}:{self._port}"
        await self._start_server()

    async def __aenter__(self) -> Agent:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    @property
    def address(self) -> str:
        """Where peers reach this agent (host:port), as registered with the detector."""
        if self._advertise:
            return self._advertise
        return f"{self._listen.rsplit(':', 1)[0]}:{self._port}"

    @property
    def metrics_address(self) -> str | None:
        """Where /metrics is served (host:port), when ``metrics_port`` was given."""
        if self._metrics_server is None:
            return None
        return f"{self._metrics_bind}:{self._metrics_server.server_port}"

    @property
    def detector_connected(self) -> bool:
        """Whether a detector (at least one, when several are given) has accepted this agent."""
        return self._links is not None and self._links.connected

    @property
    def detectors(self) -> tuple[DetectorStatus, ...]:
        """Each detector's control stream: its address, whether it is up, its id space, its latest event,
        and the resolve policy it stated."""
        return self._links.status() if self._links is not None else ()

    # -- the service's side --------------------------------------------------------------------

    def on_message(self, handler: MessageHandler) -> MessageHandler:
        """Register the handler called with ``(sender, message)`` for every delivered message."""
        self._handler = handler
        self._handler_is_async = inspect.iscoroutinefunction(handler)
        return handler

    def on_part(self, listener: Callable[[LocalSnapshotPart], None]) -> None:
        """Also hand every local snapshot part to ``listener`` (for tests and detector-less use).

        It runs on the agent's event loop, synchronously; an exception it raises is logged and
        changes nothing else."""
        self._part_listeners.append(listener)

    async def send(
        self, dest: str, payload: bytes, *, counters: Mapping[str, int] | None = None, wakes: bool = True
    ) -> None:
        """Send ``payload`` to ``dest``, waiting while that channel's window is full.

        ``counters`` are units in transit (taken from this process's counters); ``wakes=False``
        marks a message that wakes no one (a heartbeat). While it waits, the process may record
        (see the module docstring: *Recording is atomic*, *Flow-control waits*). Raises
        :class:`~stablewatch.agents.breaking.DeadlockVictim`, the message not sent (its counters
        still this process's), when stablewatch breaks the wait to end a proven deadlock.
        """
        channel = self._outbound.get(dest) or self._open(dest)
        # The hot path of every message: a plain one with room in the window is counted and queued
        # here, with no await between (the general case is _send_now's).
        if (
            counters is None
            and wakes
            and type(payload) is bytes
            and len(payload) <= self._max_message_bytes
            and channel.has_space()
        ):
            self._core.send(dest)
            channel.push(payload, len(payload) + ENTRY_OVERHEAD)
            return
        if not channel.has_space():
            await self._wait_for_space(channel)
        self._send_now(channel, dest, payload, counters, wakes)

    async def send_many(self, dest: str, payloads: Sequence[bytes]) -> None:
        """Send plain messages (no counters, each can wake) to ``dest``, in order: the same as
        ``send`` for each in turn, in far fewer steps (a stream processor's batch).

        As much of the batch as the window takes goes at once; the rest waits for space, and the
        process may record between two such pieces (never within one). A payload that is not
        bytes or is too large raises before any message of the batch is sent. A broken wait for
        space raises :class:`~stablewatch.agents.breaking.DeadlockVictim`: the pieces before it
        were sent, the rest not.
        """
        for payload in payloads:
            if type(payload) is not bytes:
                raise TypeError(f"send_many takes bytes payloads, got {type(payload).__name__}")
        sizes = [size + ENTRY_OVERHEAD for size in map(len, payloads)]
        largest = max(sizes, default=ENTRY_OVERHEAD) - ENTRY_OVERHEAD
        if largest > self._max_message_bytes:
            raise self._too_large(dest, largest)
        channel = self._outbound.get(dest) or self._open(dest)
        start = 0
        while start < len(payloads):
            if not channel.has_space():
                await self._wait_for_space(channel)
            # No await from here to the push: the piece is sent atomically with respect to recording.
            end = start + channel.free_entries(sizes[start : start + self._settings.window_entries])
            self._core.send(dest, end - start)
            channel.push_many(payloads[start:end], sizes[start:end])
            start = end

    def try_send(
        self, dest: str, payload: bytes, *, counters: Mapping[str, int] | None = None, wakes: bool = True
    ) -> bool:
        """Send without waiting: False (and nothing sent) when the channel's window is full."""
        channel = self._outbound.get(dest) or self._open(dest)
        if not channel.has_space():
            return False
        self._send_now(channel, dest, payload, counters, wakes)
        return True

    async def start_snapshot(self, snapshot_id: int | None = None, *, lifetime: float | None = None) -> int:
        """Record this process for ``snapshot_id`` and send markers; returns the id.

        None takes a fresh local id (from 2**63, never one of the detector's). The recording is
        dropped after ``lifetime`` seconds (the agent's ``recording_lifetime`` when None) unless
        the detector finishes it first.
        """
        if snapshot_id is None:
            snapshot_id = next(self._local_ids)
        assert self._lock is not None, "start() the agent first"
        async with self._lock:
            self._record_now(snapshot_id, lifetime)
        return snapshot_id

    def _record_now(self, snapshot_id: int, lifetime: float | None) -> None:
        """Start ``snapshot_id`` in the core and carry out what it asks (the caller ensures no handler runs)."""
        now = asyncio.get_running_loop().time()
        self._carry_out(self._core.start_snapshot(snapshot_id, now=now, lifetime=lifetime))

    # -- internals: sending --------------------------------------------------------------------

    async def _wait_for_space(self, channel: OutboundChannel) -> None:
        """Wait for window space, counted as a flow-control wait, letting recordings happen meanwhile.

        Raises DeadlockVictim when the wait is broken (see :mod:`stablewatch.agents.blocked`)."""
        task = asyncio.current_task()
        in_handler = task is not None and task is self._delivery
        lock = self._lock
        # A handler blocked here gives up the recording lock: its process may record meanwhile.
        release = in_handler and lock is not None and lock.locked()
        if release:
            lock.release()
        waiter = "" if in_handler or task is None else _task_waiter(task)  # "": the process itself
        try:
            with self._blocked.waiting(waiter, channel):
                while not channel.has_space():
                    await channel.wait_for_space()
        finally:
            if release:
                # Until the handler holds the lock again, a recording queued ahead of it may run:
                # the send is about to go on, and the process is recorded active meanwhile.
                with self._blocked.resuming():
                    await lock.acquire()

    def _send_now(
        self,
        channel: OutboundChannel,
        dest: str,
        payload: bytes,
        counters: Mapping[str, int] | None,
        wakes: bool,
    ) -> None:
        # No await from here on: the send is atomic with respect to recording. This is the hot
        # path of every message, hence the window size computed inline (see frames.entry_size).
        if type(payload) is not bytes:
            if not isinstance(payload, bytearray | memoryview):
                raise TypeError(f"a message payload must be bytes, got {type(payload).__name__}")
            payload = bytes(payload)
        size = len(payload)
        if size > self._max_message_bytes:
            raise self._too_large(dest, size)
        if counters or not wakes:
            outgoing: bytes | AppMessage = AppMessage(payload, counters or None, not wakes)
            if counters:
                size += COUNTER_OVERHEAD * len(counters)
                if self._state_provider is None:
                    self.state.apply_transfer(counters, -1)
        else:
            outgoing = payload
        self._core.send(dest)
        channel.push(outgoing, size + ENTRY_OVERHEAD)

    def _too_large(self, dest: str, size: int) -> MessageTooLarge:
        """The error for a message of ``size`` payload bytes over ``max_message_bytes``."""
        return MessageTooLarge(f"message of {size} bytes to {dest} exceeds max_message_bytes={self._max_message_bytes}")

    def _open(self, dest: str) -> OutboundChannel:
        channel = OutboundChannel(
            self.process_id,
            dest,
            self._resolve(dest),
            incarnation=self.incarnation,
            settings=self._settings,
            metrics=self.metrics,
            on_receiver_restart=lambda in_transit: self._receiver_restarted(dest, in_transit),
            credentials=self._tls.channel_credentials() if self._tls else None,
            channel_options=self._client_options(),
        )
        self._outbound[dest] = channel
        channel.start()
        self._carry_out(self._core.open_outbound(dest))
        return channel

    def _resolve(self, dest: str) -> Callable[[], str]:
        """How to find ``dest``, asked again at every connection attempt (peers move when they restart).

        A map must know ``dest`` at the first send (a typo should fail at once); a resolver callable
        may not know it yet: the channel keeps trying, with backoff.
        """
        peers = self._peers
        if callable(peers):
            return lambda: peers(dest)
        if dest not in peers:
            raise LookupError(f"no address known for peer {dest!r}")
        return lambda: peers[dest]

    def _client_options(self) -> list[tuple[str, Any]]:
        return self._grpc_options + (self._tls.channel_options() if self._tls else [])

    # -- internals: receiving ------------------------------------------------------------------

    def _accept(self, src: str, entries: Sequence[Entry], only_messages: bool) -> None:
        """New entries of one channel, in order, as they arrive (a run with markers under the lock).

        The core counts them now; messages then go to the receive queue, or straight to a
        synchronous handler when nothing waits ahead of them. A marker is taken in as it arrives,
        ahead of messages still queued: they are in flight for its snapshot (core: *Arrived is not
        yet received*).
        """
        if only_messages:
            self._arrive(src, entries)  # type: ignore[arg-type]
            return
        start = 0
        for position, entry in enumerate(entries):
            if type(entry) is Marker:
                if start < position:
                    self._arrive(src, entries[start:position])  # type: ignore[arg-type]
                start = position + 1
                self.metrics.markers_received(1)
                now = asyncio.get_running_loop().time()
                self._carry_out(self._core.receive_marker(src, entry.snapshot_id, now=now))
        if start < len(entries):
            self._arrive(src, entries[start:])  # type: ignore[arg-type]

    def _arrive(self, src: str, messages: Sequence[AppMessage]) -> None:
        actions = self._core.receive_messages(src, messages)
        if actions:
            self._carry_out(actions)
        if self._handler_is_async or self._inbox:
            nbytes = payload_bytes(messages)
            self._inbox.put(src, messages, self._core.arrivals - len(messages) + 1, nbytes)
        else:  # nothing can interleave with a synchronous handler: deliver now, in the reader
            self._hand_over_now(src, messages)

    async def _deliver_forever(self) -> None:
        """The delivery task: hand queued messages to the handler in arrival order."""
        inbox = self._inbox
        while True:
            run = await inbox.next()
            if self._handler_is_async:
                assert self._lock is not None
                async with self._lock:
                    self._in_run = True
                    try:
                        await self._hand_over(run)
                    finally:
                        self._in_run = False
            else:
                self._hand_over_now(run.src, run.messages)
                run.taken = len(run.messages)
            inbox.done(run)

    async def _hand_over(self, run: QueuedRun) -> None:
        """Credit units in transit and await the handler, message by message."""
        src, handler = run.src, self._handler
        keeper_counts = self._state_provider is None
        for taken, message in enumerate(run.messages, 1):
            run.taken = taken  # received from the moment its handler is called
            if keeper_counts and message.counters:
                self.state.apply_transfer(message.counters, +1)
            if handler is not None:
                try:
                    await handler(src, message)  # type: ignore[misc]
                except asyncio.CancelledError:
                    task = asyncio.current_task()
                    if task is None or task.cancelling():
                        raise  # the delivery task itself is cancelled: the agent stops
                    # Something the handler awaited was cancelled under it: a failure of that run,
                    # which must not end the delivery task (no message would be handed over again,
                    # and the process would look idle to the detector, though nothing takes its queue).
                    _log.exception("the message handler of %s was cancelled on a message from %s", self.process_id, src)
                except Exception:
                    _log.exception("the message handler of %s failed on a message from %s", self.process_id, src)
        self.metrics.received(src, len(run.messages), payload_bytes(run.messages))

    def _hand_over_now(self, src: str, messages: Sequence[AppMessage]) -> None:
        """Credit units in transit and call a synchronous handler (or none), message by message."""
        handler = self._handler
        keeper_counts = self._state_provider is None
        for message in messages:
            if keeper_counts and message.counters:
                self.state.apply_transfer(message.counters, +1)
            if handler is not None:
                try:
                    handler(src, message)
                except Exception:
                    _log.exception("the message handler of %s failed on a message from %s", self.process_id, src)
        self.metrics.received(src, len(messages), payload_bytes(messages))

    def _carry_out(self, actions: Sequence[Action]) -> None:
        """Do what the core asks, in order, without yielding to the loop."""
        for action in actions:
            if isinstance(action, SendEntry):
                channel = self._outbound.get(action.dst)
                entry = action.entry
                if channel is None:
                    continue
                if type(entry) is Marker:
                    # A detector snapshot's marker waits for the next entry (core: Markers may wait).
                    local = entry.snapshot_id >= LOCAL_ID_BASE
                    channel.put_marker(entry, None if local else self._core.deadline(entry.snapshot_id))
                else:
                    channel.push(entry, entry_size(entry))
            elif isinstance(action, RecordState):
                provider = self._state_provider
                try:
                    state = provider() if provider else self.state.snapshot()
                except Exception as error:
                    # The core awaits this state before any other event: without one the agent
                    # would be wedged. No state, no true part: the snapshot fails, with the reason.
                    _log.exception(
                        "capturing the state of %s for snapshot %d failed", self.process_id, action.snapshot_id
                    )
                    reason = f"capturing the local state failed: {type(error).__name__}: {error}"
                    self._carry_out(self._core.record_state(action.snapshot_id, LocalState(), unprovable=reason))
                    continue
                waits = self._blocked.waits() if self._blocked else None
                going_on = not state.active and self._blocked.going_on()
                handler_waits = self._handler_waits(state, waits)
                if provider is not None:  # on a copy: the provider may hand out a state it keeps
                    provided, state = state, LocalState()
                    state.CopyFrom(provided)
                    state.ClearField("handler_waits")  # the agent's to say, not the application's
                if waits:
                    state.waits.extend(waits)
                if going_on:
                    state.active = True
                if handler_waits is not None:
                    state.handler_waits = handler_waits
                self.metrics.snapshot_recorded()
                undelivered = self._inbox.undelivered() if self._inbox else None
                # Where acknowledgements stand, for the detector to tell one in transit.
                acked = self._inbound.acked() if self._inbound else None
                seen = {dst: ack for dst, channel in self._outbound.items() if (ack := channel.ack_seen) is not None}
                # A restarted sender's old messages still queued are counted on no channel: a cut
                # now would lose them (a wake-up in transit, units in transit), so it fails.
                stale = self._inbox.uncounted() if self._inbox else None
                unprovable = None if stale is None else f"messages of {stale}'s previous incarnation still queued"
                recorded = self._core.record_state(
                    action.snapshot_id, state, undelivered, acked=acked, acks_seen=seen, unprovable=unprovable
                )
                self._carry_out(recorded)
            elif isinstance(action, ReportPart):
                if action.recorded_bytes:
                    self.metrics.recorded(action.recorded_bytes)
                self._report(action.part)
            elif isinstance(action, SnapshotFailed):
                self.metrics.snapshot_failed()
                if self._links is not None:
                    self._links.report_failure(action.snapshot_id, action.reason)

    def _handler_waits(self, state: LocalState, blocked: Sequence[Wait] | None) -> bool | None:
        """``LocalState.handler_waits`` for a recording now: whether the message handler is inside a
        run that waits (its send recorded blocked, or a ``waiting()`` block of its run). None when
        that is not known (waits a state provider reports carry no task to tell the handler's from
        others').

        A recording holds the lock the handler holds across a run, except while the handler is
        blocked on a send: so the handler is between runs, or in that send (recorded as a wait of
        task "" while the receiver holds the window, else about to go on), with the ``waiting()``
        blocks it entered before still open. A wait of ``add_wait`` is the process's, which may
        outlast a run (a reply awaited across runs, while the handler takes what comes).
        """
        if not self._in_run:
            return False
        if any(not w.task for w in blocked or ()):
            return True
        if self._state_provider is not None:
            return None
        return self.state.waiting_in(self._delivery)

    def _report(self, part: LocalSnapshotPart) -> None:
        for listener in self._part_listeners:
            # A listener runs inside the handling of a frame: its error must not break the channel
            # (the frame would come again, and its markers twice).
            try:
                listener(part)
            except Exception:
                _log.exception("a part listener of %s failed on snapshot %d", self.process_id, part.snapshot_id)
        if self._links is not None:
            self._links.report_part(part)

    async def _detector_start(self, snapshot_id: int, lifetime: float | None) -> None:
        await self.start_snapshot(snapshot_id, lifetime=lifetime)

    def _detector_start_now(self, snapshot_id: int, lifetime: float | None) -> bool:
        """Record for a detector's start right away if no handler holds the recording lock."""
        if self._lock is None or self._lock.locked():
            return False
        self._record_now(snapshot_id, lifetime)
        return True

    def _finish_snapshot(self, snapshot_id: int) -> None:
        self._core.finish_snapshot(snapshot_id)

    def _control_client(
        self, address: str, on_registered: Callable[[int], str | None], on_event: Callable[[str, str], None]
    ) -> ControlClient:
        """The control stream to the detector at ``address`` (see :class:`DetectorLinks`)."""

        def new_epoch(epoch: int) -> None:
            # That detector's ids start again (a new store): forget its old snapshots, not the others'.
            self._core.new_epoch(client.id_space or 0)

        client = ControlClient(
            self.process_id,
            self.address,
            address,
            on_start=self._detector_start,
            on_start_now=self._detector_start_now,
            on_finish=self._finish_snapshot,
            on_epoch=new_epoch,
            credentials=self._tls.channel_credentials() if self._tls else None,
            channel_options=self._grpc_options + (self._tls.control_channel_options() if self._tls else []),
            incarnation=self.incarnation,
            agent_version=__version__,
            heartbeat_interval=self._heartbeat_interval,
            on_event=on_event,
            on_break=self.breaks.handle,
            on_registered=on_registered,
        )
        return client

    async def _expire_forever(self) -> None:
        """Drop recordings past their deadline, every ``expire_interval`` seconds."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self._expire_interval)
            actions = self._core.expire(loop.time())
            if actions:
                self._carry_out(actions)

    def _sender_restarted(self, src: str) -> None:
        self._inbox.forget(src)
        self._carry_out(self._core.reset_inbound(src))

    def _receiver_restarted(self, dest: str, in_transit: int) -> None:
        self._carry_out(self._core.reset_outbound(dest, in_transit))
        self.metrics.receiver_restarted(dest)

    def _send_hint(self, hint: WaitHint) -> bool:
        if self._links is not None and self._links.send_hint(hint):
            self.metrics.hinted()
            return True
        return False

    def _detector_changed(self, address: str, connected: bool) -> None:
        self.metrics.detector_connected(address, connected)
        self.metrics.control_connected(self._links is not None and self._links.connected)

    async def _start_server(self) -> None:
        assert self._inbound is not None
        # No port sharing: a second agent on the same port must fail, not split the traffic.
        server = grpc.aio.server(options=[*self._grpc_options, ("grpc.so_reuseport", 0)])
        channel_pb2_grpc.add_PeerServicer_to_server(self._inbound, server)
        if self._tls is None:
            port = server.add_insecure_port(self._listen)
        else:
            port = server.add_secure_port(self._listen, self._tls.server_credentials())
        if port == 0:
            raise OSError(f"agent {self.process_id} cannot listen on {self._listen}")
        await server.start()
        self._server, self._port = server, port
