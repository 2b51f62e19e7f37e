"""The ``stablewatch`` commands as a user runs them: a detector process, agent processes, the CLI.

``stablewatch detector --json`` runs as a subprocess (its first stdout line gives the ports), two
token-bank services (stablewatch.testing.token_node) attach to it, and ``status``, ``snapshot``, ``watch``
and ``graph`` run as subprocesses against it. Flag checking runs in-process (argparse exits 2).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import signal
import socket
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from command_line import STABLEWATCH, DetectorProcess, LineReader, stablewatch
from rich.console import Console

from conftest import free_port
from polling import poll
from stablewatch.cli.client import DetectorClient
from stablewatch.cli.main import main
from stablewatch.cli.render import WatchView
from stablewatch.detector.evaluation import evaluate, wait_for_dot
from stablewatch.testing.token_nodes import Node, connect_all, wait_quiet
from stablewatch.v1 import (
    WAIT_MODEL_OR,
    ChannelSnapshot,
    GlobalSnapshot,
    LocalState,
    PredicateResult,
    ProcessSnapshot,
    RecordedMessage,
    Wait,
    WaitNode,
)
from stablewatch.v1.query_pb2 import (
    SNAPSHOT_OUTCOME_COMPLETED,
    PredicateChange,
    SnapshotResults,
    SnapshotSummary,
    WatchEvent,
)

pytestmark = pytest.mark.timeout(60)

TOKENS = 100
METRICS = (
    "stablewatch_predicate_value",
    "stablewatch_deadlocked_nodes",
    "stablewatch_deadlock_cycles",
    "stablewatch_snapshots_total",
    "stablewatch_snapshot_aborts_total",
    "stablewatch_snapshot_duration_seconds_bucket",
    "stablewatch_last_completed_snapshot_timestamp_seconds",
    "stablewatch_last_completed_snapshot_id",
    "stablewatch_in_flight_messages",
    "stablewatch_recorded_bytes",
    "stablewatch_counter_total",
    "stablewatch_conservation_drift",
    "stablewatch_agents_attached",
    "stablewatch_rejected_parts_total",
    "stablewatch_deadlocks_resolved_total",
    "stablewatch_resolution_seconds_bucket",
    "stablewatch_breaks_sent_total",
    "stablewatch_wait_hints_total",
)


def one_json(result: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    """The command's only stdout line, as JSON."""
    lines = result.stdout.splitlines()
    assert len(lines) == 1, (result.stdout, result.stderr)
    return json.loads(lines[0])


def quiet(results: SnapshotResults) -> bool:
    """Whether these are results of both agents, both channels, and nothing in flight."""
    summary = results.snapshot
    return (summary.processes, summary.channels, summary.messages_in_flight) == (2, 2, 0)


class System:
    def __init__(self, detector: DetectorProcess, nodes: list[Node]) -> None:
        self.detector = detector
        self.nodes = nodes
        self.address = detector.address


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[System]:
    data_dir = tmp_path_factory.mktemp("cli") / "data"
    detector = DetectorProcess(data_dir, "--interval", "0.2", "--expect", f"tokens={2 * TOKENS}")
    nodes: list[Node] = []
    try:
        for process_id in ("A", "B"):
            nodes.append(Node(process_id, "--tokens", str(TOKENS), "--detector", detector.address))
        connect_all(nodes)
        for seed, node in enumerate(nodes):
            node.command("transfer", count=20, seed=seed)
        for node in nodes:
            node.expect("transferred")
        wait_quiet(nodes)
        with DetectorClient(detector.address) as client:
            poll(lambda: len(client.members()) == 2, "both agents to attach")
            poll(lambda: quiet(client.latest_results()), "a scheduled snapshot of the quiet system")
        yield System(detector, nodes)
    finally:
        for node in nodes:
            node.stop()
        status = detector.stop()
    assert status == 0, "".join(detector.stderr.seen)


