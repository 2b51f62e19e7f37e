"""History across snapshots, as plain DataFrame functions over the evaluations and the archive.

* :func:`runs` and :func:`episodes` — when a predicate began and stopped holding. Snapshots are
  taken in the order they started; an unknown result (an open cut that could not decide) is
  skipped, neither ending nor extending an episode. An episode *began* between the snapshot
  before it (``began_after``, the last one where it did not hold) and its first snapshot
  (``began_at``); it *ended* by the first later snapshot where it did not hold (``ended_at``,
  null while it still holds). ``duration_seconds`` is from ``began_at`` to ``ended_at`` (or to
  the last snapshot that saw it, ``last_seen_at``, while ``ongoing``).
* :func:`deadlock_episodes` adds the processes and tasks involved; :func:`recurring_processes`
  ranks the processes most often deadlocked; termination's episodes give the termination time.
* :func:`conservation_drift` and :func:`conservation_summary` — observed, expected and drift
  of every counter over time.
* :func:`channel_backlog` — percentiles of the messages and bytes in flight per channel, over
  time buckets and over the whole range; :func:`timeline` — one row per snapshot for the charts,
  with each snapshot's verdicts; :func:`attribute_totals` — each numeric attribute's total over
  the processes, per snapshot (the work a system did: meals eaten, tasks done).
* :func:`snapshot_outcomes` and :func:`abort_reasons` — how snapshots ended and how long they took.
* :func:`breaks` and :func:`breaks_over_time` — the deadlocks the detector broke (the archive's
  ``resolutions`` table, empty in an archive without one): each break's victim, outcome and
  times, and per time bucket how many deadlocks were broken, the victims and what became of the
  breaks; :func:`deadlock_episodes` counts the breaks of each episode.

Every function is lazy; :func:`build_history` evaluates (or reads earlier evaluations), collects
the tables (aggregates, small), writes them and draws the chart. :func:`run_history` is the job;
:func:`run_histories` runs it on several systems' archives and draws one chart with a lane per
system, each telling the system's story (:mod:`.story`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F
from pyspark.sql.pandas.types import from_arrow_schema
from rich.console import Console

from stablewatch.detector.evaluation import Verdict
from stablewatch.pipeline.chart import draw_history, draw_lanes
from stablewatch.pipeline.defaults import DEFAULT_REDUCTION, Reduction
from stablewatch.pipeline.evaluate import EVALUATIONS, evaluate_archive, write_evaluations
from stablewatch.pipeline.session import get_session
from stablewatch.pipeline.story import Story, stories_report, tell
from stablewatch.pipeline.summary import history_report
from stablewatch.pipeline.tables import Archive, check_archive, open_archive
from stablewatch.pipeline.verdict import verdict

__all__ = [
    "Histories",
    "History",
    "abort_reasons",
    "attribute_totals",
    "breaks",
    "breaks_over_time",
    "build_history",
    "channel_backlog",
    "conservation_drift",
    "conservation_summary",
    "deadlock_episodes",
    "deadlocked_nodes",
    "episodes",
    "recurring_processes",
    "run_histories",
    "run_history",
    "runs",
    "snapshot_outcomes",
    "timeline",
]

_PERCENTILES = [0.5, 0.9, 0.99]
_ACCURACY = 10_000
_NODES = "struct<deadlocked: array<struct<process: string, task: string>>>"
# MessageToJson writes int64 fields as strings and leaves out zeros.
_CONSERVATION = "struct<counter: string, expected: string, observed: string, drift: string, baseline: boolean>"


def _seconds(later: Column | str, earlier: Column | str) -> Column:
    return (F.unix_micros(later) - F.unix_micros(earlier)) / 1e6


def runs(evaluations: DataFrame, name: str) -> DataFrame:
    """The decided snapshots of predicate `name`, in start order, numbered by run of equal verdicts.

    Columns: ``snapshot_id, started_at, holds, run, prev_at, next_at`` — `run` increases each
    time the verdict changes, `prev_at`/`next_at` are the starts of the decided snapshots just
    before and after. One partition (one row per snapshot): O(n log n).
    """
    order = Window.partitionBy("name").orderBy("started_at", "snapshot_id")
    decided = evaluations.filter((F.col("name") == name) & (verdict() != Verdict.UNKNOWN.value))
    changed = F.lag("holds").over(order).isNull() | (F.lag("holds").over(order) != F.col("holds"))
    return decided.select(
        "name",
        "snapshot_id",
        "started_at",
        "holds",
        F.sum(F.when(changed, 1).otherwise(0)).over(order.rowsBetween(Window.unboundedPreceding, 0)).alias("run"),
        F.lag("started_at").over(order).alias("prev_at"),
        F.lead("started_at").over(order).alias("next_at"),
    )


def episodes(evaluations: DataFrame, name: str) -> DataFrame:
    """The episodes in which predicate `name` held (see the module doc for the bounds).

    Columns: ``episode, run, first_snapshot_id, last_snapshot_id, snapshots, began_after,
    began_at, last_seen_at, ended_at, ongoing, duration_seconds``; episodes numbered from 1.
    """
    held = runs(evaluations, name).filter("holds")
    order = F.struct("started_at", "snapshot_id")
    found = held.groupBy("run").agg(
        F.min(order).alias("first"),
        F.max(order).alias("last"),
        F.count(F.lit(1)).alias("snapshots"),
        F.min_by("prev_at", order).alias("began_after"),
        F.max_by("next_at", order).alias("ended_at"),
    )
    numbered = Window.partitionBy(F.lit(name)).orderBy("began_at")
    return (
        found.select(
            "run",
            F.col("first.snapshot_id").alias("first_snapshot_id"),
            F.col("last.snapshot_id").alias("last_snapshot_id"),
            "snapshots",
            "began_after",
            F.col("first.started_at").alias("began_at"),
            F.col("last.started_at").alias("last_seen_at"),
            "ended_at",
        )
        .withColumn("ongoing", F.col("ended_at").isNull())
        .withColumn("duration_seconds", _seconds(F.coalesce("ended_at", "last_seen_at"), "began_at"))
        .withColumn("episode", F.row_number().over(numbered))
        .select("episode", *[c for c in _EPISODE_COLUMNS if c != "episode"])
    )


_EPISODE_COLUMNS = [
    "episode",
    "run",
    "first_snapshot_id",
    "last_snapshot_id",
    "snapshots",
    "began_after",
    "began_at",
    "last_seen_at",
    "ended_at",
    "ongoing",
    "duration_seconds",
]


def deadlocked_nodes(evaluations: DataFrame) -> DataFrame:
    """Every deadlocked node of every snapshot: ``snapshot_id, started_at, process, task, label``."""
    deadlocks = evaluations.filter((F.col("name") == "deadlock") & F.col("holds"))
    nodes = deadlocks.select(
        "snapshot_id", "started_at", F.explode(F.from_json("evidence", _NODES)["deadlocked"]).alias("node")
    )
    task = F.coalesce(F.col("node.task"), F.lit(""))
    return nodes.select(
        "snapshot_id",
        "started_at",
        F.col("node.process").alias("process"),
        task.alias("task"),
        F.when(task == "", F.col("node.process")).otherwise(F.concat_ws("/", "node.process", task)).alias("label"),
    )


def deadlock_episodes(evaluations: DataFrame, resolutions: DataFrame | None = None) -> DataFrame:
    """:func:`episodes` of ``deadlock``, with the ``processes`` and ``tasks`` (``P/task``) involved and
    ``max_deadlocked_nodes``, the most nodes deadlocked in one snapshot.

    With the archive's `resolutions`, also ``breaks`` (the breaks of the episode's deadlocks: those
    a snapshot of the episode proved) and ``broken`` (of them, the waits their agents broke), 0
    for an episode without any.
    """
    held = runs(evaluations, "deadlock").select("snapshot_id", "run")
    nodes = deadlocked_nodes(evaluations).join(held, "snapshot_id")
    involved = nodes.groupBy("run").agg(
        F.array_sort(F.collect_set("process")).alias("processes"),
        F.array_sort(F.collect_set(F.when(F.col("task") != "", F.col("label")))).alias("tasks"),
    )
    most = nodes.groupBy("run", "snapshot_id").count().groupBy("run").agg(F.max("count").alias("max_deadlocked_nodes"))
    found = episodes(evaluations, "deadlock").join(involved, "run", "left").join(most, "run", "left")
    if resolutions is not None:
        counted = (
            resolutions.join(held, "snapshot_id")
            .groupBy("run")
            .agg(F.count(F.lit(1)).alias("breaks"), F.count(F.when(F.col("outcome") == "broken", 1)).alias("broken"))
        )
        found = found.join(counted, "run", "left").fillna(0, ["breaks", "broken"])
    return found.orderBy("episode")


def recurring_processes(evaluations: DataFrame) -> DataFrame:
    """The processes found deadlocked, most often first: in how many snapshots and episodes, first and last seen."""
    nodes = deadlocked_nodes(evaluations).join(
        runs(evaluations, "deadlock").select("snapshot_id", "run"), "snapshot_id"
    )
    return (
        nodes.groupBy("process")
        .agg(
            F.countDistinct("snapshot_id").alias("snapshots"),
            F.countDistinct("run").alias("episodes"),
            F.min("started_at").alias("first_seen_at"),
            F.max("started_at").alias("last_seen_at"),
            F.array_sort(F.collect_set(F.when(F.col("task") != "", F.col("label")))).alias("tasks"),
        )
        .orderBy(F.desc("snapshots"), F.desc("episodes"), "process")
    )


def conservation_drift(evaluations: DataFrame) -> DataFrame:
    """Every conservation result: ``snapshot_id, started_at, counter, verdict, expected, observed, drift, baseline``."""
    evidence = F.from_json("evidence", _CONSERVATION)
    rows = evaluations.filter(F.col("name").startswith("conservation(")).withColumn("e", evidence)
    return rows.select(
        "snapshot_id",
        "started_at",
        F.col("e.counter").alias("counter"),
        verdict().alias("verdict"),
        *(F.coalesce(F.col(f"e.{n}").cast("long"), F.lit(0)).alias(n) for n in ("expected", "observed", "drift")),
        F.coalesce("e.baseline", F.lit(False)).alias("baseline"),
    ).orderBy("started_at", "snapshot_id", "counter")


def conservation_summary(drift: DataFrame) -> DataFrame:
    """Per counter, from :func:`conservation_drift`: how often it held, was violated or unknown; the worst drift."""
    word = F.col("verdict")
    violated = word == Verdict.FALSE.value
    decided = word != Verdict.UNKNOWN.value
    last_decided = F.when(decided, F.struct("started_at", "snapshot_id"))  # max_by skips nulls
    return (
        drift.groupBy("counter")
        .agg(
            F.count(F.lit(1)).alias("snapshots"),
            F.count(F.when(word == Verdict.TRUE.value, 1)).alias("held"),
            F.count(F.when(violated, 1)).alias("violated"),
            F.count(F.when(word == Verdict.UNKNOWN.value, 1)).alias("unknown"),
            F.max(F.when(decided, F.abs("drift"))).alias("max_abs_drift"),
            F.min(F.when(violated, F.col("started_at"))).alias("first_violation_at"),
            F.max_by("drift", last_decided).alias("last_drift"),
            F.max_by("expected", last_decided).alias("expected"),
        )
        .orderBy("counter")
    )


def _percentiles(column: str, prefix: str) -> list[Column]:
    values = F.percentile_approx(column, _PERCENTILES, _ACCURACY)
    named = [values[i].alias(f"{prefix}_p{round(p * 100)}") for i, p in enumerate(_PERCENTILES)]
    return [*named, F.max(column).alias(f"{prefix}_max")]


def channel_backlog(channels: DataFrame, snapshots: DataFrame, bucket_seconds: int | None = None) -> DataFrame:
    """Percentiles (p50, p90, p99, max) of messages and bytes in flight per channel, over completed snapshots.

    With `bucket_seconds`, one row per time bucket (``bucket_start``) and channel; without, one
    row per channel over the whole range. Approximate percentiles (``percentile_approx``, exact
    for up to 10 000 values per group).
    """
    started = snapshots.filter(F.col("outcome") == "completed").select("snapshot_id", "day", "started_at")
    rows = channels.join(started, ["snapshot_id", "day"])
    keys: list[Column] = [F.col("src"), F.col("dst")]
    if bucket_seconds:
        start = F.floor(F.unix_seconds("started_at") / bucket_seconds) * bucket_seconds
        keys.insert(0, F.timestamp_seconds(start).alias("bucket_start"))
    return (
        rows.groupBy(*keys)
        .agg(
            F.countDistinct("snapshot_id").alias("snapshots"),
            *_percentiles("recorded", "messages"),
            *_percentiles("recorded_bytes", "bytes"),
        )
        .orderBy(*(["bucket_start"] if bucket_seconds else []), "src", "dst")
    )


def timeline(evaluations: DataFrame, snapshots: DataFrame, channels: DataFrame) -> DataFrame:
    """One row per completed snapshot: its verdicts, what was deadlocked, messages and bytes in flight.

    Columns: ``snapshot_id, started_at, deadlock, termination, conservation, deadlocked_processes,
    deadlocked_nodes, messages_in_flight, recorded_bytes, busiest_channel_messages``. ``deadlock``
    and ``termination`` are those predicates' verdicts; ``conservation`` is every conserved
    counter's at once (false when one was off, else unknown when one was undecided, else true;
    null without any counter); ``deadlocked_nodes`` counts processes and tasks; both deadlocked
    counts are null where the deadlock verdict is unknown (or missing).
    """

    def predicate(name: str) -> DataFrame:
        return evaluations.filter(F.col("name") == name).select("snapshot_id", verdict().alias(name))

    # The worst verdict over the counters: false above unknown above true.
    rank = F.when(verdict() == Verdict.FALSE.value, 2).when(verdict() == Verdict.UNKNOWN.value, 1).otherwise(0)
    worst = F.max(rank)
    conservation = (
        evaluations.filter(F.col("name").startswith("conservation("))
        .groupBy("snapshot_id")
        .agg(
            F.when(worst == 2, Verdict.FALSE.value)
            .when(worst == 1, Verdict.UNKNOWN.value)
            .otherwise(Verdict.TRUE.value)
            .alias("conservation")
        )
    )
    deadlocked = (
        deadlocked_nodes(evaluations)
        .groupBy("snapshot_id")
        .agg(
            F.countDistinct("process").alias("deadlocked_processes"),
            F.countDistinct("label").alias("deadlocked_nodes"),
        )
    )
    busiest = channels.groupBy("snapshot_id").agg(F.max("recorded").alias("busiest_channel_messages"))
    decided = F.col("deadlock").isin(Verdict.TRUE.value, Verdict.FALSE.value)
    completed = snapshots.filter(F.col("outcome") == "completed")
    return (
        completed.select("snapshot_id", "started_at", "messages_in_flight", "recorded_bytes")
        .join(predicate("deadlock"), "snapshot_id", "left")
        .join(predicate("termination"), "snapshot_id", "left")
        .join(conservation, "snapshot_id", "left")
        .join(deadlocked, "snapshot_id", "left")
        .join(busiest, "snapshot_id", "left")
        .fillna(0, ["deadlocked_processes", "deadlocked_nodes", "busiest_channel_messages"])
        .select(
            "snapshot_id",
            "started_at",
            "deadlock",
            "termination",
            "conservation",
            # None where the deadlock is not decided: 0 would say that nothing is deadlocked.
            *(F.when(decided, F.col(name)).alias(name) for name in ("deadlocked_processes", "deadlocked_nodes")),
            "messages_in_flight",
            "recorded_bytes",
            "busiest_channel_messages",
        )
        .orderBy("started_at", "snapshot_id")
    )


def attribute_totals(processes: DataFrame, snapshots: DataFrame) -> DataFrame:
    """Each numeric attribute's total over the processes of every completed snapshot, in start order.

    Columns: ``snapshot_id, started_at, attribute, total``. Attributes that are not numbers (a
    flag, a name) are left out. One row per snapshot and attribute.
    """
    # Every value read as text, then as a number where it is one (true/false and text are not).
    values = processes.filter(F.coalesce(F.col("attributes"), F.lit("")) != "").select(
        "snapshot_id", F.explode(F.from_json("attributes", "map<string, string>")).alias("attribute", "value")
    )
    numbers = values.select("snapshot_id", "attribute", F.col("value").try_cast("double").alias("value"))
    completed = snapshots.filter(F.col("outcome") == "completed").select("snapshot_id", "started_at")
    return (
        numbers.filter(F.col("value").isNotNull())
        .groupBy("snapshot_id", "attribute")
        .agg(F.sum("value").alias("total"))
        .join(completed, "snapshot_id")
        .select("snapshot_id", "started_at", "attribute", "total")
        .orderBy("attribute", "started_at", "snapshot_id")
    )


def snapshot_outcomes(snapshots: DataFrame) -> DataFrame:
    """Snapshots by outcome and abort kind, with their durations' percentiles (seconds)."""
    duration = _seconds("finished_at", "started_at")
    return (
        snapshots.withColumn("seconds", duration)
        .groupBy("outcome", F.coalesce("abort_kind", F.lit("")).alias("abort_kind"))
        .agg(F.count(F.lit(1)).alias("snapshots"), *_percentiles("seconds", "seconds"))
        .orderBy("outcome", "abort_kind")
    )


