"""Every predicate for every archived snapshot, with the detector's own evaluation function.

Theory of operation. The ``snapshots`` table holds, for each snapshot up to ``MAX_BLOB_BYTES``,
the serialized ``GlobalSnapshot``. Those are evaluated in parallel across snapshots
(``mapInArrow``), each by :func:`stablewatch.detector.evaluation.evaluate`, the function the
detector itself calls: the same predicate on the same snapshot gives the same result, by
construction.

A completed snapshot without a blob (too large) is evaluated from its rows, without rebuilding
its ``GlobalSnapshot``: the archive's reader reads them as Arrow columns on the driver (which
holds the archive's files: it checks every one), and the detector's columnar evaluation
(:mod:`stablewatch.detector.evaluation.columnar`) applies the same rules to whole columns. Its
wait-for graph, up to ``finish_edges`` wait edges (:class:`~.defaults.Reduction`), is built and
reduced whole in compact form by the shared algorithm; a larger one is built and reduced on
DataFrames first (:mod:`.reduce`), round by round until a round releases little, and what remains
is finished by the same algorithm in compact form. The detector's own result functions
(:func:`~stablewatch.detector.evaluation.predicates.deadlock_result`, ``termination_result``,
``conservation_results``: what ``evaluate`` runs once it has the graph) turn that evidence, the
whole graph's counts and the other facts of the rows into the results. Their evidence is written
as JSON field by field (:func:`evidence_json`), as ``MessageToJson`` would write it.

Conservation needs the expected totals the detector would have had: the configured ones, and
for every other counter the baseline set by the first closed snapshot that saw it, in the order
the snapshots finished (``finished_at``, then id). A first pass finds those baselines; each
snapshot is then evaluated with the configured totals plus the baselines set before it. The
baselines the detector took before the snapshots evaluated (a range that leaves earlier ones out,
an archive begun later), and the new ones it took when restarted on a fresh store (each snapshot
compared with the latest set before it), come from its archived results
(:func:`detector_baselines`). A snapshot archived twice is refused (ArchiveError), as the
archive's own reader refuses it, rather than evaluated and counted twice.

Aborted snapshots have no global state and are not evaluated.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import operator
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa
from google.protobuf import json_format
from pyspark import InheritableThread
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.pandas.types import from_arrow_schema

from stablewatch.detector.archive.reader import read_snapshot_rows
from stablewatch.detector.archive.schema import TABLES, ArchiveError
from stablewatch.detector.evaluation import UserPredicate, evaluate, load_predicate, new_baselines
from stablewatch.detector.evaluation.columnar import (
    LightFacts,
    RowsError,
    compact_edges,
    compact_wait_for,
    find_compact_deadlock,
    light_facts,
)
from stablewatch.detector.evaluation.plugins import check_names, entry_point_predicates
from stablewatch.detector.evaluation.predicates import (
    Holding,
    check_expected_totals,
    conservation,
    conservation_results,
    deadlock_result,
)
from stablewatch.detector.evaluation.waitfor import Deadlock, WaitCounts
from stablewatch.pipeline.defaults import DEFAULT_REDUCTION, Reduction
from stablewatch.pipeline.reduce import (
    WaitForFrames,
    counted_rows,
    graph_counts,
    numbered_edges,
    reduce_wait_for,
    remaining_rows,
    wait_for_frames,
)
from stablewatch.pipeline.tables import Archive
from stablewatch.v1 import Evaluation, GlobalSnapshot, PredicateResult

__all__ = [
    "EVALUATIONS",
    "PLAIN_COLUMNS",
    "Evaluated",
    "Totals",
    "detector_baselines",
    "evaluate_archive",
    "evaluate_blobs",
    "evidence_json",
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
_T = TypeVar("_T")
_CANDIDATES = "counter string, finished_us long, snapshot_id long, observed long"


# -- expected totals ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Totals:
    """The expected totals for conservation: configured ones, and baselines with the snapshot that set each.

    `baselines` maps a counter to its baselines ``((finished_us, snapshot_id), total)`` in order:
    the order key of the snapshot that set each, and what it held. There is more than one when a
    detector restarted on a fresh store took a new one; a snapshot is compared with the latest
    set before it, and one that set a baseline with none (the detector had none when it took it).
    """

    configured: Mapping[str, int] = field(default_factory=dict)
    baselines: Mapping[str, tuple[tuple[tuple[int, int], int], ...]] = field(default_factory=dict)

    def before(self, key: tuple[int, int]) -> dict[str, int]:
        """The totals the detector had when it evaluated the snapshot of order key `key`."""
        totals = dict(self.configured)
        for counter, taken in self.baselines.items():
            known = [(set_at, total) for set_at, total in taken if set_at <= key]
            if known and known[-1][0] < key:  # set at `key`: that snapshot took it, having none
                totals[counter] = known[-1][1]
        return totals

    def latest(self) -> dict[str, int]:
        """Each counter's latest baseline: what a snapshot after all of them is compared with."""
        return {counter: taken[-1][1] for counter, taken in self.baselines.items() if taken}


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


