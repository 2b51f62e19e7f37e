"""Every predicate for every archived snapshot, with the detector's own evaluation function.

Theory of operation. The ``snapshots`` table holds, for each snapshot up to ``MAX_BLOB_BYTES``,
the serialized ``GlobalSnapshot``. Those are evaluated in parallel across snapshots
(``mapInArrow``), each by :func:`stablewatch.detector.evaluation.evaluate`, the function the
detector itself calls: the same predicate on the same snapshot gives the same result, by
construction. A completed snapshot without a blob (too large) is rebuilt from its rows: its
wait-for graph is built and reduced on DataFrames (:mod:`.reduce`), the shared algorithm
(``find_deadlock``) finishes what remains, and the detector's own
:func:`~stablewatch.detector.evaluation.built_in_results` (what ``evaluate`` runs once it has the
graph) turns that evidence, the whole graph's counts and the snapshot rebuilt without its waits
into the results (they do not read the waits; the processes the waits name are kept for the cut's
coverage).

Conservation needs the expected totals the detector would have had: the configured ones, and
for every other counter the baseline set by the first closed snapshot that saw it, in the order
the snapshots finished (``finished_at``, then id). A first pass finds those baselines; each
snapshot is then evaluated with the configured totals plus the baselines set before it.

Aborted snapshots have no global state and are not evaluated.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import networkx as nx
import pyarrow as pa
from google.protobuf import json_format
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.pandas.types import from_arrow_schema

from stablewatch.detector.archive.schema import TABLES, snapshot_from_rows
from stablewatch.detector.evaluation import UserPredicate, built_in_results, evaluate, load_predicate, new_baselines
from stablewatch.detector.evaluation.plugins import entry_point_predicates
from stablewatch.detector.evaluation.predicates import conservation
from stablewatch.detector.evaluation.waitfor import Deadlock, WaitCounts, WaitFor, find_deadlock
from stablewatch.pipeline.reduce import (
    DEFAULT_FINISH_EDGES,
    DEFAULT_MAX_ROUNDS,
    WaitForFrames,
    counted_rows,
    graph_counts,
    numbered_edges,
    reduce_wait_for,
    remaining_graphs,
    remaining_rows,
    wait_for_frames,
)
from stablewatch.pipeline.tables import Archive
from stablewatch.v1 import Evaluation, GlobalSnapshot, PredicateResult

__all__ = [
    "EVALUATIONS",
    "Evaluated",
    "Totals",
    "evaluate_archive",
    "evaluate_blobs",
    "find_totals",
    "order_key",
    "result_table",
    "write_evaluations",
]

_ts = pa.timestamp("us", tz="UTC")

#: One row per predicate result: the archive's ``results`` columns, with the snapshot's start and finish.
EVALUATIONS = TABLES["results"].insert(1, pa.field("started_at", _ts)).insert(2, pa.field("finished_at", _ts))
_HEAD = ["snapshot_id", "started_at", "finished_at", "day"]
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_LAST = 2**63 - 1  # the order of a snapshot without a finish time: after all others
_CANDIDATES = "counter string, finished_us long, snapshot_id long, observed long"


# -- expected totals ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Totals:
    """The expected totals for conservation: configured ones, and baselines with the snapshot that set each.

    `baselines` maps a counter to ``((finished_us, snapshot_id), total)``: the order key of the
    first closed snapshot that saw it, and what it held.
    """

    configured: Mapping[str, int] = field(default_factory=dict)
    baselines: Mapping[str, tuple[tuple[int, int], int]] = field(default_factory=dict)

    def before(self, key: tuple[int, int]) -> dict[str, int]:
        """The totals the detector had when it evaluated the snapshot of order key `key`."""
        totals = dict(self.configured)
        totals.update((counter, total) for counter, (set_at, total) in self.baselines.items() if set_at < key)
        return totals


def order_key(finished_at: datetime | None, snapshot_id: int) -> tuple[int, int]:
    """The order in which the detector evaluated snapshots: by finish time, then id (no time: last)."""
    if finished_at is None:
        return (_LAST, snapshot_id)
    return ((finished_at - _EPOCH) // timedelta(microseconds=1), snapshot_id)


def _baseline_candidates(snapshot: GlobalSnapshot, configured: Mapping[str, int]) -> list[tuple[str, int]]:
    """The counters that `snapshot` would set a baseline for if none was set before, with their totals:
    conservation's own rule, as the detector applies it with only the `configured` totals."""
    return list(new_baselines(Evaluation(results=conservation(snapshot, configured))).items())


