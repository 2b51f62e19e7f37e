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
nothing is skipped.

Conservation is evaluated as ``evaluate`` evaluates it over the same archive, whatever the
micro-batch boundaries (the detector archives its batches in the order their snapshots finished):
each snapshot is compared with the latest baseline taken before it in that order, the
``--expect`` totals overriding them all. A micro-batch takes the detector's baselines from the
archived results of its own snapshots (``detector_baselines``: each one flagged ``baseline``, as
a detector restarted on a fresh store into the same archive takes a new one, and one taken
before the archive began), reading only the days its files are in; and it takes those that
earlier micro-batches carried, with the first closed snapshot of each counter (a baseline only
when no detector baseline comes before it). It carries all of them on, each with its snapshot's
order key, in ``OUT/baselines/batch=N.json`` (:data:`BASELINES_FORMAT`: the whole state, so
batch N reads only the latest earlier file, and a run again sees what the first run saw). A
folder written by an earlier version holds the first format (each counter's total, without its
order key): it is read, each total taken as a baseline from before the next micro-batch, which
the detector's own results override.

One detector batch is one ``snapshots`` file per day of start: a batch spanning midnight is two
files, and a micro-batch may take one without the other (``maxFilesPerTrigger``, or a look between
the two renames). The detector evaluated that batch's snapshots in the order they finished, which
is not the order of the days (one that started after midnight may finish first and set the
baseline), so a micro-batch evaluates whole detector batches: with each file it takes, the files
of the same name in the other days (waiting for one the detector is still renaming into place:
its other tables' files are there already), and it records them in ``OUT/taken/batch=N.json``.
A later micro-batch skips the files an earlier one recorded.

An output folder belongs to one run: one archive and one checkpoint (``OUT/_follow.json`` says
which). Another checkpoint would number its micro-batches from 0 again and leave the other run's
later batches beside its own, and another archive's snapshots would land beside the first's,
under its baselines: ``follow`` refuses both, naming the folder.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from urllib.parse import unquote, urlparse

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming import StreamingQuery
from rich.console import Console

from stablewatch.detector.archive.files import batch_range, parquet_files
from stablewatch.detector.archive.schema import SNAPSHOT_TABLES, ArchiveError
from stablewatch.pipeline.defaults import DEFAULT_REDUCTION, Reduction
from stablewatch.pipeline.evaluate import Totals, detector_baselines, evaluate_snapshots, write_evaluations
from stablewatch.pipeline.session import get_session
from stablewatch.pipeline.tables import check_file, naming_corrupt, open_archive, spark_schema

__all__ = ["BASELINES_FORMAT", "RUN_FILE", "SIBLING_WAIT", "Followed", "follow"]

#: How long a micro-batch waits for a ``snapshots`` file of its detector batch that the detector is
#: still renaming into place (it has only an fsync and renames left to do); past it, the writer is
#: taken for dead: its next start removes that day's other files and writes its snapshots again,
#: in a batch of another name, which a later micro-batch takes.
SIBLING_WAIT = 30.0

#: The file in the output folder that names the archive and the checkpoint of the run writing it.
RUN_FILE = "_follow.json"
_OUTPUTS = ("evaluations", "baselines", "taken")  # each holds ``batch=N`` entries


@dataclass
class Followed:
    """What a ``follow`` run did: micro-batches and snapshots evaluated, and the error that stopped it."""

    batches: int = 0
    snapshots: int = 0
    error: ArchiveError | None = None
    checked: set[Path] = field(default_factory=set)  # archive files whose footer was checked


#: A baseline as :func:`~stablewatch.pipeline.evaluate.find_totals` takes it: ``(counter, order key, total)``.
Baseline = tuple[str, tuple[int, int], int]

#: The format of ``OUT/baselines/batch=N.json`` this version writes (the first format, a JSON object
#: of each counter's total, is read too: :func:`_carried`).
BASELINES_FORMAT = 2

#: The order key ``detector_baselines`` gives a baseline the detector took before every snapshot read.
_BEFORE_ALL = (-1, -1)


@dataclass(frozen=True)
class _Carried:
    """The conservation baselines that micro-batches hand on, with the order key of the snapshot that
    set each: every one the detector took (its archived results say so), and the first closed
    snapshot of each counter that follow saw (a candidate, which a detector baseline taken before it
    overrides, as in ``find_totals``)."""

    detectors: tuple[Baseline, ...] = ()
    firsts: tuple[Baseline, ...] = ()

    def to_json(self) -> str:
        """The text of ``baselines/batch=N.json``: the format, and each baseline with its order key."""

        def rows(baselines: Iterable[Baseline]) -> list[dict[str, object]]:
            return [
                {"counter": counter, "finished_us": key[0], "snapshot_id": key[1], "total": total}
                for counter, key, total in sorted(baselines)
            ]

        state = {"format": BASELINES_FORMAT, "detector": rows(self.detectors), "first": rows(self.firsts)}
        return json.dumps(state, sort_keys=True) + "\n"


def _carried(folder: Path, batch_id: int) -> _Carried:
    """What the micro-batches before `batch_id` carried: the latest one's file, which holds them all.

    Files of the first format (each counter's total, no order key, only the counters that batch
    saw first) are merged back to the latest file of this format, each total taken as the first
    baseline, from before every later snapshot: the detector's own baselines, read again from
    the next micro-batch's results, override it. ArchiveError names a file of neither format."""
    earlier = sorted(
        (number, path)
        for path in folder.glob("batch=*.json")
        if (number := int(path.stem.removeprefix("batch="))) < batch_id
    )
    old: dict[str, int] = {}
    carried = _Carried()
    for _, path in reversed(earlier):
        state = _read_baselines(path)
        if isinstance(state, _Carried):
            carried = state
            break
        old = old | state  # the earlier file's total wins, as the first format read them
    firsts = {counter: (key, total) for counter, key, total in carried.firsts}
    firsts.update((counter, (_BEFORE_ALL, total)) for counter, total in old.items())
    return _Carried(carried.detectors, tuple((c, key, total) for c, (key, total) in sorted(firsts.items())))


def _read_baselines(path: Path) -> _Carried | dict[str, int]:
    """One ``baselines/batch=N.json``: this format's :class:`_Carried`, or the first format's totals."""
    try:
        state = json.loads(path.read_text())
        if isinstance(state, dict) and all(type(total) is int for total in state.values()):
            return state  # the first format: {counter: total}
        if state.get("format") != BASELINES_FORMAT:
            raise ValueError(f"format {state.get('format')!r}, not {BASELINES_FORMAT}: written by another stablewatch")

        def baselines(kind: str) -> tuple[Baseline, ...]:
            return tuple(
                (str(row["counter"]), (int(row["finished_us"]), int(row["snapshot_id"])), int(row["total"]))
                for row in state[kind]
            )

        return _Carried(baselines("detector"), baselines("first"))
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
        raise ArchiveError(f"{path}: cannot read the baselines follow carried ({exc})") from exc


def _taken_here(carried: _Carried, found: Iterable[Baseline]) -> list[Baseline]:
    """The detector's baselines `found` in a micro-batch's results that it hands on: all it flagged,
    and the one from before them (the first result did not set one) only for a counter no earlier
    micro-batch had a result of: for the others, what they carried says more (its order key)."""
    known = {counter for counter, _, _ in carried.detectors}
    return [(counter, key, total) for counter, key, total in found if key != _BEFORE_ALL or counter not in known]


def _handed_on(carried: _Carried, detectors: Iterable[Baseline], totals: Totals) -> _Carried:
    """What a micro-batch hands on: the detector's baselines known so far (`detectors`), and each
    counter's first candidate: the carried one, or the one that `totals` kept beside `detectors`
    (found in this micro-batch) when it comes first."""
    taken = {(counter, key): total for counter, key, total in detectors}
    firsts = {counter: (key, total) for counter, key, total in carried.firsts}
    for counter, baselines in totals.baselines.items():
        for key, total in baselines:
            if (counter, key) not in taken and (counter not in firsts or key < firsts[counter][0]):
                firsts[counter] = (key, total)
    return _Carried(
        tuple((counter, key, total) for (counter, key), total in sorted(taken.items())),
        tuple((counter, key, total) for counter, (key, total) in sorted(firsts.items())),
    )


def _earlier_taken(folder: Path, batch_id: int) -> set[str]:
    """The ``snapshots`` files (``day=D/NAME``) evaluated by micro-batches before `batch_id`."""
    taken: set[str] = set()
    for path in folder.glob("batch=*.json"):
        if int(path.stem.removeprefix("batch=")) < batch_id:
            taken.update(json.loads(path.read_text()))
    return taken


def _relative(uri: str) -> str:
    """A file of the ``snapshots`` table as ``day=D/NAME``, from the path or URI Spark gives."""
    path = Path(unquote(urlparse(uri).path))
    return f"{path.parent.name}/{path.name}"


def _landing(root: Path, name: str) -> list[str]:
    """The days of detector batch `name` whose ``snapshots`` file is not there yet but whose other
    tables' files are: the detector renames those first, so it is landing that file now."""
    have = {path.parent.name for path in (root / "snapshots").glob(f"day=*/{name}")}
    days = {path.parent.name for table in SNAPSHOT_TABLES for path in (root / table).glob(f"day=*/{name}")}
    return sorted(days - have)


def _whole_batches(
    root: Path, taken: Iterable[str], deadline: float, pause: Callable[[float], None] = time.sleep
) -> set[str]:
    """`taken` with the ``snapshots`` files of the same detector batches in the other days, those being
    renamed into place waited for (`pause` between looks) until `deadline` (``time.monotonic()``)."""
    files = set(taken)
    for name in sorted({relative.split("/", 1)[1] for relative in files}):
        if batch_range(name) is None:  # not a detector batch: the file stands alone
            continue
        while _landing(root, name) and time.monotonic() < deadline:
            pause(0.01)
        files.update(f"{path.parent.name}/{name}" for path in (root / "snapshots").glob(f"day=*/{name}"))
    return files


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
        # A ``snapshots`` file whose data is corrupt behind a good footer fails in Spark: named then.
        snapshots_files = ((path, "snapshots") for path in parquet_files(root, "snapshots"))
        try:
            with naming_corrupt(snapshots_files):
                _check_new_files(root, followed)
                uris = batch.select(F.input_file_name().alias("file")).distinct().collect()
                taken = (_relative(row["file"]) for row in uris)
                files = _whole_batches(root, taken, time.monotonic() + SIBLING_WAIT)
                files = sorted(files - _earlier_taken(out / "taken", batch_id))
                _check_new_files(root, followed)  # the files waited for
                days = [relative.split("/", 1)[0].removeprefix("day=") for relative in files]
                archive = open_archive(batch.sparkSession, root, min(days, default=None), max(days, default=None))
                snapshots = _snapshots_of(archive.spark, root, files)
                carried = _carried(out / "baselines", batch_id)
                # The detector's baselines, as the results of this micro-batch's snapshots say (one
                # taken before the archive began, a new one a detector restarted on a fresh store
                # took), beside those of earlier micro-batches: each snapshot is compared with the
                # latest taken before it. Only the days of these files are read.
                found = detector_baselines(archive, snapshots) if files else []
                detectors = [*carried.detectors, *_taken_here(carried, found)]
                evaluated = evaluate_snapshots(
                    archive,
                    snapshots,
                    expected,
                    predicates,
                    reduction=reduction,
                    earlier=detectors,
                    seen=carried.firsts,
                )
                write_evaluations(evaluated.evaluations, out / "evaluations" / f"batch={batch_id}", archive)
        except ArchiveError as error:
            followed.error = error
            raise
        _replace(out / "taken" / f"batch={batch_id}.json", json.dumps(files) + "\n")
        _replace(
            out / "baselines" / f"batch={batch_id}.json", _handed_on(carried, detectors, evaluated.totals).to_json()
        )
        followed.batches += 1
        followed.snapshots += evaluated.snapshots
        if console is not None:
            console.print(
                f"batch {batch_id}: {evaluated.snapshots} snapshots evaluated, {evaluated.aborted} aborted",
                highlight=False,
            )

    return write


def _claim_output(out: Path, root: Path, checkpoint: Path) -> None:
    """Make `out` the output folder of following `root` with `checkpoint`, or raise ArchiveError naming it
    when it holds what another run wrote: another archive or checkpoint (per :data:`RUN_FILE`), or
    micro-batches that `checkpoint` knows nothing of (given anew, or removed)."""
    run = {"archive": str(root.resolve()), "checkpoint": str(checkpoint.resolve())}
    record = out / RUN_FILE
    if record.exists():
        try:
            written = json.loads(record.read_text())
        except (OSError, ValueError) as exc:
            raise ArchiveError(f"{record}: cannot read which run writes {out} ({exc})") from exc
        for key, what in (("archive", "the archive"), ("checkpoint", "the checkpoint")):
            if written.get(key) != run[key]:
                raise ArchiveError(
                    f"{out} holds what follow evaluated with {what} {written.get(key)}, not {run[key]}: "
                    "give another --out (or that run's --archive and --checkpoint)"
                )
    batches = [entry for name in _OUTPUTS for entry in (out / name).glob("batch=*")]
    started = any(entry.name.isdigit() for entry in (checkpoint / "offsets").glob("*"))
    if batches and not started:  # a checkpoint given anew, or removed and started over
        raise ArchiveError(
            f"{out} holds micro-batches of a follow run that the checkpoint {checkpoint} does not know "
            "(it has none): give another --out, or that run's --checkpoint"
        )
    if not record.exists():  # new, or written by an earlier version with this checkpoint: adopted
        _replace(record, json.dumps(run, sort_keys=True) + "\n")


def _replace(path: Path, text: str) -> None:
    """Write `path` whole: aside, then renamed into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staged = path.with_name(f".{path.name}.tmp")
    staged.write_text(text)
    staged.replace(path)


def _snapshots_of(spark: SparkSession, root: Path, files: Sequence[str]) -> DataFrame:
    """The rows of the ``snapshots`` files `files` (``day=D/NAME``), with their ``day``."""
    schema = spark_schema("snapshots")
    if not files:
        return spark.createDataFrame([], schema)
    reader = spark.read.schema(schema).option("basePath", str(root / "snapshots"))
    return reader.parquet(*(str(root / "snapshots" / relative) for relative in files))


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
    (naming the file) for bad input, and (naming `out`) when `out` holds what another archive or
    checkpoint was followed into; returns what was done.
    """
    spark = spark or get_session()
    root, out = Path(archive), Path(out)
    open_archive(spark, root)  # the marker: ArchiveError when it is not an archive
    checkpoint = Path(checkpoint or out / "_checkpoint")
    _claim_output(out, root, checkpoint)
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
        .option("checkpointLocation", str(checkpoint))
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
