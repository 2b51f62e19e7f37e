"""Write the conformance cases the project ships: ``python tests/conformance/generate.py``.

Each case is a random token-bank trace (``detector/sim/generate.py``) in the COS 418 formats: a
topology ``<case>.top``, a script ``<case>.events``, a delay tape ``<case>.delays``, and the
snapshots that the independent reference replay (``reference.py``, the COS 418 rules with plain
dicts, not the simulator) records, ``<case><id>.snap``. They were generated once and committed;
``tests/test_conformance.py`` replays them through the simulator on every run, beside the COS 418
traces when those are present. Regenerate only on purpose: the files are the expected output.
"""

from __future__ import annotations

import random
from pathlib import Path

from reference import replay

from stablewatch.detector.sim.cos418 import Send, format_events, format_topology
from stablewatch.detector.sim.generate import random_trace

HERE = Path(__file__).resolve().parent

#: name -> (seed, processes, events, snapshots); the last three run up to 29, 64 and 64 snapshots at once
CASES = {
    "3nodes-random": (1, 3, 30, 2),
    "4nodes-random": (2, 4, 50, 3),
    "6nodes-random": (3, 6, 80, 4),
    "8nodes-concurrent": (4, 8, 120, 6),
    "11nodes-29snapshots": (4, 11, 200, 29),
    "5nodes-64snapshots": (1, 5, 100, 64),
    "12nodes-64snapshots": (1, 12, 200, 64),
}


def write(name: str, seed: int, processes: int, events: int, snapshots: int) -> int:
    """Write case ``name``; returns the most snapshots it runs at once."""
    topology, script = random_trace(seed, processes, events, snapshots)
    # One delay per token send and one per link for every snapshot's markers: never short.
    needed = sum(isinstance(event, Send) for event in script) + snapshots * sum(map(len, topology.links.values()))
    rng = random.Random(seed * 7919)
    delays = [rng.randrange(5) for _ in range(max(10 * events + 100 * processes, needed))]
    (HERE / f"{name}.top").write_text(format_topology(topology))
    (HERE / f"{name}.events").write_text(format_events(script))
    (HERE / f"{name}.delays").write_text("".join(f"{d}\n" for d in delays))
    for old in HERE.glob(f"{name}*.snap"):
        old.unlink()
    result = replay(HERE / f"{name}.top", HERE / f"{name}.events", HERE / f"{name}.delays")
    for snapshot_id, snap in result.snaps.items():
        (HERE / f"{name}{snapshot_id}.snap").write_text(snap.text())
    return result.most_running


if __name__ == "__main__":
    for case, spec in CASES.items():
        print(f"wrote {case}: {spec[3]} snapshots, up to {write(case, *spec)} at once")
