"""Graph reduction on DataFrames: the same graph as ``build_wait_for``, the same deadlocked set as the shared algorithm.

Stopping the rounds anywhere (the cap) and finishing with ``deadlocked_nodes`` must give exactly
the whole graph's deadlocked nodes, on large random graphs (AND, OR and mixed) and on a
10 000-long wait chain, whose links would otherwise cost a round each. The reduction's settings
(``Reduction``) refuse values out of their range, naming the setting.
"""

from __future__ import annotations

import random
from pathlib import Path

import networkx as nx
import pyarrow as pa
import pytest
from pyspark.sql import DataFrame, SparkSession
from snapshot_gen import START, Archived, random_archive, summary_of, write_archive

from stablewatch.detector.evaluation import evaluate
from stablewatch.detector.evaluation.cut import coverage
from stablewatch.detector.evaluation.deadlock import AND, OR, deadlocked_nodes
from stablewatch.detector.evaluation.waitfor import build_wait_for
from stablewatch.pipeline import cli
from stablewatch.pipeline.defaults import (
    DEFAULT_FINISH_EDGES,
    DEFAULT_MAX_ROUNDS,
    DEFAULT_MIN_RELEASE,
    Reduction,
    ReductionError,
)
from stablewatch.pipeline.evaluate import evaluate_archive
from stablewatch.pipeline.reduce import counted_rows, reduce_wait_for, remaining_graphs, wait_for_frames
from stablewatch.pipeline.tables import open_archive
from stablewatch.v1 import GlobalSnapshot, LocalState, ProcessSnapshot, Wait, WaitNode

pytestmark = pytest.mark.timeout(900)


def random_graph(seed: int, nodes: int, edges: int, or_share: float, acyclic: bool = False) -> nx.DiGraph:
    """`nodes` nodes, `edges` random distinct edges (low to high when `acyclic`), a share of OR waiters."""
    rng = random.Random(seed)
    pairs: dict[tuple[int, int], None] = {}
    while len(pairs) < edges:
        u, v = rng.randrange(nodes), rng.randrange(nodes)
        if not acyclic:
            pairs[u, v] = None
        elif u != v:
            pairs[min(u, v), max(u, v)] = None
    G = nx.DiGraph()
    G.add_nodes_from(range(nodes))
    G.add_edges_from(pairs)
    for node in G:
        if G.out_degree(node):
            G.nodes[node]["model"] = OR if rng.random() < or_share else AND
    return G


def edge_frame(spark: SparkSession, G: nx.DiGraph) -> DataFrame:
    waiters, targets = zip(*G.edges(), strict=True)
    is_or = [G.nodes[u]["model"] == OR for u in waiters]
    table = pa.table({"waiter": pa.array(waiters, pa.int64()), "target": pa.array(targets, pa.int64()), "is_or": is_or})
    return spark.createDataFrame(table)


def finish(remaining: DataFrame) -> tuple[set[int], nx.DiGraph]:
    """The shared algorithm on what remains: its deadlocked nodes, and the remaining graph."""
    rows = remaining.toArrow().to_pylist()
    R = nx.DiGraph()
    for row in rows:
        R.add_node(row["waiter"], model=OR if row["is_or"] else AND)
    R.add_edges_from((row["waiter"], row["target"]) for row in rows)
    return deadlocked_nodes(R), R


GRAPHS = {
    "and": dict(seed=1, nodes=30_000, edges=60_000, or_share=0.0),
    "or": dict(seed=2, nodes=30_000, edges=45_000, or_share=1.0),
    "mixed": dict(seed=3, nodes=30_000, edges=50_000, or_share=0.5),
    "acyclic": dict(seed=4, nodes=30_000, edges=60_000, or_share=0.3, acyclic=True),
}


