"""Breaking proven deadlocks, as the detector carries it out: orders out, reports in, every break recorded.

:class:`~.resolver.Resolver` decides which waits to break and when; this room does the rest
(DESIGN.md, "Breaking a proven deadlock"): it stores each break as a ``Resolution`` before it
sends the ``BreakWait`` on the victim's control stream (so a crash never loses one that went out),
takes the agent's ``BreakReport`` in (only from the process the break was sent to), gives up on a
report that does not come (or that a detector restart made impossible), and hands every finished
break to the archive, the metrics and the watchers. An automatic break an agent refuses because the
detectors it attaches to break by different policies (``policies_disagree``) is recorded like the
others and logged as a warning, once per distinct refusal. An operator's order says which policy
chose its victim (``BreakWait.chosen_by``: this detector's, else ``youngest``), so that an agent
whose detectors all break unasked by another policy refuses it the same way: one of them may have
broken another wait of that deadlock already (one victim per deadlock whatever the policies). A
break whose breaking raised at the agent (``failed``) is logged as a warning with the agent's
error; as after a refusal, its wait is not named (the same wait is tried again, never another
one of the deadlock, which it may still hold). An operator's break of a stored snapshot goes
only to a process attached since before that snapshot began: one that attached again may have
restarted, and its wait instances then name other waits. ``stablewatch_resolution_seconds``
measures, per wait reported broken, the time from the start of the snapshot that proved the deadlock
to the agent's report: an upper bound on how long the deadlock lasted after that snapshot saw it.

A report that comes after its break was given up (a slow agent, a congested stream) is not lost: for
the resolver's ``late_window`` (a minute), the victim's process may still answer a break given up
on, and its answer becomes the break's record, as true as any other. The stored ``Resolution`` takes
the agent's outcome and the time its report came, and its ``detail`` says it came late and when
the detector had given up; that record is archived again (the archive's readers take the answer
over the earlier ``unanswered`` row: :func:`~stablewatch.detector.archive.schema.latest_rows`),
published to watchers again, and counted under its outcome in ``stablewatch_deadlocks_resolved``
and in ``stablewatch_break_reports_late`` (counters only go up: the give-up stays counted as
``unanswered``, it happened; ``unanswered`` minus the late answers is the breaks never answered).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime

from stablewatch.agents.breaking import OPERATOR
from stablewatch.detector.evaluation.victims import Victim
from stablewatch.detector.service.metrics import RESOLUTION_OUTCOMES, DetectorMetrics
from stablewatch.detector.service.resolver import (
    DEFAULT_LATE_WINDOW,
    DEFAULT_REFUSAL_PAUSE,
    DEFAULT_REPORT_TIMEOUT,
    NothingToResolve,
    Resolver,
    remember,
)
from stablewatch.detector.service.store import Store, StoreError
from stablewatch.v1 import Evaluation, GlobalSnapshot, WaitNode
from stablewatch.v1.bounds import MAX_TEXT_BYTES, quoted_prefix, too_long
from stablewatch.v1.control_pb2 import (
    BREAK_OUTCOME_BROKEN,
    BREAK_OUTCOME_FAILED,
    BREAK_OUTCOME_POLICIES_DISAGREE,
    BREAK_OUTCOME_UNSPECIFIED,
    BreakOutcome,
    BreakReport,
    BreakWait,
)
from stablewatch.v1.query_pb2 import Resolution

__all__ = ["NothingToResolve", "Resolutions", "outcome_word"]

_log = logging.getLogger(__name__)


def outcome_word(resolution: Resolution) -> str:
    """A break's outcome as a word of :data:`~.metrics.RESOLUTION_OUTCOMES` (``pending`` while its
    report may still come)."""
    if resolution.outcome != BREAK_OUTCOME_UNSPECIFIED:
        return BreakOutcome.Name(resolution.outcome).removeprefix("BREAK_OUTCOME_").lower()
    if not resolution.HasField("reported_at"):
        return "pending"
    return "not_attached" if resolution.detail.startswith(_NOT_ATTACHED) else "unanswered"


_NOT_ATTACHED = "the victim's process is not attached"


def _nothing_known_broken(report: BreakReport) -> bool:
    """Whether the agent's answer says nothing known was broken, so the same wait is named again
    (see :meth:`.Resolver.reported`): a refusal, or a break that raised at the agent."""
    return report.outcome in (BREAK_OUTCOME_POLICIES_DISAGREE, BREAK_OUTCOME_FAILED)


class Resolutions:
    """Sends the breaks the resolver chooses and records what became of each."""

    def __init__(
        self,
        *,
        send: Callable[[str, BreakWait], bool],
        metrics: DetectorMetrics,
        publish: Callable[[Resolution], None],
        policy: str | None = None,
        report_timeout: float = DEFAULT_REPORT_TIMEOUT,
        refusal_pause: float = DEFAULT_REFUSAL_PAUSE,
        late_window: float = DEFAULT_LATE_WINDOW,
        clock: Callable[[], float] = time.time,
        attached_at: Callable[[str], float | None] | None = None,
    ) -> None:
        self.policy = policy
        #: When a process's current control stream attached (wall clock; None: not attached). Wait
        #: instances are unique only within one run of a process, so a wait of a stored snapshot
        #: is named to its process only if it has been attached since before that snapshot began.
        #: None: not checked (every break then follows its snapshot at once).
        self.attached_at = attached_at
        self.store: Store | None = None  # set when the detector opens its store
        self.archive: Callable[[Resolution], None] | None = None
        self._send = send
        self._metrics = metrics
        self._publish = publish
        self._clock = clock
        self._resolver = Resolver(report_timeout=report_timeout, refusal_pause=refusal_pause, late_window=late_window)
        self._pending: dict[int, Resolution] = {}  # break id -> the break, until its report
        self._refusals_told: dict[str, None] = {}  # the refusals logged as warnings (bounded)
        self._unstored: dict[int, Resolution] = {}  # break id -> its outcome, not stored yet (the store failed)

    def after_snapshot(self, snapshot: GlobalSnapshot, evaluation: Evaluation, started_at: float) -> list[Resolution]:
        """With a policy (``--resolve``), break the deadlocks ``snapshot`` proves; the breaks sent."""
        if self.policy is None:
            return []
        victims = self._resolver.victims(snapshot, evaluation, started_at, self.policy)
        return [self._break(snapshot.snapshot_id, victim, self.policy, "detector") for victim in victims]

    def resolve(self, snapshot_id: int, requested_by: str) -> list[Resolution]:
        """An operator's request: break the deadlocks of completed snapshot ``snapshot_id`` now.

        Raises KeyError for a snapshot the store does not hold complete, :class:`NothingToResolve`
        (saying why) when it proves no deadlock or every deadlock it shows is being broken.
        """
        store = self._store()
        snapshot, evaluation = store.snapshot(snapshot_id), store.evaluation(snapshot_id)
        summary = store.summary(snapshot_id)
        if snapshot is None or evaluation is None or summary is None:
            raise KeyError(f"snapshot {snapshot_id} is not a completed snapshot this detector holds")
        policy = self.policy or "youngest"
        started_at = summary.started_at.ToMicroseconds() / 1e6
        victims = self._resolver.victims(snapshot, evaluation, started_at, policy, operator=True)
        if not victims:
            why = self._resolver.why_none(evaluation, started_at)
            raise NothingToResolve(f"snapshot {snapshot_id} has nothing to break: {why}")
        # A stored snapshot may be old: a process that attached again since it began may have
        # restarted, and its instance numbers then name other waits, in no proven deadlock.
        since = self.attached_at
        stale = [] if since is None else [v for v in victims if (t := since(v.process)) is not None and t > started_at]
        if stale:
            who = ", ".join(sorted({quoted_prefix(v.process) for v in stale}))
            _log.warning("not breaking waits of %s named by snapshot %d: attached again since", who, snapshot_id)
            victims = [v for v in victims if v not in stale]
            if not victims:
                raise NothingToResolve(
                    f"snapshot {snapshot_id} has nothing to break: {who} attached again after snapshot "
                    f"{snapshot_id} started (it may have restarted, and its waits be others now): take a new snapshot"
                )
        return [self._break(snapshot_id, victim, OPERATOR, requested_by, chosen_by=policy) for victim in victims]

    def reported(self, process_id: str, report: BreakReport) -> Resolution | None:
        """An agent answered a break; ignored (and logged) unless it is the victim's process answering
        a break still waiting for its report, or one given up on less than the late window ago
        (then the record is corrected: see the module docstring)."""
        resolution = self._pending.get(report.break_id)
        if resolution is None or resolution.process_id != process_id or resolution.instance != report.instance:
            return self._late(process_id, report)
        del self._pending[report.break_id]
        now = self._clock()
        self._resolver.reported(report.break_id, now, refused=_nothing_known_broken(report))
        self._answer(resolution, report, now)
        self._finished(resolution)
        return resolution

    def expire(self) -> list[Resolution]:
        """Give up on the breaks whose report is overdue; those given up."""
        now = self._clock()
        given_up = []
        for break_id in self._resolver.overdue(now):
            resolution = self._pending.pop(break_id, None)
            if resolution is None:
                continue
            resolution.reported_at.FromMicroseconds(int(now * 1e6))
            resolution.detail = f"no report from {resolution.process_id} within {self._resolver.report_timeout:g} s"
            self._finished(resolution)
            given_up.append(resolution)
        return given_up

    def recover(self) -> list[Resolution]:
        """Give up on the breaks the store holds as pending: sent by this detector before it stopped.

        Called once as the detector starts, before it sends any break. A report answers a break on
        the control stream it was sent on, and those streams ended with the detector, so no report
        of these can come: each is finished as unanswered (stored, counted, archived, published)
        rather than listed as pending for ever. Whether the agent broke the wait is unknown; a cut
        that still shows the deadlock names the same wait again, and the agent breaks it at most once.
        """
        store = self._store()
        now = self._clock()
        # The holds of breaks made before this start are not kept: a snapshot begun before it may
        # show a deadlock broken since, and gets no victim.
        self._resolver.forget_until(now)
        stale: list[Resolution] = []
        before: int | None = None
        while page := store.resolutions(500, before):
            stale.extend(r for r in page if not r.HasField("reported_at") and r.resolution_id not in self._pending)
            before = page[-1].resolution_id
        for resolution in reversed(stale):  # oldest first
            resolution.reported_at.FromMicroseconds(int(now * 1e6))
            resolution.detail = "no report: the detector restarted before it came"
            self._finished(resolution)
        return stale

    # -- internals --------------------------------------------------------------------------------

    def _late(self, process_id: str, report: BreakReport) -> Resolution | None:
        """A report for no pending break: the answer to one given up on lately, or ignored."""
        now = self._clock()
        refused = _nothing_known_broken(report)
        # The resolver checks the process and the wait: the break named them when it went out.
        wait = (process_id, report.instance)
        # A late report without an answer this detector knows would only say "unanswered" again.
        known = report.outcome in BreakOutcome.values() and report.outcome != BREAK_OUTCOME_UNSPECIFIED
        remembered = known and self._resolver.remembers(report.break_id)
        resolution = self._store().resolution(report.break_id) if remembered else None
        if resolution is None or not self._resolver.reported_late(report.break_id, wait, now, refused=refused):
            self._metrics.unexpected_reports.inc()
            _log.warning(
                "ignored a break report from %s for break %d: no such break is waiting for that process's answer",
                quoted_prefix(process_id),
                report.break_id,
            )
            return None
        gave_up = resolution.reported_at.ToMicroseconds() / 1e6
        sent = resolution.sent_at.ToMicroseconds() / 1e6
        self._answer(resolution, report, now)
        resolution.detail += (
            f" (reported late, {now - sent:.1f} s after the break was sent: the detector gave up waiting at "
            f"{datetime.fromtimestamp(gave_up, UTC).isoformat(timespec='milliseconds')})"
        )
        self._metrics.late_reports.labels(outcome_word(resolution)).inc()
        self._finished(resolution)
        return resolution

    def _answer(self, resolution: Resolution, report: BreakReport, now: float) -> None:
        """Record the agent's answer in ``resolution``."""
        resolution.reported_at.FromMicroseconds(int(now * 1e6))
        resolution.outcome = report.outcome if report.outcome in BreakOutcome.values() else BREAK_OUTCOME_UNSPECIFIED
        detail = report.detail
        resolution.detail = quoted_prefix(detail, 1024) if too_long(detail, MAX_TEXT_BYTES) else detail[:4096]
        if report.outcome == BREAK_OUTCOME_POLICIES_DISAGREE:
            self._refused(resolution)
        elif report.outcome == BREAK_OUTCOME_FAILED:
            _log.warning(
                "%s failed to break wait %d of the deadlock of snapshot %d: %s",
                quoted_prefix(resolution.process_id), resolution.instance, resolution.snapshot_id, resolution.detail,
            )  # fmt: skip

    def _store(self) -> Store:
        assert self.store is not None, "the detector sets the store when it starts"
        return self.store

    def _break(
        self, snapshot_id: int, victim: Victim, policy: str, requested_by: str, *, chosen_by: str = ""
    ) -> Resolution:
        now = self._clock()
        resolution = Resolution(
            snapshot_id=snapshot_id,
            process_id=victim.process,
            task=victim.task,
            instance=victim.instance,
            policy=policy,
            requested_by=requested_by,
            component=[WaitNode(process=p, task=t) for p, t in victim.component],
            deadlock=victim.deadlock_text,
        )
        if victim.began_at_us:
            resolution.wait_began_at.FromMicroseconds(victim.began_at_us)
        resolution.sent_at.FromMicroseconds(int(now * 1e6))
        resolution = self._store().add_resolution(resolution)  # stored before it goes out
        self._resolver.sent(victim, resolution.resolution_id, now)
        self._metrics.breaks_sent.labels(requested_by if requested_by == "detector" else "operator").inc()
        order = BreakWait(
            break_id=resolution.resolution_id,
            snapshot_id=snapshot_id,
            instance=victim.instance,
            task=victim.task,
            deadlock=victim.deadlock_text,
            policy=policy,  # "operator": one explicit order, carried out even while policies disagree
            chosen_by=chosen_by,  # an operator's: refused where the detectors agree on another policy
            knows_failed=True,
        )
        _log.info(
            "breaking wait %d of %s (task %r) to end the deadlock of snapshot %d: %s",
            victim.instance, victim.process, victim.task, snapshot_id, victim.deadlock_text,
        )  # fmt: skip
        if self._send(victim.process, order):
            self._pending[resolution.resolution_id] = resolution
            self._publish(resolution)
        else:
            self._resolver.unsent(resolution.resolution_id, now)
            resolution.reported_at.FromMicroseconds(int(now * 1e6))
            resolution.detail = f"{_NOT_ATTACHED}: the break was not sent"
            self._finished(resolution)
        return resolution

    def _store_outcome(self, resolution: Resolution) -> None:
        """Store what became of `resolution`, and the outcomes a failed store write left unstored before.

        One the store fails to take (disk full) is logged and kept for the next try, rather than left
        pending in the store, where a restart would call it unanswered. StoreError for a break the
        store does not hold.
        """
        stored = Resolution()
        stored.CopyFrom(resolution)  # the caller may go on changing its own
        self._unstored[resolution.resolution_id] = stored
        for break_id, outcome in list(self._unstored.items()):
            try:
                self._store().update_resolution(outcome)
            except StoreError:  # no such break (any more): nothing to set right
                del self._unstored[break_id]
                if break_id == resolution.resolution_id:
                    raise
                continue
            except Exception as error:
                _log.error(
                    "could not store the outcome of break %d: %s; trying again with the next one", break_id, error
                )
                continue
            del self._unstored[break_id]

    def _refused(self, resolution: Resolution) -> None:
        """Warn of an agent's refusal (the detectors' policies disagree) once per distinct reason."""
        reason = resolution.detail.partition(": ")[2] or resolution.detail  # without the wait's number
        if reason in self._refusals_told:
            return
        remember(self._refusals_told, reason, bound=100)
        _log.warning(
            "%s refused to break wait %d of the deadlock of snapshot %d: %s",
            quoted_prefix(resolution.process_id), resolution.instance, resolution.snapshot_id, resolution.detail,
        )  # fmt: skip

    def _finished(self, resolution: Resolution) -> None:
        """Store, count, archive and publish a break whose outcome is known."""
        self._store_outcome(resolution)
        word = outcome_word(resolution)
        assert word in RESOLUTION_OUTCOMES, word
        self._metrics.resolutions.labels(word).inc()
        if resolution.outcome == BREAK_OUTCOME_BROKEN:
            summary = self._store().summary(resolution.snapshot_id)
            if summary is not None:
                started = summary.started_at.ToMicroseconds() / 1e6
                self._metrics.resolution_seconds.observe(
                    max(0.0, resolution.reported_at.ToMicroseconds() / 1e6 - started)
                )
        if self.archive is not None:
            self.archive(resolution)
        self._publish(resolution)
        _log.info(
            "break %d of wait %d of %s: %s%s",
            resolution.resolution_id, resolution.instance, resolution.process_id, word,
            f" ({resolution.detail})" if resolution.detail else "",
        )  # fmt: skip
