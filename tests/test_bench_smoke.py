"""The benchmarks run end to end at a tiny size and end with their JSON line (no timing asserted)."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT


def test_predicate_benchmark_prints_its_json_line() -> None:
    sizes = ["--nodes", "2000", "--edges", "6000", "--chain", "100", "--repeat", "1"]
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "predicates.py"), *sizes],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert {"nodes", "edges", "deadlock_seconds", "scc_seconds", "ratio"} <= result.keys()
    assert result["nodes"] == 2100
    assert result["edges"] == 6100
    assert result["ratio"] > 0
    assert result["graphs"]["acyclic"]["deadlocked"] == 0
    assert result["graphs"]["random"]["deadlocked"] > 0
