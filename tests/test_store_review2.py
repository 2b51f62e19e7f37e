"""Persistence, a second review: export past an unfit snapshot, a baseline the store fails to keep,
and what retention says of the unarchived snapshots it deletes.

* ``archive export`` sets aside a snapshot the archive cannot hold (a NaN attribute), as the
  detector's writer does: it is logged with its id and why, counted, and every other snapshot is
  exported (before, it failed the batch on every run and nothing after it was ever exported).
* A baseline the store fails to keep (a full disk) records the completed snapshot aborted
  (``store_error``), not RUNNING, and the detector does not keep that baseline in memory only.
* Retention past its bound says the snapshots were not archived yet when it deleted them, at
  WARNING: the archive writer may still hold them in memory and write them, as it does here.
"""

from __future__ import annotations

import json
import logging
import sqlite3
from pathlib import Path

import pytest
from samples import evaluation, global_snapshot, predicate_results
from test_store_review import T0, complete, disk_full, nan_attribute, one_member_detector

from polling import run
from stablewatch.cli.main import main
from stablewatch.detector.archive.export import export
from stablewatch.detector.archive.files import ensure_archive
from stablewatch.detector.archive.reader import read_snapshots
from stablewatch.detector.archive.writer import ArchiveWriter
from stablewatch.detector.service.store import Store
from stablewatch.v1 import GlobalSnapshot
from stablewatch.v1.query_pb2 import SNAPSHOT_OUTCOME_ABORTED, SNAPSHOT_OUTCOME_COMPLETED

pytestmark = pytest.mark.timeout(60)


def archived(root: Path) -> set[int]:
    return {row["snapshot_id"] for row, _ in read_snapshots(root)}


# -- 1. export sets aside what the archive cannot hold ------------------------------------------------


def test_export_sets_aside_a_snapshot_the_archive_cannot_hold_and_exports_the_rest(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = ensure_archive(tmp_path / "archive")
    with Store(tmp_path / "data", max_snapshots=None, max_age_seconds=None) as store:
        unfit = complete(store, T0, nan_attribute)
        good = [complete(store, T0 + i) for i in range(1, 4)]
        with caplog.at_level(logging.ERROR, logger="stablewatch.detector.archive.export"):
            result = export(store, root, batch_size=2)  # the unfit one shares its batch with a good one
        assert (result.exported, result.set_aside, result.already, result.batches) == (3, 1, 0, 2)
        assert archived(root) == set(good)
        [said] = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert f"snapshot {unfit} cannot be archived" in said and "set aside, not exported" in said
        again = export(store, root)  # idempotent: nothing new, the unfit one set aside again
        assert (again.exported, again.set_aside, again.already) == (0, 1, 3)


def test_the_export_command_says_how_many_snapshots_it_set_aside(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with Store(tmp_path / "data", max_snapshots=None, max_age_seconds=None) as store:
        complete(store, T0, nan_attribute)
        good = complete(store, T0 + 1)
    root = tmp_path / "archive"
    argv = ["archive", "export", "--data-dir", str(tmp_path / "data"), "--archive", str(root)]
    assert main([*argv, "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert (found["exported"], found["set_aside"]) == (1, 1)
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "exported 0 snapshots" in out and "1 snapshot the archive cannot hold set aside" in out
    assert archived(root) == {good}


# -- 2. a baseline the store fails to keep ------------------------------------------------------------


def test_a_baseline_the_store_fails_to_keep_records_the_snapshot_aborted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def closed(snapshot_id: int) -> GlobalSnapshot:
        snap = global_snapshot(snapshot_id)
        del snap.channels[2]  # a closed cut: it sets the baseline of tokens
        return snap

    async def scenario() -> None:
        async with one_member_detector(tmp_path, monkeypatch, closed) as (detector, taken):
            with monkeypatch.context() as patch:
                patch.setattr(detector.store, "add_expected_totals", disk_full)
                with pytest.raises(sqlite3.OperationalError):
                    await detector.take_snapshot()
            summary = detector.store.summary(taken[0])
            assert summary is not None
            assert (summary.outcome, summary.abort_kind) == (SNAPSHOT_OUTCOME_ABORTED, "store_error")
            assert detector._expected_totals == detector.store.expected_totals() == {}  # not in memory only
            await detector.take_snapshot()  # the disk has room again: the baseline is kept, in both
            assert detector.store.summary(taken[1]).outcome == SNAPSHOT_OUTCOME_COMPLETED  # type: ignore[union-attr]
            assert detector._expected_totals == detector.store.expected_totals() != {}

    run(scenario())


# -- 3. what retention says of unarchived snapshots ---------------------------------------------------


def test_retention_past_its_bound_says_not_archived_yet_at_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with Store(tmp_path / "data", max_snapshots=1, max_age_seconds=None) as store:
        ids = [complete(store, T0 + i) for i in range(15)]
        with caplog.at_level(logging.WARNING):
            assert store.apply_retention(T0 + 100, keep_unarchived=True) == 5  # ten times one are kept
    [said] = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert said.levelno == logging.WARNING
    assert f"5 finished snapshots were not archived yet when retention deleted them (ids {ids[0]} to {ids[4]})" in (
        said.getMessage()
    )


def test_no_loss_is_logged_for_snapshots_the_writer_holds_and_archives(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario() -> list[int]:
        ids = []
        with Store(tmp_path / "data", max_snapshots=1, max_age_seconds=None) as store:
            writer = ArchiveWriter(tmp_path / "archive", store, batch_size=500, max_age=300.0)
            await writer.start()
            for i in range(15):
                sid = store.allocate_id(0)
                store.begin(sid, T0 + i, members=2)
                snap = global_snapshot(sid)
                ev = evaluation(sid, predicate_results())
                results = store.complete(snap, ev, T0 + i + 1)
                writer.add(results.snapshot, snap, ev)  # as the detector's _finished does
                ids.append(sid)
            with caplog.at_level(logging.WARNING):
                store.apply_retention(T0 + 100, keep_unarchived=True)  # the writer holds all 15 in memory
            await writer.close()
        return ids

    ids = run(scenario())
    assert set(ids) <= archived(tmp_path / "archive")  # every snapshot is archived: nothing was lost
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == [], said
    assert len(said) == 1 and "never archived" not in said[0] and "may still write them" in said[0]
