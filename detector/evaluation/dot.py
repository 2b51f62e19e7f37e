"""The one Graphviz DOT writer: a ``WaitForGraph`` message as text that ``dot`` can draw.

Written by hand because networkx's DOT writers need pydot or pygraphviz. Used by the CLI's
``graph`` command, the demo, the benchmarks and the pipeline alike.
"""

from __future__ import annotations

from stablewatch.detector.evaluation.waitfor import label
from stablewatch.v1 import WAIT_MODEL_OR, WaitForGraph

__all__ = ["wait_for_dot"]


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def wait_for_dot(graph: WaitForGraph) -> str:
    """Return DOT text for `graph`: deadlocked nodes and the deadlock cycle in red, OR waiters as
    diamonds, edges set aside (in-flight and acknowledgement rules) dashed grey, flow-control waits labelled.

    O(nodes + edges).

    >>> print(wait_for_dot(WaitForGraph(snapshot_id=7)), end="")
    digraph "waitfor 7" {
      node [shape=box];
    }
    """
    dead = {label(node) for node in graph.deadlock.deadlocked}
    cycle = [label(node) for node in graph.deadlock.cycle]
    cycle_edges = set(zip(cycle, cycle[1:] + cycle[:1], strict=True))
    or_waiters = {label(edge.waiter) for edge in graph.edges if edge.model == WAIT_MODEL_OR}
    lines = [f"digraph {_quote(f'waitfor {graph.snapshot_id}')} {{", "  node [shape=box];"]
    for node in graph.nodes:
        name = label(node)
        style = ["shape=diamond"] if name in or_waiters else []
        if name in dead:
            style.append("color=red, fontcolor=red")
        lines.append(f"  {_quote(name)}" + (f" [{', '.join(style)}]" if style else "") + ";")
    for discounted in (False, True):  # counted edges first
        for edge in graph.edges:
            if edge.discounted != discounted:
                continue
            u, v = label(edge.waiter), label(edge.target)
            attrs = []
            if discounted:
                attrs = ["style=dashed", "color=grey", 'label="in flight"']
            else:
                if (u, v) in cycle_edges:
                    attrs = ["color=red", "penwidth=2"]
                if edge.flow_control:
                    attrs.append('label="window full"')
            lines.append(f"  {_quote(u)} -> {_quote(v)}" + (f" [{', '.join(attrs)}]" if attrs else "") + ";")
    lines.append("}")
    return "\n".join(lines) + "\n"
