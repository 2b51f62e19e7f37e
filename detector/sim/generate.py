"""Random token-bank traces in the COS 418 formats, for conformance cases the project ships itself.

:func:`random_trace` draws a topology (a ring, so every marker reaches every process, plus random
links) and a script of sends, snapshots and ticks from one seed. Every send is covered by what
its sender still holds of its initial balance, so the script is valid whatever the delays.
``tests/conformance/generate.py`` writes such cases with the snapshots that an independent
reference replay records (not the simulator: the cases check it).
"""

from __future__ import annotations

import random

from stablewatch.detector.sim.cos418 import Send, SnapshotEvent, Tick, Topology, TraceEvent

__all__ = ["random_trace"]


def random_trace(
    seed: int, processes: int = 4, events: int = 40, snapshots: int = 2
) -> tuple[Topology, list[TraceEvent]]:
    """A topology of `processes` nodes and a script of about `events` events with `snapshots` snapshots."""
    if processes < 2 or events < snapshots or snapshots < 1:
        raise ValueError("need at least 2 processes and at least one snapshot among the events")
    rng = random.Random(seed)
    ids = [f"N{i + 1}" for i in range(processes)]
    balances = {pid: rng.randint(3, 20) for pid in ids}
    links: dict[str, set[str]] = {pid: {ids[(i + 1) % processes]} for i, pid in enumerate(ids)}
    for src in ids:
        for dst in ids:
            if src != dst and rng.random() < 0.4:
                links[src].add(dst)
    topology = Topology(balances, {src: sorted(dsts) for src, dsts in links.items()})
    spendable = dict(balances)  # what each sender surely holds: its balance minus what it sent
    script: list[TraceEvent] = []
    snapshot_at = sorted(rng.sample(range(events), snapshots))
    for index in range(events):
        line = len(script) + 1
        if index in snapshot_at:
            script.append(SnapshotEvent(rng.choice(ids), line))
        elif rng.random() < 0.3:
            script.append(Tick(rng.randint(1, 3), line))
        else:
            src = rng.choice([pid for pid in ids if spendable[pid]] or ids)
            if not spendable[src]:
                script.append(Tick(1, line))
                continue
            tokens = rng.randint(1, min(3, spendable[src]))
            spendable[src] -= tokens
            script.append(Send(src, rng.choice(topology.links[src]), tokens, line))
    return topology, script
