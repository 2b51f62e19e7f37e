"""Benchmark: deadlock reduction against networkx's strongly connected components, same graph, same run.

Two seeded wait-for graphs (AND model), each with a long wait chain leading into it: a random one,
where most nodes can reach a cycle, and an acyclic one (every edge from a lower to a higher node),
where nothing is deadlocked and the reduction must release every node through every edge: its
worst case. Timed on each:
``deadlocked_nodes`` followed by ``deadlock_cycle`` (what the deadlock predicate needs from the
graph), and ``nx.strongly_connected_components`` consumed fully, the yardstick for a linear-time
pass in pure Python; and the same reduction on the same graph in compact form (flat integer arrays,
``compact_deadlocked`` and ``compact_cycle``: what the pipeline's columnar evaluation runs),
``compact_seconds`` per graph. Prints a table, then one JSON line (the last line) with ``ratio`` =
deadlock_seconds / scc_seconds (best of `--repeat`, on the worse of the two graphs); the target is
ratio <= 1.5.

    python bench/predicates.py                      # 1 000 000 nodes, 3 000 000 edges
    python bench/predicates.py --nodes 10000 --edges 30000 --repeat 3
"""

import argparse
import gc
import random
import statistics
import time
from collections.abc import Callable

import networkx as nx
import numpy as np
from report import json_line, timed
from rich.console import Console
from rich.table import Table

from stablewatch.detector.evaluation.deadlock import (
    CompactGraph,
    compact_cycle,
    compact_deadlocked,
    deadlock_cycle,
    deadlocked_nodes,
)


def build_graph(nodes: int, edges: int, chain: int, seed: int, acyclic: bool = False) -> nx.DiGraph:
    """Return `nodes` nodes with `edges` distinct random edges (each from the lower to the higher
    node when `acyclic`), plus `chain` more nodes waiting in a line, the last on node 0."""
    rng = random.Random(seed)
    rand = rng.random
    G = nx.DiGraph()
    G.add_nodes_from(range(nodes))
    missing = edges
    while missing > 0:  # duplicates and self-loops are dropped: top up until the count is exact
        pairs = ((int(rand() * nodes), int(rand() * nodes)) for _ in range(missing))
        if acyclic:
            G.add_edges_from((min(u, v), max(u, v)) for u, v in pairs if u != v)
        else:
            G.add_edges_from(pairs)
        missing = edges - G.number_of_edges()
    G.add_edges_from((i, i + 1) for i in range(nodes, nodes + chain - 1))
    if chain:
        G.add_edge(nodes + chain - 1, 0)
    return G


def compact(G: nx.DiGraph) -> CompactGraph:
    """`G` (nodes 0 … n-1) in compact form: successors in `G`'s order, in compressed rows."""
    n = G.number_of_nodes()
    edges = np.array(list(G.edges), dtype=np.int64).reshape(-1, 2)
    sources, targets = edges[:, 0], edges[:, 1]  # by source, each source's in G's order
    starts = np.concatenate([[0], np.cumsum(np.bincount(sources, minlength=n))])
    by_target = np.argsort(targets)
    ends = np.concatenate([[0], np.cumsum(np.bincount(targets, minlength=n))])
    return CompactGraph(
        memoryview(starts),
        memoryview(np.ascontiguousarray(targets)),
        memoryview(ends),
        memoryview(sources[by_target]),
        bytes(n),
    )


