"""What the web view shows: one JSON value built by a pure function, and the live holder of its inputs.

Theory of operation. The detector's loop thread owns the store and everything it computes; the
web view's HTTP threads (:mod:`.web_http`) must never touch either. So the loop *publishes* the
few values the page needs to one :class:`LiveView` whenever they change:

* a snapshot finished (:meth:`LiveView.finished`: completed with its evaluation, or aborted);
* the members changed (:meth:`LiveView.set_members`);
* a break of a deadlock was sent or answered (:meth:`LiveView.add_resolution`).

Each publication is cheap on the loop (references to values it no longer changes, a few small
tuples; a :class:`~stablewatch.v1.query_pb2.Resolution` is copied, as the detector updates it in
place later) and bumps a version number. The HTTP threads read the inputs of the newest version and
turn them into the view with :func:`build_view`, a pure function over protobuf values, at most
once per version (:meth:`LiveView.json`); a reader waiting for news blocks in
:meth:`LiveView.wait_for_change`. Building costs the reader's thread, not the loop: a detector
nobody looks at pays only the publications.

The view holds the members (attached, expected, missing), the latest completed snapshot's
predicates and wait-for graph (drawn on the server as SVG by :func:`graph_svg`, with a small
layout of its own: no Graphviz, no script from elsewhere), the recent snapshots with each
predicate's verdicts, the predicates' changes, and the recent breaks.

Graph layout. The wait-for graph's strongly connected components are laid out in layers (a
component below every component that waits on it, by longest path in the condensation); a
component of several nodes is drawn as a ring (the deadlock's cycle in its order when the ring
holds it), a single node as itself; each layer's components are ordered by the mean position of
those waiting on them (one barycentre sweep), and wide layers wrap. Nodes that wait on nothing and
that nothing waits on (idle processes) come last, as a ring when there are a few. O(V + E) plus
sorting; at most :data:`MAX_DRAWN_NODES` nodes are drawn (deadlocked nodes and their neighbours
first), the rest counted.
"""

from __future__ import annotations

import bisect
import dataclasses
import datetime as dt
import html
import json
import math
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import networkx as nx

from stablewatch.detector.evaluation.verdict import Verdict
from stablewatch.detector.evaluation.waitfor import label
from stablewatch.detector.service.query import outcome_name
from stablewatch.detector.service.resolutions import outcome_word
from stablewatch.v1 import (
    WAIT_MODEL_OR,
    CutCoverage,
    Evaluation,
    GlobalSnapshot,
    PredicateResult,
    WaitForGraph,
    WaitNode,
)
from stablewatch.v1.query_pb2 import SNAPSHOT_OUTCOME_ABORTED, SNAPSHOT_OUTCOME_COMPLETED, Resolution, SnapshotSummary

if TYPE_CHECKING:
    from stablewatch.detector.service.store import Store

__all__ = [
    "BREAKS_KEPT",
    "CHANGES_KEPT",
    "MAX_DRAWN_NODES",
    "TIMELINE_LENGTH",
    "Change",
    "ChannelLoad",
    "Finished",
    "Latest",
    "LiveView",
    "MemberLike",
    "ViewInputs",
    "build_view",
    "changes_between",
    "finished_of",
    "graph_svg",
    "latest_of",
]

#: Recent snapshots the timeline shows.
TIMELINE_LENGTH = 60
#: Predicate changes kept.
CHANGES_KEPT = 100
#: Breaks of deadlocks kept.
BREAKS_KEPT = 50
#: Nodes drawn at most; the view says how many it left out.
MAX_DRAWN_NODES = 200

Node = tuple[str, str]  # (process, task); task "" is the process itself


class MemberLike(Protocol):
    """What the view reads of an attached member (:class:`~.coordinator.Member` is one)."""

    process_id: str
    address: str
    attached_at: float


@dataclass(frozen=True, slots=True)
class ChannelLoad:
    """A channel of the cut with recorded messages: how many, and how many may wake its receiver."""

    src: str
    dst: str
    messages: int
    waking: int


@dataclass(frozen=True, slots=True)
class Finished:
    """One finished snapshot as the timeline shows it: its summary and each predicate's verdict."""

    summary: SnapshotSummary
    verdicts: tuple[tuple[str, Verdict], ...] = ()

    @property
    def snapshot_id(self) -> int:
        return self.summary.snapshot_id


@dataclass(frozen=True, slots=True)
class Latest:
    """The newest completed snapshot: what the page shows of its results and of its cut."""

    summary: SnapshotSummary
    results: tuple[PredicateResult, ...]
    graph: WaitForGraph
    coverage: CutCoverage
    processes: tuple[str, ...]  # the cut's members
    channels: tuple[ChannelLoad, ...]  # channels with messages in flight


