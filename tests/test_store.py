"""Unit tests of the detector's SQLite store: round trips, ids across restarts, retention, errors."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from samples import evaluation, global_snapshot, predicate_results

from stablewatch.detector.service.store import DB_FILENAME, RESTART_REASON, SCHEMA_VERSION, Store, StoreError
from stablewatch.v1 import PredicateResult
from stablewatch.v1.ids import ID_SPACES
from stablewatch.v1.query_pb2 import (
    SNAPSHOT_OUTCOME_ABORTED,
    SNAPSHOT_OUTCOME_COMPLETED,
    SNAPSHOT_OUTCOME_RUNNING,
    SnapshotSummary,
)

T0 = 1_700_000_000.25  # exactly representable, so timestamps compare exactly


# -- helpers --------------------------------------------------------------------------------------


def completed(store: Store, when: float = T0, *, deadlock: bool = True) -> int:
    """Allocate, begin and complete a snapshot that finished at `when`; return its id."""
    snapshot_id = store.allocate_id(0)
    store.begin(snapshot_id, when - 1.0, members=2)
    store.complete(global_snapshot(snapshot_id), evaluation(snapshot_id, predicate_results(deadlock)), when)
    return snapshot_id


def aborted(store: Store, when: float = T0, reason: str = "deadline of 5s passed") -> int:
    """Allocate, begin and abort a snapshot that finished at `when`; return its id."""
    snapshot_id = store.allocate_id(0)
    store.begin(snapshot_id, when - 1.0, members=3)
    store.abort(snapshot_id, reason, when)
    return snapshot_id


def ids(summaries: list[SnapshotSummary]) -> list[int]:
    return [s.snapshot_id for s in summaries]


# -- round trips ----------------------------------------------------------------------------------


def test_creates_the_data_directory_and_a_wal_database(tmp_path: Path) -> None:
    data = tmp_path / "a" / "b"
    Store(data).close()
    db = sqlite3.connect(data / DB_FILENAME)
    try:
        assert db.execute("PRAGMA journal_mode").fetchone() == ("wal",)
        assert db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone() == (SCHEMA_VERSION,)
    finally:
        db.close()


def test_completed_snapshot_and_results_round_trip(tmp_path: Path) -> None:
    results = predicate_results()
    with Store(tmp_path) as store:
        snapshot_id = store.allocate_id(0)
        assert snapshot_id == 128  # the first id of space 0 (ids are multiples of 128 there)
        snapshot = global_snapshot(snapshot_id)
        store.begin(snapshot_id, T0, members=2)
        returned = store.complete(snapshot, evaluation(snapshot_id, results), T0 + 2.5)

        summary = returned.snapshot
        assert summary.snapshot_id == snapshot_id
        assert summary.outcome == SNAPSHOT_OUTCOME_COMPLETED
        assert summary.abort_reason == ""
        assert summary.started_at.ToNanoseconds() == round(T0 * 1e9)
        assert summary.finished_at.ToNanoseconds() == round((T0 + 2.5) * 1e9)
        assert (summary.processes, summary.channels, summary.messages_in_flight) == (2, 3, 3)
        assert list(returned.results) == results

        assert store.snapshot(snapshot_id) == snapshot
        assert store.results(snapshot_id) == returned
        assert store.summary(snapshot_id) == summary
        assert store.latest_results() == returned
        # The stored value, never recomputed.
        assert store.evaluation(snapshot_id) == evaluation(snapshot_id, results)
        assert store.wait_for_graph(snapshot_id) == evaluation(snapshot_id, results).wait_for
    with Store(tmp_path) as store:  # and the same after a reopen
        assert store.snapshot(snapshot_id) == snapshot
        assert store.results(snapshot_id) == returned
        assert store.evaluation(snapshot_id) == evaluation(snapshot_id, results)


def test_running_and_aborted_summaries(store: Store) -> None:
    store.begin(1, T0, members=4)
    running = store.summary(1)
    assert running is not None
    assert running.outcome == SNAPSHOT_OUTCOME_RUNNING
    assert running.processes == 4
    assert not running.HasField("finished_at")
    assert store.snapshot(1) is None

    summary = store.abort(1, "member b failed", T0 + 1)
    assert summary.outcome == SNAPSHOT_OUTCOME_ABORTED
    assert summary.abort_reason == "member b failed"
    assert summary.finished_at.ToNanoseconds() == round((T0 + 1) * 1e9)
    assert store.summary(1) == summary
    results = store.results(1)
    assert results is not None and results.snapshot == summary and list(results.results) == []
    assert store.snapshot(1) is None


def test_unknown_ids_read_as_none(store: Store) -> None:
    assert store.summary(42) is None
    assert store.results(42) is None
    assert store.snapshot(42) is None
    assert store.summary(2**64 - 1) is None  # a uint64 id beyond what SQLite can hold
    assert store.latest_results() is None
    assert store.list(10) == []
    assert store.predicate_history("deadlock", 10) == []


# -- ids ------------------------------------------------------------------------------------------


def test_ids_increase_across_restarts_including_unused_ones(tmp_path: Path) -> None:
    with Store(tmp_path) as store:  # space 0: the multiples of 128
        assert [store.allocate_id(0) for _ in range(3)] == [128, 256, 384]
        store.begin(256, T0, members=1)  # 128 and 384 are never written
    with Store(tmp_path) as store:
        assert store.allocate_id(0) == 512
        store.begin(1000, T0, members=1)  # an id chosen elsewhere raises the sequence
        assert store.allocate_id(0) == 1024
    with Store(tmp_path) as store:
        assert store.allocate_id(0) == 1152


def test_ids_of_another_space_increase_across_restarts(tmp_path: Path) -> None:
    with Store(tmp_path) as store:
        first = [store.allocate_id(0, space=1) for _ in range(3)]
        assert first == [1, 129, 257]  # the ids ≡ 1 (mod 128), from the smallest
        clocked = store.allocate_id(T0, space=1)
        assert clocked % ID_SPACES == 1
        assert abs(clocked - int(T0 * 1_000_000)) < ID_SPACES  # still the clock's time, to 127 µs
        assert store.allocate_id(T0, space=1) == clocked + ID_SPACES  # the clock did not move
    with Store(tmp_path) as store:
        again = [store.allocate_id(T0 - 3600, space=1) for _ in range(3)]  # the clock went back
    assert again == [clocked + k * ID_SPACES for k in (2, 3, 4)]


def test_a_space_that_is_no_replica_is_refused(store: Store) -> None:
    for space in (-1, ID_SPACES, 1.0, True):
        with pytest.raises(ValueError, match="replica"):
            store.allocate_id(T0, space=space)  # type: ignore[arg-type]
    assert store.allocate_id(0) == 128  # nothing was handed out by the refused calls


def test_two_replicas_never_hand_out_the_same_id(tmp_path: Path) -> None:
    """Two detectors side by side, each with its own store, given the very same clock readings."""
    with Store(tmp_path / "a") as a, Store(tmp_path / "b") as b:
        nows = [0.0, 0.0, T0, T0, T0 + 0.000_001, T0 - 5, T0 + 1, T0 + 1]
        from_a = [a.allocate_id(now, space=0) for now in nows]
        from_b = [b.allocate_id(now, space=1) for now in nows]
    assert not set(from_a) & set(from_b)
    assert from_a == sorted(set(from_a)) and from_b == sorted(set(from_b))  # each increases
    assert {i % ID_SPACES for i in from_a} == {0} and {i % ID_SPACES for i in from_b} == {1}


def test_begin_refuses_an_existing_or_invalid_id(store: Store) -> None:
    store.begin(1, T0, members=1)
    with pytest.raises(ValueError, match="snapshot 1 already exists"):
        store.begin(1, T0, members=1)
    with pytest.raises(ValueError, match="out of range"):
        store.begin(0, T0, members=1)
    with pytest.raises(ValueError, match="finite"):
        store.begin(2, float("nan"), members=1)
    with pytest.raises(ValueError, match="members"):
        store.begin(2, T0, members=-1)


# -- restarts -------------------------------------------------------------------------------------


def test_running_snapshots_are_aborted_on_reopen(tmp_path: Path) -> None:
    with Store(tmp_path) as store:
        done = completed(store)
        first = store.allocate_id(0)
        store.begin(first, T0, members=2)
        running = store.allocate_id(0)
        store.begin(running, T0, members=2)
    with Store(tmp_path) as store:
        for snapshot_id in (first, running):
            summary = store.summary(snapshot_id)
            assert summary is not None
            assert summary.outcome == SNAPSHOT_OUTCOME_ABORTED
            assert summary.abort_reason == RESTART_REASON == "detector restarted"
            assert summary.HasField("finished_at")
        assert store.summary(done).outcome == SNAPSHOT_OUTCOME_COMPLETED
        with pytest.raises(ValueError, match="already aborted"):
            store.complete(global_snapshot(running), evaluation(running, []), T0)


# -- queries --------------------------------------------------------------------------------------


def test_latest_results_skips_aborted_and_running(store: Store) -> None:
    first = completed(store, deadlock=True)
    aborted(store)
    store.begin(store.allocate_id(0), T0, members=2)
    latest = store.latest_results()
    assert latest is not None
    assert latest.snapshot.snapshot_id == first
    assert list(latest.results) == predicate_results(deadlock=True)

    second = completed(store, deadlock=False)
    assert store.latest_results().snapshot.snapshot_id == second


def test_list_pages_newest_first(store: Store) -> None:
    made = [completed(store), aborted(store), completed(store), aborted(store), completed(store)]
    assert made == [128, 256, 384, 512, 640]
    one, two, three, four, five = made
    assert ids(store.list(2)) == [five, four]
    assert ids(store.list(2, before_id=four)) == [three, two]
    assert ids(store.list(2, before_id=two)) == [one]
    assert ids(store.list(2, before_id=one)) == []
    assert ids(store.list(100)) == [five, four, three, two, one]
    assert ids(store.list(3, before_id=2**64 - 1)) == [five, four, three]
    assert [s.outcome for s in store.list(2)] == [SNAPSHOT_OUTCOME_COMPLETED, SNAPSHOT_OUTCOME_ABORTED]
    store.begin(2**63 - 1, T0, members=1)  # the largest id SQLite can hold
    assert ids(store.list(2)) == [2**63 - 1, five]
    assert ids(store.list(2, before_id=2**64 - 1)) == [2**63 - 1, five]
    assert ids(store.list(2, before_id=2**63 - 1)) == [five, four]
    with pytest.raises(ValueError, match="page_size"):
        store.list(0)


def test_predicate_history_newest_first(store: Store) -> None:
    first = completed(store, deadlock=False)
    second = completed(store, deadlock=True)
    aborted(store)
    fourth = completed(store, deadlock=False)
    assert store.predicate_history("deadlock", 10) == [(fourth, False), (second, True), (first, False)]
    assert store.predicate_history("deadlock", 2) == [(fourth, False), (second, True)]
    assert store.predicate_history("user.score", 1) == [(fourth, True)]
    assert store.predicate_history("no such predicate", 10) == []
    assert store.predicate_history("deadlock", 0) == []
    # An unknown result reads as None, not as False (from a review: the cut did not say).
    undecided = store.allocate_id(0)
    store.begin(undecided, T0 - 1.0, members=2)
    results = predicate_results(False)
    results[0].unknown = True
    store.complete(global_snapshot(undecided), evaluation(undecided, results), T0)
    assert store.predicate_history("deadlock", 1) == [(undecided, None)]
    with pytest.raises(ValueError, match="limit"):
        store.predicate_history("deadlock", -1)


# -- errors ---------------------------------------------------------------------------------------


def test_unknown_ids_in_complete_and_abort_raise_key_error(store: Store) -> None:
    with pytest.raises(KeyError, match="snapshot 9"):
        store.complete(global_snapshot(9), evaluation(9, predicate_results()), T0)
    with pytest.raises(KeyError, match="snapshot 9"):
        store.abort(9, "deadline", T0)
    with pytest.raises(KeyError):
        store.complete(global_snapshot(2**64 - 1), evaluation(2**64 - 1, []), T0)
    assert store.list(10) == []


def test_a_finished_snapshot_cannot_finish_again(store: Store) -> None:
    done = completed(store)
    before = store.results(done)
    with pytest.raises(ValueError, match=f"snapshot {done}: it is already completed"):
        store.complete(global_snapshot(done), evaluation(done, predicate_results(deadlock=False)), T0 + 5)
    with pytest.raises(ValueError, match="already completed"):
        store.abort(done, "late", T0 + 5)
    assert store.results(done) == before  # nothing was half written

    gone = aborted(store)
    with pytest.raises(ValueError, match="already aborted"):
        store.complete(global_snapshot(gone), evaluation(gone, predicate_results()), T0 + 5)
    with pytest.raises(ValueError, match="already aborted"):
        store.abort(gone, "again", T0 + 5)


def test_a_failed_complete_leaves_the_snapshot_running(tmp_path: Path) -> None:
    with Store(tmp_path) as store:
        store.begin(1, T0, members=2)
        # Make the second result row fail inside the transaction, after the snapshot row was updated.
        db = sqlite3.connect(tmp_path / DB_FILENAME)
        db.execute(
            "CREATE TRIGGER boom BEFORE INSERT ON results WHEN NEW.name = 'boom' BEGIN SELECT RAISE(ABORT, 'boom'); END"
        )
        db.commit()
        db.close()
        results = [PredicateResult(name="fine", holds=True), PredicateResult(name="boom")]
        with pytest.raises(sqlite3.IntegrityError, match="boom"):
            store.complete(global_snapshot(1), evaluation(1, results), T0 + 1)
        assert store.summary(1).outcome == SNAPSHOT_OUTCOME_RUNNING
        assert store.snapshot(1) is None
        assert store.predicate_history("fine", 10) == []
        store.abort(1, "could not store the results", T0 + 2)  # the store is still usable


# -- retention ------------------------------------------------------------------------------------


def test_retention_by_count_deletes_oldest_first(tmp_path: Path) -> None:
    with Store(tmp_path, max_snapshots=3, max_age_seconds=None) as store:
        made = [completed(store) for _ in range(5)] + [aborted(store)]
        assert store.apply_retention(now=T0) == 3
        assert ids(store.list(10)) == made[:2:-1]
        assert store.snapshot(made[0]) is None and store.results(made[0]) is None
        # Their results went with them.
        assert store.predicate_history("deadlock", 10) == [(made[4], True), (made[3], True)]
        assert store.apply_retention(now=T0) == 0
        assert store.allocate_id(0) == made[-1] + ID_SPACES


def test_retention_never_deletes_running_rows(tmp_path: Path) -> None:
    with Store(tmp_path, max_snapshots=2, max_age_seconds=60) as store:
        oldest = store.allocate_id(0)
        store.begin(oldest, T0 - 10_000, members=2)  # old and still running
        for _ in range(3):
            completed(store, T0)
        newest = store.allocate_id(0)
        store.begin(newest, T0, members=2)  # the newest, running
        # The bound counts every row; only finished ones can go.
        assert store.apply_retention(now=T0 + 10_000) == 3
        assert ids(store.list(10)) == [newest, oldest]
        assert [s.outcome for s in store.list(10)] == [SNAPSHOT_OUTCOME_RUNNING, SNAPSHOT_OUTCOME_RUNNING]
        # Still completes after retention.
        store.complete(global_snapshot(oldest), evaluation(oldest, predicate_results()), T0 + 10_001)


def test_retention_by_age(tmp_path: Path) -> None:
    with Store(tmp_path, max_snapshots=None, max_age_seconds=100) as store:
        first = completed(store, T0)
        second = aborted(store, T0 + 50)
        third = completed(store, T0 + 100)
        running = store.allocate_id(0)
        store.begin(running, T0 - 1_000, members=1)  # running: never deleted by age
        assert store.apply_retention(now=T0 + 149) == 1
        assert store.summary(first) is None
        assert store.summary(second) is not None
        assert store.apply_retention(now=T0 + 200) == 1  # exactly max_age old is kept
        assert store.summary(third) is not None
        assert store.apply_retention(now=T0 + 10_000) == 1
        assert ids(store.list(10)) == [running]


def test_ids_are_not_reused_after_retention_empties_the_store(tmp_path: Path) -> None:
    with Store(tmp_path, max_snapshots=0, max_age_seconds=None) as store:
        made = [completed(store) for _ in range(3)]
        assert store.apply_retention(now=T0) == 3
        assert store.list(10) == []
    with Store(tmp_path) as store:
        assert store.allocate_id(0) == made[-1] + ID_SPACES


def test_retention_without_bounds_deletes_nothing(tmp_path: Path) -> None:
    with Store(tmp_path, max_snapshots=None, max_age_seconds=None) as store:
        completed(store, 0.0)
        assert store.apply_retention(now=T0) == 0


def test_retention_bounds_are_validated(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_snapshots"):
        Store(tmp_path, max_snapshots=-1)
    with pytest.raises(ValueError, match="max_age_seconds"):
        Store(tmp_path, max_age_seconds=float("inf"))


# -- files we must not use ------------------------------------------------------------------------


def test_newer_schema_version_is_refused_and_left_untouched(tmp_path: Path) -> None:
    with Store(tmp_path) as store:
        store.begin(store.allocate_id(0), T0, members=1)
    db = sqlite3.connect(tmp_path / DB_FILENAME)
    with db:
        db.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (SCHEMA_VERSION + 1,))
    db.close()

    with pytest.raises(StoreError, match=f"schema version {SCHEMA_VERSION + 1}") as raised:
        Store(tmp_path)
    assert str(tmp_path / DB_FILENAME) in str(raised.value)

    db = sqlite3.connect(tmp_path / DB_FILENAME)
    try:  # the running row was not touched by the refused open
        assert db.execute("SELECT outcome FROM snapshots").fetchall() == [("running",)]
    finally:
        db.close()


def test_a_schema_version_no_stablewatch_wrote_is_refused_and_left_untouched(tmp_path: Path) -> None:
    """An older version without an upgrade step (0) is not read as if it were current."""
    with Store(tmp_path) as store:
        store.begin(store.allocate_id(0), T0, members=1)
    db = sqlite3.connect(tmp_path / DB_FILENAME)
    with db:
        db.execute("UPDATE meta SET value = 0 WHERE key = 'schema_version'")
    db.close()

    with pytest.raises(StoreError, match="schema version 0 is not one stablewatch wrote") as raised:
        Store(tmp_path)
    assert str(tmp_path / DB_FILENAME) in str(raised.value)

    db = sqlite3.connect(tmp_path / DB_FILENAME)
    try:  # the refused upgrade rolled back: same version, the running row untouched
        assert db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchall() == [(0,)]
        assert db.execute("SELECT outcome FROM snapshots").fetchall() == [("running",)]
    finally:
        db.close()


def test_foreign_files_are_refused(tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    db = sqlite3.connect(other / DB_FILENAME)
    db.execute("CREATE TABLE t (x)")
    db.close()
    with pytest.raises(StoreError, match="not a stablewatch store") as raised:
        Store(other)
    assert str(other / DB_FILENAME) in str(raised.value)

    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / DB_FILENAME).write_bytes(b"this is not an SQLite database, not even close" * 100)
    with pytest.raises(StoreError, match="cannot open the store") as raised:
        Store(garbage)
    assert str(garbage / DB_FILENAME) in str(raised.value)


def test_data_directory_that_cannot_be_created(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(StoreError, match="cannot create the data directory") as raised:
        Store(blocker / "data")
    assert str(blocker / "data") in str(raised.value)


def test_database_path_that_cannot_be_opened(tmp_path: Path) -> None:
    (tmp_path / DB_FILENAME).mkdir()  # a directory where the database file should be
    with pytest.raises(StoreError, match="cannot open the store") as raised:
        Store(tmp_path)
    assert str(tmp_path / DB_FILENAME) in str(raised.value) and "writable" in str(raised.value)


def skip_unless_permissions_apply(directory: Path) -> None:
    """Skip when this process may write where permissions say it may not (root, CAP_DAC_OVERRIDE)."""
    probe = directory / "probe"
    try:
        probe.write_text("")
    except PermissionError:
        return
    probe.unlink()
    pytest.skip("this process ignores file permissions (root); run as another user to test read-only paths")


def test_read_only_data_directory(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    data.chmod(0o555)
    try:
        skip_unless_permissions_apply(data)
        with pytest.raises(StoreError, match="cannot open the store") as raised:
            Store(data)
        assert str(data / DB_FILENAME) in str(raised.value) and "writable" in str(raised.value)
    finally:
        data.chmod(0o755)


def test_read_only_database_file(tmp_path: Path) -> None:
    data = tmp_path / "data"
    Store(data).close()
    for leftover in data.glob(DB_FILENAME + "-*"):
        leftover.unlink()
    (data / DB_FILENAME).chmod(0o444)
    data.chmod(0o555)
    try:
        skip_unless_permissions_apply(data)
        with pytest.raises(StoreError, match="cannot open the store") as raised:
            Store(data)
        assert str(data / DB_FILENAME) in str(raised.value) and "writable" in str(raised.value)
    finally:
        data.chmod(0o755)
        (data / DB_FILENAME).chmod(0o644)


def test_closed_store_refuses_calls(tmp_path: Path) -> None:
    store = Store(tmp_path)
    store.close()
    store.close()  # harmless
    with pytest.raises(sqlite3.ProgrammingError):
        store.allocate_id(0)


# -- ids, epochs, the lock and upgrades -------------------------------------------------------------


def test_ids_follow_the_clock_in_microseconds_and_never_repeat(tmp_path: Path) -> None:
    with Store(tmp_path) as store:
        first = store.allocate_id(T0)
        # The clock's microseconds rounded down to the space (0: multiples of 128).
        assert first == int(T0 * 1_000_000) // ID_SPACES * ID_SPACES
        assert int(T0 * 1_000_000) - first < ID_SPACES
        assert store.allocate_id(T0) == first + ID_SPACES  # the clock did not move: the next of the space
        assert store.allocate_id(T0 - 3600) == first + 2 * ID_SPACES  # the clock went back: still above
        later = int((T0 + 1) * 1_000_000)
        assert store.allocate_id(T0 + 1) == later - later % ID_SPACES


def test_a_fresh_store_starts_above_an_old_detectors_ids_and_has_a_new_epoch(tmp_path: Path) -> None:
    with Store(tmp_path / "old") as old:
        old_ids = [old.allocate_id(T0 + i / 1000) for i in range(5000)]  # more than an agent remembers
        old_epoch = old.epoch
    with Store(tmp_path / "old") as reopened:
        assert reopened.epoch == old_epoch  # the same store: the same id space
    with Store(tmp_path / "fresh") as fresh:
        assert fresh.epoch not in (0, old_epoch)
        assert fresh.allocate_id(T0 + 10) > max(old_ids)


def test_the_data_directory_is_locked_while_a_store_is_open(tmp_path: Path) -> None:
    with Store(tmp_path) as store:
        with pytest.raises(StoreError, match=r"in use by another detector \(pid \d+\)"):
            Store(tmp_path)
        with Store(tmp_path, lock=False) as reader:  # a read-only look (archive export) is fine
            assert reader.epoch == store.epoch
    with Store(tmp_path):  # released on close
        pass


def test_baselines_are_kept_once(store: Store) -> None:
    store.add_expected_totals({"tokens": 30})
    store.add_expected_totals({"tokens": 99, "credits": 4})
    assert store.expected_totals() == {"tokens": 30, "credits": 4}


def test_unarchived_snapshots_until_marked(store: Store) -> None:
    done = completed(store)
    gone, running = done + ID_SPACES, done + 2 * ID_SPACES
    store.begin(gone, T0, members=1)
    store.abort(gone, "deadline", T0 + 1, "deadline")
    store.begin(running, T0, members=1)  # running: not archived yet
    assert store.unarchived(10) == [done, gone]
    store.mark_archived([done])
    assert store.unarchived(10) == [gone]
    assert store.summary(gone).abort_kind == "deadline"


def test_a_version_1_store_is_upgraded_in_place(tmp_path: Path) -> None:
    """A store written by the previous schema keeps its history, gains stored evaluations and baselines."""
    path = tmp_path / DB_FILENAME
    db = sqlite3.connect(path)
    db.executescript(
        """
        CREATE TABLE meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL) WITHOUT ROWID;
        CREATE TABLE snapshots (id INTEGER PRIMARY KEY, outcome TEXT NOT NULL, abort_reason TEXT NOT NULL DEFAULT '',
            started_at REAL NOT NULL, finished_at REAL, processes INTEGER NOT NULL,
            channels INTEGER NOT NULL DEFAULT 0, messages_in_flight INTEGER NOT NULL DEFAULT 0, snapshot BLOB);
        CREATE INDEX snapshots_by_outcome ON snapshots (outcome, id);
        CREATE TABLE results (snapshot_id INTEGER NOT NULL REFERENCES snapshots (id) ON DELETE CASCADE,
            position INTEGER NOT NULL, name TEXT NOT NULL, holds INTEGER NOT NULL, result BLOB NOT NULL,
            PRIMARY KEY (snapshot_id, position)) WITHOUT ROWID;
        INSERT INTO meta VALUES ('schema_version', 1), ('last_id', 3);
        """
    )
    blob = global_snapshot(3).SerializeToString()
    db.execute("INSERT INTO snapshots VALUES (3, 'completed', '', ?, ?, 2, 3, 3, ?)", (T0, T0 + 1, blob))
    for position, result in enumerate(predicate_results()):
        db.execute(
            "INSERT INTO results VALUES (3, ?, ?, ?, ?)",
            (position, result.name, result.holds, result.SerializeToString()),
        )
    db.commit()
    db.close()
    with Store(tmp_path) as store:
        assert store.snapshot(3) == global_snapshot(3)
        graph = store.wait_for_graph(3)
        assert graph is not None and ("a", "b") in {(e.waiter.process, e.target.process) for e in graph.edges}
        assert store.expected_totals() == {"tokens": 14}  # the baseline the newest results were checked against
        assert store.allocate_id(0) == 128  # the next id of space 0 above the old last id 3
        assert store.unarchived(10) == [3]
