"""From a review (read only) of the pipeline's conservation baselines against the detector's own.

* ``follow`` took its baselines from the first closed cut it saw and never read the detector's:
  on an archive begun after the detector took its baseline it said conserved where the detector
  (and ``evaluate``) said violated. Its first micro-batch now takes the detector's baselines too.
* A detector restarted on a fresh store, writing into the same archive, took a new baseline; the
  pipeline kept only each counter's first and said violated where the detector said conserved.
  Each snapshot is now compared with the latest baseline taken before it.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pyarrow.dataset as ds
from snapshot_gen import Archived, summary_of, write_archive
from test_pipeline_ranges_review import CONSERVATION, T0, as_the_detector, closed, conservation_verdicts

from stablewatch.pipeline.evaluate import Totals
from stablewatch.pipeline.follow import follow
from stablewatch.pipeline.tables import open_archive
from stablewatch.v1 import Evaluation, GlobalSnapshot


def _said(evaluations: dict[int, Evaluation]) -> dict[int, tuple[bool, bool]]:
    return {sid: (e.results[CONSERVATION].holds, e.results[CONSERVATION].unknown) for sid, e in evaluations.items()}


def _followed(spark: Any, root: Path, out: Path) -> dict[int, tuple[bool, bool]]:
    follow(root, out, once=True, spark=spark)
    rows = ds.dataset(out / "evaluations", format="parquet", partitioning="hive").to_table().to_pylist()
    return {r["snapshot_id"]: (r["holds"], r["unknown"]) for r in rows if r["position"] == CONSERVATION}


def _restarted() -> tuple[list[GlobalSnapshot], dict[int, Evaluation]]:
    """Store 1 took 10 on snapshot 1; a detector started on a fresh store (later ids) into the
    same archive, 20 tokens in the system, took 20 on snapshot 3 and said 3 and 4 conserved."""
    first = [closed(1, T0, 10), closed(2, T0 + timedelta(hours=1), 10)]
    second = [closed(3, T0 + timedelta(hours=2), 20), closed(4, T0 + timedelta(hours=3), 20)]
    return first + second, {**as_the_detector(first), **as_the_detector(second)}


def test_totals_before_takes_the_latest_baseline_set_before_the_key() -> None:
    totals = Totals({"credits": 3}, {"tokens": (((-1, -1), 10), ((50, 5), 20))})
    assert totals.before((10, 1)) == {"credits": 3, "tokens": 10}
    assert totals.before((50, 5)) == {"credits": 3}  # the snapshot that took 20 had none
    assert totals.before((60, 6)) == {"credits": 3, "tokens": 20}
    assert totals.latest() == {"tokens": 20}


def test_follow_keeps_the_detectors_verdict_on_an_archive_begun_after_its_baseline(spark: Any, tmp_path: Path) -> None:
    # The detector took 10 on snapshot 1, before its archive began, and said 2 and 3 (8 tokens)
    # violated; follow took its baseline from the first closed cut it saw (8: conserved).
    snapshots = [closed(1, T0, 10), closed(2, T0 + timedelta(days=1), 8), closed(3, T0 + timedelta(days=2), 8)]
    evaluations = as_the_detector(snapshots)
    archived = [Archived(summary_of(s), s) for s in snapshots[1:]]
    root = write_archive(tmp_path / "a", archived, 1, {sid: evaluations[sid] for sid in (2, 3)})
    said = {2: (False, False), 3: (False, False)}
    assert _said({sid: evaluations[sid] for sid in (2, 3)}) == said
    assert conservation_verdicts(open_archive(spark, root)) == said  # evaluate
    assert _followed(spark, root, tmp_path / "out") == said


def test_evaluate_keeps_the_verdicts_of_a_detector_started_on_a_fresh_store(spark: Any, tmp_path: Path) -> None:
    snapshots, evaluations = _restarted()
    said = _said(evaluations)
    assert said == {1: (True, False), 2: (True, False), 3: (True, False), 4: (True, False)}
    root = write_archive(tmp_path / "a", [Archived(summary_of(s), s) for s in snapshots], 1, evaluations)
    assert conservation_verdicts(open_archive(spark, root)) == said
    assert conservation_verdicts(open_archive(spark, root), first_id=4) == {4: said[4]}  # a range after both


def test_follow_keeps_the_verdicts_of_a_detector_started_on_a_fresh_store(spark: Any, tmp_path: Path) -> None:
    snapshots, evaluations = _restarted()
    root = write_archive(tmp_path / "a", [Archived(summary_of(s), s) for s in snapshots], 1, evaluations)
    assert _followed(spark, root, tmp_path / "out") == _said(evaluations)
