"""Upgrading a store written by an older stablewatch in place, one schema version at a time.

The store (:mod:`.store`) keeps its schema version in ``meta.schema_version`` and calls
:func:`upgrade` when it opens an older file, inside its write transaction: an upgrade happens
whole or not at all. Each step takes the file from one version to the next; a version without a
step is not one stablewatch ever wrote.

* 1 -> 2: new columns (``abort_kind``, the stored ``evaluation``, ``archived``,
  ``results.unknown``), a table of conservation baselines filled from the newest results, the
  store's epoch, and the stored evaluation (wait-for graph and coverage) of every completed
  snapshot, computed by :func:`~stablewatch.detector.evaluation.evaluate` as the detector would
  have; the results stay the rows they were.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from typing import TypeVar

from google.protobuf.message import DecodeError, Message

from stablewatch.detector.evaluation import evaluate
from stablewatch.v1 import Evaluation, GlobalSnapshot, PredicateResult

__all__ = ["upgrade"]

M = TypeVar("M", bound=Message)

_FROM_1 = """
ALTER TABLE snapshots ADD COLUMN abort_kind TEXT NOT NULL DEFAULT '';
ALTER TABLE snapshots ADD COLUMN evaluation BLOB;
ALTER TABLE snapshots ADD COLUMN archived INTEGER NOT NULL DEFAULT 0;
CREATE INDEX snapshots_unarchived ON snapshots (archived, id);
ALTER TABLE results ADD COLUMN unknown INTEGER NOT NULL DEFAULT 0;
CREATE TABLE expected_totals (counter TEXT PRIMARY KEY, total INTEGER NOT NULL) WITHOUT ROWID
"""


def _from_1(db: sqlite3.Connection, epoch: int) -> None:
    """Schema 1 -> 2: new columns, an epoch, and the stored evaluation of every completed snapshot."""
    for statement in _FROM_1.split(";"):
        if statement.strip():
            db.execute(statement)
    db.execute("INSERT INTO meta (key, value) VALUES ('epoch', ?)", (epoch,))
    # Baselines were read from the newest results; now they have a table of their own.
    latest = db.execute(
        "SELECT snapshot_id, result FROM results WHERE snapshot_id = (SELECT max(snapshot_id) FROM results)"
    ).fetchall()
    for snapshot_id, blob in latest:
        result = _read(PredicateResult, blob, f"a predicate result of snapshot {snapshot_id}")
        if result.WhichOneof("evidence") == "conservation":
            db.execute(
                "INSERT OR IGNORE INTO expected_totals (counter, total) VALUES (?, ?)",
                (result.conservation.counter, result.conservation.expected),
            )
    rows = db.execute("SELECT id, snapshot FROM snapshots WHERE outcome = 'completed'").fetchall()
    for snapshot_id, blob in rows:
        snapshot = _read(GlobalSnapshot, blob, f"snapshot {snapshot_id}")
        try:
            evaluated = evaluate(snapshot)
        except Exception as exc:
            raise ValueError(f"snapshot {snapshot_id} cannot be evaluated ({type(exc).__name__}: {exc})") from exc
        stored = Evaluation(snapshot_id=snapshot_id, wait_for=evaluated.wait_for, coverage=evaluated.coverage)
        db.execute(
            "UPDATE snapshots SET evaluation = ? WHERE id = ?",
            (stored.SerializeToString(deterministic=True), snapshot_id),
        )


def _read(kind: type[M], blob: bytes, what: str) -> M:
    """A stored protobuf message; ValueError naming `what` when the blob is not one."""
    try:
        return kind.FromString(blob)
    except DecodeError as exc:
        raise ValueError(f"{what} is stored as a blob that is not a {kind.__name__} ({exc})") from exc


_FROM_2 = """
CREATE TABLE resolutions (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    snapshot_id INTEGER NOT NULL,
    sent_at REAL NOT NULL,
    resolution BLOB NOT NULL
)
"""


def _from_2(db: sqlite3.Connection, epoch: int) -> None:
    """Schema 2 -> 3: an empty table of resolutions."""
    db.execute(_FROM_2)


#: The step from each older schema version to the next.
_STEPS: dict[int, Callable[[sqlite3.Connection, int], None]] = {1: _from_1, 2: _from_2}


def upgrade(db: sqlite3.Connection, version: int, to: int, epoch: int) -> None:
    """Take the store `db` from schema `version` to `to`, step by step, inside the caller's transaction.

    `epoch` is the store's new epoch, for a step that adds one. Raises ValueError, naming the
    version, for a version that no stablewatch wrote, or naming the snapshot whose stored blob
    cannot be read or evaluated.
    """
    for step in range(version, to):
        if step not in _STEPS:
            raise ValueError(f"schema version {step} is not one stablewatch wrote: there is no upgrade from it")
        _STEPS[step](db, epoch)
    db.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (to,))
