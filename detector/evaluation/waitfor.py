"""The wait-for graph of one consistent global snapshot, and its deadlock evidence.

How a :class:`~stablewatch.v1.GlobalSnapshot` becomes a graph:

* Nodes are ``(process, task)`` tuples; task ``""`` is the process itself.
* Each ``Wait`` in process P's local state makes ``(P, wait.task)`` an AND or OR waiter
  (``WAIT_MODEL_UNSPECIFIED`` counts as AND) with an edge to every target, whether or not P
  reports itself active: the wait is what the application declared. Several waits for the
  same waiter merge their targets; if their models differ the waiter is AND.
* A process node ``(P, "")`` without a wait of its own but with waiting tasks is, when P is
  passive, an OR waiter over those tasks (P progresses only if one of its tasks can); when P is
  active it is free.
* Every other node (a task that waits on nothing, an unknown process) is free.
* In-flight rule: a recorded message on channel ``q -> p`` that may wake p (``no_wake`` false)
  *discounts* every edge from a waiter in p to a target in q: in this snapshot that wait is not
  blocking. Heartbeats (``no_wake`` true) discount nothing. Discounted edges are kept apart, for
  reporting only.

Deadlock is then graph reduction with each waiter's own model (:mod:`stablewatch.detector.evaluation.deadlock`).
"""

from collections.abc import Iterable
from dataclasses import dataclass

import networkx as nx

from stablewatch.detector.evaluation.deadlock import AND, OR, deadlock_cycle, deadlock_knot, deadlocked_nodes
from stablewatch.v1 import (
    WAIT_MODEL_AND,
    WAIT_MODEL_OR,
    ChannelRef,
    DeadlockEvidence,
    GlobalSnapshot,
    WaitEdge,
    WaitForGraph,
    WaitNode,
)

Node = tuple[str, str]
Channel = tuple[str, str]  # (src, dst)

__all__ = [
    "Channel",
    "Deadlock",
    "Node",
    "WaitFor",
    "build_wait_for",
    "evidence_proto",
    "find_deadlock",
    "label",
    "to_dot",
    "to_proto",
    "waking_channels",
]


@dataclass(frozen=True, slots=True)
class WaitFor:
    """The wait-for graph of one snapshot.

    `graph` holds the counted edges; every waiter has node attribute ``model`` (``"and"`` or
    ``"or"``), free nodes have none. `discounted` holds the ``(waiter, target)`` edges set aside by
    the in-flight rule; their nodes are in `graph` too.
    """

    snapshot_id: int
    graph: nx.DiGraph
    discounted: tuple[tuple[Node, Node], ...]


@dataclass(frozen=True, slots=True)
class Deadlock:
    """Deadlock evidence: all deadlocked nodes (sorted), one cycle, the knot, the empty channels.

    `knot` is only computed when an OR waiter is deadlocked, otherwise it is empty.
    `empty_channels` has one ``(src, dst)`` per cycle edge between two processes (target's
    process -> waiter's process), without repeats: the channels that held no waking message.
    """

    deadlocked: list[Node]
    cycle: list[Node]
    knot: list[Node]
    empty_channels: list[Channel]


def waking_channels(snapshot: GlobalSnapshot) -> set[Channel]:
    """Return the ``(src, dst)`` channels holding at least one recorded message that may wake dst."""
    return {(c.src, c.dst) for c in snapshot.channels if any(not m.no_wake for m in c.messages)}


def build_wait_for(snapshot: GlobalSnapshot) -> WaitFor:
    """Build the wait-for graph of `snapshot`, applying the in-flight rule (see the module doc).

    O(processes + waits + targets + recorded messages).
    """
    waits: dict[Node, tuple[str, list[Node]]] = {}
    for process in snapshot.processes:
        pid = process.process_id
        tasks: dict[Node, None] = {}
        for wait in process.state.waits:
            waiter = (pid, wait.task)
            model = OR if wait.model == WAIT_MODEL_OR else AND
            targets = [(t.process, t.task) for t in wait.targets]
            if waiter in waits:
                old_model, old_targets = waits[waiter]
                waits[waiter] = (model if model == old_model else AND, old_targets + targets)
            else:
                waits[waiter] = (model, targets)
            if wait.task:
                tasks[waiter] = None
        if tasks and (pid, "") not in waits and not process.state.active:
            waits[(pid, "")] = (OR, list(tasks))

    waking = waking_channels(snapshot)
    graph = nx.DiGraph()
    graph.add_nodes_from((waiter, {"model": model}) for waiter, (model, _) in waits.items())
    discounted: dict[tuple[Node, Node], None] = {}
    for waiter, (_, targets) in waits.items():
        for target in targets:
            if (target[0], waiter[0]) in waking:
                discounted[(waiter, target)] = None
                graph.add_node(target)
            else:
                graph.add_edge(waiter, target)
    return WaitFor(snapshot.snapshot_id, graph, tuple(discounted))


