"""`stablewatch demo`: real services in their own processes, three detectors, three outcomes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_demo_reports_the_deadlock_termination_and_conservation(tmp_path: Path) -> None:
    script = Path(sys.executable).with_name("stablewatch")
    run = subprocess.run(
        [str(script), "demo", "--duration", "90", "--json", "--data-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["deadlock_detected"] is True
    assert sorted(report["deadlock_cycle"]) == ["P0", "P1", "P2", "P3", "P4"]
    assert report["termination_detected"] is True
    assert report["conservation_ok"] is True
    assert report["bank_totals"] == {"tokens": 3000}
    assert report["snapshots_completed"] >= 40
    assert Path(report["graph_file"]).read_text().startswith("digraph")
    # Termination is reported only after the job's own predicate says every task is done.
    job = report["systems"]["job"]["first_seen_seconds"]
    assert job["all_tasks_done"] <= job["termination"]
    # Every service process is gone: the demo leaves nothing behind.
    left = subprocess.run(["pgrep", "-f", f"--peers-dir {tmp_path}"], capture_output=True, text=True)
    assert left.stdout == ""
