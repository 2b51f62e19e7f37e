"""``evaluate`` through ``spark-submit`` on a real standalone cluster gives the local result.

A Spark master and one worker are started from the installed PySpark (``spark-class``), on
127.0.0.1 and free ports; the job is submitted with the documented example,
``deploy/spark/submit.sh spark://...``, which runs ``spark-submit`` on the entry file
``pipeline/jobs.py``, unchanged. Master, worker and its executors are killed afterwards, by
process group.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pyarrow.dataset as ds
import pyspark
import pytest
from pyspark.sql import SparkSession
from snapshot_gen import random_archive, write_archive
from spark_session import group_gone, killed_spark_env

from conftest import ROOT, free_port
from polling import poll
from stablewatch.pipeline.defaults import Reduction
from stablewatch.pipeline.evaluate import evaluate_archive, write_evaluations
from stablewatch.pipeline.tables import open_archive

pytestmark = pytest.mark.timeout(900)

SPARK_BIN = Path(pyspark.__file__).parent / "bin"
STARTUP = 240.0  # JVMs on a busy two-core machine: an upper bound, not an expectation
# Both routes, and DataFrame rounds on the executors: snapshots with more than 3 wait edges are reduced.
FLAGS = ["--reduce-above", "3", "--max-rounds", "2", "--finish-edges", "0"]


def master_state(ui_port: int) -> dict | None:
    """The master's state from its web UI, or None while it is not answering (or not yet with JSON)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{ui_port}/json/", timeout=5) as response:
            return json.load(response)
    except (OSError, ValueError):
        return None


def spark_env(tmp_path: Path) -> dict[str, str]:
    """The environment of the cluster's processes and of spark-submit: on loopback, the rest as for
    any Spark process a test kills (the executors' scratch space under ``tmp_path``)."""
    return {**killed_spark_env(tmp_path), "SPARK_LOCAL_IP": "127.0.0.1"}


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[str, int]]:
    """A standalone master and one worker; yields the master URL and its web UI port."""
    env = spark_env(tmp_path)
    port, ui = free_port(), free_port()
    started: list[subprocess.Popen[bytes]] = []

    def start(name: str, *args: str) -> None:
        log = (tmp_path / f"{name}.log").open("wb")
        started.append(
            subprocess.Popen(
                [str(SPARK_BIN / "spark-class"), *args],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # the worker's executors join its group: one kill ends them all
            )
        )

    try:
        start("master", "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port", str(port),
              "--webui-port", str(ui))  # fmt: skip
        poll(lambda: (master_state(ui) or {}).get("status") == "ALIVE", "the Spark master", timeout=STARTUP)
        url = f"spark://127.0.0.1:{port}"
        start("worker", "org.apache.spark.deploy.worker.Worker", url, "--host", "127.0.0.1",
              "--port", str(free_port()), "--webui-port", str(free_port()), "--cores", "2", "--memory", "2g",
              "--work-dir", str(tmp_path / "work"))  # fmt: skip
        poll(lambda: (master_state(ui) or {}).get("aliveworkers") == 1, "the Spark worker", timeout=STARTUP)
        yield url, ui
    finally:
        for process in reversed(started):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=60)
        poll(lambda: all(group_gone(p.pid) for p in started), "the master, worker and executors to exit", timeout=60)


def sorted_rows(folder: Path) -> list[dict]:
    table = ds.dataset(folder, format="parquet", partitioning="hive").to_table()
    return sorted(table.to_pylist(), key=lambda row: (row["snapshot_id"], row["position"]))


def test_spark_submit_to_a_standalone_cluster_gives_the_local_result(
    spark: SparkSession, cluster: tuple[str, int], tmp_path: Path
) -> None:
    url, ui = cluster
    archive = write_archive(tmp_path / "archive", random_archive(seed=11, count=70, aborted_every=17), blobless={5, 40})

    reduction = Reduction(reduce_above=3, max_rounds=2, finish_edges=0)  # what FLAGS say
    local = evaluate_archive(open_archive(spark, archive), reduction=reduction)
    write_evaluations(local.evaluations, tmp_path / "local")

    submit = [str(SPARK_BIN / "spark-submit"), "--master", url, "--conf", "spark.ui.enabled=false"]
    submit += ["--conf", "spark.driver.host=127.0.0.1", "--conf", "spark.executor.memory=1g"]
    job = [
        str(ROOT / "pipeline" / "jobs.py"),
        "evaluate",
        "--archive",
        str(archive),
        "--out",
        str(tmp_path / "cluster"),
    ]
    env = spark_env(tmp_path)
    done = subprocess.run(
        [*submit, *job, *FLAGS, "--json"], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stderr[-4000:]
    printed = json.loads(done.stdout.strip().splitlines()[-1])
    assert (printed["snapshots"], printed["large"], printed["rounds"]) == (local.snapshots, local.large, local.rounds)
    assert local.large >= 2 and local.rounds >= 1

    assert sorted_rows(tmp_path / "cluster" / "evaluations") == sorted_rows(tmp_path / "local")
    apps = (master_state(ui) or {}).get("completedapps", [])
    assert [app["name"] for app in apps] == ["stablewatch-evaluate"]  # it ran on this cluster