def find_deadlock(wf: WaitFor) -> Deadlock:
    """Reduce `wf`'s graph with each waiter's model and collect the evidence.

    The cycle is rotated to start at its smallest node, so equal snapshots give equal evidence.
    O(V + E), plus O(V log V) to sort, plus the knot's O(V' + E') on the deadlocked subgraph.
    """
    G = wf.graph
    dead = deadlocked_nodes(G)
    if not dead:
        return Deadlock([], [], [], [])
    cycle = deadlock_cycle(G, dead)
    first = cycle.index(min(cycle))
    cycle = cycle[first:] + cycle[:first]
    knot: list[Node] = []
    if any(G._node[n].get("model") == OR for n in dead):
        knot = sorted(deadlock_knot(G, dead))
    channels: dict[Channel, None] = {}
    for waiter, target in zip(cycle, cycle[1:] + cycle[:1], strict=True):
        if waiter[0] != target[0]:
            channels[(target[0], waiter[0])] = None
    return Deadlock(sorted(dead), cycle, knot, list(channels))


def label(node: Node) -> str:
    """Return ``"P"`` for a process node and ``"P/task"`` for a task node."""
    return f"{node[0]}/{node[1]}" if node[1] else node[0]


def _wait_nodes(nodes: Iterable[Node]) -> list[WaitNode]:
    return [WaitNode(process=p, task=t) for p, t in nodes]


def evidence_proto(deadlock: Deadlock) -> DeadlockEvidence:
    """Convert `deadlock` to its protobuf message."""
    return DeadlockEvidence(
        deadlocked=_wait_nodes(deadlock.deadlocked),
        cycle=_wait_nodes(deadlock.cycle),
        knot=_wait_nodes(deadlock.knot),
        empty_channels=[ChannelRef(src=s, dst=d) for s, d in deadlock.empty_channels],
    )


def to_proto(wf: WaitFor, deadlock: Deadlock | None = None) -> WaitForGraph:
    """Return the ``WaitForGraph`` message for the query API: nodes, counted and discounted edges, evidence.

    Each edge carries its waiter's model. `deadlock` defaults to ``find_deadlock(wf)``.
    """
    deadlock = find_deadlock(wf) if deadlock is None else deadlock
    nodes = wf.graph._node
    model = {AND: WAIT_MODEL_AND, OR: WAIT_MODEL_OR}

    def edge(waiter: Node, target: Node, discounted: bool) -> WaitEdge:
        return WaitEdge(
            waiter=WaitNode(process=waiter[0], task=waiter[1]),
            target=WaitNode(process=target[0], task=target[1]),
            model=model[nodes[waiter]["model"]],
            discounted=discounted,
        )

    edges = [edge(u, v, False) for u, v in wf.graph.edges]
    edges += [edge(u, v, True) for u, v in wf.discounted]
    return WaitForGraph(
        snapshot_id=wf.snapshot_id,
        nodes=_wait_nodes(wf.graph),
        edges=edges,
        deadlock=evidence_proto(deadlock),
    )


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def to_dot(wf: WaitFor, deadlock: Deadlock | None = None) -> str:
    """Return Graphviz DOT text for `wf`: deadlocked nodes and the cycle in red, OR waiters as
    diamonds, discounted edges dashed grey. `deadlock` defaults to ``find_deadlock(wf)``.

    Written by hand: networkx's DOT writers need pydot or pygraphviz.
    """
    deadlock = find_deadlock(wf) if deadlock is None else deadlock
    dead = set(deadlock.deadlocked)
    cycle = deadlock.cycle
    cycle_edges = set(zip(cycle, cycle[1:] + cycle[:1], strict=True))
    lines = [f"digraph {_quote(f'waitfor {wf.snapshot_id}')} {{", "  node [shape=box];"]
    for node, attrs in wf.graph.nodes(data=True):
        style = ["shape=diamond"] if attrs.get("model") == OR else []
        if node in dead:
            style.append("color=red, fontcolor=red")
        lines.append(f"  {_quote(label(node))}" + (f" [{', '.join(style)}]" if style else "") + ";")
    for u, v in wf.graph.edges:
        style = " [color=red, penwidth=2]" if (u, v) in cycle_edges else ""
        lines.append(f"  {_quote(label(u))} -> {_quote(label(v))}{style};")
    for u, v in wf.discounted:
        lines.append(f'  {_quote(label(u))} -> {_quote(label(v))} [style=dashed, color=grey, label="in flight"];')
    lines.append("}")
    return "\n".join(lines) + "\n"
