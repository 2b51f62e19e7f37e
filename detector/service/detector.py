"""The detector service: the rooms of :mod:`stablewatch.detector.service`, wired on one asyncio loop.

Agents attach on the control stream (:class:`~.coordinator.Coordinator`); the
:class:`~.scheduler.Scheduler` and on-demand requests start one-hop snapshots; every complete
snapshot is evaluated by the one pure function (:func:`~stablewatch.detector.evaluation.evaluate`),
and that value is stored (:class:`~.store.Store`), published as metrics and pushed to watchers
(:class:`~.watch.WatchHub`); with an archive folder, every finished snapshot (completed or
aborted) is also written to the Parquet archive
(:class:`~stablewatch.detector.archive.writer.ArchiveWriter`). One gRPC server carries the control
stream, the query API, health checking and reflection; /metrics is served on its own HTTP port,
and the web view (:mod:`~.web_http`) at ``/`` beside it or on a port of its own: the loop
publishes what it shows (:class:`~.web_view.LiveView`) and never waits for it.

Security (SECURITY.md): with ``tls_cert`` and ``tls_key`` the gRPC server speaks TLS, and /metrics
HTTPS with the same certificate; with ``tls_client_ca`` too, every client must show a certificate
from that CA (mutual TLS), which binds agents to their process ids and gives query clients their
roles (:mod:`~.auth`); the web view then serves readers only. Plaintext is meant for loopback: a
detector that listens elsewhere without TLS, or without client certificates, says so in a warning
at start. The bounds of :class:`~.limits.Limits` hold in every mode.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import ipaddress
import logging
import math
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from stablewatch.agents.breaking import OFF
from stablewatch.agents.certificates import server_credentials
from stablewatch.detector.assembly import PartRejected
from stablewatch.detector.evaluation import UserPredicate, evaluate, new_baselines
from stablewatch.detector.evaluation.plugins import check_names
from stablewatch.detector.evaluation.predicates import check_expected_totals
from stablewatch.detector.evaluation.victims import POLICIES
from stablewatch.detector.service.auth import AuthInterceptor, Authorizer
from stablewatch.detector.service.coordinator import Coordinator, NoAgents, SnapshotAborted
from stablewatch.detector.service.health_check import HealthService
from stablewatch.detector.service.limits import LimitExceeded, Limits, TokenBucket
from stablewatch.detector.service.malformed import MalformedInterceptor
from stablewatch.detector.service.metrics import DetectorMetrics
from stablewatch.detector.service.metrics_http import serve_http, serve_metrics
from stablewatch.detector.service.query import QueryService
from stablewatch.detector.service.resolutions import Resolutions
from stablewatch.detector.service.resolver import DEFAULT_REPORT_TIMEOUT
from stablewatch.detector.service.scheduler import Scheduler
from stablewatch.detector.service.store import Store
from stablewatch.detector.service.watch import WatchHub
from stablewatch.detector.service.web_http import WebApp
from stablewatch.detector.service.web_view import LiveView
from stablewatch.v1 import Evaluation, GlobalSnapshot, control_pb2, control_pb2_grpc, query_pb2, query_pb2_grpc
from stablewatch.v1.bounds import quoted_prefix
from stablewatch.v1.control_pb2 import BreakReport, WaitHint
from stablewatch.v1.ids import space_problem
from stablewatch.v1.query_pb2 import Resolution, SnapshotResults, SnapshotSummary, WatchEvent

if TYPE_CHECKING:
    from stablewatch.detector.archive.writer import ArchiveWriter

__all__ = ["Detector", "DetectorConfig", "NoAgents", "exposure_warnings"]

_log = logging.getLogger(__name__)
# Retention runs at start-up and then after every this many snapshots.
_RETENTION_EVERY = 100
# Seconds between warnings about parts for snapshots that were never started (see Detector._rejected).
_UNKNOWN_LOG_INTERVAL = 60.0


@dataclass
class DetectorConfig:
    """Everything the detector can be told; the defaults are the embedded, single-machine setup."""

    data_dir: Path = Path("stablewatch-data")
    listen: str = "127.0.0.1:50051"  # control stream and query API
    metrics_port: int | None = 9464  # /metrics over HTTP; None: not served
    metrics_address: str = "127.0.0.1"
    # The web view's own port (on metrics_address, with the same TLS); None: at / on the metrics port.
    web_port: int | None = None
    interval: float | None = 1.0  # seconds between scheduled snapshots; None: on demand only
    jitter: float = 0.1  # each interval is stretched or shrunk by up to this fraction
    deadline: float = 5.0  # a snapshot not complete by then is aborted
    max_concurrent: int = 2  # scheduled snapshots running at once
    min_members: int = 1  # snapshots (scheduled or triggered) wait until this many agents are attached
    # The system's expected membership: whole-system predicates are unknown on a cut without it.
    expected_members: tuple[str, ...] = ()  # by name
    expected_member_count: int = 0  # by number (0: not declared)
    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 5.0  # a member silent this long is detached
    expected_totals: dict[str, int] = field(default_factory=dict)  # conservation; others: baseline
    max_snapshots: int | None = 10_000  # retention by count
    max_age_seconds: float | None = 7 * 86400  # retention by age
    seed: int | None = None  # for the schedule's jitter
    archive: Path | None = None  # the Parquet archive folder; None: no archive
    archive_batch: int = 500  # snapshots per archive batch at most
    archive_age: float = 300.0  # seconds a finished snapshot waits for its batch at most
    # TLS (PEM files): cert and key for TLS; with client_ca, mutual TLS, identities and roles.
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None
    limits: Limits = field(default_factory=Limits)  # bounds against abuse
    # Breaking proven deadlocks (DESIGN.md): the victim policy, "youngest" or "oldest"; None: never
    # on its own (an operator may still ask, ResolveDeadlock).
    resolve: str | None = None
    report_timeout: float = DEFAULT_REPORT_TIMEOUT  # seconds a break waits for its agent's report
    hints: bool = True  # an agent's long-wait hint starts a snapshot at once (rate limited)
    # Detectors side by side: each needs its own replica number, its snapshot ids' space (0-127).
    replica: int = 0

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("TLS needs both tls_cert and tls_key, or neither")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("tls_client_ca (mutual TLS) needs tls_cert and tls_key as well")
        if self.resolve is not None and self.resolve not in POLICIES:
            raise ValueError(f"resolve must be one of {', '.join(POLICIES)} (or None: off), not {self.resolve!r}")
        problem = space_problem(self.replica)
        if problem is not None:
            raise ValueError(problem)
        check_expected_totals(self.expected_totals)


class TooFewMembers(NoAgents):
    """Fewer agents are attached than ``min_members`` asks for."""


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
        self._plugins = check_names(plugins)  # PluginError: two of one name, whose results would be confused
        self._store: Store | None = None
        self._archive: ArchiveWriter | None = None
        self._expected_totals: dict[str, int] = {}
        self._authorizer = Authorizer(required=config.tls_client_ca is not None)
        self.coordinator = Coordinator(
            heartbeat_interval=config.heartbeat_interval,
            id_space=config.replica,
            on_rejected=self._rejected,
            on_membership=self._membership_changed,
            on_refused=self.refused,
            on_break_report=self._break_reported,
            on_hint=self._hinted,
            on_detached=self._detached,
            limits=config.limits,
            authorizer=self._authorizer,
            resolve_policy=config.resolve or OFF,
        )
        rate = config.limits.trigger_rate
        self._trigger_bucket = None if rate is None else TokenBucket(*rate)
        self._hint_bucket = TokenBucket(*config.limits.hint_rate)
        self._hinted_snapshot: asyncio.Task[SnapshotResults | None] | None = None
        self._hint_started = 0.0  # wall clock: when the running (or last) hint snapshot started
        self._hint_pending = False  # a hint came that no snapshot started since covers
        self._hint_timer: asyncio.TimerHandle | None = None  # a pending hint waits for a token
        self._stopping = False
        self.resolutions = Resolutions(
            send=self.coordinator.send_break,
            metrics=self.metrics,
            publish=self._publish_resolution,
            policy=config.resolve,
            report_timeout=config.report_timeout,
            attached_at=self._attached_at,
        )
        self._server: grpc.aio.Server | None = None
        self._port = 0
        self._metrics_server = None
        self._web_server = None
        #: What the web view shows, published from the loop (read by the web view's threads).
        self.web = LiveView(config.listen, config.expected_members, config.expected_member_count)
        self._heartbeats: asyncio.Task[None] | None = None
        self._scheduler: Scheduler | None = None
        self._triggered: set[asyncio.Task[SnapshotResults]] = set()
        self._watch = WatchHub()
        self._latest: SnapshotResults | None = None
        self._finished_since_retention = 0
        #: Snapshots whose ABORTED row the store failed to write (id -> reason, kind, finished at): retried.
        self._unstored: dict[int, tuple[str, str, float]] = {}
        self._health = HealthService(self.refused)
        # Rejections of parts for snapshots never started: one warning per _UNKNOWN_LOG_INTERVAL, the rest at debug.
        self._unknown_warned_at = -math.inf  # monotonic seconds
        self._unknown_unwarned = 0  # such rejections since that warning, logged at debug level

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        """Open the store, serve gRPC and /metrics, and start the schedule."""
        config = self.config
        self._store = Store(config.data_dir, max_snapshots=config.max_snapshots, max_age_seconds=config.max_age_seconds)
        if config.archive is not None:
            from stablewatch.detector.archive.writer import ArchiveWriter  # pyarrow: only when archiving

            # Before retention: what a killed detector had not archived yet is written first.
            archive = ArchiveWriter(
                config.archive, self._store, batch_size=config.archive_batch, max_age=config.archive_age
            )
            try:
                await archive.start()
            except BaseException:
                self._store.close()
                raise
            self._archive = archive
            self.resolutions.archive = archive.add_resolution
        self.resolutions.store = self._store
        self._store.apply_retention(time.time(), keep_unarchived=self._archive is not None)
        self.coordinator.epoch = self._store.epoch
        self._latest = self._store.latest_results()
        if self._latest is not None:  # the gauges say what the query API says, from the start
            latest = self._latest.snapshot
            finished_at = latest.finished_at.ToMicroseconds() / 1e6
            # Its recorded bytes are not stored apart from the snapshot: not known until a new one.
            self.metrics.latest(
                latest.snapshot_id, self._latest.results, finished_at, latest.messages_in_flight, math.nan
            )
        self._expected_totals = {**self._store.expected_totals(), **config.expected_totals}
        self._watch = WatchHub(self._latest)
        self.resolutions.recover()  # breaks left pending when it stopped: no report can come now
        options = [
            ("grpc.so_reuseport", 0),  # without this, a second detector could bind the port and split the agents
            ("grpc.max_receive_message_length", config.limits.grpc_max_message),
        ]
        # The first interceptor wraps the handler the second returns: permissions are checked
        # before a request that is not protobuf is refused.
        interceptors = [AuthInterceptor(self._authorizer, self.refused), MalformedInterceptor(self.refused)]
        self._server = grpc.aio.server(options=options, interceptors=interceptors)
        control_pb2_grpc.add_ControlServicer_to_server(self.coordinator, self._server)
        query_pb2_grpc.add_QueryServicer_to_server(QueryService(self, config.limits), self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        names = (
            query_pb2.DESCRIPTOR.services_by_name["Query"].full_name,
            control_pb2.DESCRIPTOR.services_by_name["Control"].full_name,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        )
        reflection.enable_server_reflection(names, self._server)
        try:
            if config.tls_cert is not None and config.tls_key is not None:
                credentials = server_credentials(config.tls_cert, config.tls_key, config.tls_client_ca)
                self._port = self._server.add_secure_port(config.listen, credentials)
            else:
                self._port = self._server.add_insecure_port(config.listen)
            if self._port == 0:
                raise OSError(f"the detector cannot listen on {config.listen}")
        except BaseException:
            if self._archive is not None:
                await self._archive.close()
            self._store.close()
            raise
        self.web.load(self._store, self.address)
        for warning in exposure_warnings(config):
            _log.warning("%s", warning)
        await self._server.start()
        for name in ("", *names[:2]):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        tls = {"cert_file": config.tls_cert, "key_file": config.tls_key, "client_ca_file": config.tls_client_ca}
        web = WebApp(self.web, self._authorizer, self.refused)
        if config.metrics_port is not None:
            beside = web if config.web_port is None else None
            self._metrics_server = serve_metrics(
                self.metrics.registry, config.metrics_port, config.metrics_address, beside=beside, **tls
            )
        if config.web_port is not None:
            try:
                self._web_server = serve_http(web, config.web_port, config.metrics_address, name="web-http", **tls)
            except OSError as error:  # told apart from /metrics (no errno: the CLI shows this message)
                where = f"{config.metrics_address}:{config.web_port}"
                raise OSError(f"the web view on {where}: {error.strerror or error}") from error
        _log.debug("web view on %s", self.web_url or "nothing (no metrics port)")
        self._heartbeats = asyncio.ensure_future(self._watch_heartbeats())
        # What exists by now (modules, the store, the server) lives as long as the detector: out of
        # the collector's way, or every full collection walks it all (14 ms at start-up on a quiet
        # machine) with the event loop stopped, in the middle of whatever snapshot is running.
        gc.freeze()
        if config.interval is not None:
            self._scheduler = Scheduler(
                self.take_snapshot,
                interval=config.interval,
                jitter=config.jitter,
                max_concurrent=config.max_concurrent,
                ready=lambda: len(self.coordinator.members) >= max(1, config.min_members),
                seed=config.seed,
                quiet=(SnapshotAborted, NoAgents),
            )
            self._scheduler.start()
        _log.debug("detector listening on %s, data in %s", self.address, config.data_dir)

    async def stop(self) -> None:
        """Stop the schedule, end watch streams, stop serving, flush the archive and close the store."""
        self._stopping = True
        if self._hint_timer is not None:
            self._hint_timer.cancel()
        # A running snapshot is aborted and stored as such (see take_snapshot).
        if self._scheduler is not None:
            await self._scheduler.stop()
        for task in (self._heartbeats, self._hinted_snapshot, *self._triggered):
            if task is not None:
                task.cancel()
        for task in (self._heartbeats, self._hinted_snapshot, *self._triggered):
            if task is not None:
                await asyncio.gather(task, return_exceptions=True)
        self._watch.close()
        self.web.close()  # its event streams end
        await self._health.enter_graceful_shutdown()
        if self._server is not None:
            await self._server.stop(grace=0.5)
        if self._metrics_server is not None:
            await asyncio.to_thread(self._metrics_server.shutdown)
            self._metrics_server.server_close()
        if self._web_server is not None:
            await asyncio.to_thread(self._web_server.shutdown)
            self._web_server.server_close()
        if self._archive is not None:
            await self._archive.close()
        if self._store is not None:
            self._store.close()

    @property
    def address(self) -> str:
        """Where agents and clients reach the gRPC services (host:port)."""
        return f"{self.config.listen.rsplit(':', 1)[0]}:{self._port}"

    @property
    def metrics_url(self) -> str | None:
        return None if self._metrics_server is None else self._http_url(self._metrics_server.server_port, "metrics")

    @property
    def web_url(self) -> str | None:
        """The web view's page (``http(s)://host:port/``), or None when it is not served."""
        server = self._web_server if self.config.web_port is not None else self._metrics_server
        return None if server is None else self._http_url(server.server_port, "")

    def _http_url(self, port: int, path: str) -> str:
        scheme = "http" if self.config.tls_cert is None else "https"
        host = self.config.metrics_address
        host = f"[{host}]" if ":" in host else host
        return f"{scheme}://{host}:{port}/{path}"

    @property
    def store(self) -> Store:
        assert self._store is not None, "start() the detector first"
        return self._store

    # -- snapshots -----------------------------------------------------------------------------

    async def take_snapshot(self, deadline: float | None = None, expected: Iterable[str] = ()) -> SnapshotResults:
        """Take one snapshot of every attached agent now and return its results.

        `expected` names processes the cut must hold, on top of the configured expectation. An
        aborted snapshot is returned too, with its outcome and reason. Raises :class:`NoAgents`
        when no agent is attached, :class:`TooFewMembers` when fewer than ``min_members`` are.
        """
        # First, also while no agent is attached (the schedule still comes here): the store may work again.
        self._store_unstored()
        attached = len(self.coordinator.members)
        if not attached:
            raise NoAgents("no agent is attached")
        if attached < self.config.min_members:
            raise TooFewMembers(
                f"{attached} of the {self.config.min_members} agents that --min-members asks for are attached"
            )
        store = self.store
        started = time.time()
        snapshot_id = store.allocate_id(started, self.config.replica)
        store.begin(snapshot_id, started, attached)
        clock = time.perf_counter()
        try:
            snapshot = await self.coordinator.snapshot(
                deadline or self.config.deadline,
                snapshot_id,
                expected=frozenset(self.config.expected_members).union(expected),
                expected_count=self.config.expected_member_count,
            )
        except asyncio.CancelledError:
            # The caller gave up (shutdown): abort it everywhere rather than leave it running.
            self.coordinator.abort(snapshot_id, "the detector stopped it", "shutdown")
            self.metrics.aborted("shutdown")
            with contextlib.suppress(Exception):  # logged, and remembered for the next write
                self._finished(self._store_aborted(snapshot_id, "the detector stopped it", "shutdown"))
            raise
        except SnapshotAborted as aborted:
            self.metrics.aborted(aborted.kind)
            summary = self._store_aborted(snapshot_id, aborted.reason, aborted.kind)
            self._finished(summary)
            results = SnapshotResults(snapshot=summary)
            self._watch.publish(results, changes=[])
            self._retain(time.time())
            return results
        seconds = time.perf_counter() - clock
        finished = time.time()
        # Microseconds: what Parquet and Spark timestamps hold, so the archive keeps them exactly.
        snapshot.started_at.FromMicroseconds(int(started * 1e6))
        snapshot.completed_at.FromMicroseconds(int(finished * 1e6))
        evaluation = evaluate(snapshot, self._expected_totals, self._plugins)
        baselines = new_baselines(evaluation)
        try:
            # Inside the same handling as the snapshot: a baseline the store failed to keep (a full
            # disk) records the snapshot aborted (store_error), never leaves it RUNNING.
            if baselines:
                store.add_expected_totals(baselines)
                self._expected_totals.update(baselines)  # only once the store has them
            results = store.complete(snapshot, evaluation, finished)
        except Exception as error:
            self._store_failed(snapshot_id, error)
            raise
        self._finished(results.snapshot, snapshot, evaluation)
        self.metrics.completed(seconds)
        # Concurrent snapshots finish in any order: a slow older one is stored, counted, archived
        # and streamed, but the latest results, the gauges and the changes stay the newest's.
        newest = self._latest is None or snapshot_id > self._latest.snapshot.snapshot_id
        if newest:
            self._latest = results
            messages = [m for channel in snapshot.channels for m in channel.messages]
            recorded = sum(len(m.payload) for m in messages)
            self.metrics.latest(snapshot_id, evaluation.results, finished, len(messages), recorded)
        self._watch.publish(results, self._watch.changes(evaluation.results) if newest else [])
        try:
            self.resolutions.after_snapshot(snapshot, evaluation, started)
        except Exception:  # breaking is on top of detection: it must never cost a result
            _log.exception("could not break the deadlock of snapshot %d", snapshot_id)
        self._retain(finished)
        return results

    def _store_failed(self, snapshot_id: int, error: Exception) -> None:
        """The completed snapshot `snapshot_id` could not be stored: record it ABORTED (kind ``store_error``),
        rather than leave it RUNNING until a restart calls it "detector restarted"; count and log it."""
        _log.error(
            "snapshot %d completed, but the store could not keep it: %s; it is recorded as aborted", snapshot_id, error
        )
        self.metrics.aborted("store_error")
        with contextlib.suppress(Exception):  # logged, and remembered for the next write
            summary = self._store_aborted(
                snapshot_id, f"the completed snapshot could not be stored: {error}", "store_error"
            )
            self._finished(summary)

    def _store_aborted(self, snapshot_id: int, reason: str, kind: str) -> SnapshotSummary:
        """Store RUNNING snapshot `snapshot_id` as ABORTED; when the store fails, log it, remember it
        (:meth:`_store_unstored` writes it at the next snapshot's turn) and raise."""
        finished = time.time()
        try:
            return self.store.abort(snapshot_id, reason, finished, kind)
        except (KeyError, ValueError):
            raise  # no RUNNING row to set right
        except Exception as error:
            self._unstored[snapshot_id] = (reason, kind, finished)
            _log.error("could not store snapshot %d as aborted (%s): %s; trying again before the next snapshot",
                       snapshot_id, reason, error)  # fmt: skip
            raise

    def _store_unstored(self) -> None:
        """Write the ABORTED rows the store failed to write before; those that fail again wait for the next try."""
        for snapshot_id, (reason, kind, finished) in list(self._unstored.items()):
            try:
                summary = self.store.abort(snapshot_id, reason, finished, kind)
            except (KeyError, ValueError):  # gone (retention) or no longer RUNNING: nothing to set right
                del self._unstored[snapshot_id]
                continue
            except Exception as error:
                _log.error("could not store snapshot %d as aborted, again: %s", snapshot_id, error)
                continue
            del self._unstored[snapshot_id]
            self._finished(summary)

    def _retain(self, now: float) -> None:
        """Apply the store's retention after every :data:`_RETENTION_EVERY` finished snapshots."""
        self._finished_since_retention += 1
        if self._finished_since_retention >= _RETENTION_EVERY:
            self._finished_since_retention = 0
            self._store.apply_retention(now, keep_unarchived=self._archive is not None)

    def _finished(
        self, summary: SnapshotSummary, snapshot: GlobalSnapshot | None = None, evaluation: Evaluation | None = None
    ) -> None:
        """Hand a finished (stored) snapshot to the web view, and to the archive if there is one."""
        self.web.finished(summary, snapshot, evaluation)
        if self._archive is not None:
            self._archive.add(summary, snapshot, evaluation)

    async def trigger(self, deadline: float | None = None, expected: Iterable[str] = ()) -> SnapshotResults:
        """:meth:`take_snapshot` for a client: it runs to its end even if the client hangs up.

        Raises :class:`~.limits.LimitExceeded` over the trigger rate or when the most triggered
        snapshots the limits allow are running.
        """
        limits = self.config.limits
        if len(self._triggered) >= limits.max_running_triggers:
            raise self._over(
                "too_many_triggers",
                f"{len(self._triggered)} triggered snapshots are running, the detector's limit; try again later",
            )
        if self._trigger_bucket is not None and not self._trigger_bucket.take():
            bucket = self._trigger_bucket
            raise self._over(
                "rate_limited",
                f"snapshots may be triggered {bucket} at most; try again in {bucket.wait():.1f} s",
            )
        task = asyncio.ensure_future(self.take_snapshot(deadline, expected))
        self._triggered.add(task)
        task.add_done_callback(self._triggered.discard)
        return await asyncio.shield(task)

    async def _watch_heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self.config.heartbeat_interval)
            self.resolutions.expire()
            for process_id in self.coordinator.expire_silent(time.time(), self.config.heartbeat_timeout):
                self._detached("no_heartbeat", f"{process_id}: no heartbeat for {self.config.heartbeat_timeout:g}s")

    # -- queries -------------------------------------------------------------------------------

    def latest(self) -> SnapshotResults | None:
        """Results of the newest complete snapshot."""
        return self._latest

    def members(self) -> query_pb2.ListMembersResponse:
        """The attached agents, and the expected processes that are not attached."""
        response = query_pb2.ListMembersResponse(expected_count=self.config.expected_member_count)
        for member in sorted(self.coordinator.members.values(), key=lambda m: m.process_id):
            entry = response.members.add(process_id=member.process_id, address=member.address)
            entry.attached_at.FromNanoseconds(int(member.attached_at * 1e9))
            entry.last_heartbeat.FromNanoseconds(int(member.last_heartbeat * 1e9))
        response.expected_missing.extend(sorted(set(self.config.expected_members) - self.coordinator.members.keys()))
        return response

    def watch(self, identity: str = "this process") -> AsyncIterator[WatchEvent]:
        """The latest results first, then every new result as it is published, until the detector stops.

        `identity` is who watches (:func:`~.auth.peer_identity`). Raises :class:`~.limits.LimitExceeded`
        when `identity` holds as many watch streams as one may, or all the detector allows are open.
        """
        limits = self.config.limits
        held = self._watch.watchers_of(identity)
        if held >= limits.max_watchers_per_identity:
            raise self._over(
                "too_many_watchers_for_identity",
                f"{quoted_prefix(identity, 128)} holds {held} watch streams, the most one client may; "
                "close one to open another",
            )
        if self._watch.watchers >= limits.max_watchers:
            raise self._over(
                "too_many_watchers", f"{self._watch.watchers} watch streams are open, the detector's limit"
            )
        return self._watch.subscribe(self._latest, identity)

    def resolve(self, snapshot_id: int, requested_by: str) -> list[Resolution]:
        """An operator's request to break the deadlocks snapshot ``snapshot_id`` proves (see
        :meth:`~.resolutions.Resolutions.resolve`: KeyError, NothingToResolve)."""
        return self.resolutions.resolve(snapshot_id, requested_by)

    # -- callbacks from the coordinator --------------------------------------------------------

    def _break_reported(self, process_id: str, report: BreakReport) -> None:
        self.resolutions.reported(process_id, report)

    def _attached_at(self, process_id: str) -> float | None:
        """When ``process_id``'s control stream attached (None: it is not attached)."""
        member = self.coordinator.members.get(process_id) or self.coordinator.joining.get(process_id)
        return None if member is None else member.attached_at

    def _hinted(self, process_id: str, hint: WaitHint) -> None:
        """A wait of ``process_id`` has lasted past its agent's threshold: snapshot now.

        At most one snapshot for hints runs at a time, and at most ``limits.hint_rate`` start. A
        hint is never dropped, only merged: one that comes while a hint snapshot runs is covered by
        it when its wait began before that snapshot started (every recording came later), else by
        one more snapshot when it ends; one over the rate by one snapshot as soon as a token frees.
        So the last wait of a deadlock always gets a snapshot soon, and a storm of hints costs at
        most ``hint_rate`` snapshots a second.
        """
        if not self.config.hints:
            outcome = "ignored"
        elif self._hinted_snapshot is not None and not self._hinted_snapshot.done():
            outcome = "coalesced"
            if time.time() - hint.waited_ms / 1000 >= self._hint_started:
                self._hint_pending = True  # began after the running one started: one more when it ends
        elif self._hint_timer is not None:
            outcome = "rate_limited"  # a snapshot is already due as soon as a token frees
        elif self._hint_bucket.take():
            outcome = "snapshot"
            self._start_hint_snapshot()
        else:
            outcome = "rate_limited"
            self._hint_pending = True
            self._hint_timer = asyncio.get_running_loop().call_later(self._hint_bucket.wait(), self._hint_follow_up)
        self.metrics.wait_hints.labels(outcome).inc()
        _log.debug("hint from %s (wait %d, %d ms): %s", process_id, hint.instance, hint.waited_ms, outcome)

    def _start_hint_snapshot(self) -> None:
        self._hint_pending = False
        self._hint_started = time.time()
        self._hinted_snapshot = asyncio.ensure_future(self._snapshot_for_hint())
        self._hinted_snapshot.add_done_callback(lambda _: self._hint_follow_up())

    def _hint_follow_up(self) -> None:
        """Start the snapshot a merged hint is owed, when none runs and a token is free (else later)."""
        self._hint_timer = None
        if not self._hint_pending or self._stopping:
            return
        if self._hinted_snapshot is not None and not self._hinted_snapshot.done():
            return  # its end calls this again
        if self._hint_bucket.take():
            self._start_hint_snapshot()
        else:
            self._hint_timer = asyncio.get_running_loop().call_later(self._hint_bucket.wait(), self._hint_follow_up)

    async def _snapshot_for_hint(self) -> SnapshotResults | None:
        try:
            return await self.take_snapshot()
        except (NoAgents, SnapshotAborted):
            return None

    def _publish_resolution(self, resolution: Resolution) -> None:
        self._watch.publish_resolution(resolution)
        self.web.add_resolution(resolution)

    def _rejected(self, rejected: PartRejected) -> None:
        self.metrics.rejected_parts.labels(rejected.reason).inc()
        # A late part is routine (an agent that attached, or recorded from a peer's marker, while a
        # snapshot it was no member of ended): counted, and logged only at debug level.
        level = logging.DEBUG if rejected.reason == "late" else logging.WARNING
        if rejected.reason == "unknown_snapshot":
            # Any attached agent can send these as fast as it likes: a warning now and then says so,
            # the metric counts every one.
            now = time.monotonic()
            if now - self._unknown_warned_at < _UNKNOWN_LOG_INTERVAL:
                self._unknown_unwarned += 1
                level = logging.DEBUG
            else:
                if self._unknown_unwarned:
                    _log.warning(
                        "%d more parts for snapshots never started were rejected in the last %gs (at debug level)",
                        self._unknown_unwarned,
                        now - self._unknown_warned_at,
                    )
                self._unknown_warned_at, self._unknown_unwarned = now, 0
        _log.log(level, "rejected a snapshot part: %s", rejected)

    def _detached(self, reason: str, detail: str) -> None:
        """Count and log a member the detector detached (reason: one of coordinator.DETACH_REASONS)."""
        self.metrics.detached.labels(reason).inc()
        _log.warning("detached (%s): %s", reason, detail)

    def refused(self, reason: str, detail: str) -> None:
        """Count a refused stream or call (reason: one of limits.REFUSAL_REASONS) and log why."""
        self.metrics.refused.labels(reason).inc()
        _log.warning("refused (%s): %s", reason, detail)

    def _over(self, reason: str, message: str) -> LimitExceeded:
        self.refused(reason, message)
        return LimitExceeded(reason, message)

    def _membership_changed(self) -> None:
        self.metrics.agents_attached.set(len(self.coordinator.members))
        self.web.set_members(self.coordinator.members.values())


