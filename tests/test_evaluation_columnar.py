"""The columnar evaluation gives the detector's own results, byte for byte, from a snapshot's archive rows.

Random snapshots (hypothesis) mix everything the wait-for rules and the other built-ins
distinguish: AND, OR and unspecified waits of processes and tasks, several waits of one task (all
AND, merged; or not, split into ``task[wait k]`` nodes), waits without targets, targets outside the
cut, flow-control waits with acknowledgement positions, messages in flight that wake, wake one
task or nobody, counters on processes and messages (zero and negative too), expected members,
outside peers and an expected count. Each is turned into its archive rows with the archive's own
writer (``snapshot_rows``) and evaluated column by column; the detector's side is ``evaluate``.
The deadlock's component search is also run with its breadth-first first step forced on (and
cut short), and the compact algorithms are checked against networkx's on random graphs.
"""

from __future__ import annotations

import random
from pathlib import Path

import networkx as nx
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from snapshot_gen import random_archive, rows_of, write_archive

from stablewatch.detector.archive.reader import read_snapshot_rows, read_snapshots
from stablewatch.detector.archive.schema import ArchiveError
from stablewatch.detector.evaluation import columnar, evaluate
from stablewatch.detector.evaluation.columnar import (
    RowsError,
    SnapshotRows,
    compact_edges,
    compact_wait_for,
    evaluate_rows,
    find_compact_deadlock,
    light_facts,
)
from stablewatch.detector.evaluation.deadlock import (
    AND,
    OR,
    CompactGraph,
    compact_components,
    compact_deadlocked,
    deadlock_components,
    deadlocked_nodes,
)
from stablewatch.detector.evaluation.waitfor import build_wait_for, find_deadlock, wait_counts
from stablewatch.v1 import (
    WAIT_MODEL_AND,
    WAIT_MODEL_OR,
    AckPosition,
    ChannelSnapshot,
    GlobalSnapshot,
    LocalState,
    ProcessSnapshot,
    RecordedMessage,
    Wait,
    WaitNode,
)


@st.composite
def snapshots(draw: st.DrawFn) -> GlobalSnapshot:
    """A random snapshot of 1 to 6 processes (see the module docstring for what it mixes)."""
    n = draw(st.integers(1, 6))
    pids = [f"P{i}" for i in range(n)]
    tasks = ["", "", "t0", "t1", "t0[wait 1]"]
    outside = ["X", ""]
    snapshot = GlobalSnapshot(snapshot_id=draw(st.integers(1, 2**40)))
    for pid in pids:
        state = LocalState(active=draw(st.booleans()))
        handler_waits = draw(st.sampled_from([None, True, False]))  # None: an older agent's
        if handler_waits is not None:
            state.handler_waits = handler_waits
        for _ in range(draw(st.integers(0, 4))):
            wait = Wait(
                task=draw(st.sampled_from(tasks[:4])),
                model=draw(st.sampled_from([WAIT_MODEL_AND, WAIT_MODEL_OR, WAIT_MODEL_OR, 0])),
                flow_control=draw(st.integers(0, 5)) == 0,
            )
            for _ in range(draw(st.integers(0, 3))):
                process = (
                    draw(st.sampled_from(pids + outside))
                    if draw(st.integers(0, 6)) == 0
                    else draw(st.sampled_from(pids))
                )
                wait.targets.append(WaitNode(process=process, task=draw(st.sampled_from(tasks))))
            state.waits.append(wait)
        for counter in ("tokens", "credits"):
            if draw(st.booleans()):
                state.counters[counter] = draw(st.integers(-3, 5))
        snapshot.processes.append(ProcessSnapshot(process_id=pid, state=state))
    pairs = [(a, b) for a in pids for b in pids]
    for src, dst in draw(st.lists(st.sampled_from(pairs), unique=True, max_size=2 * n)) if pairs else []:
        channel = ChannelSnapshot(src=src, dst=dst)
        for _ in range(draw(st.integers(0, 3))):
            message = RecordedMessage(
                payload=b"m",
                no_wake=draw(st.integers(0, 3)) == 0,
                wakes_task=draw(st.sampled_from(["", "", "t0", "t1"])),
            )
            if draw(st.booleans()):
                message.counters[draw(st.sampled_from(["tokens", "credits", "gone"]))] = draw(st.integers(-2, 4))
            channel.messages.append(message)
        channel.sent_before_marker = len(channel.messages)
        if draw(st.booleans()):
            seen = draw(st.integers(0, 3))
            incarnation = draw(st.sampled_from([1, 2**63 + 1]))
            channel.sender_ack_seen.CopyFrom(
                AckPosition(sender_incarnation=1, receiver_incarnation=incarnation, next_seq=seen)
            )
            if draw(st.booleans()):
                other = draw(st.sampled_from([incarnation, incarnation, 7]))
                ahead = draw(st.sampled_from([seen, seen + 1, max(0, seen - 1), 2**63 + seen]))
                channel.receiver_acked.CopyFrom(
                    AckPosition(sender_incarnation=1, receiver_incarnation=other, next_seq=ahead)
                )
        snapshot.channels.append(channel)
    snapshot.expected_members.extend(draw(st.lists(st.sampled_from([*pids, "P9"]), max_size=3)))
    snapshot.outside_peers.extend(draw(st.lists(st.sampled_from(["Y", "P0"]), max_size=1)))
    snapshot.expected_member_count = draw(st.integers(0, n + 2))
    return snapshot


