"""Benchmark: phantom deadlocks, stablewatch's consistent snapshots against a naive poller.

A deadlock-free workload with fast lock churn across processes: 16 agents over 4 host processes
(bench/agent_host.py) pass a mutex token round a ring in which consecutive agents live in different
processes. An agent waits on its predecessor until the token arrives, holds it for ``--hold``
seconds, passes it on and, in the same step, waits again. There is never a real deadlock: at every
moment either one agent holds the token (and waits on nothing) or the token is in flight towards
an agent whose wait it will end.

Two detectors watch the ring at the same time:

* **stablewatch**: the detector in this process takes scheduled snapshots (every ``--interval``
  seconds, a few at once). Each complete snapshot is a consistent cut; a deadlock it reports here
  is a phantom and a bug. Every cut is also checked independently: agents not waiting plus tokens
  recorded in flight must be exactly one (the token is conserved in a consistent cut), and the
  cuts where all agents wait while the token is in flight are counted: the in-flight rule is what
  keeps those from looking like a cycle.
* **naive**: polls each host's current waits (the ``waits`` command) one host after another, so
  each process is seen at a different moment, and looks for a cycle in the union of the waits
  (networkx ``find_cycle``). Every cycle it finds is a phantom by construction; the bench also
  proves it for each one: a deadlock is stable, so if the ring's token-pass count still grows
  after a poll round that completed after the one that found the cycle, no deadlock existed when
  it was seen.

Runs until stablewatch has ``--snapshots`` complete snapshots (at most ``--max-seconds``), then
prints a table and, as the last line, a JSON object (``snapshots``, ``stablewatch_phantoms``,
``naive_polls``, ``naive_phantoms``, ``aborted``, ``run_seconds``, ``passes_per_s``, ...).
Target: stablewatch 0 phantoms over >= 1000 snapshots while the naive poller reports some.

    python bench/phantom.py [--snapshots 1000] [--agents 16] [--interval 0.02] [--hold 0.001]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import dataclass, field

import networkx as nx
from cluster import Cluster, ring_links
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

from stablewatch.detector.evaluation import evaluate, wait_for_dot
from stablewatch.v1 import GlobalSnapshot

TOKEN = b"token"


@dataclass
class Stablewatch(Observed):
    """What the detector's snapshots showed, and where each cut found the token."""

    token_in_flight_all_waiting: int = 0  # cuts that only the in-flight rule keeps from a cycle
    token_held: int = 0
    bad_token_count: list[tuple[int, int]] = field(default_factory=list)  # (snapshot id, tokens)

    def check_token(self, snapshot: GlobalSnapshot, members: set[str]) -> None:
        """Agents of ``members`` not waiting plus tokens recorded in flight: exactly one in a consistent cut."""
        free = sum(1 for p in snapshot.processes if p.process_id in members and not p.state.waits)
        in_flight = sum(1 for c in snapshot.channels for m in c.messages if m.payload == TOKEN)
        if free + in_flight != 1:
            self.bad_token_count.append((snapshot.snapshot_id, free + in_flight))
        elif in_flight:
            self.token_in_flight_all_waiting += 1
        else:
            self.token_held += 1


@dataclass
class TokenRound(Round):
    """A poll round of the ring's hosts."""

    passes: int  # the sum of the hosts' token-pass counts, each as read in this round


async def poll_round(cluster: Cluster) -> TokenRound:
    """Every host's waits, asked one host after another; a cycle in their union (networkx) if any."""
    graph = nx.DiGraph()
    passes = 0
    started = time.monotonic()
    for host in cluster.hosts:
        reply = await host.ask("waits", "waits")
        passes += reply["passes"]
        graph.add_edges_from((waiter, target) for waiter, targets in reply["waits"].items() for target in targets)
    finished = time.monotonic()
    return TokenRound(started, finished, cycle_in(graph), passes)


