"""Benchmark: snapshot completion time against the broadcast round trip, with application traffic.

For 8, 32 and 64 agents (spread over a few OS processes, several agents each), on a ring and on a
random degree-4 topology, every agent sends 64-byte messages to its neighbours while the detector
(this process) alternates two measurements on the same members:

* a snapshot: StartSnapshot to every member, until the last part completes the global state;
* the broadcast round trip: a no-op Ping to every member over the same control streams, until
  every Pong is back: the least that any snapshot must do.

Prints a table and, as the last line, a JSON object for the 64-agent random case (``agents``,
``p50_ms``, ``p99_ms``, ``rtt_ms``, ``p50_over_rtt``, ``p99_over_rtt``) with every case under
``cases``. Targets: p50 <= 2 x rtt, p99 <= 5 x rtt.

    python bench/snapshot_latency.py [--samples 100] [--rate 50] [--sizes 8,32,64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from cluster import Cluster, percentile, random_links, ring_links
from rich.console import Console
from rich.table import Table


async def measure(agents: int, topology: str, args: argparse.Namespace) -> dict[str, object]:
    processes = 2 if agents <= 8 else 4
    async with Cluster(agents, processes) as cluster:
        links = ring_links(cluster.ids) if topology == "ring" else random_links(cluster.ids, 4, seed=agents)
        await cluster.connect(links)
        await cluster.all_hosts("traffic", "traffic", rate=args.rate)
        coordinator = cluster.detector.coordinator
        for _ in range(5):  # warm up channels and caches
            await coordinator.snapshot(10)
            await coordinator.ping_all(10)
        snapshots: list[float] = []
        rtts: list[float] = []
        for _ in range(args.samples):
            rtts.append(await coordinator.ping_all(10))
            start = time.perf_counter()
            await coordinator.snapshot(10)
            snapshots.append(time.perf_counter() - start)
        await cluster.all_hosts("quiet", "quiet")
    p50, p99, rtt = statistics.median(snapshots), percentile(snapshots, 0.99), statistics.median(rtts)
    return {
        "agents": agents,
        "processes": processes,
        "topology": topology,
        "samples": args.samples,
        "rate_per_agent": args.rate,
        "p50_ms": round(p50 * 1000, 3),
        "p99_ms": round(p99 * 1000, 3),
        "rtt_ms": round(rtt * 1000, 3),
        "rtt_p99_ms": round(percentile(rtts, 0.99) * 1000, 3),
        "p50_over_rtt": round(p50 / rtt, 3),
        "p99_over_rtt": round(p99 / rtt, 3),
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=100)
    parser.add_argument("--rate", type=float, default=50, help="messages per second per agent")
    parser.add_argument("--sizes", default="8,32,64")
    args = parser.parse_args()
    cases = []
    for agents in (int(size) for size in args.sizes.split(",")):
        for topology in ("ring", "random"):
            cases.append(await measure(agents, topology, args))

    table = Table(title=f"snapshot completion vs broadcast round trip ({args.rate:g} msgs/s per agent)")
    for column in ("agents", "processes", "topology", "p50 ms", "p99 ms", "rtt ms", "p50/rtt", "p99/rtt"):
        table.add_column(column, justify="right")
    for case in cases:
        table.add_row(
            *(str(case[key]) for key in ("agents", "processes", "topology", "p50_ms", "p99_ms", "rtt_ms")),
            str(case["p50_over_rtt"]),
            str(case["p99_over_rtt"]),
        )
    Console().print(table)
    print("targets: p50/rtt <= 2, p99/rtt <= 5")
    headline = next(c for c in reversed(cases) if c["topology"] == "random")
    print(json.dumps({**headline, "cases": cases}), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