def serialized(results: list) -> list[bytes]:
    return [r.SerializeToString(deterministic=True) for r in results]


def assert_same(snapshot: GlobalSnapshot, totals: dict[str, int]) -> None:
    expected = evaluate(snapshot, totals)
    assert serialized(evaluate_rows(rows_of(snapshot), totals)) == serialized(list(expected.results))


@settings(max_examples=400, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(snapshots(), st.sampled_from([{}, {"tokens": 4}, {"tokens": 0, "missing": 3}]))
def test_the_results_are_the_detectors(snapshot: GlobalSnapshot, totals: dict[str, int]) -> None:
    assert_same(snapshot, totals)


@settings(max_examples=200, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(snapshots())
def test_the_graph_and_evidence_are_build_wait_fors(snapshot: GlobalSnapshot) -> None:
    """Node order, each waiter's edge order, counts and evidence, compared piece by piece."""
    wf = build_wait_for(snapshot)
    compact = compact_wait_for(rows_of(snapshot))
    assert compact.counts == wait_counts(wf)
    G = wf.graph
    waiters = [node for node, model in G.nodes(data="model") if model is not None]
    count = compact.counts.waiters
    labels = list(zip(*(column.to_pylist() for column in compact.labels(range(len(compact.graph)))), strict=True))
    assert labels[:count] == waiters
    assert [OR if flag else AND for flag in compact.is_or[:count]] == [G.nodes[n]["model"] for n in waiters]
    for i, node in enumerate(waiters):
        assert [labels[t] for t in compact.graph.successors(i)] == list(G.successors(node)), node
    assert find_compact_deadlock(compact) == find_deadlock(wf)


@settings(max_examples=150, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(snapshots(), st.sampled_from([1, 1_000]))
def test_the_component_search_finds_the_same_with_its_first_step(snapshot: GlobalSnapshot, levels: int) -> None:
    """The cycle's component found breadth-first first (even on the smallest graphs), or given up on."""
    with pytest.MonkeyPatch.context() as patched:
        patched.setattr(columnar, "_PIVOT_NODES", 0)
        patched.setattr(columnar, "_MAX_LEVELS", levels)
        assert find_compact_deadlock(compact_wait_for(rows_of(snapshot))) == find_deadlock(build_wait_for(snapshot))


def test_a_large_random_deadlock_is_the_detectors() -> None:
    """Thousands of processes waiting at random, most of them deadlocked in one component, which the
    breadth-first step finds; a long chain leading into it."""
    rng = random.Random(29)
    n = 15_000
    pids = [f"svc-{i:05d}" for i in range(n)]
    snapshot = GlobalSnapshot(snapshot_id=1, expected_members=pids)
    for i, pid in enumerate(pids):
        state = LocalState(active=rng.random() < 0.01)
        if i >= 14_000:  # a chain: each waits on the next, the last on the random part
            state.waits.append(Wait(targets=[WaitNode(process=pids[(i + 1) % n if i + 1 < n else 0])]))
        elif rng.random() < 0.95:
            model = WAIT_MODEL_OR if rng.random() < 1 / 3 else WAIT_MODEL_AND
            targets = [WaitNode(process=pids[t]) for t in rng.sample(range(14_000), 3)]
            state.waits.append(Wait(model=model, targets=targets))
        state.counters["tokens"] = 1
        snapshot.processes.append(ProcessSnapshot(process_id=pid, state=state))
    found = find_compact_deadlock(compact_wait_for(rows_of(snapshot)))
    assert len(found.deadlocked) > 5_000 and found.knot
    assert_same(snapshot, {})


@st.composite
def graphs(draw: st.DrawFn) -> nx.DiGraph:
    n = draw(st.integers(1, 12))
    G = nx.DiGraph()
    G.add_nodes_from(range(n))
    G.add_edges_from(draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)), max_size=3 * n)))
    for node in G:
        G.nodes[node]["model"] = draw(st.sampled_from([AND, OR]))
    return G


def compact(G: nx.DiGraph) -> CompactGraph:
    n = G.number_of_nodes()
    starts, targets, ends, sources = [0], [], [0], []
    for u in range(n):
        targets += list(G.successors(u))
        starts.append(len(targets))
        sources += list(G.predecessors(u))
        ends.append(len(sources))
    return CompactGraph(starts, targets, ends, sources, [G.nodes[u]["model"] == OR for u in range(n)])


