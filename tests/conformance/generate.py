"""Write the conformance cases the project ships: ``python tests/conformance/generate.py``.

Each case is a random token-bank trace (``detector/sim/generate.py``) in the COS 418 formats: a
topology ``<case>.top``, a script ``<case>.events``, a delay tape ``<case>.delays``, and the
snapshots the simulator records, ``<case><id>.snap``. They were generated once and committed;
``tests/test_conformance.py`` replays them on every run, beside the COS 418 traces when those are
present. Regenerate only on purpose: the files are the expected output.
"""

from __future__ import annotations

import random
from pathlib import Path

from stablewatch.detector.sim.cos418 import format_events, format_snap, format_topology, snap_from_snapshot
from stablewatch.detector.sim.generate import random_trace
from stablewatch.detector.sim.simulator import Simulation, tape_delays

HERE = Path(__file__).resolve().parent

#: name -> (seed, processes, events, snapshots)
CASES = {
    "3nodes-random": (1, 3, 30, 2),
    "4nodes-random": (2, 4, 50, 3),
    "6nodes-random": (3, 6, 80, 4),
    "8nodes-concurrent": (4, 8, 120, 6),
}


def write(name: str, seed: int, processes: int, events: int, snapshots: int) -> None:
    topology, script = random_trace(seed, processes, events, snapshots)
    rng = random.Random(seed * 7919)
    delays = [rng.randrange(5) for _ in range(10 * events + 100 * processes)]
    (HERE / f"{name}.top").write_text(format_topology(topology))
    (HERE / f"{name}.events").write_text(format_events(script))
    (HERE / f"{name}.delays").write_text("".join(f"{d}\n" for d in delays))
    for old in HERE.glob(f"{name}*.snap"):
        old.unlink()
    for snapshot in Simulation(topology, tape_delays(delays)).run(script):
        snap = snap_from_snapshot(snapshot)
        (HERE / f"{name}{snap.snapshot_id}.snap").write_text(format_snap(snap))


if __name__ == "__main__":
    for case, spec in CASES.items():
        write(case, *spec)
        print(f"wrote {case}")
