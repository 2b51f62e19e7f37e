"""Prometheus metrics of one agent: traffic per peer, markers, snapshots, windows, rejections,
broken waits and long-wait hints.

Every metric is named ``stablewatch_agent_*`` and registered into the registry it is given (the
service's own) or a new private one; the global default registry is used only when passed
explicitly (``registry=prometheus_client.REGISTRY``). The only label is ``peer`` (bounded by the
number of peers), for rejected frames ``reason`` (bounded by :data:`REJECT_REASONS`), or for
broken waits ``kind`` (:data:`BREAK_KINDS`); the process id is a target label added by Prometheus,
not a metric label.

The transport calls one method per frame or batch. Each peer's labelled children are looked up
once and cached, so the hot path is a dict lookup and an ``inc``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from stablewatch.agents.frames import FRAME_ERRORS

__all__ = ["BREAK_KINDS", "REJECT_REASONS", "AgentMetrics"]

PREFIX = "stablewatch_agent"

REJECT_REASONS: tuple[str, ...] = (*FRAME_ERRORS, "other")
"""The values of the ``reason`` label of ``stablewatch_agent_rejected_frames_total``: the
transport's frame errors and ``other``, which counts any unknown reason so that the label set
stays bounded."""

BREAK_KINDS: tuple[str, ...] = ("application", "send")
"""The values of the ``kind`` label of ``stablewatch_agent_breaks_total``: an ``application`` wait
(``agent.state``) or a ``send`` blocked on a full window."""


@dataclass(frozen=True, slots=True)
class _PeerChildren:
    """The labelled children of one peer, looked up once."""

    messages_sent: Counter
    messages_received: Counter
    bytes_sent: Counter
    bytes_received: Counter
    retransmitted: Counter
    reconnects: Counter
    receiver_restarts: Counter
    window_entries: Gauge
    window_bytes: Gauge


class AgentMetrics:
    """The agent's metrics, registered into `registry` (a new private one if None)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        registry = self.registry

        def counter(name: str, doc: str, *labels: str) -> Counter:
            return Counter(f"{PREFIX}_{name}", doc, labels, registry=registry)

        def gauge(name: str, doc: str, *labels: str) -> Gauge:
            return Gauge(f"{PREFIX}_{name}", doc, labels, registry=registry)

        self._messages_sent = counter("messages_sent", "Application messages sent", "peer")
        self._messages_received = counter("messages_received", "Application messages received", "peer")
        self._bytes_sent = counter("sent_bytes", "Bytes of channel entries sent", "peer")
        self._bytes_received = counter("received_bytes", "Bytes of channel entries received", "peer")
        self._retransmitted = counter("retransmitted_entries", "Channel entries sent again after a reconnect", "peer")
        self._reconnects = counter("reconnects", "Channel streams reopened", "peer")
        self._receiver_restarts = counter(
            "receiver_restarts", "New processes found at a peer's address (its channel's counts reset)", "peer"
        )
        self._window_entries = gauge("window_entries", "Channel entries not yet acknowledged", "peer")
        self._window_bytes = gauge("window_bytes", "Bytes of channel entries not yet acknowledged", "peer")
        self._markers_sent = counter("markers_sent", "Snapshot markers sent")
        self._markers_received = counter("markers_received", "Snapshot markers received")
        self._snapshots_recorded = counter("snapshots_recorded", "Snapshots this process recorded")
        self._snapshots_failed = counter("snapshots_failed", "Snapshots that failed in this process")
        self._recorded_bytes = counter(
            "recorded_bytes", "Bytes of channel messages recorded for snapshots (payloads, and 16 per counter entry)"
        )
        rejected = counter("rejected_frames", "Channel frames rejected, by reason", "reason")
        self._rejected = {reason: rejected.labels(reason) for reason in REJECT_REASONS}
        self._control_connected = gauge(
            "control_connected", "1 while a control stream to a detector (any of them) is up, else 0"
        )
        self._detector_connected = gauge(
            "detector_connected", "1 while the control stream to this detector is up, else 0", "detector"
        )
        breaks = counter("breaks", "Waits broken to end a proven deadlock, by kind (application, send)", "kind")
        self._breaks = {kind: breaks.labels(kind) for kind in BREAK_KINDS}
        self._wait_hints = counter("wait_hints", "Waits that lasted past the hint threshold, hinted to the detector")
        # In the order of _PeerChildren's fields.
        self._per_peer: tuple[Counter | Gauge, ...] = (
            self._messages_sent,
            self._messages_received,
            self._bytes_sent,
            self._bytes_received,
            self._retransmitted,
            self._reconnects,
            self._receiver_restarts,
            self._window_entries,
            self._window_bytes,
        )
        self._peers: dict[str, _PeerChildren] = {}
        self._peers_lock = threading.Lock()

    def _peer(self, peer: str) -> _PeerChildren:
        children = self._peers.get(peer)
        if children is None:
            with self._peers_lock:
                children = self._peers.get(peer)
                if children is None:
                    children = _PeerChildren(*(metric.labels(peer) for metric in self._per_peer))
                    self._peers[peer] = children
        return children

    # -- per peer ---------------------------------------------------------------------------------

    def sent(self, peer: str, messages: int, nbytes: int) -> None:
        """A frame to `peer` went out with `messages` application messages in `nbytes` bytes."""
        children = self._peer(peer)
        children.messages_sent.inc(messages)
        children.bytes_sent.inc(nbytes)

    def received(self, peer: str, messages: int, nbytes: int) -> None:
        """A frame from `peer` came in with `messages` application messages in `nbytes` bytes."""
        children = self._peer(peer)
        children.messages_received.inc(messages)
        children.bytes_received.inc(nbytes)

    def retransmitted(self, peer: str, n: int) -> None:
        """`n` unacknowledged entries were sent to `peer` again after a reconnect."""
        self._peer(peer).retransmitted.inc(n)

    def reconnected(self, peer: str) -> None:
        """The stream to or from `peer` was reopened."""
        self._peer(peer).reconnects.inc()

    def receiver_restarted(self, peer: str) -> None:
        """A new process of `peer` acknowledged the channel: its counts were reset to the window."""
        self._peer(peer).receiver_restarts.inc()

    def window(self, peer: str, entries: int, nbytes: int) -> None:
        """The channel to `peer` now has `entries` entries (`nbytes` bytes) not yet acknowledged."""
        children = self._peer(peer)
        children.window_entries.set(entries)
        children.window_bytes.set(nbytes)

    def remove_peer(self, peer: str) -> None:
        """Drop `peer`'s series (it left the membership), so series do not pile up over time."""
        with self._peers_lock:
            if self._peers.pop(peer, None) is None:
                return
            for metric in self._per_peer:
                metric.remove(peer)

    # -- process-wide -----------------------------------------------------------------------------

    def markers_sent(self, n: int) -> None:
        """`n` markers went out."""
        self._markers_sent.inc(n)

    def markers_received(self, n: int) -> None:
        """`n` markers came in."""
        self._markers_received.inc(n)

    def snapshot_recorded(self) -> None:
        """This process recorded its local state for a snapshot."""
        self._snapshots_recorded.inc()

    def snapshot_failed(self) -> None:
        """A snapshot failed in this process (for example its recording grew past the bound)."""
        self._snapshots_failed.inc()

    def recorded(self, nbytes: int) -> None:
        """`nbytes` bytes of channel messages were recorded for snapshots (as charged against the bound)."""
        self._recorded_bytes.inc(nbytes)

    def frame_rejected(self, reason: str) -> None:
        """A channel frame was rejected; a `reason` not in :data:`REJECT_REASONS` counts as ``other``."""
        (self._rejected.get(reason) or self._rejected["other"]).inc()

    def control_connected(self, connected: bool) -> None:
        """Whether a control stream to a detector (any of them) is up."""
        self._control_connected.set(1 if connected else 0)

    def detector_connected(self, detector: str, connected: bool) -> None:
        """The control stream to the detector at ``detector`` went up (True) or down (False)."""
        self._detector_connected.labels(detector).set(1 if connected else 0)

    def broke(self, kind: str) -> None:
        """A wait of `kind` (:data:`BREAK_KINDS`) was broken for a detector's ``BreakWait``."""
        self._breaks[kind].inc()

    def hinted(self) -> None:
        """A wait that lasted past the hint threshold was hinted to the detector."""
        self._wait_hints.inc()

    # -- exposition -------------------------------------------------------------------------------

    def serve_http(self, port: int, addr: str = "127.0.0.1") -> tuple[WSGIServer, threading.Thread]:
        """Serve this registry on ``http://addr:port/metrics`` from a daemon thread.

        Port 0 picks a free port (``server.server_port``). Stop with ``server.shutdown()`` and
        ``server.server_close()``.
        """
        return start_http_server(port, addr=addr, registry=self.registry)