@settings(max_examples=400, derandomize=True, deadline=None)
@given(graphs())
def test_the_component_search_is_networkxs(G: nx.DiGraph) -> None:
    dead = deadlocked_nodes(G)
    flags = compact_deadlocked(compact(G))
    assert {u for u in G if flags[u]} == dead
    sub = G.subgraph(dead)
    sinks = set().union(*nx.attracting_components(sub)) if dead else set()
    cyclic = sum(1 for c in nx.strongly_connected_components(sub) if len(c) > 1 or sub.has_edge(*[next(iter(c))] * 2))
    assert deadlock_components(G, dead) == (sinks, cyclic)
    among = nx.DiGraph()
    among.add_nodes_from(G.nodes(data=True))
    among.add_edges_from(sub.edges)
    sink, count = compact_components(compact(among), sorted(dead))
    assert (set(sink), count) == (sinks, cyclic)


@settings(max_examples=200, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(snapshots(), st.randoms(use_true_random=False))
def test_counted_edges_in_any_order_give_the_same_evidence(snapshot: GlobalSnapshot, rng: random.Random) -> None:
    """:func:`compact_edges` (what the pipeline's rounds leave) on a whole graph's counted edges, shuffled."""
    wf = build_wait_for(snapshot)
    G = wf.graph
    rank = {node: i for i, node in enumerate(G)}
    rows = [
        {
            "process": u[0],
            "task": u[1],
            "is_or": G.nodes[u]["model"] == OR,
            "rank": rank[u],
            "sub": 0,
            "target_process": v[0],
            "target_task": v[1],
            "position": position,
            "flow_control": bool(G.edges[u, v].get("flow_control")),
        }
        for u in G
        for position, v in enumerate(G.successors(u))
    ]
    rng.shuffle(rows)
    columns = ["process", "task", "is_or", "rank", "sub", "target_process", "target_task", "position", "flow_control"]
    table = (
        pa.table({name: [row[name] for row in rows] for name in columns})
        if rows
        else pa.table(
            {name: pa.array([], pa.string() if "process" in name or "task" in name else pa.int64()) for name in columns}
        )
    )
    assert find_compact_deadlock(compact_edges(table, wait_counts(wf))) == find_deadlock(wf)


# -- the archive's reader --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    items = random_archive(seed=29, count=60, aborted_every=13)
    return write_archive(tmp_path_factory.mktemp("archive"), items, batch_size=7, blobless={5, 6, 7})


def test_read_snapshot_rows_evaluates_as_the_rebuilt_snapshot(archive: Path) -> None:
    checked = 0
    for head, snapshot in read_snapshots(archive):
        if snapshot is None:
            with pytest.raises(ArchiveError, match="aborted"):
                read_snapshot_rows(archive, head["snapshot_id"])
            continue
        rows = read_snapshot_rows(archive, head["snapshot_id"])
        assert serialized(evaluate_rows(rows, {"tokens": 9})) == serialized(
            list(evaluate(snapshot, {"tokens": 9}).results)
        )
        light = read_snapshot_rows(archive, head["snapshot_id"], waits=False)
        assert light.wait_edges["model"].null_count == light.wait_edges.num_rows  # what light_facts does not read
        full = light_facts(rows)
        assert light_facts(light).termination == full.termination and light_facts(light).cut == full.cut
        checked += 1
    assert checked == 60 - 60 // 13
    with pytest.raises(ArchiveError, match="not in the archive"):
        read_snapshot_rows(archive, 10_000)


def test_rows_that_do_not_fit_together_are_refused() -> None:
    snapshot = GlobalSnapshot(
        snapshot_id=3,
        processes=[ProcessSnapshot(process_id="A", state=LocalState(waits=[Wait(targets=[WaitNode(process="B")])]))],
        channels=[ChannelSnapshot(src="B", dst="A", messages=[RecordedMessage(payload=b"x")])],
    )
    rows = rows_of(snapshot)
    stranger = rows.wait_edges.set_column(1, "waiter_process", pa.array(["Z"]))
    with pytest.raises(RowsError, match="names process 'Z'"):
        compact_wait_for(SnapshotRows(rows.head, rows.processes, rows.counters, stranger, rows.channels, rows.messages))
    no_channel = rows.channels.slice(0, 0)
    with pytest.raises(RowsError, match="a channel it does not have"):
        evaluate_rows(
            SnapshotRows(rows.head, rows.processes, rows.counters, rows.wait_edges, no_channel, rows.messages)
        )
    twice = pa.concat_tables([rows.messages, rows.messages])
    with pytest.raises(RowsError, match="1 messages recorded, 2 rows"):
        evaluate_rows(SnapshotRows(rows.head, rows.processes, rows.counters, rows.wait_edges, rows.channels, twice))