def _candidate_batches(batches: Iterator[pa.RecordBatch], configured: Mapping[str, int]) -> Iterator[pa.RecordBatch]:
    for batch in batches:
        rows: dict[str, list[Any]] = {"counter": [], "finished_us": [], "snapshot_id": [], "observed": []}
        for sid, order, blob in zip(
            *(batch.column(n).to_pylist() for n in ("snapshot_id", "finished_us", "snapshot")), strict=True
        ):
            for counter, observed in _baseline_candidates(GlobalSnapshot.FromString(blob), configured):
                rows["counter"].append(counter)
                rows["finished_us"].append(order)
                rows["snapshot_id"].append(sid)
                rows["observed"].append(observed)
        yield pa.RecordBatch.from_pydict(rows, schema=_candidates_schema())


@functools.cache
def _candidates_schema() -> pa.Schema:
    return pa.schema(
        [("counter", pa.string()), ("finished_us", pa.int64()), ("snapshot_id", pa.int64()), ("observed", pa.int64())]
    )


def find_totals(candidates: Iterable[tuple[str, tuple[int, int], int]], configured: Mapping[str, int]) -> Totals:
    """Keep, per counter, the candidate ``(counter, order key, total)`` that comes first in the order."""
    first: dict[str, tuple[tuple[int, int], int]] = {}
    for counter, key, total in candidates:
        if counter not in first or key < first[counter][0]:
            first[counter] = (key, total)
    return Totals(dict(configured), first)


# -- results as rows ----------------------------------------------------------------------------------------


def _evidence_json(result: PredicateResult) -> str:
    kind = result.WhichOneof("evidence")
    if not kind:
        return ""
    return json_format.MessageToJson(
        getattr(result, kind), indent=None, preserving_proto_field_name=True, sort_keys=True
    )


def result_table(heads: pa.RecordBatch | pa.Table, per_snapshot: Sequence[Sequence[PredicateResult]]) -> pa.Table:
    """:data:`EVALUATIONS` rows: for each row of `heads` (columns ``snapshot_id, started_at,
    finished_at, day``), one per result of its snapshot in `per_snapshot`, in order."""
    repeat = pa.array([i for i, results in enumerate(per_snapshot) for _ in results], pa.int64())
    flat = [r for results in per_snapshot for r in results]
    columns: dict[str, Any] = {
        name: heads.column(name).take(repeat).cast(EVALUATIONS.field(name).type) for name in _HEAD
    }
    columns.update(
        position=[i for results in per_snapshot for i in range(len(results))],
        name=[r.name for r in flat],
        holds=[r.holds for r in flat],
        unknown=[r.unknown for r in flat],
        summary=[r.summary for r in flat],
        error=[r.error for r in flat],
        missing_processes=[list(r.missing_processes) for r in flat],
        evidence=[_evidence_json(r) for r in flat],
        result=[r.SerializeToString(deterministic=True) for r in flat],
    )
    return pa.Table.from_pydict({name: columns[name] for name in EVALUATIONS.names}, schema=EVALUATIONS)


@functools.cache
def _plugins(specs: tuple[str, ...]) -> tuple[UserPredicate, ...]:
    """The user predicates, as the detector loads them: installed entry points, then `specs`. Once per process."""
    return (*entry_point_predicates(), *(load_predicate(spec) for spec in specs))


def _evaluate_batches(
    batches: Iterator[pa.RecordBatch], totals: Totals, specs: tuple[str, ...]
) -> Iterator[pa.RecordBatch]:
    plugins = _plugins(specs)
    for batch in batches:
        per_snapshot = []
        for sid, order, blob in zip(
            *(batch.column(n).to_pylist() for n in ("snapshot_id", "finished_us", "snapshot")), strict=True
        ):
            evaluation = evaluate(GlobalSnapshot.FromString(blob), totals.before((order, sid)), plugins)
            per_snapshot.append(evaluation.results)
        yield from result_table(batch, per_snapshot).to_batches()


def _with_order(snapshots: DataFrame) -> DataFrame:
    return snapshots.withColumn("finished_us", F.coalesce(F.unix_micros("finished_at"), F.lit(_LAST)))


