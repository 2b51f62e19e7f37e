"""Second truth review of the pipeline: follow mode, the evaluation of rows against the detector's,
and bad files outside the range a job was asked for.

What the pipeline reports must be what the detector would report on the same archived snapshots,
whichever way it reads them (a batch job, a stream taking the files a few at a time), and a bad
file must be named whichever of its reads finds it.
"""

from __future__ import annotations

import random
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from snapshot_gen import (
    START,
    Archived,
    as_version,
    detector_evaluations,
    pair_break,
    pair_deadlocked,
    random_snapshot,
    summary_of,
    write_archive,
)

from stablewatch.detector.archive.files import parquet_files
from stablewatch.detector.archive.reader import read_snapshots
from stablewatch.detector.archive.schema import METADATA_KEY, SCHEMA_VERSION, ArchiveError
from stablewatch.detector.archive.writer import write_resolution_batch
from stablewatch.pipeline.defaults import Reduction
from stablewatch.pipeline.evaluate import EVALUATIONS, evaluate_archive, order_key
from stablewatch.pipeline.follow import _whole_batches, follow
from stablewatch.pipeline.history import run_history
from stablewatch.pipeline.tables import open_archive
from stablewatch.v1 import Evaluation, GlobalSnapshot, LocalState, ProcessSnapshot

pytestmark = pytest.mark.timeout(600)

MIDNIGHT = datetime(2026, 3, 2, tzinfo=UTC)


