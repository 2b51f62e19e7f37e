"""Which wait to break to end a proven deadlock: one victim per deadlocked sink component.

DESIGN.md, "Breaking a proven deadlock". The deadlocked nodes of a wait-for graph, with the
counted edges among them, form a graph in which every node has a successor (a deadlocked AND
waiter waits on at least one deadlocked node, a deadlocked OR waiter only on deadlocked ones). Its
**sink components** (strongly connected, no edge out: ``networkx.attracting_components``) are the
deadlocks proper; everything else deadlocked is a chain that only waits on them, and is released
once they are. So each sink component has a cycle, and breaking one of its waits is what can help.

A sink component's members are blocked and wait only on each other: while it is deadlocked none
of them can start or change a wait, and the only waits that can end are those whose wake-up was
already on its way (met by the rules of :mod:`.waitfor`, though another wait on the same target
keeps the edge). So every consistent cut that shows the deadlock shows its members with the same
unmet waits, whatever else in the system has moved on between the cuts. It may show more members:
an AND waiter of the component may also wait on a node outside it, which can later block on the
component and join it (with a wait younger than all of the component's). The resolver holds a
grown component as the one it grew from (:mod:`stablewatch.detector.service.resolver`); two
detectors whose cuts fall on either side of the join may choose differently. The choice below
reads nothing but the component's waits:

* the **candidates** are the waits (``Wait.instance`` set: 0 is an older agent's wait, which
  cannot be named) whose node (:func:`~.waitfor.wait_nodes`) is in the component and which wait
  on one of its nodes over a counted edge, unmet. A wait merged into a node of the component but
  whose targets are all elsewhere, or that the in-flight and acknowledgement rules meet (its
  wake-up is on its way; the edge counts for another wait of the node on the same target), does
  not hold the component up: breaking it would leave the deadlock whole, and it is gone from any
  later cut, which must pick the same wait;
* a **policy** orders them: ``youngest`` (the default) breaks the wait that began last, which has
  lost the least time, as wait-die schemes do; ``oldest`` the one that began first. A wait whose
  start is unknown (``began_at_us`` 0) comes after those with one. Ties go to the smallest
  ``(process, instance)``;
* waits already broken (`exclude`) are skipped, so a deadlock that outlives its victim moves on
  to the next candidate.

Hence the same wait on every cut that shows the deadlock with the same members, and by every
detector that sees it so. Pure functions: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Callable, Container
from dataclasses import dataclass

import networkx as nx

from stablewatch.detector.evaluation.deadlock import deadlock_cycle
from stablewatch.detector.evaluation.text import SHOWN
from stablewatch.detector.evaluation.waitfor import Node, label, meeting, wait_nodes
from stablewatch.v1 import GlobalSnapshot, Wait, WaitForGraph

__all__ = ["DEFAULT_POLICY", "POLICIES", "Victim", "choose_victims", "cycle_text", "sink_components"]

#: The victim policies, by name: which candidate wait of a deadlock is broken first.
POLICIES = ("youngest", "oldest")
DEFAULT_POLICY = "youngest"


@dataclass(frozen=True, slots=True)
class Victim:
    """The wait chosen to end one deadlock, with the deadlock it ends.

    `process`, `task` and `instance` name the wait as its agent knows it (``BreakWait``);
    `node` is its node in the wait-for graph. `component` is the deadlock's sink component (sorted
    nodes) and `deadlock_text` one of its cycles as text (``"A/t1 -> B/t2 -> A/t1"``).
    """

    process: str
    task: str
    instance: int
    began_at_us: int
    node: Node
    component: tuple[Node, ...]
    deadlock_text: str

    @property
    def key(self) -> tuple[Node, ...]:
        """The deadlock, recognisable across snapshots and detectors: its sink component's nodes."""
        return self.component


def sink_components(graph: WaitForGraph) -> list[nx.DiGraph]:
    """Return the deadlocked sink components of `graph`, each as a ``DiGraph`` of its counted edges.

    Only the nodes in ``graph.deadlock.deadlocked`` and the counted (not discounted) edges among
    them are read. Components come sorted by their smallest node; each graph holds its nodes and
    edges in sorted order, so equal components give equal graphs whatever order `graph` lists
    them in. O(V' + E' log E') for the V' deadlocked nodes and E' counted edges among them.

    >>> from stablewatch.v1 import WaitEdge
    >>> g = WaitForGraph(deadlock={"deadlocked": [{"process": p} for p in "ABC"]})
    >>> g.edges.extend(WaitEdge(waiter={"process": u}, target={"process": v}) for u, v in ["AB", "BC", "CB"])
    >>> [sorted(c) for c in sink_components(g)]
    [[('B', ''), ('C', '')]]
    """
    dead = {(n.process, n.task) for n in graph.deadlock.deadlocked}
    if not dead:
        return []
    # (waiter, target) -> whether it is a flow-control edge, for the counted edges among `dead`.
    edges: dict[tuple[Node, Node], bool] = {}
    for e in graph.edges:
        waiter, target = (e.waiter.process, e.waiter.task), (e.target.process, e.target.task)
        if not e.discounted and waiter in dead and target in dead:
            edges[(waiter, target)] = e.flow_control
    among = nx.DiGraph()
    among.add_nodes_from(sorted(dead))
    among.add_edges_from((u, v, {"flow_control": fc}) for (u, v), fc in sorted(edges.items()))
    components = []
    for members in nx.attracting_components(among):
        component = nx.DiGraph()
        component.add_nodes_from(sorted(members))
        component.add_edges_from((u, v, d) for u, v, d in among.edges(sorted(members), data=True) if v in members)
        # Every deadlocked node has a deadlocked successor, so a sink component has a cycle; an
        # edgeless one would mean evidence inconsistent with its edges, and offers nothing to break.
        if component.number_of_edges():
            components.append(component)
    return sorted(components, key=min)


