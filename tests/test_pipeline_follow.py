"""``follow`` evaluates each batch as it lands and resumes after a restart, or a kill, without duplicates or gaps.

The snapshots finish in id order (each takes under a minute, a minute apart), so the order the
batches land in is the order the detector evaluated them: the results, baselines included,
must be the detector's.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pyarrow.dataset as ds
import pytest
from pyspark.sql import SparkSession
from snapshot_gen import Archived, detector_evaluations, random_archive, summary_of, write_archive
from spark_session import group_gone, killed_spark_env
from test_pipeline_ranges_review import CONSERVATION, T0, as_the_detector, closed, conservation_verdicts

from polling import poll
from stablewatch.detector.archive.schema import ArchiveError
from stablewatch.pipeline.follow import _Carried, _carried, follow
from stablewatch.pipeline.tables import open_archive
from stablewatch.v1 import Evaluation

pytestmark = pytest.mark.timeout(900)

STARTUP = 240.0  # a JVM and a Spark session on a busy two-core machine: an upper bound, not an expectation


def followed_rows(out: Path) -> list[dict]:
    """Every result row written so far (folders being written, ``_temporary``, are not read)."""
    dataset = ds.dataset(out / "evaluations", format="parquet", partitioning="hive")
    return dataset.to_table(columns=["snapshot_id", "position", "result", "batch"]).to_pylist()


def assert_each_result_once(out: Path, items: list[Archived]) -> None:
    rows = followed_rows(out)
    keys = [(row["snapshot_id"], row["position"]) for row in rows]
    assert len(keys) == len(set(keys)), "a snapshot was evaluated twice into the output"
    expected = detector_evaluations(items)
    assert {sid for sid, _ in keys} == set(expected), "a snapshot was skipped"
    for row in rows:
        result = expected[row["snapshot_id"]].results[row["position"]]
        assert row["result"] == result.SerializeToString(deterministic=True), row["snapshot_id"]


def test_a_restart_resumes_from_the_checkpoint(spark: SparkSession, tmp_path: Path) -> None:
    items = random_archive(seed=5, count=80, aborted_every=23, max_millis=50_000)
    archive, out = tmp_path / "archive", tmp_path / "out"
    write_archive(archive, items[:40], batch_size=10)
    first = follow(archive, out, once=True, max_files=2)
    assert first.snapshots == sum(1 for item in items[:40] if item.snapshot is not None)
    assert_each_result_once(out, items[:40])

    assert follow(archive, out, once=True).batches == 0  # nothing new: nothing done again
    write_archive(archive, items[40:], batch_size=10)
    second = follow(archive, out, once=True, max_files=3)
    assert second.batches >= 2
    assert first.snapshots + second.snapshots == sum(1 for item in items if item.snapshot is not None)
    assert_each_result_once(out, items)


@pytest.fixture
def process_groups() -> Iterator[list[subprocess.Popen[str]]]:
    """Processes started in their own process group; the whole group (Python, JVM, workers) is killed after."""
    started: list[subprocess.Popen[str]] = []
    yield started
    for process in started:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=60)


def _uncommitted(out: Path) -> bool:
    """A micro-batch has written output but Spark has not committed it: the moment to kill."""
    offsets = out / "_checkpoint" / "offsets"
    if not offsets.is_dir():
        return False
    return any(
        entry.name.isdigit()
        and not (out / "_checkpoint" / "commits" / entry.name).exists()
        and (out / "evaluations" / f"batch={entry.name}").exists()
        for entry in offsets.iterdir()
    )


def test_killed_in_the_middle_of_a_batch_it_resumes_without_duplicates_or_gaps(
    tmp_path: Path, process_groups: list[subprocess.Popen[str]]
) -> None:
    items = random_archive(seed=6, count=90, aborted_every=29, max_millis=50_000)
    archive, out = tmp_path / "archive", tmp_path / "out"
    write_archive(archive, items[:60], batch_size=10)
    command = [sys.executable, "-m", "stablewatch.cli.main", "pipeline", "follow"]
    command += ["--archive", str(archive), "--out", str(out)]
    env = killed_spark_env(tmp_path)  # the JVM is killed below
    running = subprocess.Popen(
        [*command, "--interval", "0.5", "--max-files", "1"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        text=True,
    )
    process_groups.append(running)
    poll(lambda: _uncommitted(out), "a micro-batch written but not committed", timeout=STARTUP, interval=0.002)
    os.killpg(running.pid, signal.SIGKILL)
    running.wait(timeout=60)
    poll(lambda: group_gone(running.pid), "the killed follow's JVM and workers to exit", timeout=60)
    killed = [entry.name for entry in (out / "_checkpoint" / "offsets").iterdir() if entry.name.isdigit()]
    assert any(not (out / "_checkpoint" / "commits" / name).exists() for name in killed)

    write_archive(archive, items[60:], batch_size=10)
    resumed = subprocess.run(
        [*command, "--once", "--json"], env=env, capture_output=True, text=True, timeout=STARTUP * 2, check=False
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    for name in killed:  # the batch cut short was run again, with the same files, and committed
        assert (out / "_checkpoint" / "commits" / name).exists()
    assert_each_result_once(out, items)


# -- a detector restarted on a fresh store into the same archive ----------------------------------------------


def _restarted_twice() -> tuple[list[Archived], dict[int, Evaluation]]:
    """Store 1 took 10 on snapshot 1 (2: conserved). A detector started on a fresh store into the
    same archive took 20 on snapshot 3 (4: conserved, 5 with 10 again: violated)."""
    first = [closed(1, T0, 10), closed(2, T0 + timedelta(hours=1), 10)]
    hours = (2, 3, 4)
    second = [closed(sid, T0 + timedelta(hours=h), t) for sid, h, t in zip((3, 4, 5), hours, (20, 20, 10), strict=True)]
    evaluations = {**as_the_detector(first), **as_the_detector(second)}
    return [Archived(summary_of(s), s) for s in first + second], evaluations


def _followed_verdicts(out: Path) -> dict[int, tuple[bool, bool]]:
    rows = ds.dataset(out / "evaluations", format="parquet", partitioning="hive").to_table().to_pylist()
    return {r["snapshot_id"]: (r["holds"], r["unknown"]) for r in rows if r["position"] == CONSERVATION}


def _detector_said(evaluations: dict[int, Evaluation]) -> dict[int, tuple[bool, bool]]:
    return {sid: (e.results[CONSERVATION].holds, e.results[CONSERVATION].unknown) for sid, e in evaluations.items()}


@pytest.mark.parametrize("landing", ["all-there", "restart-after-first-batches"])
def test_a_detector_baseline_in_a_later_micro_batch_takes_over_as_in_evaluate(
    spark: SparkSession, tmp_path: Path, landing: str
) -> None:
    # Before: follow read the detector's baselines only in its first micro-batch, then compared
    # every later snapshot with the totals it carried (no order key): the whole archive's latest
    # baseline (20) when it was all there, or 10 when the restart landed later.
    items, evaluations = _restarted_twice()
    said = _detector_said(evaluations)
    assert said == {1: (True, False), 2: (True, False), 3: (True, False), 4: (True, False), 5: (False, False)}
    archive, out = tmp_path / "archive", tmp_path / "out"
    if landing == "all-there":
        write_archive(archive, items, 1, evaluations)
        assert follow(archive, out, once=True, max_files=1, spark=spark).batches == 5
    else:
        write_archive(archive, items[:2], 1, evaluations)
        follow(archive, out, once=True, max_files=1, spark=spark)
        write_archive(archive, items[2:], 1, evaluations)
        follow(archive, out, once=True, max_files=2, spark=spark)
    assert conservation_verdicts(open_archive(spark, archive)) == said  # evaluate
    assert _followed_verdicts(out) == said


def test_an_output_folder_of_the_first_baselines_format_is_read(spark: SparkSession, tmp_path: Path) -> None:
    # An earlier version wrote each counter's total, once, where a micro-batch first saw it: 10,
    # missing the restart in batch 2. Its later micro-batches take the detector's 20 from its results.
    items, evaluations = _restarted_twice()
    archive, out = tmp_path / "archive", tmp_path / "out"
    write_archive(archive, items[:3], 1, evaluations)
    assert follow(archive, out, once=True, max_files=1, spark=spark).batches == 3
    for batch, written in enumerate(['{"tokens": 10}\n', "{}\n", "{}\n"]):
        (out / "baselines" / f"batch={batch}.json").write_text(written)
    write_archive(archive, items[3:], 1, evaluations)
    assert follow(archive, out, once=True, max_files=1, spark=spark).batches == 2
    said = _detector_said(evaluations)
    assert conservation_verdicts(open_archive(spark, archive)) == said
    assert _followed_verdicts(out) == said


def test_carried_baselines_are_those_of_earlier_batches_and_a_bad_file_is_named(tmp_path: Path) -> None:
    folder = tmp_path / "baselines"
    folder.mkdir()
    (folder / "batch=0.json").write_text('{"tokens": 10}\n')  # the first format
    (folder / "batch=1.json").write_text('{"credits": 3, "tokens": 99}\n')
    state = _Carried((("tokens", (-1, -1), 10), ("tokens", (50, 3), 20)), (("credits", (7, 1), 3),))
    (folder / "batch=2.json").write_text(state.to_json())
    (folder / "batch=10.json").write_text("not json")
    assert _carried(folder, 0) == _Carried()
    assert _carried(folder, 1) == _Carried((), (("tokens", (-1, -1), 10),))
    assert _carried(folder, 2) == _Carried((), (("credits", (-1, -1), 3), ("tokens", (-1, -1), 10)))
    assert _carried(folder, 3) == _carried(folder, 10) == state  # the latest holds them all
    with pytest.raises(ArchiveError, match=r"batch=10\.json: cannot read the baselines"):
        _carried(folder, 11)
