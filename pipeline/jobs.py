"""The file to give ``spark-submit``: the pipeline's jobs, unchanged, on any Spark cluster.

From a checkout (or find the installed file with
``python -c "import stablewatch.pipeline.jobs as j; print(j.__file__)"``)::

    spark-submit --master spark://HOST:7077 pipeline/jobs.py evaluate --archive /data/archive --out /data/analysis
    spark-submit --master spark://HOST:7077 pipeline/jobs.py history --archive /data/archive --out /data/analysis
    spark-submit --master spark://HOST:7077 pipeline/jobs.py follow --archive /data/archive --out /data/follow

The arguments are those of ``stablewatch pipeline`` (``--help`` lists them). Without
``--master``, spark-submit runs on ``local[*]``. Everything about the cluster (master, executors,
memory, ``spark.pyspark.python``) comes from spark-submit's flags and configuration, never from
this code. Every worker needs stablewatch installed in the Python that runs its executors, and
the archive and ``--out`` folders mounted at the same paths as on the driver (see deploy/spark/).
"""

import sys

from stablewatch.pipeline.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
