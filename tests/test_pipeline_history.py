"""``history`` finds episodes that begin and end, with the right bounds, and the rest of the history.

A scripted archive of 25 snapshots a minute apart, processes P0..P4 holding 20 tokens each:

* 5-8: P0 and P1 wait on each other (deadlock episode 1); 9 is aborted, so it ends by 10;
* 13: an open cut, P0 waiting on the missing P9, without a deadlock: unknown, skipped by episodes;
* 14-17: P2's task t0 and P3 wait on each other, P2 passive (episode 2, begun after 12);
  15 is missing 5 tokens;
* 21-23: every process passive, nothing in flight: terminated, until 24;
* 24-25: P4 and P0 wait on each other (episode 3, still going at the end).

Every process reports the attribute ``work`` (the snapshot's number) and ``role`` (a name, not a
number).

The detector broke (the ``resolutions`` table, :data:`BREAKS`): in episode 1 a wait of P1 that was
gone by then (6) and one of P0 (8); in episode 2 the wait of P2's task t0, by an operator (17);
in episode 3 one of P4, whose agent never answered (24).
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from pyspark.sql import SparkSession
from rich.console import Console
from snapshot_gen import START, Archived, aborted, as_version, summary_of, write_archive

from stablewatch.detector.archive.writer import write_resolution_batch
from stablewatch.pipeline import cli
from stablewatch.pipeline.history import History, run_history
from stablewatch.v1 import ChannelSnapshot, GlobalSnapshot, LocalState, ProcessSnapshot, RecordedMessage, Wait, WaitNode
from stablewatch.v1.control_pb2 import BREAK_OUTCOME_BROKEN, BREAK_OUTCOME_GONE, BREAK_OUTCOME_UNSPECIFIED
from stablewatch.v1.query_pb2 import Resolution

pytestmark = pytest.mark.timeout(600)

PIDS = ["P0", "P1", "P2", "P3", "P4"]
CYCLES = {**dict.fromkeys(range(5, 9), ("P0", "P1")), **dict.fromkeys(range(24, 26), ("P4", "P0"))}


def at(sid: int) -> datetime:
    """When snapshot `sid` started."""
    return START + timedelta(minutes=sid)


def scripted_snapshot(sid: int) -> GlobalSnapshot:
    snapshot = GlobalSnapshot(snapshot_id=sid, expected_members=PIDS + (["P9"] if sid == 13 else []))
    snapshot.started_at.FromDatetime(at(sid))
    snapshot.completed_at.FromDatetime(at(sid) + timedelta(seconds=2))
    terminated = 21 <= sid <= 23
    for pid in PIDS:
        state = LocalState(
            active=not terminated and pid == ("P2" if sid in CYCLES else "P0" if 14 <= sid <= 17 else "P1")
        )
        state.counters["tokens"] = 15 if (sid, pid) == (15, "P4") else 20
        state.attributes.update({"work": sid, "role": "branch"})
        if sid in CYCLES and pid in CYCLES[sid]:
            other = CYCLES[sid][1 - CYCLES[sid].index(pid)]
            state.waits.append(Wait(targets=[WaitNode(process=other)]))
        if sid == 13 and pid == "P0":  # a wait on a process outside the cut: no deadlock is unknown
            state.waits.append(Wait(targets=[WaitNode(process="P9")]))
        if 14 <= sid <= 17 and pid == "P2":
            state.waits.append(Wait(task="t0", targets=[WaitNode(process="P3")]))
        if 14 <= sid <= 17 and pid == "P3":
            state.waits.append(Wait(targets=[WaitNode(process="P2", task="t0")]))
        snapshot.processes.append(ProcessSnapshot(process_id=pid, state=state))
    backlog = 0 if terminated else sid % 4
    snapshot.channels.append(
        ChannelSnapshot(
            src="P1",
            dst="P2",
            sent_before_marker=backlog,
            messages=[RecordedMessage(payload=b"x" * 10) for _ in range(backlog)],
        )
    )
    return snapshot


def scripted() -> list[Archived]:
    items = []
    for sid in range(1, 26):
        if sid == 9:
            items.append(aborted(sid, at(sid), kind="deadline", seconds=5))
        else:
            snapshot = scripted_snapshot(sid)
            items.append(Archived(summary_of(snapshot), snapshot))
    return items


# (snapshot, victim process, task, outcome, answered that long after the snapshot started, by whom)
BREAKS = [
    (6, "P1", "", BREAK_OUTCOME_GONE, 3.5, "detector"),
    (8, "P0", "", BREAK_OUTCOME_BROKEN, 3.05, "detector"),
    (17, "P2", "t0", BREAK_OUTCOME_BROKEN, 3.2, "operator:alice"),
    (24, "P4", "", BREAK_OUTCOME_UNSPECIFIED, 8.0, "detector"),  # given up on after 5 s
]


def scripted_breaks() -> list[Resolution]:
    """:data:`BREAKS` as the detector records them: sent 3 s after their snapshot started."""
    resolutions = []
    for n, (sid, process, task, outcome, answered, by) in enumerate(BREAKS, 1):
        resolution = Resolution(
            resolution_id=n,
            snapshot_id=sid,
            process_id=process,
            task=task,
            instance=100 + n,
            policy="operator" if by != "detector" else "youngest",
            requested_by=by,
            component=[WaitNode(process=p) for p in CYCLES.get(sid, ("P2", "P3"))],
            deadlock="a cycle",
            outcome=outcome,
        )
        resolution.wait_began_at.FromDatetime(at(sid) - timedelta(seconds=30))
        resolution.sent_at.FromDatetime(at(sid) + timedelta(seconds=3))
        resolution.reported_at.FromDatetime(at(sid) + timedelta(seconds=answered))
        resolutions.append(resolution)
    return resolutions


def scripted_archive(root: Path, items: list[Archived] | None = None) -> Path:
    """The scripted snapshots (or `items`) and the scripted breaks, archived."""
    write_archive(root, scripted() if items is None else items, batch_size=4)
    write_resolution_batch(root, scripted_breaks())
    return root


@pytest.fixture(scope="module")
def history(spark: SparkSession, tmp_path_factory: pytest.TempPathFactory) -> History:
    archive = scripted_archive(tmp_path_factory.mktemp("archive"))
    return run_history(archive, tmp_path_factory.mktemp("out"), bucket_seconds=600)


def test_deadlock_episodes_begin_and_end_with_their_bounds(history: History) -> None:
    found = history.tables["deadlock_episodes"].to_pylist()
    columns = ["episode", "first_snapshot_id", "last_snapshot_id", "snapshots", "began_after", "began_at"]
    columns += ["last_seen_at", "ended_at", "ongoing", "duration_seconds"]
    bounds = [tuple(e[c] for c in columns) for e in found]
    assert bounds == [
        (1, 5, 8, 4, at(4), at(5), at(8), at(10), False, 300.0),  # 9 was aborted: ended by 10
        (2, 14, 17, 4, at(12), at(14), at(17), at(18), False, 240.0),  # 13 was unknown: began after 12
        (3, 24, 25, 2, at(23), at(24), at(25), None, True, 60.0),  # still deadlocked at the end
    ]
    assert [(e["processes"], e["tasks"], e["max_deadlocked_nodes"]) for e in found] == [
        (["P0", "P1"], [], 2),
        (["P2", "P3"], ["P2/t0"], 2),  # P2's task t0 and P3 (P2's own node is free: see the timeline test)
        (["P0", "P4"], [], 2),
    ]
    assert [(e["breaks"], e["broken"]) for e in found] == [(2, 1), (1, 1), (1, 0)]


def test_the_deadlocks_broken_per_bucket_with_their_victims_and_outcomes(history: History) -> None:
    found = history.tables["breaks"].to_pylist()
    assert [(b["snapshot_id"], b["victim"], b["outcome"], b["requested_by"]) for b in found] == [
        (6, "P1", "gone", "detector"),
        (8, "P0", "broken", "detector"),
        (17, "P2/t0", "broken", "operator:alice"),
        (24, "P4", "unanswered", "detector"),
    ]
    assert [b["recovery_seconds"] for b in found] == [None, 3.05, 3.2, None]  # broken ones only
    assert [b["answer_seconds"] for b in found] == [0.5, 0.05, 0.2, 5.0]
    assert all(b["waited_seconds"] == 33.0 for b in found) and found[0]["component_size"] == 2
    buckets = history.tables["breaks_over_time"].to_pylist()  # 10-minute buckets
    assert [
        (b["bucket_start"], b["breaks"], b["broken"], b["gone"], b["unanswered"], b["victims"]) for b in buckets
    ] == [
        (at(0), 2, 1, 1, 0, ["P0", "P1"]),
        (at(10), 1, 1, 0, 0, ["P2/t0"]),
        (at(20), 1, 0, 0, 1, ["P4"]),
    ]
    assert [(b["recovery_p50"], b["recovery_max"]) for b in buckets] == [(3.05, 3.05), (3.2, 3.2), (None, None)]


def test_termination_and_the_processes_most_often_deadlocked(history: History) -> None:
    (terminated,) = history.tables["termination_episodes"].to_pylist()
    assert (terminated["first_snapshot_id"], terminated["began_after"], terminated["began_at"]) == (21, at(20), at(21))
    assert (terminated["ended_at"], terminated["ongoing"]) == (at(24), False)
    recurring = [
        (r["process"], r["snapshots"], r["episodes"]) for r in history.tables["recurring_processes"].to_pylist()
    ]
    assert recurring == [("P0", 6, 2), ("P1", 4, 1), ("P2", 4, 1), ("P3", 4, 1), ("P4", 2, 1)]


def test_conservation_backlog_and_outcomes(history: History) -> None:
    (tokens,) = history.tables["conservation_summary"].to_pylist()
    assert (tokens["counter"], tokens["expected"], tokens["held"], tokens["violated"], tokens["unknown"]) == (
        "tokens",
        100,
        22,
        1,
        1,
    )
    assert (tokens["max_abs_drift"], tokens["first_violation_at"], tokens["last_drift"]) == (5, at(15), 0)
    drift = {r["snapshot_id"]: r["drift"] for r in history.tables["conservation"].to_pylist()}
    assert drift[15] == -5 and drift[16] == 0
    (channel,) = history.tables["channel_backlog"].to_pylist()
    assert (channel["src"], channel["dst"], channel["snapshots"], channel["messages_max"], channel["bytes_max"]) == (
        "P1",
        "P2",
        24,
        3,
        30,
    )
    buckets = history.tables["channel_backlog_over_time"].to_pylist()
    assert sum(b["snapshots"] for b in buckets) == 24 and len(buckets) == 3  # 10-minute buckets
    outcomes = {(o["outcome"], o["abort_kind"]): o for o in history.tables["snapshot_outcomes"].to_pylist()}
    assert outcomes["completed", ""]["snapshots"] == 24 and outcomes["completed", ""]["seconds_max"] == 2.0
    assert outcomes["aborted", "deadline"]["snapshots"] == 1
    timeline = history.tables["timeline"].to_pylist()
    assert [r["deadlocked_processes"] for r in timeline if r["deadlock"] == "true"] == [2] * 4 + [2] * 4 + [2] * 2
    assert [r["snapshot_id"] for r in timeline if r["deadlock"] == "unknown"] == [13]
    undecided = [(r["deadlocked_processes"], r["deadlocked_nodes"]) for r in timeline if r["deadlock"] == "unknown"]
    assert undecided == [(None, None)]  # not 0: nothing says that nothing is deadlocked there


def test_the_timeline_has_every_verdict_and_the_attributes_their_totals(history: History) -> None:
    rows = {r["snapshot_id"]: r for r in history.tables["timeline"].to_pylist()}
    assert [sid for sid, r in rows.items() if r["termination"] == "true"] == [21, 22, 23]
    assert [sid for sid, r in rows.items() if r["conservation"] == "false"] == [15]
    assert rows[1]["conservation"] == "true" and rows[5]["deadlocked_nodes"] == 2
    # Episode 2: P2's task t0 and P3, two nodes of two processes. P2's own node (an OR over its
    # tasks) is free in both 14 and 16: other processes are active, or a message is on its way to
    # P2, so something may still make P2 active (the quiet rule of the wait-for graph).
    assert (rows[16]["deadlocked_nodes"], rows[16]["deadlocked_processes"]) == (2, 2)
    assert (rows[14]["deadlocked_nodes"], rows[14]["deadlocked_processes"]) == (2, 2)
    totals = history.tables["attributes"].to_pylist()
    assert {r["attribute"] for r in totals} == {"work"}  # the role is no number
    assert [(r["snapshot_id"], r["total"]) for r in totals] == [(sid, 5.0 * sid) for sid in sorted(rows)]


def test_tables_chart_and_summary_are_written(history: History) -> None:
    for path in history.files:
        assert pq.read_table(path).num_rows == history.tables[path.stem].num_rows
    assert history.chart is not None and history.chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert pq.read_table(history.out / "evaluations").num_rows == 24 * 3  # deadlock, termination, tokens


def test_history_from_earlier_evaluations_via_the_command(
    history: History, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    archive = scripted_archive(tmp_path / "archive")
    args = ["history", "--archive", str(archive), "--out", str(tmp_path / "out")]
    status = cli.main([*args, "--evaluations", str(history.out / "evaluations"), "--no-chart"])
    assert status == 0
    console = " ".join(capsys.readouterr().out.split())  # as printed, wrapped at 80 columns
    assert "24 snapshots" in console and "3 deadlock episodes" in console and "1 ongoing" in console
    assert "P2/t0" in console
    assert "2 deadlocks broken (4 breaks: 2 broken, 1 gone, 1 unanswered)" in console
    assert "deadlocks broken" in console and "last breaks" in console and "3.05 s" in console
    assert not (tmp_path / "out" / "history.png").exists()
    status = cli.main([*args, "--json", "--evaluations", str(history.out / "evaluations")])
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert status == 0
    assert (printed["deadlock_episodes"], printed["termination_episodes"]) == (3, 1)
    assert (printed["breaks"], printed["deadlocks_broken"]) == (4, 2)
    assert printed["break_outcomes"] == {"broken": 2, "gone": 1, "unanswered": 1}
    assert Path(printed["chart"]).is_file()


def test_history_is_callable_from_python_with_a_console(spark: SparkSession, tmp_path: Path) -> None:
    """On an archive of schema version 2, the last without wait instances and breaks."""
    archive = as_version(write_archive(tmp_path / "archive", scripted()[:12], batch_size=5), 2)
    console = Console(record=True, width=160)
    found = run_history(archive, tmp_path / "out", console)
    assert found.evaluated == 11 and found.aborted == 1
    text = console.export_text()
    assert "1 deadlock episode;" in text
    # Without breaks (no resolutions table): the history as before, breaks counted 0.
    assert not (archive / "resolutions").exists()
    assert found.tables["breaks"].num_rows == 0 and found.tables["breaks_over_time"].num_rows == 0
    assert [(e["breaks"], e["broken"]) for e in found.tables["deadlock_episodes"].to_pylist()] == [(0, 0)]
    assert "broken" not in text and "breaks" not in text


def test_empty_tables_are_one_line_each(spark: SparkSession, tmp_path: Path) -> None:
    """An archive without a deadlock, a termination, a counter or a channel: one line each, no empty table."""
    archive = quiet_archive(tmp_path / "archive")
    console = Console(record=True, width=160)
    run_history(archive, tmp_path / "out", console, chart=False)
    lines = [line.strip() for line in console.export_text().splitlines()]
    for line in (
        "no deadlock episode",
        "no termination episode",
        "conservation: no completed snapshot held a counter, so there was nothing to check",
        "channels: no completed snapshot held a channel",
    ):
        assert line in lines
    titles = ["deadlock episodes", "processes most often deadlocked", "termination", "conservation"]
    for title in [*titles, "busiest channels (messages in flight per snapshot)"]:
        assert title not in lines
    assert "snapshot outcomes" in lines  # a table with rows is still a table


def quiet_archive(root: Path) -> Path:
    """Three snapshots of two processes, one active: nothing happens."""
    items = []
    for sid in range(1, 4):
        snapshot = GlobalSnapshot(snapshot_id=sid, expected_members=["P0", "P1"])
        snapshot.started_at.FromDatetime(at(sid))
        snapshot.completed_at.FromDatetime(at(sid) + timedelta(seconds=1))
        for pid in ("P0", "P1"):
            snapshot.processes.append(ProcessSnapshot(process_id=pid, state=LocalState(active=pid == "P0")))
        items.append(Archived(summary_of(snapshot), snapshot))
    return write_archive(root, items)


def test_several_systems_side_by_side_one_lane_each(
    spark: SparkSession, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    scripted_root = scripted_archive(tmp_path / "scripted")
    quiet = quiet_archive(tmp_path / "quiet")
    out = tmp_path / "out"
    args = ["history", "--archive", f"scripted={scripted_root}", "--archive", f"quiet={quiet}"]
    status = cli.main([*args, "--progress", "scripted=work", "--out", str(out), "--json"])
    assert status == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert list(printed["systems"]) == ["scripted", "quiet"]  # the lanes' order: as given
    scripted, calm = printed["systems"]["scripted"], printed["systems"]["quiet"]
    assert (scripted["deadlock_episodes"], scripted["deadlocks_broken"], scripted["evaluated"]) == (3, 2, 24)
    assert scripted["sentence"] == (
        "running 4.0 min, then deadlocked 3 times (longest 5.0 min), terminated 1 time (longest 3.0 min) "
        "and running again in between, deadlocked at the end; work 5 → 125 in all; "
        "2 deadlocks broken (4 breaks sent); tokens off in 1 snapshot (drift up to -5)"
    )
    assert [p["state"] for p in scripted["phases"]][:3] == ["running", "deadlocked", "running"]
    assert calm["sentence"] == "running throughout (2.0 min, 3 snapshots)"
    assert Path(printed["chart"]) == out / "history.png" and (out / "history.png").read_bytes()[:4] == b"\x89PNG"
    assert all(Path(table).parent == out / "scripted" / "history" for table in scripted["tables"])
    assert (out / "quiet" / "history" / "timeline.parquet").is_file()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--archive", "a=x", "--archive", "a=y"], "two archives are named 'a'"),
        (["--archive", "x/bank", "--archive", "y/bank"], "two archives are named 'bank'"),
        (["--archive", "a=x", "--progress", "b=meals"], "--progress names no archive's system: b"),
        (["--archive", "a=x", "--archive", "b=y", "--evaluations", "e"], "--evaluations reads the evaluations of one"),
        (["--archive", "a=x", "--progress", "meals"], "expected NAME=ATTRIBUTE"),
    ],
)
def test_bad_flags_for_several_systems_are_usage_errors(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["history", *flags, "--out", "o"])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_a_break_answered_after_it_was_given_up_counts_once_with_its_answer(
    spark: SparkSession, tmp_path: Path
) -> None:
    # Break 4 (P4) was given up on after 5 s; its agent's report came 15 s later, and the detector
    # archived the answer as a second row of the break (the archive's files are never rewritten).
    root = scripted_archive(tmp_path / "archive")
    late = scripted_breaks()[3]
    late.outcome = BREAK_OUTCOME_BROKEN
    late.reported_at.FromDatetime(at(24) + timedelta(seconds=23))
    write_resolution_batch(root, [late])
    history = run_history(root, tmp_path / "out", bucket_seconds=600)
    found = history.tables["breaks"].to_pylist()
    assert [(b["snapshot_id"], b["victim"], b["outcome"]) for b in found][-2:] == [
        (17, "P2/t0", "broken"),
        (24, "P4", "broken"),
    ]
    assert len(found) == 4 and found[-1]["answer_seconds"] == 20.0
    buckets = history.tables["breaks_over_time"].to_pylist()
    assert [(b["breaks"], b["broken"], b["unanswered"]) for b in buckets] == [(2, 1, 0), (1, 1, 0), (1, 1, 0)]
    episodes = history.tables["deadlock_episodes"].to_pylist()
    assert [(e["breaks"], e["broken"]) for e in episodes] == [(2, 1), (1, 1), (1, 1)]
