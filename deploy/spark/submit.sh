#!/usr/bin/env bash
# Run a stablewatch pipeline job on a Spark cluster with spark-submit, unchanged:
#
#   deploy/spark/submit.sh spark://HOST:7077 history --archive /data/archive --out /data/analysis
#   deploy/spark/submit.sh local[*] evaluate --archive /data/archive --out /data/analysis
#
# The first argument is the master; the rest are the job and its flags (`stablewatch pipeline --help`).
# The driver and every executor run stablewatch from the same Python: STABLEWATCH_PYTHON (default
# python3), which must be installed at the same path on the workers. SPARK_SUBMIT names
# spark-submit (default: the one on PATH); SPARK_SUBMIT_FLAGS adds flags such as
# "--executor-memory 4g --conf spark.driver.host=10.0.0.5".
set -euo pipefail
if [ $# -lt 2 ]; then
    echo "usage: $0 MASTER evaluate|history|follow --archive DIR --out DIR [flags]" >&2
    exit 2
fi
master=$1
shift
python=${STABLEWATCH_PYTHON:-python3}
jobs=$("$python" -c 'import stablewatch.pipeline.jobs as jobs; print(jobs.__file__)')
# shellcheck disable=SC2086  # SPARK_SUBMIT_FLAGS is a list of flags
exec "${SPARK_SUBMIT:-spark-submit}" --master "$master" --conf "spark.pyspark.python=$python" \
    ${SPARK_SUBMIT_FLAGS:-} "$jobs" "$@"
