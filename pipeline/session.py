"""The Spark session of the jobs: whatever ``spark-submit`` configured, ``local[*]`` otherwise.

The code sets no master and no cluster setting. ``spark-submit --master spark://HOST:PORT``
(or ``--conf``, ``spark-defaults.conf``, ``PYSPARK_SUBMIT_ARGS``) decides where the jobs run;
a plain ``stablewatch pipeline ...`` starts Spark's own default, ``local[*]``. Two things are
set only when nobody set them, because the jobs' meaning depends on them, not the cluster's size:

* the Python that runs the evaluation on executors, ``PYSPARK_PYTHON``: this interpreter, which
  has stablewatch installed (a cluster whose workers keep stablewatch elsewhere sets
  ``spark.pyspark.python`` in ``spark-submit``);
* the SQL session time zone: UTC, the time zone of the archive's day partitions.

Spark's console progress bar is always off: the jobs report their own progress. A session this
module starts logs Spark's errors only (``log4j2.properties`` beside this file), unless the
driver's Java options were configured. When it starts Spark's JVM itself (not under
``spark-submit``), the JVM's stderr passes through a filter that drops the one line Java prints at
every start of Spark 4 and that asks nothing of anyone (:data:`JVM_NOISE`: Spark's launcher always
adds the incubating vector module); everything else the JVM says is passed on.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO

from pyspark import SparkConf, SparkContext
from pyspark.java_gateway import launch_gateway
from pyspark.sql import SparkSession

__all__ = ["JVM_NOISE", "get_session"]

#: Lines of the JVM's stderr that are dropped, whole. Spark 4's launcher always starts the JVM with
#: ``--add-modules=jdk.incubator.vector`` (its JavaModuleOptions), and Java warns of it at start.
JVM_NOISE = frozenset({b"WARNING: Using incubator modules: jdk.incubator.vector"})

_DEFAULTS = {"spark.sql.session.timeZone": "UTC"}  # SQL settings, applied when not configured


def get_session(app_name: str = "stablewatch-pipeline", log_level: str = "ERROR") -> SparkSession:
    """Return the active Spark session, or start one named `app_name` (``local[*]`` unless configured).

    `log_level` is Spark's log level for this application (``ERROR`` keeps the terminal for the
    jobs' own output; errors that stop a job are reported by the job itself).
    """
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    active = SparkSession.getActiveSession()
    if active is not None:
        return active
    conf = SparkConf().setAppName(app_name).set("spark.ui.showConsoleProgress", "false")
    if not conf.contains("spark.driver.extraJavaOptions"):
        quiet = (Path(__file__).with_name("log4j2.properties")).as_uri()
        conf.set("spark.driver.extraJavaOptions", f"-Dlog4j2.configurationFile={quiet}")
    # No JVM yet (PySpark keeps one per Python process, ``SparkContext._gateway``): start it here,
    # its stderr filtered, and build the session on it. Under spark-submit the JVM runs already.
    if SparkContext._gateway is None and "PYSPARK_GATEWAY_PORT" not in os.environ:
        _start_context(conf)
    session = SparkSession.builder.config(conf=conf).getOrCreate()
    conf = session.sparkContext.getConf()
    for key, value in _DEFAULTS.items():
        if not conf.contains(key):
            session.conf.set(key, value)
    session.sparkContext.setLogLevel(log_level)
    return session


def _start_context(conf: SparkConf) -> SparkContext:
    """Start Spark's JVM (as PySpark would) with its stderr piped through :func:`_pass_on`, and the
    SparkContext on it, which the session builder then uses."""
    gateway = launch_gateway(conf, popen_kwargs={"stderr": subprocess.PIPE})
    process = getattr(gateway, "proc", None)
    if process is not None and process.stderr is not None:
        threading.Thread(target=_pass_on, args=(process.stderr,), name="spark-jvm-stderr", daemon=True).start()
    return SparkContext(conf=conf, gateway=gateway)


def _pass_on(stream: IO[bytes]) -> None:
    """Copy the JVM's stderr to ours, line by line, but for :data:`JVM_NOISE`; until the JVM closes it."""
    for line in iter(stream.readline, b""):
        if line.rstrip(b"\r\n") in JVM_NOISE:
            continue
        sys.stderr.write(line.decode(errors="replace"))
        sys.stderr.flush()