@dataclass(frozen=True, slots=True)
class Change:
    """A predicate's value changed with snapshot ``snapshot_id`` (``before`` None: its first value)."""

    snapshot_id: int
    at: float  # the snapshot's finish, wall-clock seconds
    name: str
    before: Verdict | None
    after: Verdict


@dataclass(frozen=True, slots=True)
class ViewInputs:
    """Everything :func:`build_view` reads: immutable, so a reader thread may use it while the loop
    publishes the next one."""

    detector: str = ""  # where the detector serves gRPC, as a title
    expected: tuple[str, ...] = ()  # declared members (--members by id)
    expected_count: int = 0  # declared number of members (0: none)
    members: tuple[MemberLike, ...] = ()
    latest: Latest | None = None
    timeline: tuple[Finished, ...] = ()  # by snapshot id, oldest first
    changes: tuple[Change, ...] = ()  # oldest first
    breaks: tuple[Resolution, ...] = ()  # by break id, oldest first


# -- from the detector's values to the inputs (run on the loop; cheap) ---------------------------------------


def finished_of(summary: SnapshotSummary, results: Iterable[PredicateResult] = ()) -> Finished:
    """The timeline's entry for a finished snapshot. O(predicates)."""
    return Finished(summary, tuple((r.name, Verdict.of(r)) for r in results))


def latest_of(summary: SnapshotSummary, snapshot: GlobalSnapshot, evaluation: Evaluation) -> Latest:
    """The latest view of a completed snapshot: its results and graph (shared, never changed
    afterwards), its members and the channels holding messages. O(processes + channels + messages
    in flight)."""
    channels = tuple(
        ChannelLoad(c.src, c.dst, len(c.messages), sum(1 for m in c.messages if not m.no_wake))
        for c in snapshot.channels
        if c.messages
    )
    return Latest(
        summary=summary,
        results=tuple(evaluation.results),
        graph=evaluation.wait_for,
        coverage=evaluation.coverage,
        processes=tuple(p.process_id for p in snapshot.processes),
        channels=channels,
    )


def changes_between(last: Mapping[str, Verdict], entry: Finished) -> list[Change]:
    """The predicates whose verdict in `entry` differs from `last` (name -> verdict). O(predicates)."""
    at = _seconds(entry.summary, "finished_at")
    return [
        Change(entry.snapshot_id, at, name, last.get(name), verdict)
        for name, verdict in entry.verdicts
        if last.get(name) != verdict
    ]


# -- the view ----------------------------------------------------------------------------------------------


def build_view(inputs: ViewInputs, version: int = 0) -> dict[str, Any]:
    """The web view as a JSON-ready dict (see the module doc). Pure; O(members + timeline + changes +
    breaks) plus the graph's O(V + E) (at most :data:`MAX_DRAWN_NODES` nodes drawn).

    >>> view = build_view(ViewInputs(detector="127.0.0.1:50051", expected=("A",)))
    >>> view["snapshot"], view["members"]["missing"], view["graph"]["nodes"]
    (None, ['A'], [])
    """
    latest = inputs.latest
    attached = sorted(inputs.members, key=lambda m: m.process_id)
    names = {m.process_id for m in attached}
    missing = [name for name in sorted(set(inputs.expected)) if name not in names]
    members = {
        "attached": [
            {"process_id": m.process_id, "address": m.address, "attached_at": _iso(m.attached_at)} for m in attached
        ],
        "expected": sorted(set(inputs.expected)),
        "expected_count": inputs.expected_count,
        "missing": missing,
        "missing_count": max(len(missing), inputs.expected_count - len(attached)),
        "cut_missing": [] if latest is None else list(latest.coverage.missing_processes),
    }
    return {
        "version": version,
        "detector": inputs.detector,
        "members": members,
        "snapshot": None if latest is None else _snapshot(latest),
        "predicates": [] if latest is None else [_predicate(r) for r in latest.results],
        "graph": _graph(latest),
        "timeline": [_timeline_entry(entry) for entry in inputs.timeline],
        "changes": [_change(change) for change in reversed(inputs.changes)],
        "breaks": [_break(resolution) for resolution in reversed(inputs.breaks)],
    }


def _snapshot(latest: Latest) -> dict[str, Any]:
    summary = latest.summary
    return {
        **_summary(summary),
        "channels": summary.channels,
        "closed": latest.coverage.closed,
        "missing_unnamed": latest.coverage.missing_unnamed,
    }


def _summary(summary: SnapshotSummary) -> dict[str, Any]:
    started, finished = _seconds(summary, "started_at"), _seconds(summary, "finished_at")
    return {
        "id": summary.snapshot_id,
        "outcome": outcome_name(summary.outcome),
        "reason": summary.abort_reason,
        "kind": summary.abort_kind,
        "started_at": _iso(started),
        "finished_at": _iso(finished),
        "duration_ms": round((finished - started) * 1000, 1) if started and finished else None,
        "processes": summary.processes,
        "messages_in_flight": summary.messages_in_flight,
    }