def exposure_warnings(config: DetectorConfig) -> list[str]:
    """What `config` leaves open beyond this machine: the gRPC port without TLS or without client
    certificates, /metrics without TLS (logged at start; empty on loopback or with mutual TLS)."""
    warnings = []
    if not _is_loopback(config.listen.rsplit(":", 1)[0]):
        if config.tls_cert is None:
            warnings.append(
                f"the detector listens on {config.listen} in PLAINTEXT: anyone who reaches it can attach as any "
                "process, send snapshot parts, trigger snapshots and read every global state; give --tls-cert, "
                "--tls-key and --tls-client-ca (SECURITY.md)"
            )
        elif config.tls_client_ca is None:
            warnings.append(
                f"the detector on {config.listen} has TLS but no --tls-client-ca: no client is authenticated, so "
                "anyone who reaches it can attach as any process, trigger snapshots and read every global state "
                "(SECURITY.md)"
            )
    if config.tls_cert is None and not _is_loopback(config.metrics_address):
        if config.metrics_port is not None:
            web = " and so is the web view (members, results, wait-for graphs)" if config.web_port is None else ""
            warnings.append(f"/metrics is served in plaintext on {config.metrics_address}, beyond this machine{web}")
        if config.web_port is not None:
            warnings.append(
                f"the web view (members, results, wait-for graphs) is served in plaintext on "
                f"{config.metrics_address}:{config.web_port}, beyond this machine"
            )
    return warnings


def _is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or name, IPv6 possibly in brackets) is this machine's loopback only."""
    host = host.removeprefix("[").removesuffix("]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
