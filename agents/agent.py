"""The embeddable agent for asyncio services: channels to peers, the snapshot core, the control stream.

A service creates one :class:`Agent` with its process id, where it listens, how to reach its
peers and the detector; registers a message handler; and sends with :meth:`Agent.send`. The agent
keeps the protocol core and carries out its actions on real gRPC channels.

The contract with the service
-----------------------------
* **Received** means handed to the handler: a message is part of the receiver's state once the
  handler returns. A handler that queues work must report the queued work in its state.
* **Recording is atomic.** The agent captures the local state on its event loop, never while a
  handler runs, and puts the markers on every channel in the same step: no send and no delivery
  can fall between. The state comes from :attr:`Agent.state` (a :class:`LocalStateKeeper`) or from
  a ``state_provider`` callback, which must be quick, must not block and must not send.
* **Counters on a message are units in transit.** With the built-in state keeper, ``send`` takes
  them out of this process's counters and delivery adds them to the receiver's, each atomically
  with the send or delivery, so tokens are conserved without extra care.
* **Backpressure.** ``send`` waits while the channel's window of unacknowledged entries is full.
* The agent never blocks the service on the detector: while it is unreachable, no snapshot runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import grpc
import prometheus_client

from stablewatch import __version__
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
)
from stablewatch.agents.frames import COUNTER_OVERHEAD, ENTRY_OVERHEAD, entry_size
from stablewatch.agents.inbound import InboundChannels
from stablewatch.agents.metrics import AgentMetrics
from stablewatch.agents.outbound import ChannelSettings, OutboundChannel
from stablewatch.agents.state import LocalStateKeeper
from stablewatch.agents.tls import TlsConfig
from stablewatch.v1 import LocalSnapshotPart, LocalState, channel_pb2_grpc

__all__ = ["Agent", "MessageHandler", "MessageTooLarge"]

MessageHandler = Callable[[str, AppMessage], Awaitable[None] | None]
PeerResolver = Mapping[str, str] | Callable[[str], str]

DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024
# Frames around a maximal message need a little room beyond it.
_GRPC_SLACK = 64 * 1024


class MessageTooLarge(ValueError):
    """A message is larger than the agent's ``max_message_bytes``."""