def _predicate(result: PredicateResult) -> dict[str, Any]:
    return {
        "name": result.name,
        "value": str(Verdict.of(result)),
        "summary": result.summary,
        "error": result.error,
        "missing": list(result.missing_processes),
    }


def _timeline_entry(entry: Finished) -> dict[str, Any]:
    return {**_summary(entry.summary), "values": {name: str(verdict) for name, verdict in entry.verdicts}}


def _change(change: Change) -> dict[str, Any]:
    return {
        "snapshot_id": change.snapshot_id,
        "at": _iso(change.at),
        "predicate": change.name,
        "from": None if change.before is None else str(change.before),
        "to": str(change.after),
    }


def _break(resolution: Resolution) -> dict[str, Any]:
    def at(name: str) -> str | None:
        return _iso(getattr(resolution, name).ToMicroseconds() / 1e6) if resolution.HasField(name) else None

    return {
        "id": resolution.resolution_id,
        "snapshot_id": resolution.snapshot_id,
        "process": resolution.process_id,
        "task": resolution.task,
        "waiter": label(WaitNode(process=resolution.process_id, task=resolution.task)),
        "instance": resolution.instance,
        "policy": resolution.policy,
        "requested_by": resolution.requested_by,
        "deadlock": resolution.deadlock,
        "sent_at": at("sent_at"),
        "reported_at": at("reported_at"),
        "outcome": outcome_word(resolution),
        "detail": resolution.detail,
    }


def _seconds(summary: SnapshotSummary, name: str) -> float:
    """A summary's timestamp in seconds, 0.0 when unset."""
    return getattr(summary, name).ToMicroseconds() / 1e6 if summary.HasField(name) else 0.0