def repeated(func: Callable[[], object], repeat: int) -> tuple[list[float], object]:
    """Run `func` `repeat` times; return the wall-clock seconds of each run and the last result."""
    seconds = []
    result: object = None
    for _ in range(repeat):
        result = None  # the last run's result is freed before the next run
        elapsed, result = timed(func)
        seconds.append(elapsed)
    return seconds, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1_000_000)
    parser.add_argument("--edges", type=int, default=3_000_000)
    parser.add_argument("--chain", type=int, default=10_000, help="length of the extra wait chain")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--seed", type=int, default=418)
    args = parser.parse_args()

    console = Console()
    table = Table(title=f"deadlock vs networkx SCC, {args.nodes:,} + {args.chain:,} nodes, {args.edges:,} edges")
    for column in ("graph", "what", "best s", "median s", "result"):
        table.add_column(column, justify="left" if column in ("graph", "what") else "right")
    shapes = {}
    for shape in ("random", "acyclic"):
        shapes[shape] = measure(args, shape == "acyclic", table, shape)
    console.print(table)
    worst = max(shapes.values(), key=lambda measured: measured["ratio"])
    json_line(
        {
            "nodes": worst["nodes"],
            "edges": worst["edges"],
            "chain": args.chain,
            "seed": args.seed,
            "repeat": args.repeat,
            "deadlock_seconds": worst["deadlock_seconds"],
            "scc_seconds": worst["scc_seconds"],
            "ratio": worst["ratio"],
            "worst_graph": worst["graph"],
            "graphs": shapes,
        }
    )


def measure(args: argparse.Namespace, acyclic: bool, table: Table, shape: str) -> dict[str, object]:
    """Build one graph, time both algorithms on it, add its rows to `table`; return its figures."""
    # Millions of small dicts that live for the whole run: the cyclic collector would rescan them
    # over and over, while building (doubling its time) and in both timings. Freeze them instead.
    gc.disable()
    start = time.perf_counter()
    G = build_graph(args.nodes, args.edges, args.chain, args.seed, acyclic)
    build_seconds = time.perf_counter() - start
    gc.freeze()
    gc.enable()

    def deadlock() -> tuple[int, int]:
        dead = deadlocked_nodes(G)
        return len(dead), len(deadlock_cycle(G, dead)) if dead else 0

    def scc() -> int:
        return sum(1 for _ in nx.strongly_connected_components(G))

    C = compact(G)

    def compact_deadlock() -> tuple[int, int]:
        dead = compact_deadlocked(C)
        return dead.count(1), len(compact_cycle(C, dead))

    deadlock_runs, (dead_count, cycle_length) = repeated(deadlock, args.repeat)
    scc_runs, components = repeated(scc, args.repeat)
    compact_runs, compact_found = repeated(compact_deadlock, args.repeat)
    assert compact_found == (dead_count, cycle_length), "the compact form must find the same"
    deadlock_seconds, scc_seconds = min(deadlock_runs), min(scc_runs)
    ratio = deadlock_seconds / scc_seconds

    table.add_row(shape, "build graph", f"{build_seconds:.2f}", "", f"seed {args.seed}")
    table.add_row(
        "",
        "deadlock (nodes + cycle)",
        f"{deadlock_seconds:.3f}",
        f"{statistics.median(deadlock_runs):.3f}",
        f"{dead_count:,} deadlocked, {cycle_length}-cycle",
    )
    table.add_row(
        "",
        "networkx SCC",
        f"{scc_seconds:.3f}",
        f"{statistics.median(scc_runs):.3f}",
        f"{components:,} components",
    )
    table.add_row(
        "", "deadlock, compact form", f"{min(compact_runs):.3f}", f"{statistics.median(compact_runs):.3f}", ""
    )
    table.add_row("", "ratio (best)", f"{ratio:.3f}", "", "target <= 1.5", end_section=True)
    figures = {
        "graph": shape,
        "nodes": G.number_of_nodes(),
        "edges": G.number_of_edges(),
        "deadlocked": dead_count,
        "deadlock_seconds": round(deadlock_seconds, 4),
        "deadlock_median_seconds": round(statistics.median(deadlock_runs), 4),
        "scc_seconds": round(scc_seconds, 4),
        "scc_median_seconds": round(statistics.median(scc_runs), 4),
        "compact_seconds": round(min(compact_runs), 4),
        "ratio": round(ratio, 4),
    }
    gc.unfreeze()  # the graph dies with this frame; let the collector see it again
    return figures


if __name__ == "__main__":
    main()