def find_totals(
    candidates: Iterable[tuple[str, tuple[int, int], int]],
    configured: Mapping[str, int],
    detectors: Iterable[tuple[str, tuple[int, int], int]] = (),
) -> Totals:
    """The baselines, each ``(counter, order key, total)``: per counter, every one the detector took
    (`detectors`, :func:`detector_baselines`), and the first of the `candidates` (the first closed
    snapshot that saw it) when it comes before all those: the detector had no baseline yet then."""
    first: dict[str, tuple[tuple[int, int], int]] = {}
    taken: dict[str, dict[tuple[int, int], int]] = {}
    for counter, key, total in detectors:
        taken.setdefault(counter, {})[key] = total
    for counter, key, total in candidates:
        if counter not in first or key < first[counter][0]:
            first[counter] = (key, total)
    for counter, (key, total) in first.items():
        kept = taken.setdefault(counter, {})
        if all(key < other for other in kept):
            kept[key] = total
    return Totals(dict(configured), {counter: tuple(sorted(kept.items())) for counter, kept in taken.items()})


# -- results as rows ----------------------------------------------------------------------------------------


def evidence_json(result: PredicateResult) -> str:
    """The evidence of `result` as JSON (``""`` when it has none), exactly as protobuf's ``MessageToJson``
    writes it (snake_case names, sorted keys, no indent, int64 as strings, defaults left out).

    The built-in evidence is written field by field, several times faster than ``MessageToJson``'s
    reflection: the evidence of a million-node deadlock or of a million holdings is millions of
    small messages. Lists of names that ``json.dumps`` would not escape (printable ASCII without
    quotes or backslashes, as process ids are) are joined as text; others go through
    ``json.dumps``. User predicates' details go through ``MessageToJson`` itself.
    """
    kind = result.WhichOneof("evidence")
    if not kind:
        return ""
    evidence = getattr(result, kind)
    if kind == "deadlock":
        return _deadlock_json(
            *(_pairs(getattr(evidence, name)) for name in ("deadlocked", "cycle", "knot")),
            [(c.src, c.dst) for c in evidence.empty_channels],
            evidence.separate_deadlocks,
        )
    if kind == "conservation" and all(bool(h.process) != h.HasField("channel") for h in evidence.holdings):
        holdings = [(h.process or (h.channel.src, h.channel.dst), h.amount) for h in evidence.holdings]
        return _conservation_json(evidence, holdings)
    if kind == "termination":
        return _object(
            _fields(
                ("active_processes", list(evidence.active_processes)),
                ("busy_channels", [_channel(c.src, c.dst) for c in evidence.busy_channels]),
                ("released_sends", [_channel(c.src, c.dst) for c in evidence.released_sends]),
            )
        )
    return json_format.MessageToJson(evidence, indent=None, preserving_proto_field_name=True, sort_keys=True)


#: The bytes that ``json.dumps`` (ensure_ascii) writes as themselves in a string: printable ASCII
#: but the quote and the backslash.
_PLAIN_BYTES = bytes(c for c in range(0x20, 0x7F) if c not in b'"\\')

