"""The wait-for graph of one consistent global snapshot, and its deadlock evidence.

How a :class:`~stablewatch.v1.GlobalSnapshot` becomes a graph:

* Nodes are ``(process, task)`` tuples; task ``""`` is the process itself.
* Each ``Wait`` in process P's local state makes ``(P, wait.task)`` an AND or OR waiter
  (``WAIT_MODEL_UNSPECIFIED`` counts as AND) with an edge to every target, whether or not P
  reports itself active: the wait is what the application declared.
* A waiter with several waits needs every one of them. AND waits merge exactly into one AND
  waiter over all their targets. Otherwise each wait becomes a node of its own,
  ``(P, "task[wait k]")`` with the wait's model and targets, and the waiter is an AND waiter
  over those nodes: ``(B) and (C or D)`` stays exactly that. Agents report one ``Wait`` per wait
  instance, so several AND waits of one task are the usual case. :func:`wait_nodes` is the one
  place that maps a wait to its node (the victim choice maps deadlocked nodes back through it).
  A task of that form is the wait's node, never a task of its own: the detector refuses a part
  that names one (``stablewatch.v1.bounds.names_a_wait``), as one wait would be taken for another.
* A process node ``(P, "")`` without a wait of its own but with waiting tasks stands for
  anything P may do: a wait on it is met as soon as P is active. A passive process becomes
  active on receiving a message, from any process, so P stays passive for good only if no
  message will ever reach it. **Quiet rule.** Only on a *quiet* cut, closed (:mod:`.cut`: no
  process outside it, which may be running), with no member active, no message that may wake
  (``no_wake`` false) recorded on any channel and no acknowledgement in transit (which releases
  a blocked send, whose task may then send anything), can nothing reach P: there the node is an
  OR waiter over P's tasks (P progresses only if one of its tasks can). On any other cut it is
  free: an active process, or one that a message in flight will make active, may send P a
  message at any time, so a deadlock through P's node would not be stable (true on one cut,
  false on a later one). On an open cut whose members are all passive with nothing in flight,
  closing it may make it quiet: the edges into such nodes are counted (``WaitCounts.undecided``),
  and "no deadlock" is unknown there. A wait that P declares itself (task ``""``) is what P said
  it needs, and, like a task's own waits, only the in-flight rule below meets it (a message from
  a target's process, naming the task or none): a task woken for something else still waits on
  its targets.
* Every other node is free: a task that waits on nothing, and any process outside the cut (it
  may well be running; see :mod:`.cut`), so a wait on it never counts as blocked.
* **In-flight rule.** A recorded message on channel ``q -> p`` that may wake p (``no_wake``
  false; when ``wakes_task`` is set, only that task of p) *satisfies* the edges from a waiter in
  p to targets in q: p will receive it and wake. An AND waiter loses those edges (it still needs
  its other targets); an OR waiter needs any one target, so one satisfied edge releases it and
  all its edges are set aside. Heartbeats (``no_wake``) satisfy nothing, and neither does any
  message for a ``flow_control`` wait (a send blocked on a full window: only the target consuming
  releases it). Edges set aside are kept apart, as *discounted*, for reporting.
* **Acknowledgement rule.** A ``flow_control`` edge from a waiter in p to a target in q is
  satisfied when an acknowledgement is in transit on ``p -> q``: the channel's
  ``receiver_acked`` (where q's acknowledgements stood at q's recording) is ahead of its
  ``sender_ack_seen`` (the highest one p had received at p's recording), both of the same sender
  and receiver incarnations. q consumed and acknowledged before it recorded, and p will get window
  space: without the rule, a receiver that consumed, acknowledged, and then waited on p would
  close a cycle that is no deadlock. It is set aside like an edge the in-flight rule satisfies.
  When a position is missing or the incarnations differ, nothing is known and the edge counts.
  It is satisfied too when q's message handler will take what is queued, and q acknowledges
  (:func:`consuming`). A process records only between its handler's runs or while the handler
  is blocked on a send, and its agent records whether the handler was inside a run that waits
  (``handler_waits``: on that send, or on a wait it declared). An older agent does not: there
  q's handler counts as waiting when q records a wait of task ``""`` (what the handler waits on
  is one), though such a wait may be a background task's and the handler free.

Deadlock is then graph reduction with each waiter's own model (:mod:`.deadlock`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

import networkx as nx

from stablewatch.detector.evaluation.cut import coverage
from stablewatch.detector.evaluation.deadlock import (
    AND,
    OR,
    deadlock_components,
    deadlock_cycle,
    deadlocked_nodes,
)
from stablewatch.v1 import (
    WAIT_MODEL_AND,
    WAIT_MODEL_OR,
    ChannelRef,
    DeadlockEvidence,
    GlobalSnapshot,
    LocalState,
    ProcessSnapshot,
    Wait,
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
    "WaitCounts",
    "WaitFor",
    "acks_in_transit",
    "build_wait_for",
    "consuming",
    "cycle_edges",
    "empty_channels",
    "evidence_proto",
    "find_deadlock",
    "label",
    "meeting",
    "rotated",
    "sends_going_on",
    "to_proto",
    "wait_counts",
    "wait_nodes",
    "waking_channels",
]


@dataclass(frozen=True, slots=True)
class WaitFor:
    """The wait-for graph of one snapshot.

    `graph` holds the counted edges; every waiter has node attribute ``model`` (``"and"`` or
    ``"or"``), free nodes have none; an edge from a flow-control wait has attribute
    ``flow_control=True``. `discounted` holds the ``(waiter, target)`` edges set aside by the
    in-flight and acknowledgement rules; their nodes are in `graph` too.
    """

    snapshot_id: int
    graph: nx.DiGraph
    discounted: tuple[tuple[Node, Node], ...]
    # The processes in the snapshot; a node of any other process is outside the cut. Empty (every
    # target outside) is the safe default: an open cut then never says "no deadlock".
    members: frozenset[str] = frozenset()
    # The members whose process node the quiet rule leaves free on this cut (waiting tasks, no
    # wait of their own, the cut not quiet): see WaitCounts.undecided.
    undecided: frozenset[str] = frozenset()


class WaitCounts(NamedTuple):
    """The size of a wait-for graph, as a result without a deadlock reports it."""

    waiters: int  # nodes with a model
    edges: int  # counted edges
    discounted: int  # (waiter, target) pairs set aside by the in-flight and acknowledgement rules
    outside: int  # counted edges whose target is a process outside the cut
    # Counted edges into the node of a member process with waiting tasks and no wait of its own,
    # free because the cut is not quiet (the quiet rule): on an open cut whose members are all
    # quiet, the processes missing from it decide whether it is free.
    undecided: int = 0


@dataclass(frozen=True, slots=True)
class Deadlock:
    """Deadlock evidence: all deadlocked nodes (sorted), one cycle, the knot, the empty channels.

    `knot` is only computed when an OR waiter is deadlocked, otherwise it is empty.
    `empty_channels` has one ``(src, dst)`` per cycle edge between two processes (target's
    process -> waiter's process), without repeats: the channels that held no message waking the
    waiter on the cycle (one may hold a message that wakes another task of its receiver).
    Flow-control edges are left out: their wait is on the opposite channel being full.
    `separate` counts the wait cycles that share no node.
    """

    deadlocked: list[Node]
    cycle: list[Node]
    knot: list[Node]
    empty_channels: list[Channel]
    separate: int = 0


def _waking(snapshot: GlobalSnapshot) -> dict[Channel, frozenset[str] | None]:
    """Channels holding a message that may wake their receiver: None if it may wake any of the
    receiver's waits, else the set of the receiver's tasks that their messages can wake."""
    waking: dict[Channel, frozenset[str] | None] = {}
    for c in snapshot.channels:
        tasks: set[str] = set()
        for m in c.messages:
            if m.no_wake:
                continue
            if not m.wakes_task:
                waking[(c.src, c.dst)] = None
                break
            tasks.add(m.wakes_task)
        else:
            if tasks:
                waking[(c.src, c.dst)] = frozenset(tasks)
    return waking


def waking_channels(snapshot: GlobalSnapshot) -> set[Channel]:
    """Return the ``(src, dst)`` channels holding at least one recorded message that may wake dst."""
    return set(_waking(snapshot))


def acks_in_transit(snapshot: GlobalSnapshot) -> set[Channel]:
    """Return the ``(src, dst)`` channels with an acknowledgement on its way back to src.

    That is, the receiver had acknowledged further at its recording than the sender had seen at
    its own, both positions of the same sender and receiver incarnations. O(channels).
    """
    channels: set[Channel] = set()
    for c in snapshot.channels:
        if not (c.HasField("receiver_acked") and c.HasField("sender_ack_seen")):
            continue
        acked, seen = c.receiver_acked, c.sender_ack_seen
        same = (acked.sender_incarnation, acked.receiver_incarnation) == (
            seen.sender_incarnation,
            seen.receiver_incarnation,
        )
        if same and acked.next_seq > seen.next_seq:
            channels.add((c.src, c.dst))
    return channels


def consuming(snapshot: GlobalSnapshot) -> set[str]:
    """Return the members whose message handler will take what is queued, so that their queue
    gets room without anything more from another process (the acknowledgement rule in the module
    doc): those whose agent recorded ``handler_waits`` false (the handler between runs, or in a
    send about to go on with nothing it declared open). Where that is not recorded (an older
    agent), those that record no wait of their own (task ``""``, with a target), the handler's
    being of that task. O(processes + waits)."""
    return {p.process_id for p in snapshot.processes if not _handler_waits(p.state)}


def _handler_waits(state: LocalState) -> bool:
    """Whether a process's message handler may be in a run that waits (see :func:`consuming`)."""
    if state.HasField("handler_waits"):
        return state.handler_waits
    return any(not w.task and len(w.targets) for w in state.waits)


def sends_going_on(
    snapshot: GlobalSnapshot, acking: set[Channel] | None = None, consumers: set[str] | None = None
) -> list[Channel]:
    """Return the channels ``p -> q`` on which a send of p blocked on the full window is about to
    go on, sorted: the acknowledgement rule meets its flow-control wait (an acknowledgement in
    transit on ``p -> q``, or q's handler will take what is queued and acknowledge). Its task then
    resumes and may send anything, so p has not terminated and the cut is not quiet, though p
    recorded itself passive. `acking` and `consumers`: :func:`acks_in_transit` and
    :func:`consuming`, when already at hand. O(processes + waits + channels)."""
    acking = acks_in_transit(snapshot) if acking is None else acking
    consumers = consuming(snapshot) if consumers is None else consumers
    going = {
        (p.process_id, t.process)
        for p in snapshot.processes
        for w in p.state.waits
        if w.flow_control
        for t in w.targets
        if (p.process_id, t.process) in acking or t.process in consumers
    }
    return sorted(going)


def meeting(snapshot: GlobalSnapshot) -> Callable[[str, str, str, bool], bool]:
    """Return ``met(process, task, target, flow_control)``: whether the in-flight or the
    acknowledgement rule (see the module doc) meets a wait of `process`'s task `task` on a target
    in process `target` (a ``flow_control`` wait, or not), in `snapshot`.

    :func:`build_wait_for` sets aside the edges these rules meet (it applies them inline, once per
    edge); the victim choice (:mod:`.victims`) never breaks a wait they meet. O(channels +
    recorded messages) to build, O(1) per question.
    """
    waking = _waking(snapshot)
    acking = acks_in_transit(snapshot)
    consumers = consuming(snapshot)

    def met(process: str, task: str, target: str, flow_control: bool) -> bool:
        if flow_control:  # window space comes from an acknowledgement, never from a message
            return (process, target) in acking or target in consumers
        channel = (target, process)
        if channel not in waking:
            return False
        tasks = waking[channel]
        return tasks is None or task in tasks

    return met


def wait_nodes(process: ProcessSnapshot) -> list[tuple[Wait, Node]]:
    """Return each of `process`'s waits, in order, with the wait-for node it belongs to.

    The one place that says which node a ``Wait`` makes (see the module doc): a task's waits all
    belong to ``(P, task)`` when the task has one wait or all of them are AND (they merge);
    otherwise the task's k-th wait (from 1, in the order given) is node ``(P, "task[wait k]")``.
    :func:`build_wait_for` builds the graph from it, and the victim choice
    (:mod:`.victims`) maps a deadlocked node back to the waits that can break it. O(waits).

    >>> p = ProcessSnapshot(process_id="P", state={"waits": [{"task": "t"}, {"task": "t"}]})
    >>> [node for _, node in wait_nodes(p)]
    [('P', 't'), ('P', 't')]
    >>> p.state.waits[1].model = WAIT_MODEL_OR
    >>> [node for _, node in wait_nodes(p)]
    [('P', 't[wait 1]'), ('P', 't[wait 2]')]
    """
    pid = process.process_id
    tasks: dict[str, list[Wait]] = {}
    for wait in process.state.waits:
        tasks.setdefault(wait.task, []).append(wait)
    split = {task for task, group in tasks.items() if len(group) > 1 and any(_model(wait) != AND for wait in group)}
    seen: dict[str, int] = {}
    nodes: list[tuple[Wait, Node]] = []
    for wait in process.state.waits:
        if wait.task in split:
            seen[wait.task] = k = seen.get(wait.task, 0) + 1
            nodes.append((wait, (pid, f"{wait.task}[wait {k}]")))
        else:
            nodes.append((wait, (pid, wait.task)))
    return nodes


def _model(wait: Wait) -> str:
    """A wait's model as the reduction knows it (``WAIT_MODEL_UNSPECIFIED`` counts as AND)."""
    return OR if wait.model == WAIT_MODEL_OR else AND


def _targets(wait: Wait) -> list[tuple[Node, bool]]:
    return [((t.process, t.task), wait.flow_control) for t in wait.targets]


def build_wait_for(snapshot: GlobalSnapshot) -> WaitFor:
    """Build the wait-for graph of `snapshot`, applying the quiet, in-flight and
    acknowledgement rules (see the module doc).

    O(processes + waits + targets + recorded messages + channels).
    """
    # waiter -> (model, [(target, flow_control), ...]); `owner` maps a wait's own node to its waiter.
    waits: dict[Node, tuple[str, list[tuple[Node, bool]]]] = {}
    owner: dict[Node, Node] = {}
    waking = _waking(snapshot)
    acking = acks_in_transit(snapshot)
    consumers = consuming(snapshot)
    # The quiet rule: a process node stands for its tasks only where nothing can reach it again (an
    # acknowledgement in transit, or a receiver that will consume, releases a blocked send, whose
    # task may then send anything).
    quiet = (
        not waking
        and not acking
        and not any(p.state.active for p in snapshot.processes)
        and not sends_going_on(snapshot, acking, consumers)
        and coverage(snapshot).closed
    )
    undecided: list[str] = []
    for process in snapshot.processes:
        pid = process.process_id
        declared: dict[Node, list[tuple[Wait, Node]]] = {}
        for wait, node in wait_nodes(process):
            declared.setdefault((pid, wait.task), []).append((wait, node))
        for waiter, group in declared.items():
            if group[0][1] == waiter:  # merged: one wait, or all AND
                model = _model(group[0][0]) if len(group) == 1 else AND
                waits[waiter] = (model, [t for wait, _ in group for t in _targets(wait)])
                continue
            waits[waiter] = (AND, [])
            for wait, node in group:
                waits[node] = (_model(wait), _targets(wait))
                owner[node] = waiter
                waits[waiter][1].append((node, False))
        tasks = [waiter for waiter in declared if waiter[1]]
        if tasks and (pid, "") not in waits:
            if quiet:
                waits[(pid, "")] = (OR, [(task, False) for task in tasks])
            else:
                undecided.append(pid)

    def satisfied(waiter: Node, target: Node, flow_control: bool) -> bool:
        # meeting()'s rules, inline: this runs once per edge of graphs of millions.
        if flow_control:  # window space comes from an acknowledgement, never from a message
            return (waiter[0], target[0]) in acking or target[0] in consumers
        if (target[0], waiter[0]) not in waking:
            return False
        tasks = waking[(target[0], waiter[0])]
        return tasks is None or owner.get(waiter, waiter)[1] in tasks

    graph = nx.DiGraph()
    graph.add_nodes_from((waiter, {"model": model}) for waiter, (model, _) in waits.items())
    discounted: dict[tuple[Node, Node], None] = {}
    for waiter, (model, targets) in waits.items():
        met = [satisfied(waiter, target, fc) for target, fc in targets]
        if model == OR and any(met):  # one target is enough, and one is on its way
            for target, _ in targets:
                discounted[(waiter, target)] = None
                graph.add_node(target)
            continue
        # An AND edge is counted while any wait on that target is unmet (a target may be named
        # by a flow-control wait and an ordinary one).
        unmet: dict[Node, bool] = {}
        for (target, fc), ok in zip(targets, met, strict=True):
            if not ok:
                unmet[target] = unmet.get(target, False) or fc
        for target, _ in targets:
            if target in unmet:
                if unmet[target]:
                    graph.add_edge(waiter, target, flow_control=True)
                else:
                    graph.add_edge(waiter, target)
            else:
                discounted[(waiter, target)] = None
                graph.add_node(target)
    members = frozenset(p.process_id for p in snapshot.processes)
    return WaitFor(snapshot.snapshot_id, graph, tuple(discounted), members, frozenset(undecided))


def find_deadlock(wf: WaitFor) -> Deadlock:
    """Reduce `wf`'s graph with each waiter's model and collect the evidence.

    The cycle is rotated to start at its smallest node, so equal snapshots give equal evidence.
    O(V + E), plus O(V log V) to sort, plus one component search of the deadlocked subgraph
    (O(V' + E')) for both the knot and the count.
    """
    G = wf.graph
    dead = deadlocked_nodes(G)
    if not dead:
        return Deadlock([], [], [], [], 0)
    cycle = rotated(deadlock_cycle(G, dead))
    sink, separate = deadlock_components(G, dead)
    knot: list[Node] = []
    if any(G.nodes[n].get("model") == OR for n in dead):
        knot = sorted(sink)
    flow_control = [bool(G.edges[waiter, target].get("flow_control")) for waiter, target in cycle_edges(cycle)]
    return Deadlock(sorted(dead), cycle, knot, empty_channels(cycle, flow_control), separate)


def rotated(cycle: list[Node]) -> list[Node]:
    """`cycle` rotated to start at its smallest node, so equal graphs give equal evidence."""
    if not cycle:
        return cycle
    first = cycle.index(min(cycle))
    return cycle[first:] + cycle[:first]


def cycle_edges(cycle: list[Node]) -> Iterable[tuple[Node, Node]]:
    """The edges of `cycle`, closing back to its first node."""
    return zip(cycle, cycle[1:] + cycle[:1], strict=True)


def empty_channels(cycle: list[Node], flow_control: Iterable[bool]) -> list[Channel]:
    """The channels along `cycle` that held no message waking its waiter (a counted edge says so;
    one may hold a message for another task of the receiver): one ``(src, dst)`` per edge between two
    processes (target's process -> waiter's process), without repeats, leaving out the flow-control
    edges (`flow_control`, one flag per edge of :func:`cycle_edges`): their wait is on the opposite
    channel being full."""
    channels: dict[Channel, None] = {}
    for (waiter, target), fc in zip(cycle_edges(cycle), flow_control, strict=True):
        if waiter[0] != target[0] and not fc:
            channels[(target[0], waiter[0])] = None
    return list(channels)


def wait_counts(wf: WaitFor) -> WaitCounts:
    """Count `wf`'s waiters, counted edges, discounted pairs, counted edges into processes outside
    the cut (not in ``wf.members``) and into the process nodes the quiet rule left free
    (``wf.undecided``). O(V + E)."""
    G = wf.graph
    waiters = sum(1 for _, model in G.nodes(data="model") if model is not None)
    outside = sum(1 for _, target in G.edges if target[0] not in wf.members)
    undecided = sum(1 for _, (process, task) in G.edges if not task and process in wf.undecided)
    return WaitCounts(waiters, G.number_of_edges(), len(wf.discounted), outside, undecided)


def label(node: Node | WaitNode) -> str:
    """Return ``"P"`` for a process node and ``"P/task"`` for a task node (``"P /svc/Method#..."``
    when the task already starts with a slash, as RPC mode's calls do: no doubled slash)."""
    process, task = (node.process, node.task) if isinstance(node, WaitNode) else node
    if not task:
        return process
    return f"{process} {task}" if task.startswith("/") else f"{process}/{task}"


def _wait_nodes(nodes: Iterable[Node]) -> list[WaitNode]:
    return [WaitNode(process=p, task=t) for p, t in nodes]


def _add_nodes(field: Any, nodes: Iterable[Node]) -> None:
    # ``add`` fills the repeated field in place: a third of the cost of building messages and copying
    # them in, which counts for the hundreds of thousands of nodes of a large deadlock.
    add = field.add
    for process, task in nodes:
        if task:
            add(process=process, task=task)
        else:
            add(process=process)


def evidence_proto(deadlock: Deadlock) -> DeadlockEvidence:
    """Convert `deadlock` to its protobuf message. O(nodes in the evidence)."""
    evidence = DeadlockEvidence(
        empty_channels=[ChannelRef(src=s, dst=d) for s, d in deadlock.empty_channels],
        separate_deadlocks=deadlock.separate,
    )
    _add_nodes(evidence.deadlocked, deadlock.deadlocked)
    _add_nodes(evidence.cycle, deadlock.cycle)
    _add_nodes(evidence.knot, deadlock.knot)
    return evidence


def to_proto(wf: WaitFor, deadlock: Deadlock | None = None) -> WaitForGraph:
    """Return the ``WaitForGraph`` message: nodes, counted and discounted edges, evidence.

    Each edge carries its waiter's model. `deadlock` defaults to ``find_deadlock(wf)``.
    """
    deadlock = find_deadlock(wf) if deadlock is None else deadlock
    nodes = wf.graph.nodes
    model = {AND: WAIT_MODEL_AND, OR: WAIT_MODEL_OR}

    def edge(waiter: Node, target: Node, discounted: bool, flow_control: bool = False) -> WaitEdge:
        return WaitEdge(
            waiter=WaitNode(process=waiter[0], task=waiter[1]),
            target=WaitNode(process=target[0], task=target[1]),
            model=model[nodes[waiter]["model"]],
            discounted=discounted,
            flow_control=flow_control,
        )

    edges = [edge(u, v, False, bool(fc)) for u, v, fc in wf.graph.edges(data="flow_control")]
    edges += [edge(u, v, True) for u, v in wf.discounted]
    return WaitForGraph(
        snapshot_id=wf.snapshot_id,
        nodes=_wait_nodes(wf.graph),
        edges=edges,
        deadlock=evidence_proto(deadlock),
    )
