"""Deadlock in wait-for graphs too large for one worker: graph reduction on DataFrames, then the shared algorithm.

Theory of operation. A snapshot archived without its blob (over ``MAX_BLOB_BYTES``) may hold
millions of wait-for nodes. Up to :data:`~stablewatch.pipeline.defaults.DEFAULT_FINISH_EDGES`
wait edges, one process holds its whole graph in compact form
(:mod:`stablewatch.detector.evaluation.columnar`) and this module is not needed. Above that, the
graph is built from the archive's rows with the very rules of
:func:`~stablewatch.detector.evaluation.waitfor.build_wait_for` (:func:`wait_for_frames`), then
reduced on DataFrames (:func:`reduce_wait_for`): each round releases every node without remaining
out-edges, drops the edges into them, and drops every edge of an OR waiter that had one (it is
released too). An AND waiter is released once it has lost all its edges. Each round cuts the
lineage (``localCheckpoint``), and the rounds stop when one releases little (a deadlocked
remainder is never released, however many rounds run) or at a cap (a chain of n links would cost
n rounds). The edges that remain go to one process as Arrow columns
(:func:`~stablewatch.detector.evaluation.columnar.compact_edges`), where the shared algorithm
finishes the job (:func:`~stablewatch.detector.evaluation.columnar.find_compact_deadlock`). Graph
reduction is confluent (Holt, 1972): whatever was released in whatever order, the nodes never
released are the same, so stopping after any round and finishing elsewhere gives exactly the
deadlocked set of the whole graph.

The remaining edges keep the whole graph's node order for their waiters and each waiter's edge
order (:func:`remaining_rows`), so the deadlock evidence (the cycle found, rotated to its smallest
node; the knot; the empty channels; the number of separate deadlocks) is the shared function's on
the whole graph: it only looks at deadlocked nodes and the edges among them, which reduction
never removes. (:func:`remaining_graphs` builds networkx graphs from the same rows, for checks.)

References
----------
R. C. Holt, "Some deadlock properties of computer systems", ACM Computing Surveys 4(3), 1972.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import networkx as nx
import pyarrow as pa
from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F

from stablewatch.detector.evaluation.deadlock import AND, OR
from stablewatch.pipeline.defaults import DEFAULT_MAX_ROUNDS, DEFAULT_MIN_RELEASE

__all__ = [
    "WaitForFrames",
    "counted_rows",
    "graph_counts",
    "numbered_edges",
    "reduce_wait_for",
    "remaining_graphs",
    "remaining_rows",
    "wait_for_frames",
]

_SHIFT = 2**31  # packs two int32 positions into one sortable int64
_ID = "snapshot_id"


@dataclass(frozen=True)
class WaitForFrames:
    """The wait-for graphs of some snapshots as two DataFrames.

    `waiters`: one row per waiter node — ``snapshot_id, process, task, is_or, rank, sub`` — where
    ``(rank, sub)`` orders the waiters as ``build_wait_for`` inserts them (by process, then by
    the waiter's first wait, a split waiter's own wait nodes right after it; a passive process's
    implicit OR over its tasks last).

    `edges`: one row per ``(waiter, target)`` pair — ``snapshot_id, process, task,
    target_process, target_task, is_or, counted, flow_control, position`` — where `counted` is
    False for a pair set aside by the in-flight rule, `flow_control` marks a counted edge from a
    flow-control wait, and `position` orders a waiter's edges as ``build_wait_for`` adds them.
    """

    waiters: DataFrame
    edges: DataFrame
    # One row per member process ``snapshot_id, target_process`` whose node the quiet rule leaves
    # free (waiting tasks, no wait of its own, the cut not quiet): ``WaitCounts.undecided``.
    undecided: DataFrame


def _pack(high: Column, low: Column | int) -> Column:
    return high.cast("long") * _SHIFT + (low if isinstance(low, Column) else F.lit(low)).cast("long")


def wait_for_frames(
    processes: DataFrame,
    wait_edges: DataFrame,
    messages: DataFrame,
    channels: DataFrame,
    open_snapshots: Collection[int],
) -> WaitForFrames:
    """Return the wait-for graphs of the snapshots in the four archive tables (same columns as the archive).

    The rules are those of ``build_wait_for``: every declared wait makes its ``(process, task)`` a
    waiter; one wait keeps its model and AND waits merge into one AND waiter, while several waits
    that are not all AND each become a node ``(process, "task[wait k]")`` of their own, the waiter
    being an AND waiter over them; a process with waiting tasks and no wait of its own is an OR
    waiter over those tasks on a quiet cut (the quiet rule: closed, not in ``open_snapshots``, no
    process active, no message that may wake, not ``no_wake``, no acknowledgement in transit on
    any channel, and no flow-control wait on a target that will consume), and free on any other,
    where a message may still reach it and make it active; a recorded message on
    ``target -> waiter`` that may wake the waiter (not ``no_wake``; its ``wakes_task`` empty or
    the waiter's task) satisfies that edge unless it is a flow-control wait; a satisfied edge
    releases an OR waiter (all its edges are set aside) and is set aside from an AND waiter (a
    pair is counted while any wait on it is unmet). A flow-control edge is satisfied instead when
    an acknowledgement is in transit on ``waiter -> target``: the channel's ``receiver_acked`` is
    ahead of its ``sender_ack_seen``, both of the same incarnations; or when the target's handler
    will consume (``consuming``): its ``handler_waits`` is false, or not recorded and the target
    records no wait of its own (task ""). Every node that is not a waiter is free.

    Lazy: a few joins and aggregations, O(processes + wait edges + messages + channels) rows shuffled.
    """
    waits = wait_edges.select(
        _ID,
        F.col("waiter_process").alias("process"),
        F.coalesce("waiter_task", F.lit("")).alias("task"),
        "target_process",
        F.coalesce("target_task", F.lit("")).alias("target_task"),
        (F.col("model") == OR).alias("or_wait"),
        F.coalesce("flow_control", F.lit(False)).alias("flow_control"),
        "wait_index",
        "target_index",
    )
    procs = processes.select(_ID, F.col("process_id").alias("process"), "process_index", "active")

    declared = waits.groupBy(_ID, "process", "task").agg(
        F.min("wait_index").alias("first_wait"),
        F.bool_and("or_wait").alias("all_or"),
        F.bool_or("or_wait").alias("any_or"),
        F.countDistinct("wait_index").alias("waits"),
    )
    # Several waits, not all AND: each wait becomes a node of its own, ``task[wait k]``.
    declared = declared.withColumn("split", (F.col("waits") > 1) & F.col("any_or")).withColumn(
        "is_or", F.col("all_or") & ~F.col("split")
    )
    has = waits.groupBy(_ID, "process").agg(
        F.bool_or(F.col("task") == "").alias("own_wait"), F.bool_or(F.col("task") != "").alias("task_waits")
    )
    # Targets that will consume (``waitfor.consuming``): members whose handler_waits is false, or
    # not recorded (an older agent) and that record no wait of their own.
    own = (
        waits.filter((F.col("task") == "") & F.col("target_process").isNotNull())
        .select(_ID, F.col("process").alias("target_process"))
        .distinct()
        .withColumn("own_wait", F.lit(True))
    )
    consuming = (
        processes.select(_ID, F.col("process_id").alias("target_process"), "handler_waits")
        .join(own, [_ID, "target_process"], "left")
        .filter(~F.coalesce(F.col("handler_waits"), F.col("own_wait").isNotNull()))
        .select(_ID, "target_process", F.lit(True).alias("consuming"))
    )
    # The quiet rule: a process node stands for its tasks only on a cut nothing can reach any more
    # (no waking message, no acknowledgement in transit, no process active, no blocked send about
    # to go on because its target will consume, closed).
    acking = _acks_in_transit(channels)
    loud = (
        messages.filter(~F.coalesce("no_wake", F.lit(False)))
        .select(_ID)
        .union(acking.select(_ID))
        .union(processes.filter(F.coalesce("active", F.lit(False))).select(_ID))
        .union(waits.filter("flow_control").join(consuming, [_ID, "target_process"]).select(_ID))
        .distinct()
    )
    nodes = has.filter(~F.col("own_wait") & F.col("task_waits")).select(_ID, "process")
    quiet = nodes.filter(~F.col(_ID).isin(sorted(open_snapshots))).join(loud, [_ID], "left_anti")
    implicit = quiet.join(procs, [_ID, "process"]).select(_ID, "process", "process_index")
    undecided = nodes.join(quiet, [_ID, "process"], "left_anti").select(_ID, F.col("process").alias("target_process"))
    ranked = declared.join(procs, [_ID, "process"])
    waiters = ranked.select(
        _ID,
        "process",
        "task",
        "is_or",
        _pack(F.col("process_index"), F.col("first_wait")).alias("rank"),
        F.lit(0).alias("sub"),
    )

    # The split waiters' own waits: node ``task[wait k]``, k numbering the waiter's waits in order.
    split_waits = (
        waits.join(
            ranked.filter("split").select(_ID, "process", "task", "process_index", "first_wait"),
            [_ID, "process", "task"],
        )
        .withColumn("k", F.dense_rank().over(Window.partitionBy(_ID, "process", "task").orderBy("wait_index")))
        .withColumn("wait_task", F.concat(F.col("task"), F.lit("[wait "), F.col("k").cast("string"), F.lit("]")))
    )
    wait_nodes = split_waits.groupBy(_ID, "process", "task", "wait_task", "k").agg(
        F.first("or_wait").alias("is_or"),
        F.first("process_index").alias("process_index"),
        F.first("first_wait").alias("first_wait"),
    )
    waiters = waiters.unionByName(
        wait_nodes.select(
            _ID,
            "process",
            F.col("wait_task").alias("task"),
            "is_or",
            _pack(F.col("process_index"), F.col("first_wait")).alias("rank"),
            F.col("k").alias("sub"),
        )
    )
    waiters = waiters.unionByName(
        implicit.select(
            _ID,
            "process",
            F.lit("").alias("task"),
            F.lit(True).alias("is_or"),
            _pack(F.col("process_index"), _SHIFT - 1).alias("rank"),
            F.lit(0).alias("sub"),
        )
    )

    # Every edge as (node, its owner's task for the wake rule, target, flow control, position).
    plain = waits.join(declared.filter(~F.col("split")).select(_ID, "process", "task"), [_ID, "process", "task"])
    stated = plain.filter(F.col("target_process").isNotNull()).select(
        _ID,
        "process",
        "task",
        F.col("task").alias("owner_task"),
        "target_process",
        "target_task",
        "flow_control",
        _pack(F.col("wait_index"), F.col("target_index")).alias("position"),
    )
    of_waits = split_waits.filter(F.col("target_process").isNotNull()).select(
        _ID,
        "process",
        F.col("wait_task").alias("task"),
        F.col("task").alias("owner_task"),
        "target_process",
        "target_task",
        "flow_control",
        _pack(F.col("wait_index"), F.col("target_index")).alias("position"),
    )
    to_waits = wait_nodes.select(
        _ID,
        "process",
        "task",
        F.col("task").alias("owner_task"),
        F.col("process").alias("target_process"),
        F.col("wait_task").alias("target_task"),
        F.lit(False).alias("flow_control"),
        F.col("k").cast("long").alias("position"),
    )
    over_tasks = (
        declared.filter(F.col("task") != "")
        .join(implicit, [_ID, "process"])
        .select(
            _ID,
            "process",
            F.lit("").alias("task"),
            F.lit("").alias("owner_task"),
            F.col("process").alias("target_process"),
            F.col("task").alias("target_task"),
            F.lit(False).alias("flow_control"),
            _pack(F.col("first_wait"), 0).alias("position"),
        )
    )
    instances = (
        stated.unionByName(of_waits)
        .unionByName(to_waits)
        .unionByName(over_tasks)
        .join(waiters.select(_ID, "process", "task", "is_or"), [_ID, "process", "task"])
    )

    waking = (
        messages.filter(~F.coalesce("no_wake", F.lit(False)))
        .groupBy(_ID, F.col("src").alias("target_process"), F.col("dst").alias("process"))
        .agg(
            F.bool_or(F.coalesce("wakes_task", F.lit("")) == "").alias("wakes_all"),
            F.collect_set("wakes_task").alias("wakes_tasks"),
        )
    )
    acking = acking.select(
        _ID, F.col("src").alias("process"), F.col("dst").alias("target_process"), F.lit(True).alias("acking")
    )
    satisfied = F.when(F.col("flow_control"), F.col("acking").isNotNull() | F.col("consuming").isNotNull()).otherwise(
        F.col("wakes_all").isNotNull() & (F.col("wakes_all") | F.array_contains("wakes_tasks", F.col("owner_task")))
    )
    waiter = Window.partitionBy(_ID, "process", "task")
    instances = (
        instances.join(waking, [_ID, "target_process", "process"], "left")
        .join(acking, [_ID, "process", "target_process"], "left")
        .join(consuming, [_ID, "target_process"], "left")
        .withColumn("satisfied", satisfied)
        .withColumn("or_released", F.col("is_or") & F.bool_or("satisfied").over(waiter))
    )
    edges = instances.groupBy(_ID, "process", "task", "target_process", "target_task").agg(
        F.first("is_or").alias("is_or"),
        (F.bool_or(~F.col("satisfied")) & ~F.first("or_released")).alias("counted"),
        F.bool_or(~F.col("satisfied") & F.col("flow_control")).alias("flow_control"),
        F.min("position").alias("position"),
    )
    return WaitForFrames(waiters, edges, undecided)


_SIGN = -(2**63)  # a long's sign bit


def _acks_in_transit(channels: DataFrame) -> DataFrame:
    """The channels (``snapshot_id, src, dst``) with an acknowledgement in transit: ``receiver_acked``
    ahead of ``sender_ack_seen``, both of the same incarnations (``acks_in_transit``)."""
    acked, seen = F.col("receiver_acked"), F.col("sender_ack_seen")
    return channels.filter(
        acked.isNotNull()
        & seen.isNotNull()
        & (acked["sender_incarnation"] == seen["sender_incarnation"])
        & (acked["receiver_incarnation"] == seen["receiver_incarnation"])
        # next_seq is a uint64 kept in a long by its bits: compared unsigned, as the snapshot holds it
        # (flipping the sign bit orders the bits as unsigned).
        & (acked["next_seq"].bitwiseXOR(F.lit(_SIGN)) > seen["next_seq"].bitwiseXOR(F.lit(_SIGN)))
    ).select(_ID, "src", "dst")


def graph_counts(frames: WaitForFrames, processes: DataFrame) -> DataFrame:
    """Per snapshot: ``waiters``, counted ``edges``, ``discounted`` pairs, the counted edges to
    processes outside the cut, ``outside``, and to process nodes the quiet rule left free,
    ``undecided`` (what ``wait_counts`` counts); `processes` is the archive's table."""
    waiters = frames.waiters.groupBy(_ID).agg(F.count(F.lit(1)).alias("waiters"))
    edges = frames.edges.groupBy(_ID).agg(
        F.count(F.when(F.col("counted"), 1)).alias("edges"), F.count(F.when(~F.col("counted"), 1)).alias("discounted")
    )
    members = processes.select(_ID, F.col("process_id").alias("target_process"))
    outside = (
        frames.edges.filter("counted")
        .join(members, [_ID, "target_process"], "left_anti")
        .groupBy(_ID)
        .agg(F.count(F.lit(1)).alias("outside"))
    )
    undecided = (
        frames.edges.filter(F.col("counted") & (F.col("target_task") == ""))
        .join(frames.undecided, [_ID, "target_process"])
        .groupBy(_ID)
        .agg(F.count(F.lit(1)).alias("undecided"))
    )
    counts = waiters.join(edges, _ID, "left").join(outside, _ID, "left").join(undecided, _ID, "left")
    return counts.fillna(0, ["edges", "discounted", "outside", "undecided"])


def numbered_edges(frames: WaitForFrames) -> tuple[DataFrame, DataFrame]:
    """Number every node and return ``(nodes, edges)``: the counted edges as ``waiter, target, is_or`` longs.

    `nodes` maps ``snapshot_id, process, task`` to ``node`` (unique across snapshots) and is
    materialized (``localCheckpoint``), since the numbers are not deterministic. Reduction then
    shuffles integers, not strings.
    """
    counted = frames.edges.filter("counted")
    nodes = (
        counted.select(_ID, "process", "task")
        .unionByName(counted.select(_ID, F.col("target_process").alias("process"), F.col("target_task").alias("task")))
        .distinct()
        .withColumn("node", F.monotonically_increasing_id())
        .localCheckpoint()
    )
    waiter = nodes.withColumnRenamed("node", "waiter")
    target = nodes.select(
        _ID, F.col("process").alias("target_process"), F.col("task").alias("target_task"), F.col("node").alias("target")
    )
    edges = counted.join(waiter, [_ID, "process", "task"]).join(target, [_ID, "target_process", "target_task"])
    return nodes, edges.select("waiter", "target", "is_or")


def reduce_wait_for(
    edges: DataFrame,
    max_rounds: int = DEFAULT_MAX_ROUNDS,
    finish_edges: int = 0,
    min_release: float = DEFAULT_MIN_RELEASE,
) -> tuple[DataFrame, int]:
    """Release waiters round by round; return the edges that remain and the number of rounds run.

    `edges` has columns ``waiter``, ``target`` and ``is_or`` (the waiter's model), one row per
    distinct edge; a node is a waiter while it has edges, so every other node is free. A round
    releases the targets that have no edges and removes the edges into them, and every edge of an
    OR waiter that had one. It stops at a fixpoint (then the waiters that remain are exactly the
    deadlocked nodes), after `max_rounds` rounds, as soon as at most `finish_edges` edges remain
    (one process finishes those faster than more rounds would), or after a round that removed
    less than `min_release` of the edges it started with: what remains is then mostly deadlocked,
    which no round releases (a million-node graph kept two thirds of its edges after eight
    rounds), and one process finishes it in compact form
    (:func:`~stablewatch.detector.evaluation.columnar.compact_edges`). Each round is
    materialized with ``localCheckpoint``, so the plan does not grow with the rounds.

    Whatever remains has the same deadlocked nodes as `edges` (reduction is confluent): finish it
    with :func:`~stablewatch.detector.evaluation.deadlock.deadlocked_nodes`.

    Complexity: per round, two shuffles of the remaining edges; rounds at most `max_rounds`.
    """
    remaining = edges.localCheckpoint()
    size = remaining.count()
    rounds = 0
    while rounds < max_rounds and size > finish_edges:
        blocked = remaining.select(F.col("waiter").alias("target")).distinct().withColumn("blocked", F.lit(True))
        marked = remaining.join(blocked, "target", "left")
        released = F.col("blocked").isNull()
        or_released = marked.filter(F.col("is_or") & released).select("waiter").distinct()
        after = (
            marked.filter(~released)
            .join(or_released, "waiter", "left_anti")
            .select("waiter", "target", "is_or")
            .localCheckpoint()
        )
        rounds += 1
        after_size = after.count()
        little = size - after_size < min_release * size
        remaining, unchanged = after, after_size == size
        size = after_size
        if unchanged or little:
            break
    return remaining, rounds


def counted_rows(frames: WaitForFrames) -> DataFrame:
    """Every counted edge with its labels, model, flow control and orders, for :func:`remaining_graphs`."""
    return frames.edges.filter("counted").drop("is_or", "counted").join(frames.waiters, [_ID, "process", "task"])


def remaining_rows(frames: WaitForFrames, nodes: DataFrame, remaining: DataFrame) -> DataFrame:
    """The `remaining` edges (numbered as by :func:`numbered_edges`) as :func:`counted_rows` gives them."""
    waiter = nodes.withColumnRenamed("node", "waiter")
    target = nodes.select(
        F.col("process").alias("target_process"), F.col("task").alias("target_task"), F.col("node").alias("target")
    )
    labelled = remaining.join(waiter, "waiter").join(target, "target")
    keys = [_ID, "process", "task", "target_process", "target_task"]
    return labelled.select(*keys).join(counted_rows(frames), keys)


def remaining_graphs(rows: pa.Table) -> dict[int, nx.DiGraph]:
    """Build each snapshot's wait-for graph from :func:`counted_rows` or :func:`remaining_rows`, in its order.

    Waiters are added by rank with their ``model``, then each waiter's edges by position (with
    ``flow_control=True`` where set), so node and successor orders match ``build_wait_for``'s
    on the whole snapshot. O(rows log rows).
    """
    columns = ["snapshot_id", "rank", "sub", "position", "process", "task", "is_or", "target_process", "target_task"]
    order = ["snapshot_id", "rank", "sub", "position"]
    ordered = rows.sort_by([(name, "ascending") for name in order])
    graphs: dict[int, nx.DiGraph] = {}
    records = list(zip(*(ordered.column(name).to_pylist() for name in [*columns, "flow_control"]), strict=True))
    for sid, _, _, _, process, task, is_or, _, _, _ in records:
        graphs.setdefault(sid, nx.DiGraph()).add_node((process, task), model=OR if is_or else AND)
    for sid, _, _, _, process, task, _, target_process, target_task, flow_control in records:
        if flow_control:
            graphs[sid].add_edge((process, task), (target_process, target_task), flow_control=True)
        else:
            graphs[sid].add_edge((process, task), (target_process, target_task))
    return graphs
