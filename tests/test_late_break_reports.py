"""A break's report that comes after the detector gave up on it: recorded as what really happened.

The detector gives a break up as ``unanswered`` after ``report_timeout`` (DESIGN.md, "Breaking a
proven deadlock"). An agent that was only slow still answers; when it says it broke the wait, the
record (store, archive, metrics, watchers, the CLI) must say ``broken`` in the end, and a later
cut must not name the wait again. Pure and in-process (the harness of tests/test_resolutions.py, a
settable clock), except the last test, which runs a real detector and the CLI.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from control_streams import RawAgent
from settable_clock import T0, Clock
from test_resolutions import Harness, cycle_snapshot, report

from polling import async_poll, poll
from stablewatch.cli.main import main
from stablewatch.detector.archive.files import ensure_archive, parquet_files
from stablewatch.detector.archive.reader import check, read_resolutions
from stablewatch.detector.archive.writer import ArchiveWriter, write_resolution_batch
from stablewatch.detector.evaluation import evaluate
from stablewatch.detector.service.detector import DetectorConfig
from stablewatch.detector.service.resolutions import outcome_word
from stablewatch.detector.service.resolver import DEFAULT_LATE_WINDOW, Resolver
from stablewatch.detector.service.store import Store
from stablewatch.testing.detector import Running
from stablewatch.v1 import AgentMessage, LocalSnapshotPart, LocalState
from stablewatch.v1.control_pb2 import (
    BREAK_OUTCOME_ALREADY_BROKEN,
    BREAK_OUTCOME_BROKEN,
    BREAK_OUTCOME_POLICIES_DISAGREE,
    BreakReport,
    BreakWait,
)
from stablewatch.v1.query_pb2 import Resolution

pytestmark = pytest.mark.timeout(60)

TIMEOUT = 5.0  # the harness's report_timeout


def given_up(h: Harness, clock: Clock, snapshot_id: int = 10) -> tuple[BreakWait, Resolution]:
    """A break of b's wait 7 for the deadlock of ``snapshot_id``, given up as unanswered at T0 + 6."""
    h.complete(cycle_snapshot(snapshot_id), T0 - 1)
    _, order = h.sent[-1]
    clock.now = T0 + TIMEOUT + 1
    [unanswered] = h.resolutions.expire()
    assert outcome_word(unanswered) == "unanswered"
    return order, unanswered


def words(resolutions: list[Resolution]) -> list[str]:
    return [outcome_word(r) for r in resolutions]


# -- the record --------------------------------------------------------------------------------------


def test_a_late_broken_report_corrects_the_stored_and_archived_record(store: Store, clock: Clock) -> None:
    h = Harness(store, clock)
    order, _ = given_up(h, clock)
    clock.now = T0 + 9
    late = h.resolutions.reported("b", report(order, detail="ABORTED: the call was cancelled"))
    assert late is not None and outcome_word(late) == "broken"
    stored = store.resolution(order.break_id)
    assert stored is not None and outcome_word(stored) == "broken"
    assert stored.reported_at.ToMicroseconds() == int((T0 + 9) * 1e6)  # when the agent's report came
    assert stored.detail.startswith("ABORTED: the call was cancelled")
    assert "reported late" in stored.detail and "gave up" in stored.detail  # and when it gave up
    # The archive hears of it twice: given up, then the correction; the last word is the answer.
    assert words(h.archived) == ["unanswered", "broken"] and h.archived[-1] == stored
    assert words(h.published) == ["pending", "unanswered", "broken"]