def evaluate_blobs(snapshots: DataFrame, totals: Totals, predicates: Sequence[str] = ()) -> DataFrame:
    """Evaluate every snapshot of `snapshots` (rows of the ``snapshots`` table with a blob) in parallel.

    Each is evaluated by the shared ``evaluate`` with ``totals.before(its order key)`` and the
    user predicates (installed entry points, then the import paths `predicates`), loaded once per
    Python worker. Returns :data:`EVALUATIONS` rows, lazily. O(size of the snapshots) in total.
    """
    blobs = _with_order(snapshots).select(*_HEAD, "finished_us", "snapshot")
    specs = tuple(predicates)
    return blobs.mapInArrow(lambda batches: _evaluate_batches(batches, totals, specs), from_arrow_schema(EVALUATIONS))


# -- snapshots too large for one worker ---------------------------------------------------------------------


_NO_WAITS = WaitCounts(0, 0, 0, 0)  # a snapshot without waits has no row in graph_counts


@dataclass
class _Large:
    """A snapshot archived without its blob: its head, the snapshot rebuilt without waits, its graph's deadlock."""

    head: dict[str, Any]
    light: bytes  # the serialized GlobalSnapshot without waits (see _light_snapshot)
    counts: WaitCounts = _NO_WAITS  # of the whole wait-for graph, which only the DataFrames hold
    deadlock: Deadlock | None = None  # find_deadlock on what the reduction left


def _group_rows(table: pa.Table) -> dict[int, list[dict[str, Any]]]:
    groups: dict[int, list[dict[str, Any]]] = {}
    for row in table.to_pylist():
        groups.setdefault(row["snapshot_id"], []).append(row)
    return groups


def _light_snapshot(
    head: Mapping[str, Any], rows: Mapping[str, Mapping[int, list[dict[str, Any]]]], targets: Sequence[str]
) -> GlobalSnapshot:
    """Rebuild snapshot `head` from its rows without its waits; the processes they name join ``outside_peers``.

    Coverage, termination and conservation read processes, channels, messages, counters and the
    names the cut must hold: ``outside_peers`` now carries the wait targets' processes, so the
    cut's coverage is that of the whole snapshot.
    """
    sid = head["snapshot_id"]
    peers = sorted({*(head.get("outside_peers") or []), *targets})
    return snapshot_from_rows(
        {**head, "outside_peers": peers},
        rows["processes"].get(sid, []),
        rows["counters"].get(sid, []),
        [],
        rows["channels"].get(sid, []),
        rows["messages"].get(sid, []),
    )


def _chunks(heads: Sequence[dict[str, Any]], max_rows: int) -> Iterator[list[dict[str, Any]]]:
    """Split `heads` so that each chunk's rows (as the heads count them) stay under `max_rows`, one head at least."""
    chunk: list[dict[str, Any]] = []
    rows = 0
    for head in heads:
        size = 2 * head["processes"] + 2 * head["channels"] + head["messages_in_flight"]
        if chunk and rows + size > max_rows:
            yield chunk
            chunk, rows = [], 0
        chunk.append(head)
        rows += size
    if chunk:
        yield chunk


def _rows_of(archive: Archive, table: str, heads: Sequence[Mapping[str, Any]]) -> DataFrame:
    """The rows of `table` that belong to the snapshots `heads` (their days' partitions only)."""
    ids = [head["snapshot_id"] for head in heads]
    days = sorted({head["day"] for head in heads})
    return archive.table(table).filter(F.col("day").isin(days) & F.col("snapshot_id").isin(ids))


def _rebuild_light(archive: Archive, heads: Sequence[dict[str, Any]], max_rows: int) -> dict[int, _Large]:
    """Rebuild each large snapshot without its waits, collecting the rows of a bounded chunk at a time."""
    large: dict[int, _Large] = {}
    for chunk in _chunks(heads, max_rows):
        rows = {
            name: _group_rows(_rows_of(archive, name, chunk).toArrow())
            for name in ("processes", "counters", "channels", "messages")
        }
        named = (
            _rows_of(archive, "wait_edges", chunk)
            .filter(F.col("target_process").isNotNull() & (F.col("target_process") != ""))
            .select("snapshot_id", "target_process")
            .distinct()
            .toArrow()
        )
        targets: dict[int, list[str]] = {}
        for sid, process in zip(
            named.column("snapshot_id").to_pylist(), named.column("target_process").to_pylist(), strict=True
        ):
            targets.setdefault(sid, []).append(process)
        for head in chunk:
            sid = head["snapshot_id"]
            light = _light_snapshot(head, rows, targets.get(sid, []))
            large[sid] = _Large(head, light.SerializeToString(deterministic=True))
    return large