def abort_reasons(snapshots: DataFrame, top: int = 20) -> DataFrame:
    """The `top` most frequent abort reasons: kind, reason, how many, first and last time."""
    return (
        snapshots.filter(F.col("outcome") == "aborted")
        .groupBy("abort_kind", "abort_reason")
        .agg(
            F.count(F.lit(1)).alias("snapshots"),
            F.min("started_at").alias("first_at"),
            F.max("started_at").alias("last_at"),
        )
        .orderBy(F.desc("snapshots"), "abort_kind", "abort_reason")
        .limit(top)
    )


def _label(process: Column | str, task: Column | str) -> Column:
    """A wait-for node as text, as :func:`~stablewatch.detector.evaluation.waitfor.label` writes it:
    ``P`` for the process itself, ``P/task`` for one of its tasks (``P /svc/Method#...`` for an RPC call)."""
    task = F.coalesce(F.col(task) if isinstance(task, str) else task, F.lit(""))
    process = F.col(process) if isinstance(process, str) else process
    return (
        F.when(task == "", process)
        .when(task.startswith("/"), F.concat_ws(" ", process, task))
        .otherwise(F.concat_ws("/", process, task))
    )


def breaks(resolutions: DataFrame, snapshots: DataFrame) -> DataFrame:
    """Every archived break of a deadlock, in the order they were sent.

    Columns: ``resolution_id, snapshot_id, sent_at, reported_at, victim`` (``P`` or ``P/task``),
    ``instance, policy, requested_by, outcome`` (broken, gone, already_broken, policies_disagree,
    failed, unanswered, pending), ``deadlock, component_size``, ``waited_seconds`` (how long the victim had waited
    when the break was sent), ``answer_seconds`` (from sending to the agent's answer) and
    ``recovery_seconds`` (for a broken wait, from the start of the snapshot that proved the
    deadlock to the answer: as long as the deadlock can have lasted after it was seen, the
    detector's ``stablewatch_resolution_seconds``; null when that snapshot is not in the range read).
    """
    proving = snapshots.select("snapshot_id", F.col("started_at").alias("proved_by_start"))
    recovery = F.when(F.col("outcome") == "broken", _seconds("reported_at", "proved_by_start"))
    return (
        resolutions.join(proving, "snapshot_id", "left")
        .select(
            "resolution_id",
            "snapshot_id",
            "sent_at",
            "reported_at",
            _label("process_id", "task").alias("victim"),
            "instance",
            "policy",
            "requested_by",
            "outcome",
            "deadlock",
            F.size(F.coalesce("component", F.array())).alias("component_size"),
            _seconds("sent_at", "wait_began_at").alias("waited_seconds"),
            _seconds("reported_at", "sent_at").alias("answer_seconds"),
            recovery.alias("recovery_seconds"),
        )
        .orderBy("sent_at", "resolution_id")
    )