def _iso(seconds: float) -> str | None:
    if not seconds:
        return None
    return dt.datetime.fromtimestamp(seconds, dt.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


# -- the graph ---------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Node:
    key: Node
    id: str  # label(): "P" or "P/task"
    kind: str  # process, task, call
    model: str | None = None  # "and" / "or" for a waiter
    deadlocked: bool = False
    cycle: bool = False
    knot: bool = False
    outside: bool = False  # a process (or its task) not in the cut
    idle: bool = False  # a member that waits on nothing and nothing waits on

    def classes(self) -> list[str]:
        flags = ("deadlocked", "cycle", "knot", "outside", "idle")
        return ["node", self.kind, *([self.model] if self.model else []), *(f for f in flags if getattr(self, f))]


@dataclass(slots=True)
class _Edge:
    waiter: Node
    target: Node
    model: str
    discounted: bool
    flow_control: bool
    deadlocked: bool = False
    cycle: bool = False
    knot: bool = False

    def classes(self) -> list[str]:
        flags = ("discounted", "flow_control", "deadlocked", "cycle", "knot")
        return ["edge", self.model, *(f.replace("_", "-") for f in flags if getattr(self, f))]


def _key(node: WaitNode) -> Node:
    return (node.process, node.task)


def _kind(key: Node) -> str:
    if not key[1]:
        return "process"
    return "call" if key[1].startswith("/") else "task"  # RPC mode names a call's task by its method


def _graph_parts(latest: Latest) -> tuple[list[_Node], list[_Edge], int]:
    """The drawn nodes (deadlocked first when there are too many) and edges among them, and the
    number of nodes in all."""
    graph, evidence = latest.graph, latest.graph.deadlock
    members = set(latest.processes)
    dead = {_key(n) for n in evidence.deadlocked}
    cycle = [_key(n) for n in evidence.cycle]
    knot = {_key(n) for n in evidence.knot}
    or_waiters = {_key(e.waiter) for e in graph.edges if e.model == WAIT_MODEL_OR}
    nodes: dict[Node, _Node] = {}
    for wait_node in graph.nodes:
        key = _key(wait_node)
        nodes[key] = _Node(key, label(wait_node), _kind(key))
    edges: list[_Edge] = []
    for e in graph.edges:
        waiter, target = _key(e.waiter), _key(e.target)
        for key in (waiter, target):
            if key not in nodes:
                nodes[key] = _Node(key, label(WaitNode(process=key[0], task=key[1])), _kind(key))
        edges.append(_Edge(waiter, target, "or" if waiter in or_waiters else "and", e.discounted, e.flow_control))
    on_cycle = set(cycle)
    for node in nodes.values():
        node.deadlocked, node.cycle, node.knot = node.key in dead, node.key in on_cycle, node.key in knot
        node.outside = node.key[0] not in members
    for edge in edges:
        nodes[edge.waiter].model = edge.model
    cycle_edges = set(zip(cycle, cycle[1:] + cycle[:1], strict=True))
    for edge in edges:
        if edge.discounted:
            continue
        edge.deadlocked = edge.waiter in dead and edge.target in dead
        edge.cycle = (edge.waiter, edge.target) in cycle_edges
        edge.knot = edge.waiter in knot and edge.target in knot
    for process in latest.processes:  # members that wait on nothing: shown idle
        key = (process, "")
        if key not in nodes:
            nodes[key] = _Node(key, process, "process", idle=True)
    for channel in latest.channels:  # a channel's ends are members (assembly keeps member channels only)
        for process in (channel.src, channel.dst):
            nodes.setdefault((process, ""), _Node((process, ""), process, "process", idle=True))
    total = len(nodes)
    if total > MAX_DRAWN_NODES:
        near = dead | {e.target for e in edges if e.waiter in dead} | {e.waiter for e in edges if e.target in dead}
        ranked = sorted(nodes, key=lambda k: (k not in dead, k not in near, nodes[k].idle, k))
        keep = set(ranked[:MAX_DRAWN_NODES])
        nodes = {k: n for k, n in nodes.items() if k in keep}
        edges = [e for e in edges if e.waiter in keep and e.target in keep]
    return sorted(nodes.values(), key=lambda n: n.key), edges, total


def _graph(latest: Latest | None) -> dict[str, Any]:
    if latest is None:
        return {
            "snapshot_id": None,
            "nodes": [],
            "edges": [],
            "channels": [],
            "total_nodes": 0,
            "separate_deadlocks": 0,
            "cycle": [],
            "knot": [],
            "svg": _EMPTY,
        }
    nodes, edges, total = _graph_parts(latest)
    ids = {n.key: n.id for n in nodes}
    evidence = latest.graph.deadlock
    return {
        "snapshot_id": latest.summary.snapshot_id,
        "nodes": [
            {
                "id": n.id,
                "process": n.key[0],
                "task": n.key[1],
                "kind": n.kind,
                "model": n.model,
                "deadlocked": n.deadlocked,
                "cycle": n.cycle,
                "knot": n.knot,
                "outside": n.outside,
                "idle": n.idle,
            }
            for n in nodes
        ],
        "edges": [
            {
                # The labels, and the keys they name: a label alone is ambiguous (task "b" of
                # process "a" and a process named "a/b" are both "a/b").
                "waiter": ids[e.waiter],
                "target": ids[e.target],
                "waiter_process": e.waiter[0],
                "waiter_task": e.waiter[1],
                "target_process": e.target[0],
                "target_task": e.target[1],
                "model": e.model,
                "discounted": e.discounted,
                "flow_control": e.flow_control,
                "deadlocked": e.deadlocked,
                "cycle": e.cycle,
                "knot": e.knot,
            }
            for e in edges
        ],
        "channels": [dataclasses.asdict(c) for c in latest.channels],
        "total_nodes": total,
        "separate_deadlocks": evidence.separate_deadlocks,
        "cycle": [label(n) for n in evidence.cycle],
        "knot": [label(n) for n in evidence.knot],
        "svg": _draw(latest, nodes, edges),
    }


# Drawing sizes, in SVG user units (pixels at scale 1). Labels are set in a 12 px monospace font.
_CHAR = 7.3
_PAD = 9.0
_HEIGHT = 24.0
_MAX_LABEL = 28
_GAP_X = 34.0
_GAP_Y = 64.0
_MARGIN = 22.0
_ROW = 1100.0  # a layer wider than this wraps
_RING_MIN = 64.0
_IDLE_RING = (3, 16)  # idle nodes are drawn as a ring when there are this many (inclusive)

_EMPTY = (
    '<svg xmlns="http://www.w3.org/2000/svg" class="wait-for empty" viewBox="0 0 320 40" width="320" height="40">'
    '<text x="10" y="24">no snapshot has completed yet</text></svg>'
)
_MARKERS = {  # id -> colour of the arrow head
    "sw-arrow": "#4b5563",
    "sw-arrow-or": "#7c3aed",
    "sw-arrow-dead": "#dc2626",
    "sw-arrow-grey": "#9ca3af",
    "sw-arrow-channel": "#2563eb",
}


@dataclass(slots=True)
class _Block:
    """A component to place: its nodes' offsets from its top-left corner, and its size."""

    nodes: list[Node]
    offsets: dict[Node, tuple[float, float]]
    width: float
    height: float
    anchor: Node = field(init=False)

    def __post_init__(self) -> None:
        self.anchor = min(self.nodes)


def _shown(text: str) -> str:
    """The label as drawn: control characters replaced, long ones cut (the title has it whole)."""
    text = "".join(c if c.isprintable() else "?" for c in text)
    return text if len(text) <= _MAX_LABEL else text[: _MAX_LABEL - 1] + "…"


def _width(node: _Node) -> float:
    return len(_shown(node.id)) * _CHAR + 2 * _PAD + (14 if node.model == "or" else 0)


def _ring(order: Sequence[Node], widths: Mapping[Node, float]) -> _Block:
    """`order` clockwise on a circle from the top, wide enough that neighbours do not overlap."""
    k, widest = len(order), max(widths[n] for n in order)
    radius = max(_RING_MIN, (widest + 48) / (2 * math.sin(math.pi / k)), k * (_HEIGHT + 24) / (2 * math.pi))
    cx, cy = radius + widest / 2, radius + _HEIGHT / 2
    angles = [2 * math.pi * i / k - math.pi / 2 for i in range(k)]  # clockwise from the top
    offsets = {n: (cx + radius * math.cos(a), cy + radius * math.sin(a)) for n, a in zip(order, angles, strict=True)}
    return _Block(list(order), offsets, 2 * radius + widest, 2 * radius + _HEIGHT)


def _ring_order(component: set[Node], graph: nx.DiGraph, cycle: Sequence[Node]) -> list[Node]:
    """A walk along wait edges through `component`, starting with the deadlock cycle when it lies
    there, so that most edges join neighbours on the ring."""
    order = [n for n in cycle if n in component] if set(cycle) <= component else []
    seen = set(order)
    current = order[-1] if order else None
    while len(order) < len(component):
        following = [] if current is None else [s for s in graph.successors(current) if s not in seen]
        following = [s for s in following if s in component]
        current = min(following) if following else min(component - seen)
        order.append(current)
        seen.add(current)
    return order


def _layout(
    nodes: Sequence[_Node], edges: Sequence[_Edge], cycle: Sequence[Node]
) -> tuple[dict[Node, tuple[float, float]], float, float]:
    """Node centres and the drawing's width and height (see the module doc)."""
    widths = {n.key: _width(n) for n in nodes}
    graph = nx.DiGraph()
    graph.add_nodes_from(widths)
    graph.add_edges_from((e.waiter, e.target) for e in edges if e.waiter != e.target)
    waiters = {e.waiter for e in edges}  # a self-loop is a wait too
    loose = sorted(n for n in graph if graph.degree(n) == 0 and n not in waiters)
    connected = graph.subgraph(set(graph) - set(loose))
    components = sorted((set(c) for c in nx.strongly_connected_components(connected)), key=min)
    blocks: list[_Block] = []
    index: dict[Node, int] = {}
    for i, component in enumerate(components):
        if len(component) == 1:
            (n,) = component
            blocks.append(_Block([n], {n: (widths[n] / 2, _HEIGHT / 2)}, widths[n], _HEIGHT))
        else:
            blocks.append(_ring(_ring_order(component, connected, cycle), widths))
        index.update((n, i) for n in component)
    condensed = nx.DiGraph()
    condensed.add_nodes_from(range(len(blocks)))
    condensed.add_edges_from((index[u], index[v]) for u, v in connected.edges if index[u] != index[v])
    layer: dict[int, int] = {}
    for b in nx.lexicographical_topological_sort(condensed):
        layer[b] = max((layer[p] + 1 for p in condensed.predecessors(b)), default=0)
    rows: list[list[int]] = [[] for _ in range(max(layer.values(), default=-1) + 1)]
    for b in sorted(layer):
        rows[layer[b]].append(b)
    if loose:
        low, high = _IDLE_RING
        if low <= len(loose) <= high:
            blocks.append(_ring(loose, widths))
            rows.append([len(blocks) - 1])
        else:
            first = len(blocks)
            blocks += [_Block([n], {n: (widths[n] / 2, _HEIGHT / 2)}, widths[n], _HEIGHT) for n in loose]
            rows.append(list(range(first, len(blocks))))
    # Place rows top-down, each centred on x = 0; order a row by where its waiters stand above.
    centre_x: dict[int, float] = {}
    corner: dict[int, tuple[float, float]] = {}
    y = 0.0
    for row in rows:

        def barycentre(b: int) -> tuple[float, Node]:
            above = [centre_x[p] for p in condensed.predecessors(b) if p in centre_x] if b in condensed else []
            return (sum(above) / len(above) if above else 0.0, blocks[b].anchor)

        row.sort(key=barycentre)
        lines: list[list[int]] = [[]]
        width = 0.0
        for b in row:  # wrap wide layers
            if lines[-1] and width + _GAP_X + blocks[b].width > _ROW:
                lines.append([])
                width = 0.0
            width += (_GAP_X if lines[-1] else 0.0) + blocks[b].width
            lines[-1].append(b)
        for line in lines:
            total = sum(blocks[b].width for b in line) + _GAP_X * (len(line) - 1)
            height = max(blocks[b].height for b in line)
            x = -total / 2
            for b in line:
                corner[b] = (x, y + (height - blocks[b].height) / 2)
                centre_x[b] = x + blocks[b].width / 2
                x += blocks[b].width + _GAP_X
            y += height + _GAP_Y
    positions = {
        n: (corner[b][0] + dx, corner[b][1] + dy)
        for b, block in enumerate(blocks)
        for n, (dx, dy) in block.offsets.items()
    }
    if not positions:
        return {}, 2 * _MARGIN, 2 * _MARGIN
    left = min(x - widths[n] / 2 for n, (x, _) in positions.items())
    right = max(x + widths[n] / 2 for n, (x, _) in positions.items())
    top = min(y for _, y in positions.values()) - _HEIGHT / 2 - 40  # room for self-loops
    bottom = max(y for _, y in positions.values()) + _HEIGHT / 2
    shifted = {n: (x - left + _MARGIN, y - top + _MARGIN) for n, (x, y) in positions.items()}
    return shifted, right - left + 2 * _MARGIN, bottom - top + 2 * _MARGIN


def _esc(text: object) -> str:
    return html.escape("".join(c if c.isprintable() else "?" for c in str(text)), quote=True)


def _clip(centre: tuple[float, float], toward: tuple[float, float], half: tuple[float, float]) -> tuple[float, float]:
    """Where the ray from `centre` toward `toward` leaves a box of half-sizes `half` (2 units out)."""
    dx, dy = toward[0] - centre[0], toward[1] - centre[1]
    length = math.hypot(dx, dy) or 1.0
    dx, dy = dx / length, dy / length
    t = min(half[0] / abs(dx) if dx else math.inf, half[1] / abs(dy) if dy else math.inf) + 2
    return centre[0] + dx * t, centre[1] + dy * t


def _curve(
    p: tuple[float, float], q: tuple[float, float], hp: tuple[float, float], hq: tuple[float, float], bend: float
) -> tuple[str, tuple[float, float]]:
    """A quadratic curve from box p to box q bowed by `bend` of its length to its left (so the two
    directions between one pair part), and its midpoint."""
    dx, dy = q[0] - p[0], q[1] - p[1]
    length = math.hypot(dx, dy) or 1.0
    control = ((p[0] + q[0]) / 2 + dy / length * bend * length, (p[1] + q[1]) / 2 - dx / length * bend * length)
    start, end = _clip(p, control, hp), _clip(q, control, hq)
    middle = (
        0.25 * start[0] + 0.5 * control[0] + 0.25 * end[0],
        0.25 * start[1] + 0.5 * control[1] + 0.25 * end[1],
    )
    path = f"M{start[0]:.1f},{start[1]:.1f} Q{control[0]:.1f},{control[1]:.1f} {end[0]:.1f},{end[1]:.1f}"
    return path, middle


def _loop(p: tuple[float, float], half: tuple[float, float]) -> tuple[str, tuple[float, float]]:
    x, top = p[0], p[1] - half[1]
    path = f"M{x - 8:.1f},{top:.1f} C{x - 30:.1f},{top - 36:.1f} {x + 30:.1f},{top - 36:.1f} {x + 8:.1f},{top - 2:.1f}"
    return path, (x, top - 30)


def graph_svg(latest: Latest | None) -> str:
    """The latest wait-for graph as an SVG document, for the page to put in place as it is.

    Every element carries classes and ``data-`` attributes a test (or a style sheet) can read:
    ``<g class="node process and deadlocked cycle" data-node="P0">``, ``<g class="edge and cycle"
    data-waiter="P0" data-target="P1">`` (``or`` for an OR waiter's edges, ``discounted`` for one a
    message in flight satisfies, ``flow-control``, ``deadlocked``, ``knot``), and ``<g class="channel
    in-flight" data-src="P" data-dst="Q" data-messages="2" data-waking="1">``. Every text is escaped.
    O(V + E) after the layout.
    """
    if latest is None:
        return _EMPTY
    nodes, edges, _ = _graph_parts(latest)
    return _draw(latest, nodes, edges)


def _draw(latest: Latest, nodes: Sequence[_Node], edges: Sequence[_Edge]) -> str:
    cycle = [_key(n) for n in latest.graph.deadlock.cycle]
    positions, width, height = _layout(nodes, edges, cycle)
    half = {n.key: (_width(n) / 2, _HEIGHT / 2) for n in nodes}
    ids = {n.key: n.id for n in nodes}
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="wait-for" data-snapshot="{latest.summary.snapshot_id}" '
        f'viewBox="0 0 {width:.0f} {height:.0f}" width="{width:.0f}" height="{height:.0f}" role="img" '
        f'aria-label="wait-for graph of snapshot {latest.summary.snapshot_id}">',
        "<defs>",
        *(
            f'<marker id="{name}" viewBox="0 0 10 10" refX="9" refY="5" markerUnits="userSpaceOnUse" '
            f'markerWidth="9" markerHeight="9" orient="auto-start-reverse">'
            f'<path d="M0,0 L10,5 L0,10 z" fill="{colour}"/></marker>'
            for name, colour in _MARKERS.items()
        ),
        "</defs>",
    ]
    if not nodes:
        out.append(f'<text x="{_MARGIN}" y="{_MARGIN + 16}">no process waits in this snapshot</text>')
    for channel in latest.channels:
        p, q = positions.get((channel.src, "")), positions.get((channel.dst, ""))
        if p is None or q is None:
            continue
        path, middle = _curve(p, q, half[(channel.src, "")], half[(channel.dst, "")], 0.22)
        title = (
            f"channel {channel.src} → {channel.dst}: {channel.messages} message(s) in flight, "
            f"{channel.waking} that may wake {channel.dst}"
        )
        out.append(
            f'<g class="channel in-flight" data-src="{_esc(channel.src)}" data-dst="{_esc(channel.dst)}" '
            f'data-messages="{channel.messages}" data-waking="{channel.waking}"><title>{_esc(title)}</title>'
            f'<path d="{path}" marker-end="url(#sw-arrow-channel)"/>'
            f'<text x="{middle[0]:.1f}" y="{middle[1] - 4:.1f}">{channel.messages} msg</text></g>'
        )
    for edge in edges:
        p, q = positions[edge.waiter], positions[edge.target]
        if edge.waiter == edge.target:
            path, middle = _loop(p, half[edge.waiter])
        else:
            path, middle = _curve(p, q, half[edge.waiter], half[edge.target], 0.12)
        marker = (
            "sw-arrow-grey"
            if edge.discounted
            else "sw-arrow-dead"
            if edge.deadlocked
            else "sw-arrow-or"
            if edge.model == "or"
            else "sw-arrow"
        )
        what = (
            "satisfied by a message in flight"
            if edge.discounted
            else "window full"
            if edge.flow_control
            else f"{edge.model.upper()} wait"
        )
        title = f"{ids[edge.waiter]} waits for {ids[edge.target]} ({what})"
        text = ""
        if edge.flow_control and not edge.discounted:
            text = f'<text x="{middle[0]:.1f}" y="{middle[1] - 4:.1f}">window full</text>'
        out.append(
            f'<g class="{" ".join(edge.classes())}" data-waiter="{_esc(ids[edge.waiter])}" '
            f'data-target="{_esc(ids[edge.target])}"><title>{_esc(title)}</title>'
            f'<path d="{path}" marker-end="url(#{marker})"/>{text}</g>'
        )
    for node in nodes:
        x, y = positions[node.key]
        w = _width(node)
        state = [
            word
            for word, on in (
                (f"{node.model.upper()} waiter" if node.model else "waits on nothing", True),
                ("deadlocked", node.deadlocked),
                ("on the cycle", node.cycle),
                ("in the knot", node.knot),
                ("outside the cut", node.outside),
            )
            if on
        ]
        tag = ""
        if node.model == "or":
            tag = f'<text class="model-tag" x="{x + w / 2 - 17:.1f}" y="{y + 3:.1f}">OR</text>'
        out.append(
            f'<g class="{" ".join(node.classes())}" data-node="{_esc(node.id)}" data-process="{_esc(node.key[0])}" '
            f'data-task="{_esc(node.key[1])}"><title>{_esc(node.id)}: {_esc(", ".join(state))}</title>'
            f'<rect x="{x - w / 2:.1f}" y="{y - _HEIGHT / 2:.1f}" width="{w:.1f}" height="{_HEIGHT:.1f}"/>'
            f'<text x="{x - w / 2 + _PAD:.1f}" y="{y + 4:.1f}">{_esc(_shown(node.id))}</text>{tag}</g>'
        )
    out.append("</svg>")
    return "".join(out)