def test_status_json(system: System) -> None:
    result = stablewatch("status", "--detector", system.address, "--json")
    assert result.returncode == 0, result.stderr
    status = one_json(result)
    assert status["detector"] == system.address
    assert [m["process_id"] for m in status["members"]] == ["A", "B"]
    assert [m["address"] for m in status["members"]] == [node.address for node in system.nodes]
    latest = status["latest"]
    assert latest["snapshot"]["outcome"] == "SNAPSHOT_OUTCOME_COMPLETED"
    assert latest["snapshot"]["processes"] == 2
    assert isinstance(latest["snapshot"]["snapshot_id"], int)
    values = {r["name"]: r["holds"] for r in latest["results"]}
    assert values == {"deadlock": False, "termination": True, "conservation(tokens)": True}


def test_status_human(system: System) -> None:
    result = stablewatch("status", "--detector", system.address)
    assert result.returncode == 0, result.stderr
    for text in ("2 agents attached", "A", "B", "completed", "deadlock", "termination", "conservation(tokens)"):
        assert text in result.stdout


def test_snapshot_json(system: System) -> None:
    result = stablewatch("snapshot", "--detector", system.address, "--json")
    assert result.returncode == 0, result.stderr
    report = one_json(result)
    assert report["outcome"] == "completed"
    assert report["abort_reason"] == ""
    summary = report["results"]["snapshot"]
    assert summary["snapshot_id"] == report["snapshot_id"]
    assert (summary["processes"], summary["channels"]) == (2, 2)
    assert [r["name"] for r in report["results"]["results"]] == ["deadlock", "termination", "conservation(tokens)"]
    conservation = report["results"]["results"][2]["conservation"]
    assert (conservation["expected"], conservation["observed"], conservation["drift"]) == (200, 200, 0)


def test_snapshot_human(system: System) -> None:
    result = stablewatch("snapshot", "--detector", system.address)
    assert result.returncode == 0, result.stderr
    assert "completed" in result.stdout
    assert "2 processes, 2 channels" in " ".join(result.stdout.split())


def test_watch_json_count(system: System) -> None:
    result = stablewatch("watch", "--detector", system.address, "--json", "--count", "2")
    assert result.returncode == 0, result.stderr
    events = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(events) == 2
    ids = [event["snapshot_id"] for event in events]
    assert ids[0] < ids[1]
    for event in events:
        assert event["outcome"] in ("completed", "aborted")
        assert event["results"]["snapshot"]["snapshot_id"] == event["snapshot_id"]
        assert isinstance(event["changes"], list)


def test_watch_human_count(system: System) -> None:
    result = stablewatch("watch", "--detector", system.address, "--count", "1")
    assert result.returncode == 0, result.stderr
    assert "predicates (1 event)" in result.stdout
    assert "conservation(tokens)" in result.stdout
    assert result.stdout.endswith("\n")


def test_watch_to_a_pipe_prints_the_table_after_each_event(system: System) -> None:
    """Piped (a log, `timeout`), the live table would show only the last table, at exit: each event
    prints the table as it is then."""
    result = stablewatch("watch", "--detector", system.address, "--count", "2")
    assert result.returncode == 0, result.stderr
    assert "predicates (1 event)" in result.stdout and "predicates (2 events)" in result.stdout
    assert result.stdout.index("predicates (1 event)") < result.stdout.index("predicates (2 events)")


def test_watch_changes_only_shows_the_current_values_first(system: System) -> None:
    """On a steady system nothing changes; the table still shows every value at once."""
    result = stablewatch("watch", "--detector", system.address, "--changes-only", "--count", "1")
    assert result.returncode == 0, result.stderr
    assert "conservation(tokens)" in result.stdout and "deadlock" in result.stdout
    assert "waiting for the next snapshot" not in result.stdout


