"""The one Graphviz DOT writer: a ``WaitForGraph`` message as text that ``dot`` can draw.

Written by hand because networkx's DOT writers need pydot or pygraphviz. Used by the CLI's
``graph`` command, the demo, the benchmarks and the pipeline alike.

A node's DOT id is ``n0``, ``n1``, ... by its (process, task) key in sorted order, and its name
(:func:`~.waitfor.label`) is its ``label``: two nodes whose labels read alike (task ``b`` of
process ``a``, and a process named ``a/b``) stay two nodes.
"""

from __future__ import annotations

from stablewatch.detector.evaluation.waitfor import label
from stablewatch.v1 import WAIT_MODEL_OR, WaitForGraph, WaitNode

__all__ = ["wait_for_dot"]

_Key = tuple[str, str]  # (process, task): a node of the graph


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _key(node: WaitNode) -> _Key:
    return (node.process, node.task)


def wait_for_dot(graph: WaitForGraph) -> str:
    """Return DOT text for `graph`: deadlocked nodes and the deadlock cycle in red, OR waiters as
    diamonds, edges set aside (in-flight and acknowledgement rules) dashed grey, flow-control waits labelled.

    Deterministic: the nodes in sorted (process, task) order, then the edges in the graph's order
    (counted ones first). O((nodes + edges) log nodes).

    >>> print(wait_for_dot(WaitForGraph(snapshot_id=7)), end="")
    digraph "waitfor 7" {
      node [shape=box];
    }
    """
    dead = {_key(node) for node in graph.deadlock.deadlocked}
    cycle = [_key(node) for node in graph.deadlock.cycle]
    cycle_edges = set(zip(cycle, cycle[1:] + cycle[:1], strict=True))
    or_waiters = {_key(edge.waiter) for edge in graph.edges if edge.model == WAIT_MODEL_OR}
    keys = {_key(node) for node in graph.nodes}
    keys.update(_key(node) for edge in graph.edges for node in (edge.waiter, edge.target))
    ids = {key: f"n{index}" for index, key in enumerate(sorted(keys))}
    lines = [f"digraph {_quote(f'waitfor {graph.snapshot_id}')} {{", "  node [shape=box];"]
    for key, node_id in ids.items():
        attrs = [f"label={_quote(label(key))}"]
        if key in or_waiters:
            attrs.append("shape=diamond")
        if key in dead:
            attrs.append("color=red, fontcolor=red")
        lines.append(f"  {node_id} [{', '.join(attrs)}];")
    for discounted in (False, True):  # counted edges first
        for edge in graph.edges:
            if edge.discounted != discounted:
                continue
            u, v = _key(edge.waiter), _key(edge.target)
            attrs = []
            if discounted:
                attrs = ["style=dashed", "color=grey", 'label="in flight"']
            else:
                if (u, v) in cycle_edges:
                    attrs = ["color=red", "penwidth=2"]
                if edge.flow_control:
                    attrs.append('label="window full"')
            lines.append(f"  {ids[u]} -> {ids[v]}" + (f" [{', '.join(attrs)}]" if attrs else "") + ";")
    lines.append("}")
    return "\n".join(lines) + "\n"