# -- the live holder -----------------------------------------------------------------------------------------


class LiveView:
    """The inputs of the view, published by the detector's loop, read by any thread.

    Publications replace an immutable :class:`ViewInputs` under a lock and wake the readers
    waiting in :meth:`wait_for_change`; :meth:`json` builds the view of the newest inputs outside
    that lock, once per version.
    """

    def __init__(self, detector: str = "", expected: Iterable[str] = (), expected_count: int = 0) -> None:
        self._changed = threading.Condition()
        self._inputs = ViewInputs(detector=detector, expected=tuple(expected), expected_count=expected_count)
        self._version = 0
        self._closed = False
        self._last: dict[str, Verdict] = {}  # each predicate's newest verdict
        self._last_id = 0  # the newest completed snapshot seen
        self._build = threading.Lock()
        self._built: tuple[int, bytes] | None = None

    # -- the loop's side ---------------------------------------------------------------------------

    def load(self, store: Store, detector: str | None = None) -> None:
        """Start from what `store` holds: the recent snapshots, the latest one's graph, the recent
        breaks; `detector` (its address) names the page. On the loop, as the detector starts (the
        store belongs to it)."""
        finished = (SNAPSHOT_OUTCOME_COMPLETED, SNAPSHOT_OUTCOME_ABORTED)
        summaries = [s for s in reversed(store.list(TIMELINE_LENGTH)) if s.outcome in finished]
        entries: list[Finished] = []
        for summary in summaries:
            results = store.results(summary.snapshot_id) if summary.outcome == SNAPSHOT_OUTCOME_COMPLETED else None
            entries.append(finished_of(summary, results.results if results is not None else ()))
        latest = None
        newest = store.latest_results()
        if newest is not None:
            newest_id = newest.snapshot.snapshot_id
            snapshot, evaluation = store.snapshot(newest_id), store.evaluation(newest_id)
            if snapshot is not None and evaluation is not None:
                latest = latest_of(newest.snapshot, snapshot, evaluation)
        breaks = tuple(reversed(store.resolutions(BREAKS_KEPT)))
        with self._changed:
            changes: list[Change] = []
            for entry in entries:
                if entry.summary.outcome == SNAPSHOT_OUTCOME_COMPLETED:
                    changes += self._note(entry)
            self._publish(
                detector=self._inputs.detector if detector is None else detector,
                latest=latest,
                timeline=tuple(entries),
                changes=tuple(changes[-CHANGES_KEPT:]),
                breaks=breaks,
            )

    def finished(
        self, summary: SnapshotSummary, snapshot: GlobalSnapshot | None = None, evaluation: Evaluation | None = None
    ) -> None:
        """A snapshot finished: completed (with its snapshot and evaluation) or aborted."""
        entry = finished_of(summary, evaluation.results if evaluation is not None else ())
        newest = snapshot is not None and evaluation is not None and summary.snapshot_id > self._last_id
        latest = latest_of(summary, snapshot, evaluation) if newest and snapshot and evaluation else None
        with self._changed:
            inputs = self._inputs
            timeline = list(inputs.timeline)
            bisect.insort(timeline, entry, key=lambda e: e.snapshot_id)
            changed = {"timeline": tuple(timeline[-TIMELINE_LENGTH:])}
            if latest is not None:  # a slow older snapshot neither replaces the latest nor makes changes
                changed["latest"] = latest
                changed["changes"] = (*inputs.changes, *self._note(entry))[-CHANGES_KEPT:]
            self._publish(**changed)

    def set_members(self, members: Iterable[MemberLike]) -> None:
        """The attached members now (they are read later, from other threads: only fields that
        never change once a member is attached are)."""
        with self._changed:
            self._publish(members=tuple(members))

    def add_resolution(self, resolution: Resolution) -> None:
        """A break was sent or answered (the same break again when answered: it replaces the first)."""
        copy = Resolution()
        copy.CopyFrom(resolution)  # the detector goes on changing its own
        with self._changed:
            breaks = [b for b in self._inputs.breaks if b.resolution_id != copy.resolution_id]
            bisect.insort(breaks, copy, key=lambda b: b.resolution_id)
            self._publish(breaks=tuple(breaks[-BREAKS_KEPT:]))

    def close(self) -> None:
        """The detector stops: readers waiting for a change return (event streams end)."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def _note(self, entry: Finished) -> list[Change]:
        """The changes `entry` (completed, newer than any before) makes; remembers its verdicts."""
        changes = changes_between(self._last, entry)
        self._last.update(entry.verdicts)
        self._last_id = entry.snapshot_id
        return changes

    def _publish(self, **changed: Any) -> None:
        """Replace the inputs (under the lock) and wake the readers."""
        self._inputs = dataclasses.replace(self._inputs, **changed)
        self._version += 1
        self._changed.notify_all()

    # -- the readers' side -------------------------------------------------------------------------

    @property
    def version(self) -> int:
        """Bumped by every publication."""
        with self._changed:
            return self._version

    @property
    def closed(self) -> bool:
        with self._changed:
            return self._closed

    def inputs(self) -> tuple[int, ViewInputs]:
        """The newest inputs and their version."""
        with self._changed:
            return self._version, self._inputs

    def json(self) -> tuple[int, bytes]:
        """The newest view as compact JSON (UTF-8), and its version; built once per version."""
        version, inputs = self.inputs()
        built = self._built
        if built is not None and built[0] == version:
            return built
        with self._build:  # one build at a time; the loop never waits for it
            built = self._built
            if built is None or built[0] != version:
                body = json.dumps(build_view(inputs, version), separators=(",", ":")).encode()
                built = self._built = (version, body)
            return built

    def wait_for_change(self, seen: int, timeout: float) -> int | None:
        """Wait up to `timeout` seconds for a version newer than `seen`; the version then (`seen`
        when nothing changed), or None once the view is closed."""
        with self._changed:
            self._changed.wait_for(lambda: self._closed or self._version != seen, timeout)
            return None if self._closed else self._version