def _reduce_large(archive: Archive, large: dict[int, _Large], max_rounds: int, finish_edges: int) -> tuple[int, int]:
    """Build, reduce and finish the wait-for graphs of the `large` snapshots, all at once.

    Returns the rounds run and the edges left to the shared algorithm.

    When all their counted edges together are `finish_edges` or fewer, no round runs: the edges
    go straight to the shared algorithm.
    """
    with _no_broadcast_joins(archive.spark):
        return _reduce_large_graphs(archive, large, max_rounds, finish_edges)


@contextlib.contextmanager
def _no_broadcast_joins(spark: SparkSession) -> Iterator[None]:
    """Plan every join as a shuffle meanwhile: the graphs of large snapshots are too big to broadcast.

    Spark's size estimates of filtered and aggregated frames are often far below what they hold
    (a million-node graph was estimated small enough), and a broadcast that does not fit stops the
    job; shuffled joins only spill. The session's settings are restored afterwards.
    """
    keys = ("spark.sql.autoBroadcastJoinThreshold", "spark.sql.adaptive.autoBroadcastJoinThreshold")
    before = {key: spark.conf.get(key, None) for key in keys}
    for key in keys:
        spark.conf.set(key, "-1")
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                spark.conf.unset(key)
            else:
                spark.conf.set(key, value)


def _reduce_large_graphs(
    archive: Archive, large: dict[int, _Large], max_rounds: int, finish_edges: int
) -> tuple[int, int]:
    heads = [item.head for item in large.values()]
    processes, *tables = (
        _rows_of(archive, name, heads) for name in ("processes", "wait_edges", "messages", "channels")
    )
    frames = wait_for_frames(processes, *tables)
    frames = WaitForFrames(frames.waiters.localCheckpoint(), frames.edges.localCheckpoint())
    for row in graph_counts(frames, processes).collect():
        counts = WaitCounts(row["waiters"], row["edges"], row["discounted"], row["outside"])
        large[row["snapshot_id"]].counts = counts
    rounds = 0
    if max_rounds and sum(item.counts[1] for item in large.values()) > finish_edges:
        nodes, edges = numbered_edges(frames)
        remaining, rounds = reduce_wait_for(edges, max_rounds, finish_edges)
        rows = remaining_rows(frames, nodes, remaining)
    else:
        rows = counted_rows(frames)
    table = rows.toArrow()
    graphs = remaining_graphs(table)
    for sid, item in large.items():
        # The remaining graph holds every deadlocked node and the edges among them, all the evidence reads.
        item.deadlock = find_deadlock(WaitFor(sid, graphs.get(sid) or nx.DiGraph(), ()))
    return rounds, table.num_rows


def _evaluate_large(item: _Large, totals: Totals, plugin_names: Sequence[str]) -> list[PredicateResult]:
    """Every result of a large snapshot, in ``evaluate``'s order, by the detector's ``built_in_results``
    from the reduced graph's evidence and the whole graph's counts; user predicates are not run on it."""
    assert item.deadlock is not None
    head = item.head
    expected = totals.before((head["finished_us"], head["snapshot_id"]))
    results = built_in_results(GlobalSnapshot.FromString(item.light), item.deadlock, item.counts, expected)
    reason = "snapshot archived without its blob (too large for one worker): user predicates need the whole snapshot"
    results += [
        PredicateResult(name=name, holds=False, unknown=True, summary=f"not evaluated: {reason}", error=reason)
        for name in plugin_names
    ]
    return results


# -- the job ------------------------------------------------------------------------------------------------


@dataclass
class Evaluated:
    """What :func:`evaluate_archive` did: the result rows (a DataFrame) and what it counted on the way."""

    evaluations: DataFrame
    snapshots: int  # completed snapshots evaluated
    aborted: int  # aborted snapshots in the range (not evaluated)
    large: int  # snapshots evaluated through the DataFrame reduction
    rounds: int  # reduction rounds run
    remaining: int  # wait edges left to the shared algorithm after the rounds
    totals: Totals


def _heads(archive: Archive, first_id: int | None, last_id: int | None) -> DataFrame:
    snapshots = archive.table("snapshots")
    if first_id is not None:
        snapshots = snapshots.filter(F.col("snapshot_id") >= first_id)
    if last_id is not None:
        snapshots = snapshots.filter(F.col("snapshot_id") <= last_id)
    return snapshots


