"""Breaking proven deadlocks in the detector: the resolver's rules, the stored breaks, bad reports.

Pure and in-process: a real store in a temporary folder, the real evaluation, and a recorded
``send`` in place of the control streams (tests/test_breaking_e2e.py has the real processes).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from settable_clock import T0, Clock

from stablewatch.detector.evaluation import evaluate
from stablewatch.detector.service.metrics import DetectorMetrics
from stablewatch.detector.service.resolutions import NothingToResolve, Resolutions, outcome_word
from stablewatch.detector.service.resolver import Resolver
from stablewatch.detector.service.store import DB_FILENAME, Store
from stablewatch.v1 import WAIT_MODEL_AND, WAIT_MODEL_OR, GlobalSnapshot, LocalState, ProcessSnapshot, Wait, WaitNode
from stablewatch.v1.control_pb2 import (
    BREAK_OUTCOME_ALREADY_BROKEN,
    BREAK_OUTCOME_BROKEN,
    BREAK_OUTCOME_GONE,
    BreakReport,
    BreakWait,
)
from stablewatch.v1.query_pb2 import Resolution


def wait(task: str, target: tuple[str, str], instance: int, began_us: int) -> Wait:
    return Wait(
        task=task,
        targets=[WaitNode(process=target[0], task=target[1])],
        model=WAIT_MODEL_AND,
        instance=instance,
        began_at_us=began_us,
    )


def cycle_snapshot(snapshot_id: int, *, extra_free: bool = False) -> GlobalSnapshot:
    """a/x waits on b/y (instance 1, older), b/y waits on a/x (instance 7, younger): one deadlock."""
    processes = [
        ProcessSnapshot(process_id="a", state=LocalState(active=True, waits=[wait("x", ("b", "y"), 1, 1_000)])),
        ProcessSnapshot(process_id="b", state=LocalState(active=True, waits=[wait("y", ("a", "x"), 7, 2_000)])),
    ]
    if extra_free:
        processes.append(ProcessSnapshot(process_id="c", state=LocalState(active=True)))
    members = [p.process_id for p in processes]
    return GlobalSnapshot(snapshot_id=snapshot_id, processes=processes, expected_members=members)


def free_snapshot(snapshot_id: int) -> GlobalSnapshot:
    processes = [ProcessSnapshot(process_id=p, state=LocalState(active=True)) for p in ("a", "b")]
    return GlobalSnapshot(snapshot_id=snapshot_id, processes=processes, expected_members=["a", "b"])


class Harness:
    """Resolutions over a real store, sending into a list, with a settable clock."""

    def __init__(self, store: Store, clock: Clock, policy: str | None = "youngest", attached: bool = True) -> None:
        self.store, self.clock = store, clock
        self.sent: list[tuple[str, BreakWait]] = []
        self.published: list[Resolution] = []
        self.archived: list[Resolution] = []
        self.attached = attached
        self.metrics = DetectorMetrics()
        self.resolutions = Resolutions(
            send=self._send,
            metrics=self.metrics,
            publish=lambda r: self.published.append(Resolution.FromString(r.SerializeToString())),
            policy=policy,
            report_timeout=5.0,
            clock=clock,
        )
        self.resolutions.store = store
        self.resolutions.archive = self.archived.append

    def _send(self, process: str, order: BreakWait) -> bool:
        if self.attached:
            self.sent.append((process, order))
        return self.attached

    def complete(self, snapshot: GlobalSnapshot, started_at: float) -> list[Resolution]:
        """Store `snapshot` as completed (started at `started_at`) and hand it to the resolutions."""
        evaluation = evaluate(snapshot)
        self.store.begin(snapshot.snapshot_id, started_at, len(snapshot.processes))
        self.store.complete(snapshot, evaluation, started_at + 0.01)
        return self.resolutions.after_snapshot(snapshot, evaluation, started_at)

    def metric(self, name: str, **labels: str) -> float:
        value = self.metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value


def report(order: BreakWait, outcome: int = BREAK_OUTCOME_BROKEN, detail: str = "ABORTED") -> BreakReport:
    return BreakReport(break_id=order.break_id, instance=order.instance, outcome=outcome, detail=detail)


# -- the store ------------------------------------------------------------------------------------


def test_resolutions_are_stored_with_new_ids_updated_and_listed_newest_first(store: Store) -> None:
    first = store.add_resolution(Resolution(snapshot_id=5, process_id="a", instance=1))
    second = store.add_resolution(Resolution(snapshot_id=6, process_id="b", instance=2))
    assert second.resolution_id == first.resolution_id + 1
    second.outcome = BREAK_OUTCOME_BROKEN
    store.update_resolution(second)
    assert store.resolution(second.resolution_id) == second
    assert [r.resolution_id for r in store.resolutions(10)] == [second.resolution_id, first.resolution_id]
    assert [r.resolution_id for r in store.resolutions(10, before_id=second.resolution_id)] == [first.resolution_id]
    assert store.resolution(999) is None


def test_a_version_2_store_gains_an_empty_resolutions_table(tmp_path: Path) -> None:
    Store(tmp_path).close()
    db = sqlite3.connect(tmp_path / DB_FILENAME)
    db.execute("DROP TABLE resolutions")
    db.execute("UPDATE meta SET value = 2 WHERE key = 'schema_version'")
    db.commit()
    db.close()
    with Store(tmp_path) as store:
        assert store.resolutions(10) == []
        assert store.add_resolution(Resolution(snapshot_id=1)).resolution_id == 1


# -- breaking: one victim, once -------------------------------------------------------------------


def test_a_proven_deadlock_gets_one_break_for_its_youngest_wait(store: Store, clock: Clock) -> None:
    h = Harness(store, clock)
    sent = h.complete(cycle_snapshot(10), T0 - 1)
    assert len(sent) == 1 and len(h.sent) == 1
    process, order = h.sent[0]
    assert (process, order.instance, order.task, order.snapshot_id) == ("b", 7, "y", 10)
    assert order.break_id == sent[0].resolution_id
    assert "a/x" in order.deadlock and "b/y" in order.deadlock
    stored = store.resolution(order.break_id)
    assert stored is not None and outcome_word(stored) == "pending"
    assert stored.policy == "youngest" and stored.requested_by == "detector"
    assert {(n.process, n.task) for n in stored.component} == {("a", "x"), ("b", "y")}
    assert h.metric("stablewatch_breaks_sent_total", requested_by="detector") == 1


def test_the_oldest_policy_picks_the_other_wait(store: Store, clock: Clock) -> None:
    h = Harness(store, clock, policy="oldest")
    h.complete(cycle_snapshot(10), T0 - 1)
    assert [(p, o.instance) for p, o in h.sent] == [("a", 1)]


def test_no_second_victim_until_a_snapshot_started_after_the_report_still_shows_it(store: Store, clock: Clock) -> None:
    h = Harness(store, clock)
    h.complete(cycle_snapshot(10), T0 - 1)
    assert h.complete(cycle_snapshot(11), T0 - 0.5) == []  # the break is under way
    _, order = h.sent[0]
    clock.now = T0 + 1
    assert h.resolutions.reported("b", report(order)) is not None
    # Started before the report: it may have recorded the victim still waiting.
    assert h.complete(cycle_snapshot(12), T0 + 0.5) == []
    assert len(h.sent) == 1
    # Started after the report and still deadlocked: the next candidate, never the same wait again.
    again = h.complete(cycle_snapshot(13), T0 + 2)
    assert [(p, o.instance) for p, o in h.sent[1:]] == [("a", 1)]
    assert len(again) == 1


def growing_snapshot(snapshot_id: int, *, joined: bool) -> GlobalSnapshot:
    """a/x waits (AND) on b/y and c/z, b/y waits on a/x: the deadlock {a/x, b/y}, c/z free. With
    ``joined``, c/z (instance 3, the youngest) waits on a/x too: the component grows to {a, b, c}."""
    c_waits = [wait("z", ("a", "x"), 3, 3_000)] if joined else []
    both = Wait(
        task="x",
        targets=[WaitNode(process="b", task="y"), WaitNode(process="c", task="z")],
        model=WAIT_MODEL_AND,
        instance=2,
        began_at_us=2_000,
    )
    processes = [
        ProcessSnapshot(process_id="a", state=LocalState(active=True, waits=[both])),
        ProcessSnapshot(process_id="b", state=LocalState(active=True, waits=[wait("y", ("a", "x"), 1, 1_000)])),
        ProcessSnapshot(process_id="c", state=LocalState(active=True, waits=c_waits)),
    ]
    return GlobalSnapshot(snapshot_id=snapshot_id, processes=processes, expected_members=["a", "b", "c"])


def test_a_deadlock_that_grows_while_its_break_is_under_way_gets_no_second_victim(store: Store, clock: Clock) -> None:
    h = Harness(store, clock)
    h.complete(growing_snapshot(10, joined=False), T0 - 1)
    assert [(p, o.instance) for p, o in h.sent] == [("a", 2)]  # breaking a/x ends it whole
    # c/z has blocked on a/x since: the same deadlock, grown (another component, sharing nodes).
    assert h.complete(growing_snapshot(11, joined=True), T0 - 0.5) == []
    _, order = h.sent[0]
    clock.now = T0 + 1
    h.resolutions.reported("a", report(order))
    assert h.complete(growing_snapshot(12, joined=True), T0 + 0.5) == []  # began before the report
    assert len(h.sent) == 1
    # Begun after the report and still deadlocked: it outlived its victim, and the next wait goes.
    h.complete(growing_snapshot(13, joined=True), T0 + 2)
    assert [(p, o.instance) for p, o in h.sent[1:]] == [("c", 3)]


def test_a_report_is_stored_counted_archived_and_published(store: Store, clock: Clock) -> None:
    h = Harness(store, clock)
    h.complete(cycle_snapshot(10), T0 - 1)
    _, order = h.sent[0]
    clock.now = T0 + 0.25
    h.resolutions.reported("b", report(order, detail="ABORTED: the call was cancelled"))
    stored = store.resolution(order.break_id)
    assert stored is not None and outcome_word(stored) == "broken"
    assert stored.reported_at.ToMicroseconds() == int((T0 + 0.25) * 1e6)
    assert h.archived == [stored]
    assert [outcome_word(r) for r in h.published] == ["pending", "broken"]
    assert h.metric("stablewatch_deadlocks_resolved_total", outcome="broken") == 1
    assert h.metric("stablewatch_resolution_seconds_count") == 1
    assert h.metric("stablewatch_resolution_seconds_sum") == pytest.approx(1.25)  # from the snapshot's start


@pytest.mark.parametrize(
    ("outcome", "word"), [(BREAK_OUTCOME_GONE, "gone"), (BREAK_OUTCOME_ALREADY_BROKEN, "already_broken")]
)
def test_gone_and_already_broken_reports_are_recorded_as_such(
    store: Store, clock: Clock, outcome: int, word: str
) -> None:
    h = Harness(store, clock)
    h.complete(cycle_snapshot(10), T0 - 1)
    _, order = h.sent[0]
    h.resolutions.reported("b", report(order, outcome, "nothing done"))
    stored = store.resolution(order.break_id)
    assert stored is not None and outcome_word(stored) == word
    assert h.metric("stablewatch_resolution_seconds_count") == 0  # only broken waits are timed


def test_reports_that_answer_no_pending_break_change_nothing(store: Store, clock: Clock) -> None:
    h = Harness(store, clock)
    h.complete(cycle_snapshot(10), T0 - 1)
    _, order = h.sent[0]
    assert h.resolutions.reported("a", report(order)) is None  # not the victim's process
    assert h.resolutions.reported("b", BreakReport(break_id=order.break_id + 50, instance=7)) is None
    assert h.resolutions.reported("b", BreakReport(break_id=order.break_id, instance=8)) is None
    assert h.metric("stablewatch_break_reports_ignored_total") == 3
    stored = store.resolution(order.break_id)
    assert stored is not None and outcome_word(stored) == "pending"
    assert h.resolutions.reported("b", report(order)) is not None  # the real one still counts
    assert h.resolutions.reported("b", report(order)) is None  # once


def test_an_unanswered_break_is_given_up_after_the_timeout(store: Store, clock: Clock) -> None:
    h = Harness(store, clock)
    h.complete(cycle_snapshot(10), T0 - 1)
    assert len(h.sent) == 1
    clock.now = T0 + 4
    assert h.resolutions.expire() == []
    clock.now = T0 + 6
    [given_up] = h.resolutions.expire()
    assert outcome_word(given_up) == "unanswered" and "no report from b" in given_up.detail
    assert h.metric("stablewatch_deadlocks_resolved_total", outcome="unanswered") == 1
    # A snapshot that started after the detector gave up names the same wait again (the order may
    # have been lost; the agent breaks a wait at most once): another wait would be a second victim.
    h.complete(cycle_snapshot(11), T0 + 7)
    assert [(p, o.instance) for p, o in h.sent[1:]] == [(p, o.instance) for p, o in h.sent[:1]]


def test_a_victim_that_is_not_attached_is_recorded_and_not_retried_at_once(store: Store, clock: Clock) -> None:
    h = Harness(store, clock, attached=False)
    [resolution] = h.complete(cycle_snapshot(10), T0 - 1)
    assert outcome_word(resolution) == "not_attached"
    assert h.metric("stablewatch_deadlocks_resolved_total", outcome="not_attached") == 1
    assert h.complete(cycle_snapshot(11), T0 - 0.5) == []


def test_without_a_policy_nothing_is_broken_on_its_own(store: Store, clock: Clock) -> None:
    h = Harness(store, clock, policy=None)
    assert h.complete(cycle_snapshot(10), T0 - 1) == []
    assert h.sent == []


def test_no_deadlock_no_break(store: Store, clock: Clock) -> None:
    h = Harness(store, clock)
    assert h.complete(free_snapshot(10), T0 - 1) == []


def test_an_open_cut_whose_deadlock_is_unknown_is_never_broken(store: Store, clock: Clock) -> None:
    """b/y may be released by a process outside the cut (an OR wait): deadlock is unknown, nothing is broken."""
    snapshot = cycle_snapshot(10)
    snapshot.expected_members.append("elsewhere")  # expected but missing: the cut is open
    snapshot.processes[1].state.waits[0].targets.add(process="elsewhere")
    snapshot.processes[1].state.waits[0].model = WAIT_MODEL_OR
    h = Harness(store, clock)
    assert h.complete(snapshot, T0 - 1) == []


# -- an operator's request ------------------------------------------------------------------------


def test_an_operator_breaks_a_stored_snapshots_deadlock_once(store: Store, clock: Clock) -> None:
    h = Harness(store, clock, policy=None)
    h.complete(cycle_snapshot(10), T0 - 1)
    [resolution] = h.resolutions.resolve(10, "CN=alice")
    assert (resolution.policy, resolution.requested_by, resolution.instance) == ("operator", "CN=alice", 7)
    with pytest.raises(NothingToResolve, match="being broken already"):
        h.resolutions.resolve(10, "CN=alice")
    assert h.metric("stablewatch_breaks_sent_total", requested_by="operator") == 1


def test_an_operator_request_for_a_snapshot_without_a_deadlock_says_so(store: Store, clock: Clock) -> None:
    h = Harness(store, clock, policy=None)
    h.complete(free_snapshot(10), T0 - 1)
    with pytest.raises(NothingToResolve, match=r"proves no deadlock \(deadlock is false\)"):
        h.resolutions.resolve(10, "CN=alice")
    with pytest.raises(KeyError):
        h.resolutions.resolve(999, "CN=alice")
    assert h.sent == []


def other_deadlock(snapshot_id: int) -> GlobalSnapshot:
    """c/u and d/v wait on each other; a and b are free."""
    processes = [
        ProcessSnapshot(process_id="c", state=LocalState(active=True, waits=[wait("u", ("d", "v"), 50, 5_000)])),
        ProcessSnapshot(process_id="d", state=LocalState(active=True, waits=[wait("v", ("c", "u"), 51, 6_000)])),
        ProcessSnapshot(process_id="a", state=LocalState(active=True)),
        ProcessSnapshot(process_id="b", state=LocalState(active=True)),
    ]
    return GlobalSnapshot(snapshot_id=snapshot_id, processes=processes, expected_members=["a", "b", "c", "d"])


def test_an_operator_request_for_a_snapshot_older_than_a_forgotten_break_is_refused(store: Store, clock: Clock) -> None:
    h = Harness(store, clock)
    h.complete(cycle_snapshot(10), T0 - 1)
    _, order = h.sent[0]
    clock.now = T0 + 1
    h.resolutions.reported("b", report(order))  # broken: snapshot 10's deadlock is over
    # Two hours on, another deadlock: the first break's hold is dropped (kept an hour).
    clock.now = T0 + 7200
    h.complete(other_deadlock(20), T0 + 7200)
    sent = len(h.sent)
    # Snapshot 10 began before that break: its next candidate would be a second victim.
    with pytest.raises(NothingToResolve, match="take a new snapshot"):
        h.resolutions.resolve(10, "CN=alice")
    assert len(h.sent) == sent


def test_an_operator_request_for_a_snapshot_from_before_the_detector_started_is_refused(
    store: Store, clock: Clock
) -> None:
    h = Harness(store, clock, policy=None)
    h.complete(cycle_snapshot(10), T0 - 1)
    # The detector restarts: its holds (breaks it made, and their reports) are not kept.
    clock.now = T0
    restarted = Harness(store, clock, policy=None)
    restarted.resolutions.recover()
    with pytest.raises(NothingToResolve, match="restarted since"):
        restarted.resolutions.resolve(10, "CN=alice")
    assert restarted.sent == []
    restarted.complete(cycle_snapshot(11), T0 + 1)  # a new snapshot of it can be broken
    [resolution] = restarted.resolutions.resolve(11, "CN=alice")
    assert resolution.instance == 7


def test_the_resolver_refuses_a_bad_timeout() -> None:
    with pytest.raises(ValueError, match="report_timeout"):
        Resolver(report_timeout=0)