def explain_snapshot(cluster: Cluster, snapshot_id: int, why: str) -> str:
    """Everything the detector knows about a snapshot that looks wrong: evidence, states, channels, graph."""
    detector = cluster.detector
    lines = [f"--- snapshot {snapshot_id}: {why} ---"]
    results = detector.store.results(snapshot_id)
    if results is not None:
        for result in results.results:
            if result.name == "deadlock":
                evidence = result.deadlock
                lines.append(f"summary: {result.summary}")
                lines.append("cycle: " + " -> ".join(n.process for n in evidence.cycle))
                lines.append("empty channels: " + ", ".join(f"{c.src}->{c.dst}" for c in evidence.empty_channels))
    snapshot = detector.store.snapshot(snapshot_id)
    if snapshot is None:
        lines.append("(the snapshot itself is no longer held)")
        return "\n".join(lines)
    for process in sorted(snapshot.processes, key=lambda p: p.process_id):
        waits = [t.process for w in process.state.waits for t in w.targets]
        lines.append(f"  {process.process_id}: waits on {waits or 'nothing'}")
    for channel in sorted(snapshot.channels, key=lambda c: (c.src, c.dst)):
        recorded = [m.payload.decode(errors="replace") for m in channel.messages]
        lines.append(
            f"  channel {channel.src}->{channel.dst}: n={channel.sent_before_marker} "
            f"m={channel.received_before_recording} in flight={recorded}"
        )
    lines.append(wait_for_dot(evaluate(snapshot).wait_for))
    return "\n".join(lines)