_first = operator.itemgetter(0)
_second = operator.itemgetter(1)


class _Raw:
    """Text that is JSON already, in parts that :func:`_object` joins once with the rest: the text
    of a huge list is copied once into the evidence, not again at each level that wraps it."""

    __slots__ = ("parts",)

    def __init__(self, *parts: str) -> None:
        self.parts = parts


def _object(fields: dict[str, Any]) -> str:
    """``json.dumps(fields, sort_keys=True)``, the values that are :class:`_Raw` written as they are."""
    parts = ["{"]
    for i, (name, value) in enumerate(sorted(fields.items())):
        parts += (", " if i else "", json.dumps(name), ": ")
        if isinstance(value, _Raw):
            parts += value.parts
        else:
            parts.append(json.dumps(value, sort_keys=True))
    parts.append("}")
    return "".join(parts)


def _plain(texts: Sequence[str]) -> bool:
    """Whether ``json.dumps`` writes each of `texts` as itself between quotes (its UTF-8 bytes all plain:
    one pass in C; a lone surrogate is not, as its bytes show)."""
    return not "".join(texts).encode("utf-8", "surrogatepass").translate(None, _PLAIN_BYTES)


def _pairs(nodes: Any) -> list[tuple[str, str]]:
    """``WaitNode`` messages as ``(process, task)`` pairs, the form of ``Deadlock``'s lists."""
    return [(node.process, node.task) for node in nodes]


def _nodes(pairs: Sequence[tuple[str, str]]) -> _Raw:
    """A list of ``WaitNode`` (as ``(process, task)`` pairs) as JSON."""
    if not pairs:
        return _Raw("[]")
    processes = list(map(_first, pairs))
    if all(processes) and not any(map(_second, pairs)) and _plain(processes):  # processes alone, the usual case
        return _Raw('[{"process": "', '"}, {"process": "'.join(processes), '"}]')
    tasks = list(map(_second, pairs))
    if not (_plain(processes) and _plain(tasks)):
        return _Raw(json.dumps([_fields(("process", p), ("task", t)) for p, t in pairs], sort_keys=True))
    items = []
    for process, task in pairs:
        fields = ([f'"process": "{process}"'] if process else []) + ([f'"task": "{task}"'] if task else [])
        items.append("{" + ", ".join(fields) + "}")
    return _Raw("[", ", ".join(items), "]")


def _fields(*pairs: tuple[str, Any]) -> dict[str, Any]:
    """The pairs whose value is not the default (proto3 leaves those out)."""
    return {name: value for name, value in pairs if value}


def _channel(src: str, dst: str) -> dict[str, str]:
    return _fields(("src", src), ("dst", dst))


def _deadlock_json(
    deadlocked: Sequence[tuple[str, str]],
    cycle: Sequence[tuple[str, str]],
    knot: Sequence[tuple[str, str]],
    empty_channels: Sequence[tuple[str, str]],
    separate: int,
) -> str:
    """``DeadlockEvidence`` as JSON, from its values."""
    written: dict[str, Any] = {
        name: _nodes(nodes) for name, nodes in (("deadlocked", deadlocked), ("cycle", cycle), ("knot", knot)) if nodes
    }
    if empty_channels:
        written["empty_channels"] = [_channel(src, dst) for src, dst in empty_channels]
    if separate:
        written["separate_deadlocks"] = separate  # uint32: a number
    return _object(written)


def _holdings(holdings: Sequence[Holding]) -> _Raw:
    """A list of ``CounterHolding`` (as :data:`Holding` pairs: a process or a channel, and the amount)
    as JSON (int64 amounts as strings)."""
    processes = list(map(_first, holdings))
    if all(isinstance(p, str) and p for p in processes) and all(map(_second, holdings)) and _plain(processes):
        return _Raw("[", ", ".join([f'{{"amount": "{a}", "process": "{p}"}}' for p, a in holdings]), "]")
    written = []
    for where, amount in holdings:
        fields = _fields(("amount", str(amount) if amount else ""))
        if isinstance(where, str):
            fields.update(_fields(("process", where)))
        else:
            fields["channel"] = _channel(*where)
        written.append(fields)
    return _Raw(json.dumps(written, sort_keys=True))