#: The outcomes counted per bucket by :func:`breaks_over_time`, as its columns.
BREAK_OUTCOME_COLUMNS = ("broken", "gone", "already_broken", "policies_disagree", "failed", "unanswered", "pending")


def breaks_over_time(found: DataFrame, bucket_seconds: int) -> DataFrame:
    """Per time bucket of `bucket_seconds` (by when the break was sent), from :func:`breaks`: how
    many breaks, how many of each outcome (``broken`` is the number of deadlocks broken), the
    proving snapshots, the victims (sorted), and percentiles of ``recovery_seconds``. With
    `bucket_seconds` 0, one row over the whole range (``bucket_start`` null); none without breaks.

    Columns: ``bucket_start, breaks, broken, gone, already_broken, policies_disagree, failed,
    unanswered, pending, snapshots, victims, recovery_p50, recovery_p90, recovery_p99, recovery_max``.
    """
    if bucket_seconds:
        start = F.floor(F.unix_seconds("sent_at") / bucket_seconds) * bucket_seconds
        bucket = F.timestamp_seconds(start)
    else:
        bucket = F.lit(None).cast("timestamp")
    return (
        found.groupBy(bucket.alias("bucket_start"))
        .agg(
            F.count(F.lit(1)).alias("breaks"),
            *(F.count(F.when(F.col("outcome") == word, 1)).alias(word) for word in BREAK_OUTCOME_COLUMNS),
            F.countDistinct("snapshot_id").alias("snapshots"),
            F.array_sort(F.collect_set("victim")).alias("victims"),
            *_percentiles("recovery_seconds", "recovery"),
        )
        .orderBy("bucket_start")
    )


