"""From a review (read only) of the Spark pipeline against the detector's own results.

* A range of ids or days took its conservation baselines from inside the range: the first
  snapshot in it set a new one, and a loss before it was reported as conserved where the
  detector had said violated. A range now also takes the baselines the detector took (its archived
  results) on the snapshots it leaves out.
* A snapshot archived twice (an archive copied in twice, overlapping exports) was evaluated and
  counted twice without a word; the archive's own reader calls that an error, and so does the
  pipeline now, naming the snapshot and its files.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from snapshot_gen import Archived, summary_of, write_archive

from stablewatch.detector.archive.files import ensure_archive, write_batch
from stablewatch.detector.archive.schema import ArchiveError, snapshot_rows
from stablewatch.detector.evaluation import evaluate, new_baselines
from stablewatch.pipeline.evaluate import EVALUATIONS, evaluate_archive
from stablewatch.pipeline.history import run_history
from stablewatch.pipeline.tables import Archive, open_archive
from stablewatch.v1 import Evaluation, GlobalSnapshot, LocalState, ProcessSnapshot

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
CONSERVATION = 2  # the position of conservation(tokens) among each snapshot's results


def closed(snapshot_id: int, started: datetime, tokens: int) -> GlobalSnapshot:
    """A closed cut of two passive processes holding `tokens` between them."""
    snapshot = GlobalSnapshot(snapshot_id=snapshot_id, expected_members=["P0", "P1"])
    snapshot.started_at.FromDatetime(started)
    snapshot.completed_at.FromDatetime(started + timedelta(milliseconds=300))
    for pid, held in (("P0", tokens // 2), ("P1", tokens - tokens // 2)):
        state = LocalState()
        state.counters["tokens"] = held
        snapshot.processes.append(ProcessSnapshot(process_id=pid, state=state))
    return snapshot


def as_the_detector(snapshots: list[GlobalSnapshot]) -> dict[int, Evaluation]:
    """Each snapshot's evaluation as one detector makes it, baselines carried in finish order."""
    totals: dict[str, int] = {}
    evaluations = {}
    for snapshot in snapshots:
        evaluations[snapshot.snapshot_id] = evaluation = evaluate(snapshot, totals)
        totals.update(new_baselines(evaluation))
    return evaluations


def conservation_verdicts(archive: Archive, **options: Any) -> dict[int, tuple[bool, bool]]:
    rows = evaluate_archive(archive, **options).evaluations.toArrow().cast(EVALUATIONS).to_pylist()
    return {row["snapshot_id"]: (row["holds"], row["unknown"]) for row in rows if row["position"] == CONSERVATION}


def test_a_range_after_the_baseline_keeps_the_detectors_verdict(spark: Any, tmp_path: Path) -> None:
    # 10 tokens on day 1, 8 on days 2 and 3: the detector says conservation(tokens) is violated
    # on snapshots 2 and 3, against the baseline that snapshot 1 set.
    snapshots = [closed(1, T0, 10), closed(2, T0 + timedelta(days=1), 8), closed(3, T0 + timedelta(days=2), 8)]
    evaluations = as_the_detector(snapshots)
    said = {sid: (e.results[CONSERVATION].holds, e.results[CONSERVATION].unknown) for sid, e in evaluations.items()}
    assert said == {1: (True, False), 2: (False, False), 3: (False, False)}
    root = write_archive(tmp_path / "a", [Archived(summary_of(s), s) for s in snapshots], 1, evaluations)
    in_range = {2: said[2], 3: said[3]}
    assert conservation_verdicts(open_archive(spark, root), first_id=2) == in_range
    assert conservation_verdicts(open_archive(spark, root, "2026-03-02", None)) == in_range
    assert conservation_verdicts(open_archive(spark, root)) == said  # the whole archive, as before
    # history over a range of days says the same (it evaluates through the same function).
    history = run_history(root, tmp_path / "out", first_day="2026-03-02", chart=False, spark=spark)
    [summary] = history.tables["conservation_summary"].to_pylist()
    assert (summary["counter"], summary["snapshots"], summary["held"]) == ("tokens", 2, 0)


def test_an_archive_begun_after_the_detectors_baseline_keeps_its_verdicts(spark: Any, tmp_path: Path) -> None:
    # From the review of the predicates (a suspicion, now checked): the detector took its baseline
    # (10) on snapshot 1, before its archive began; the archive holds snapshots 2 and 3 (8 tokens),
    # which the detector said violated. Without a range the pipeline took snapshot 2 as its
    # baseline and said conserved. The detector's results in the archive say what it compared with.
    snapshots = [closed(1, T0, 10), closed(2, T0 + timedelta(days=1), 8), closed(3, T0 + timedelta(days=2), 8)]
    evaluations = as_the_detector(snapshots)
    archived = [Archived(summary_of(s), s) for s in snapshots[1:]]
    root = write_archive(tmp_path / "a", archived, 1, {sid: evaluations[sid] for sid in (2, 3)})
    assert conservation_verdicts(open_archive(spark, root)) == {2: (False, False), 3: (False, False)}
    # A counter zeroed out: the expected total 0 is left out of the evidence's JSON, and still read.
    zero = [closed(1, T0, 0), closed(2, T0 + timedelta(days=1), 2)]
    evaluations = as_the_detector(zero)
    root = write_archive(tmp_path / "z", [Archived(summary_of(zero[1]), zero[1])], 1, {2: evaluations[2]})
    assert conservation_verdicts(open_archive(spark, root)) == {2: (False, False)}


def test_a_snapshot_archived_twice_is_refused_naming_it_and_its_files(spark: Any, tmp_path: Path) -> None:
    # Snapshot 2 is in two batches: its results would count twice in every total.
    snapshots = [closed(i, T0 + timedelta(minutes=i), 10) for i in (1, 2, 3)]
    root = ensure_archive(tmp_path / "a")
    written = []
    for batch in (snapshots[:2], snapshots[1:]):
        rows: dict[str, list[dict[str, Any]]] = {}
        for snapshot in batch:
            for table, table_rows in snapshot_rows(summary_of(snapshot), snapshot, evaluate(snapshot)).items():
                rows.setdefault(table, []).extend(table_rows)
        written += [path for path in write_batch(root, rows) if "snapshots" in path.parts]
    with pytest.raises(ArchiveError, match="snapshot 2 is archived twice") as refused:
        evaluate_archive(open_archive(spark, root))
    assert all(path.name in str(refused.value) for path in written)
    with pytest.raises(ArchiveError, match="snapshot 2 is archived twice"):
        run_history(root, tmp_path / "out", chart=False, spark=spark)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())  # nothing written
