"""Prometheus metrics of one RPC-mode agent: stamped messages, bad and stale stamps, uninstrumented calls,
snapshots, broken waits.

Every metric is named ``stablewatch_agent_rpc_*`` and registered into the registry it is given (the
service's own) or a new private one, as :class:`~stablewatch.agents.metrics.AgentMetrics` does. Labels
are bounded: ``kind`` (:data:`STAMPED_KINDS`, :data:`BREAK_KINDS`), ``side`` (:data:`SIDES`) and
``direction`` (:data:`DIRECTIONS`). Children are looked up once, so the per-call cost is a dict lookup and an ``inc``;
the one counter every call moves, ``stamped_messages``, is plain ints the agent adds to under its own
lock (no second lock per call), formatted only at scrape time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

__all__ = ["BREAK_KINDS", "DIRECTIONS", "SIDES", "STAMPED_KINDS", "RpcAgentMetrics"]

PREFIX = "stablewatch_agent_rpc"

#: What a stamp went out on: a request (a call's opening) or a response (a call's end).
STAMPED_KINDS = ("request", "response")
#: Which interceptor saw a bad or stale stamp: the server (on a request) or the client (on a response).
SIDES = ("server", "client")
#: Calls with an uninstrumented peer: ``inbound`` (served for a client without a stamp) or
#: ``outbound`` (made to a server that answered without one).
DIRECTIONS = ("inbound", "outbound")
#: The waits a break ends: an outgoing ``call`` (cancelled at the caller) or a ``queued`` request
#: (refused with ABORTED before its handler ran).
BREAK_KINDS = ("call", "queued")


class RpcAgentMetrics:
    """The RPC-mode agent's metrics, registered into `registry` (a new private one if None)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        registry = self.registry

        def counter(name: str, doc: str, *labels: str) -> Counter:
            return Counter(f"{PREFIX}_{name}", doc, labels, registry=registry)

        self._stamped = _Tally(
            f"{PREFIX}_stamped_messages", "Requests and responses sent with a stamp, by kind", "kind", STAMPED_KINDS
        )
        registry.register(self._stamped)
        bad = counter("bad_stamps", "Calls refused for a malformed or impossible stamp, by side", "side")
        self._bad = {side: bad.labels(side) for side in SIDES}
        stale = counter(
            "stale_messages",
            "Requests and responses refused (ABORTED) as sent before the counts of their pair restarted, by side",
            "side",
        )
        self._stale = {side: stale.labels(side) for side in SIDES}
        outside = counter("uninstrumented_calls", "Calls passed through to or from a peer without a stamp", "direction")
        self._uninstrumented = {direction: outside.labels(direction) for direction in DIRECTIONS}
        self._resets = counter("peer_resets", "Channel counts restarted after a call ended ambiguously")
        self._recorded = counter("snapshots_recorded", "Local states captured for snapshots (one per jump)")
        self._failed = counter("snapshots_failed", "Snapshots that failed in this process")
        breaks = counter("breaks", "Waits broken to end a proven deadlock, by kind (call, queued)", "kind")
        self._breaks = {kind: breaks.labels(kind) for kind in BREAK_KINDS}
        self._control_connected = Gauge(
            f"{PREFIX}_control_connected",
            "1 while a control stream to a detector (any of them) is up, else 0",
            registry=registry,
        )
        self._detector_connected = Gauge(
            f"{PREFIX}_detector_connected",
            "1 while the control stream to this detector is up, else 0",
            ["detector"],
            registry=registry,
        )

    def stamped(self, kind: str) -> None:
        """A request or a response went out with a stamp (`kind` in :data:`STAMPED_KINDS`).

        Not thread-safe on its own: the agent calls it inside the critical section that sent the stamp.
        """
        self._stamped.counts[kind] += 1

    def bad_stamp(self, side: str) -> None:
        """A call was refused for its stamp, by the server or the client interceptor."""
        self._bad[side].inc()

    def stale(self, side: str) -> None:
        """A request (server side) or a response (client side) was refused as stale."""
        self._stale[side].inc()

    def uninstrumented(self, direction: str) -> None:
        """A call to or from a peer that sent no stamp passed through."""
        self._uninstrumented[direction].inc()

    def peer_reset(self) -> None:
        """The counts of a pair restarted (a call ended without knowing whether its messages arrived)."""
        self._resets.inc()

    def snapshot_recorded(self) -> None:
        """This process captured its local state (one capture serves every snapshot of a jump)."""
        self._recorded.inc()

    def snapshot_failed(self) -> None:
        """A snapshot failed in this process."""
        self._failed.inc()

    def broke(self, kind: str) -> None:
        """A wait of `kind` (:data:`BREAK_KINDS`) was broken for a detector's ``BreakWait``."""
        self._breaks[kind].inc()

    @property
    def stamped_counts(self) -> dict[str, int]:
        """The stamped-messages counts by kind, for an owner that adds to them under its own lock."""
        return self._stamped.counts

    def control_connected(self, connected: bool) -> None:
        """Whether a control stream to a detector (any of them) is up."""
        self._control_connected.set(1 if connected else 0)

    def detector_connected(self, detector: str, connected: bool) -> None:
        """The control stream to the detector at ``detector`` went up (True) or down (False)."""
        self._detector_connected.labels(detector).set(1 if connected else 0)

    def serve_http(self, port: int, addr: str = "127.0.0.1") -> tuple[WSGIServer, threading.Thread]:
        """Serve this registry on ``http://addr:port/metrics`` from a daemon thread (port 0: any free one)."""
        return start_http_server(port, addr=addr, registry=self.registry)


class _Tally(Collector):
    """A labelled counter kept as plain ints, for the hot path: its owner adds to :attr:`counts` under a
    lock of its own (here none is taken), and the family is built only when scraped."""

    def __init__(self, name: str, documentation: str, label: str, values: Iterable[str]) -> None:
        self.counts = dict.fromkeys(values, 0)
        self._name, self._documentation, self._label = name, documentation, label
        self._created = time.time()

    def describe(self) -> Iterable[CounterMetricFamily]:
        return [CounterMetricFamily(self._name, self._documentation, labels=[self._label])]

    def collect(self) -> Iterable[CounterMetricFamily]:
        family = CounterMetricFamily(self._name, self._documentation, labels=[self._label])
        for value, count in list(self.counts.items()):
            family.add_metric([value], count, created=self._created)
        yield family
