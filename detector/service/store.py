"""The detector's embedded store: snapshot outcomes, global snapshots and their evaluations in SQLite.

One file, ``<data_dir>/stablewatch.sqlite3``, opened in WAL mode with ``synchronous=NORMAL`` and
used from the detector's event loop thread only. Every call is one small transaction, so it is
quick enough to make from the loop. A writer holds an exclusive lock on
``<data_dir>/stablewatch.lock`` while it is open: a second detector on the same folder is refused
with a clear :class:`StoreError` instead of corrupting the first one's ids.

Theory of operation:

* A snapshot's life is ``allocate_id`` -> ``begin`` (a RUNNING row) -> ``complete`` or ``abort``.
  An id is the snapshot's start time in microseconds since the Unix epoch, in the detector's id
  space (:mod:`stablewatch.v1.ids`: detectors side by side never share an id), raised above
  the last id when the clock has not moved on: ids grow within a store and, because they follow
  the clock, a fresh store (a new data directory) starts above any earlier detector's ids. The
  last id is persisted as soon as it is handed out, so an id is never handed out twice, even when
  its row was never written or was deleted by retention. ``begin`` with an id from elsewhere
  raises the counter to at least that id. Each store also has a random ``epoch``, sent to agents
  when they register: an agent that sees a new epoch forgets every snapshot of the old one.
* A completed snapshot keeps its ``GlobalSnapshot`` and its ``Evaluation`` (wait-for graph and
  coverage) as serialized protobuf blobs, and each predicate result as a row of ``results``
  (name, holds, unknown, blob), so that the history of one predicate is an index scan.
* ``archived`` marks the finished snapshots already written to the Parquet archive, so that a
  restarted detector writes exactly those that were not (``unarchived``, ``mark_archived``); a
  snapshot the archive cannot hold is set aside (``set_aside``: ``archived`` is 2) and never
  offered again.
* A RUNNING row found when the store opens with its lock belongs to a detector that is gone: it
  is marked ABORTED with the reason ``"detector restarted"``. Opened without the lock, the store
  leaves RUNNING rows alone: they may belong to the live detector beside it.
* ``add_resolution`` stores a break of a proven deadlock as it is sent (the id is the break id)
  and ``update_resolution`` what its agent answered; ``resolutions`` lists them newest first.
  Retention keeps them as long as the snapshots (by age).
* ``apply_retention`` deletes finished snapshots beyond ``max_snapshots`` (oldest first) and those
  that finished more than ``max_age_seconds`` ago; RUNNING rows are never deleted. With an archive
  (``keep_unarchived``) it spares the snapshots not archived yet, and the breaks, up to
  :data:`UNARCHIVED_SLACK` times those bounds; past that it deletes them and logs a WARNING with how
  many were not archived yet and their ids (the archive writer may still hold them in memory).

The schema is versioned (``meta.schema_version``); a file written by a newer stablewatch is
refused with :class:`StoreError` rather than misread, and an older one is upgraded in place
(:mod:`.migration`) by a detector. A reader that only looks (``lock=False``) never upgrades a file
its live detector may be using: it reads a version-2 file as it is (it has no breaks), and refuses
an older one with :class:`StoreError`.
Durability: with ``synchronous=NORMAL`` a commit survives a crash of the process, though the last
commits may be lost on power loss.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import sqlite3
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType

from google.protobuf.timestamp_pb2 import Timestamp

from stablewatch.detector import lockfile
from stablewatch.detector.service import migration
from stablewatch.v1 import Evaluation, GlobalSnapshot, PredicateResult, WaitForGraph
from stablewatch.v1.ids import next_id, space_problem
from stablewatch.v1.query_pb2 import (
    SNAPSHOT_OUTCOME_ABORTED,
    SNAPSHOT_OUTCOME_COMPLETED,
    SNAPSHOT_OUTCOME_RUNNING,
    Resolution,
    SnapshotOutcome,
    SnapshotResults,
    SnapshotSummary,
)

__all__ = [
    "DB_FILENAME",
    "LOCK_FILENAME",
    "RESTART_REASON",
    "SCHEMA_VERSION",
    "UNARCHIVED_SLACK",
    "Store",
    "StoreError",
]

_log = logging.getLogger(__name__)

#: The database file inside the data directory.
DB_FILENAME = "stablewatch.sqlite3"
#: The lock a writing detector holds inside the data directory.
LOCK_FILENAME = "stablewatch.lock"
#: The schema this code reads and writes; older ones are upgraded when opened.
SCHEMA_VERSION = 3
#: Why a snapshot left RUNNING by an earlier process was aborted.
RESTART_REASON = "detector restarted"
#: With an archive, retention spares what is not archived yet up to this many times its bounds.
UNARCHIVED_SLACK = 10
#: The oldest schema a reader that only looks reads as it is (version 3 only added ``resolutions``).
_LOOK_ONLY_FROM = 2
_SET_ASIDE = 2  # ``archived`` of a snapshot the archive cannot hold

_MAX_ID = 2**63 - 1  # SQLite integers are signed 64-bit
_BUSY_TIMEOUT_MS = 2000  # only another process holding the file can make us wait

_SCHEMA = """
CREATE TABLE meta (
    key TEXT PRIMARY KEY,
    value INTEGER NOT NULL
) WITHOUT ROWID;
CREATE TABLE snapshots (
    id INTEGER PRIMARY KEY,
    outcome TEXT NOT NULL CHECK (outcome IN ('running', 'completed', 'aborted')),
    abort_reason TEXT NOT NULL DEFAULT '',
    abort_kind TEXT NOT NULL DEFAULT '',
    started_at REAL NOT NULL,
    finished_at REAL,
    processes INTEGER NOT NULL,  -- members at begin, len(snapshot.processes) once completed
    channels INTEGER NOT NULL DEFAULT 0,
    messages_in_flight INTEGER NOT NULL DEFAULT 0,
    snapshot BLOB,  -- GlobalSnapshot, set once completed
    evaluation BLOB,  -- Evaluation without its results (they are rows of results), set once completed
    archived INTEGER NOT NULL DEFAULT 0  -- 1: written to the Parquet archive, 2: set aside (it cannot be)
);
CREATE INDEX snapshots_by_outcome ON snapshots (outcome, id);
CREATE INDEX snapshots_unarchived ON snapshots (archived, id);
CREATE INDEX snapshots_by_finished ON snapshots (finished_at);
CREATE TABLE results (
    snapshot_id INTEGER NOT NULL REFERENCES snapshots (id) ON DELETE CASCADE,
    position INTEGER NOT NULL,  -- order of the results as evaluated
    name TEXT NOT NULL,
    holds INTEGER NOT NULL,
    unknown INTEGER NOT NULL DEFAULT 0,
    result BLOB NOT NULL,  -- PredicateResult
    PRIMARY KEY (snapshot_id, position)
) WITHOUT ROWID;
CREATE INDEX results_by_name ON results (name, snapshot_id);
CREATE TABLE expected_totals (
    counter TEXT PRIMARY KEY,
    total INTEGER NOT NULL  -- a conservation baseline, taken from the first closed cut to see the counter
) WITHOUT ROWID;
CREATE TABLE resolutions (
    id INTEGER PRIMARY KEY AUTOINCREMENT,  -- the break id: never reused, even after retention
    snapshot_id INTEGER NOT NULL,  -- the snapshot that proved the deadlock (kept after its row is gone)
    sent_at REAL NOT NULL,
    resolution BLOB NOT NULL  -- Resolution, rewritten when the agent answers
);
"""

_OUTCOMES: dict[str, SnapshotOutcome] = {
    "running": SNAPSHOT_OUTCOME_RUNNING,
    "completed": SNAPSHOT_OUTCOME_COMPLETED,
    "aborted": SNAPSHOT_OUTCOME_ABORTED,
}

_SUMMARY_COLUMNS = (
    "id, outcome, abort_reason, started_at, finished_at, processes, channels, messages_in_flight, abort_kind"
)


class StoreError(Exception):
    """The store cannot be opened or used: unwritable path, foreign or newer file. Names the file."""


def _timestamp(seconds: float) -> Timestamp:
    ts = Timestamp()
    ts.FromNanoseconds(round(seconds * 1e9))
    return ts


def _summary(row: tuple) -> SnapshotSummary:
    snapshot_id, outcome, reason, started_at, finished_at, processes, channels, in_flight, kind = row
    summary = SnapshotSummary(
        snapshot_id=snapshot_id,
        outcome=_OUTCOMES[outcome],
        abort_reason=reason,
        abort_kind=kind,
        started_at=_timestamp(started_at),
        processes=processes,
        channels=channels,
        messages_in_flight=in_flight,
    )
    if finished_at is not None:
        summary.finished_at.CopyFrom(_timestamp(finished_at))
    return summary


def _new_epoch() -> int:
    """A random, non-zero epoch that fits an SQLite integer."""
    return secrets.randbelow(_MAX_ID) + 1


def _check_id(snapshot_id: int) -> None:
    if not 1 <= snapshot_id <= _MAX_ID:
        raise ValueError(f"snapshot id {snapshot_id} is out of range 1..{_MAX_ID}")


def _check_time(name: str, seconds: float) -> None:
    if not math.isfinite(seconds):
        raise ValueError(f"{name} must be a finite number of unix seconds, not {seconds!r}")


class Store:
    """Snapshot outcomes, global snapshots and their evaluations, kept in ``data_dir``.

    Not thread-safe: use it from one thread (the detector's event loop). With ``lock`` (the
    default) it holds the data directory's lock until :meth:`close`; a reader that only looks
    (``stablewatch archive export``) may pass ``lock=False``, and can then run beside a live detector.
    """

    def __init__(
        self,
        data_dir: Path,
        *,
        max_snapshots: int | None = 10_000,
        max_age_seconds: float | None = 7 * 86400,
        lock: bool = True,
    ) -> None:
        if max_snapshots is not None and max_snapshots < 0:
            raise ValueError(f"max_snapshots must be >= 0 or None, not {max_snapshots}")
        if max_age_seconds is not None and not (max_age_seconds >= 0 and math.isfinite(max_age_seconds)):
            raise ValueError(f"max_age_seconds must be >= 0 or None, not {max_age_seconds}")
        self.max_snapshots = max_snapshots
        self.max_age_seconds = max_age_seconds
        self.path = Path(data_dir) / DB_FILENAME
        try:
            Path(data_dir).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot create the data directory {data_dir}: {exc.strerror or exc}") from exc
        self._lock_fd = self._take_lock(Path(data_dir)) if lock else None
        try:
            self._db = sqlite3.connect(self.path, isolation_level=None)
        except sqlite3.Error as exc:
            self._release_lock()
            raise self._open_error(exc) from exc
        try:
            self._prepare()
        except BaseException as exc:
            self._db.close()
            self._release_lock()
            if isinstance(exc, sqlite3.Error):
                raise self._open_error(exc) from exc
            raise

    @staticmethod
    def _take_lock(data_dir: Path) -> int:
        """Lock the data directory for this process; StoreError naming the holder if another has it."""
        path = data_dir / LOCK_FILENAME
        try:
            return lockfile.take(path)
        except lockfile.Held as held:
            raise StoreError(
                f"the data directory {data_dir} is in use by another detector (pid {held.holder}); "
                "stop it, or give this one another --data-dir"
            ) from None
        except OSError as exc:
            raise StoreError(f"cannot create or lock the lock file {path}: {exc.strerror or exc}") from exc

    def _release_lock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the descriptor releases the flock
            self._lock_fd = None

    def _open_error(self, exc: sqlite3.Error) -> StoreError:
        hint = ""
        if getattr(exc, "sqlite_errorname", "").startswith(("SQLITE_CANTOPEN", "SQLITE_READONLY", "SQLITE_PERM")):
            hint = " (the data directory and the file must be writable by the detector)"
        return StoreError(f"cannot open the store {self.path}: {exc}{hint}")

    # -- opening ----------------------------------------------------------------------------------

    def _prepare(self) -> None:
        """Check or create the schema, and abort the snapshots a previous process left running."""
        db = self._db
        db.execute(f"PRAGMA busy_timeout = {_BUSY_TIMEOUT_MS}")
        version = self._schema_version()  # read before writing anything: a newer file stays untouched
        if version is not None and version > SCHEMA_VERSION:
            raise StoreError(
                f"the store {self.path} has schema version {version}, newer than this stablewatch "
                f"supports ({SCHEMA_VERSION}); upgrade stablewatch or use another data directory"
            )
        if version is not None and version < SCHEMA_VERSION and self._lock_fd is None:
            # Upgrading under a live older detector would leave it a store it cannot open.
            if version < _LOOK_ONLY_FROM:
                raise StoreError(
                    f"the store {self.path} has schema version {version}, older than this stablewatch's "
                    f"({SCHEMA_VERSION}), and a reader that only looks does not upgrade it: open it with "
                    "the detector first (stablewatch detector --data-dir ...), which upgrades it"
                )
            self.schema_version = version
            (epoch,) = db.execute("SELECT value FROM meta WHERE key = 'epoch'").fetchone()
            self.epoch = int(epoch)
            return
        #: The schema of the file as it is read: :data:`SCHEMA_VERSION` unless a look-only reader opened an older one.
        self.schema_version: int = SCHEMA_VERSION
        db.execute("PRAGMA foreign_keys = ON")
        db.execute("PRAGMA journal_mode = WAL")
        db.execute("PRAGMA synchronous = NORMAL")
        with self._write():
            version = self._schema_version()
            if version is None:
                for statement in _SCHEMA.split(";"):
                    if statement.strip():
                        db.execute(statement)
                db.executemany(
                    "INSERT INTO meta (key, value) VALUES (?, ?)",
                    [("schema_version", SCHEMA_VERSION), ("last_id", 0), ("epoch", _new_epoch())],
                )
            elif version < SCHEMA_VERSION:
                try:
                    migration.upgrade(db, version, SCHEMA_VERSION, _new_epoch())
                except ValueError as exc:  # rolled back with the transaction; names the snapshot
                    raise StoreError(f"cannot upgrade the store {self.path}: {exc}") from None
            if self._lock_fd is not None:  # without the lock, RUNNING rows may be a live detector's
                db.execute(
                    "UPDATE snapshots SET outcome = 'aborted', abort_reason = ?, abort_kind = 'restart', "
                    "finished_at = ? WHERE outcome = 'running'",
                    (RESTART_REASON, time.time()),
                )
        (epoch,) = db.execute("SELECT value FROM meta WHERE key = 'epoch'").fetchone()
        self.epoch: int = int(epoch)

    def _schema_version(self) -> int | None:
        """The file's schema version; None for an empty file; StoreError for a file that is not ours."""
        tables = {name for (name,) in self._db.execute("SELECT name FROM sqlite_schema WHERE type = 'table'")}
        if not tables:
            return None
        row = None
        if "meta" in tables:
            row = self._db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        if row is None:
            raise StoreError(f"{self.path} is an SQLite database but not a stablewatch store (no schema version)")
        return int(row[0])

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction: everything inside commits together or not at all."""
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield self._db
            self._db.execute("COMMIT")
        except BaseException:
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
            raise

    # -- writing ----------------------------------------------------------------------------------

    def allocate_id(self, now: float, space: int = 0) -> int:
        """A new snapshot id of id space `space` (the detector's replica): `now` in microseconds, or
        above every id handed out before (also by earlier processes) if that is larger; persisted now."""
        _check_time("now", now)
        problem = space_problem(space)
        if problem is not None:
            raise ValueError(problem)
        with self._write() as db:
            (last,) = db.execute("SELECT value FROM meta WHERE key = 'last_id'").fetchone()
            snapshot_id = next_id(int(last), min(int(now * 1_000_000), _MAX_ID), space)
            if snapshot_id > _MAX_ID:
                raise StoreError(f"{self.path}: snapshot ids are exhausted (the last one is {last})")
            db.execute("UPDATE meta SET value = ? WHERE key = 'last_id'", (snapshot_id,))
        return snapshot_id

    def begin(self, snapshot_id: int, started_at: float, members: int) -> None:
        """Record that snapshot `snapshot_id` started at `started_at` with `members` processes (RUNNING)."""
        _check_id(snapshot_id)
        _check_time("started_at", started_at)
        if members < 0:
            raise ValueError(f"members must be >= 0, not {members}")
        with self._write() as db:
            if db.execute("SELECT 1 FROM snapshots WHERE id = ?", (snapshot_id,)).fetchone():
                raise ValueError(f"snapshot {snapshot_id} already exists in {self.path}")
            db.execute(
                "INSERT INTO snapshots (id, outcome, started_at, processes) VALUES (?, 'running', ?, ?)",
                (snapshot_id, started_at, members),
            )
            db.execute("UPDATE meta SET value = max(value, ?) WHERE key = 'last_id'", (snapshot_id,))

    def complete(self, snapshot: GlobalSnapshot, evaluation: Evaluation, finished_at: float) -> SnapshotResults:
        """Store the completed `snapshot` and its `evaluation`; return its results with their summary.

        Raises KeyError for an id never begun, ValueError for one that is no longer RUNNING or
        for an evaluation of another snapshot.
        """
        snapshot_id = snapshot.snapshot_id
        if evaluation.snapshot_id != snapshot_id:
            raise ValueError(f"the evaluation of snapshot {evaluation.snapshot_id} is not of snapshot {snapshot_id}")
        _check_time("finished_at", finished_at)
        in_flight = sum(len(channel.messages) for channel in snapshot.channels)
        blob = snapshot.SerializeToString(deterministic=True)
        rest = Evaluation(snapshot_id=snapshot_id, wait_for=evaluation.wait_for, coverage=evaluation.coverage)
        rows = [
            (snapshot_id, position, r.name, r.holds, r.unknown, r.SerializeToString(deterministic=True))
            for position, r in enumerate(evaluation.results)
        ]
        with self._write() as db:
            self._require_running(snapshot_id, "complete")
            db.execute(
                "UPDATE snapshots SET outcome = 'completed', finished_at = ?, processes = ?, channels = ?, "
                "messages_in_flight = ?, snapshot = ?, evaluation = ? WHERE id = ?",
                (
                    finished_at,
                    len(snapshot.processes),
                    len(snapshot.channels),
                    in_flight,
                    blob,
                    rest.SerializeToString(deterministic=True),
                    snapshot_id,
                ),
            )
            db.executemany(
                "INSERT INTO results (snapshot_id, position, name, holds, unknown, result) VALUES (?, ?, ?, ?, ?, ?)",
                rows,
            )
            summary = self._summary_row(snapshot_id)
        return SnapshotResults(snapshot=_summary(summary), results=evaluation.results)

    def abort(self, snapshot_id: int, reason: str, finished_at: float, kind: str = "") -> SnapshotSummary:
        """Mark RUNNING snapshot `snapshot_id` ABORTED for `reason` (of bounded `kind`); return its summary.

        Raises KeyError for an id never begun, ValueError for one that is no longer RUNNING.
        """
        _check_time("finished_at", finished_at)
        with self._write() as db:
            self._require_running(snapshot_id, "abort")
            db.execute(
                "UPDATE snapshots SET outcome = 'aborted', abort_reason = ?, abort_kind = ?, finished_at = ? "
                "WHERE id = ?",
                (reason, kind, finished_at, snapshot_id),
            )
            row = self._summary_row(snapshot_id)
        return _summary(row)

    def expected_totals(self) -> dict[str, int]:
        """The conservation baselines kept so far (counter -> expected total)."""
        return {name: int(total) for name, total in self._db.execute("SELECT counter, total FROM expected_totals")}

    def add_expected_totals(self, totals: Mapping[str, int]) -> None:
        """Keep new conservation baselines; a counter that already has one keeps it."""
        if totals:
            with self._write() as db:
                db.executemany(
                    "INSERT OR IGNORE INTO expected_totals (counter, total) VALUES (?, ?)", sorted(totals.items())
                )

    def mark_archived(self, snapshot_ids: Sequence[int]) -> None:
        """Record that these finished snapshots are in the Parquet archive."""
        with self._write() as db:
            db.executemany("UPDATE snapshots SET archived = 1 WHERE id = ?", [(i,) for i in snapshot_ids])

    def set_aside(self, snapshot_ids: Sequence[int]) -> None:
        """Record that these finished snapshots cannot be archived: :meth:`unarchived` no longer offers them."""
        with self._write() as db:
            db.executemany("UPDATE snapshots SET archived = ? WHERE id = ?", [(_SET_ASIDE, i) for i in snapshot_ids])

    def unarchived(self, limit: int, after_id: int = 0) -> list[int]:
        """Up to `limit` ids of finished snapshots not yet archived, above `after_id`, oldest first."""
        rows = self._db.execute(
            "SELECT id FROM snapshots WHERE archived = 0 AND outcome != 'running' AND id > ? ORDER BY id LIMIT ?",
            (min(after_id, _MAX_ID), limit),
        )
        return [int(i) for (i,) in rows]

    def add_resolution(self, resolution: Resolution) -> Resolution:
        """Store a break as it is sent; returns it with its new ``resolution_id`` (the break id)."""
        sent_at = resolution.sent_at.ToMicroseconds() / 1e6
        with self._write() as db:
            cursor = db.execute(
                "INSERT INTO resolutions (snapshot_id, sent_at, resolution) VALUES (?, ?, x'')",
                (resolution.snapshot_id, sent_at),
            )
            stored = Resolution()
            stored.CopyFrom(resolution)
            stored.resolution_id = int(cursor.lastrowid)
            db.execute(
                "UPDATE resolutions SET resolution = ? WHERE id = ?",
                (stored.SerializeToString(deterministic=True), stored.resolution_id),
            )
        return stored

    def update_resolution(self, resolution: Resolution) -> None:
        """Store what became of a break (its report, or that none came)."""
        with self._write() as db:
            updated = db.execute(
                "UPDATE resolutions SET resolution = ? WHERE id = ?",
                (resolution.SerializeToString(deterministic=True), resolution.resolution_id),
            ).rowcount
        if not updated:
            raise StoreError(f"no resolution {resolution.resolution_id} to update")

    def resolution(self, resolution_id: int) -> Resolution | None:
        """One stored break, or None."""
        if self.schema_version < 3:  # an older file, opened to look: it has no breaks
            return None
        row = self._db.execute("SELECT resolution FROM resolutions WHERE id = ?", (resolution_id,)).fetchone()
        return None if row is None else Resolution.FromString(row[0])

    def resolutions(self, page_size: int, before_id: int | None = None) -> list[Resolution]:
        """Breaks newest first, at most ``page_size``, with ids below ``before_id`` when given."""
        if self.schema_version < 3:  # an older file, opened to look: it has no breaks
            return []
        rows = self._db.execute(
            "SELECT resolution FROM resolutions WHERE id < ? ORDER BY id DESC LIMIT ?",
            (_MAX_ID if before_id is None else before_id, page_size),
        ).fetchall()
        return [Resolution.FromString(blob) for (blob,) in rows]

    def _require_running(self, snapshot_id: int, action: str) -> None:
        row = None
        if snapshot_id <= _MAX_ID:
            row = self._db.execute("SELECT outcome FROM snapshots WHERE id = ?", (snapshot_id,)).fetchone()
        if row is None:
            raise KeyError(f"cannot {action} snapshot {snapshot_id}: it was never begun (or was deleted by retention)")
        if row[0] != "running":
            raise ValueError(f"cannot {action} snapshot {snapshot_id}: it is already {row[0]}")

    def apply_retention(self, now: float, *, keep_unarchived: bool = False) -> int:
        """Delete finished snapshots beyond ``max_snapshots`` (oldest first) or that finished more than
        ``max_age_seconds`` before `now`; return how many were deleted. RUNNING rows stay; ids are not reused.

        With `keep_unarchived` (an archive is configured) snapshots not archived yet, and the breaks,
        are kept up to :data:`UNARCHIVED_SLACK` times those bounds; what is deleted past that unarchived
        is logged as a WARNING (how many, which ids).
        """
        _check_time("now", now)
        deleted = 0
        lost: list[tuple[int, int, int]] = []  # (how many, first id, last id) deleted unarchived
        spare = " AND archived != 0" if keep_unarchived else ""
        slack = UNARCHIVED_SLACK if keep_unarchived else 1
        with self._write() as db:
            if self.max_age_seconds is not None:
                deleted += db.execute(
                    f"DELETE FROM snapshots WHERE outcome != 'running' AND finished_at < ?{spare}",
                    (now - self.max_age_seconds,),
                ).rowcount
                if keep_unarchived:
                    deleted += self._delete_unarchived("finished_at < ?", (now - slack * self.max_age_seconds,), lost)
                db.execute("DELETE FROM resolutions WHERE sent_at < ?", (now - slack * self.max_age_seconds,))
            if self.max_snapshots is not None:
                # Every row counts towards the bound; only finished ones can be deleted to meet it.
                beyond = "id <= (SELECT id FROM snapshots ORDER BY id DESC LIMIT 1 OFFSET ?)"
                deleted += db.execute(
                    f"DELETE FROM snapshots WHERE outcome != 'running' AND {beyond}{spare}", (self.max_snapshots,)
                ).rowcount
                if keep_unarchived:
                    deleted += self._delete_unarchived(beyond, (slack * self.max_snapshots,), lost)
        for count, first, last in lost:
            # Not "lost": the store cannot tell whether the archive writer still holds them in memory
            # (its batch of up to --archive-batch, written right after); only if that write fails are they.
            _log.warning(
                "%s: %d finished snapshots were not archived yet when retention deleted them (ids %d to %d), "
                "past %d times the retention bound: the archive writer may still write them from memory; if "
                "it fails to, they are lost to the archive",
                self.path, count, first, last, slack,
            )  # fmt: skip
        if deleted:
            _log.debug("%s: retention deleted %d finished snapshots", self.path, deleted)
        return deleted

    def _delete_unarchived(self, condition: str, params: tuple, lost: list[tuple[int, int, int]]) -> int:
        """Delete the finished, unarchived snapshots meeting `condition`; note how many and which in `lost`."""
        where = f"outcome != 'running' AND archived = 0 AND {condition}"
        count, first, last = self._db.execute(
            f"SELECT count(*), min(id), max(id) FROM snapshots WHERE {where}", params
        ).fetchone()
        if count:
            self._db.execute(f"DELETE FROM snapshots WHERE {where}", params)
            lost.append((int(count), int(first), int(last)))
        return int(count)

    # -- reading ----------------------------------------------------------------------------------

    def _summary_row(self, snapshot_id: int) -> tuple | None:
        if snapshot_id > _MAX_ID:  # a uint64 id no row can have
            return None
        return self._db.execute(f"SELECT {_SUMMARY_COLUMNS} FROM snapshots WHERE id = ?", (snapshot_id,)).fetchone()

    def _results_of(self, summary: SnapshotSummary) -> SnapshotResults:
        blobs = self._db.execute(
            "SELECT result FROM results WHERE snapshot_id = ? ORDER BY position", (summary.snapshot_id,)
        )
        return SnapshotResults(snapshot=summary, results=[PredicateResult.FromString(blob) for (blob,) in blobs])

    def summary(self, snapshot_id: int) -> SnapshotSummary | None:
        """The summary of snapshot `snapshot_id` in any outcome, or None if the store does not hold it."""
        row = self._summary_row(snapshot_id)
        return None if row is None else _summary(row)

    def results(self, snapshot_id: int) -> SnapshotResults | None:
        """Summary and predicate results of `snapshot_id` (no results unless completed), or None."""
        summary = self.summary(snapshot_id)
        return None if summary is None else self._results_of(summary)

    def evaluation(self, snapshot_id: int) -> Evaluation | None:
        """The stored evaluation of completed snapshot `snapshot_id` (results, wait-for graph, coverage), or None."""
        if snapshot_id > _MAX_ID:
            return None
        row = self._db.execute(
            "SELECT evaluation FROM snapshots WHERE id = ? AND outcome = 'completed'", (snapshot_id,)
        ).fetchone()
        if row is None:
            return None
        evaluation = Evaluation.FromString(row[0])
        evaluation.results.extend(self._results_of(self.summary(snapshot_id)).results)
        return evaluation

    def wait_for_graph(self, snapshot_id: int) -> WaitForGraph | None:
        """The stored wait-for graph (with its deadlock evidence) of completed snapshot `snapshot_id`, or None."""
        evaluation = self.evaluation(snapshot_id)
        return None if evaluation is None else evaluation.wait_for

    def snapshot(self, snapshot_id: int) -> GlobalSnapshot | None:
        """The global snapshot `snapshot_id` if it completed and is still held, else None."""
        if snapshot_id > _MAX_ID:
            return None
        row = self._db.execute(
            "SELECT snapshot FROM snapshots WHERE id = ? AND outcome = 'completed'", (snapshot_id,)
        ).fetchone()
        return None if row is None else GlobalSnapshot.FromString(row[0])

    def latest_results(self) -> SnapshotResults | None:
        """Summary and results of the newest COMPLETED snapshot, or None if there is none."""
        row = self._db.execute(
            f"SELECT {_SUMMARY_COLUMNS} FROM snapshots WHERE outcome = 'completed' ORDER BY id DESC LIMIT 1"
        ).fetchone()
        return None if row is None else self._results_of(_summary(row))

    def list(self, page_size: int, before_id: int | None = None) -> list[SnapshotSummary]:
        """Up to `page_size` summaries, newest first, of snapshots with an id below `before_id` (if given).

        For the next page pass the last id returned as `before_id`.
        """
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, not {page_size}")
        # Every id is at most _MAX_ID, and a larger before_id cannot be bound as an SQLite integer.
        below = "id <= ?" if before_id is None or before_id > _MAX_ID else "id < ?"
        before = _MAX_ID if before_id is None else min(before_id, _MAX_ID)
        rows = self._db.execute(
            f"SELECT {_SUMMARY_COLUMNS} FROM snapshots WHERE {below} ORDER BY id DESC LIMIT ?", (before, page_size)
        )
        return [_summary(row) for row in rows]

    def predicate_history(self, name: str, limit: int) -> list[tuple[int, bool | None]]:
        """``(snapshot_id, holds)`` of predicate `name` in up to `limit` completed snapshots, newest
        first; ``holds`` is None where the result was unknown (not False: the cut did not say)."""
        if limit < 0:
            raise ValueError(f"limit must be >= 0, not {limit}")
        rows = self._db.execute(
            "SELECT snapshot_id, holds, unknown FROM results WHERE name = ? "
            "ORDER BY snapshot_id DESC, position DESC LIMIT ?",
            (name, limit),
        )
        return [(int(snapshot_id), None if unknown else bool(holds)) for snapshot_id, holds, unknown in rows]

    # -- closing ----------------------------------------------------------------------------------

    def close(self) -> None:
        """Close the database and release the data directory; further calls fail. Closing twice is harmless."""
        self._db.close()
        self._release_lock()

    def __enter__(self) -> Store:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