async def run(args: argparse.Namespace) -> dict[str, object]:
    seen = Stablewatch()
    rounds: list[TokenRound] = []
    async with Cluster.scheduled(args) as cluster:
        processes = len(cluster.hosts)
        # Agent i lives in process i % processes, so consecutive agents round the ring are in
        # different processes (unless agents % processes == 1, where the last and first share one).
        ring = list(cluster.ids)
        await cluster.connect(ring_links(ring))
        # Start the ring everywhere else first: the token must not reach a host that does not know
        # the ring yet (its agent could not pass it on, and the ring would really deadlock).
        first = cluster.host_of[ring[0]]
        for host in [*(h for h in cluster.hosts if h is not first), first]:
            await host.ask("ring", "ring", order=ring, hold=args.hold)
        started, started_ns = time.monotonic(), time.time_ns()
        members = set(ring)

        def check(snapshot: GlobalSnapshot) -> None:
            seen.check_token(snapshot, members)

        # Until enough snapshots, the time limit, or either observer failing. The poller's last
        # rounds are 20 ms apart: time for the token to move between the proving rounds.
        finished, ended = await watch_side_by_side(
            lambda done: watch_snapshots(cluster.detector, seen, done, args.snapshots, check, since_ns=started_ns),
            lambda stop: poll_rounds(lambda: poll_round(cluster), rounds, stop, extra=2, pause=0.02),
            args.max_seconds,
        )
        elapsed = ended - started
        for snapshot_id in seen.deadlocks[: args.explain]:
            print(explain_snapshot(cluster, snapshot_id, "stablewatch reported deadlock"), flush=True)
        for snapshot_id, tokens in seen.bad_token_count[: args.explain]:
            why = f"{tokens} tokens (agents not waiting + tokens in flight), not 1"
            print(explain_snapshot(cluster, snapshot_id, why), flush=True)
        quiet_teardown()
    measured, naive_phantoms = measured_rounds(rounds, started + elapsed)
    # A deadlock is stable. Round i+1 read every host after round i had finished; if the sum of the
    # pass counts grew after that (counts only grow), the token moved after round i: no deadlock then.
    proven = [i for i in naive_phantoms if i + 1 < len(rounds) and rounds[-1].passes > rounds[i + 1].passes]
    passes = measured[-1].passes if measured else 0
    return {
        "finished": finished,
        "processes": processes,
        "elapsed": elapsed,
        "seen": seen,
        "rounds": measured,
        "naive_phantoms": naive_phantoms,
        "naive_proven": proven,
        "passes": passes,
        "passes_moving_at_end": len(rounds) >= 2 and rounds[-1].passes > rounds[-2].passes,
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--snapshots", type=int, default=1000, help="complete stablewatch snapshots to take")
    parser.add_argument("--agents", type=int, default=16)
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--interval", type=float, default=0.02, help="seconds between scheduled snapshots")
    parser.add_argument("--max-concurrent", type=int, default=2, help="scheduled snapshots at once")
    parser.add_argument("--deadline", type=float, default=2.0, help="snapshot deadline, seconds")
    parser.add_argument("--hold", type=float, default=0.001, help="seconds an agent holds the token")
    parser.add_argument("--max-seconds", type=float, default=900, help="give up after this long")
    parser.add_argument("--explain", type=int, default=5, help="snapshots to print evidence for if any is wrong")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    if args.agents < 2 or args.processes < 2:
        parser.error("the ring needs at least 2 agents over at least 2 processes")

    outcome = await run(args)
    seen: Stablewatch = outcome["seen"]
    rounds: list[TokenRound] = outcome["rounds"]
    elapsed = outcome["elapsed"]
    phantoms = len(seen.deadlocks)
    naive_phantoms = len(outcome["naive_phantoms"])
    proven = len(outcome["naive_proven"])

    table = comparison_table(
        f"phantom deadlocks: token ring of {args.agents} agents over {outcome['processes']} processes, "
        f"hold {args.hold * 1000:g} ms, {outcome['passes'] / elapsed:.0f} token passes/s "
        f"({outcome['passes']} in {elapsed:.1f} s)",
        "phantom rate",
    )
    cuts = f"token in flight with all waiting in {seen.token_in_flight_all_waiting}, held in {seen.token_held}"
    table.add_row(*stablewatch_row(seen, args.interval, cuts))
    proofs = f"{proven} proven phantoms (the token moved on after)"
    table.add_row(*naive_row("naive (each host's waits in turn)", rounds, naive_phantoms, proofs))
    console = Console(width=200)
    console.print(table)
    wrong = [f"{len(seen.bad_token_count)} snapshots did not hold exactly one token"] if seen.bad_token_count else []
    print_problems(
        console,
        seen,
        wrong,
        finished=outcome["finished"],
        elapsed=elapsed,
        target=args.snapshots,
        moving=outcome["passes_moving_at_end"],
        not_moving="the token was not moving any more at the end",
    )
    print("target: stablewatch 0 phantoms over >= 1000 snapshots while the naive poller reports some")
    target_met = (
        outcome["finished"]
        and seen.completed >= 1000
        and phantoms == 0
        and naive_phantoms > 0
        and not seen.bad_token_count
        and outcome["passes_moving_at_end"]
    )
    json_line(
        {
            "agents": args.agents,
            "processes": outcome["processes"],
            "snapshots": seen.completed,
            "stablewatch_phantoms": phantoms,
            "stablewatch_phantom_ids": seen.deadlocks[:20],
            "aborted": seen.aborted,
            "snapshot_p50_ms": seen.p50_ms(),
            "cuts_token_in_flight_all_waiting": seen.token_in_flight_all_waiting,
            "cuts_token_held": seen.token_held,
            "cuts_token_count_wrong": len(seen.bad_token_count),
            "naive_polls": len(rounds),
            "naive_phantoms": naive_phantoms,
            "naive_phantoms_proven": proven,
            "naive_round_p50_ms": round_p50_ms(rounds),
            "passes": outcome["passes"],
            "passes_per_s": round(outcome["passes"] / elapsed, 1),
            "token_moving_at_end": outcome["passes_moving_at_end"],
            "run_seconds": round(elapsed, 2),
            "interval": args.interval,
            "hold": args.hold,
            "seed": args.seed,
            "finished": outcome["finished"],
            "target_met": target_met,
        }
    )
    if phantoms or seen.bad_token_count:
        sys.exit(1)


if __name__ == "__main__":
    asyncio.run(main())
