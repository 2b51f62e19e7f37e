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
from pathlib import Path

import pyarrow.dataset as ds
import pytest
from pyspark.sql import SparkSession
from snapshot_gen import Archived, detector_evaluations, random_archive, write_archive
from spark_session import group_gone, killed_spark_env

from polling import poll
from stablewatch.pipeline.follow import follow

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