def _conservation_json(evidence: Any, holdings: Sequence[Holding]) -> str:
    """``ConservationEvidence`` as JSON: its single fields from `evidence`, its holdings from `holdings`."""
    written: dict[str, Any] = _fields(("counter", evidence.counter), ("baseline", evidence.baseline))
    for name in ("expected", "observed", "drift"):
        value = getattr(evidence, name)
        if value:
            written[name] = str(value)  # int64: a string
    if holdings:
        written["holdings"] = _holdings(holdings)
    return _object(written)


def result_table(
    heads: pa.RecordBatch | pa.Table,
    per_snapshot: Sequence[Sequence[PredicateResult]],
    evidence: Sequence[Sequence[str]] | None = None,
) -> pa.Table:
    """:data:`EVALUATIONS` rows: for each row of `heads` (columns ``snapshot_id, started_at,
    finished_at, day``), one per result of its snapshot in `per_snapshot`, in order; `evidence`,
    when given, holds their evidence as JSON already (else :func:`evidence_json` writes it)."""
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
        evidence=[text for texts in evidence for text in texts] if evidence else [evidence_json(r) for r in flat],
        result=[r.SerializeToString(deterministic=True) for r in flat],
    )
    return pa.Table.from_pydict({name: columns[name] for name in EVALUATIONS.names}, schema=EVALUATIONS)


@functools.cache
def user_predicates(specs: tuple[str, ...]) -> tuple[UserPredicate, ...]:
    """The user predicates, as the detector loads them: installed entry points, then `specs`, no
    two of one name (PluginError, as for a spec that does not load). Once per process."""
    return check_names([*entry_point_predicates(), *(load_predicate(spec) for spec in specs)])


def _evaluate_batches(
    batches: Iterator[pa.RecordBatch], totals: Totals, specs: tuple[str, ...]
) -> Iterator[pa.RecordBatch]:
    plugins = user_predicates(specs)
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
    """A snapshot archived without its blob, as far as it is evaluated: its head, what its results read
    besides the graph, its conservation results with the configured totals, and its graph's deadlock."""

    head: dict[str, Any]
    facts: LightFacts
    conservation: list[PredicateResult]
    counts: WaitCounts = _NO_WAITS  # of the whole wait-for graph
    deadlock: Deadlock | None = None  # the shared algorithm's evidence, on the whole graph or what rounds left


def _by_snapshot(table: pa.Table) -> dict[int, pa.Table]:
    """`table`'s rows per snapshot id."""
    if table.num_rows == 0:
        return {}
    ids = table["snapshot_id"].to_numpy()
    if (ids == ids[0]).all():
        return {int(ids[0]): table}
    order = np.argsort(ids, kind="stable")
    ordered = ids[order]
    starts = np.flatnonzero(np.concatenate([[True], ordered[1:] != ordered[:-1]]))
    bounds = [*starts.tolist(), len(ids)]
    return {int(ordered[a]): table.take(pa.array(order[a:b])) for a, b in itertools.pairwise(bounds)}


def _rows_of(archive: Archive, table: str, heads: Sequence[Mapping[str, Any]]) -> DataFrame:
    """The rows of `table` that belong to the snapshots `heads` (their days' partitions only)."""
    ids = [head["snapshot_id"] for head in heads]
    days = sorted({head["day"] for head in heads})
    return archive.table(table).filter(F.col("day").isin(days) & F.col("snapshot_id").isin(ids))


