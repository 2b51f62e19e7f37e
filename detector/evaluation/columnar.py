"""The built-in predicates of one snapshot from its archive rows, column by column: no ``GlobalSnapshot``.

Theory of operation. A snapshot archived without its blob may hold a million processes and
millions of wait edges. Rebuilding its ``GlobalSnapshot`` and a networkx graph from those rows
costs a Python object per row, per node and per edge: many times the reduction itself. Here the
rows stay columns (:class:`SnapshotRows`: Arrow tables with the archive's own columns) and each
rule of the one evaluation is applied to whole columns at once:

* names become numbers in one pass (every process name of the snapshot in one dictionary, the
  members first in the snapshot's order; every task name in another), and the integer work is
  numpy's (sorts, prefix sums, scatters); strings are only compared and sorted by Arrow;
* the wait-for graph (:func:`compact_wait_for`) follows :func:`~.waitfor.build_wait_for` rule for
  rule (merged and split waits, a process's implicit OR over its tasks on a quiet cut, the in-flight
  and acknowledgement rules). Its nodes are numbered in ``build_wait_for``'s node order
  (the waiters first, as it inserts them, then the other targets) and each waiter's edges keep
  its order, in a :class:`~.deadlock.CompactGraph`: flat integer arrays that the algorithms read
  through memoryviews, without a Python object per node or edge;
* the deadlock (:func:`find_compact_deadlock`) is the shared algorithm of :mod:`.deadlock` on that
  graph: the same reduction, the same cycle walk from the same first node (so the same cycle),
  the knot and the count from one pass of the same component search, and the evidence sorted as
  :class:`~.waitfor.Deadlock` holds it;
* coverage, termination and conservation are the facts that :mod:`.cut` and :mod:`.predicates`
  turn into results (:func:`~.cut.cut_coverage`, :func:`~.predicates.termination_result`,
  :func:`~.predicates.conservation_results`), found in the columns.

:func:`evaluate_rows` then gives, through those functions and :func:`~.predicates.deadlock_result`,
the built-in results of ``evaluate(snapshot_from_rows(...))``, byte for byte. The Python loops
left are those no column operation replaces: the reduction, the cycle walk, the component search,
and one protobuf message per node and per holding of the evidence.

The rows are read as the archive's writer writes them (one per process, per channel, per wait
target, per message); :class:`RowsError` when they do not fit together, where the archive's
reader would refuse them too. numpy is needed here (the pipeline has it through pandas); nothing
else of the detector imports this module.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from stablewatch.detector.evaluation.cut import cut_coverage
from stablewatch.detector.evaluation.deadlock import CompactGraph, compact_components, compact_cycle, compact_deadlocked
from stablewatch.detector.evaluation.predicates import (
    Holding,
    conservation_results,
    deadlock_result,
    termination_result,
)
from stablewatch.detector.evaluation.waitfor import Channel, Deadlock, Node, WaitCounts, empty_channels
from stablewatch.v1 import CutCoverage, PredicateResult

__all__ = [
    "COLUMNS",
    "LIGHT_WAIT_COLUMNS",
    "CompactWaitFor",
    "LightFacts",
    "RowsError",
    "SnapshotRows",
    "compact_edges",
    "compact_wait_for",
    "evaluate_rows",
    "find_compact_deadlock",
    "light_facts",
    "light_results",
]

#: The columns of the wait edges that :func:`light_facts` reads.
LIGHT_WAIT_COLUMNS = ("waiter_process", "waiter_task", "target_process", "flow_control")
#: The columns of each archive table that the evaluation reads (a reader need read no others).
COLUMNS: dict[str, tuple[str, ...]] = {
    "processes": ("process_id", "process_index", "active", "handler_waits"),
    "counters": ("counter", "process_id", "amount"),
    "wait_edges": (
        "waiter_process",
        "waiter_task",
        "target_process",
        "target_task",
        "model",
        "flow_control",
        "wait_index",
        "target_index",
    ),
    "channels": ("src", "dst", "recorded", "receiver_acked", "sender_ack_seen"),
    "messages": ("src", "dst", "no_wake", "wakes_task", "counters"),
}

_I64 = np.int64
_LAST = 2**62  # the rank of a process's implicit OR waiter among its own: after every wait


class RowsError(ValueError):
    """The rows of a snapshot do not fit together: a row names a process or a channel that has no row."""


@dataclass(frozen=True)
class SnapshotRows:
    """One snapshot as Arrow tables with the archive's columns (at least :data:`COLUMNS`), and its head.

    `head` is its ``snapshots`` row, of which ``snapshot_id``, ``expected_members``,
    ``expected_member_count`` and ``outside_peers`` are read (the lists as Python lists or Arrow
    arrays). Every table holds this snapshot's rows only, in any order.
    """

    head: Mapping[str, Any]
    processes: pa.Table
    counters: pa.Table
    wait_edges: pa.Table
    channels: pa.Table
    messages: pa.Table
    # What the graph and the other predicates both need, computed once (see _facts).
    _facts: dict[str, _Facts] = field(default_factory=dict, compare=False, repr=False)


@dataclass(frozen=True)
class CompactWaitFor:
    """A wait-for graph as :func:`~.waitfor.build_wait_for` builds it, in compact form.

    Node i is ``(process_names[process_codes[i]], task_names[task_codes[i]])`` and is an OR
    waiter when ``is_or[i]``; the waiters come first, in ``build_wait_for``'s node order. Counted
    edge e goes from ``sources[e]`` to ``graph.targets[e]``, from a flow-control wait when
    ``flow_control[e]``; the edges are grouped by waiter, each waiter's in its order. `counts`
    is what :func:`~.waitfor.wait_counts` counts.
    """

    graph: CompactGraph
    process_names: pa.Array
    task_names: pa.Array
    process_codes: np.ndarray
    task_codes: np.ndarray
    is_or: np.ndarray
    sources: np.ndarray
    targets: np.ndarray
    flow_control: np.ndarray
    counts: WaitCounts

    def labels(self, nodes: np.ndarray | Sequence[int]) -> tuple[pa.Array, pa.Array]:
        """The processes and tasks of `nodes`, as two string arrays."""
        at = np.asarray(nodes, dtype=_I64)
        return self.process_names.take(self.process_codes[at]), self.task_names.take(self.task_codes[at])


# -- column helpers -----------------------------------------------------------------------------------------


def _array(values: pa.Array | pa.ChunkedArray) -> pa.Array:
    return values.combine_chunks() if isinstance(values, pa.ChunkedArray) else values


def _ints(values: pa.Array | pa.ChunkedArray, null: int = 0) -> np.ndarray:
    """An integer column as int64, nulls as `null`."""
    values = _array(values)
    if values.null_count:
        values = pc.fill_null(values, null)
    return values.cast(pa.int64()).to_numpy(zero_copy_only=False)


def _bools(values: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """A bool column, nulls as false."""
    values = _array(values)
    if values.null_count:
        values = pc.fill_null(values, False)
    return values.to_numpy(zero_copy_only=False).astype(bool)


def _strings(values: pa.Array | pa.ChunkedArray | Sequence[str] | None) -> pa.ChunkedArray:
    """A column of names as strings (a list from the head, or a column), chunks kept."""
    if values is None:
        return pa.chunked_array([], pa.string())
    if isinstance(values, pa.ChunkedArray):
        return values.cast(pa.string())
    if isinstance(values, pa.Array):
        return pa.chunked_array([values.cast(pa.string())])
    return pa.chunked_array([pa.array(values, pa.string())])


def _view(values: np.ndarray) -> memoryview:
    """An int64 array as a memoryview: indexed from Python as fast as a list, no object per value."""
    return memoryview(np.ascontiguousarray(values, dtype=_I64))


def _starts(keys: np.ndarray, n: int) -> np.ndarray:
    """Row offsets for keys 0 … n-1 of rows sorted by key: entry u counts the rows with a smaller key."""
    starts = np.zeros(n + 1, dtype=_I64)
    np.cumsum(np.bincount(keys, minlength=n), out=starts[1:])
    return starts


def _runs(sorted_values: np.ndarray) -> np.ndarray:
    """The indices where a run of equal values of `sorted_values` starts."""
    if len(sorted_values) == 0:
        return np.zeros(0, dtype=_I64)
    return np.flatnonzero(np.concatenate([[True], sorted_values[1:] != sorted_values[:-1]]))


def _ranks(groups: np.ndarray) -> np.ndarray:
    """1, 2, … counting each value's occurrences in `groups`, in order."""
    order = np.argsort(groups, kind="stable")
    ordered = groups[order]
    starts = _runs(ordered)
    within = np.arange(len(groups), dtype=_I64) - np.repeat(starts, np.diff(np.append(starts, len(groups))))
    ranks = np.empty(len(groups), dtype=_I64)
    ranks[order] = within + 1
    return ranks


