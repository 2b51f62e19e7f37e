"""`stablewatch demo`: real services in their own processes, four detectors, four outcomes (the
shop's deadlock broken, and orders completing after it); what the demo reads in the shop's books."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from stablewatch.cli.demo import shop_breaks_lines
from stablewatch.cli.live_demo import DemoReport, ShopBreaks, call_of, write_graph
from stablewatch.detector.evaluation import evaluate
from stablewatch.examples.shop import CHARGE, CONFIRM, PLACE, RESERVE, SERVICES
from stablewatch.v1 import GlobalSnapshot, LocalState, ProcessSnapshot, Wait, WaitNode
from stablewatch.v1.control_pb2 import BREAK_OUTCOME_BROKEN
from stablewatch.v1.query_pb2 import Resolution

PNG_MAGIC = b"\x89PNG"


def test_demo_reports_the_deadlocks_the_break_termination_and_conservation(tmp_path: Path) -> None:
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
    # The shop's gRPC services (RPC mode) deadlock: reported with the cycle of calls.
    assert report["shop_deadlock_detected"] is True
    calls = report["shop_deadlock_calls"]
    assert {c["service"] for c in calls} == {"orders", "payments", "inventory"}, calls
    methods = {c["method"] for c in calls}
    assert methods == {"/shop.Orders/Place", "/shop.Payments/Charge", "/shop.Inventory/Reserve", "/shop.Orders/Confirm"}
    assert all(c["call"].split(":")[0] in ("client", "orders", "payments", "inventory") for c in calls), calls
    assert report["shop_stopped"] is True  # at the end, on SIGTERM: none had to be killed
    shop = report["systems"]["shop"]["first_seen_seconds"]
    assert shop["deadlock"] < 20, shop
    # Its detector breaks it (youngest): one waiting call of the deadlock, in a service, gets ABORTED.
    assert report["shop_breaks"] >= 1
    assert report["shop_break_outcomes"]["broken"] == report["shop_breaks"]
    victim = report["shop_victim"]
    assert victim["process"] in SERVICES and victim["instance"] > 0, victim
    assert call_of(victim["process"], victim["task"]) in report["shop_break_component"], report
    aborted = report["shop_victim_aborted"]
    assert aborted["service"] in SERVICES, aborted
    proven = f"stablewatch broke this wait to end a deadlock proven by snapshot {report['shop_break_snapshot']}: "
    assert proven in aborted["details"], aborted
    # The ABORTED travels back up the call chain to the client's Place, which is placed again.
    assert report["shop_aborted_details"], report
    assert 0 < report["shop_recovery_ms"] < 60_000, report["shop_recovery_ms"]
    assert report["shop_break_report_ms"] >= 0
    assert report["shop_orders_at_break"] >= 0
    assert report["shop_orders_after_break"] > 0
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


# -- what the demo reads in the shop's books (no processes) -----------------------------------------

VICTIM_DETAILS = (
    "stablewatch broke this wait to end a deadlock proven by snapshot {}: inventory /shop.Inventory/Reserve#payments:1"
    " -> orders /shop.Orders/Confirm#inventory:1 -> ... (retry after a back-off)"
)


def _break(break_id: int, snapshot_id: int, broken: bool) -> Resolution:
    resolution = Resolution(
        resolution_id=break_id,
        snapshot_id=snapshot_id,
        process_id="orders",
        task="/shop.Orders/Confirm#inventory:1",
        instance=6,
        policy="youngest",
        component=[WaitNode(process="orders", task="/shop.Orders/Confirm#inventory:1")],
    )
    resolution.sent_at.FromMicroseconds(10_170_000)
    if broken:
        resolution.reported_at.FromMicroseconds(10_172_500)
        resolution.outcome = BREAK_OUTCOME_BROKEN
    return resolution


def _call(method: str, began: float, ended: float, code: str = "OK", details: str = "") -> dict[str, object]:
    return {"began": began, "ended": ended, "method": method, "code": code, "details": details}


def _books(client: list[dict[str, object]]) -> dict[str, dict[str, object]]:
    """The shop at the first break (wall-clock seconds): one chain of the deadlock unwinds from the
    victim's ABORTED (inventory's Confirm, at 10.18), a call of the other chain is still out."""
    chained = "a call it made ended in ABORTED"
    return {
        "orders": {
            "outstanding": [],
            "finished": [_call(CHARGE, 9.0, 9.5), _call(CHARGE, 10.00, 10.20, "ABORTED", f"{CHARGE}: {chained}")],
        },
        "payments": {
            # began after the ABORTED: not an edge of the deadlock it ended
            "outstanding": [{"method": RESERVE, "began": 10.05}, {"method": RESERVE, "began": 10.30}],
            "finished": [_call(RESERVE, 10.01, 10.19, "ABORTED", f"{RESERVE}: {chained}")],
        },
        "inventory": {
            "outstanding": [],
            "finished": [
                _call(CONFIRM, 9.80, 9.90, "ABORTED", VICTIM_DETAILS.format(5)),  # another break's victim
                _call(CONFIRM, 10.03, 10.18, "ABORTED", VICTIM_DETAILS.format(7)),
            ],
        },
        "client": {"outstanding": [], "finished": client},
    }


CLIENT_PLACES = [
    _call(PLACE, 9.0, 9.8),
    _call(PLACE, 9.9, 10.21, "ABORTED", f"{PLACE}: a call it made ended in ABORTED"),
    _call(PLACE, 9.95, 10.25),  # the other chain's order, released by the break
    _call(PLACE, 10.3, 10.4),
]


def test_the_first_break_is_explained_from_the_shop_books() -> None:
    breaks = ShopBreaks()
    breaks.read(_books(CLIENT_PLACES))  # no break yet: nothing to explain
    assert breaks.client_aborted is None and not breaks.wants_services
    breaks.seen(_break(1, 7, broken=False))  # sent
    breaks.seen(_break(2, 8, broken=False))
    assert breaks.first is None and breaks.outcomes() == {"pending": 2}
    breaks.seen(_break(1, 7, broken=True))  # answered
    assert breaks.first is not None and breaks.first.resolution_id == 1
    assert breaks.broken == 1 and breaks.outcomes() == {"broken": 1, "pending": 1}
    assert breaks.report_ms == 2.5
    assert breaks.wants_services

    breaks.read(_books(CLIENT_PLACES))
    assert not breaks.wants_services
    assert breaks.victim_aborted is not None and breaks.victim_aborted.role == "inventory"
    assert breaks.victim_aborted.ended == 10.18  # the one naming the break's snapshot, not the other break's
    assert breaks.last_block == 10.05  # the other chain's Reserve, still out; not the one begun after
    assert breaks.recovery_ms == 130.0
    assert breaks.client_aborted is not None and breaks.client_aborted.details.endswith("ended in ABORTED")
    assert (breaks.orders_at_break, breaks.orders_after) == (1, 2)


def test_the_orders_after_the_break_only_grow_as_the_books_forget() -> None:
    breaks = ShopBreaks()
    breaks.seen(_break(1, 7, broken=True))
    breaks.read({"client": {"finished": CLIENT_PLACES}})  # the client alone: the break's moment is not known yet
    assert breaks.client_aborted is not None and breaks.orders_at_break is None and breaks.orders_after == 0
    breaks.read(_books(CLIENT_PLACES))
    assert (breaks.orders_at_break, breaks.orders_after) == (1, 2)
    # Later, the client's books kept only their latest calls: the figures taken stay, the count grows.
    breaks.read({"client": {"finished": [_call(PLACE, 10.3, 10.4)]}})
    assert (breaks.orders_at_break, breaks.orders_after) == (1, 2)
    later = [_call(PLACE, 10.3, 10.4), *[_call(PLACE, 11.0, 11.0 + i / 10) for i in range(3)]]
    breaks.read({"client": {"finished": later}})
    assert breaks.orders_after == 4


def test_no_victim_found_without_an_aborted_naming_the_break() -> None:
    breaks = ShopBreaks()
    breaks.seen(_break(1, 99, broken=True))  # its ABORTED is not in these books (yet)
    breaks.read(_books(CLIENT_PLACES))
    assert breaks.wants_services and breaks.victim_aborted is None and breaks.recovery_ms is None


def _shop_report(**breaks: object) -> DemoReport:
    return DemoReport(
        snapshots_completed=41, deadlock_detected=True, deadlock_cycle=[], termination_detected=True,
        conservation_ok=True, seconds=7.0, bank_totals={}, graph_dot=None, graph_png=None, archives={},
        shop_deadlock_detected=True, shop_deadlock_calls=[], shop_stopped=True, out_dir="out", data_dir=None,
        systems={}, **breaks,  # type: ignore[arg-type]
    )  # fmt: skip


def test_the_summary_tells_how_the_shop_deadlock_was_broken() -> None:
    confirm = call_of("orders", "/shop.Orders/Confirm#inventory:1")
    report = _shop_report(
        shop_breaks=51,
        shop_break_outcomes={"broken": 51, "gone": 1},
        shop_break_snapshot=7,
        shop_victim={"process": "orders", "task": "/shop.Orders/Confirm#inventory:1", "instance": 6},
        shop_break_component=[confirm, *[call_of("payments", f"{CHARGE}#orders:{i}") for i in range(7)]],
        shop_victim_aborted={"service": "inventory", "method": CONFIRM, "details": VICTIM_DETAILS.format(7)},
        shop_aborted_details=f"{PLACE}: a call it made ended in ABORTED",
        shop_recovery_ms=46.6,
        shop_break_report_ms=4.7,
        shop_orders_at_break=0,
        shop_orders_after_break=26,
    )
    text = "\n".join(line.plain for line in shop_breaks_lines(report))
    assert "broken by its detector (--resolve youngest), as snapshot #7 proved it:" in text
    victim = "victim: orders /shop.Orders/Confirm#inventory:1 (wait 6)"
    assert f"{victim}, the youngest of the deadlock's 8 waiting calls;" in text
    assert "reported broken 4.7 ms after the break was sent" in text
    assert f"its caller, inventory, saw ABORTED: {VICTIM_DETAILS.format(7)}" in text
    assert f"the client's Place saw ABORTED: {PLACE}: a call it made ended in ABORTED" in text
    assert "from the last worker blocking to the ABORTED: 46.6 ms" in text
    assert "orders completed: 0 by the break, 26 more since" in text
    assert "52 breaks by the end (51 broken, 1 gone)" in text


def test_the_summary_says_when_no_shop_deadlock_was_broken() -> None:
    text = "\n".join(line.plain for line in shop_breaks_lines(_shop_report()))
    assert text == "  its detector (--resolve youngest) broke no deadlock in time"
