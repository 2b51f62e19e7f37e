"""`stablewatch demo`: real services in their own processes, three detectors, three outcomes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from stablewatch.cli.live_demo import write_graph
from stablewatch.detector.evaluation import evaluate
from stablewatch.v1 import GlobalSnapshot, LocalState, ProcessSnapshot, Wait, WaitNode

PNG_MAGIC = b"\x89PNG"


def test_demo_reports_the_deadlock_termination_and_conservation(tmp_path: Path) -> None:
    script = Path(sys.executable).with_name("stablewatch")
    out = tmp_path / "out"
    run = subprocess.run(
        [str(script), "demo", "--duration", "90", "--json", "--data-dir", str(tmp_path / "data"), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=360,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.strip().splitlines()
    # The addresses come first, whole, as soon as the detectors listen.
    ready = json.loads(lines[0])
    assert ready["event"] == "ready"
    assert set(ready["systems"]) == {"bank", "philosophers", "job", "shop"}
    assert all(s["address"].startswith("127.0.0.1:") for s in ready["systems"].values())
    report = json.loads(lines[-1])
    assert report["deadlock_detected"] is True
    assert sorted(report["deadlock_cycle"]) == ["P0", "P1", "P2", "P3", "P4"]
    # The shop's gRPC services (RPC mode) deadlock: reported with the cycle of calls, then stopped.
    assert report["shop_deadlock_detected"] is True
    calls = report["shop_deadlock_calls"]
    assert {c["service"] for c in calls} == {"orders", "payments", "inventory"}, calls
    methods = {c["method"] for c in calls}
    assert methods == {"/shop.Orders/Place", "/shop.Payments/Charge", "/shop.Inventory/Reserve", "/shop.Orders/Confirm"}
    assert all(c["call"].split(":")[0] in ("client", "orders", "payments", "inventory") for c in calls), calls
    assert report["shop_stopped"] is True
    shop = report["systems"]["shop"]["first_seen_seconds"]
    assert shop["deadlock"] < 20, shop
    assert report["termination_detected"] is True
    assert report["conservation_ok"] is True
    assert report["bank_totals"] == {"tokens": 3000}
    assert report["snapshots_completed"] >= 40
    assert Path(report["graph_dot"]).read_text().startswith("digraph")
    if shutil.which("dot"):
        assert Path(report["graph_png"]).read_bytes().startswith(PNG_MAGIC)
    else:
        assert report["graph_png"] is None
    # Every finished snapshot is archived, and the Spark history job ran on the philosophers' archive.
    assert set(report["archives"]) == {"bank", "philosophers", "job", "shop"}
    check = subprocess.run(
        [str(script), "archive", "check", "--archive", report["archives"]["bank"], "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert check.returncode == 0, check.stderr
    history = report["history"]
    assert history["archive"] == report["archives"]["philosophers"]
    assert history["evaluated"] >= 5
    assert history["deadlock_episodes"] == 1  # the philosophers deadlock once, for good
    assert Path(history["chart"]).read_bytes().startswith(PNG_MAGIC)
    assert all(Path(table).exists() for table in history["tables"])
    # Termination is reported only after the job's own predicate says every task is done.
    job = report["systems"]["job"]["first_seen_seconds"]
    assert job["all_tasks_done"] <= job["termination"]
    # Every service process is gone: the demo leaves nothing behind.
    left = subprocess.run(["pgrep", "-f", f"--peers-dir {tmp_path}"], capture_output=True, text=True)
    assert left.stdout == ""


def _deadlocked_graph():
    def waits_on(pid: str, target: str) -> ProcessSnapshot:
        return ProcessSnapshot(process_id=pid, state=LocalState(waits=[Wait(targets=[WaitNode(process=target)])]))

    return evaluate(GlobalSnapshot(snapshot_id=3, processes=[waits_on("A", "B"), waits_on("B", "A")])).wait_for


def test_the_graph_is_dot_text_without_graphviz(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no `dot` anywhere
    dot, png = write_graph(_deadlocked_graph(), tmp_path / "g.dot")
    assert dot.read_text().startswith("digraph")
    assert png is None and not (tmp_path / "g.png").exists()


@pytest.mark.skipif(shutil.which("dot") is None and not os.environ.get("CI"), reason="Graphviz is not installed")
def test_the_graph_is_also_a_png_with_graphviz(tmp_path: Path) -> None:
    assert shutil.which("dot"), "CI installs Graphviz (.ci/run): the PNG path must be tested there"
    dot, png = write_graph(_deadlocked_graph(), tmp_path / "g.dot")
    assert dot.read_text().startswith("digraph")
    assert png is not None and png.read_bytes().startswith(PNG_MAGIC)