def cycle_text(component: nx.DiGraph) -> str:
    """One cycle of a sink `component` as text, from its smallest node and closing back to it.

    ``"A/t1 -> B/t2 -> A/t1"``; the walk takes the smallest successor at each step, so the text
    depends only on the component. A long cycle is cut short like the deadlock result's summary.
    O(V + E) for the component.
    """
    smallest = nx.DiGraph()
    smallest.add_nodes_from(sorted(component))
    smallest.add_edges_from((u, min(component.successors(u))) for u in sorted(component))
    cycle = deadlock_cycle(smallest, set(smallest))
    first = cycle.index(min(cycle))
    cycle = cycle[first:] + cycle[:first]
    steps = [label(n) for n in cycle]
    if len(steps) > SHOWN:
        steps = [*steps[: SHOWN - 1], f"... ({len(steps) - SHOWN + 1} more)"]
    return " -> ".join([*steps, label(cycle[0])])


def choose_victims(
    snapshot: GlobalSnapshot,
    graph: WaitForGraph,
    policy: str = DEFAULT_POLICY,
    exclude: Container[tuple[str, int]] = (),
) -> list[Victim]:
    """Return one wait to break per deadlock of `snapshot`, in the order of the deadlocks' nodes.

    `graph` is `snapshot`'s wait-for graph with its deadlock evidence (``evaluate(snapshot).wait_for``).
    Per sink component of the deadlocked nodes (:func:`sink_components`), the first candidate
    wait in `policy`'s order (see the module doc) that is not in `exclude` (``(process,
    instance)`` pairs already broken); a deadlock without one gets no victim. Empty when `graph`
    shows no deadlock. Whether the deadlock is *proven* (the result true, not unknown) is the
    caller's question.

    Complexity: O(processes + waits + targets) plus :func:`sink_components`, plus sorting each
    component's candidates.

    Raises ValueError for a policy not in :data:`POLICIES`.
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown victim policy {policy!r}: choose one of {', '.join(POLICIES)}")
    components = sink_components(graph)
    if not components:
        return []
    where = {node: i for i, component in enumerate(components) for node in component}
    pids = {process for process, _ in where}
    met = meeting(snapshot)
    candidates: list[list[tuple[Wait, Node]]] = [[] for _ in components]
    for process in snapshot.processes:
        if process.process_id not in pids:
            continue
        for wait, node in wait_nodes(process):
            i = where.get(node)
            if i is not None and wait.instance and _inside(wait, node, components[i], met):
                candidates[i].append((wait, node))
    order = _ORDER[policy]
    victims = []
    for component, waits in zip(components, candidates, strict=True):
        chosen = min(
            (c for c in waits if (c[1][0], c[0].instance) not in exclude),
            key=lambda c: order(c[0], c[1][0]),
            default=None,
        )
        if chosen is None:
            continue
        wait, node = chosen
        victims.append(
            Victim(
                process=node[0],
                task=wait.task,
                instance=wait.instance,
                began_at_us=wait.began_at_us,
                node=node,
                component=tuple(component),
                deadlock_text=cycle_text(component),
            )
        )
    return victims


# Each policy as a sort key over (wait, process), smallest first: a start that is known first
# (``began_at_us`` 0 is unknown), then the policy's order of starts, then the id.
_ORDER: dict[str, Callable[[Wait, str], tuple[bool, int, str, int]]] = {
    "youngest": lambda w, p: (w.began_at_us == 0, -w.began_at_us, p, w.instance),
    "oldest": lambda w, p: (w.began_at_us == 0, w.began_at_us, p, w.instance),
}


def _inside(wait: Wait, node: Node, component: nx.DiGraph, met: Callable[[str, str, str, bool], bool]) -> bool:
    """Whether `wait` (of `node`) waits on a node of `component` over a counted edge it holds up.

    An edge counts while any wait of `node` on its target is unmet, so the edge alone does not say
    that this one is: a wait that `met` (:func:`~.waitfor.meeting`) meets holds nothing up, be it
    a flow-control wait with an acknowledgement in transit beside an ordinary wait on the same
    target, or an ordinary wait whose waking message is in flight beside a blocked send.
    """
    out = component.succ[node]
    for t in wait.targets:
        if (t.process, t.task) in out and not met(node[0], wait.task, t.process, wait.flow_control):
            return True
    return False
