"""Graph reduction on plain networkx graphs: hand-checked cases and properties against brute force."""

import networkx as nx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stablewatch.detector.evaluation.deadlock import (
    AND,
    OR,
    and_deadlock,
    deadlock_cycle,
    deadlock_knot,
    deadlocked_nodes,
    or_deadlock,
)


def graph(edges: list[tuple[str, str]], models: dict[str, str] | None = None) -> nx.DiGraph:
    G = nx.DiGraph(edges)
    for node, model in (models or {}).items():
        G.add_node(node, model=model)
    return G


def assert_is_cycle(G: nx.DiGraph, cycle: list, within: set) -> None:
    assert cycle, "expected a cycle"
    assert len(set(cycle)) == len(cycle)
    assert set(cycle) <= within
    for u, v in zip(cycle, cycle[1:] + cycle[:1], strict=True):
        assert G.has_edge(u, v)


def test_and_cycle() -> None:
    G = graph([("a", "b"), ("b", "c"), ("c", "a")])
    dead = deadlocked_nodes(G)
    assert dead == {"a", "b", "c"}
    assert deadlock_cycle(G, dead) == ["a", "b", "c"]


def test_self_loop_is_a_cycle() -> None:
    G = graph([("a", "a"), ("b", "a")])
    assert deadlocked_nodes(G) == {"a", "b"}
    assert deadlock_cycle(G, {"a", "b"}) == ["a"]


def test_chain_into_cycle_deadlocks_the_chain_too() -> None:
    G = graph([("x", "y"), ("y", "a"), ("a", "b"), ("b", "a"), ("z", "free")])
    dead = deadlocked_nodes(G)
    assert dead == {"x", "y", "a", "b"}
    assert deadlock_cycle(G, dead) == ["a", "b"]


def test_pure_chain_is_no_deadlock() -> None:
    G = graph([("a", "b"), ("b", "c"), ("c", "d")])
    assert deadlocked_nodes(G) == set()
    assert deadlock_cycle(G, set()) == []
    assert deadlock_knot(G, set()) == set()


def test_and_waiter_with_one_free_target_still_deadlocks() -> None:
    G = graph([("a", "b"), ("b", "a"), ("a", "free")])
    assert deadlocked_nodes(G) == {"a", "b"}


def test_or_cycle_with_exit_to_free_node_is_no_deadlock() -> None:
    G = graph([("a", "b"), ("b", "c"), ("c", "a"), ("c", "free")], {"a": OR, "b": OR, "c": OR})
    dead = deadlocked_nodes(G)
    assert dead == set()
    assert deadlock_knot(G, dead) == set()
    # The same graph under the AND model is deadlocked.
    assert and_deadlock(G) == {"a", "b", "c"}


def test_or_knot_deadlocks() -> None:
    edges = [("a", "b"), ("b", "a"), ("b", "c"), ("c", "a"), ("d", "a"), ("d", "e"), ("e", "d")]
    G = graph(edges, dict.fromkeys("abcde", OR))
    dead = deadlocked_nodes(G)
    assert dead == {"a", "b", "c", "d", "e"}
    # d and e only lead into the knot {a, b, c}: deadlocked, but not part of it.
    assert deadlock_knot(G, dead) == {"a", "b", "c"}
    assert_is_cycle(G, deadlock_cycle(G, dead), dead)
    assert or_deadlock(G) == dead


def test_mixed_and_or() -> None:
    # o (OR) needs a or f; f is free, so o is released; x (AND) needs o and y; y needs x.
    G = graph([("o", "a"), ("o", "f"), ("a", "o"), ("x", "o"), ("x", "y"), ("y", "x")], {"o": OR, "a": AND})
    assert deadlocked_nodes(G) == {"x", "y"}
    # With o an AND waiter, a and o wait on each other as well.
    G.nodes["o"]["model"] = AND
    assert deadlocked_nodes(G) == {"o", "a", "x", "y"}


