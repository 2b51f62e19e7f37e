"""Benchmark: phantom deadlocks among gRPC services, RPC mode's snapshots against a naive poller.

The shop of ``stablewatch.examples.shop`` under its ``churn`` workload: orders, payments and
inventory (each its own OS process, a plain gRPC server with a bounded pool, instrumented with an
RPC-mode agent) and a client keeping 3 orders going. The call graph has a cycle (``orders.Place ->
payments.Charge -> inventory.Reserve -> orders.Confirm``), Charges and Reserves queue for their
2-worker pools, but orders has a worker more than the client has orders out, so a Confirm always
gets one: the shop never deadlocks.

Two detectors watch it at the same time:

* **stablewatch**: the detector in this process takes scheduled snapshots (every ``--interval``
  seconds, at most ``--max-concurrent`` at once). Each complete snapshot is a consistent cut whose
  wait-for graph comes from the calls themselves (a caller's task waits on the callee's call, a
  queued request on the busy workers); a deadlock it reports here is a false alarm and a bug. For
  each cut the bench also counts the waits it holds (calls out, requests queued) and whether the
  cut's waits, seen process to process (the naive poller's granularity), form a cycle.
* **naive**: polls each process's books (``/shop.Admin/Status``: the calls it has out right now)
  one process after another, so each is seen at a different moment, draws an edge from a service to
  every service it has a call out to, and reports a deadlock when those edges form a cycle (networkx
  ``find_cycle``). Each of its reports is a phantom (the shop never deadlocks); the bench also proves
  it for each one: a deadlocked call never ends, so if, on some edge of the cycle, every call that
  made that edge has ended by the last poll round, that edge was no lasting wait and the cycle no
  deadlock.

Runs until stablewatch has ``--snapshots`` complete snapshots (at most ``--max-seconds``), then
prints a table and, as the last line, a JSON object: ``snapshots``, ``stablewatch_deadlocks``,
``naive_polls``, ``naive_deadlocks``, ``naive_deadlocks_proven``, ``aborted``, ``seconds``,
``places`` and ``places_per_s`` (orders completed: the shop kept moving), the cut counts, and
``target_met`` (stablewatch 0 deadlocks over >= 1000 snapshots while the naive poller reports some).

    python bench/rpc_phantom.py [--snapshots 1000] [--interval 0.05] [--max-concurrent 2]

At the default 20 snapshots a second, 1000 snapshots take about a minute (plus ~5 s of start-up),
on a quiet 2-core machine; a loaded machine completes fewer per second (``snapshots_per_s``).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import networkx as nx
from report import json_line, quiet_teardown
from rich.console import Console
from side_by_side import (
    Observed,
    Round,
    comparison_table,
    cycle_in,
    measured_rounds,
    naive_row,
    poll_rounds,
    print_problems,
    round_p50_ms,
    stablewatch_row,
    watch_side_by_side,
    watch_snapshots,
)

from stablewatch.detector.service.detector import Detector, DetectorConfig
from stablewatch.examples.shop import ROLES, WORKLOADS, read_status
from stablewatch.examples.shop_processes import ShopProcesses
from stablewatch.v1 import GlobalSnapshot, WaitModel


@dataclass
class Stablewatch(Observed):
    """What the detector's snapshots showed, and the waits each cut held."""

    with_calls: int = 0  # cuts with at least one call out
    with_queued: int = 0  # cuts with at least one request queued for a worker
    with_service_cycle: int = 0  # cuts whose waits, process to process, form a cycle

    def count_waits(self, snapshot: GlobalSnapshot) -> None:
        """Count the cut's calls out, requests queued, and whether its waits form a cycle process to process."""
        waits = [w for p in snapshot.processes for w in p.state.waits]
        self.with_calls += any(w.model != WaitModel.WAIT_MODEL_OR for w in waits)
        self.with_queued += any(w.model == WaitModel.WAIT_MODEL_OR for w in waits)
        self.with_service_cycle += service_cycle(snapshot)