# -- the job ------------------------------------------------------------------------------------------------


@dataclass
class History:
    """The history tables (collected: they are aggregates) and where they were written."""

    tables: dict[str, pa.Table]
    out: Path
    chart: Path | None = None
    evaluated: int = 0  # snapshots evaluated in this run (0 when earlier evaluations were read)
    aborted: int = 0
    first_at: datetime | None = None  # the first and last completed snapshot's start
    last_at: datetime | None = None
    files: list[Path] = field(default_factory=list)


def build_history(
    archive: Archive, evaluations: DataFrame, out: Path, bucket_seconds: int = 60, chart: bool = True
) -> History:
    """Compute every history table from `evaluations` and `archive`; write them to ``out/history``; draw the chart."""
    snapshots = archive.table("snapshots").drop("snapshot")
    channels = archive.table("channels")
    resolutions = archive.table("resolutions")  # empty in an archive without breaks
    # The resolutions table is partitioned by the day a break was sent, the snapshots by the day they
    # started: a deadlock proven before the range's last midnight may be broken after it. An
    # episode counts the breaks of its snapshots whenever they were sent (never before the range).
    later = Archive(archive.spark, archive.root, archive.first_day, None)
    proved = resolutions if archive.last_day is None else later.table("resolutions")
    drift = conservation_drift(evaluations)
    found = breaks(resolutions, snapshots)
    frames = {
        "deadlock_episodes": deadlock_episodes(evaluations, proved),
        "recurring_processes": recurring_processes(evaluations),
        "termination_episodes": episodes(evaluations, "termination"),
        "conservation": drift,
        "conservation_summary": conservation_summary(drift),
        "channel_backlog": channel_backlog(channels, snapshots),
        "channel_backlog_over_time": channel_backlog(channels, snapshots, bucket_seconds),
        "timeline": timeline(evaluations, snapshots, channels),
        "attributes": attribute_totals(archive.table("processes"), snapshots),
        "snapshot_outcomes": snapshot_outcomes(snapshots),
        "abort_reasons": abort_reasons(snapshots),
        "breaks": found,
        "breaks_over_time": breaks_over_time(found, bucket_seconds),
    }
    # A corrupt file among the later breaks is named too: `later` checked and read them.
    with archive.reading(), later.reading():
        tables = {name: frame.toArrow() for name, frame in frames.items()}
    folder = out / "history"
    folder.mkdir(parents=True, exist_ok=True)
    files = []
    for name, table in tables.items():
        path = folder / f"{name}.parquet"
        pq.write_table(table, path)
        files.append(path)
    history = History(tables, out, files=files)
    times = tables["timeline"].column("started_at")
    if len(times):
        history.first_at, history.last_at = times[0].as_py(), times[-1].as_py()
    if chart:
        history.chart = draw_history(
            tables["timeline"], tables["deadlock_episodes"], out / "history.png", breaks=tables["breaks"]
        )
    return history


