"""What the pipeline's tests share to run Spark: one local session (``local[2]``, few shuffle
partitions, no UI), and the environment and the end of Spark processes started in a process group
of their own."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pyspark.sql import SparkSession


@contextmanager
def local_spark() -> Iterator[SparkSession]:
    """Start a small local Spark session (the jobs' ``get_session`` then returns it); stop it at the end."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = (
        SparkSession.builder.master("local[2]")
        .appName("stablewatch-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.default.parallelism", "4")
        .config("spark.sql.session.timeZone", "UTC")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    try:
        yield spark
    finally:
        spark.stop()


def killed_spark_env(folder: Path) -> dict[str, str]:
    """The environment for Spark processes a test will kill: this Python for their workers, and their
    scratch space and the JVM's temporary files under ``folder`` (a test's ``tmp_path``), since a
    killed JVM leaves those behind."""
    spark = {"PYSPARK_PYTHON": sys.executable, "SPARK_LOCAL_DIRS": str(folder)}
    return {**os.environ, **spark, "SPARK_SUBMIT_OPTS": f"-Djava.io.tmpdir={folder}"}


def group_gone(pgid: int) -> bool:
    """Whether no process of group ``pgid`` is left (a JVM and the workers it started)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False