@pytest.mark.parametrize("shape", GRAPHS)
def test_capped_reduction_finishes_to_the_shared_algorithms_set(spark: SparkSession, shape: str) -> None:
    G = random_graph(**GRAPHS[shape])
    expected = deadlocked_nodes(G)
    edges = edge_frame(spark, G)
    sizes = []
    for cap in (0, 2, 1000):
        remaining, rounds = reduce_wait_for(edges, max_rounds=cap)
        assert rounds <= cap
        found, R = finish(remaining)
        assert found == expected, (shape, cap)
        sizes.append(R.number_of_edges())
    assert rounds < 1000  # a fixpoint: the waiters left are exactly the deadlocked nodes
    assert {node for node, model in R.nodes(data="model") if model} == expected
    assert sizes[0] == G.number_of_edges()
    assert sizes[0] >= sizes[1] >= sizes[2]
    assert sizes[1] < sizes[0] or shape == "and"  # the first rounds release the free nodes' waiters
    if shape == "acyclic":
        assert not expected and sizes[2] == 0


@pytest.mark.parametrize("into_cycle", [False, True])
def test_a_ten_thousand_long_chain_costs_the_cap_not_a_round_per_link(spark: SparkSession, into_cycle: bool) -> None:
    n = 10_000
    G = nx.DiGraph([(i, i + 1) for i in range(n)])  # n links; node n is free...
    if into_cycle:
        G.add_edge(n, n - 1)  # ...unless it waits on the last waiter: a cycle at the end
    for node in G:
        if G.out_degree(node):
            G.nodes[node]["model"] = AND
    remaining, rounds = reduce_wait_for(edge_frame(spark, G), max_rounds=5)
    found, R = finish(remaining)
    size = R.number_of_edges()
    assert found == deadlocked_nodes(G)
    if into_cycle:
        assert len(found) == n + 1 and rounds == 1 and size == n + 1  # nothing to release: a fixpoint at once
    else:
        assert not found and rounds == 5 and size == n - 5  # five links released, the rest finished at once


def chain_snapshot(n: int, into_cycle: bool) -> GlobalSnapshot:
    """Processes C0 -> C1 -> ... -> C{n-1}, each waiting on the next; the last waits on C0 when `into_cycle`."""
    snapshot = GlobalSnapshot(snapshot_id=1, expected_members=[f"C{i}" for i in range(n)])
    snapshot.started_at.FromDatetime(START)
    snapshot.completed_at.FromDatetime(START)
    for i in range(n):
        state = LocalState()
        if i + 1 < n or into_cycle:
            state.waits.append(Wait(targets=[WaitNode(process=f"C{(i + 1) % n}")]))
        snapshot.processes.append(ProcessSnapshot(process_id=f"C{i}", state=state))
    return snapshot


@pytest.mark.parametrize("into_cycle", [False, True])
def test_a_ten_thousand_process_chain_archived_without_its_blob(
    spark: SparkSession, tmp_path: Path, into_cycle: bool
) -> None:
    snapshot = chain_snapshot(10_000, into_cycle)
    write_archive(tmp_path, [Archived(summary_of(snapshot), snapshot)], blobless={1})
    evaluated = evaluate_archive(open_archive(spark, tmp_path), reduction=Reduction(max_rounds=4, finish_edges=0))
    assert (evaluated.large, evaluated.rounds) == (1, 1 if into_cycle else 4)
    rows = evaluated.evaluations.orderBy("position").toArrow().to_pylist()
    expected = evaluate(snapshot, {})
    assert [row["result"] for row in rows] == [r.SerializeToString(deterministic=True) for r in expected.results]
    assert rows[0]["holds"] == into_cycle


