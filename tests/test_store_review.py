"""The detector's persistence under bad values and failing writes (a review of store and archive).

* A snapshot the archive cannot turn into rows (a NaN attribute, a uint64 of 2**63 or more) is
  refused by the assembler as ``malformed``; should one reach the writer anyway, it fails alone: it
  is set aside (logged, marked in the store, never retried) and the rest of its batch is archived.
* With an archive, retention spares what is not archived yet, up to ten times its bounds, and logs
  a WARNING naming what it deletes past that (the writer may still hold those in memory).
* A completed snapshot the store fails to keep is recorded aborted (``store_error``), not left
  RUNNING; an abort or a break's answer the store fails to take is written with the next write.
* A failed upgrade is a StoreError naming the file and the snapshot; a look-only open never
  upgrades an older store; a failed Parquet write leaves no temporary file.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import sqlite3
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from samples import evaluation, global_snapshot, predicate_results
from settable_clock import T0 as CLOCK_T0
from settable_clock import Clock
from test_resolutions import Harness, cycle_snapshot, report

from polling import async_poll, run
from stablewatch.detector.archive.files import ensure_archive
from stablewatch.detector.archive.reader import read_snapshots
from stablewatch.detector.archive.schema import ArchiveError
from stablewatch.detector.archive.writer import ArchiveWriter, load, write_finished
from stablewatch.detector.assembly import Assembler, PartRejected
from stablewatch.detector.service.detector import Detector, DetectorConfig, NoAgents
from stablewatch.detector.service.store import DB_FILENAME, Store, StoreError
from stablewatch.v1 import GlobalSnapshot, InboundChannelState, LocalSnapshotPart, LocalState, OutboundCount
from stablewatch.v1 import RecordedMessage as Message
from stablewatch.v1.control_pb2 import BREAK_OUTCOME_BROKEN
from stablewatch.v1.query_pb2 import SNAPSHOT_OUTCOME_ABORTED

pytestmark = pytest.mark.timeout(60)

T0 = 1_700_000_000.0


def complete(store: Store, started: float, make: Any = global_snapshot) -> int:
    """Store a completed snapshot made by `make` (from its id), started at `started`; its id."""
    snapshot_id = store.allocate_id(0)
    store.begin(snapshot_id, started, members=2)
    snap = make(snapshot_id)
    snap.started_at.FromMicroseconds(int(started * 1e6))
    snap.completed_at.FromMicroseconds(int(started * 1e6) + 1000)
    store.complete(snap, evaluation(snapshot_id, predicate_results()), started + 1)
    return snapshot_id


def huge_receive_index(snapshot_id: int) -> GlobalSnapshot:
    snap = global_snapshot(snapshot_id)
    snap.channels[0].messages[0].receive_index = 2**63  # a uint64 an agent may send
    return snap


def nan_attribute(snapshot_id: int) -> GlobalSnapshot:
    snap = global_snapshot(snapshot_id)
    snap.processes[0].state.attributes.update({"ratio": float("nan")})  # an agent not in Python may send it
    return snap


def archived_mark(store: Store, snapshot_id: int) -> int:
    (mark,) = (
        sqlite3.connect(store.path).execute("SELECT archived FROM snapshots WHERE id = ?", (snapshot_id,)).fetchone()
    )
    return int(mark)


# -- 1a. the assembler refuses what the archive could not hold ------------------------------------


def _state_with(attributes: dict[str, Any]) -> LocalSnapshotPart:
    part = LocalSnapshotPart(snapshot_id=7, process_id="a", state=LocalState(active=True))
    part.state.attributes.update(attributes)
    return part


def _outbound(n: int) -> LocalSnapshotPart:
    return LocalSnapshotPart(
        snapshot_id=7, process_id="a", state=LocalState(), outbound=[OutboundCount(dst="b", sent_before_marker=n)]
    )


def _inbound(**fields: Any) -> LocalSnapshotPart:
    return LocalSnapshotPart(snapshot_id=7, process_id="a", inbound=[InboundChannelState(src="b", **fields)])


@pytest.mark.parametrize(
    ("part", "named"),
    [
        (_state_with({"ratio": math.nan}), "ratio"),
        (_state_with({"load": math.inf}), "load"),
        (_state_with({"deep": {"list": [1.0, -math.inf]}}), "deep"),
        (_outbound(2**63), "n=9223372036854775808"),
        (_inbound(received_before_recording=2**63), "m=9223372036854775808"),
        (_inbound(received_before_recording=1, messages=[Message(payload=b"x", receive_index=2**63)]), "index"),
        (
            _inbound(received_before_recording=1, payloads=[b"x", b"y"], run_starts=[2**63 - 1], run_lengths=[2]),
            "index",
        ),
    ],
    ids=["nan", "inf", "nested-inf", "n", "m", "receive-index", "column-run"],
)
def test_a_part_with_a_value_the_archive_cannot_hold_is_malformed(part: LocalSnapshotPart, named: str) -> None:
    assembler = Assembler()
    assembler.begin(7, ("a", "b"))
    with pytest.raises(PartRejected) as caught:
        assembler.add_part(part, sender="a")
    assert caught.value.reason == "malformed"
    assert named in str(caught.value)


def test_the_largest_int64_values_still_pass() -> None:
    assembler = Assembler()
    assembler.begin(7, ("a", "b"))
    assembler.add_part(_state_with({"ratio": 0.5, "big": 1e300}), sender="a")
    assembler.add_part(
        _inbound(received_before_recording=2**63 - 2, messages=[Message(payload=b"x", receive_index=2**63 - 1)]),
        sender="a",
    )


# -- 1b. the writer sets aside what it cannot write, and writes the rest ------------------------------


def test_one_snapshot_with_a_uint64_above_2_63_is_an_archive_error_naming_it(tmp_path: Path) -> None:
    with Store(tmp_path / "data") as store:
        bad = complete(store, T0, huge_receive_index)
        with pytest.raises(ArchiveError, match=f"snapshot {bad} cannot be archived"):
            write_finished(tmp_path / "archive", [load(store, bad)])
        assert not [p for p in (tmp_path / "archive").rglob("*") if p.is_file() and p.name.endswith(".tmp")]


@pytest.mark.parametrize("make", [huge_receive_index, nan_attribute], ids=["uint64", "nan"])
def test_a_snapshot_the_archive_cannot_hold_is_set_aside_and_the_rest_is_archived(
    tmp_path: Path, make: Any, caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario() -> None:
        with Store(tmp_path / "data") as store:
            before = complete(store, T0)
            bad = complete(store, T0 + 5, make)
            after = complete(store, T0 + 10)
            writer = ArchiveWriter(tmp_path / "archive", store, batch_size=10, max_age=0.05)
            await writer.start()  # the resync writes all three as one batch
            try:
                await async_poll(lambda: not store.unarchived(10), "the store to hold nothing unarchived")
            finally:
                await writer.close()
            archived = {h["snapshot_id"] for h, _ in read_snapshots(tmp_path / "archive")}
            assert archived == {before, after}
            assert writer.written == 2
            assert archived_mark(store, bad) == 2 and archived_mark(store, after) == 1
            said = [r for r in caplog.records if r.levelno == logging.ERROR and f"snapshot {bad}" in r.getMessage()]
            assert said and "set aside" in said[0].getMessage()

    with caplog.at_level(logging.INFO):
        run(scenario())


def test_a_write_that_fails_on_a_full_disk_leaves_no_partial_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import stablewatch.detector.archive.files as files

    def full_disk(table: Any, where: Any, **kwargs: Any) -> None:
        Path(where).write_bytes(b"PAR1" + b"\0" * 100_000)  # what pyarrow got onto the disk before ENOSPC
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with Store(tmp_path / "data") as store:
        sid = complete(store, T0)
        root = ensure_archive(tmp_path / "archive")
        monkeypatch.setattr(files.pq, "write_table", full_disk)
        with pytest.raises(ArchiveError, match="No space left"):
            write_finished(root, [load(store, sid)])
        assert not [p for p in root.rglob("*") if p.is_file() and p.name.endswith(".tmp")]


# -- 2. retention spares what the archive lacks ------------------------------------------------------


def test_retention_with_an_archive_keeps_the_unarchived_snapshots(tmp_path: Path) -> None:
    with Store(tmp_path / "data", max_snapshots=3, max_age_seconds=None) as store:
        ids = [complete(store, T0 + i) for i in range(6)]
        store.mark_archived(ids[:2])
        assert store.apply_retention(T0 + 100, keep_unarchived=True) == 2  # only the archived ones
        assert [s.snapshot_id for s in store.list(10)] == ids[:1:-1]
        assert store.apply_retention(T0 + 100) == 1  # without an archive: the bound is the bound
        assert [s.snapshot_id for s in store.list(10)] == ids[:2:-1]


def test_retention_by_count_past_its_bound_deletes_unarchived_snapshots_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with Store(tmp_path / "data", max_snapshots=1, max_age_seconds=None) as store:
        ids = [complete(store, T0 + i) for i in range(15)]
        with caplog.at_level(logging.WARNING):
            assert store.apply_retention(T0 + 100, keep_unarchived=True) == 5  # ten times one are kept
        assert len(store.list(20)) == 10
        [said] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert (
            f"5 finished snapshots were not archived yet when retention deleted them (ids {ids[0]} to {ids[4]})" in said
        )


def test_retention_by_age_spares_unarchived_snapshots_and_breaks_up_to_its_bound(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from stablewatch.v1.query_pb2 import Resolution

    with Store(tmp_path / "data", max_snapshots=None, max_age_seconds=10) as store:
        ids = [complete(store, T0 + i) for i in range(3)]
        store.mark_archived(ids[:1])
        sent = Resolution(snapshot_id=ids[0], process_id="a")
        sent.sent_at.FromMicroseconds(int(T0 * 1e6))
        store.add_resolution(sent)
        with caplog.at_level(logging.WARNING):
            assert store.apply_retention(T0 + 50, keep_unarchived=True) == 1  # the archived one
            assert store.resolutions(10) and not caplog.records
            assert store.apply_retention(T0 + 200, keep_unarchived=True) == 2  # past ten times 10 s
        assert store.list(10) == [] and store.resolutions(10) == []
        [said] = [r.getMessage() for r in caplog.records]
        assert (
            f"2 finished snapshots were not archived yet when retention deleted them (ids {ids[1]} to {ids[2]})" in said
        )


def test_the_detector_with_an_archive_spares_what_it_lacks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[bool] = []
    real = Store.apply_retention

    def recording(self: Store, now: float, **kwargs: Any) -> int:
        calls.append(kwargs.get("keep_unarchived", False))
        return real(self, now, **kwargs)

    monkeypatch.setattr(Store, "apply_retention", recording)

    async def scenario(archive: Path | None) -> None:
        config = DetectorConfig(
            data_dir=tmp_path / "data", listen="127.0.0.1:0", metrics_port=None, interval=None, archive=archive
        )
        detector = Detector(config)
        await detector.start()
        await detector.stop()

    run(scenario(tmp_path / "archive"))
    run(scenario(None))
    assert calls == [True, False]


# -- 3. a store write that fails as a snapshot ends --------------------------------------------------


@contextlib.asynccontextmanager
async def one_member_detector(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, make: Callable[[int], GlobalSnapshot] = global_snapshot
) -> AsyncIterator[tuple[Detector, list[int]]]:
    """A started detector with one attached member and a coordinator that completes every snapshot
    with `make` (from its id); the detector and the ids taken. Stopped after."""
    config = DetectorConfig(data_dir=tmp_path / "data", listen="127.0.0.1:0", metrics_port=None, interval=None)
    detector = Detector(config)
    await detector.start()
    taken: list[int] = []

    async def snapshot(timeout: float, snapshot_id: int | None = None, **_: Any) -> GlobalSnapshot:
        assert snapshot_id is not None
        taken.append(snapshot_id)
        return make(snapshot_id)

    try:
        detector.coordinator.members["a"] = object()  # type: ignore[assignment]  # for take_snapshot's check
        monkeypatch.setattr(detector.coordinator, "snapshot", snapshot)
        yield detector, taken
    finally:
        detector.coordinator.members.clear()
        await detector.stop()


def disk_full(*args: Any, **kwargs: Any) -> Any:
    raise sqlite3.OperationalError("database or disk is full")


def test_a_completed_snapshot_the_store_cannot_keep_is_recorded_aborted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def scenario() -> None:
        async with one_member_detector(tmp_path, monkeypatch) as (detector, taken):
            with monkeypatch.context() as patch:
                patch.setattr(detector.store, "complete", disk_full)
                with pytest.raises(sqlite3.OperationalError):
                    await detector.take_snapshot()
            summary = detector.store.summary(taken[0])
            assert summary is not None and summary.outcome == SNAPSHOT_OUTCOME_ABORTED
            assert summary.abort_kind == "store_error"
            assert summary.abort_reason == "the completed snapshot could not be stored: database or disk is full"
            aborts = detector.metrics.registry.get_sample_value(
                "stablewatch_snapshot_aborts_total", {"kind": "store_error"}
            )
            assert aborts == 1

    run(scenario())


async def snapshot_on_a_full_disk(detector: Detector, monkeypatch: pytest.MonkeyPatch) -> None:
    """Take a snapshot while the store can neither complete nor abort it (the abort is left unstored)."""
    with monkeypatch.context() as patch:
        patch.setattr(detector.store, "complete", disk_full)
        patch.setattr(detector.store, "abort", disk_full)
        with pytest.raises(sqlite3.OperationalError):
            await detector.take_snapshot()


def test_an_abort_the_store_fails_to_write_is_written_before_the_next_snapshot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def scenario() -> None:
        async with one_member_detector(tmp_path, monkeypatch) as (detector, taken):
            await snapshot_on_a_full_disk(detector, monkeypatch)
            first = detector.store.summary(taken[0])
            assert first is not None and first.outcome != SNAPSHOT_OUTCOME_ABORTED  # the disk was full
            await detector.take_snapshot()  # the store works again: the abort is written first
            first = detector.store.summary(taken[0])
            assert first is not None and first.outcome == SNAPSHOT_OUTCOME_ABORTED
            assert first.abort_kind == "store_error"

    run(scenario())


def test_an_abort_the_store_fails_to_write_is_written_at_the_next_turn_also_without_agents(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The schedule's next turn writes it though no agent is attached any more (no snapshot starts)."""

    async def scenario() -> None:
        async with one_member_detector(tmp_path, monkeypatch) as (detector, taken):
            await snapshot_on_a_full_disk(detector, monkeypatch)
            detector.coordinator.members.clear()  # the member left
            with pytest.raises(NoAgents):
                await detector.take_snapshot()
            first = detector.store.summary(taken[0])
            assert first is not None and first.outcome == SNAPSHOT_OUTCOME_ABORTED
            assert first.abort_kind == "store_error"

    run(scenario())