def _closed(sid: int, started: datetime, took: timedelta, tokens: int) -> GlobalSnapshot:
    """A closed cut of two passive processes holding `tokens` between them, that took `took`."""
    snapshot = GlobalSnapshot(snapshot_id=sid, expected_members=["P0", "P1"])
    snapshot.started_at.FromDatetime(started)
    snapshot.completed_at.FromDatetime(started + took)
    for pid, held in (("P0", tokens // 2), ("P1", tokens - tokens // 2)):
        state = LocalState()
        state.counters["tokens"] = held
        snapshot.processes.append(ProcessSnapshot(process_id=pid, state=state))
    return snapshot


def _followed(out: Path) -> dict[tuple[int, int], bytes]:
    rows = ds.dataset(out / "evaluations", format="parquet", partitioning="hive").to_table().to_pylist()
    keyed = {(row["snapshot_id"], row["position"]): row["result"] for row in rows}
    assert len(keyed) == len(rows), "a result was written twice"
    return keyed


def _serialized(evaluations: dict[int, Evaluation]) -> dict[tuple[int, int], bytes]:
    return {
        (sid, position): result.SerializeToString(deterministic=True)
        for sid, evaluation in evaluations.items()
        for position, result in enumerate(evaluation.results)
    }


# -- follow: a detector batch that spans midnight is two files --------------------------------------------


def test_follow_keeps_the_detectors_baseline_when_a_batch_spanning_midnight_lands_in_two_micro_batches(
    spark: Any, tmp_path: Path
) -> None:
    # One detector batch, two snapshots: A started just before midnight and took a second; B started
    # just after midnight and finished first. The detector evaluated B first: B's closed cut set the
    # baseline (12 tokens), and A (10 tokens) violates it. The batch is two `snapshots` files, one
    # per day of start; taking one file per micro-batch must not make A the baseline instead.
    a = _closed(1, MIDNIGHT - timedelta(milliseconds=500), timedelta(seconds=1), tokens=10)
    b = _closed(2, MIDNIGHT, timedelta(milliseconds=100), tokens=12)
    items = [Archived(summary_of(s), s) for s in (a, b)]
    root, out = tmp_path / "archive", tmp_path / "out"
    write_archive(root, items, batch_size=2)
    assert len(parquet_files(root, "snapshots")) == 2
    expected = detector_evaluations(items)
    assert expected[2].results[2].conservation.baseline and not expected[1].results[2].holds

    followed = follow(root, out, once=True, max_files=1, spark=spark)
    assert followed.snapshots == 2
    assert _followed(out) == _serialized(expected)


def test_follow_evaluates_each_snapshot_once_when_a_batch_spanning_midnight_is_split(
    spark: Any, tmp_path: Path
) -> None:
    # Forty snapshots twenty seconds apart across midnight, some taking longer than the gap, in
    # batches of seven; one file per micro-batch, then whatever landed since, in two runs.
    rng = random.Random(77)
    items = []
    for n in range(40):
        started = MIDNIGHT - timedelta(minutes=6) + n * timedelta(seconds=20)
        snapshot = random_snapshot(rng, 1000 + n, started, max_millis=45_000)
        items.append(Archived(summary_of(snapshot), snapshot))
    root, out = tmp_path / "archive", tmp_path / "out"
    write_archive(root, items[:21], batch_size=7)
    follow(root, out, once=True, max_files=1, spark=spark)
    write_archive(root, items[21:], batch_size=7)
    follow(root, out, once=True, max_files=2, spark=spark)
    assert _followed(out) == _serialized(detector_evaluations(items))


# -- the evaluation from rows against the detector's, on the snapshots as archived -------------------------


def _finish(item: Archived) -> tuple[int, int]:
    return order_key(item.summary.finished_at.ToDatetime(UTC), item.summary.snapshot_id)


def _varied(seed: int, count: int) -> list[Archived]:
    """`count` random snapshots of 2 to 20 processes, a few seconds apart, some finishing after later ones."""
    rng = random.Random(seed)
    items = []
    for sid in range(1, count + 1):
        started = START + timedelta(seconds=7 * sid)
        snapshot = random_snapshot(rng, sid, started, rng.choice([2, 3, 5, 8, 12, 20]), rng.choice([50, 20_000]))
        items.append(Archived(summary_of(snapshot), snapshot))
    return items


@pytest.mark.parametrize("version", [3, 2, 1])
@pytest.mark.parametrize("seed", [3, 4])
def test_rows_and_reduction_give_the_detectors_verdicts_on_the_archived_snapshots(
    spark: Any, tmp_path: Path, seed: int, version: int
) -> None:
    """Every snapshot evaluated from its rows (through rounds on DataFrames or none, every one routed
    there) gives what the detector's own function gives on the snapshot the archive gives back, in any
    schema version (an older file lacks facts a newer one has: both sides see the same archived
    snapshot); with the default settings, those without a blob too."""
    items = _varied(seed, 40)
    root = write_archive(tmp_path / "archive", items, batch_size=13, blobless=range(2, 41, 2))
    if version < 3:
        as_version(root, version)
    archived = [Archived(summary_of(s), s) for _, s in read_snapshots(root) if s is not None]
    expected = _serialized(detector_evaluations(archived))
    reductions = [Reduction(reduce_above=0, max_rounds=rounds, finish_edges=0) for rounds in (0, 2)]
    if version == 3:  # the blobs of older versions, rewritten here, still hold the newer facts
        reductions.append(Reduction())
    for reduction in reductions:
        rows = evaluate_archive(open_archive(spark, root), reduction=reduction).evaluations.toArrow()
        got = {(r["snapshot_id"], r["position"]): r["result"] for r in rows.cast(EVALUATIONS).to_pylist()}
        assert got == expected, reduction


# -- a bad file past the range's last day ---------------------------------------------------------------------


def _corrupt_pages(path: Path) -> None:
    """Overwrite every page of the Parquet file `path`; its footer still reads fine."""
    data = bytearray(path.read_bytes())
    footer = int.from_bytes(data[-8:-4], "little")
    data[4 : len(data) - 8 - footer] = b"\xff" * (len(data) - 12 - footer)
    path.write_bytes(bytes(data))


def test_corrupt_breaks_after_the_days_asked_for_are_named(spark: Any, tmp_path: Path) -> None:
    # The history of 2026-03-01 reads the breaks sent after it too (a deadlock proven before midnight
    # is broken after it). A corrupt file among those must be named, like one inside the range.
    root = tmp_path / "archive"
    snapshot = pair_deadlocked(1, MIDNIGHT - timedelta(seconds=2))
    write_archive(root, [Archived(summary_of(snapshot), snapshot)])
    write_resolution_batch(root, [pair_break(1, MIDNIGHT + timedelta(milliseconds=100))])
    write_resolution_batch(root, [pair_break(2, MIDNIGHT + timedelta(days=1))])
    bad = parquet_files(root, "resolutions")[-1]
    assert "2026-03-03" in str(bad)
    _corrupt_pages(bad)
    with pytest.raises(ArchiveError, match=f"{bad}: corrupt Parquet file"):
        run_history(root, tmp_path / "out", chart=False, first_day="2026-03-01", last_day="2026-03-01")


# -- follow and schema versions ---------------------------------------------------------------------------------


def test_follow_gives_what_evaluate_gives_on_an_archive_of_an_older_version(spark: Any, tmp_path: Path) -> None:
    items = sorted(_varied(5, 30), key=_finish)  # batched as the detector batches them: as they finish
    root = as_version(write_archive(tmp_path / "archive", items, batch_size=7, blobless=range(3, 31, 3)), 2)
    evaluated = evaluate_archive(open_archive(spark, root)).evaluations.toArrow().cast(EVALUATIONS).to_pylist()
    follow(root, tmp_path / "out", once=True, max_files=2, spark=spark)
    assert _followed(tmp_path / "out") == {(r["snapshot_id"], r["position"]): r["result"] for r in evaluated}


def test_follow_names_a_file_of_a_newer_version_and_keeps_what_it_took_before(spark: Any, tmp_path: Path) -> None:
    items = _varied(6, 20)
    root, out = tmp_path / "archive", tmp_path / "out"
    write_archive(root, items[:10], batch_size=5)
    follow(root, out, once=True, spark=spark)
    before = _followed(out)
    write_archive(root, items[10:], batch_size=5)
    newer = parquet_files(root, "snapshots")[-1]
    table = pq.read_table(newer)
    pq.write_table(table.replace_schema_metadata({METADATA_KEY: str(SCHEMA_VERSION + 1).encode()}), newer)
    with pytest.raises(ArchiveError, match=f"{newer}: schema version {SCHEMA_VERSION + 1} is newer"):
        follow(root, out, once=True, spark=spark)
    assert _followed(out) == before
    assert before == _serialized(detector_evaluations(items[:10]))


# -- follow: one output folder, one run -------------------------------------------------------------------------


def test_follow_refuses_an_output_folder_that_another_checkpoint_wrote(spark: Any, tmp_path: Path) -> None:
    # A second run with another checkpoint numbers its micro-batches from 0 again: writing into the
    # first run's folder would leave that run's later batches beside its own, every snapshot twice.
    items = _varied(7, 20)
    root, out = write_archive(tmp_path / "archive", items, batch_size=5), tmp_path / "out"
    follow(root, out, once=True, max_files=1, spark=spark)
    with pytest.raises(ArchiveError, match=str(out)):
        follow(root, out, once=True, checkpoint=tmp_path / "elsewhere", spark=spark)
    assert _followed(out) == _serialized(detector_evaluations(items))


def test_follow_refuses_an_output_folder_of_another_archive(spark: Any, tmp_path: Path) -> None:
    # The checkpoint in OUT says which files of the first archive were taken, not which archive: the
    # second archive's snapshots would land beside the first's, under the first's baselines.
    first, second = _varied(8, 10), _varied(9, 10)
    out = tmp_path / "out"
    follow(write_archive(tmp_path / "a", first, batch_size=5), out, once=True, spark=spark)
    with pytest.raises(ArchiveError, match=str(out)):
        follow(write_archive(tmp_path / "b", second, batch_size=5), out, once=True, spark=spark)
    assert _followed(out) == _serialized(detector_evaluations(first))


def _split_batch(root: Path) -> tuple[str, Path]:
    """An archive of one batch spanning midnight, its second day's ``snapshots`` file moved aside as if
    the detector were about to rename it into place: the first day's file, and where the second goes."""
    a = _closed(1, MIDNIGHT - timedelta(milliseconds=500), timedelta(seconds=1), tokens=10)
    b = _closed(2, MIDNIGHT, timedelta(milliseconds=100), tokens=12)
    write_archive(root, [Archived(summary_of(s), s) for s in (a, b)], batch_size=2)
    first, second = parquet_files(root, "snapshots")
    second.rename(second.with_name(f".{second.name}.tmp"))
    return f"{first.parent.name}/{first.name}", second


def test_a_micro_batch_waits_for_the_rest_of_its_batch_being_renamed_into_place(tmp_path: Path) -> None:
    first, second = _split_batch(tmp_path / "archive")

    def land(seconds: float) -> None:  # the detector's rename, while follow waits
        second.with_name(f".{second.name}.tmp").rename(second)

    files = _whole_batches(tmp_path / "archive", [first], time.monotonic() + 600, land)
    assert files == {first, f"{second.parent.name}/{second.name}"}


def test_a_micro_batch_does_not_wait_past_its_deadline_for_a_dead_writer(tmp_path: Path) -> None:
    first, _ = _split_batch(tmp_path / "archive")
    looks: list[float] = []
    assert _whole_batches(tmp_path / "archive", [first], time.monotonic() - 1, looks.append) == {first}
    assert looks == []


def test_follow_names_a_snapshots_file_whose_data_is_corrupt(spark: Any, tmp_path: Path) -> None:
    items = _varied(10, 10)
    root = write_archive(tmp_path / "archive", items, batch_size=5)
    bad = parquet_files(root, "snapshots")[-1]
    _corrupt_pages(bad)
    with pytest.raises(ArchiveError, match=f"{bad}: corrupt Parquet file"):
        follow(root, tmp_path / "out", once=True, spark=spark)