def _sorted_pairs(first: pa.Array, second: pa.Array) -> list[tuple[str, str]]:
    """``(first, second)`` string pairs sorted as Python sorts tuples (UTF-8 bytes sort as code points)."""
    table = pa.table({"a": first, "b": second}).sort_by([("a", "ascending"), ("b", "ascending")])
    return list(zip(table["a"].to_pylist(), table["b"].to_pylist(), strict=True))


def _sorted_strings(values: pa.Array) -> list[str]:
    return values.take(pc.array_sort_indices(values)).to_pylist()


# -- what every part needs: names as numbers ----------------------------------------------------------------


_NAMED = (  # every column that names a process, in the order they are numbered (members first)
    ("wait_edges", "waiter_process"),
    ("wait_edges", "target_process"),
    ("counters", "process_id"),
    ("messages", "src"),
    ("messages", "dst"),
    ("channels", "src"),
    ("channels", "dst"),
)


@dataclass(frozen=True)
class _Facts:
    """The names of a snapshot as numbers, its members' states, and the channels that may wake."""

    names: pa.Array  # every process name: the members first, in the snapshot's order
    members: int
    codes: dict[tuple[str, str], np.ndarray]  # (table, column) -> name numbers, -1 for null
    expected: np.ndarray  # the head's expected members and outside peers, as name numbers
    active: np.ndarray  # per member
    handler_waits: np.ndarray  # per member: 1 its handler waits, 0 it does not, -1 not recorded
    tasks: pa.Array  # every task name, "" first
    task_codes: dict[tuple[str, str], np.ndarray]
    waking_any: np.ndarray  # sorted channels (src * names + dst) with a message that may wake any wait of dst
    waking_task: frozenset[tuple[int, int]]  # (channel, task): a message that may wake that task of dst only
    waking_task_channels: np.ndarray  # sorted channels of `waking_task`
    busy: list[Channel]  # every channel with a waking message, sorted

    def code(self, table: str, column: str) -> np.ndarray:
        return self.codes[(table, column)]