def test_late_answers_are_counted_under_their_word_and_as_late(store: Store, clock: Clock) -> None:
    """Counters only go up: the give-up stays counted (it happened), the answer is counted too, and
    ``stablewatch_break_reports_late_total`` says how many give-ups an answer followed."""
    h = Harness(store, clock)
    order, _ = given_up(h, clock)
    clock.now = T0 + 9
    h.resolutions.reported("b", report(order))
    assert h.metric("stablewatch_deadlocks_resolved_total", outcome="unanswered") == 1
    assert h.metric("stablewatch_deadlocks_resolved_total", outcome="broken") == 1
    assert h.metric("stablewatch_break_reports_late_total", outcome="broken") == 1
    assert h.metric("stablewatch_break_reports_ignored_total") == 0
    assert h.metric("stablewatch_resolution_seconds_count") == 1
    assert h.metric("stablewatch_resolution_seconds_sum") == pytest.approx(10.0)  # from the snapshot's start


def test_a_late_refusal_is_recorded_and_names_nothing(store: Store, clock: Clock) -> None:
    h = Harness(store, clock)
    order, _ = given_up(h, clock)
    clock.now = T0 + 9
    late = h.resolutions.reported("b", report(order, BREAK_OUTCOME_POLICIES_DISAGREE, "7: policies differ"))
    assert late is not None and outcome_word(late) == "policies_disagree"
    assert h.metric("stablewatch_break_reports_late_total", outcome="policies_disagree") == 1
    # Nothing was broken: the refusal pause holds the detector's policy off the deadlock ...
    assert h.complete(cycle_snapshot(11), T0 + 10) == []
    # ... and after it, the same wait is named again (every detector names it).
    h.complete(cycle_snapshot(12), T0 + 9 + 61)
    assert [(p, o.instance) for p, o in h.sent] == [("b", 7), ("b", 7)]


# -- who may answer late, and until when ---------------------------------------------------------------


def test_a_late_report_from_another_process_or_for_another_wait_is_ignored(store: Store, clock: Clock) -> None:
    h = Harness(store, clock)
    order, _ = given_up(h, clock)
    clock.now = T0 + 9
    assert h.resolutions.reported("a", report(order)) is None  # not the victim's process
    assert h.resolutions.reported("b", BreakReport(break_id=order.break_id, instance=8)) is None
    assert h.metric("stablewatch_break_reports_ignored_total") == 2
    stored = store.resolution(order.break_id)
    assert stored is not None and outcome_word(stored) == "unanswered"
    assert words(h.archived) == ["unanswered"]
    # The victim's own answer still counts, once.
    assert h.resolutions.reported("b", report(order)) is not None
    assert h.resolutions.reported("b", report(order)) is None
    assert words(h.archived) == ["unanswered", "broken"]
    assert h.metric("stablewatch_deadlocks_resolved_total", outcome="broken") == 1


def test_a_report_after_the_late_window_is_ignored(store: Store, clock: Clock) -> None:
    h = Harness(store, clock)
    order, _ = given_up(h, clock)
    clock.now = T0 + TIMEOUT + 1 + DEFAULT_LATE_WINDOW + 0.5
    h.resolutions.expire()  # forgets what it gave up longer ago than the window
    assert h.resolutions.reported("b", report(order)) is None
    stored = store.resolution(order.break_id)
    assert stored is not None and outcome_word(stored) == "unanswered"
    assert h.metric("stablewatch_break_reports_ignored_total") == 1
    assert h.metric("stablewatch_break_reports_late_total", outcome="broken") == 0


def test_the_breaks_given_up_are_remembered_in_bounded_memory() -> None:
    resolver = Resolver(report_timeout=1.0, late_window=30.0, max_given_up=3)
    snapshots = [cycle_snapshot(i) for i in range(6)]
    for break_id, snapshot in enumerate(snapshots, start=1):
        # Each snapshot names b's wait 7 again once the break before it was given up.
        [victim] = resolver.victims(snapshot, evaluate(snapshot), float(break_id * 10), "youngest")
        resolver.sent(victim, break_id, float(break_id * 10))
        assert resolver.overdue(float(break_id * 10 + 2)) == [break_id]
    assert resolver.given_up == 3  # the three newest
    assert not resolver.reported_late(1, ("b", 7), 63.0)  # forgotten (the bound)
    assert resolver.reported_late(6, ("b", 7), 63.0)
    assert resolver.given_up == 2
    assert not resolver.reported_late(4, ("b", 7), 42.0 + 30.5)  # forgotten (the window)
    assert resolver.given_up == 1  # break 5, given up 20.5 s before