def _large_snapshots(
    archive: Archive, heads: Sequence[dict[str, Any]], configured: Mapping[str, int], finish_edges: int
) -> tuple[dict[int, _Large], list[int]]:
    """Evaluate the snapshots `heads` as far as their rows allow, one at a time.

    Each snapshot's rows are read as Arrow columns by the archive's own reader, here on the driver,
    which has the archive's files (it checks every one): Spark's scan and Arrow transfer of a
    million-process snapshot's rows cost more than its whole evaluation. One with at most
    `finish_edges` wait edges is evaluated whole in compact form (its graph built and reduced by
    the shared algorithm, :mod:`stablewatch.detector.evaluation.columnar`); of a larger one only
    the processes its waits name are read, and its graph is left to the DataFrame reduction: its
    id is returned.
    """
    large: dict[int, _Large] = {}
    reduced: list[int] = []
    for head in heads:
        sid = head["snapshot_id"]
        whole = (head["wait_edges"] or 0) <= finish_edges
        try:
            rows = read_snapshot_rows(archive.root, sid, waits=whole)
            facts = light_facts(rows)
            item = _Large(head, facts, conservation_results(facts.holdings, configured, facts.cut))
            if whole:
                wait_for = compact_wait_for(rows)
                item.counts, item.deadlock = wait_for.counts, find_compact_deadlock(wait_for)
            else:
                reduced.append(sid)
        except RowsError as error:
            raise ArchiveError(f"{archive.root}: {error}") from None
        del rows
        large[sid] = item
    return large, reduced


def _reduce_large(archive: Archive, large: dict[int, _Large], reduction: Reduction) -> tuple[int, int]:
    """Build, reduce and finish the wait-for graphs of the `large` snapshots on DataFrames, all at once.

    Returns the rounds run and the edges left to the shared algorithm. When all their counted
    edges together are `reduction`'s ``finish_edges`` or fewer, no round runs: the edges go
    straight to it.
    """
    with _no_broadcast_joins(archive.spark):
        return _reduce_large_graphs(archive, large, reduction)


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


_REMAINING = ["snapshot_id", "process", "task", "is_or", "rank", "sub", "target_process", "target_task", "position"]


def _reduce_large_graphs(archive: Archive, large: dict[int, _Large], reduction: Reduction) -> tuple[int, int]:
    heads = [item.head for item in large.values()]
    processes, *tables = (
        _rows_of(archive, name, heads) for name in ("processes", "wait_edges", "messages", "channels")
    )
    open_snapshots = [sid for sid, item in large.items() if not item.facts.cut.closed]
    frames = wait_for_frames(processes, *tables, open_snapshots=open_snapshots)
    frames = WaitForFrames(
        frames.waiters.localCheckpoint(), frames.edges.localCheckpoint(), frames.undecided.localCheckpoint()
    )
    for row in graph_counts(frames, processes).collect():
        counts = WaitCounts(row["waiters"], row["edges"], row["discounted"], row["outside"], row["undecided"])
        large[row["snapshot_id"]].counts = counts
    rounds = 0
    if reduction.max_rounds and sum(item.counts.edges for item in large.values()) > reduction.finish_edges:
        nodes, edges = numbered_edges(frames)
        remaining, rounds = reduce_wait_for(edges, reduction.max_rounds, reduction.finish_edges, reduction.min_release)
        rows = remaining_rows(frames, nodes, remaining)
    else:
        rows = counted_rows(frames)
    table = rows.select(*_REMAINING, "flow_control").toArrow()
    graphs = _by_snapshot(table)
    for sid, item in large.items():
        # The remaining graph holds every deadlocked node and the edges among them, all the evidence reads.
        edges = graphs.get(sid, table.schema.empty_table())
        item.deadlock = find_compact_deadlock(compact_edges(edges, item.counts))
    return rounds, table.num_rows


def _large_results(
    item: _Large, configured: Mapping[str, int], totals: Totals, plugin_names: Sequence[str]
) -> list[PredicateResult]:
    """Every result of a large snapshot, in ``evaluate``'s order, by the detector's own result functions
    from the graph's evidence and the rows' facts; user predicates are not run on it."""
    assert item.deadlock is not None
    head = item.head
    facts = item.facts
    expected = totals.before((head["finished_us"], head["snapshot_id"]))
    results = [deadlock_result(item.deadlock, item.counts, facts.cut, facts.termination), facts.termination]
    if expected == dict(configured):
        results += item.conservation
    else:  # an earlier snapshot set a baseline
        results += conservation_results(facts.holdings, expected, facts.cut)
    reason = "snapshot archived without its blob (too large for one worker): user predicates need the whole snapshot"
    results += [
        PredicateResult(name=name, holds=False, unknown=True, summary=f"not evaluated: {reason}", error=reason)
        for name in plugin_names
    ]
    return results


