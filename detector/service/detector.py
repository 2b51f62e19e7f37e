"""The detector service: scheduled snapshots, predicates, the store, metrics and the watch stream.

:class:`Detector` ties the pieces together on one asyncio loop. Agents attach on the control
stream (:class:`~.coordinator.Coordinator`); a schedule (interval with jitter, a deadline per
snapshot, a limit on snapshots at once) and on-demand requests start one-hop snapshots; every
complete snapshot is evaluated (:class:`~.predicates.Evaluator`), stored (:class:`~.store.Store`),
published as metrics and pushed to watchers. One gRPC server carries the control stream, the
query API, health checking and reflection; /metrics is served on its own HTTP port.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from stablewatch.detector.evaluation.deadlock import count_deadlocks
from stablewatch.detector.evaluation.plugins import UserPredicate
from stablewatch.detector.evaluation.predicates import Evaluator
from stablewatch.detector.evaluation.waitfor import build_wait_for, find_deadlock, to_proto
from stablewatch.detector.service.assembly import PartRejected
from stablewatch.detector.service.coordinator import Coordinator, NoAgents, SnapshotAborted
from stablewatch.detector.service.metrics import DetectorMetrics
from stablewatch.detector.service.query import QueryService
from stablewatch.detector.service.store import Store
from stablewatch.v1 import (
    PredicateResult,
    WaitForGraph,
    control_pb2,
    control_pb2_grpc,
    query_pb2,
    query_pb2_grpc,
)
from stablewatch.v1.query_pb2 import PredicateChange, SnapshotResults, WatchEvent

__all__ = ["Detector", "DetectorConfig", "NoAgents"]

_log = logging.getLogger(__name__)
# Watchers that fall this far behind are dropped rather than letting memory grow.
_WATCH_QUEUE = 1000
# Retention runs at start-up and then after every this many snapshots.
_RETENTION_EVERY = 100


@dataclass
class DetectorConfig:
    """Everything the detector can be told; the defaults are the embedded, single-machine setup."""

    data_dir: Path = Path("stablewatch-data")
    listen: str = "127.0.0.1:50051"  # control stream and query API
    metrics_port: int | None = 9464  # /metrics over HTTP; None: not served
    metrics_address: str = "127.0.0.1"
    interval: float | None = 1.0  # seconds between scheduled snapshots; None: on demand only
    jitter: float = 0.1  # each interval is stretched or shrunk by up to this fraction
    deadline: float = 5.0  # a snapshot not complete by then is aborted
    max_concurrent: int = 2  # scheduled snapshots running at once
    min_members: int = 1  # scheduled snapshots wait until this many agents are attached
    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 5.0  # a member silent this long is detached
    expected_totals: dict[str, int] = field(default_factory=dict)  # conservation; others: baseline
    max_snapshots: int | None = 10_000  # retention by count
    max_age_seconds: float | None = 7 * 86400  # retention by age
    seed: int | None = None  # for the schedule's jitter


class Detector:
    """The running detector; see the module docstring."""

    def __init__(
        self,
        config: DetectorConfig,
        *,
        plugins: Sequence[UserPredicate] = (),
        metrics: DetectorMetrics | None = None,
    ) -> None:
        self.config = config
        self.metrics = metrics or DetectorMetrics()
        self._plugins = plugins
        self._random = random.Random(config.seed)
        self._store: Store | None = None
        self._evaluator: Evaluator | None = None
        self.coordinator = Coordinator(
            heartbeat_interval=config.heartbeat_interval,
            on_rejected=self._rejected,
            on_membership=self._membership_changed,
        )
        self._server: grpc.aio.Server | None = None
        self._port = 0
        self._metrics_server = None
        self._tasks: list[asyncio.Task[None]] = []
        self._snapshot_tasks: set[asyncio.Task[SnapshotResults]] = set()
        self._watchers: set[asyncio.Queue[WatchEvent | None]] = set()
        self._last_values: dict[str, bool] = {}
        self._latest: SnapshotResults | None = None
        self._health = health.HealthServicer()

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        """Open the store, serve gRPC and /metrics, and start the schedule."""
        config = self.config
        self._store = Store(config.data_dir, max_snapshots=config.max_snapshots, max_age_seconds=config.max_age_seconds)
        self._store.apply_retention(time.time())
        self._latest = self._store.latest_results()
        self._evaluator = Evaluator({**_baseline(self._latest), **config.expected_totals}, self._plugins)
        if self._latest is not None:
            self._last_values = {r.name: r.holds for r in self._latest.results}
        # Without this, gRPC lets a second detector bind the same port and split the agents.
        self._server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        control_pb2_grpc.add_ControlServicer_to_server(self.coordinator, self._server)
        query_pb2_grpc.add_QueryServicer_to_server(QueryService(self), self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        names = (
            query_pb2.DESCRIPTOR.services_by_name["Query"].full_name,
            control_pb2.DESCRIPTOR.services_by_name["Control"].full_name,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        )
        reflection.enable_server_reflection(names, self._server)
        self._port = self._server.add_insecure_port(config.listen)
        if self._port == 0:
            raise OSError(f"the detector cannot listen on {config.listen}")
        await self._server.start()
        for name in ("", *names[:2]):
            self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        if config.metrics_port is not None:
            from prometheus_client import start_http_server

            self._metrics_server, _ = start_http_server(
                config.metrics_port, addr=config.metrics_address, registry=self.metrics.registry
            )
        self._tasks.append(asyncio.ensure_future(self._watch_heartbeats()))
        if config.interval is not None:
            self._tasks.append(asyncio.ensure_future(self._schedule()))
        _log.debug("detector listening on %s, data in %s", self.address, config.data_dir)

    async def stop(self) -> None:
        """Stop the schedule, end watch streams, stop serving and close the store."""
        for task in (*self._tasks, *self._snapshot_tasks):
            task.cancel()  # a running snapshot is aborted and stored as such (see take_snapshot)
        for task in (*self._tasks, *self._snapshot_tasks):
            with contextlib.suppress(asyncio.CancelledError, SnapshotAborted, NoAgents):
                await task
        self._tasks.clear()
        for queue in list(self._watchers):
            _end_watch(queue)
        self._health.enter_graceful_shutdown()
        if self._server is not None:
            await self._server.stop(grace=0.5)
        if self._metrics_server is not None:
            await asyncio.to_thread(self._metrics_server.shutdown)
            self._metrics_server.server_close()
        if self._store is not None:
            self._store.close()

    @property
    def address(self) -> str:
        """Where agents and clients reach the gRPC services (host:port)."""
        return f"{self.config.listen.rsplit(':', 1)[0]}:{self._port}"

    @property
    def metrics_url(self) -> str | None:
        if self._metrics_server is None:
            return None
        return f"http://{self.config.metrics_address}:{self._metrics_server.server_port}/metrics"

    @property
    def store(self) -> Store:
        assert self._store is not None, "start() the detector first"
        return self._store

    # -- snapshots -----------------------------------------------------------------------------

    async def take_snapshot(self, deadline: float | None = None) -> SnapshotResults:
        """Take one snapshot of every attached agent now and return its results.

        An aborted snapshot is returned too, with its outcome and reason. Raises
        :class:`NoAgents` when no agent is attached.
        """
        if not self.coordinator.members:
            raise NoAgents("no agent is attached")
        store, evaluator = self.store, self._evaluator
        assert evaluator is not None
        snapshot_id = store.allocate_id()
        started = time.time()
        store.begin(snapshot_id, started, len(self.coordinator.members))
        clock = time.perf_counter()
        try:
            snapshot = await self.coordinator.snapshot(deadline or self.config.deadline, snapshot_id)
        except asyncio.CancelledError:
            # The caller gave up (shutdown): abort it everywhere rather than leave it running.
            self.coordinator.abort(snapshot_id, "the detector stopped it", "shutdown")
            store.abort(snapshot_id, "the detector stopped it", time.time())
            self.metrics.aborted("shutdown")
            raise
        except SnapshotAborted as aborted:
            summary = store.abort(snapshot_id, aborted.reason, time.time())
            self.metrics.aborted(aborted.kind)
            results = SnapshotResults(snapshot=summary)
            self._publish(results, changes=[])
            return results
        seconds = time.perf_counter() - clock
        finished = time.time()
        snapshot.started_at.FromNanoseconds(int(started * 1e9))
        snapshot.completed_at.FromNanoseconds(int(finished * 1e9))
        predicate_results = evaluator.evaluate(snapshot)
        results = store.complete(snapshot, predicate_results, finished)
        self.metrics.completed(snapshot, predicate_results, seconds, finished)
        if evaluator.last_wait_for is not None and evaluator.last_deadlock is not None:
            found = evaluator.last_deadlock
            self.metrics.deadlock_cycles.set(count_deadlocks(evaluator.last_wait_for.graph, found.deadlocked))
        if self._latest is None or snapshot_id > self._latest.snapshot.snapshot_id:
            self._latest = results  # a slow older snapshot must not replace a newer one
        self._publish(results, self._changes(predicate_results))
        if snapshot_id % _RETENTION_EVERY == 0:
            store.apply_retention(finished)
        return results

    def _changes(self, results: Sequence[PredicateResult]) -> list[PredicateChange]:
        changes = []
        for result in results:
            previous = self._last_values.get(result.name)
            if previous is None or previous != result.holds:
                changes.append(
                    PredicateChange(
                        name=result.name, holds=result.holds, previous_holds=bool(previous), first=previous is None
                    )
                )
            self._last_values[result.name] = result.holds
        return changes

    async def _schedule(self) -> None:
        """Start a snapshot every interval (with jitter) while fewer than max_concurrent run."""
        config = self.config
        assert config.interval is not None
        while True:
            stretch = 1 + config.jitter * (2 * self._random.random() - 1)
            await asyncio.sleep(config.interval * stretch)
            attached = len(self.coordinator.members)
            if attached < max(1, config.min_members) or len(self._snapshot_tasks) >= config.max_concurrent:
                continue
            task = asyncio.ensure_future(self.take_snapshot())
            self._snapshot_tasks.add(task)
            task.add_done_callback(self._snapshot_done)

    def _snapshot_done(self, task: asyncio.Task[SnapshotResults]) -> None:
        self._snapshot_tasks.discard(task)
        if not task.cancelled() and task.exception() is not None and not isinstance(task.exception(), NoAgents):
            _log.error("scheduled snapshot failed", exc_info=task.exception())

    async def _watch_heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self.config.heartbeat_interval)
            for process_id in self.coordinator.expire_silent(time.time(), self.config.heartbeat_timeout):
                _log.warning("detached %s: no heartbeat for %gs", process_id, self.config.heartbeat_timeout)

    # -- queries -------------------------------------------------------------------------------

    def latest(self) -> SnapshotResults | None:
        """Results of the newest complete snapshot."""
        return self._latest

    def wait_for_graph(self, snapshot_id: int) -> WaitForGraph | None:
        """The wait-for graph of a complete snapshot, with its deadlock evidence."""
        snapshot = self.store.snapshot(snapshot_id)
        if snapshot is None:
            return None
        wait_for = build_wait_for(snapshot)
        return to_proto(wait_for, find_deadlock(wait_for))

    def members(self) -> list[query_pb2.Member]:
        members = []
        for member in sorted(self.coordinator.members.values(), key=lambda m: m.process_id):
            entry = query_pb2.Member(process_id=member.process_id, address=member.address)
            entry.attached_at.FromNanoseconds(int(member.attached_at * 1e9))
            entry.last_heartbeat.FromNanoseconds(int(member.last_heartbeat * 1e9))
            members.append(entry)
        return members

    async def watch(self) -> AsyncIterator[WatchEvent]:
        """Every new result as it is published, until the detector stops."""
        queue: asyncio.Queue[WatchEvent | None] = asyncio.Queue(_WATCH_QUEUE)
        self._watchers.add(queue)
        try:
            while (event := await queue.get()) is not None:
                yield event
        finally:
            self._watchers.discard(queue)

    def _publish(self, results: SnapshotResults, changes: list[PredicateChange]) -> None:
        event = WatchEvent(results=results, changes=changes, snapshot_id=results.snapshot.snapshot_id)
        for queue in list(self._watchers):
            try:
                queue.put_nowait(event)
            except asyncio.QueueFull:  # a watcher this far behind is cut off: its stream ends
                self._watchers.discard(queue)
                _end_watch(queue)

    # -- callbacks from the coordinator --------------------------------------------------------

    def _rejected(self, rejected: PartRejected) -> None:
        self.metrics.rejected_parts.labels(rejected.reason).inc()
        _log.warning("rejected a snapshot part: %s", rejected)

    def _membership_changed(self) -> None:
        self.metrics.agents_attached.set(len(self.coordinator.members))


def _end_watch(queue: asyncio.Queue[WatchEvent | None]) -> None:
    """End a watch stream: drop what it has not read yet and queue the end."""
    while not queue.empty():
        queue.get_nowait()
    queue.put_nowait(None)


def _baseline(latest: SnapshotResults | None) -> dict[str, int]:
    """Expected totals carried over a restart: those the latest stored results were checked against."""
    if latest is None:
        return {}
    return {
        r.conservation.counter: r.conservation.expected
        for r in latest.results
        if r.WhichOneof("evidence") == "conservation"
    }