def test_default_model_and_model_attribute_name() -> None:
    G = nx.DiGraph([(1, 2), (2, 1), (2, 3)])
    assert deadlocked_nodes(G) == {1, 2}
    assert deadlocked_nodes(G, default=OR) == set()
    G.nodes[2]["kind"] = OR
    assert deadlocked_nodes(G, model="kind") == set()
    assert deadlocked_nodes(G, model=None) == {1, 2}


def test_cycle_needs_a_closed_deadlocked_set() -> None:
    G = graph([("a", "b")])
    with pytest.raises(ValueError):
        deadlock_cycle(G, {"a"})


@pytest.mark.parametrize("into_cycle", [True, False])
def test_ten_thousand_long_chain(into_cycle: bool) -> None:
    n = 10_000
    G = nx.DiGraph((i, i + 1) for i in range(n))
    if into_cycle:
        G.add_edges_from([(n, n + 1), (n + 1, n)])
    dead = deadlocked_nodes(G)
    assert len(dead) == (n + 2 if into_cycle else 0)
    assert deadlock_cycle(G, dead) == ([n, n + 1] if into_cycle else [])
    assert or_deadlock(G) == dead
    if into_cycle:
        assert deadlock_knot(G, dead) == {n, n + 1}


# --- properties -------------------------------------------------------------------------------


@st.composite
def wait_graphs(draw: st.DrawFn, models: list[str] | None = None) -> nx.DiGraph:
    n = draw(st.integers(1, 9))
    edges = draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)), max_size=n * 3))
    G = nx.DiGraph()
    G.add_nodes_from(range(n))
    G.add_edges_from(edges)
    for node in G:
        G.nodes[node]["model"] = draw(st.sampled_from(models or [AND, OR]))
    return G


def brute_force(G: nx.DiGraph) -> set:
    """Release nodes by the definition, sweeping until nothing changes."""
    released: set = set()
    changed = True
    while changed:
        changed = False
        for n in G:
            if n in released:
                continue
            targets = list(G.successors(n))
            if G.nodes[n]["model"] == OR:
                free = not targets or any(t in released for t in targets)
            else:
                free = all(t in released for t in targets)
            if free:
                released.add(n)
                changed = True
    return set(G) - released


@settings(max_examples=400, derandomize=True, deadline=None)
@given(wait_graphs())
def test_reduction_equals_brute_force_fixpoint(G: nx.DiGraph) -> None:
    dead = deadlocked_nodes(G)
    assert dead == brute_force(G)
    if dead:
        assert_is_cycle(G, deadlock_cycle(G, dead), dead)
        knot = deadlock_knot(G, dead)
        assert knot and knot <= dead
        # The knot is closed among deadlocked nodes, and every deadlocked node leads into it.
        assert all(s in knot for n in knot for s in G.successors(n) if s in dead)
        assert all(n in knot or nx.descendants(G.subgraph(dead), n) & knot for n in dead)


@settings(max_examples=300, derandomize=True, deadline=None)
@given(wait_graphs([AND]))
def test_and_reduction_is_reaching_a_cycle(G: nx.DiGraph) -> None:
    on_cycle = {n for c in nx.strongly_connected_components(G) if len(c) > 1 for n in c}
    on_cycle |= {n for n in G if G.has_edge(n, n)}
    reach = set(on_cycle)
    for n in on_cycle:
        reach |= nx.ancestors(G, n)
    assert deadlocked_nodes(G) == reach == and_deadlock(G)


@settings(max_examples=300, derandomize=True, deadline=None)
@given(wait_graphs([OR]))
def test_or_reduction_is_not_reaching_a_free_node(G: nx.DiGraph) -> None:
    free = {n for n in G if G.out_degree(n) == 0}
    can_reach_free = set(free)
    for n in free:
        can_reach_free |= nx.ancestors(G, n)
    assert deadlocked_nodes(G) == set(G) - can_reach_free == or_deadlock(G)