def _large_evidence(item: _Large, results: Sequence[PredicateResult]) -> list[str]:
    """:func:`evidence_json` of each of a large snapshot's `results` (:func:`_large_results`), its
    deadlock's and conservation's written from the values they were built from (the graph's
    evidence, the rows' holdings) instead of read back from their messages' million parts: the
    same text, by the same writers."""
    assert item.deadlock is not None
    found, holdings = item.deadlock, item.facts.holdings
    written = []
    for result in results:
        kind = result.WhichOneof("evidence")
        if kind == "deadlock":  # deadlock_result(found, ...): its evidence is evidence_proto(found)
            written.append(
                _deadlock_json(found.deadlocked, found.cycle, found.knot, found.empty_channels, found.separate)
            )
        elif kind == "conservation":  # conservation_results(holdings, ...): every holding of its counter
            written.append(_conservation_json(result.conservation, holdings.get(result.conservation.counter, ())))
        else:
            written.append(evidence_json(result))
    return written


# -- the job ------------------------------------------------------------------------------------------------


@dataclass
class Evaluated:
    """What :func:`evaluate_archive` did: the result rows (a DataFrame) and what it counted on the way."""

    evaluations: DataFrame
    snapshots: int  # completed snapshots evaluated
    aborted: int  # aborted snapshots in the range (not evaluated)
    large: int  # snapshots evaluated from their rows (without a blob, or above Reduction.reduce_above)
    rounds: int  # reduction rounds run on DataFrames
    remaining: int  # wait edges the shared algorithm finished in compact form (a whole graph's, or what rounds left)
    totals: Totals
    reduced: int = 0  # large snapshots whose graphs went through the DataFrame reduction


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
    reduction: Reduction = DEFAULT_REDUCTION,
    earlier: Sequence[tuple[str, tuple[int, int], int]] = (),
    seen: Sequence[tuple[str, tuple[int, int], int]] = (),
) -> Evaluated:
    """Evaluate the completed snapshots among `snapshots` (rows of `archive`'s ``snapshots`` table).

    Snapshots without a blob, and those with more than `reduction`'s ``reduce_above`` wait edges
    when it is set, are evaluated from their rows, read as Arrow columns one snapshot at a time:
    one with at most ``finish_edges`` wait edges whole, in compact form by the shared algorithm; a
    larger one through the DataFrame reduction first (at most ``max_rounds`` rounds, none once
    ``finish_edges`` edges or fewer remain, the last one a round that removed less than
    ``min_release`` of its edges). The others are evaluated by the shared function in parallel.
    `expected` are the conservation totals known before these snapshots (configured, or earlier
    baselines); `earlier` are baselines the detector took on snapshots that may lie outside
    `snapshots` (:func:`detector_baselines`); `seen` are baseline candidates found in snapshots
    evaluated before these (``follow``'s earlier micro-batches), candidates beside those found
    here (the first of each counter wins, unless the detector took one before it). Runs the Spark
    jobs that check that no snapshot is archived twice, count the snapshots, find the baselines
    and evaluate the large snapshots; returns the result rows lazily. ArchiveError names a
    snapshot archived twice and its files.
    """
    configured = dict(expected or {})
    check_expected_totals(configured)  # ValueError: a drift from it would not be a 64-bit integer
    _refuse_duplicates(archive, snapshots)
    completed = _with_order(snapshots.filter(F.col("outcome") == "completed"))
    routed = F.col("snapshot").isNull()
    if reduction.reduce_above is not None:
        routed = routed | (F.col("wait_edges") > reduction.reduce_above)
    small = completed.filter(~routed)
    with archive.reading():
        heads = completed.filter(routed).select(*_HEAD, "finished_us", "wait_edges").toArrow().sort_by("snapshot_id")
        # The outcomes are needed only once the large snapshots are read: their job runs meanwhile.
        counting = _in_background(
            archive.spark,
            lambda: snapshots.agg(
                F.count(F.when(F.col("outcome") == "completed", 1)).alias("completed"),
                F.count(F.when(F.col("outcome") != "completed", 1)).alias("aborted"),
            ).first(),
        )
        try:
            large, reduced = _large_snapshots(archive, heads.to_pylist(), configured, reduction.finish_edges)
        finally:
            futures.wait([counting])  # no job of this call outlives it, even when it fails
        outcomes = counting.result()
        assert outcomes is not None
        # Without a snapshot left for them, the jobs over blobs would only start Python workers.
        any_small = outcomes["completed"] > len(large)
        candidates = _small_candidates(small, configured) if any_small else []
        for sid, item in large.items():
            key = (item.head["finished_us"], sid)
            taken = new_baselines(Evaluation(results=item.conservation))
            candidates += [(counter, key, total) for counter, total in taken.items()]
        candidates += [(counter, key, total) for counter, key, total in seen if counter not in configured]
        detectors = [(counter, key, total) for counter, key, total in earlier if counter not in configured]
        totals = find_totals(candidates, configured, detectors)
        rounds, left = 0, 0
        if reduced:
            rounds, left = _reduce_large(archive, {sid: large[sid] for sid in reduced}, reduction)
    remaining = left + sum(item.counts.edges for sid, item in large.items() if sid not in set(reduced))

    evaluations = evaluate_blobs(small, totals, predicates) if any_small or not large else None
    if large:
        names = [plugin.name for plugin in user_predicates(tuple(predicates))]
        ids = heads.column("snapshot_id").to_pylist()
        results = [_large_results(large[sid], configured, totals, names) for sid in ids]
        evidence = [_large_evidence(large[sid], sid_results) for sid, sid_results in zip(ids, results, strict=True)]
        rows = archive.spark.createDataFrame(result_table(heads, results, evidence))
        evaluations = rows if evaluations is None else evaluations.unionByName(rows)
    assert evaluations is not None
    return Evaluated(
        evaluations, outcomes["completed"], outcomes["aborted"], len(large), rounds, remaining, totals, len(reduced)
    )


