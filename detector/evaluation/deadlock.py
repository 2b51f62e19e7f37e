"""Deadlock in a wait-for graph, as plain functions over a networkx ``DiGraph``.

An edge ``u -> v`` means *u waits for v*. Every node with out-edges is a waiter with a model:
AND (released only when all its targets are released) or OR (released when any one is). A node
without out-edges is free. Graph reduction (Holt, 1972) releases nodes until nothing changes; the
nodes never released are deadlocked. That one rule covers both classic definitions:

* pure AND graphs (Chandy–Misra–Haas's resource model): the nodes that can reach a cycle;
* pure OR graphs (Chandy–Misra–Haas's communication model): the nodes that cannot reach a free
  node, i.e. the knots and everything that can only lead into them;

and mixed graphs where each waiter keeps its own model. The reduction runs in O(V + E), like a
topological sort, and never enumerates simple cycles.

References
----------
R. C. Holt, "Some deadlock properties of computer systems", ACM Computing Surveys 4(3), 1972.
K. M. Chandy, J. Misra, L. M. Haas, "Distributed deadlock detection", ACM TOCS 1(2), 1983.
"""

from collections.abc import Hashable, Iterable, Set

import networkx as nx

AND = "and"
OR = "or"

__all__ = [
    "AND",
    "OR",
    "and_deadlock",
    "count_deadlocks",
    "deadlock_cycle",
    "deadlock_knot",
    "deadlocked_nodes",
    "or_deadlock",
]


def deadlocked_nodes(G: nx.DiGraph, model: str | None = "model", default: str = AND) -> set[Hashable]:
    """Return the nodes of `G` that graph reduction can never release.

    A node is released if it has no successors, if it is an AND waiter whose successors are all
    released, or if it is an OR waiter with at least one released successor. Each node's model is
    its attribute `model` (``"and"`` or ``"or"``); nodes without it, or every node when `model` is
    None, use `default`. Any value other than ``"or"`` counts as AND.

    Kahn-style propagation over predecessors: ``counter[n]`` is the out-degree of an AND node and
    ``min(1, out-degree)`` of an OR node; nodes whose counter is zero are released, and each
    released node decrements its predecessors' counters. Whatever keeps a positive counter is
    deadlocked. Iterative, so chains of any length are fine.

    Complexity: O(V + E) time, O(V) extra space.

    >>> G = nx.DiGraph([(1, 2), (2, 3), (3, 2), (4, 5)])
    >>> sorted(deadlocked_nodes(G))
    [1, 2, 3]
    >>> G.add_edge(2, 5)
    >>> G.nodes[2]["model"] = "or"  # 2 needs 3 or 5, and 5 is free
    >>> sorted(deadlocked_nodes(G))
    []
    """
    # Public API only, in its cheapest forms: ``adjacency()`` and ``nodes(data=True)`` hand out
    # the graph's own dicts, and ``predecessors`` is one iterator per released node (no view objects).
    counter = {n: len(nbrs) for n, nbrs in G.adjacency()}
    if model is None:
        if default == OR:
            counter = {n: min(c, 1) for n, c in counter.items()}
    else:
        for n, attrs in G.nodes(data=True):
            if counter[n] > 1 and attrs.get(model, default) == OR:
                counter[n] = 1

    released = [n for n, c in counter.items() if c == 0]
    pop, push, predecessors = released.pop, released.append, G.predecessors
    while released:
        for p in predecessors(pop()):
            c = counter[p] - 1
            counter[p] = c
            if c == 0:  # exactly once per node: an OR node goes negative after its first release
                push(p)
    return {n for n, c in counter.items() if c > 0}


def and_deadlock(G: nx.DiGraph) -> set[Hashable]:
    """Return the nodes of `G` that can reach a cycle (every waiter needs all its targets).

    Node attributes are ignored. O(V + E).

    >>> sorted(and_deadlock(nx.DiGraph([(0, 1), (1, 2), (2, 1), (1, 3)])))
    [0, 1, 2]
    """
    return deadlocked_nodes(G, model=None, default=AND)