def test_the_late_window_and_bound_are_checked() -> None:
    with pytest.raises(ValueError, match="late_window"):
        Resolver(late_window=-1)
    with pytest.raises(ValueError, match="max_given_up"):
        Resolver(max_given_up=0)


# -- the resolver: no second break, nothing counted twice ------------------------------------------------


def test_a_wait_reported_broken_late_is_not_named_again(store: Store, clock: Clock) -> None:
    h = Harness(store, clock)
    order, _ = given_up(h, clock)
    clock.now = T0 + 9
    h.resolutions.reported("b", report(order))
    # Started before the late report: it may have recorded the victim still waiting. No victim.
    assert h.complete(cycle_snapshot(11), T0 + 8) == []
    # Started after it and still deadlocked: the next candidate, as after any report in time.
    h.complete(cycle_snapshot(12), T0 + 10)
    assert [(p, o.instance) for p, o in h.sent] == [("b", 7), ("a", 1)]


def test_a_resent_break_of_the_same_wait_ends_already_broken_and_nothing_is_counted_twice(
    store: Store, clock: Clock
) -> None:
    h = Harness(store, clock)
    first, _ = given_up(h, clock)
    # A cut begun after the give-up names the same wait again (the order may have been lost).
    h.complete(cycle_snapshot(11), T0 + 7)
    _, second = h.sent[-1]
    assert (second.instance, second.break_id) == (7, first.break_id + 1)
    clock.now = T0 + 8
    assert h.resolutions.reported("b", report(first)) is not None  # the first order did break it
    clock.now = T0 + 8.5
    assert h.resolutions.reported("b", report(second, BREAK_OUTCOME_ALREADY_BROKEN, "7 was broken")) is not None
    assert [outcome_word(r) for r in (store.resolution(first.break_id), store.resolution(second.break_id))] == [
        "broken",
        "already_broken",
    ]
    assert h.metric("stablewatch_deadlocks_resolved_total", outcome="broken") == 1
    assert h.metric("stablewatch_deadlocks_resolved_total", outcome="already_broken") == 1
    assert h.metric("stablewatch_resolution_seconds_count") == 1  # one wait broken, timed once


def test_a_wait_answered_late_stays_named_when_its_resent_break_is_given_up_too(store: Store, clock: Clock) -> None:
    h = Harness(store, clock)
    first, _ = given_up(h, clock)
    h.complete(cycle_snapshot(11), T0 + 7)
    clock.now = T0 + 8
    h.resolutions.reported("b", report(first))
    clock.now = T0 + 7 + TIMEOUT + 1
    [second] = h.resolutions.expire()  # the re-sent order's answer is slow too
    assert second.resolution_id == first.break_id + 1
    h.complete(cycle_snapshot(12), T0 + 20)
    assert [o.instance for _, o in h.sent] == [7, 7, 1]  # b's wait 7, broken, is never named a third time


# -- a restart, the archive, the CLI ----------------------------------------------------------------------


def run_writer(root: Path, store: Store, handed: list[Resolution]) -> ArchiveWriter:
    """Start a writer over `store` (it resyncs), hand it `handed` as the detector would, close it."""

    async def cycle() -> ArchiveWriter:
        writer = ArchiveWriter(root, store)
        await writer.start()
        for resolution in handed:
            writer.add_resolution(resolution)
        await writer.close()
        return writer

    return asyncio.run(cycle())