def test_a_break_answer_the_store_fails_to_take_is_stored_with_the_next(
    store: Store, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock()
    h = Harness(store, clock)
    h.complete(cycle_snapshot(10), CLOCK_T0 - 1)
    _, order = h.sent[-1]
    with monkeypatch.context() as patch, caplog.at_level(logging.ERROR):
        patch.setattr(store, "update_resolution", disk_full)
        answered = h.resolutions.reported("b", report(order))
    assert answered is not None and answered.outcome == BREAK_OUTCOME_BROKEN
    assert h.archived[-1] == answered  # counted, archived and published all the same
    assert any(f"break {order.break_id}" in r.getMessage() for r in caplog.records)
    stored = store.resolution(order.break_id)
    assert stored is not None and not stored.HasField("reported_at")  # the disk was full
    clock.now = CLOCK_T0 + 1
    h.complete(cycle_snapshot(11), CLOCK_T0 + 0.5)  # the deadlock again: a second break, answered ...
    victim, second = h.sent[-1]
    assert second.break_id != order.break_id
    assert h.resolutions.reported(victim, report(second)) is not None  # ... and stored, with the first's answer
    stored = store.resolution(order.break_id)
    assert stored is not None and stored.outcome == BREAK_OUTCOME_BROKEN


# -- 4. a failed upgrade -------------------------------------------------------------------------------

V1 = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL) WITHOUT ROWID;
CREATE TABLE snapshots (id INTEGER PRIMARY KEY, outcome TEXT NOT NULL, abort_reason TEXT NOT NULL DEFAULT '',
    started_at REAL NOT NULL, finished_at REAL, processes INTEGER NOT NULL,
    channels INTEGER NOT NULL DEFAULT 0, messages_in_flight INTEGER NOT NULL DEFAULT 0, snapshot BLOB);