@dataclass
class ShopRound(Round):
    """A poll round of the shop's processes."""

    placed: int
    outstanding: dict[str, set[int]]  # process -> ids of its calls out
    cycle_calls: list[tuple[str, set[int]]] | None  # per edge of the cycle: (caller, the calls behind it)


def service_cycle(snapshot: GlobalSnapshot) -> bool:
    """Whether the cut's waits, each drawn from the waiter's process to its target's, form a cycle."""
    graph = nx.DiGraph()
    for process in snapshot.processes:
        for wait in process.state.waits:
            graph.add_edges_from(
                (process.process_id, t.process) for t in wait.targets if t.process != process.process_id
            )
    return cycle_in(graph) is not None


async def poll_naively(admins: dict[str, str], rounds: list[ShopRound], stop: asyncio.Event, extra: int) -> None:
    """Read every process's books in turn until ``stop``, then ``extra`` more rounds (to prove phantoms)."""
    channels = {role: grpc.insecure_channel(address) for role, address in admins.items()}
    try:
        # The last rounds are 50 ms apart: time for the calls to end between the proving rounds.
        await poll_rounds(lambda: asyncio.to_thread(poll_round, channels), rounds, stop, extra, pause=0.05)
    finally:
        for channel in channels.values():
            channel.close()


def poll_round(channels: dict[str, grpc.Channel]) -> ShopRound:
    """One round: each process's calls out, asked one after another; a cycle among them if any."""
    graph = nx.DiGraph()
    outstanding: dict[str, set[int]] = {}
    placed = 0
    started = time.monotonic()
    for role in ROLES:
        status = read_status(channels[role])
        outstanding[role] = {call["id"] for call in status["outstanding"]}
        for call in status["outstanding"]:
            if graph.has_edge(role, call["to"]):
                graph.edges[role, call["to"]]["calls"].add(call["id"])
            else:
                graph.add_edge(role, call["to"], calls={call["id"]})
        if role == "client":
            placed = status["counts"].get("/shop.Orders/Place", 0)
    finished = time.monotonic()
    cycle = cycle_in(graph)
    calls = None if cycle is None else [(u, set(graph.edges[u, v]["calls"])) for u, v in cycle]
    return ShopRound(started, finished, cycle, placed, outstanding, calls)


def proven_phantom(found: ShopRound, last: ShopRound) -> bool:
    """Some edge of `found`'s cycle has none of its calls still out at `last`: no lasting wait, no deadlock."""
    assert found.cycle_calls is not None
    return any(not (calls & last.outstanding[caller]) for caller, calls in found.cycle_calls)