def or_deadlock(G: nx.DiGraph) -> set[Hashable]:
    """Return the nodes of `G` that cannot reach a node without successors (every waiter needs one target).

    Node attributes are ignored. O(V + E).

    >>> sorted(or_deadlock(nx.DiGraph([(0, 1), (1, 2), (2, 1), (1, 3)])))
    []
    >>> sorted(or_deadlock(nx.DiGraph([(0, 1), (1, 2), (2, 1)])))
    [0, 1, 2]
    """
    return deadlocked_nodes(G, model=None, default=OR)


def deadlock_cycle(G: nx.DiGraph, deadlocked: Set[Hashable]) -> list[Hashable]:
    """Return one wait cycle among the `deadlocked` nodes, in edge order (closing back to the first).

    Every deadlocked node has a deadlocked successor (an AND node waits on at least one unreleased
    node, an OR node only on unreleased ones), so walking deadlocked successors from any deadlocked
    node must repeat a node; the repeated stretch is the cycle. The walk starts at the first
    deadlocked node in `G`'s node order, so the answer is deterministic. Returns ``[]`` when
    `deadlocked` is empty; a self-loop gives a one-node cycle.

    Complexity: O(length of the walk + the out-edges scanned along it), at most O(V + E).

    >>> G = nx.DiGraph([(0, 1), (1, 2), (2, 3), (3, 1)])
    >>> deadlock_cycle(G, deadlocked_nodes(G))
    [1, 2, 3]

    Raises ValueError if `deadlocked` is not closed under "has a deadlocked successor", i.e. was
    not computed by :func:`deadlocked_nodes` on `G`.
    """
    if not deadlocked:
        return []
    succ = G.succ
    node = next((n for n in G if n in deadlocked), None)
    position: dict[Hashable, int] = {}
    path: list[Hashable] = []
    while node not in position:
        if node is None:
            raise ValueError("deadlocked is not a set of deadlocked nodes of G")
        position[node] = len(path)
        path.append(node)
        node = next((s for s in succ[node] if s in deadlocked), None)
    return path[position[node] :]


def deadlock_knot(G: nx.DiGraph, deadlocked: Iterable[Hashable]) -> set[Hashable]:
    """Return the knot evidence: the nodes in sink strongly connected components among `deadlocked`.

    In the subgraph induced by the deadlocked nodes, a sink component is a set of blocked nodes
    none of which waits on anything outside it that could ever be released: in a pure OR graph,
    exactly the knots of Chandy–Misra–Haas. Only that subgraph is examined.

    Complexity: O(V' + E') for the V' deadlocked nodes and the E' edges among them.

    >>> G = nx.DiGraph([(0, 1), (1, 2), (2, 1)])
    >>> sorted(deadlock_knot(G, or_deadlock(G)))
    [1, 2]
    """
    return set().union(*nx.attracting_components(G.subgraph(deadlocked)))


def count_deadlocks(G: nx.DiGraph, deadlocked: Iterable[Hashable]) -> int:
    """Return how many separate deadlocks `deadlocked` holds: wait cycles that share no node.

    Counts the strongly connected components of the deadlocked subgraph that contain a cycle
    (more than one node, or a self-loop); chains leading into them are not counted again.

    Complexity: O(V' + E') for the V' deadlocked nodes and the E' edges among them.

    >>> G = nx.DiGraph([(0, 1), (1, 0), (2, 3), (3, 2), (4, 0)])
    >>> count_deadlocks(G, deadlocked_nodes(G))
    2
    """
    sub = G.subgraph(deadlocked)
    return sum(
        1
        for component in nx.strongly_connected_components(sub)
        if len(component) > 1 or any(sub.has_edge(n, n) for n in component)
    )