def test_the_archive_reads_back_the_correction_and_check_counts_each_break_once(tmp_path: Path) -> None:
    data, root = tmp_path / "data", tmp_path / "archive"
    with Store(data) as store:
        clock = Clock()
        h = Harness(store, clock)
        order, _ = given_up(h, clock)
        run_writer(root, store, [h.archived[0]])  # the give-up is written ...
        clock.now = T0 + 9
        h.resolutions.reported("b", report(order))
        run_writer(root, store, [h.archived[1]])  # ... and then the correction, in its own file
        assert len(parquet_files(root, "resolutions")) == 2
        [read] = read_resolutions(root)
        assert read == store.resolution(order.break_id) and outcome_word(read) == "broken"
        found = check(root)
        assert (found.rows["resolutions"], found.resolutions, found.late_answers) == (2, {"broken": 1}, 1)
        assert run_writer(root, store, []).resolutions_written == 0  # nothing more to write


def test_a_correction_pending_with_its_give_up_replaces_it_unwritten(tmp_path: Path) -> None:
    data, root = tmp_path / "data", tmp_path / "archive"
    with Store(data) as store:

        async def cycle() -> ArchiveWriter:
            writer = ArchiveWriter(root, store)  # a batch waits max_age (minutes): both meet in memory
            await writer.start()
            clock = Clock()
            h = Harness(store, clock)
            h.resolutions.archive = writer.add_resolution
            order, _ = given_up(h, clock)
            assert writer.pending_resolutions == 1
            clock.now = T0 + 9
            h.resolutions.reported("b", report(order))
            assert writer.pending_resolutions == 1  # the answer took the give-up's place
            await writer.close()
            return writer

        assert asyncio.run(cycle()).resolutions_written == 1
        [read] = read_resolutions(root)
        assert outcome_word(read) == "broken"
        assert check(root).rows["resolutions"] == 1


def test_a_correction_that_comes_while_its_give_up_is_written_is_written_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    import stablewatch.detector.archive.writer as writer_module

    entered, release = threading.Event(), threading.Event()

    def held_write(root: Path, resolutions: list[Resolution]) -> list[Path]:
        entered.set()
        assert release.wait(20), "the test never let the write go on"
        return write_resolution_batch(root, resolutions)

    monkeypatch.setattr(writer_module, "write_resolution_batch", held_write)
    data, root = tmp_path / "data", tmp_path / "archive"
    with Store(data) as store:

        async def cycle() -> ArchiveWriter:
            writer = ArchiveWriter(root, store, batch_size=1)  # the give-up is written at once
            await writer.start()
            clock = Clock()
            h = Harness(store, clock)
            h.resolutions.archive = writer.add_resolution
            order, _ = given_up(h, clock)
            await async_poll(entered.is_set, "the give-up's write to start")
            clock.now = T0 + 9
            h.resolutions.reported("b", report(order))
            assert writer.pending_resolutions == 2  # the answer waits behind the row being written
            release.set()
            await writer.close()
            return writer

        assert asyncio.run(cycle()).resolutions_written == 2
        assert [outcome_word(r) for r in read_resolutions(root)] == ["broken"]
        found = check(root)
        assert (found.rows["resolutions"], found.resolutions, found.late_answers) == (2, {"broken": 1}, 1)


def test_a_restart_keeps_the_corrected_record_and_archives_it_if_the_archive_lacks_it(tmp_path: Path) -> None:
    """Killed after storing the correction, before archiving it: the store has the truth, and the
    next start neither gives it up again nor leaves the archive saying unanswered."""
    data, root = tmp_path / "data", tmp_path / "archive"
    with Store(data) as store:
        clock = Clock()
        h = Harness(store, clock)
        order, _ = given_up(h, clock)
        run_writer(root, store, [h.archived[0]])
        clock.now = T0 + 9
        h.resolutions.reported("b", report(order))  # stored; the archive never hears of it (killed)
    with Store(data) as store:
        again = Harness(store, Clock(T0 + 100))
        assert again.resolutions.recover() == []  # nothing pending: the record is final
        stored = store.resolution(order.break_id)
        assert stored is not None and outcome_word(stored) == "broken" and "reported late" in stored.detail
        assert run_writer(root, store, []).resolutions_written == 1  # the resync writes the correction
        assert [outcome_word(r) for r in read_resolutions(root)] == ["broken"]
        assert run_writer(root, store, []).resolutions_written == 0
        check(root)