def test_wait_for_frames_build_the_graph_build_wait_for_builds(spark: SparkSession, tmp_path: Path) -> None:
    items = random_archive(seed=9, count=150)
    archive = open_archive(spark, write_archive(tmp_path, items))
    tables = ("processes", "wait_edges", "messages", "channels")
    open_snapshots = [item.snapshot.snapshot_id for item in items if not coverage(item.snapshot).closed]
    frames = wait_for_frames(*(archive.table(name) for name in tables), open_snapshots=open_snapshots)
    waiters = frames.waiters.toArrow().to_pylist()
    edges = frames.edges.toArrow().to_pylist()
    graphs = remaining_graphs(counted_rows(frames).toArrow())
    for item in items:
        wf = build_wait_for(item.snapshot)
        sid, G = wf.snapshot_id, wf.graph
        mine = sorted((w for w in waiters if w["snapshot_id"] == sid), key=lambda w: w["rank"])
        assert [((w["process"], w["task"]), OR if w["is_or"] else AND) for w in mine] == [
            (node, model) for node, model in G.nodes(data="model") if model is not None
        ], sid
        pairs = {
            ((e["process"], e["task"]), (e["target_process"], e["target_task"])): e
            for e in edges
            if e["snapshot_id"] == sid
        }
        counted = {pair: bool(e["flow_control"]) for pair, e in pairs.items() if e["counted"]}
        assert counted == {(u, v): bool(fc) for u, v, fc in G.edges(data="flow_control")}, sid
        assert {pair for pair, e in pairs.items() if not e["counted"]} == set(wf.discounted), sid
        rebuilt = graphs.get(sid, nx.DiGraph())
        for node in G:  # each waiter's edges in the order build_wait_for added them
            assert (list(rebuilt.successors(node)) if node in rebuilt else []) == list(G.successors(node)), sid


def test_the_settings_default_to_the_documented_defaults() -> None:
    assert Reduction() == Reduction(None, DEFAULT_MAX_ROUNDS, DEFAULT_FINISH_EDGES, DEFAULT_MIN_RELEASE)


@pytest.mark.parametrize(
    "settings",
    [
        {"reduce_above": 0, "max_rounds": 0, "finish_edges": 0, "min_release": 0.0},  # every lower bound
        {"reduce_above": 10**9, "max_rounds": 10**6, "finish_edges": 10**12, "min_release": 1.0},
        {"reduce_above": None, "min_release": 0.2},
    ],
)
def test_settings_in_their_ranges_are_taken_as_given(settings: dict) -> None:
    reduction = Reduction(**settings)
    assert {name: getattr(reduction, name) for name in settings} == settings


@pytest.mark.parametrize(
    ("name", "value", "reason"),
    [
        ("reduce_above", -1, "must be at least 0, not -1"),
        ("max_rounds", -1, "must be at least 0, not -1"),
        ("finish_edges", -10, "must be at least 0, not -10"),
        ("min_release", -0.1, "must be from 0 to 1, not -0.1"),
        ("min_release", 1.5, "must be from 0 to 1, not 1.5"),
        ("min_release", float("nan"), "must be from 0 to 1, not nan"),
    ],
)
def test_a_setting_out_of_its_range_is_refused_by_name(name: str, value: float, reason: str) -> None:
    with pytest.raises(ReductionError) as refused:
        Reduction(**{name: value})
    assert isinstance(refused.value, ValueError)
    assert (refused.value.field, refused.value.reason) == (name, reason)
    assert str(refused.value) == f"{name} {reason}"


@pytest.mark.parametrize(
    ("flag", "value", "reason"),
    [
        ("--reduce-above", "-1", "must be at least 0, not -1"),
        ("--max-rounds", "-1", "must be at least 0, not -1"),
        ("--finish-edges", "-10", "must be at least 0, not -10"),
        ("--min-release", "1.5", "must be from 0 to 1, not 1.5"),
        ("--max-rounds", "two", "expected a whole number, not 'two'"),
        ("--min-release", "half", "expected a fraction from 0 to 1, not 'half'"),
    ],
)
def test_the_command_refuses_a_bad_reduction_flag_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, value: str, reason: str
) -> None:
    """Argparse's usage error (status 2) before any work, with the range ``Reduction`` checks."""
    with pytest.raises(SystemExit) as exited:
        cli.main(["evaluate", "--archive", str(tmp_path), "--out", str(tmp_path), flag, value])
    assert exited.value.code == 2
    assert f"stablewatch pipeline evaluate: error: argument {flag}: {reason}" in capsys.readouterr().err