def run_history(
    archive: Path,
    out: Path,
    console: Console | None = None,
    *,
    expected: Mapping[str, int] | None = None,
    predicates: Sequence[str] = (),
    evaluations: Path | None = None,
    bucket_seconds: int = 60,
    reduction: Reduction = DEFAULT_REDUCTION,
    chart: bool = True,
    first_day: str | None = None,
    last_day: str | None = None,
    spark: SparkSession | None = None,
) -> History:
    """The ``history`` job, callable from Python: evaluate `archive` (or read `evaluations`, the output
    of an earlier ``evaluate``), write ``out/evaluations``, ``out/history/*.parquet`` and
    ``out/history.png``, and print the summary on `console` (when given). `reduction` is how large
    snapshots are evaluated (:func:`~.evaluate.evaluate_snapshots`); `first_day` and `last_day`
    limit the day partitions read.

    Raises ArchiveError (naming the file) for bad input.
    """
    spark = spark or get_session()
    opened = open_archive(spark, Path(archive), first_day, last_day)
    for table in ("snapshots", "channels", "resolutions"):  # check every file it reads before any work
        opened.files(table)
    out = Path(out)
    evaluated = aborted = 0
    if evaluations is None:
        result = evaluate_archive(opened, expected, predicates, reduction=reduction)
        evaluated, aborted = result.snapshots, result.aborted
        evaluations = out / "evaluations"
        write_evaluations(result.evaluations, evaluations, opened)
    frame = spark.read.schema(from_arrow_schema(EVALUATIONS)).parquet(str(evaluations)).cache()
    history = build_history(opened, frame, out, bucket_seconds, chart)
    frame.unpersist()
    history.evaluated, history.aborted = evaluated, aborted
    if console is not None:
        console.print(history_report(history))
    return history