def _facts(rows: SnapshotRows) -> _Facts:
    """Number the names of `rows` (once per rows: the graph and the other predicates share them)."""
    if "facts" in rows._facts:
        return rows._facts["facts"]
    sid = rows.head["snapshot_id"]
    processes = rows.processes
    order = np.argsort(_ints(processes["process_index"]), kind="stable")
    pids = _array(processes["process_id"]).cast(pa.string()).take(pa.array(order))
    parts = [_strings(pids)]
    parts += [_strings(getattr(rows, table)[column]) for table, column in _NAMED]
    parts += [_strings(rows.head.get("expected_members")), _strings(rows.head.get("outside_peers"))]
    encoded = pc.dictionary_encode(pa.chunked_array([c for part in parts for c in part.chunks], pa.string()))
    names = encoded.chunks[-1].dictionary if encoded.num_chunks else pa.array([], pa.string())
    indices = pa.chunked_array([c.indices for c in encoded.chunks], pa.int32()) if encoded.num_chunks else None
    flat = _ints(indices, -1) if indices is not None else np.zeros(0, dtype=_I64)
    bounds = np.cumsum([0, *(len(part) for part in parts)])
    pieces = [flat[a:b] for a, b in itertools.pairwise(bounds)]
    members = len(pids)
    if not np.array_equal(pieces[0], np.arange(members)):
        raise RowsError(f"snapshot {sid}: a process has more than one row")
    codes = dict(zip(_NAMED, pieces[1 : 1 + len(_NAMED)], strict=True))
    active = _bools(_array(processes["active"]).take(pa.array(order))) if members else np.zeros(0, bool)
    handler_waits = (
        _ints(_array(processes["handler_waits"]).take(pa.array(order)).cast(pa.int8()), -1)
        if members
        else np.zeros(0, _I64)
    )

    task_parts = [
        pa.chunked_array([pa.array([""])]),
        _strings(rows.wait_edges["waiter_task"]),
        _strings(rows.wait_edges["target_task"]),
        _strings(rows.messages["wakes_task"]),
    ]
    task_encoded = pc.dictionary_encode(
        pa.chunked_array([pc.fill_null(c, "") for part in task_parts for c in part.chunks], pa.string())
    )
    tasks = task_encoded.chunks[-1].dictionary
    task_flat = _ints(pa.chunked_array([c.indices for c in task_encoded.chunks], pa.int32()))
    task_bounds = np.cumsum([0, *(len(part) for part in task_parts)])
    task_pieces = [task_flat[a:b] for a, b in itertools.pairwise(task_bounds)]
    task_codes = {
        ("wait_edges", "waiter_task"): task_pieces[1],
        ("wait_edges", "target_task"): task_pieces[2],
        ("messages", "wakes_task"): task_pieces[3],
    }

    # The in-flight rule: channels holding a message that may wake their receiver.
    base = len(names)
    waking = ~_bools(rows.messages["no_wake"]) if rows.messages.num_rows else np.zeros(0, bool)
    channel = codes[("messages", "src")] * base + codes[("messages", "dst")]
    for_any = waking & (task_codes[("messages", "wakes_task")] == 0)
    for_task = waking & ~for_any
    specific = set(
        zip(channel[for_task].tolist(), task_codes[("messages", "wakes_task")][for_task].tolist(), strict=True)
    )
    busy_channels = np.unique(channel[waking])
    busy = _sorted_pairs(names.take(pa.array(busy_channels // base)), names.take(pa.array(busy_channels % base)))
    facts = _Facts(
        names=names,
        members=members,
        codes=codes,
        expected=np.concatenate(pieces[1 + len(_NAMED) :]),
        active=active,
        handler_waits=handler_waits,
        tasks=tasks,
        task_codes=task_codes,
        waking_any=np.unique(channel[for_any]),
        waking_task=frozenset(specific),
        waking_task_channels=np.unique(np.array([c for c, _ in specific], dtype=_I64)),
        busy=busy,
    )
    rows._facts["facts"] = facts
    return facts


def _check_members(sid: int, facts: _Facts, codes: np.ndarray) -> None:
    """RowsError unless every name in `codes` (nulls aside) is a member, as ``snapshot_from_rows`` requires."""
    outside = codes >= facts.members
    if outside.any():
        bad = facts.names[int(codes[np.flatnonzero(outside)[0]])].as_py()
        raise RowsError(f"snapshot {sid}: a row names process {bad!r}, which has no process row")


def _acking(rows: SnapshotRows, facts: _Facts) -> np.ndarray:
    """The channels with an acknowledgement in transit (:func:`~.waitfor.acks_in_transit`), sorted."""
    channels = rows.channels
    if channels.num_rows == 0:
        return np.zeros(0, dtype=_I64)
    acked, seen = _array(channels["receiver_acked"]), _array(channels["sender_ack_seen"])
    both = _bools(pc.and_(pc.is_valid(acked), pc.is_valid(seen)))

    def part(position: pa.Array, name: str) -> np.ndarray:
        return _ints(pc.struct_field(position, name))

    same = (part(acked, "sender_incarnation") == part(seen, "sender_incarnation")) & (
        part(acked, "receiver_incarnation") == part(seen, "receiver_incarnation")
    )
    # next_seq is a uint64 kept in int64 by its bits: compared unsigned, as the snapshot holds it.
    ahead = part(acked, "next_seq").view(np.uint64) > part(seen, "next_seq").view(np.uint64)
    keep = both & same & ahead
    src, dst = facts.code("channels", "src")[keep], facts.code("channels", "dst")[keep]
    return np.unique(src * len(facts.names) + dst)


def _consumers(rows: SnapshotRows, facts: _Facts) -> np.ndarray:
    """The members whose handler will take what is queued (:func:`~.waitfor.consuming`), sorted:
    ``handler_waits`` false, or not recorded and no wait of their own (task 0, "", with a target)."""
    wp, tp = facts.code("wait_edges", "waiter_process"), facts.code("wait_edges", "target_process")
    own = wp[(facts.task_codes[("wait_edges", "waiter_task")] == 0) & (tp >= 0) & (wp >= 0)]
    waits = np.zeros(facts.members, dtype=bool)
    waits[own[own < facts.members]] = True
    recorded = facts.handler_waits
    waits = np.where(recorded < 0, waits, recorded == 1)
    return np.flatnonzero(~waits).astype(_I64)


def _going_on(rows: SnapshotRows, facts: _Facts) -> np.ndarray:
    """The channels (src * names + dst) on which a send blocked on the full window is about to go
    on (:func:`~.waitfor.sends_going_on`), sorted."""
    fc = _bools(rows.wait_edges["flow_control"])
    if not fc.any():
        return np.zeros(0, dtype=_I64)
    wp, tp = facts.code("wait_edges", "waiter_process"), facts.code("wait_edges", "target_process")
    keep = fc & (wp >= 0) & (tp >= 0)
    channels = wp[keep] * len(facts.names) + tp[keep]
    released = np.isin(channels, _acking(rows, facts)) | np.isin(tp[keep], _consumers(rows, facts))
    return np.unique(channels[released])


# -- the wait-for graph -------------------------------------------------------------------------------------


def compact_wait_for(rows: SnapshotRows) -> CompactWaitFor:
    """The wait-for graph of the snapshot in `rows`, by :func:`~.waitfor.build_wait_for`'s rules (see there).

    Sorts, prefix sums and lookups over whole columns (O(n log n) in compiled code for the n rows
    of processes, wait edges, messages and channels), no Python object per row. RowsError when a
    wait names a waiter without a process row.
    """
    facts = _facts(rows)
    sid = rows.head["snapshot_id"]
    waits = rows.wait_edges
    wp = facts.code("wait_edges", "waiter_process")
    _check_members(sid, facts, wp)
    if (wp < 0).any():
        raise RowsError(f"snapshot {sid}: a wait edge names no waiter process")
    rows_ = _WaitRows(
        wp=wp,
        wi=_ints(waits["wait_index"]),
        ti=_ints(waits["target_index"]),
        wt=facts.task_codes[("wait_edges", "waiter_task")],
        is_or=_bools(pc.equal(waits["model"], "or")) if waits.num_rows else np.zeros(0, bool),
        fc=_bools(waits["flow_control"]) if waits.num_rows else np.zeros(0, bool),
        tp=facts.code("wait_edges", "target_process"),
        tt=facts.task_codes[("wait_edges", "target_task")],
    ).ordered()
    return _Builder(rows, facts, rows_).build()


@dataclass(frozen=True)
class _WaitRows:
    """The wait edge rows as numbers: waiter process and task, wait and target positions, model,
    flow control, target process (-1: none) and task."""

    wp: np.ndarray
    wi: np.ndarray
    ti: np.ndarray
    wt: np.ndarray
    is_or: np.ndarray
    fc: np.ndarray
    tp: np.ndarray
    tt: np.ndarray

    def ordered(self) -> _WaitRows:
        """The rows by process, wait and target (as the archive's writer writes them: then no sort)."""
        wp, wi, ti = self.wp, self.wi, self.ti
        if len(wp) > 1:
            dp, dw, dt = np.diff(wp), np.diff(wi), np.diff(ti)
            if not ((dp > 0) | ((dp == 0) & ((dw > 0) | ((dw == 0) & (dt >= 0))))).all():
                order = np.lexsort((ti, wi, wp))
                return _WaitRows(*(getattr(self, name)[order] for name in self.__dataclass_fields__))
        return self


@dataclass
class _Builder:
    """:func:`compact_wait_for`'s steps, over the numbered rows."""

    rows: SnapshotRows
    facts: _Facts
    w: _WaitRows

    def build(self) -> CompactWaitFor:
        w, facts = self.w, self.facts
        tasks = facts.tasks
        if len(w.wp):
            # One row per wait: its first row holds the wait's task, model and flow control.
            first = np.concatenate([[True], (w.wp[1:] != w.wp[:-1]) | (w.wi[1:] != w.wi[:-1])])
            starts = np.flatnonzero(first)
            wait_of_row = np.cumsum(first) - 1
        else:
            starts = wait_of_row = np.zeros(0, dtype=_I64)
        w_wp, w_wi, w_wt, w_or, w_fc = w.wp[starts], w.wi[starts], w.wt[starts], w.is_or[starts], w.fc[starts]
        # Declared waiters, one per (process, task): their waits in order, whether any is OR.
        task_count = len(tasks)
        keys, g_first, g_of_wait, g_count = np.unique(
            w_wp * task_count + w_wt, return_index=True, return_inverse=True, return_counts=True
        )
        groups = len(keys)
        g_any_or = np.bincount(g_of_wait, weights=w_or, minlength=groups) > 0
        g_wp, g_wt, g_wi = w_wp[g_first], w_wt[g_first], w_wi[g_first]  # first wait: waits are in order
        g_split = (g_count > 1) & g_any_or
        # Several waits, not all AND: each wait becomes a node "task[wait k]", k from 1 in order.
        split = np.flatnonzero(g_split[g_of_wait])
        s_group = g_of_wait[split]
        k = _ranks(s_group)
        own = np.zeros(0, dtype=_I64)
        if len(split):
            own_names = pc.binary_join_element_wise(
                tasks.take(pa.array(w_wt[split])), "[wait ", pa.array(k).cast(pa.string()), "]", ""
            )
            new = pc.unique(own_names)
            tasks = pa.concat_arrays([tasks, pc.filter(new, pc.invert(pc.is_in(new, value_set=tasks)))])
            own = _ints(pc.index_in(own_names, value_set=tasks))
        task_count = len(tasks)
        # A process with waiting tasks and no wait of its own: an OR waiter over its tasks on a quiet
        # cut (closed, no member active, no waking message nor acknowledgement in transit anywhere),
        # else free (the quiet rule).
        own_wait = np.zeros(facts.members, dtype=bool)
        own_wait[g_wp[g_wt == 0]] = True
        task_waits = np.zeros(facts.members, dtype=bool)
        task_waits[g_wp[g_wt != 0]] = True
        quiet = self._quiet()
        implicit = np.flatnonzero(task_waits & ~own_wait) if quiet else np.zeros(0, dtype=_I64)
        # The members whose process node the quiet rule leaves free (WaitCounts.undecided).
        undecided = np.zeros(len(facts.names), dtype=bool)
        if not quiet:
            undecided[: facts.members] = task_waits & ~own_wait

        # The waiters in build_wait_for's order: by process, then the waiter's first wait, a split
        # waiter's wait nodes right after it, the implicit OR last.
        p = np.concatenate([g_wp, w_wp[split], implicit])
        t = np.concatenate([g_wt, own, np.zeros(len(implicit), dtype=_I64)])
        is_or = np.concatenate([g_any_or & ~g_split, w_or[split], np.ones(len(implicit), dtype=bool)])
        r2 = np.concatenate([g_wi, g_wi[s_group], np.full(len(implicit), _LAST, dtype=_I64)])
        r3 = np.concatenate([np.zeros(groups, dtype=_I64), k, np.zeros(len(implicit), dtype=_I64)])
        order = np.lexsort((r3, r2, p))
        index = np.empty(len(order), dtype=_I64)
        index[order] = np.arange(len(order))
        g_node, s_node, i_node = np.split(index, [groups, groups + len(split)])
        waiter_p, waiter_t, waiter_or = p[order], t[order], is_or[order]
        count = len(order)

        # Edge instances, each waiter's in its order: the waits' targets (of a split wait: from
        # its node), a split waiter's wait nodes, the implicit OR's tasks.
        wait_node = g_node[g_of_wait]
        wait_node[split] = s_node
        row_wait, tp, tt, row_wp = wait_of_row, w.tp, w.tt, w.wp
        if not (tp >= 0).all():  # a wait without targets has one row, with none
            has = np.flatnonzero(tp >= 0)
            row_wait, tp, tt, row_wp = row_wait[has], tp[has], tt[has], row_wp[has]
        pieces = [
            (wait_node[row_wait], None, w_fc[row_wait], w_wt[row_wait], row_wp, tp),
            (g_node[s_group], s_node, np.zeros(len(split), bool), w_wt[split], w_wp[split], w_wp[split]),
        ]
        if len(implicit):
            of = np.flatnonzero((g_wt != 0) & np.isin(g_wp, implicit))
            of = of[np.lexsort((g_wi[of], g_wp[of]))]
            node_of_process = np.zeros(facts.members, dtype=_I64)
            node_of_process[implicit] = i_node
            process = g_wp[of]
            pieces.append(
                (
                    node_of_process[process],
                    g_node[of],
                    np.zeros(len(of), bool),
                    np.zeros(len(of), _I64),
                    process,
                    process,
                )
            )
        # The waits' targets by name: a waiter's node, or a free node numbered after the waiters.
        first_targets = _waiter_of(waiter_p, waiter_t, tp, tt, task_count, len(facts.names))
        free = np.flatnonzero(first_targets < 0)
        free_keys = tp[free] * task_count + tt[free]
        others = np.unique(free_keys)
        first_targets[free] = count + np.searchsorted(others, free_keys)
        nodes = count + len(others)

        src = np.concatenate([piece[0] for piece in pieces])
        dst = np.concatenate([first_targets, *(piece[1] for piece in pieces[1:])])
        fc = np.concatenate([piece[2] for piece in pieces])
        owner = np.concatenate([piece[3] for piece in pieces])
        wproc = np.concatenate([piece[4] for piece in pieces])
        tproc = np.concatenate([piece[5] for piece in pieces])

        satisfied = self._satisfied(fc, owner, wproc, tproc)
        # An OR waiter with one satisfied edge is released: every edge of it is set aside.
        released = np.zeros(count, dtype=bool)
        released[src[satisfied & waiter_or[src]]] = True
        unmet = ~satisfied
        pairs = _pairs(src, dst, nodes, unmet, fc & unmet, tproc)
        counted = pairs.unmet & ~released[pairs.src]
        outside = int(np.count_nonzero(pairs.tproc[counted] >= facts.members))
        other_p, other_t = np.divmod(others, task_count)
        # Counted edges into a free process node (task 0 is "") that the quiet rule left free.
        free_targets = pairs.dst[counted] - count
        free_targets = free_targets[free_targets >= 0]
        into = (other_t[free_targets] == 0) & undecided[other_p[free_targets]]
        counts = WaitCounts(
            count,
            int(np.count_nonzero(counted)),
            len(pairs.src) - int(np.count_nonzero(counted)),
            outside,
            int(np.count_nonzero(into)),
        )
        return _compact(
            pairs.src[counted],
            pairs.dst[counted],
            pairs.fc[counted],
            np.concatenate([waiter_or, np.zeros(len(others), bool)]),
            facts.names,
            tasks,
            np.concatenate([waiter_p, other_p]),
            np.concatenate([waiter_t, other_t]),
            counts,
        )

    def _quiet(self) -> bool:
        """Whether nothing can reach a member ever again: the cut is closed, no member is active, no
        channel holds a message that may wake nor an acknowledgement in transit, and no blocked send
        is about to go on (the quiet rule of :mod:`.waitfor`)."""
        facts = self.facts
        if facts.active.any() or len(facts.waking_any) or len(facts.waking_task_channels):
            return False
        if len(_acking(self.rows, facts)) or len(_going_on(self.rows, facts)):
            return False
        return _coverage(self.rows, facts).closed

    def _consuming(self) -> np.ndarray:
        """The members whose handler will take what is queued (:func:`~.waitfor.consuming`), sorted."""
        return _consumers(self.rows, self.facts)

    def _satisfied(self, fc: np.ndarray, owner: np.ndarray, wproc: np.ndarray, tproc: np.ndarray) -> np.ndarray:
        """Which edge instances the in-flight and acknowledgement rules satisfy."""
        facts = self.facts
        base = len(facts.names)
        satisfied = np.zeros(len(fc), dtype=bool)
        acking = _acking(self.rows, facts)
        if len(acking) and fc.any():  # window space: an acknowledgement on its way back to the waiter
            satisfied[fc] = np.isin(wproc[fc] * base + tproc[fc], acking)
        consumers = self._consuming()
        if len(consumers) and fc.any():  # or a target that will consume (waitfor.consuming)
            satisfied[fc] |= np.isin(tproc[fc], consumers)
        if len(facts.waking_any) or facts.waking_task:  # a message on target -> waiter that may wake it
            back = tproc * base + wproc
            woken = np.isin(back, facts.waking_any) & ~fc
            maybe = np.flatnonzero(np.isin(back, facts.waking_task_channels) & ~fc & ~woken)
            if len(maybe):
                pairs = zip(back[maybe].tolist(), owner[maybe].tolist(), strict=True)
                woken[maybe] = np.fromiter((pair in facts.waking_task for pair in pairs), bool, len(maybe))
            satisfied |= woken
        return satisfied


def _waiter_of(
    waiter_p: np.ndarray, waiter_t: np.ndarray, target_p: np.ndarray, target_t: np.ndarray, tasks: int, names: int
) -> np.ndarray:
    """The waiter number of each target ``(target_p, target_t)``, -1 where the target is no waiter.

    A process's own node (task 0: most targets) is found in a table by process number, the
    others by binary search among the waiters' keys.
    """
    found = np.full(len(target_p), -1, dtype=_I64)
    own = np.full(names, -1, dtype=_I64)
    mine = waiter_t == 0
    own[waiter_p[mine]] = np.flatnonzero(mine)
    plain = target_t == 0
    found[plain] = own[target_p[plain]]
    rest = np.flatnonzero(~plain)
    if len(rest) and len(waiter_p):
        keys = waiter_p * tasks + waiter_t
        by_key = np.argsort(keys, kind="stable")
        sorted_keys = keys[by_key]
        wanted = target_p[rest] * tasks + target_t[rest]
        at = np.minimum(np.searchsorted(sorted_keys, wanted), len(keys) - 1)
        hit = sorted_keys[at] == wanted
        found[rest[hit]] = by_key[at[hit]]
    return found


@dataclass(frozen=True)
class _Pairs:
    """One row per (waiter, target) pair, at its first instance: whether any instance is unmet, any
    unmet one is flow control, and the target's process."""

    src: np.ndarray
    dst: np.ndarray
    unmet: np.ndarray
    fc: np.ndarray
    tproc: np.ndarray


def _pairs(
    src: np.ndarray, dst: np.ndarray, nodes: int, unmet: np.ndarray, fc: np.ndarray, tproc: np.ndarray
) -> _Pairs:
    """Merge the edge instances of each (waiter, target) pair; the instances come each waiter's in order."""
    pair = src * nodes + dst
    ordered = np.sort(pair)
    if len(pair) < 2 or (ordered[1:] != ordered[:-1]).all():  # no pair named twice, the usual case
        return _Pairs(src, dst, unmet, fc, tproc)
    order = np.argsort(pair, kind="stable")  # a pair's instances stay in order: its first comes first
    starts = _runs(pair[order])
    first = np.sort(order[starts])  # the first instance of each pair, in instance order
    group = np.empty(len(pair), dtype=_I64)
    group[order] = np.repeat(np.arange(len(starts)), np.diff(np.append(starts, len(pair))))
    index = group[first]  # the group of each kept instance
    any_unmet = np.zeros(len(starts), dtype=bool)
    np.logical_or.at(any_unmet, group, unmet)
    any_fc = np.zeros(len(starts), dtype=bool)
    np.logical_or.at(any_fc, group, fc)
    return _Pairs(src[first], dst[first], any_unmet[index], any_fc[index], tproc[first])


def _compact(
    sources: np.ndarray,
    targets: np.ndarray,
    flow_control: np.ndarray,
    is_or: np.ndarray,
    process_names: pa.Array,
    task_names: pa.Array,
    process_codes: np.ndarray,
    task_codes: np.ndarray,
    counts: WaitCounts,
) -> CompactWaitFor:
    """Lay counted edges out in compressed rows. The edges come each waiter's in its order, the
    waiters possibly interleaved: a stable sort by waiter keeps each one's order."""
    nodes = len(is_or)
    if len(sources) > 1 and (np.diff(sources) < 0).any():
        order = np.argsort(sources, kind="stable")
        sources, targets, flow_control = sources[order], targets[order], flow_control[order]
    by_target = np.argsort(targets)  # a node's predecessors in any order
    graph = CompactGraph(
        starts=_view(_starts(sources, nodes)),
        targets=_view(targets),
        ends=_view(_starts(targets, nodes)),
        sources=_view(sources[by_target]),
        is_or=memoryview(np.ascontiguousarray(is_or, dtype=np.uint8)),
    )
    return CompactWaitFor(
        graph, process_names, task_names, process_codes, task_codes, is_or, sources, targets, flow_control, counts
    )


def compact_edges(edges: pa.Table, counts: WaitCounts) -> CompactWaitFor:
    """The wait-for graph of one snapshot given by its counted edges, as the pipeline's reduction leaves them.

    `edges` has one row per counted edge, with columns ``process, task, is_or`` (the waiter and
    its model), ``rank, sub`` (the waiter's place in ``build_wait_for``'s node order),
    ``target_process, target_task``, ``position`` (the edge's place among its waiter's) and
    ``flow_control``. Reduction keeps every deadlocked node and the edges among them, so
    :func:`find_compact_deadlock` on what a reduction left finds the whole graph's evidence;
    `counts` are the whole graph's. O(n log n) for n edges.
    """
    processes = pc.dictionary_encode(
        pa.chunked_array([*_strings(edges["process"]).chunks, *_strings(edges["target_process"]).chunks], pa.string())
    )
    tasks = pc.dictionary_encode(
        pa.chunked_array(
            [pc.fill_null(c, "") for c in (*_strings(edges["task"]).chunks, *_strings(edges["target_task"]).chunks)],
            pa.string(),
        )
    )
    n = edges.num_rows
    p_names = processes.chunks[-1].dictionary if processes.num_chunks else pa.array([], pa.string())
    t_names = tasks.chunks[-1].dictionary if tasks.num_chunks else pa.array([], pa.string())
    p_codes = _ints(pa.chunked_array([c.indices for c in processes.chunks], pa.int32())) if n else np.zeros(0, _I64)
    t_codes = _ints(pa.chunked_array([c.indices for c in tasks.chunks], pa.int32())) if n else np.zeros(0, _I64)
    base = max(len(t_names), 1)
    waiter_key, target_key = p_codes[:n] * base + t_codes[:n], p_codes[n:] * base + t_codes[n:]
    rank, sub, position = _ints(edges["rank"]), _ints(edges["sub"]), _ints(edges["position"])
    is_or = _bools(edges["is_or"]) if n else np.zeros(0, bool)
    # The waiters in node order (rank, sub), then each waiter's edges by position.
    keys, first = np.unique(waiter_key, return_index=True)
    order = np.lexsort((sub[first], rank[first]))
    waiters = keys[order]
    index = np.empty(len(keys), dtype=_I64)
    index[order] = np.arange(len(keys))
    src = index[np.searchsorted(keys, waiter_key)]
    at = np.minimum(np.searchsorted(keys, target_key), max(len(keys) - 1, 0))
    found = keys[at] == target_key if len(keys) else np.zeros(n, bool)
    others = np.unique(target_key[~found])
    dst = np.where(found, index[at] if len(keys) else 0, len(keys) + np.searchsorted(others, target_key))
    edge_order = np.lexsort((position, src))
    all_keys = np.concatenate([waiters, others])
    process_codes, task_codes = np.divmod(all_keys, base)
    return _compact(
        src[edge_order],
        dst[edge_order],
        _bools(edges["flow_control"])[edge_order] if n else np.zeros(0, bool),
        np.concatenate([is_or[first][order], np.zeros(len(others), bool)]),
        p_names,
        t_names,
        process_codes,
        task_codes,
        counts,
    )


# -- the deadlock -------------------------------------------------------------------------------------------


def find_compact_deadlock(wf: CompactWaitFor) -> Deadlock:
    """:func:`~.waitfor.find_deadlock` on a compact graph: the same evidence, from the same shared algorithm.

    The reduction; the cycle walk from the first deadlocked node in node order, rotated to its
    smallest node; the knot (when an OR waiter is deadlocked) and the count of separate
    deadlocks from one component search of the deadlocked subgraph. O(V + E) Python steps, plus
    sorting the evidence.
    """
    G = wf.graph
    dead = compact_deadlocked(G)
    if dead.find(1) < 0:
        return Deadlock([], [], [], [], 0)
    walk = compact_cycle(G, dead)
    processes, tasks = wf.labels(walk)
    labels = list(zip(processes.to_pylist(), tasks.to_pylist(), strict=True))
    first = labels.index(min(labels))
    walk, cycle = walk[first:] + walk[:first], labels[first:] + labels[:first]
    starts = np.frombuffer(G.starts, dtype=_I64)
    flow = [
        bool(wf.flow_control[starts[u] + G.successors(u).tolist().index(v)])
        for u, v in zip(walk, walk[1:] + walk[:1], strict=True)
    ]
    # The deadlocked subgraph in compressed rows: its edges are a subsequence of the graph's.
    deadlocked = np.frombuffer(dead, dtype=np.uint8).astype(bool)
    among = deadlocked[wf.sources] & deadlocked[wf.targets]
    kept = np.concatenate([[0], np.cumsum(among)])
    sub_starts, sub_targets = kept[starts], wf.targets[among]
    subgraph = CompactGraph(_view(sub_starts), _view(sub_targets), (), (), ())
    dead_nodes = np.flatnonzero(deadlocked)
    # The cycle's component at once, with whole-array steps; the component search does the rest.
    pivot = _pivot_component(sub_starts, sub_targets, walk[0]) if len(dead_nodes) >= _PIVOT_NODES else None
    done = np.flatnonzero(pivot) if pivot is not None else np.zeros(0, dtype=_I64)
    sink, separate = compact_components(subgraph, _view(dead_nodes), done=_view(done))
    if len(done):
        sources = np.repeat(np.arange(len(starts) - 1), np.diff(sub_starts))
        separate += 1  # it holds the cycle
        if not (pivot[sources] & ~pivot[sub_targets]).any():  # no edge out: a sink
            sink = [*sink, *done.tolist()]
    # Every deadlocked node sorted by label, and the knot in the same order.
    processes, tasks = wf.labels(dead_nodes)
    table = pa.table({"p": processes, "t": tasks, "n": dead_nodes}).sort_by([("p", "ascending"), ("t", "ascending")])
    everyone = list(zip(table["p"].to_pylist(), table["t"].to_pylist(), strict=True))
    knot: list[Node] = []
    if (deadlocked & wf.is_or).any():
        in_sink = np.zeros(len(deadlocked), dtype=bool)
        in_sink[np.asarray(sink, dtype=_I64)] = True
        keep = in_sink[_ints(table["n"])]
        knot = [label for label, kept_ in zip(everyone, keep.tolist(), strict=True) if kept_]
    return Deadlock(everyone, cycle, knot, empty_channels(cycle, flow), separate)


#: Deadlocked nodes from which the cycle's component is found breadth-first before the component
#: search: in a large deadlock most nodes are in one component, which whole-array steps find at once.
_PIVOT_NODES = 10_000
#: Breadth-first levels after which the search gives up (a long chain: the component search is quick on it).
_MAX_LEVELS = 1_000


def _pivot_component(starts: np.ndarray, targets: np.ndarray, pivot: int) -> np.ndarray | None:
    """The strongly connected component of `pivot` in the graph of compressed rows `starts`,
    `targets`, as a mask: the nodes it reaches that reach it (forward-backward, Fleischer,
    Hendrickson and Pınar, 2000), each direction breadth-first, a level per whole-array step.
    None when a direction takes more than :data:`_MAX_LEVELS` levels. O(V + E) per direction.
    """
    n = len(starts) - 1
    forward = _reach(starts, targets, pivot)
    if forward is None:
        return None
    # Backward among the nodes reached forward only: a chain that leads into the component is no part of it.
    sources = np.repeat(np.arange(n), np.diff(starts))
    return _reach(_starts(targets, n), sources[np.argsort(targets, kind="stable")], pivot, forward)


def _reach(starts: np.ndarray, targets: np.ndarray, source: int, among: np.ndarray | None = None) -> np.ndarray | None:
    """The nodes reachable from `source` (a mask), through the nodes `among` (a mask) if given,
    breadth-first; None past :data:`_MAX_LEVELS` levels."""
    seen = np.zeros(len(starts) - 1, dtype=bool)
    seen[source] = True
    blocked = seen if among is None else ~among | seen
    frontier = np.array([source], dtype=_I64)
    for _ in range(_MAX_LEVELS):
        low = starts[frontier]
        lengths = starts[frontier + 1] - low
        total = int(lengths.sum())
        if total == 0:
            return seen
        at = np.repeat(low - (np.cumsum(lengths) - lengths), lengths) + np.arange(total)
        reached = targets[at]
        reached = np.unique(reached[~blocked[reached]])
        if len(reached) == 0:
            return seen
        seen[reached] = True
        if blocked is not seen:
            blocked[reached] = True
        frontier = reached
    return None


# -- coverage, termination, conservation --------------------------------------------------------------------


def _coverage(rows: SnapshotRows, facts: _Facts) -> CutCoverage:
    """:func:`~.cut.coverage` of the snapshot in `rows`: every name that a wait target (not ""), a
    channel, the expected members or the outside peers give, that is not a member."""
    targets = facts.code("wait_edges", "target_process")
    empty = pc.index_in(pa.array([""]), value_set=facts.names)[0].as_py()
    named = np.concatenate(
        [
            targets[(targets >= 0) & (targets != (-1 if empty is None else empty))],
            facts.code("channels", "src"),
            facts.code("channels", "dst"),
            facts.expected,
        ]
    )
    missing = np.unique(named[named >= facts.members])
    return cut_coverage(
        facts.members,
        _sorted_strings(facts.names.take(pa.array(missing, pa.int64()))),
        rows.head.get("expected_member_count") or 0,
    )


def _held(rows: SnapshotRows, facts: _Facts) -> dict[str, list[Holding]]:
    """:func:`~.predicates.held` of the snapshot in `rows`: per counter, its non-zero units on
    processes (by id), then on channels (by src, dst, summing the recorded messages' counters)."""
    counters = rows.counters
    code = facts.code("counters", "process_id")
    on_process = code >= 0
    _check_members(rows.head["snapshot_id"], facts, code[on_process])
    seen = counters.filter(pa.array(on_process)) if counters.num_rows else counters
    in_flight = _in_flight(rows.messages)
    holdings: dict[str, list[Holding]] = {
        name: []
        for name in pc.unique(
            pa.concat_arrays([_array(seen["counter"]).cast(pa.string()), _array(in_flight["counter"])])
        ).to_pylist()
    }
    held = seen.filter(pc.not_equal(seen["amount"], 0)).sort_by([("counter", "ascending"), ("process_id", "ascending")])
    _append_runs(holdings, held["counter"], held["process_id"].to_pylist(), held["amount"])
    moving = in_flight.filter(pc.not_equal(in_flight["amount"], 0)).sort_by(
        [("counter", "ascending"), ("src", "ascending"), ("dst", "ascending")]
    )
    channels = list(zip(moving["src"].to_pylist(), moving["dst"].to_pylist(), strict=True))
    _append_runs(holdings, moving["counter"], channels, moving["amount"])
    return holdings


def _append_runs(
    holdings: dict[str, list[Holding]], counters: pa.ChunkedArray, where: list[Any], amounts: pa.ChunkedArray
) -> None:
    """Append ``(where, amount)`` to ``holdings[counter]`` for rows sorted by counter, a run of them at a time."""
    names = _array(counters).cast(pa.string())
    if len(names) == 0:
        return
    amount = _array(amounts).to_pylist()
    firsts = pc.indices_nonzero(pc.not_equal(names.slice(1), names.slice(0, len(names) - 1))).to_pylist()
    bounds = [0, *(i + 1 for i in firsts), len(names)]
    for a, b in itertools.pairwise(bounds):
        holdings[names[a].as_py()] += zip(where[a:b], amount[a:b], strict=True)


def _in_flight(messages: pa.Table) -> pa.Table:
    """The recorded messages' counters summed per channel and counter: ``src, dst, counter, amount``."""
    empty = pa.table({name: pa.array([], pa.string()) for name in ("src", "dst", "counter")}).append_column(
        "amount", pa.array([], pa.int64())
    )
    if messages.num_rows == 0:
        return empty
    maps = _array(messages["counters"])
    if isinstance(maps.type, pa.MapType):  # as a list of entries: the list kernels take no map
        maps = maps.cast(pa.list_(pa.struct([("key", maps.type.key_type), ("value", maps.type.item_type)])))
    parents = pc.list_parent_indices(maps)
    if len(parents) == 0:
        return empty
    entries = pc.list_flatten(maps)
    table = pa.table(
        {
            "src": _array(messages["src"]).cast(pa.string()).take(parents),
            "dst": _array(messages["dst"]).cast(pa.string()).take(parents),
            "counter": entries.field("key").cast(pa.string()),
            "amount": pc.fill_null(entries.field("value").cast(pa.int64()), 0),
        }
    )
    summed = table.group_by(["src", "dst", "counter"], use_threads=False).aggregate([("amount", "sum")])
    return summed.rename_columns(["src", "dst", "counter", "amount"])


def _check_channels(rows: SnapshotRows, facts: _Facts) -> None:
    """RowsError when messages lie on a channel without a row, or a channel's count of them is not its rows'."""
    sid = rows.head["snapshot_id"]
    base = len(facts.names)
    channels = facts.code("channels", "src") * base + facts.code("channels", "dst")
    on = facts.code("messages", "src") * base + facts.code("messages", "dst")
    stray = ~np.isin(on, channels)
    if stray.any():
        at = int(np.flatnonzero(stray)[0])
        src, dst = rows.messages["src"][at].as_py(), rows.messages["dst"][at].as_py()
        raise RowsError(f"snapshot {sid}: messages recorded on {src}->{dst}, a channel it does not have")
    if rows.channels.num_rows == 0:
        return
    keys, counts = np.unique(on, return_counts=True)
    found = np.zeros(len(channels), dtype=_I64)
    if len(keys):
        at = np.minimum(np.searchsorted(keys, channels), len(keys) - 1)
        found = np.where(keys[at] == channels, counts[at], 0)
    recorded = _ints(rows.channels["recorded"])
    wrong = np.flatnonzero(found != recorded)
    if len(wrong):
        at_ = int(wrong[0])
        src, dst = rows.channels["src"][at_].as_py(), rows.channels["dst"][at_].as_py()
        raise RowsError(f"snapshot {sid} channel {src}->{dst}: {recorded[at_]} messages recorded, {found[at_]} rows")


@dataclass(frozen=True)
class LightFacts:
    """What the built-in results read of a snapshot besides its wait-for graph: the cut's coverage,
    the ``termination`` result, and where each counter's units are (:func:`~.predicates.held`'s form)."""

    cut: CutCoverage
    termination: PredicateResult
    holdings: dict[str, list[Holding]]

    def results(self, found: Deadlock, counts: WaitCounts, expected_totals: Mapping[str, int]) -> list[PredicateResult]:
        """The built-in results, given the wait-for graph's deadlock evidence `found` and size `counts`:
        :func:`~.evaluate.built_in_results`' order and functions."""
        results = [deadlock_result(found, counts, self.cut, self.termination), self.termination]
        return results + conservation_results(self.holdings, expected_totals, self.cut)


def light_facts(rows: SnapshotRows) -> LightFacts:
    """The :class:`LightFacts` of the snapshot in `rows`.

    Of ``rows.wait_edges`` only the waiter and target processes, the waiter task and
    ``flow_control`` are read (the cut's coverage, and the blocked sends about to go on): a caller
    that reduced the graph elsewhere may pass those alone (:data:`LIGHT_WAIT_COLUMNS`), the other
    columns null. RowsError when
    messages lie on a channel without a row, or a counter on a process without one. O(n log n)
    for the n rows.
    """
    facts = _facts(rows)
    _check_channels(rows, facts)
    cut = _coverage(rows, facts)
    active = _sorted_strings(facts.names.slice(0, facts.members).filter(pa.array(facts.active)))
    going, base = _going_on(rows, facts), len(facts.names)
    released = _sorted_pairs(facts.names.take(pa.array(going // base)), facts.names.take(pa.array(going % base)))
    termination = termination_result(active, facts.busy, facts.members, cut, released)
    return LightFacts(cut, termination, _held(rows, facts))


def light_results(
    rows: SnapshotRows, found: Deadlock, counts: WaitCounts, expected_totals: Mapping[str, int]
) -> list[PredicateResult]:
    """The built-in results of the snapshot in `rows` given its wait-for graph's deadlock evidence
    `found` and size `counts`: :func:`~.evaluate.built_in_results`, from the rows (see :func:`light_facts`).
    A protobuf message per holding and per node of the evidence."""
    return light_facts(rows).results(found, counts, expected_totals)


def evaluate_rows(rows: SnapshotRows, expected_totals: Mapping[str, int] | None = None) -> list[PredicateResult]:
    """Every built-in result of the snapshot in `rows`, as ``evaluate(snapshot_from_rows(...)).results``
    gives them (user predicates aside): deadlock, termination, then conservation by counter.

    `expected_totals` as for :func:`~.evaluate.evaluate`. RowsError when the rows do not fit
    together. O(n log n) column work for n rows, O(V + E) Python steps for the graph's V nodes and
    E edges, and a protobuf message per node and per holding of the evidence.
    """
    wait_for = compact_wait_for(rows)
    return light_results(rows, find_compact_deadlock(wait_for), wait_for.counts, expected_totals or {})
