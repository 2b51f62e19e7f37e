"""The CLI's display of the detector's answers, found by review.

* ``stablewatch watch`` (WatchView) must not show an older snapshot that finishes after a newer one
  as current: the detector streams it (with no changes), but its latest results stay the newest's.
* The detector's strings (summaries, errors, process ids, task names such as ``A/t[wait 1]``,
  addresses, deadlock text, victims, missing members) are text, not Rich markup: ``[wait 1]`` must
  not vanish, and ``[/]`` must not raise MarkupError.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import grpc
import pytest
from rich.console import Console
from test_detector_service_review import FREE, System, deadlock, overlap

from polling import poll
from stablewatch.cli import health, status
from stablewatch.cli.client import DetectorError
from stablewatch.cli.render import (
    WatchView,
    members_table,
    predicate_table,
    resolutions_table,
    resolve_report,
    snapshot_report,
)
from stablewatch.detector.evaluation import Verdict, evaluate
from stablewatch.detector.service.watch import WatchHub
from stablewatch.v1 import WAIT_MODEL_OR, GlobalSnapshot, PredicateResult
from stablewatch.v1.bounds import process_id_problem
from stablewatch.v1.query_pb2 import (
    SNAPSHOT_OUTCOME_ABORTED,
    SNAPSHOT_OUTCOME_COMPLETED,
    ListMembersResponse,
    ListResolutionsResponse,
    Member,
    Resolution,
    SnapshotResults,
    SnapshotSummary,
    WatchEvent,
)

pytestmark = pytest.mark.timeout(120)


def _text(renderable: object) -> str:
    console = Console(record=True, width=300, color_system=None)
    console.print(renderable)
    return console.export_text()


# -- watch: the newest snapshot, not the last to finish ------------------------------------------------------


def _results(snapshot_id: int, deadlocked: bool) -> SnapshotResults:
    return SnapshotResults(
        snapshot=SnapshotSummary(snapshot_id=snapshot_id, outcome=SNAPSHOT_OUTCOME_COMPLETED, processes=2),
        results=[
            PredicateResult(
                name="deadlock", holds=deadlocked, summary="cycle A -> B -> A" if deadlocked else "no cycle"
            )
        ],
    )


def _published(hub: WatchHub, results: SnapshotResults, newest: bool) -> WatchEvent:
    """What Detector.take_snapshot publishes: the changes against the newest results, none for an older one."""
    changes = hub.changes(results.results) if newest else []
    return WatchEvent(results=results, changes=changes, snapshot_id=results.snapshot.snapshot_id)


def test_an_older_snapshot_finishing_late_is_not_shown_as_current() -> None:
    hub, view = WatchHub(), WatchView()
    view.update(_published(hub, _results(10, deadlocked=False), newest=True))
    view.update(_published(hub, _results(20, deadlocked=True), newest=True))  # a proven deadlock, newest
    # Snapshot 15 started before 20 but finished after it: streamed, with no changes.
    view.update(_published(hub, _results(15, deadlocked=False), newest=False))
    lines = _text(view.render()).splitlines()
    # GetLatestResults says #20, deadlock true: so does the table, and its header.
    row = view.rows["deadlock"]
    assert row.holds and row.summary == "cycle A -> B -> A" and row.since == 20
    assert lines[0].startswith("snapshot #20 completed"), lines
    assert lines[1] == "snapshot #15 completed after a newer one (#20); not the latest", lines
    assert any("│ deadlock  │ true  │   #20 │ cycle A -> B -> A" in line for line in lines), lines

    # The next newest snapshot is current again, and the note about #15 goes.
    view.update(_published(hub, _results(21, deadlocked=False), newest=True))
    lines = _text(view.render()).splitlines()
    assert not view.rows["deadlock"].holds and view.rows["deadlock"].since == 21
    assert lines[0].startswith("snapshot #21 completed") and "not the latest" not in "\n".join(lines)


def test_an_abort_is_news_and_only_completed_snapshots_make_one_late() -> None:
    def aborted(snapshot_id: int) -> WatchEvent:
        summary = SnapshotSummary(snapshot_id=snapshot_id, outcome=SNAPSHOT_OUTCOME_ABORTED, abort_reason="deadline")
        return WatchEvent(results=SnapshotResults(snapshot=summary), snapshot_id=snapshot_id)

    hub, view = WatchHub(), WatchView()
    view.update(_published(hub, _results(20, deadlocked=False), newest=True))
    view.update(aborted(22))
    assert _text(view.render()).splitlines()[0].startswith("snapshot #22 aborted at")
    # #21 completes after #22 aborted: the newest completed snapshot, so the detector's latest.
    view.update(_published(hub, _results(21, deadlocked=True), newest=True))
    assert view.rows["deadlock"].holds and view.rows["deadlock"].since == 21
    lines = _text(view.render()).splitlines()
    assert lines[0].startswith("snapshot #21 completed") and "not the latest" not in lines[1]
    view.update(aborted(19))  # an older abort finishing late is no news of the present
    lines = _text(view.render()).splitlines()
    assert lines[0].startswith("snapshot #21 completed")
    assert lines[1] == "snapshot #19 aborted after a newer one (#21); not the latest"


def test_watch_shows_the_newest_snapshot_not_the_last_to_finish(tmp_path: Path) -> None:
    """End to end: a real detector's Watch stream (two overlapping snapshots, the newer proving a
    deadlock finishes first) fed into WatchView, the state behind `stablewatch watch`."""
    system = System(tmp_path / "data")
    events: list[WatchEvent] = []

    async def collect() -> None:
        async for event in system.detector.watch("reviewer"):
            events.append(event)

    try:
        assert deadlock(system.snapshot(FREE)) is Verdict.FALSE
        watching = asyncio.run_coroutine_threadsafe(collect(), system.running.loop)
        try:
            poll(lambda: events, "the watcher's first event")
            s1, s2 = overlap(system)  # s2 (deadlock true) finishes first, then s1 (false)
            poll(lambda: any(e.snapshot_id == s1 for e in events[1:]), "s1's event")
        finally:
            watching.cancel()
        latest = system.detector.latest()  # what GetLatestResults / status say
    finally:
        system.stop()
    assert latest.snapshot.snapshot_id == s2 and deadlock(latest) is Verdict.TRUE
    view = WatchView()
    for event in events:
        view.update(event)
    text = _text(view.render())
    assert view.rows["deadlock"].holds, f"`stablewatch status` says deadlock true (#{s2}); watch shows:\n{text}"
    assert text.splitlines()[0].startswith(f"snapshot #{s2} completed"), text
    assert f"snapshot #{s1} completed after a newer one (#{s2}); not the latest" in text


# -- the detector's strings are text, not markup --------------------------------------------------------------


def _deadlock_through_a_split_task() -> PredicateResult:
    """A real evaluation whose deadlock cycle names the node "A/t[wait 1]"."""
    s = GlobalSnapshot(snapshot_id=5)
    a = s.processes.add(process_id="A")
    a.state.waits.add(task="t").targets.add(process="B")
    a.state.waits.add(task="t", model=WAIT_MODEL_OR).targets.add(process="B")
    b = s.processes.add(process_id="B")
    b.state.waits.add().targets.add(process="A")
    (found,) = [r for r in evaluate(s, {}, []).results if r.name == "deadlock"]
    assert "A/t[wait 1]" in found.summary
    return found


def test_the_predicate_table_keeps_the_cycle_as_the_detector_wrote_it() -> None:
    found = _deadlock_through_a_split_task()
    assert "A/t[wait 1]" in _text(predicate_table([found]))


def test_the_watch_table_keeps_the_cycle_as_the_detector_wrote_it() -> None:
    found = _deadlock_through_a_split_task()
    view = WatchView()
    summary = SnapshotSummary(snapshot_id=5, outcome=SNAPSHOT_OUTCOME_COMPLETED)
    view.update(WatchEvent(results=SnapshotResults(snapshot=summary, results=[found]), snapshot_id=5))
    assert "A/t[wait 1]" in _text(view.render())


def test_an_error_with_brackets_in_the_watch_table_does_not_crash() -> None:
    view = WatchView()
    summary = SnapshotSummary(snapshot_id=5, outcome=SNAPSHOT_OUTCOME_COMPLETED)
    result = PredicateResult(name="mine[x]", unknown=True, error="ValueError: bad key [/]")
    view.update(WatchEvent(results=SnapshotResults(snapshot=summary, results=[result]), snapshot_id=5))
    text = _text(view.render())
    assert "bad key [/]" in text and "mine[x]" in text


def test_resolve_report_and_table_keep_the_deadlock_text_victim_and_requester() -> None:
    r = Resolution(
        resolution_id=1,
        snapshot_id=5,
        process_id="A",
        task="t[wait 1]",
        instance=3,
        deadlock="cycle A -> A/t -> A/t[wait 1] -> B -> A",
        policy="operator",
        requested_by="CN=[ops]",
    )
    report = _text(resolve_report(5, [r]))
    assert "A/t[wait 1] -> B" in report
    assert "wait 3 of A/t[wait 1]" in report
    assert "(requested by CN=[ops])" in report
    table = _text(resolutions_table([r]))
    assert "of A/t[wait 1]" in table and "CN=[ops]" in table


def test_a_user_predicate_error_with_brackets_does_not_crash_status() -> None:
    result = PredicateResult(name="mine", unknown=True, error="ValueError: bad key [/]")
    assert "bad key [/]" in _text(predicate_table([result]))


def test_a_process_id_and_address_with_brackets_stay_whole() -> None:
    assert process_id_problem("A[/]") is None  # a valid process id
    text = _text(members_table([Member(process_id="A[/]", address="[fe80::1]:7000")], now=0))
    assert "A[/]" in text and "[fe80::1]:7000" in text


def test_process_ids_with_brackets_in_a_simulation_report() -> None:
    s = GlobalSnapshot(snapshot_id=1)
    s.processes.add(process_id="p[bold]").state.counters["x"] = 3
    s.processes.add(process_id="q[/]").state.counters["x"] = 4
    assert "p[bold]=3 q[/]=4" in _text(snapshot_report([(s, [])], title="1 snapshot"))


class _StatusClient:
    address = "[fe80::1]:50051"

    def membership(self) -> ListMembersResponse:
        return ListMembersResponse(expected_missing=["db[primary]", "cache[/]"])

    def latest_results(self) -> SnapshotResults:
        raise DetectorError("none yet", grpc.StatusCode.NOT_FOUND)

    def list_resolutions(self, page_size: int) -> ListResolutionsResponse:
        return ListResolutionsResponse()

    def health(self) -> str:
        return "SERVING"


def test_status_names_the_expected_members_that_are_missing() -> None:
    console = Console(record=True, width=300, color_system=None)
    status._status(_StatusClient(), argparse.Namespace(json=False), console)
    assert "expected but not attached: db[primary], cache[/] (whole-system" in console.export_text()


def test_health_keeps_a_bracketed_address() -> None:
    console = Console(record=True, width=300, color_system=None)
    assert health._health(_StatusClient(), argparse.Namespace(json=False), console) == 0
    assert console.export_text() == "[fe80::1]:50051: SERVING\n"
