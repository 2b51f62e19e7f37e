"""``follow``: Structured Streaming over the archive folder, each new batch of snapshots evaluated as it lands.

Theory of operation. The detector writes a batch's ``snapshots`` file last, renamed into place,
so a visible ``snapshots`` file means the batch's other rows are visible too, and temporary files
(``.name.tmp``) are hidden from Spark. A file stream over ``ARCHIVE/snapshots`` (the table's
schema, the ``day`` partitions discovered) takes each new file exactly once; the query's
checkpoint (Spark's offset and commit logs) records which files each micro-batch took. A restart
resumes after the last committed micro-batch and runs an uncommitted one again with the same
files.

Each micro-batch is evaluated like ``evaluate`` does (:func:`~stablewatch.pipeline.evaluate.evaluate_snapshots`)
and written to ``OUT/evaluations/batch=N``, replacing that folder: a micro-batch run again
replaces its own output instead of adding to it, so nothing is evaluated twice in the output and
nothing is skipped. Conservation baselines carry from batch to batch in
``OUT/baselines/batch=N.json``; batch N reads only those of earlier batches, so a run again sees
what the first run saw. Batches are taken in the order their files appear, so a baseline is the
first closed snapshot in that order (within a batch: by finish time, as everywhere).
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.streaming import StreamingQuery
from rich.console import Console

from stablewatch.detector.archive.files import parquet_files
from stablewatch.detector.archive.schema import ArchiveError
from stablewatch.pipeline.defaults import DEFAULT_REDUCTION, Reduction
from stablewatch.pipeline.evaluate import evaluate_snapshots, write_evaluations
from stablewatch.pipeline.session import get_session
from stablewatch.pipeline.tables import check_file, open_archive, spark_schema

__all__ = ["Followed", "follow"]


@dataclass
class Followed:
    """What a ``follow`` run did: micro-batches and snapshots evaluated, and the error that stopped it."""

    batches: int = 0
    snapshots: int = 0
    error: ArchiveError | None = None
    checked: set[Path] = field(default_factory=set)  # archive files whose footer was checked


def _earlier_baselines(folder: Path, batch_id: int) -> dict[str, int]:
    """The baselines written by micro-batches before `batch_id`, the earliest first."""
    totals: dict[str, int] = {}
    for path in sorted(folder.glob("batch=*.json")):
        if int(path.stem.removeprefix("batch=")) < batch_id:
            for counter, total in json.loads(path.read_text()).items():
                totals.setdefault(counter, total)
    return totals


def _check_new_files(root: Path, followed: Followed) -> None:
    """Check the footer of every ``snapshots`` file not checked yet, before Spark reads it."""
    for path in parquet_files(root, "snapshots"):
        if path not in followed.checked:
            check_file(path, "snapshots")
            followed.checked.add(path)


def _batch_writer(
    root: Path,
    out: Path,
    followed: Followed,
    expected: Mapping[str, int],
    predicates: Sequence[str],
    reduction: Reduction,
    console: Console | None,
) -> Callable[[DataFrame, int], None]:
    """The ``foreachBatch`` function: evaluate one micro-batch and replace its output folder."""

    def write(batch: DataFrame, batch_id: int) -> None:
        try:
            _check_new_files(root, followed)
            days = [row["day"] for row in batch.select("day").distinct().collect()]
            archive = open_archive(batch.sparkSession, root, min(days, default=None), max(days, default=None))
            earlier = _earlier_baselines(out / "baselines", batch_id)
            evaluated = evaluate_snapshots(archive, batch, {**earlier, **expected}, predicates, reduction=reduction)
            write_evaluations(evaluated.evaluations, out / "evaluations" / f"batch={batch_id}", archive)
        except ArchiveError as error:
            followed.error = error
            raise
        new = {c: total for c, (_, total) in sorted(evaluated.totals.baselines.items()) if c not in earlier}
        (out / "baselines").mkdir(parents=True, exist_ok=True)
        staged = out / "baselines" / f".batch={batch_id}.json.tmp"
        staged.write_text(json.dumps(new, sort_keys=True) + "\n")
        staged.replace(out / "baselines" / f"batch={batch_id}.json")
        followed.batches += 1
        followed.snapshots += evaluated.snapshots
        if console is not None:
            console.print(
                f"batch {batch_id}: {evaluated.snapshots} snapshots evaluated, {evaluated.aborted} aborted",
                highlight=False,
            )

    return write


def follow(
    archive: Path,
    out: Path,
    console: Console | None = None,
    *,
    checkpoint: Path | None = None,
    expected: Mapping[str, int] | None = None,
    predicates: Sequence[str] = (),
    once: bool = False,
    interval: float = 5.0,
    max_files: int | None = None,
    reduction: Reduction = DEFAULT_REDUCTION,
    spark: SparkSession | None = None,
) -> Followed:
    """Evaluate every batch of snapshots that lands in `archive`, into ``out/evaluations/batch=N``.

    With `once`, process what is there now and stop (``availableNow``); otherwise look for new
    files every `interval` seconds until SIGINT or SIGTERM. `max_files` bounds the ``snapshots``
    files per micro-batch. `checkpoint` defaults to ``out/_checkpoint``. `reduction` is how large
    snapshots are evaluated (:func:`~.evaluate.evaluate_snapshots`). Raises ArchiveError
    (naming the file) for bad input; returns what was done.
    """
    spark = spark or get_session()
    root, out = Path(archive), Path(out)
    open_archive(spark, root)  # the marker: ArchiveError when it is not an archive
    followed = Followed()
    source = root / "snapshots"
    if not source.is_dir():
        if once:
            return followed
        if console is not None:
            console.print(f"waiting for the first batch of snapshots in {root}", highlight=False)
        while not source.is_dir():  # the detector creates it with its first batch
            time.sleep(interval)
    reader = spark.readStream.schema(spark_schema("snapshots"))
    if max_files:
        reader = reader.option("maxFilesPerTrigger", max_files)
    writer = _batch_writer(root, out, followed, dict(expected or {}), predicates, reduction, console)
    query = (
        reader.parquet(str(source))
        .writeStream.queryName("stablewatch-follow")
        .foreachBatch(writer)
        .option("checkpointLocation", str(checkpoint or out / "_checkpoint"))
    )
    query = query.trigger(availableNow=True) if once else query.trigger(processingTime=f"{interval} seconds")
    running = query.start()
    _await(running, followed)
    return followed


def _await(query: StreamingQuery, followed: Followed) -> None:
    """Wait for `query` to end; SIGTERM stops it like Ctrl-C. Re-raise an ArchiveError from a batch."""

    def stop(signum: int, frame: FrameType | None) -> None:
        query.stop()

    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, stop) if main else None
    try:
        query.awaitTermination()
    except KeyboardInterrupt:
        query.stop()
    except Exception:
        if followed.error is not None:
            raise followed.error from None
        raise
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
