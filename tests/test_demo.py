"""`stablewatch demo`: real services in their own processes, four detectors, four outcomes (the
shop's deadlock broken, and orders completing after it), each system's history told by Spark;
what the demo reads in the shop's books; a quiet output."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import IO

import grpc
import pytest
from rich.console import Console

from polling import poll
from stablewatch.cli.demo import bank_line, history_arguments, shop_breaks_lines, verbose_logging, where_text
from stablewatch.cli.live_demo import (
    DemoReport,
    ShopBreaks,
    _read_books_last,
    _report,
    _System,
    call_of,
    write_graph,
)
from stablewatch.detector.assembly import PartRejected
from stablewatch.detector.evaluation import Verdict, evaluate
from stablewatch.detector.service.detector import Detector, DetectorConfig
from stablewatch.detector.service.query import outcome_name
from stablewatch.examples.shop import CHARGE, CONFIRM, PLACE, RESERVE, SERVICES
from stablewatch.v1 import GlobalSnapshot, LocalState, PredicateResult, ProcessSnapshot, Wait, WaitNode
from stablewatch.v1.control_pb2 import BREAK_OUTCOME_BROKEN
from stablewatch.v1.query_pb2 import Resolution, SnapshotResults

PNG_MAGIC = b"\x89PNG"
#: What a new user must not have to ignore in the demo's output: gRPC's note when Spark's JVM is
#: forked, Java's warning of the incubating vector module Spark 4 adds, a detector's routine
#: rejection of a late snapshot part.
NOISE = ("fork_posix.cc", "skipping fork() handlers", "Using incubator modules", "rejected a snapshot part")


class Output:
    """A child's output read as it comes, line by line (stdout) and whole (stderr), by two threads."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        assert process.stdout is not None and process.stderr is not None
        self.lines: list[str] = []
        self.errors: list[str] = []
        self._threads = [
            threading.Thread(target=self._read, args=(process.stdout, self.lines), daemon=True),
            threading.Thread(target=self._read, args=(process.stderr, self.errors), daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    @staticmethod
    def _read(stream: IO[str], into: list[str]) -> None:
        for line in stream:
            into.append(line)

    def event(self, name: str) -> dict[str, object] | None:
        """The first JSON line of event `name` printed so far."""
        for line in list(self.lines):
            if line.startswith("{") and json.loads(line).get("event") == name:
                return json.loads(line)
        return None

    def join(self) -> None:
        for thread in self._threads:
            thread.join(timeout=30)


def _get(url: str) -> int:
    with urllib.request.urlopen(url, timeout=10) as response:
        response.read()
        return response.status


def test_demo_reports_the_deadlocks_the_break_termination_and_conservation(tmp_path: Path) -> None:
    script = Path(sys.executable).with_name("stablewatch")
    out = tmp_path / "out"
    command = [str(script), "demo", "--duration", "90", "--json", "--stay"]
    command += ["--data-dir", str(tmp_path / "data"), "--out", str(out)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    output = Output(process)
    try:
        # The addresses come first, whole, as soon as the detectors listen: each web page first.
        ready = poll(lambda: output.event("ready"), "the detectors' addresses", timeout=60, interval=0.1)
        assert output.lines[0].startswith('{"event": "ready"')
        systems = ready["systems"]
        assert isinstance(systems, dict) and list(systems) == ["bank", "philosophers", "job", "shop"]
        assert all(s["address"].startswith("127.0.0.1:") for s in systems.values())
        # --stay: once the demo is over, everything stays up, the web pages too, until Ctrl-C.
        poll(lambda: output.event("staying"), "the demo to be over and stay up", timeout=120, interval=0.1)
        for where in systems.values():
            assert where["web"].startswith("http://127.0.0.1:"), where
            assert _get(where["web"]) == 200
            assert _get(where["metrics"]) == 200
        assert process.poll() is None
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=360) == 0, "".join(output.errors)[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
        output.join()
    # Quiet: none of the libraries' noise (nor the detectors' routine lines) on the demo's output.
    errors = "".join(output.errors)
    for noise in NOISE:
        assert noise not in errors and noise not in "".join(output.lines), errors[-3000:]
    lines = [line.strip() for line in output.lines]
    report = json.loads(lines[-1])
    assert report["deadlock_detected"] is True
    assert sorted(report["deadlock_cycle"]) == ["P0", "P1", "P2", "P3", "P4"]
    # The shop's gRPC services (RPC mode) deadlock: reported with the cycle of calls.
    assert report["shop_deadlock_detected"] is True
    calls = report["shop_deadlock_calls"]
    assert {c["service"] for c in calls} == {"orders", "payments", "inventory"}, calls
    methods = {c["method"] for c in calls}
    assert methods == {"/shop.Orders/Place", "/shop.Payments/Charge", "/shop.Inventory/Reserve", "/shop.Orders/Confirm"}
    # Each call: its caller's process and incarnation (in hex), and the caller's call number.
    caller_call = re.compile(r"(client|orders|payments|inventory)@[0-9a-f]+:[0-9]+")
    assert all(caller_call.fullmatch(c["call"]) for c in calls), calls
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
    # Every finished snapshot is archived, and the Spark history job ran on every system's archive.
    assert set(report["archives"]) == {"bank", "philosophers", "job", "shop"}
    check = subprocess.run(
        [str(script), "archive", "check", "--archive", report["archives"]["bank"], "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert check.returncode == 0, check.stderr
    history = report["history"]
    assert history["command"].startswith(f"stablewatch pipeline history --archive bank={out}/archive/bank ")
    told = history["systems"]
    assert list(told) == ["bank", "philosophers", "job", "shop"]  # the chart's lanes, top to bottom
    assert all(told[name]["archive"] == report["archives"][name] for name in told)
    states = {name: [phase["state"] for phase in system["phases"]] for name, system in told.items()}
    # Each system's story, from its first snapshot: the bank's tokens conserved throughout...
    assert states["bank"] == ["running"], told["bank"]["sentence"]
    assert "tokens = 3000 conserved in all" in told["bank"]["sentence"]
    # ...the philosophers eating (seen eating in several snapshots), then deadlocked for good...
    assert states["philosophers"] == ["running", "deadlocked"], told["philosophers"]["sentence"]
    assert told["philosophers"]["phases"][0]["snapshots"] >= 5
    assert re.search(r"\(meals \d+ → \d+\)", told["philosophers"]["sentence"])
    assert told["philosophers"]["deadlock_episodes"] == 1
    # ...the job running, then terminated...
    assert states["job"] == ["running", "terminated"], told["job"]["sentence"]
    assert re.search(r"\(done \d+ → 156\)", told["job"]["sentence"])  # every task of the job
    # ...and the shop deadlocked, broken, going on and deadlocking anew.
    assert states["shop"].count("deadlocked") >= 2 and "running" in states["shop"][1:], told["shop"]["sentence"]
    assert told["shop"]["deadlocks_broken"] >= 1
    assert Path(history["chart"]) == out / "pipeline" / "history.png"
    assert Path(history["chart"]).read_bytes().startswith(PNG_MAGIC)
    assert all(Path(table).exists() for system in told.values() for table in system["tables"])
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


class _StoreAnswering:
    """A detector's store whose breaks are answered (and one more sent) after ``looks`` looks."""

    def __init__(self, looks: int) -> None:
        self.looks = looks

    def resolutions(self, page_size: int) -> list[Resolution]:
        self.looks -= 1
        if self.looks >= 0:
            return [_break(2, 8, broken=False), _break(1, 7, broken=True)]  # newest first
        return [_break(3, 9, broken=False), _break(2, 8, broken=True), _break(1, 7, broken=True)]


class _ShopAway:
    def status(self, role: str) -> dict[str, object]:
        raise grpc.RpcError  # the books cannot be read: the breaks are counted all the same


def test_the_summary_waits_for_the_report_of_a_break_sent_just_before_the_end() -> None:
    """A break sent just before the end is answered some milliseconds later: the summary waits for
    that (up to REPORT_WAIT seconds) and does not count it pending, nor one sent after the end."""
    store = _StoreAnswering(looks=3)
    system = SimpleNamespace(shop=_ShopAway(), breaks=ShopBreaks(), detector=SimpleNamespace(store=store))
    asyncio.run(asyncio.wait_for(_read_books_last(system), 10))  # type: ignore[arg-type]
    assert store.looks < 0  # it looked again until the report came
    assert system.breaks.outcomes() == {"broken": 2}
    assert system.breaks.first is not None and system.breaks.first.resolution_id == 1


def test_a_break_sent_after_the_end_is_forgotten_with_what_it_explained() -> None:
    breaks = ShopBreaks()
    breaks.seen(_break(5, 7, broken=False))
    breaks.seen(_break(6, 8, broken=True))  # answered first, though sent after the end
    breaks.read(_books(CLIENT_PLACES))
    breaks.seen(_break(5, 7, broken=True))
    assert breaks.first is not None and breaks.first.resolution_id == 6
    assert breaks.client_aborted is not None
    breaks.keep({5})
    assert breaks.outcomes() == {"broken": 1}
    assert breaks.first is not None and breaks.first.resolution_id == 5
    assert breaks.client_aborted is None  # explained again, for break 5, at the next read
    breaks.seen(_break(5, 7, broken=False))  # the watch's late news of its sending
    assert breaks.outcomes() == {"broken": 1}


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


# -- the demo's output ------------------------------------------------------------------------------


def test_the_web_pages_come_first() -> None:
    def at(port: int, web: bool = True) -> dict[str, str | None]:
        return {
            "web": f"http://127.0.0.1:{port}/" if web else None,
            "address": f"127.0.0.1:{port + 1}",
            "metrics": f"http://127.0.0.1:{port}/metrics",
        }

    console = Console(record=True, width=100)
    console.print(where_text({"bank": at(8000), "philosophers": at(8010)}))
    lines = console.export_text().splitlines()
    assert lines[:3] == [
        "The detectors' web pages, live:",
        "  bank          http://127.0.0.1:8000/",
        "  philosophers  http://127.0.0.1:8010/",
    ]
    assert "  philosophers  127.0.0.1:8011  http://127.0.0.1:8010/metrics" in lines
    console = Console(record=True, width=100)
    console.print(where_text({"bank": at(8000, web=False)}))  # a detector that serves no page
    assert console.export_text().splitlines()[0] == "gRPC APIs and /metrics:"


def test_the_history_covers_every_system_with_its_work() -> None:
    archives = {name: f"out/archive/{name}" for name in ("bank", "philosophers", "job", "shop")}
    assert history_arguments(archives, Path("out/pipeline")) == [
        "history",
        *("--archive", "bank=out/archive/bank", "--archive", "philosophers=out/archive/philosophers"),
        *("--archive", "job=out/archive/job", "--archive", "shop=out/archive/shop"),
        *("--progress", "philosophers=meals", "--progress", "job=done", "--progress", "shop=orders"),
        *("--out", "out/pipeline"),
    ]


def test_late_parts_are_logged_only_with_verbose(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A detector's rejection of a late part is counted in its metrics; the demo shows it with --verbose only."""
    detector = Detector(DetectorConfig(data_dir=tmp_path / "data"))
    late = PartRejected("late", "snapshot 7 already finished")
    detector._rejected(late)  # what the demo's detectors do with one, without --verbose
    assert capsys.readouterr().err == ""
    console = Console(record=True, width=200)
    handler = verbose_logging(console)
    try:
        detector._rejected(late)
    finally:
        logger = logging.getLogger("stablewatch")
        logger.removeHandler(handler)
        logger.setLevel(logging.NOTSET)
    assert "rejected a snapshot part: late: snapshot 7 already finished" in console.export_text()
    counted = detector.metrics.registry.get_sample_value("stablewatch_rejected_parts_total", {"reason": "late"})
    assert counted == 2


def _bank_snapshot(snapshot_id: int, verdict: Verdict, observed: int) -> SnapshotResults:
    """A completed bank snapshot whose conservation(tokens) is `verdict`, summing `observed` tokens."""
    results = SnapshotResults()
    results.snapshot.snapshot_id = snapshot_id
    results.snapshot.outcome = next(v for v in range(10) if outcome_name(v) == "completed")
    result = PredicateResult(name="conservation(tokens)", holds=verdict is Verdict.TRUE)
    result.unknown = verdict is Verdict.UNKNOWN
    result.conservation.counter = "tokens"
    result.conservation.observed = observed
    results.results.append(result)
    return results


def _bank_report(tmp_path: Path, verdicts: list[tuple[Verdict, int]]) -> DemoReport:
    """The demo's report when the bank's snapshots had these conservation verdicts (and totals)."""
    detector = SimpleNamespace(
        store=SimpleNamespace(predicate_history=lambda *a, **k: []), config=SimpleNamespace(archive=tmp_path)
    )
    systems = [_System(name, name, [], [], detector) for name in ("bank", "philosophers", "job", "shop")]  # type: ignore[arg-type]
    for snapshot_id, (verdict, observed) in enumerate(verdicts):
        systems[0].observe(_bank_snapshot(snapshot_id, verdict, observed), 1.0)
    return _report(systems, 1.0, tmp_path, None)


def test_unknown_conservation_is_not_counted_as_conserved(tmp_path: Path) -> None:
    """An open cut (a branch missing) proves nothing: 20 unknown snapshots are not "conserved in
    every snapshot", and their partial sum is no total of the bank's."""
    report = _bank_report(tmp_path, [(Verdict.UNKNOWN, 2000)] * 20)
    assert (report.conservation_ok, report.bank_totals) == (False, {})
    assert (report.bank_conserved, report.bank_conservation_unknown) == (0, 20)
    line = bank_line(report)
    assert line.plain == "bank totals: none (conservation never proved: unknown in 20 snapshots, an open cut)"
    assert str(line.style) == "yellow"


def test_the_bank_totals_come_from_a_snapshot_that_proved_conservation(tmp_path: Path) -> None:
    """Proved in some snapshots, unknown in others: conserved (the demo's promise is shown), the
    totals those of the latest proof, and the unknown ones told apart with their number."""
    verdicts = [(Verdict.TRUE, 3000), (Verdict.UNKNOWN, 2000), (Verdict.TRUE, 3000), (Verdict.UNKNOWN, 1000)]
    report = _bank_report(tmp_path, verdicts)
    assert (report.conservation_ok, report.bank_totals) == (True, {"tokens": 3000})
    assert (report.bank_conserved, report.bank_conservation_unknown) == (2, 2)
    line = bank_line(report)
    assert line.plain == "bank totals: tokens = 3000 (conserved in 2 snapshots; unknown in 2, an open cut)"
    everywhere = _bank_report(tmp_path, [(Verdict.TRUE, 3000)] * 3)
    assert bank_line(everywhere).plain == "bank totals: tokens = 3000 (conserved in every snapshot)"


def test_a_false_conservation_is_not_conserved(tmp_path: Path) -> None:
    report = _bank_report(tmp_path, [(Verdict.TRUE, 3000), (Verdict.FALSE, 2999), (Verdict.TRUE, 3000)])
    assert report.conservation_ok is False and report.bank_conservation_broken
    assert bank_line(report).plain == "bank totals: tokens = 3000 (NOT conserved)"