@dataclass
class Histories:
    """The history of several systems: each one's :class:`History` and :class:`~.story.Story`, one chart."""

    systems: dict[str, History]
    stories: dict[str, Story]
    out: Path
    chart: Path | None = None


def run_histories(
    archives: Mapping[str, Path],
    out: Path,
    console: Console | None = None,
    *,
    progress: Mapping[str, str] | None = None,
    chart: bool = True,
    spark: SparkSession | None = None,
    **options: Any,
) -> Histories:
    """The ``history`` job on several systems' archives (system name -> archive folder), one after the other.

    Each system's tables go to ``out/<system>`` (as :func:`run_history` writes them, without its
    chart); ``out/history.png`` has one lane per system, in the order given, and `console` (when
    given) gets each system's story. `progress` names, per system, the attribute whose total tells
    its work (e.g. ``meals``). `options` are :func:`run_history`'s. Every archive is checked before
    any work: ArchiveError (naming the folder) for one that is not an archive.
    """
    for archive in archives.values():
        check_archive(Path(archive))
    progress = progress or {}
    out = Path(out)
    systems = {
        name: run_history(Path(archive), out / name, None, chart=False, spark=spark, **options)
        for name, archive in archives.items()
    }
    stories = {name: tell(name, history.tables, progress.get(name)) for name, history in systems.items()}
    histories = Histories(systems, stories, out)
    if chart:
        histories.chart = draw_lanes(list(stories.values()), out / "history.png")
    if console is not None:
        rows = [story.as_dict() for story in stories.values()]
        console.print(stories_report(rows, None if histories.chart is None else str(histories.chart), str(out)))
    return histories
