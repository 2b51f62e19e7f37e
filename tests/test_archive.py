"""The Parquet archive: the writer's batches, crash recovery, export, the reader and its errors.

Unit tests drive an :class:`ArchiveWriter` over a real store on one event loop; the crash windows
of a batch are set up by hand. The end-to-end tests run a real detector: in-process with
hand-driven agents, and as its own OS process with token-bank agents, killed with SIGKILL while it
writes small batches and restarted on the same data directory and archive.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from command_line import DetectorProcess
from control_streams import RawAgent
from google.protobuf.struct_pb2 import Struct
from samples import evaluation, global_snapshot, predicate_results

from polling import async_poll, poll
from stablewatch.cli.main import main
from stablewatch.detector.archive.export import export
from stablewatch.detector.archive.files import batch_name, ensure_archive, parquet_files, read_table
from stablewatch.detector.archive.reader import check, read_snapshots
from stablewatch.detector.archive.schema import (
    MARKER_FILE,
    METADATA_KEY,
    SCHEMA_VERSION,
    TABLES,
    ArchiveError,
    snapshot_from_rows,
    snapshot_rows,
    table_schema,
)
from stablewatch.detector.archive.writer import ArchiveWriter, load, write_finished
from stablewatch.detector.service.detector import DetectorConfig
from stablewatch.detector.service.query import outcome_name
from stablewatch.detector.service.store import Store, StoreError
from stablewatch.testing.detector import Running
from stablewatch.testing.token_nodes import Node, connect_all
from stablewatch.v1 import GlobalSnapshot, LocalSnapshotPart, LocalState, PredicateResult, WaitNode
from stablewatch.v1.query_pb2 import SNAPSHOT_OUTCOME_RUNNING

pytestmark = pytest.mark.timeout(120)

DAY = 86400.0
NEWER = SCHEMA_VERSION + 1  # a schema version this code does not read
T0 = 1_700_000_000.0  # 2023-11-14 22:13:20 UTC


# -- helpers --------------------------------------------------------------------------------------


def complete(store: Store, started: float = T0, snapshot_id: int | None = None) -> int:
    """Store a completed snapshot (every kind of row, microsecond times as the detector sets them);
    `snapshot_id`, if given, is one running already."""
    if snapshot_id is None:
        snapshot_id = store.allocate_id(0)
        store.begin(snapshot_id, started, members=2)
    snapshot = global_snapshot(snapshot_id)
    snapshot.started_at.FromMicroseconds(int(started * 1e6) + 123_456)
    snapshot.completed_at.FromMicroseconds(int(started * 1e6) + 1_000_001)
    store.complete(snapshot, evaluation(snapshot_id, predicate_results()), started + 1)
    return snapshot_id


def abort(store: Store, started: float = T0) -> int:
    snapshot_id = store.allocate_id(0)
    store.begin(snapshot_id, started, members=3)
    store.abort(snapshot_id, "deadline of 5s passed", started + 5, "deadline")
    return snapshot_id


def finished_ids(store: Store) -> set[int]:
    return {s.snapshot_id for s in store.list(100_000) if s.outcome != SNAPSHOT_OUTCOME_RUNNING}


def ids_per_table(root: Path) -> dict[str, Counter[int]]:
    """How many rows each snapshot has in each table of the archive."""
    return {table: Counter(read_table(root, table).column("snapshot_id").to_pylist()) for table in TABLES}


def expected_ids_per_table(store: Store, snapshot_ids: set[int]) -> dict[str, Counter[int]]:
    """The same, as the store's snapshots convert to rows: each snapshot's rows exactly once."""
    expected: dict[str, Counter[int]] = {table: Counter() for table in TABLES}
    for snapshot_id in snapshot_ids:
        item = load(store, snapshot_id)
        assert item is not None
        for table, rows in snapshot_rows(item.summary, item.snapshot, item.evaluation).items():
            expected[table].update(row["snapshot_id"] for row in rows)
    return expected


def assert_archived_exactly_once(store: Store, root: Path) -> None:
    """Every finished snapshot of the store is in the archive once, with all its rows once, and is
    rebuilt from them as the store holds it."""
    wanted = finished_ids(store)
    assert ids_per_table(root) == expected_ids_per_table(store, wanted)
    rebuilt = list(read_snapshots(root))
    assert sorted(head["snapshot_id"] for head, _ in rebuilt) == sorted(wanted)
    for head, snapshot in rebuilt:
        assert snapshot == store.snapshot(head["snapshot_id"])


def visible_files(root: Path) -> set[Path]:
    return {path for table in TABLES for path in parquet_files(root, table)}


def run(coroutine_function: Callable[[], Any]) -> Any:
    return asyncio.run(coroutine_function())


def restart_writer(root: Path, store: Store, batch_size: int = 500) -> int:
    """Start a writer (it resyncs with the store) and close it; return how many snapshots it wrote."""

    async def cycle() -> int:
        writer = ArchiveWriter(root, store, batch_size=batch_size)
        await writer.start()
        await writer.close()
        return writer.written

    return run(cycle)


# -- round trip and batching ----------------------------------------------------------------------


def test_round_trip_store_to_parquet_to_identical_snapshots(store: Store, tmp_path: Path) -> None:
    done = [complete(store), complete(store)]
    gone = abort(store)
    root = tmp_path / "archive"
    assert restart_writer(root, store) == 3  # a writer starts by catching up with the store
    assert store.unarchived(10) == []
    for head, snapshot in read_snapshots(root):
        if head["snapshot_id"] == gone:
            assert snapshot is None
            assert (head["outcome"], head["abort_kind"], head["abort_reason"]) == (
                "aborted",
                "deadline",
                "deadline of 5s passed",
            )
            continue
        assert snapshot == store.snapshot(head["snapshot_id"])
        assert GlobalSnapshot.FromString(head["snapshot"]) == snapshot  # the blob too
        assert head["closed"] is True
    results = read_table(root, "results").to_pylist()
    for snapshot_id in done:
        rows = sorted((r for r in results if r["snapshot_id"] == snapshot_id), key=lambda r: r["position"])
        assert [PredicateResult.FromString(r["result"]) for r in rows] == list(store.evaluation(snapshot_id).results)
        assert json.loads(rows[1]["evidence"])["drift"] == "-1"  # int64 in proto JSON is a string
    assert [head["snapshot_id"] for head, _ in read_snapshots(root, ids=[done[1]])] == [done[1]]
    assert_archived_exactly_once(store, root)


def test_batches_by_count_by_age_and_on_close(store: Store, tmp_path: Path) -> None:
    root = tmp_path / "archive"

    def add(writer: ArchiveWriter) -> int:
        snapshot_id = complete(store)
        item = load(store, snapshot_id)
        writer.add(item.summary, item.snapshot, item.evaluation)
        return snapshot_id

    async def scenario() -> None:
        by_count = ArchiveWriter(root, store, batch_size=3, max_age=3600)
        await by_count.start()
        first = [add(by_count), add(by_count)]
        assert by_count.pending == 2 and not visible_files(root)  # no batch before 3 or an hour
        first.append(add(by_count))
        await async_poll(lambda: by_count.written == 3, "a batch of three")
        assert [p.name for p in parquet_files(root, "snapshots")] == [batch_name(first)]
        await by_count.close()

        by_age = ArchiveWriter(root, store, batch_size=1000, max_age=0.05)
        await by_age.start()
        alone = add(by_age)
        await async_poll(lambda: by_age.written == 1, "a batch of one, by age")
        assert batch_name([alone]) in {p.name for p in parquet_files(root, "snapshots")}
        await by_age.close()

        on_close = ArchiveWriter(root, store, batch_size=1000, max_age=3600)
        await on_close.start()
        last = [add(on_close), add(on_close)]
        await on_close.close()
        assert on_close.written == 2
        assert batch_name(last) in {p.name for p in parquet_files(root, "snapshots")}
        on_close.add(store.summary(last[0]))  # after close: ignored, nothing breaks

    run(scenario)
    assert len(parquet_files(root, "snapshots")) == 3  # never a file per snapshot
    assert store.unarchived(10) == []
    assert_archived_exactly_once(store, root)


def test_a_batch_across_midnight_lands_day_by_day_a_millisecond_apart(store: Store, tmp_path: Path) -> None:
    """``pipeline follow`` takes files in modification-time order at millisecond resolution: the
    earlier day's snapshots must land first, even when the batch is written within a millisecond."""
    midnight = (T0 // DAY + 1) * DAY
    ids = [complete(store, started) for started in (midnight - 10, midnight - 5, midnight + 5)]
    root = tmp_path / "archive"
    assert restart_writer(root, store, batch_size=3) == 3
    files = parquet_files(root, "snapshots")
    assert [p.parent.name for p in files] == ["day=2023-11-14", "day=2023-11-15"]
    assert {p.name for p in files} == {batch_name(ids)}
    landed = [os.stat(p).st_mtime_ns // 1_000_000 for p in files]
    assert landed[0] < landed[1]
    every = sorted(os.stat(p).st_mtime_ns for table in TABLES for p in parquet_files(root, table))
    assert max(os.stat(p).st_mtime_ns for p in files) == every[-1]  # the snapshots files land last


def test_a_batch_is_durable_before_the_store_marks_it_archived(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rename is durable only once its folder is flushed: every folder that gained an entry (the
    day's, the table's, the archive's) is flushed before the store marks the batch archived, or a
    power loss could keep the mark and lose the batch."""
    synced: list[str] = []
    real_fsync, real_mark = os.fsync, store.mark_archived

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    def mark_archived(snapshot_ids: Any) -> None:
        if snapshot_ids:
            synced.append("marked")
        real_mark(snapshot_ids)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(store, "mark_archived", mark_archived)
    complete(store)
    root = tmp_path / "archive"
    assert restart_writer(root, store) == 1
    before_mark = synced[: synced.index("marked")]
    folders = {str(p.parent) for table in TABLES for p in parquet_files(root, table)}
    tables = {str(root / table) for table in TABLES if parquet_files(root, table)}
    assert folders | tables | {str(root)} <= set(before_mark)


def test_failed_writes_are_logged_and_written_once_the_archive_works_again(
    store: Store, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "archive"
    ensure_archive(root)
    blocker = root / "processes"  # a file where a table's folder must be: every batch fails
    blocker.write_text("in the way")
    before_start = complete(store)  # left unarchived by a detector that died

    async def scenario() -> None:
        writer = ArchiveWriter(root, store, batch_size=2, max_age=0.05)
        await writer.start()  # the catch-up fails: logged, and the detector goes on
        assert "cannot write batch" in caplog.text and str(root) in caplog.text
        for _ in range(2):
            item = load(store, complete(store))
            writer.add(item.summary, item.snapshot, item.evaluation)
        await async_poll(lambda: caplog.text.count("stay in the store") >= 2, "the next attempt failing too")
        assert writer.written == 0 and len(store.unarchived(10)) == 3
        blocker.unlink()
        await async_poll(lambda: writer.written == 3, "the resync to write them all")
        await writer.close()

    run(scenario)
    assert before_start in finished_ids(store)
    assert store.unarchived(10) == []
    assert_archived_exactly_once(store, root)


# -- crash windows --------------------------------------------------------------------------------


def test_a_batch_in_place_but_not_marked_is_not_written_again(store: Store, tmp_path: Path) -> None:
    root = tmp_path / "archive"
    ensure_archive(root)
    ids = [complete(store), abort(store), complete(store)]
    write_finished(root, [load(store, i) for i in ids])  # renamed into place; killed before marking
    before = {path: path.stat().st_mtime_ns for path in visible_files(root)}
    assert restart_writer(root, store) == 0
    assert store.unarchived(10) == []
    assert {path: path.stat().st_mtime_ns for path in visible_files(root)} == before  # untouched
    assert_archived_exactly_once(store, root)


def test_an_interrupted_batch_is_removed_and_written_again_once(store: Store, tmp_path: Path) -> None:
    """Killed mid-batch: a temporary file, other tables renamed, and of two days only the first
    day's snapshots file in place."""
    root = tmp_path / "archive"
    ensure_archive(root)
    day1 = [complete(store, T0), complete(store, T0)]
    day2 = [complete(store, T0 + DAY), abort(store, T0 + DAY)]
    files = write_finished(root, [load(store, i) for i in day1 + day2])
    name = files[-1].name
    second_day = next(path for path in files if "snapshots" in path.parts and "day=2023-11-15" in path.parts)
    second_day.unlink()  # the last rename never happened
    tmp = second_day.with_name(f".{name}.tmp")
    tmp.write_bytes(b"PAR1 half a file")  # a temporary file that was being written
    assert read_table(root, "snapshots").num_rows == 2  # readers see day one's snapshots only
    assert restart_writer(root, store) == 2  # day two's snapshots, once more, in a batch of their own
    assert not tmp.exists()
    assert store.unarchived(10) == []
    assert_archived_exactly_once(store, root)


def test_a_second_writer_is_refused_while_the_first_holds_the_archive(store: Store, tmp_path: Path) -> None:
    root = tmp_path / "archive"

    async def two_writers() -> None:
        first = ArchiveWriter(root, store)
        await first.start()
        with pytest.raises(ArchiveError, match="being written by another process"):
            await ArchiveWriter(root, store).start()
        with pytest.raises(ArchiveError, match=f"{root}.*being written by another process"):
            export(store, root)
        await first.close()
        second = ArchiveWriter(root, store)  # the lock went with the first writer
        await second.start()
        await second.close()

    run(two_writers)
    with pytest.raises(StoreError, match=rf"data directory .* is in use by another detector \(pid {os.getpid()}\)"):
        Store(tmp_path / "data")  # the store takes the same kind of lock


# -- export ---------------------------------------------------------------------------------------


def test_export_is_idempotent_and_leaves_a_live_detectors_running_snapshot_alone(
    store: Store, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for _ in range(3):
        complete(store)
    abort(store)
    running = store.allocate_id(0)
    store.begin(running, T0, members=2)  # the live detector is taking this one now
    root = tmp_path / "archive"
    argv = ["archive", "export", "--data-dir", str(tmp_path / "data"), "--archive", str(root), "--batch", "3"]

    assert main([*argv, "--json"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert (first["exported"], first["already"], first["batches"], first["files"]) == (4, 0, 2, 8)
    assert main(argv) == 0
    assert f"nothing new to export: {root} holds all 4 finished snapshots" in capsys.readouterr().out
    assert len(parquet_files(root, "snapshots")) == 2

    assert store.summary(running).outcome == SNAPSHOT_OUTCOME_RUNNING  # not "detector restarted"
    complete(store, snapshot_id=running)
    assert main(argv) == 0
    assert "exported 1 snapshot to" in capsys.readouterr().out
    assert store.unarchived(10) == sorted(finished_ids(store))  # export never writes to the store
    assert_archived_exactly_once(store, root)
    assert restart_writer(root, store) == 0  # a detector on this store finds them all in place
    assert store.unarchived(10) == []


# -- bad archives ---------------------------------------------------------------------------------


@pytest.fixture
def archive(store: Store, tmp_path: Path) -> Path:
    """An archive of two snapshots, written by export."""
    complete(store)
    abort(store)
    root = tmp_path / "archive"
    export(store, root)
    return root


def some_file(root: Path, table: str = "processes") -> Path:
    return parquet_files(root, table)[0]


def corrupt(root: Path) -> Path:
    path = some_file(root)
    path.write_bytes(path.read_bytes()[:-20])
    return path


def foreign(root: Path) -> Path:
    path = some_file(root)
    pq.write_table(pa.table({"snapshot_id": [1]}), path)  # Parquet, but not ours
    return path


def newer_file(root: Path) -> Path:
    path = some_file(root)
    table = pq.read_table(path)
    pq.write_table(table.replace_schema_metadata({METADATA_KEY: str(NEWER).encode()}), path)
    return path


def newer_marker(root: Path) -> Path:
    marker = root / MARKER_FILE
    marker.write_text(json.dumps({"format": "stablewatch-archive", "schema_version": NEWER}))
    return marker


def not_an_archive(root: Path) -> Path:
    (root / MARKER_FILE).unlink()
    return root


def twice(root: Path) -> Path:
    first = some_file(root, "snapshots")
    copy = first.with_name(batch_name([10**6]))
    copy.write_bytes(first.read_bytes())
    return copy


@pytest.mark.parametrize(
    ("spoil", "reason"),
    [
        (corrupt, "not a readable Parquet file"),
        (foreign, "not a stablewatch archive file"),
        (newer_file, f"schema version {NEWER} is newer than this stablewatch reads ({SCHEMA_VERSION}); upgrade"),
        (newer_marker, f"archive schema version {NEWER} is newer than this stablewatch reads ({SCHEMA_VERSION})"),
        (not_an_archive, "is not a stablewatch archive"),
        (twice, "is archived twice"),
    ],
)
def test_bad_archives_give_clear_errors_naming_the_file(
    archive: Path, spoil: Callable[[Path], Path], reason: str, capsys: pytest.CaptureFixture[str]
) -> None:
    culprit = spoil(archive)
    assert main(["archive", "check", "--archive", str(archive)]) == 2
    err = capsys.readouterr().err
    assert str(culprit) in err and reason in err, err
    assert "Traceback" not in err
    if spoil is not twice:  # read_snapshots does not look for twins; every other fault it sees
        with pytest.raises(ArchiveError) as raised:
            list(read_snapshots(archive))
        assert str(culprit) in str(raised.value) and reason in str(raised.value)
    assert main(["archive", "check", "--archive", str(archive), "--json"]) == 2
    assert reason in json.loads(capsys.readouterr().out)["error"]


def test_check_counts_a_good_archive(archive: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["archive", "check", "--archive", str(archive), "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["outcomes"] == {"aborted": 1, "completed": 1}
    assert found["rows"]["snapshots"] == 2 and found["rows"]["processes"] == 2
    assert found["files"]["snapshots"] == 1
    assert main(["archive", "check", "--archive", str(archive)]) == 0
    assert "snapshots: 1 aborted, 1 completed" in capsys.readouterr().out


def test_bad_export_and_detector_arguments_exit_with_the_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "notes.txt").write_text("mine")
    with Store(tmp_path / "data"):
        pass
    export_to = ["archive", "export", "--data-dir", str(tmp_path / "data"), "--archive"]
    assert main([*export_to, str(occupied)]) == 2
    assert f"{occupied} is not empty and is not a stablewatch archive" in capsys.readouterr().err
    assert main(["archive", "export", "--data-dir", str(tmp_path / "nothing"), "--archive", str(tmp_path / "a")]) == 2
    assert "holds no stablewatch store (stablewatch.sqlite3 is missing)" in capsys.readouterr().err
    assert not (tmp_path / "nothing").exists()

    detector = ["detector", "--listen", "127.0.0.1:0", "--metrics-port", "-1", "--data-dir", str(tmp_path / "data")]
    assert main([*detector, "--archive", str(occupied)]) == 1
    err = capsys.readouterr().err
    assert f"the detector cannot start: {occupied} is not empty and is not a stablewatch archive" in err
    assert "Traceback" not in err


# -- the real detector ----------------------------------------------------------------------------


def test_detector_archives_completed_and_aborted_snapshots_and_flushes_on_stop(tmp_path: Path) -> None:
    root = tmp_path / "archive"
    config = DetectorConfig(
        data_dir=tmp_path / "data",
        listen="127.0.0.1:0",
        metrics_port=None,
        interval=None,
        archive=root,
        archive_batch=1000,
        archive_age=3600,
    )
    service = Running(config)
    p, q = RawAgent(service, "P"), RawAgent(service, "Q")
    try:
        poll(lambda: len(service.detector.coordinator.members) == 2, "two members")
        pending = asyncio.run_coroutine_threadsafe(service.detector.take_snapshot(deadline=10), service.loop)
        poll(lambda: p.starts() and q.starts(), "StartSnapshot at both")
        snapshot_id = p.starts()[0]
        attributes = Struct()
        attributes.update({"role": "bank"})
        p.send_part(LocalSnapshotPart(snapshot_id=snapshot_id, process_id="P", state=LocalState(attributes=attributes)))
        q.send_part(LocalSnapshotPart(snapshot_id=snapshot_id, process_id="Q", state=LocalState(counters={"t": 2})))
        assert outcome_name(pending.result(20).snapshot.outcome) == "completed"
        aborted = service.call(service.detector.take_snapshot(deadline=0.2))  # nobody answers
        assert outcome_name(aborted.snapshot.outcome) == "aborted"
        assert not visible_files(root)  # both wait for their batch (an hour, or a thousand)
    finally:
        p.close()
        q.close()
        service.stop()  # flushes
    with Store(tmp_path / "data") as store:
        assert finished_ids(store) == {snapshot_id, aborted.snapshot.snapshot_id}
        assert store.unarchived(10) == []
        assert_archived_exactly_once(store, root)


def test_a_detector_killed_while_writing_leaves_a_readable_archive_and_restarts_exactly_once(tmp_path: Path) -> None:
    data, root = tmp_path / "data", tmp_path / "archive"
    options = ["--archive", str(root), "--archive-batch", "1", "--archive-age", "0.05"]
    detector = DetectorProcess(data, *options, "--interval", "0.02", "--max-concurrent", "2")
    nodes: list[Node] = []
    try:
        nodes = [Node(pid, "--tokens", "100", "--detector", detector.address) for pid in ("A", "B")]
        connect_all(nodes)
        for seed, node in enumerate(nodes):
            node.command("transfer", count=2000, seed=seed)  # messages in flight while snapshots run
        poll(lambda: len(parquet_files(root, "snapshots")) >= 20, "twenty batches in the archive", timeout=60)
    finally:
        status = detector.stop(signal.SIGKILL)  # whatever it was doing: a batch, most likely
        for node in nodes:
            node.stop()
    assert status == -signal.SIGKILL
    killed = check(root)  # every visible file reads, and no snapshot is there twice
    assert killed.rows["snapshots"] >= 20

    restarted = DetectorProcess(data, *options, "--interval", "off")  # ready once it has caught up
    assert restarted.stop() == 0, "".join(restarted.stderr.seen)
    assert not list(root.glob("*/day=*/.*.tmp"))
    with Store(data) as store:
        assert len(finished_ids(store)) >= killed.rows["snapshots"]
        assert store.unarchived(100_000) == []
        assert_archived_exactly_once(store, root)


def test_a_channels_file_of_version_1_reads_without_acknowledgement_positions(tmp_path: Path) -> None:
    root = tmp_path / "archive"
    ensure_archive(root)
    old = table_schema("channels", 1)
    assert "receiver_acked" not in old.names and "receiver_acked" in TABLES["channels"].names
    row = {"snapshot_id": 1, "src": "a", "dst": "b", "channel_index": 0, "sent_before_marker": 2}
    row |= {"received_before_recording": 2, "recorded": 0, "recorded_bytes": 0}
    path = root / "channels" / "day=2026-03-01" / batch_name([1])
    path.parent.mkdir(parents=True)
    table = pa.Table.from_pylist([row], schema=old.remove(old.get_field_index("day")))
    pq.write_table(table.replace_schema_metadata({METADATA_KEY: b"1"}), path)
    [read] = read_table(root, "channels").to_pylist()
    assert (read["receiver_acked"], read["sender_ack_seen"], read["day"]) == (None, None, "2026-03-01")
    head = {"snapshot_id": 1}
    snapshot = snapshot_from_rows(head, [], [], [], [read], [])
    assert not snapshot.channels[0].HasField("receiver_acked")


# -- wait instances (schema version 3) and older archives ------------------------------------------


def with_instances(snapshot: GlobalSnapshot) -> GlobalSnapshot:
    """`snapshot` (of :func:`samples.global_snapshot`) with its waits numbered and timed as agents
    report them now, extremes included: an instance using all 64 bits, a start a Python datetime
    cannot hold, one unknown (0); and several waits of one task, one per instance, the usual case."""
    a, b = (process.state for process in snapshot.processes)
    a.waits[0].instance, a.waits[0].began_at_us = 2**64 - 1, 1_700_000_000_123_456
    b.waits[0].instance, b.waits[0].began_at_us = 7, 2**62
    b.waits.add(task="t1", targets=[WaitNode(process="c")], instance=2**63)
    b.waits.add(task="t1", instance=8, began_at_us=-5)
    snapshot.started_at.FromMicroseconds(snapshot.started_at.ToMicroseconds())  # as the detector sets them
    snapshot.completed_at.FromMicroseconds(snapshot.completed_at.ToMicroseconds())
    return snapshot


def test_wait_instances_and_starts_round_trip_through_rows_and_files(tmp_path: Path) -> None:
    with Store(tmp_path / "data") as store:
        snapshot_id = store.allocate_id(0)
        store.begin(snapshot_id, T0, members=2)
        snapshot = with_instances(global_snapshot(snapshot_id))
        store.complete(snapshot, evaluation(snapshot_id, predicate_results()), T0 + 1)
        item = load(store, snapshot_id)
        assert item is not None
        rows = snapshot_rows(item.summary, snapshot)
        assert [(r["waiter_task"], r["instance"], r["began_at"]) for r in rows["wait_edges"]] == [
            ("", -1, 1_700_000_000_123_456),  # uint64 kept in int64 by its bits
            ("t1", 7, 2**62),
            ("t1", -(2**63), None),  # began 0: unknown, null
            ("t1", 8, -5),  # no targets: one row all the same
        ]
        rebuilt = snapshot_from_rows(
            rows["snapshots"][0], *(rows[t] for t in ("processes", "counters", "wait_edges", "channels", "messages"))
        )
        assert rebuilt == snapshot
        root = tmp_path / "archive"
        assert restart_writer(root, store) == 1
        [(head, read)] = list(read_snapshots(root))
        assert read == snapshot == store.snapshot(snapshot_id)
        assert GlobalSnapshot.FromString(head["snapshot"]) == snapshot


def write_old_batch(root: Path, version: int, items: list[Any]) -> None:
    """Write `items` (Finished) as a batch of schema `version`: the columns of that version only."""
    rows = {table: [] for table in TABLES if table != "resolutions"}
    for item in items:
        for table, table_rows in snapshot_rows(item.summary, item.snapshot, item.evaluation).items():
            rows[table].extend(table_rows)
    name = batch_name([item.snapshot_id for item in items])
    for table, table_rows in rows.items():
        schema = table_schema(table, version)
        for day in sorted({row["day"] for row in table_rows}):
            path = root / table / f"day={day}" / name
            path.parent.mkdir(parents=True, exist_ok=True)
            day_rows = [{n: row[n] for n in schema.names} for row in table_rows if row["day"] == day]
            arrow = pa.Table.from_pylist(day_rows, schema=schema).drop_columns(["day"])
            pq.write_table(arrow.replace_schema_metadata({METADATA_KEY: str(version).encode()}), path)


def test_an_archive_of_version_2_reads_its_waits_as_instance_0_and_takes_new_batches(
    store: Store, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old = complete(store)
    root = tmp_path / "archive"
    root.mkdir()
    (root / MARKER_FILE).write_text(json.dumps({"format": "stablewatch-archive", "schema_version": 2}))
    write_old_batch(root, 2, [load(store, old)])
    store.mark_archived([old])
    assert "instance" not in table_schema("wait_edges", 2).names
    with pytest.raises(ArchiveError, match="schema version 2 has no resolutions table"):
        table_schema("resolutions", 2)

    [(_, snapshot)] = list(read_snapshots(root))
    assert snapshot == store.snapshot(old)  # the store's waits carry no instance either
    assert all(w.instance == 0 and w.began_at_us == 0 for p in snapshot.processes for w in p.state.waits)
    edges = read_table(root, "wait_edges").to_pylist()
    assert edges and all(e["instance"] is None and e["began_at"] is None for e in edges)

    new = store.allocate_id(0)
    store.begin(new, T0 + 10, members=2)
    fresh = with_instances(global_snapshot(new))
    store.complete(fresh, evaluation(new, predicate_results()), T0 + 11)
    assert restart_writer(root, store) == 1  # a writer of this version goes on with the old archive
    assert json.loads((root / MARKER_FILE).read_text())["schema_version"] == SCHEMA_VERSION
    current = str(SCHEMA_VERSION).encode()
    assert [pq.read_schema(p).metadata[METADATA_KEY] for p in parquet_files(root, "wait_edges")] == [b"2", current]
    assert_archived_exactly_once(store, root)
    assert {h["snapshot_id"]: s for h, s in read_snapshots(root)}[new] == fresh
    assert main(["archive", "check", "--archive", str(root), "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["schema_version"] == SCHEMA_VERSION and found["rows"]["snapshots"] == 2