def test_export_writes_a_correction_the_archive_lacks(tmp_path: Path) -> None:
    from stablewatch.detector.archive.export import export

    data, root = tmp_path / "data", tmp_path / "archive"
    with Store(data) as store:
        clock = Clock()
        h = Harness(store, clock)
        order, _ = given_up(h, clock)
        assert export(store, root).resolutions == 1
        clock.now = T0 + 9
        h.resolutions.reported("b", report(order))
        again = export(store, root)
        assert (again.resolutions, again.resolutions_already) == (1, 0)
        assert export(store, root).resolutions == 0
        assert [outcome_word(r) for r in read_resolutions(root)] == ["broken"]


def test_check_refuses_two_answers_or_two_give_ups_of_one_break(tmp_path: Path) -> None:
    from stablewatch.detector.archive.schema import ArchiveError

    root = tmp_path / "archive"
    ensure_archive(root)
    answered = Resolution(resolution_id=3, snapshot_id=9, process_id="b", outcome=BREAK_OUTCOME_BROKEN)
    answered.sent_at.FromMicroseconds(int(T0 * 1e6))
    answered.reported_at.FromMicroseconds(int(T0 * 1e6) + 5)
    write_resolution_batch(root, [answered])
    other = Resolution()
    other.CopyFrom(answered)
    other.outcome = BREAK_OUTCOME_ALREADY_BROKEN
    write_resolution_batch(root, [other])
    with pytest.raises(ArchiveError, match="break 3 of snapshot 9 is archived twice"):
        check(root)


def test_the_cli_and_query_api_show_the_corrected_outcome(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = DetectorConfig(
        data_dir=tmp_path / "data",
        listen="127.0.0.1:0",
        metrics_port=None,
        interval=None,
        heartbeat_timeout=120,
        heartbeat_interval=0.05,  # gives up overdue breaks this often
        report_timeout=0.2,
        resolve="youngest",
    )
    running = Running(config)
    agents = {pid: RawAgent(running, pid) for pid in ("a", "b")}
    try:
        poll(lambda: {"a", "b"} <= set(running.detector.coordinator.members), "a and b to attach")
        deadlock = {p.process_id: list(p.state.waits) for p in cycle_snapshot(1).processes}
        pending = asyncio.run_coroutine_threadsafe(running.detector.take_snapshot(deadline=10), running.loop)
        poll(lambda: all(agent.starts() for agent in agents.values()), "StartSnapshot at every agent")
        for pid, agent in agents.items():
            state = LocalState(active=True, waits=deadlock[pid])
            agent.send_part(LocalSnapshotPart(snapshot_id=agent.starts()[-1], process_id=pid, state=state))
        pending.result(20)

        def orders() -> list[BreakWait]:
            received = agents["b"].received
            return [m.break_wait for m in received if m.WhichOneof("kind") == "break_wait"]

        [order] = poll(orders, "the BreakWait at b")

        def listed() -> dict[str, Any]:
            assert main(["resolutions", "--detector", running.detector.address, "--json"]) == 0
            return json.loads(capsys.readouterr().out)["resolutions"][0]

        poll(lambda: listed()["outcome"] == "unanswered", "the break to be given up")
        late = BreakReport(break_id=order.break_id, instance=order.instance, outcome=BREAK_OUTCOME_BROKEN, detail="ok")
        agents["b"].send(AgentMessage(break_report=late))
        poll(lambda: listed()["outcome"] == "broken", "the late report to correct the record")
        assert "reported late" in listed()["detail"]
        assert running.metric("stablewatch_break_reports_late_total", outcome="broken") == 1
        assert running.metric("stablewatch_deadlocks_resolved_total", outcome="broken") == 1
    finally:
        for agent in agents.values():
            agent.close()
        running.stop()