async def run(args: argparse.Namespace) -> dict[str, object]:
    seen = Stablewatch()
    rounds: list[ShopRound] = []
    with tempfile.TemporaryDirectory(prefix="stablewatch-rpc-phantom-") as folder:
        config = DetectorConfig(
            data_dir=Path(folder) / "data",
            listen="127.0.0.1:0",
            metrics_port=None,
            interval=args.interval,
            deadline=args.deadline,
            max_concurrent=args.max_concurrent,
            min_members=len(ROLES),  # no snapshot before the whole shop is attached
            expected_members=ROLES,
            max_snapshots=100_000,
            seed=args.seed,
        )
        detector = Detector(config)
        await detector.start()
        shop = ShopProcesses(Path(folder) / "shop", "churn", detector.address, ("--seed", str(args.seed)))
        try:
            await asyncio.to_thread(shop.start)
            admins = {role: shop.admin(role) for role in ROLES}
            started = time.monotonic()
            placed_before = (await asyncio.to_thread(read_status, admins["client"]))["counts"].get(
                "/shop.Orders/Place", 0
            )
            finished, ended = await watch_side_by_side(
                lambda done: watch_snapshots(detector, seen, done, args.snapshots, seen.count_waits),
                lambda stop: poll_naively(admins, rounds, stop, extra=3),
                args.max_seconds,
            )
            elapsed = ended - started
            shop.check_running()
        finally:
            quiet_teardown()  # snapshots in flight abort as the shop stops
            await asyncio.to_thread(shop.stop)
            await detector.stop()
    measured, naive_deadlocks = measured_rounds(rounds, started + elapsed)
    proven = [i for i in naive_deadlocks if proven_phantom(rounds[i], rounds[-1])]
    placed = (measured[-1].placed if measured else 0) - placed_before
    return {
        "finished": finished,
        "elapsed": elapsed,
        "seen": seen,
        "rounds": measured,
        "naive_deadlocks": naive_deadlocks,
        "naive_proven": proven,
        "placed": placed,
        "moving_at_end": len(rounds) >= 2 and rounds[-1].placed > rounds[-2].placed,
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--snapshots", type=int, default=1000, help="complete stablewatch snapshots to take (1000)")
    parser.add_argument("--interval", type=float, default=0.05, help="seconds between scheduled snapshots (0.05)")
    parser.add_argument("--max-concurrent", type=int, default=2, help="scheduled snapshots at once (2)")
    parser.add_argument("--deadline", type=float, default=2.0, help="snapshot deadline, seconds (2)")
    parser.add_argument("--max-seconds", type=float, default=900, help="give up after this long (900)")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()

    outcome = await run(args)
    seen: Stablewatch = outcome["seen"]
    rounds: list[ShopRound] = outcome["rounds"]
    elapsed = outcome["elapsed"]
    deadlocks = len(seen.deadlocks)
    naive_deadlocks = len(outcome["naive_deadlocks"])
    proven = len(outcome["naive_proven"])
    workload = WORKLOADS["churn"]

    table = comparison_table(
        f"phantom deadlocks among gRPC services: the shop's churn workload (pools {workload.workers}, "
        f"{workload.concurrency} orders at once), {outcome['placed'] / elapsed:.0f} orders/s "
        f"({outcome['placed']} in {elapsed:.1f} s)",
        "rate",
    )
    cuts = (
        f"cuts with calls out {seen.with_calls}, with requests queued {seen.with_queued}, "
        f"with a cycle process to process {seen.with_service_cycle}"
    )
    table.add_row(*stablewatch_row(seen, args.interval, cuts))
    proofs = f"{proven} proven phantoms (calls on the cycle ended after)"
    table.add_row(*naive_row("naive (each process's calls out in turn)", rounds, naive_deadlocks, proofs))
    console = Console(width=200)
    console.print(table)
    print_problems(
        console,
        seen,
        (),
        finished=outcome["finished"],
        elapsed=elapsed,
        target=args.snapshots,
        moving=outcome["moving_at_end"],
        not_moving="the shop was not completing orders any more at the end",
    )
    print("target: stablewatch 0 deadlocks over >= 1000 snapshots while the naive poller reports some")
    json_line(
        {
            "snapshots": seen.completed,
            "stablewatch_deadlocks": deadlocks,
            "stablewatch_deadlock_ids": seen.deadlocks[:20],
            "aborted": seen.aborted,
            "snapshot_p50_ms": seen.p50_ms(),
            "snapshots_per_s": round(seen.completed / elapsed, 2),
            "cuts_with_calls_out": seen.with_calls,
            "cuts_with_requests_queued": seen.with_queued,
            "cuts_with_process_cycle": seen.with_service_cycle,
            "naive_polls": len(rounds),
            "naive_deadlocks": naive_deadlocks,
            "naive_deadlocks_proven": proven,
            "naive_round_p50_ms": round_p50_ms(rounds),
            "places": outcome["placed"],
            "places_per_s": round(outcome["placed"] / elapsed, 1),
            "moving_at_end": outcome["moving_at_end"],
            "seconds": round(elapsed, 2),
            "interval": args.interval,
            "seed": args.seed,
            "finished": outcome["finished"],
            "target_met": bool(
                outcome["finished"]
                and seen.completed >= 1000
                and deadlocks == 0
                and naive_deadlocks > 0
                and outcome["moving_at_end"]
            ),
        }
    )
    if deadlocks:
        sys.exit(1)


if __name__ == "__main__":
    asyncio.run(main())