def evaluate_snapshots(
    archive: Archive,
    snapshots: DataFrame,
    expected: Mapping[str, int] | None = None,
    predicates: Sequence[str] = (),
    *,
    reduce_above: int | None = None,
    max_rounds: int = DEFAULT_MAX_ROUNDS,
    finish_edges: int = DEFAULT_FINISH_EDGES,
    max_rows: int = 2_000_000,
) -> Evaluated:
    """Evaluate the completed snapshots among `snapshots` (rows of `archive`'s ``snapshots`` table).

    Snapshots without a blob, and those with more than `reduce_above` wait edges when it is set,
    go through the DataFrame reduction (at most `max_rounds` rounds, none once `finish_edges`
    edges or fewer remain; their rows are collected `max_rows` at a time); the others are
    evaluated by the shared function in parallel.
    `expected` are the conservation totals known before these snapshots (configured, or earlier
    baselines). Runs the Spark jobs that count the snapshots, find the baselines and reduce the
    large snapshots; returns the result rows lazily.
    """
    configured = dict(expected or {})
    completed = _with_order(snapshots.filter(F.col("outcome") == "completed"))
    routed = F.col("snapshot").isNull()
    if reduce_above is not None:
        routed = routed | (F.col("wait_edges") > reduce_above)
    small = completed.filter(~routed)
    with archive.reading():
        outcomes = snapshots.agg(
            F.count(F.when(F.col("outcome") == "completed", 1)).alias("completed"),
            F.count(F.when(F.col("outcome") != "completed", 1)).alias("aborted"),
        ).first()
        heads = completed.filter(routed).drop("snapshot").toArrow().sort_by("snapshot_id")
        large = _rebuild_light(archive, heads.to_pylist(), max_rows)
        candidates = _small_candidates(small, configured)
        for sid, item in large.items():
            key = (item.head["finished_us"], sid)
            light = GlobalSnapshot.FromString(item.light)
            candidates += [(counter, key, total) for counter, total in _baseline_candidates(light, configured)]
        totals = find_totals(candidates, configured)
        rounds, remaining = _reduce_large(archive, large, max_rounds, finish_edges) if large else (0, 0)

    evaluations = evaluate_blobs(small, totals, predicates)
    if large:
        names = [plugin.name for plugin in _plugins(tuple(predicates))]
        results = [_evaluate_large(large[sid], totals, names) for sid in heads.column("snapshot_id").to_pylist()]
        evaluations = evaluations.unionByName(archive.spark.createDataFrame(result_table(heads, results)))
    assert outcomes is not None
    return Evaluated(evaluations, outcomes["completed"], outcomes["aborted"], len(large), rounds, remaining, totals)


def _small_candidates(small: DataFrame, configured: Mapping[str, int]) -> list[tuple[str, tuple[int, int], int]]:
    """The first baseline candidate of every counter among snapshots with a blob (one Spark job)."""
    firsts = (
        small.select("snapshot_id", "finished_us", "snapshot")
        .mapInArrow(lambda batches: _candidate_batches(batches, configured), _CANDIDATES)
        .groupBy("counter")
        .agg(F.min(F.struct("finished_us", "snapshot_id", "observed")).alias("first"))
        .select("counter", "first.*")
        .collect()
    )
    return [(row["counter"], (row["finished_us"], row["snapshot_id"]), row["observed"]) for row in firsts]


def evaluate_archive(
    archive: Archive,
    expected: Mapping[str, int] | None = None,
    predicates: Sequence[str] = (),
    *,
    first_id: int | None = None,
    last_id: int | None = None,
    reduce_above: int | None = None,
    max_rounds: int = DEFAULT_MAX_ROUNDS,
    finish_edges: int = DEFAULT_FINISH_EDGES,
) -> Evaluated:
    """Evaluate every completed snapshot of `archive` (ids from `first_id` to `last_id`, inclusive);
    see :func:`evaluate_snapshots` for the rest."""
    return evaluate_snapshots(
        archive,
        _heads(archive, first_id, last_id),
        expected,
        predicates,
        reduce_above=reduce_above,
        max_rounds=max_rounds,
        finish_edges=finish_edges,
    )


def write_evaluations(evaluations: DataFrame, out: Path, archive: Archive | None = None) -> None:
    """Write `evaluations` to ``out`` as Parquet, partitioned by day (replacing what was there)."""
    if archive is None:
        evaluations.write.mode("overwrite").partitionBy("day").parquet(str(out))
        return
    with archive.reading():
        evaluations.write.mode("overwrite").partitionBy("day").parquet(str(out))