def _in_background(spark: SparkSession, action: Callable[[], _T]) -> Future[_T]:
    """``action()`` run in a thread of its own while the caller goes on: its future.

    The thread is PySpark's ``InheritableThread``: in pinned-thread mode it takes the caller's
    local properties (job group, description, a streaming batch's), as the caller's own job would.
    The future's ``result()`` raises what ``action`` raised, in the caller's thread, so that a
    Spark failure reaches the caller's :meth:`~stablewatch.pipeline.tables.Archive.reading` as if
    run there.
    """
    future: Future[_T] = Future()

    def run() -> None:
        try:
            future.set_result(action())
        except BaseException as error:  # handed to the caller by result()
            future.set_exception(error)

    InheritableThread(target=run, session=spark, name="stablewatch-background", daemon=True).start()
    return future


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
    reduction: Reduction = DEFAULT_REDUCTION,
) -> Evaluated:
    """Evaluate every completed snapshot of `archive` (ids from `first_id` to `last_id`, inclusive);
    see :func:`evaluate_snapshots` for the rest.

    The baselines are the detector's (:func:`detector_baselines`), as its archived results say:
    the first snapshot evaluated here may not be the first to see a counter (a range that leaves
    earlier snapshots out, an archive begun after the detector took its baseline, retention), and
    the detector compared it with the earlier one; and a detector restarted on a fresh store took
    a new one, which the snapshots after it were compared with.
    """
    earlier = detector_baselines(Archive(archive.spark, archive.root, None, archive.last_day))
    return evaluate_snapshots(
        archive,
        _heads(archive, first_id, last_id),
        expected,
        predicates,
        reduction=reduction,
        earlier=earlier,
    )