CREATE INDEX snapshots_by_outcome ON snapshots (outcome, id);
CREATE TABLE results (snapshot_id INTEGER NOT NULL REFERENCES snapshots (id) ON DELETE CASCADE,
    position INTEGER NOT NULL, name TEXT NOT NULL, holds INTEGER NOT NULL, result BLOB NOT NULL,
    PRIMARY KEY (snapshot_id, position)) WITHOUT ROWID;
INSERT INTO meta VALUES ('schema_version', 1), ('last_id', 4);
"""

V2 = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL) WITHOUT ROWID;
CREATE TABLE snapshots (id INTEGER PRIMARY KEY, outcome TEXT NOT NULL, abort_reason TEXT NOT NULL DEFAULT '',
    abort_kind TEXT NOT NULL DEFAULT '', started_at REAL NOT NULL, finished_at REAL, processes INTEGER NOT NULL,
    channels INTEGER NOT NULL DEFAULT 0, messages_in_flight INTEGER NOT NULL DEFAULT 0, snapshot BLOB,
    evaluation BLOB, archived INTEGER NOT NULL DEFAULT 0);
CREATE TABLE results (snapshot_id INTEGER NOT NULL, position INTEGER NOT NULL, name TEXT NOT NULL,
    holds INTEGER NOT NULL, unknown INTEGER NOT NULL DEFAULT 0, result BLOB NOT NULL,
    PRIMARY KEY (snapshot_id, position)) WITHOUT ROWID;
CREATE TABLE expected_totals (counter TEXT PRIMARY KEY, total INTEGER NOT NULL) WITHOUT ROWID;
INSERT INTO meta VALUES ('schema_version', 2), ('last_id', 3), ('epoch', 77);
INSERT INTO snapshots (id, outcome, abort_reason, abort_kind, started_at, finished_at, processes)
    VALUES (3, 'aborted', 'deadline passed', 'deadline', 1700000000.0, 1700000005.0, 2);
"""


