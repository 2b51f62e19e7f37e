"""Prometheus metrics of the detector, named by Prometheus conventions.

Labels are bounded: predicate names (the built-ins, configured plugins and one per conserved
counter), counter names, abort kinds, rejection, refusal and detach reasons. Snapshot and process ids are never
label values: the latest snapshot id is a gauge value, not a label.

A predicate is true, false or unknown, by the one rule of
:class:`~stablewatch.detector.evaluation.Verdict`. ``stablewatch_predicate_value`` is 1 only when it
is true; ``stablewatch_predicate_unknown`` is 1 when the latest cut could not decide it, so an alert
on ``value == 1`` never fires on unknown, and one on a false value must also ask ``unknown == 0``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from stablewatch.detector.assembly import REJECTION_REASONS
from stablewatch.detector.evaluation import Verdict
from stablewatch.detector.service.coordinator import ABORT_KINDS, DETACH_REASONS
from stablewatch.detector.service.limits import REFUSAL_REASONS
from stablewatch.v1 import PredicateResult

__all__ = ["HINT_OUTCOMES", "LATE_REPORT_OUTCOMES", "RESOLUTION_OUTCOMES", "DetectorMetrics"]

#: How a break ended (the label of ``stablewatch_deadlocks_resolved_total``).
RESOLUTION_OUTCOMES = (
    "broken",
    "gone",
    "already_broken",
    "policies_disagree",
    "failed",
    "unanswered",
    "not_attached",
)
#: The agents' answers that can come after the detector gave up waiting (the label of
#: ``stablewatch_break_reports_late_total``).
LATE_REPORT_OUTCOMES = ("broken", "gone", "already_broken", "policies_disagree", "failed")
#: What a long-wait hint led to (the label of ``stablewatch_wait_hints_total``).
HINT_OUTCOMES = ("snapshot", "coalesced", "rate_limited", "ignored")

# From a one-hop snapshot on loopback (milliseconds) to a slow member at its deadline (seconds).
_DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class DetectorMetrics:
    """The detector's metrics in ``registry`` (a new private one by default)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.predicate_value = Gauge(
            "stablewatch_predicate_value", "Value of each predicate on the latest complete snapshot (1 holds)",
            ["predicate"], registry=r,
        )  # fmt: skip
        self.predicate_unknown = Gauge(
            "stablewatch_predicate_unknown",
            "1 when the latest complete snapshot could not decide the predicate (an open cut, a failed plugin)",
            ["predicate"], registry=r,
        )  # fmt: skip
        self.deadlocked_nodes = Gauge(
            "stablewatch_deadlocked_nodes",
            "Wait-for nodes deadlocked in the latest complete snapshot (NaN when its deadlock is unknown)",
            registry=r,
        )
        self.deadlock_cycles = Gauge(
            "stablewatch_deadlock_cycles",
            "Separate deadlocks (wait cycles or knots) in the latest complete snapshot (NaN when unknown)",
            registry=r,
        )
        self.snapshots = Counter("stablewatch_snapshots", "Snapshots by outcome", ["outcome"], registry=r)
        self.aborts = Counter(
            "stablewatch_snapshot_aborts", "Aborted snapshots by kind of reason", ["kind"], registry=r
        )
        self.duration = Histogram(
            "stablewatch_snapshot_duration_seconds", "Time from a snapshot's start to its completion",
            buckets=_DURATION_BUCKETS, registry=r,
        )  # fmt: skip
        self.last_completed = Gauge(
            "stablewatch_last_completed_snapshot_timestamp_seconds",
            "Unix time when the latest snapshot completed",
            registry=r,
        )
        self.last_snapshot_id = Gauge(
            "stablewatch_last_completed_snapshot_id", "Id of the latest complete snapshot", registry=r
        )
        self.in_flight_messages = Gauge(
            "stablewatch_in_flight_messages", "Messages recorded in flight in the latest complete snapshot", registry=r
        )
        self.recorded_bytes = Gauge(
            "stablewatch_recorded_bytes",
            "Payload bytes recorded in flight in the latest complete snapshot (NaN after a restart, until a new one)",
            registry=r,
        )  # fmt: skip
        self.counter_total = Gauge(
            "stablewatch_counter_total", "Observed total of each conserved counter", ["counter"], registry=r
        )
        self.conservation_drift = Gauge(
            "stablewatch_conservation_drift", "Observed minus expected total of each counter", ["counter"], registry=r
        )
        self.agents_attached = Gauge("stablewatch_agents_attached", "Agents attached to the detector", registry=r)
        self.rejected_parts = Counter(
            "stablewatch_rejected_parts", "Local snapshot parts rejected, by reason", ["reason"], registry=r
        )
        self.refused = Counter(
            "stablewatch_refused",
            "Control streams and API calls the detector refused (identity, permission, limits), by reason",
            ["reason"], registry=r,
        )  # fmt: skip
        # A break given up (unanswered) whose agent then answers late is counted twice here: as
        # unanswered when the detector gave up, and under its answer when that came (also counted in
        # late_reports). Both happened; unanswered minus the late answers is the breaks never answered.
        self.resolutions = Counter(
            "stablewatch_deadlocks_resolved",
            "Breaks of proven deadlocks, by how they ended (broken, gone, already_broken, policies_disagree: "
            "refused by an agent whose detectors' --resolve policies differ, failed: breaking raised at the agent, "
            "unanswered, not_attached); "
            "an answer that came after the break was given up as unanswered is counted under it too",
            ["outcome"], registry=r,
        )  # fmt: skip
        self.late_reports = Counter(
            "stablewatch_break_reports_late",
            "Agents' answers to breaks already given up as unanswered, by answer: each is also counted in "
            "stablewatch_deadlocks_resolved_total under that answer, and the break's record now holds it",
            ["outcome"], registry=r,
        )  # fmt: skip
        self.resolution_seconds = Histogram(
            "stablewatch_resolution_seconds",
            "From the start of the snapshot that proved a deadlock to its victim's agent reporting the wait broken",
            buckets=_DURATION_BUCKETS, registry=r,
        )  # fmt: skip
        self.breaks_sent = Counter(
            "stablewatch_breaks_sent", "BreakWait orders sent, by who asked (detector, operator)", ["requested_by"],
            registry=r,
        )  # fmt: skip
        self.unexpected_reports = Counter(
            "stablewatch_break_reports_ignored",
            "Break reports that answered no break waiting for that process (unknown id, another process, "
            "or a break given up on longer ago than the late window)",
            registry=r,
        )
        self.wait_hints = Counter(
            "stablewatch_wait_hints",
            "Long-wait hints from agents, by what the detector did (snapshot, coalesced, rate_limited, ignored)",
            ["outcome"], registry=r,
        )  # fmt: skip
        self.detached = Counter(
            "stablewatch_agents_detached",
            "Agents the detector detached, by reason (no_heartbeat; outbox_full: its stream was not read)",
            ["reason"], registry=r,
        )  # fmt: skip
        for reason in DETACH_REASONS:
            self.detached.labels(reason)
        for outcome in RESOLUTION_OUTCOMES:
            self.resolutions.labels(outcome)
        for outcome in LATE_REPORT_OUTCOMES:
            self.late_reports.labels(outcome)
        for requester in ("detector", "operator"):
            self.breaks_sent.labels(requester)
        for outcome in HINT_OUTCOMES:
            self.wait_hints.labels(outcome)
        for reason in REJECTION_REASONS:
            self.rejected_parts.labels(reason)
        for reason in REFUSAL_REASONS:
            self.refused.labels(reason)
        for kind in ABORT_KINDS:
            self.aborts.labels(kind)
        for outcome in ("completed", "aborted"):
            self.snapshots.labels(outcome)

    def completed(self, seconds: float) -> None:
        """Count one complete snapshot, `seconds` from its start (every one, in whatever order they finish)."""
        self.snapshots.labels("completed").inc()
        self.duration.observe(seconds)

    def latest(
        self,
        snapshot_id: int,
        results: Sequence[PredicateResult],
        finished_at: float,
        in_flight: int,
        recorded_bytes: float,
    ) -> None:
        """Publish the latest complete snapshot's results: the newest (by id) there is. An older one
        that finishes after it is only counted (:meth:`completed`), never published over it.
        `in_flight` and `recorded_bytes` are its messages recorded in flight and their payload
        bytes (NaN: not known, as for a snapshot read back from the store at a restart)."""
        self.last_completed.set(finished_at)
        self.last_snapshot_id.set(snapshot_id)
        self.in_flight_messages.set(in_flight)
        self.recorded_bytes.set(recorded_bytes)
        for result in results:
            verdict = Verdict.of(result)
            self.predicate_value.labels(result.name).set(1 if verdict is Verdict.TRUE else 0)
            self.predicate_unknown.labels(result.name).set(1 if verdict is Verdict.UNKNOWN else 0)
            if result.name == "deadlock" and verdict is Verdict.UNKNOWN:
                # Not 0: that would say "nothing deadlocked" where the cut lacks the facts.
                self.deadlocked_nodes.set(math.nan)
                self.deadlock_cycles.set(math.nan)
            elif result.name == "deadlock":
                self.deadlocked_nodes.set(len(result.deadlock.deadlocked))
                self.deadlock_cycles.set(result.deadlock.separate_deadlocks)
            kind = result.WhichOneof("evidence")
            if kind == "conservation" and verdict is Verdict.UNKNOWN:
                # No number is better than a stale one: a drift alert must not fire on an open cut.
                for gauge in (self.counter_total, self.conservation_drift):
                    with contextlib.suppress(KeyError):
                        gauge.remove(result.conservation.counter)
            elif kind == "conservation":
                evidence = result.conservation
                self.counter_total.labels(evidence.counter).set(evidence.observed)
                self.conservation_drift.labels(evidence.counter).set(evidence.drift)

    def aborted(self, kind: str) -> None:
        self.snapshots.labels("aborted").inc()
        self.aborts.labels(kind).inc()