def detector_baselines(archive: Archive, snapshots: DataFrame | None = None) -> list[tuple[str, tuple[int, int], int]]:
    """The baselines the detector took, as its archived conservation results say: ``(counter,
    order key, total)`` for every result decided on a closed cut that set one (flagged
    ``baseline``: the order key is its snapshot's), a detector restarted on a fresh store taking a
    new one; and, when a counter's first decided result did not set one, the baseline it was
    compared with, which the detector took before the archive holds anything of the counter (an
    archive begun later, or retention): its order key comes before every snapshot. One Spark job
    over a few columns of the ``results`` and ``snapshots`` tables; no snapshot is decoded.

    With `snapshots` (rows of the ``snapshots`` table, within `archive`'s days), only the results of
    those snapshots count, and "first" means the first among them: ``follow``'s micro-batch."""
    evidence = F.col("evidence")
    decided = (
        archive.table("results")
        .filter(F.col("name").startswith("conservation(") & ~F.coalesce("unknown", F.lit(False)))
        .filter(F.coalesce("error", F.lit("")) == "")
        .select(
            "snapshot_id",
            F.get_json_object(evidence, "$.counter").alias("counter"),
            # A closed cut's result always has one: left out of the JSON, it is 0 (proto3's default).
            F.coalesce(F.get_json_object(evidence, "$.expected").cast("long"), F.lit(0)).alias("total"),
            F.coalesce(F.get_json_object(evidence, "$.baseline") == "true", F.lit(False)).alias("baseline"),
        )
    )
    heads = _with_order(
        (archive.table("snapshots") if snapshots is None else snapshots).select("snapshot_id", "finished_at")
    )
    taken = F.struct("finished_us", "snapshot_id", "total")
    per_counter = (
        decided.join(heads, "snapshot_id")
        .groupBy("counter")
        .agg(
            F.min(F.struct("finished_us", "snapshot_id", "total", "baseline")).alias("first"),
            F.collect_list(F.when(F.col("baseline"), taken)).alias("taken"),  # collect_list drops the nulls
        )
    )
    with archive.reading():
        rows = per_counter.collect()
    found = []
    for row in rows:
        if not row["first"]["baseline"]:
            found.append((row["counter"], (-1, -1), row["first"]["total"]))
        found += [(row["counter"], (t["finished_us"], t["snapshot_id"]), t["total"]) for t in row["taken"]]
    return sorted(found)


def _refuse_duplicates(archive: Archive, snapshots: DataFrame) -> None:
    """ArchiveError if a snapshot of `snapshots` is archived twice (its results would count twice),
    naming it and its files, as the archive's own check does (one Spark job over the ids)."""
    twice = (
        snapshots.select("snapshot_id", F.input_file_name().alias("file"))
        .groupBy("snapshot_id")
        .agg(F.count("*").alias("copies"), F.sort_array(F.collect_set("file")).alias("files"))
        .filter(F.col("copies") > 1)
        .orderBy("snapshot_id")
        .limit(1)
    )
    with archive.reading():
        found = twice.collect()
    for row in found:
        raise ArchiveError(
            f"snapshot {row['snapshot_id']} is archived twice ({row['copies']} copies, in {', '.join(row['files'])}): "
            "remove the extra copy before evaluating"
        )


#: Columns written without Parquet's dictionary encoding: their values are nearly all distinct
#: (serialized results, evidence JSON), so the dictionary only costs time (a quarter to a third of
#: a huge snapshot's write) before parquet-mr falls back to plain pages. The other columns keep it.
PLAIN_COLUMNS = ("evidence", "result")


def write_evaluations(evaluations: DataFrame, out: Path, archive: Archive | None = None) -> None:
    """Write `evaluations` to ``out`` as Parquet, partitioned by day (replacing what was there),
    the :data:`PLAIN_COLUMNS` without dictionary encoding."""
    writer = evaluations.write.mode("overwrite").partitionBy("day")
    for column in PLAIN_COLUMNS:  # parquet-mr's per-column form of parquet.enable.dictionary
        writer = writer.option(f"parquet.enable.dictionary#{column}", "false")
    with archive.reading() if archive is not None else contextlib.nullcontext():
        writer.parquet(str(out))