def make_v1(folder: Path, second_blob: bytes) -> None:
    db = sqlite3.connect(folder / DB_FILENAME)
    db.executescript(V1)
    db.execute(
        "INSERT INTO snapshots VALUES (3, 'completed', '', ?, ?, 2, 3, 3, ?)",
        (T0, T0 + 1, global_snapshot(3).SerializeToString()),
    )
    db.execute("INSERT INTO snapshots VALUES (4, 'completed', '', ?, ?, 2, 3, 3, ?)", (T0 + 2, T0 + 3, second_blob))
    db.commit()
    db.close()


def schema_version(folder: Path) -> int:
    db = sqlite3.connect(folder / DB_FILENAME)
    try:
        (version,) = db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        return int(version)
    finally:
        db.close()


def test_a_failed_upgrade_is_a_store_error_naming_the_file_and_the_snapshot(tmp_path: Path) -> None:
    make_v1(tmp_path, b"\xff\xff\xff not a GlobalSnapshot")
    with pytest.raises(StoreError, match=rf"{tmp_path / DB_FILENAME}.*snapshot 4"):
        Store(tmp_path)
    assert schema_version(tmp_path) == 1  # rolled back: nothing lost
    assert sqlite3.connect(tmp_path / DB_FILENAME).execute("SELECT count(*) FROM snapshots").fetchone() == (2,)


# -- 5. a look-only open of an older store -------------------------------------------------------------


def test_a_look_only_open_reads_a_version_2_store_as_it_is(tmp_path: Path) -> None:
    db = sqlite3.connect(tmp_path / DB_FILENAME)
    db.executescript(V2)
    db.close()
    with Store(tmp_path, lock=False) as store:
        [summary] = store.list(10)
        assert summary.snapshot_id == 3 and summary.abort_kind == "deadline"
        assert store.resolutions(10) == [] and store.resolution(1) is None and store.epoch == 77
    assert schema_version(tmp_path) == 2
    with Store(tmp_path) as store:  # the detector upgrades it
        assert store.resolutions(10) == []
    assert schema_version(tmp_path) == 3


def test_a_look_only_open_refuses_a_version_1_store_rather_than_upgrade_it(tmp_path: Path) -> None:
    make_v1(tmp_path, global_snapshot(4).SerializeToString())
    with pytest.raises(StoreError, match="open it with the detector first"):
        Store(tmp_path, lock=False)
    assert schema_version(tmp_path) == 1
