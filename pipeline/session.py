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
driver's Java options were configured.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from pyspark import SparkConf
from pyspark.sql import SparkSession

__all__ = ["get_session"]

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
    builder = SparkSession.builder.appName(app_name).config("spark.ui.showConsoleProgress", "false")
    if not SparkConf().contains("spark.driver.extraJavaOptions"):
        quiet = (Path(__file__).with_name("log4j2.properties")).as_uri()
        builder = builder.config("spark.driver.extraJavaOptions", f"-Dlog4j2.configurationFile={quiet}")
    session = builder.getOrCreate()
    conf = session.sparkContext.getConf()
    for key, value in _DEFAULTS.items():
        if not conf.contains(key):
            session.conf.set(key, value)
    session.sparkContext.setLogLevel(log_level)
    return session
