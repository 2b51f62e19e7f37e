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

Each algorithm is written once, over a graph given by functions (a node's successors or
predecessors) and a mapping from node to number (a dict, or a list when nodes are 0 … n-1), and
serves two forms of the graph: a networkx ``DiGraph`` (the functions below taking `G`, what the
detector evaluates) and a :class:`CompactGraph`, the same graph as flat integer arrays for graphs
of millions of nodes (what :mod:`.columnar` builds from the archive's rows, without one Python
object per node or edge). The same algorithm on the same graph gives the same answer in both.

References
----------
R. C. Holt, "Some deadlock properties of computer systems", ACM Computing Surveys 4(3), 1972.
K. M. Chandy, J. Misra, L. M. Haas, "Distributed deadlock detection", ACM TOCS 1(2), 1983.
"""

import itertools
from collections.abc import Callable, Hashable, Iterable, MutableMapping, MutableSequence, Sequence, Set
from dataclasses import dataclass
from typing import TypeVar

import networkx as nx

AND = "and"
OR = "or"

N = TypeVar("N", bound=Hashable)

__all__ = [
    "AND",
    "OR",
    "CompactGraph",
    "and_deadlock",
    "compact_components",
    "compact_cycle",
    "compact_deadlocked",
    "count_deadlocks",
    "deadlock_components",
    "deadlock_cycle",
    "deadlock_knot",
    "deadlocked_nodes",
    "or_deadlock",
]


# -- the algorithms, once ------------------------------------------------------------------------------------


def _release(counter: MutableMapping[N, int] | MutableSequence[int], predecessors: Callable[[N], Iterable[N]]) -> None:
    """Graph reduction, in place: ``counter[n]`` is what still holds node n (its AND targets not yet
    released, or 1 for an OR waiter); a node whose counter reaches 0 is released and releases its
    predecessors in turn (Kahn-style). Whatever keeps a positive counter is deadlocked.

    Iterative, so chains of any length are fine. O(V + E).
    """
    items = counter.items() if isinstance(counter, dict) else enumerate(counter)  # type: ignore[union-attr]
    released = [n for n, c in items if c == 0]
    pop, push = released.pop, released.append
    while released:
        for p in predecessors(pop()):
            c = counter[p] - 1
            counter[p] = c
            if c == 0:  # exactly once per node: an OR node goes negative after its first release
                push(p)


def _walk(start: N | None, successors: Callable[[N], Iterable[N]], deadlocked: Callable[[N], bool]) -> list[N]:
    """From deadlocked node `start`, follow the first deadlocked successor until a node repeats;
    return the repeated stretch (a cycle). ValueError when a node has no deadlocked successor."""
    position: dict[N, int] = {}
    path: list[N] = []
    node = start
    while node not in position:
        if node is None:
            raise ValueError("deadlocked is not a set of deadlocked nodes of G")
        position[node] = len(path)
        path.append(node)
        node = next((s for s in successors(node) if deadlocked(s)), None)
    return path[position[node] :]


def _components(
    nodes: Iterable[N], successors: Callable[[N], Sequence[N]], rindex: MutableMapping[N, int] | MutableSequence[int]
) -> tuple[list[N], int]:
    """The strongly connected components of the graph on `nodes`, in one depth-first pass: return the
    nodes of its sink components (no edge to another component) and how many components hold a
    cycle (more than one node, or a self-loop).

    `successors(n)` gives n's successors, all among `nodes`; `rindex` maps every node to 0 and is
    used up. Pearce's single-array variant of Tarjan's algorithm, iterative: ``rindex[v]`` is the
    visit number while v is open (lowered to the smallest it reaches, as Tarjan's lowlink) and a
    component number above every visit number once v's component is complete. A component is a
    sink unless one of its nodes has an edge into a completed component; that flag travels up the
    depth-first tree, whose path between a node and its component's root stays in the component.

    O(V + E) time, O(V) extra space.

    D. J. Pearce, "A space-efficient algorithm for finding strongly connected components",
    Information Processing Letters 116(1), 2016.
    """
    count = len(rindex)
    index = 1
    component = 2 * count + 1  # counts down; always above every visit number (at most `count`)
    stack: list[N] = []  # visited nodes whose component is not complete yet
    sink: list[N] = []
    cyclic = 0
    for start in nodes:
        if rindex[start]:
            continue
        rindex[start] = index
        # The depth-first path: node, its successor iterator, its visit number, "has an edge out".
        path = [start]
        its = [iter(successors(start))]
        visits = [index]
        out = [False]
        index += 1
        while path:
            v = path[-1]
            for w in its[-1]:
                r = rindex[w]
                if not r:  # unvisited: go down
                    rindex[w] = index
                    path.append(w)
                    its.append(iter(successors(w)))
                    visits.append(index)
                    out.append(False)
                    index += 1
                    break
                if r > count:  # w's component is complete, so it is not v's
                    out[-1] = True
                elif r < rindex[v]:
                    rindex[v] = r
            else:
                path.pop()
                its.pop()
                visit = visits.pop()
                leaves = out.pop()
                if rindex[v] == visit:  # v is its component's root: the component is complete
                    rindex[v] = component
                    members = [v]
                    while stack and rindex[stack[-1]] >= visit:
                        w = stack.pop()
                        rindex[w] = component
                        members.append(w)
                    component -= 1
                    if len(members) > 1 or v in successors(v):
                        cyclic += 1
                    if not leaves:
                        sink += members
                    if path:
                        out[-1] = True
                else:  # v belongs to the component of a node above it on the path
                    stack.append(v)
                    if path:
                        if rindex[v] < rindex[path[-1]]:
                            rindex[path[-1]] = rindex[v]
                        if leaves:
                            out[-1] = True
    return sink, cyclic


# -- on networkx graphs --------------------------------------------------------------------------------------


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
    _release(counter, G.predecessors)
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
    start = next((n for n in G if n in deadlocked), None)
    return _walk(start, G.succ.__getitem__, deadlocked.__contains__)


def deadlock_components(G: nx.DiGraph, deadlocked: Iterable[Hashable]) -> tuple[set[Hashable], int]:
    """Return :func:`deadlock_knot` and :func:`count_deadlocks` of `deadlocked` together, in one pass.

    Complexity: O(V' + E') for the V' deadlocked nodes and the E' edges among them.

    >>> G = nx.DiGraph([(0, 1), (1, 0), (2, 3), (3, 2), (4, 0), (2, 0)])
    >>> deadlock_components(G, deadlocked_nodes(G))
    ({0, 1}, 2)
    """
    among = dict.fromkeys(deadlocked, 0)
    succ = G.succ
    successors = {n: [s for s in succ[n] if s in among] for n in among}
    sink, cyclic = _components(list(among), successors.__getitem__, among)
    return set(sink), cyclic


def deadlock_knot(G: nx.DiGraph, deadlocked: Iterable[Hashable]) -> set[Hashable]:
    """Return the knot evidence: the nodes in sink strongly connected components among `deadlocked`.

    In the subgraph induced by the deadlocked nodes, a sink component is a set of blocked nodes
    none of which waits on anything outside it that could ever be released: in a pure OR graph,
    exactly the knots of Chandy–Misra–Haas (``networkx.attracting_components`` of that subgraph).
    Only that subgraph is examined.

    Complexity: O(V' + E') for the V' deadlocked nodes and the E' edges among them.

    >>> G = nx.DiGraph([(0, 1), (1, 2), (2, 1)])
    >>> sorted(deadlock_knot(G, or_deadlock(G)))
    [1, 2]
    """
    return deadlock_components(G, deadlocked)[0]


def count_deadlocks(G: nx.DiGraph, deadlocked: Iterable[Hashable]) -> int:
    """Return how many separate deadlocks `deadlocked` holds: wait cycles that share no node.

    Counts the strongly connected components of the deadlocked subgraph that contain a cycle
    (more than one node, or a self-loop); chains leading into them are not counted again.

    Complexity: O(V' + E') for the V' deadlocked nodes and the E' edges among them.

    >>> G = nx.DiGraph([(0, 1), (1, 0), (2, 3), (3, 2), (4, 0)])
    >>> count_deadlocks(G, deadlocked_nodes(G))
    2
    """
    return deadlock_components(G, deadlocked)[1]


# -- on compact graphs ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CompactGraph:
    """A wait-for graph on nodes 0 … n-1 as flat integer arrays (compressed rows): a million-node
    graph in tens of megabytes, where networkx's dicts take gigabytes.

    Node u's successors are ``targets[starts[u]:starts[u + 1]]``, in the order they matter (the
    first deadlocked one continues the cycle walk); its predecessors ``sources[ends[u]:ends[u + 1]]``,
    in any order. ``is_or[u]`` is true for an OR waiter; a node without successors is free
    whatever its model. Any sequence of ints does: lists, or memoryviews of arrays (read from
    Python as fast as lists, without an object per value).
    """

    starts: Sequence[int]
    targets: Sequence[int]
    ends: Sequence[int]
    sources: Sequence[int]
    is_or: Sequence[bool]

    def __len__(self) -> int:
        return len(self.starts) - 1

    def successors(self, u: int) -> Sequence[int]:
        return self.targets[self.starts[u] : self.starts[u + 1]]

    def predecessors(self, v: int) -> Sequence[int]:
        return self.sources[self.ends[v] : self.ends[v + 1]]


def compact_deadlocked(G: CompactGraph) -> bytearray:
    """:func:`deadlocked_nodes` of `G`: a flag per node, 1 for a node reduction never releases. O(V + E).

    >>> G = CompactGraph([0, 1, 2, 2], [1, 0], [0, 1, 2, 2], [1, 0], [False, False, False])
    >>> list(compact_deadlocked(G))
    [1, 1, 0]
    """
    starts = G.starts
    counter = [b - a for a, b in itertools.pairwise(starts)]  # out-degrees
    for u, is_or in enumerate(G.is_or):
        if is_or and counter[u] > 1:
            counter[u] = 1
    ends, sources = G.ends, G.sources
    _release(counter, lambda v: sources[ends[v] : ends[v + 1]])
    return bytearray(c > 0 for c in counter)


def compact_cycle(G: CompactGraph, deadlocked: bytearray) -> list[int]:
    """:func:`deadlock_cycle` of `G`: from the first deadlocked node (the smallest number), follow
    the first deadlocked successor until a node repeats. ``[]`` when nothing is deadlocked."""
    start = deadlocked.find(1)
    if start < 0:
        return []
    starts, targets = G.starts, G.targets
    return _walk(start, lambda u: targets[starts[u] : starts[u + 1]], deadlocked.__getitem__)


def compact_components(among: CompactGraph, nodes: Iterable[int], done: Iterable[int] = ()) -> tuple[list[int], int]:
    """:func:`deadlock_components` on `among`, the subgraph of the deadlocked `nodes` (its edges
    only those between two of them; other nodes may stay, without edges): the nodes of its sink
    components, and the number of its components with a cycle. O(V' + E').

    The nodes in `done` form components the caller has found already: they are skipped, and an
    edge into one of them is an edge out of its own component, as into any completed component.
    """
    starts = among.starts
    targets = among.targets
    rindex = [0] * len(among)
    finished = 2 * len(rindex) + 2  # above every number _components gives
    for node in done:
        rindex[node] = finished
    return _components(nodes, lambda u: targets[starts[u] : starts[u + 1]], rindex)