class Agent:
    """One process's agent: see the module docstring for what it promises the service."""

    def __init__(
        self,
        process_id: str,
        *,
        listen: str = "127.0.0.1:0",
        advertise: str | None = None,
        peers: PeerResolver | None = None,  # id -> "host:port", or a callable resolving an id
        detector: str | None = None,
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
    ) -> None:
        self.process_id = process_id
        self.state = LocalStateKeeper()
        self.metrics = AgentMetrics(metrics_registry)
        self._metrics_port = metrics_port
        self._metrics_bind = metrics_address
        self._metrics_server: Any = None
        self._listen = listen
        self._advertise = advertise
        self._peers: PeerResolver = peers if peers is not None else {}
        self._detector = detector
        self._handler: MessageHandler | None = None
        self._handler_is_async = False
        if handler is not None:
            self.on_message(handler)
        self._state_provider = state_provider
        self._tls = tls
        self._max_message_bytes = max_message_bytes
        self._settings = channel_settings or ChannelSettings()
        self._heartbeat_interval = heartbeat_interval
        # A new incarnation per start of the process tells peers that its counts start again.
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
        self._lock: asyncio.Lock | None = None
        self._server: grpc.aio.Server | None = None
        self._inbound: InboundChannels | None = None
        self._control: ControlClient | None = None
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
            deliver=self._deliver,
            on_sender_restart=self._sender_restarted,
            metrics=self.metrics,
        )
        await self._start_server()
        self._expiry = asyncio.get_running_loop().create_task(self._expire_forever(), name=f"expiry-{self.process_id}")
        if self._metrics_port is not None:
            self._metrics_server, _ = self.metrics.serve_http(self._metrics_port, self._metrics_bind)
        if self._detector is not None:
            self._control = ControlClient(
                self.process_id,
                self.address,
                self._detector,
                on_start=self._detector_start,
                on_finish=self._finish_snapshot,
                on_epoch=self._new_epoch,
                credentials=self._tls.channel_credentials() if self._tls else None,
                channel_options=self._client_options(),
                incarnation=self.incarnation,
                agent_version=__version__,
                heartbeat_interval=self._heartbeat_interval,
                on_event=self._control_event,
            )
            await self._control.start()

    async def stop(self) -> None:
        """Close the control stream, every channel and the server."""
        if self._control is not None:
            await self._control.stop()
        if self._expiry is not None:
            self._expiry.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._expiry
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
        return self._control is not None and self._control.connected

    # -- the service's side --------------------------------------------------------------------

    def on_message(self, handler: MessageHandler) -> MessageHandler:
        """Register the handler called with ``(sender, message)`` for every delivered message."""
        self._handler = handler
        self._handler_is_async = inspect.iscoroutinefunction(handler)
        return handler

    def on_part(self, listener: Callable[[LocalSnapshotPart], None]) -> None:
        """Also hand every local snapshot part to ``listener`` (for tests and detector-less use)."""
        self._part_listeners.append(listener)

    async def send(
        self, dest: str, payload: bytes, *, counters: Mapping[str, int] | None = None, wakes: bool = True
    ) -> None:
        """Send ``payload`` to ``dest``, waiting while that channel's window is full.

        ``counters`` are units in transit (taken from this process's counters); ``wakes=False``
        marks a message that wakes no one (a heartbeat).
        """
        channel = self._outbound.get(dest) or self._open(dest)
        if not channel.has_space():
            await channel.wait_for_space()
        self._send_now(channel, dest, payload, counters, wakes)

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
            now = asyncio.get_running_loop().time()
            self._carry_out(self._core.start_snapshot(snapshot_id, now=now, lifetime=lifetime))
        return snapshot_id

    # -- internals: sending --------------------------------------------------------------------

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
            raise MessageTooLarge(
                f"message of {size} bytes to {dest} exceeds max_message_bytes={self._max_message_bytes}"
            )
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

    async def _deliver(self, src: str, entries: Sequence[Entry], only_messages: bool) -> None:
        """New entries of one channel, in order; called with the delivery lock held."""
        if only_messages:
            actions = self._core.receive_messages(src, entries)  # type: ignore[arg-type]
            if actions:
                self._carry_out(actions)
            messages = entries
        else:
            messages = []
            for entry in entries:
                if type(entry) is Marker:
                    self.metrics.markers_received(1)
                    now = asyncio.get_running_loop().time()
                    self._carry_out(self._core.receive_marker(src, entry.snapshot_id, now=now))
                else:
                    self._carry_out(self._core.receive_message(src, entry))
                    messages.append(entry)
                    # Delivery must precede a later marker's recording: hand it over now.
                    await self._hand_over(src, (entry,))
            self.metrics.received(src, len(messages), sum(len(m.payload) for m in messages))
            return
        await self._hand_over(src, messages)
        self.metrics.received(src, len(messages), sum(len(m.payload) for m in messages))

    async def _hand_over(self, src: str, messages: Sequence[AppMessage]) -> None:
        """Credit units in transit and call the handler, message by message."""
        handler = self._handler
        keeper_counts = self._state_provider is None
        for message in messages:
            if keeper_counts and message.counters:
                self.state.apply_transfer(message.counters, +1)
            if handler is not None:
                if self._handler_is_async:
                    await handler(src, message)
                else:
                    handler(src, message)

    def _carry_out(self, actions: Sequence[Action]) -> None:
        """Do what the core asks, in order, without yielding to the loop."""
        for action in actions:
            if isinstance(action, SendEntry):
                channel = self._outbound.get(action.dst)
                if channel is not None:
                    channel.push(action.entry, entry_size(action.entry))
            elif isinstance(action, RecordState):
                state = self._state_provider() if self._state_provider else self.state.snapshot()
                self.metrics.snapshot_recorded()
                self._carry_out(self._core.record_state(action.snapshot_id, state))
            elif isinstance(action, ReportPart):
                self._report(action.part)
            elif isinstance(action, SnapshotFailed):
                self.metrics.snapshot_failed()
                if self._control is not None:
                    self._control.report_failure(action.snapshot_id, action.reason)

    def _report(self, part: LocalSnapshotPart) -> None:
        recorded = sum(len(m.payload) for channel in part.inbound for m in channel.messages)
        if recorded:
            self.metrics.recorded(recorded)
        if self._control is not None:
            self._control.report_part(part)
        for listener in self._part_listeners:
            listener(part)

    async def _detector_start(self, snapshot_id: int, lifetime: float | None) -> None:
        await self.start_snapshot(snapshot_id, lifetime=lifetime)

    def _finish_snapshot(self, snapshot_id: int) -> None:
        self._core.finish_snapshot(snapshot_id)

    def _new_epoch(self, epoch: int) -> None:
        """The detector's ids start again (a new store): forget every snapshot of the old epoch."""
        self._core.new_epoch()

    async def _expire_forever(self) -> None:
        """Drop recordings past their deadline, every ``expire_interval`` seconds."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self._expire_interval)
            actions = self._core.expire(loop.time())
            if actions:
                self._carry_out(actions)

    def _sender_restarted(self, src: str) -> None:
        self._carry_out(self._core.reset_inbound(src))

    def _receiver_restarted(self, dest: str, in_transit: int) -> None:
        self._carry_out(self._core.reset_outbound(dest, in_transit))

    def _control_event(self, event: str, detail: str) -> None:
        self.metrics.control_connected(event == "connected")

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