def default_sigint() -> None:
    """Let SIGINT interrupt the child even when pytest runs with it ignored (as a shell's background job)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_watch_ends_cleanly_on_ctrl_c(system: System) -> None:
    watch = subprocess.Popen(
        [*STABLEWATCH, "watch", "--detector", system.address, "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=default_sigint,
    )
    try:
        line = LineReader(watch.stdout).next(fail=lambda: watch.stderr.read() if watch.wait(10) is not None else "")
        json.loads(line)  # it is streaming
        watch.send_signal(signal.SIGINT)
        assert watch.wait(timeout=15) == 0
        assert "Traceback" not in watch.stderr.read()
    finally:
        if watch.poll() is None:
            watch.kill()
            watch.wait(timeout=10)


def test_graph_dot(system: System, tmp_path: Path) -> None:
    result = stablewatch("graph", "--detector", system.address, "--format", "dot")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith('digraph "waitfor ')
    assert result.stdout.rstrip().endswith("}")

    latest = one_json(stablewatch("status", "--detector", system.address, "--json"))["latest"]
    snapshot_id = latest["snapshot"]["snapshot_id"]
    out = tmp_path / "graph.dot"
    result = stablewatch("graph", "--detector", system.address, "--snapshot", str(snapshot_id), "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert out.read_text().startswith(f'digraph "waitfor {snapshot_id}" {{')

    report = one_json(stablewatch("graph", "--detector", system.address, "--snapshot", str(snapshot_id), "--json"))
    assert report["snapshot_id"] == snapshot_id
    assert report["graph"]["snapshot_id"] == snapshot_id
    assert report["dot"] == out.read_text()

    result = stablewatch("graph", "--detector", system.address, "--snapshot", "999999999")
    assert result.returncode == 1
    assert "snapshot 999999999 is not known" in result.stderr


def test_graph_image(system: System, tmp_path: Path) -> None:
    out = tmp_path / "graph.png"
    result = stablewatch("graph", "--detector", system.address, "--format", "png", "--out", str(out))
    if shutil.which("dot") is None:
        assert result.returncode == 1
        assert "install graphviz" in result.stderr
        assert "--format dot" in result.stderr
    else:
        assert result.returncode == 0, result.stderr
        assert out.read_bytes().startswith(b"\x89PNG")


def test_metrics_are_served(system: System) -> None:
    with urllib.request.urlopen(system.detector.metrics, timeout=5) as response:
        text = response.read().decode()
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    missing = [name for name in METRICS if name not in names]
    assert not missing, missing
    assert "stablewatch_agents_attached 2.0" in text
    assert 'stablewatch_predicate_value{predicate="termination"} 1.0' in text


def test_aborted_snapshot_exits_3(system: System) -> None:
    b = system.nodes[1].process
    os.kill(b.pid, signal.SIGSTOP)  # B cannot answer: the snapshot misses its deadline
    try:
        result = stablewatch("snapshot", "--detector", system.address, "--json", "--timeout", "0.5")
    finally:
        os.kill(b.pid, signal.SIGCONT)
    assert result.returncode == 3, result.stderr
    report = one_json(result)
    assert report["outcome"] == "aborted"
    assert "deadline of 0.5s passed" in report["abort_reason"]
    assert f"snapshot {report['snapshot_id']} aborted: deadline" in result.stderr
    with DetectorClient(system.address, timeout=10) as client:  # the system recovers
        poll(lambda: client.trigger_snapshot(5).snapshot.outcome == SNAPSHOT_OUTCOME_COMPLETED, "a snapshot")


def test_unreachable_detector_exits_1() -> None:
    address = f"127.0.0.1:{free_port()}"
    for command in (["status"], ["snapshot"], ["watch"], ["graph"], ["resolve", "1"], ["resolutions"]):
        result = stablewatch(*command, "--detector", address)
        assert result.returncode == 1, (command, result.stderr)
        assert f"cannot reach the detector at {address}" in result.stderr, command
        assert "Traceback" not in result.stderr
    result = stablewatch("status", "--detector", address, "--json")
    assert result.returncode == 1
    assert one_json(result)["code"] == "UNAVAILABLE"


def test_no_agents_snapshot_exits_1(tmp_path: Path) -> None:
    detector = DetectorProcess(tmp_path / "data", "--interval", "off", "--metrics-port", "none")
    try:
        assert detector.metrics is None
        result = stablewatch("snapshot", "--detector", detector.address)
        assert result.returncode == 1
        assert "no agent is attached" in result.stderr
        result = stablewatch("status", "--detector", detector.address, "--json")
        assert result.returncode == 0, result.stderr
        assert one_json(result) == {
            "detector": detector.address,
            "members": [],
            "expected_missing": [],
            "expected_count": 0,
            "latest": None,
            "latest_resolution": None,
        }
    finally:
        assert detector.stop() == 0


def test_listen_on_port_0_reports_the_ports_it_bound(system: System) -> None:
    """``--listen 127.0.0.1:0 --metrics-port 0 --json`` (the fixture's detector) names real ports."""
    host, _, port = system.address.rpartition(":")
    assert host == "127.0.0.1" and int(port) > 0
    result = stablewatch("health", "--detector", system.address)
    assert result.returncode == 0, result.stderr
    metrics_port = int(system.detector.metrics.rsplit(":", 1)[1].removesuffix("/metrics"))
    assert metrics_port > 0 and metrics_port != int(port)


def test_detector_help_says_port_0_picks_a_free_port(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["detector", "--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # as printed, wrapped
    assert text.count("0: any free port, which --json reports") == 2  # --listen and --metrics-port


def test_version_prints_the_package_version() -> None:
    result = stablewatch("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"stablewatch {importlib.metadata.version('stablewatch')}\n"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_detector_stops_cleanly_with_a_watcher(tmp_path: Path, signum: int) -> None:
    detector = DetectorProcess(tmp_path / "data", "--interval", "0.2")
    watch = subprocess.Popen(
        [*STABLEWATCH, "watch", "--detector", detector.address], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        assert detector.stop(signum) == 0, "".join(detector.stderr.seen)
        assert "Traceback" not in "".join(detector.stderr.seen)
        assert watch.wait(timeout=15) == 1  # the stream ended (or, were it too late to subscribe, never began)
        assert b"Traceback" not in watch.stderr.read()
    finally:
        for process in (detector.process, watch):
            if process.poll() is None:
                process.kill()
                process.wait(timeout=10)


def test_detector_that_cannot_start_exits_1(tmp_path: Path) -> None:
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    result = stablewatch("detector", "--listen", "127.0.0.1:0", "--metrics-port", "-1", "--data-dir", str(not_a_folder))
    assert result.returncode == 1
    assert "the detector cannot start" in result.stderr
    assert "Traceback" not in result.stderr

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = ["--listen", "127.0.0.1:0", "--metrics-port", str(port), "--data-dir", str(tmp_path)]
        result = stablewatch("detector", *args)
    assert result.returncode == 1
    assert f"the detector cannot start: /metrics on 127.0.0.1:{port}: Address already in use" in result.stderr


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["detector", "--listen", "nowhere"], "expected HOST:PORT"),
        (["detector", "--listen", "127.0.0.1:99999"], "expected HOST:PORT"),
        (["detector", "--metrics-port", "70000"], "expected a port"),
        (["detector", "--interval", "-1"], "must be 0 or off (on demand only) or a positive number"),
        (["detector", "--interval", "soon"], "expected a number"),
        (["detector", "--jitter", "1.5"], "below 1"),
        (["detector", "--deadline", "nan"], "finite"),
        (["detector", "--max-concurrent", "0"], "at least 1"),
        (["detector", "--heartbeat-timeout", "0"], "must be above 0"),
        (["detector", "--expect", "tokens"], "COUNTER=TOTAL"),
        (["detector", "--expect", "tokens=many"], "expected an integer"),
        (["detector", "--predicate", "no_such_module_for_stablewatch:check"], "cannot load predicate"),
        (["detector", "--predicate", "no_colon"], "expected 'package.module:function'"),
        (["detector", "--keep", "-3"], "at least 0"),
        (["detector", "--keep-days", "0"], "must be above 0"),
        (["status", "--timeout", "0"], "must be above 0"),
        (["status", "--detector", "localhost"], "expected HOST:PORT"),
        (["snapshot", "--timeout", "-1"], "must be above 0"),
        (["watch", "--count", "0"], "at least 1"),
        (["graph", "--snapshot", "0"], "at least 1"),
        (["graph", "--format", "gif"], "invalid choice"),
        (["status", "--bogus"], "unrecognized arguments"),
    ],
)
def test_bad_flags_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_bad_flags_exit_2_from_the_console_script() -> None:
    result = stablewatch("detector", "--deadline", "soon")
    assert result.returncode == 2
    assert "argument --deadline: expected a number, not 'soon'" in result.stderr


def test_graph_dot_from_the_stored_graph() -> None:
    def process(pid: str, *waits: Wait, active: bool = False) -> ProcessSnapshot:
        return ProcessSnapshot(process_id=pid, state=LocalState(active=active, waits=waits))

    def targets(*names: str) -> list[WaitNode]:
        return [WaitNode(process=name.partition("/")[0], task=name.partition("/")[2]) for name in names]

    snapshot = GlobalSnapshot(
        snapshot_id=7,
        processes=[
            process("A", Wait(targets=targets("B"))),
            process("B", Wait(targets=targets("C/worker"))),
            process("C", Wait(task="worker", targets=targets("A", "D"), model=WAIT_MODEL_OR)),
            process("D", Wait(targets=targets("C/worker"))),
            process("E", Wait(targets=targets('F "quoted"'))),
            process('F "quoted"', active=True),
            process("G", Wait(targets=targets("A"))),
        ],
        # A message in flight on A -> G may wake G: G's wait on A is discounted.
        channels=[ChannelSnapshot(src="A", dst="G", sent_before_marker=1, messages=[RecordedMessage(payload=b"x")])],
    )
    dot = wait_for_dot(evaluate(snapshot).wait_for)
    # Nodes are n0, n1, ... in (process, task) order: A, B, C/worker, D, E, F "quoted", G.
    assert "n0 -> n1 [color=red, penwidth=2];" in dot  # A -> B
    assert 'n2 [label="C/worker", shape=diamond, color=red, fontcolor=red];' in dot
    assert 'n6 -> n0 [style=dashed, color=grey, label="in flight"];' in dot  # G -> A
    assert 'n5 [label="F \\"quoted\\""];' in dot


def test_watch_view_highlights_changes() -> None:
    def results(snapshot_id: int, deadlock: bool) -> SnapshotResults:
        summary = SnapshotSummary(snapshot_id=snapshot_id, outcome=SNAPSHOT_OUTCOME_COMPLETED, processes=2)
        return SnapshotResults(
            snapshot=summary,
            results=[
                PredicateResult(name="deadlock", holds=deadlock, summary="cycle A -> B" if deadlock else "none"),
                PredicateResult(name="termination", holds=False, summary="A active"),
            ],
        )

    view = WatchView()
    first = [PredicateChange(name=n, holds=False, first=True) for n in ("deadlock", "termination")]
    view.update(WatchEvent(snapshot_id=1, results=results(1, False), changes=first))
    view.update(WatchEvent(snapshot_id=2, results=results(2, False)))
    view.update(WatchEvent(snapshot_id=3, changes=[PredicateChange(name="deadlock", holds=True, previous_holds=False)]))
    assert (view.rows["deadlock"].holds, view.rows["deadlock"].since) == (True, 3)
    # The stream's first event says what holds now, not since when: no "since" until a change.
    assert (view.rows["termination"].holds, view.rows["termination"].since) == (False, 0)
    console = Console(record=True, width=100, color_system=None)
    console.print(view.render())
    text = console.export_text()
    assert "snapshot #3: deadlock became true" in text
    assert "predicates (3 events)" in text
    assert "#3" in text and "#1" not in text


def test_output_closed_early_ends_quietly(system: System) -> None:
    """`stablewatch snapshot --json | head -c 100`: no BrokenPipeError traceback."""
    shell = f"{' '.join(STABLEWATCH)} snapshot --detector {system.address} --json | head -c 100"
    result = subprocess.run(["bash", "-o", "pipefail", "-c", shell], capture_output=True, text=True, timeout=60)
    assert len(result.stdout) == 100
    assert result.stderr == ""
    assert result.returncode == 0
