"""Breaking deadlocks from the command line: ``stablewatch detector --resolve ...`` and its flags,
``stablewatch resolve SNAPSHOT_ID``, ``stablewatch resolutions``, and breaks in ``watch`` and ``status``.

A real detector runs in-process (:class:`~stablewatch.testing.detector.Running`); its agents are
hand-driven control streams (:class:`control_streams.RawAgent`), so that a test says exactly which
waits a snapshot holds and what the victim's agent answers. The commands run in-process through
``main`` (``watch`` as the console script, since it streams). Flag checking runs in-process too
(argparse exits 2). tests/test_breaking_e2e.py has real agents breaking real waits.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from command_line import STABLEWATCH, LineReader
from control_streams import RawAgent
from rich.console import Console

from polling import poll
from stablewatch.cli import detector as detector_command
from stablewatch.cli.main import main
from stablewatch.cli.render import WatchView, resolution_dict, resolution_line, resolutions_table
from stablewatch.detector.service.detector import DetectorConfig
from stablewatch.detector.service.limits import Limits
from stablewatch.testing.detector import Running
from stablewatch.v1 import (
    WAIT_MODEL_AND,
    AgentMessage,
    LocalSnapshotPart,
    LocalState,
    PredicateResult,
    Wait,
    WaitNode,
)
from stablewatch.v1.control_pb2 import BREAK_OUTCOME_BROKEN, BREAK_OUTCOME_GONE, BreakReport, BreakWait
from stablewatch.v1.query_pb2 import (
    SNAPSHOT_OUTCOME_COMPLETED,
    Resolution,
    SnapshotResults,
    SnapshotSummary,
    WatchEvent,
)

pytestmark = pytest.mark.timeout(60)


# a/x waits on b/y (instance 1, began first) and b/y on a/x (instance 7, began last): one deadlock,
# whose youngest wait is b's instance 7.
def _wait(task: str, target: tuple[str, str], instance: int, began_at_us: int) -> Wait:
    waited = WaitNode(process=target[0], task=target[1])
    return Wait(task=task, targets=[waited], model=WAIT_MODEL_AND, instance=instance, began_at_us=began_at_us)


DEADLOCK = {"a": [_wait("x", ("b", "y"), 1, 1_000)], "b": [_wait("y", ("a", "x"), 7, 2_000)]}
CYCLE = "a/x -> b/y -> a/x"


class System:
    """A detector with agents a and b attached, as hand-driven control streams."""

    def __init__(self, data_dir: Path) -> None:
        # The raw agents send no heartbeats: a long timeout keeps them attached while a test runs.
        config = DetectorConfig(
            data_dir=data_dir, listen="127.0.0.1:0", metrics_port=None, interval=None, heartbeat_timeout=120
        )
        self.running = Running(config)
        self.address = self.running.detector.address
        self.agents = {pid: RawAgent(self.running, pid) for pid in ("a", "b")}
        poll(lambda: {"a", "b"} <= set(self.running.detector.coordinator.members), "a and b to attach")

    def snapshot(self, waits: dict[str, list[Wait]]) -> SnapshotResults:
        """Take a snapshot in which each agent reports its `waits` (none: it is passive and free)."""
        agents = list(self.agents.values())
        before = {agent: len(agent.starts()) for agent in agents}
        pending: concurrent.futures.Future[SnapshotResults] = asyncio.run_coroutine_threadsafe(
            self.running.detector.take_snapshot(deadline=10), self.running.loop
        )
        poll(lambda: all(len(a.starts()) > before[a] for a in agents), "StartSnapshot at every agent")
        for agent in agents:
            state = LocalState(active=bool(waits.get(agent.process_id)), waits=waits.get(agent.process_id, []))
            agent.send_part(LocalSnapshotPart(snapshot_id=agent.starts()[-1], process_id=agent.process_id, state=state))
        results = pending.result(20)
        assert results.snapshot.outcome == SNAPSHOT_OUTCOME_COMPLETED, results.snapshot.abort_reason
        return results

    def breaks(self, process_id: str) -> list[BreakWait]:
        """The BreakWait orders agent `process_id` has received."""
        return [m.break_wait for m in self.agents[process_id].received if m.WhichOneof("kind") == "break_wait"]

    def stop(self) -> None:
        for agent in self.agents.values():
            agent.close()
        self.running.stop()


@pytest.fixture
def system(tmp_path: Path) -> Iterator[System]:
    system = System(tmp_path / "data")
    try:
        yield system
    finally:
        system.stop()


@pytest.fixture(autouse=True)
def wide(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tables as wide as a terminal would show them (rich reads COLUMNS), not 80 columns."""
    monkeypatch.setenv("COLUMNS", "200")


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Run ``stablewatch *argv`` in-process: its exit status, stdout and stderr."""
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_json(out: str) -> dict[str, Any]:
    lines = out.splitlines()
    assert len(lines) == 1, out
    return json.loads(lines[0])


def flat(text: str) -> str:
    """Text as printed, with rich's wrapping undone."""
    return " ".join(text.split())


# -- stablewatch resolve -----------------------------------------------------------------------------------


def test_resolve_breaks_the_youngest_wait_and_resolutions_lists_it(
    system: System, capsys: pytest.CaptureFixture[str]
) -> None:
    snapshot_id = system.snapshot(DEADLOCK).snapshot.snapshot_id
    code, out, err = cli(capsys, "resolve", str(snapshot_id), "--detector", system.address, "--json")
    assert code == 0, err
    report = one_json(out)
    assert (report["detector"], report["snapshot_id"]) == (system.address, snapshot_id)
    (sent,) = report["resolutions"]
    assert (sent["process_id"], sent["task"], sent["instance"]) == ("b", "y", 7)
    assert (sent["snapshot_id"], sent["policy"], sent["outcome"]) == (snapshot_id, "operator", "pending")
    assert sent["deadlock"] == CYCLE
    assert sent["requested_by"].startswith("address ")  # who asked: the client's address, without TLS
    assert {(n["process"], n["task"]) for n in sent["component"]} == {("a", "x"), ("b", "y")}

    # The order went to b, naming its wait; b answers that it broke it.
    poll(lambda: system.breaks("b"), "the BreakWait at b")
    (order,) = system.breaks("b")
    assert (order.break_id, order.snapshot_id) == (sent["resolution_id"], snapshot_id)
    assert (order.instance, order.task) == (7, "y")
    assert order.deadlock == CYCLE
    assert system.breaks("a") == []
    report_message = BreakReport(
        break_id=order.break_id, instance=7, outcome=BREAK_OUTCOME_BROKEN, detail="ABORTED: the call was cancelled"
    )
    system.agents["b"].send(AgentMessage(break_report=report_message))

    def listed() -> dict[str, Any]:
        code, out, err = cli(capsys, "resolutions", "--detector", system.address, "--json")
        assert code == 0, err
        return one_json(out)

    poll(lambda: listed()["resolutions"][0]["outcome"] == "broken", "the break to be reported broken")
    listing = listed()
    assert listing["detector"] == system.address
    (done,) = listing["resolutions"]
    assert done["resolution_id"] == sent["resolution_id"]
    assert done["detail"] == "ABORTED: the call was cancelled"
    assert done["reported_at"] and done["sent_at"]

    code, out, err = cli(capsys, "resolutions", "--detector", system.address)
    assert code == 0, err
    text = flat(out)
    assert "1 break of deadlocks, newest first" in text
    for needle in (f"#{sent['resolution_id']}", f"#{snapshot_id}", "wait 7 of b/y", "operator", "broken", CYCLE):
        assert needle in text, needle

    # That deadlock was broken after the snapshot began: nothing more to break in it.
    code, out, err = cli(capsys, "resolve", str(snapshot_id), "--detector", system.address, "--json")
    assert code == 1
    assert one_json(out)["code"] == "FAILED_PRECONDITION"
    assert f"snapshot {snapshot_id} has nothing to break" in err


def test_resolve_prints_each_break_sent(system: System, capsys: pytest.CaptureFixture[str]) -> None:
    snapshot_id = system.snapshot(DEADLOCK).snapshot.snapshot_id
    code, out, err = cli(capsys, "resolve", str(snapshot_id), "--detector", system.address)
    assert code == 0, err
    text = flat(out)
    assert f"snapshot #{snapshot_id}: sent 1 break for 1 deadlock" in text
    for needle in ("victim wait 7 of b/y", f"deadlock {CYCLE}", "policy operator (requested by address", "pending"):
        assert needle in text, needle
    assert "wait began 1970-01-01" in text or "wait began 1969-12-31" in text  # 2 ms after the epoch, local time
    # Its agent has not answered: a second request finds the deadlock being broken already.
    code, _, err = cli(capsys, "resolve", str(snapshot_id), "--detector", system.address)
    assert code == 1
    assert "being broken already" in err


def test_resolve_a_snapshot_without_a_deadlock(system: System, capsys: pytest.CaptureFixture[str]) -> None:
    snapshot_id = system.snapshot({}).snapshot.snapshot_id
    code, out, err = cli(capsys, "resolve", str(snapshot_id), "--detector", system.address)
    assert code == 1
    assert out == ""
    assert f"stablewatch: snapshot {snapshot_id} has nothing to break: it proves no deadlock (deadlock is false)" in err
    code, out, err = cli(capsys, "resolve", str(snapshot_id), "--detector", system.address, "--json")
    assert code == 1
    assert one_json(out)["code"] == "FAILED_PRECONDITION"
    assert "Traceback" not in err
    assert system.breaks("a") == system.breaks("b") == []


def test_resolve_an_unknown_snapshot(system: System, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(capsys, "resolve", "999999", "--detector", system.address, "--json")
    assert code == 1
    assert one_json(out) == {"error": "snapshot 999999 is not known", "code": "NOT_FOUND"}
    assert "snapshot 999999 is not known" in err


def test_resolve_when_the_victim_has_left(system: System, capsys: pytest.CaptureFixture[str]) -> None:
    """The victim's process detached after the snapshot: the break cannot go out, and says so."""
    snapshot_id = system.snapshot(DEADLOCK).snapshot.snapshot_id
    system.agents.pop("b").close()
    poll(lambda: "b" not in system.running.detector.coordinator.members, "b to detach")
    code, out, err = cli(capsys, "resolve", str(snapshot_id), "--detector", system.address, "--json")
    assert code == 1
    (unsent,) = one_json(out)["resolutions"]
    assert (unsent["process_id"], unsent["outcome"]) == ("b", "not_attached")
    assert "no break was sent: the victims' processes are not attached (b)" in err


def test_resolutions_of_a_detector_that_broke_nothing(system: System, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(capsys, "resolutions", "--detector", system.address, "--json")
    assert code == 0, err
    assert one_json(out) == {"detector": system.address, "resolutions": []}
    code, out, err = cli(capsys, "resolutions", "--detector", system.address)
    assert code == 0, err
    assert "no deadlock has been broken" in out


def test_resolutions_pages_newest_first(system: System, capsys: pytest.CaptureFixture[str]) -> None:
    """More breaks than a page: --limit takes the newest, across pages."""
    store = system.running.detector.store

    def add(count: int) -> None:
        for instance in range(1, count + 1):
            store.add_resolution(Resolution(snapshot_id=1, process_id="a", instance=instance, policy="youngest"))

    system.running.on_loop(lambda: add(120))
    code, out, err = cli(capsys, "resolutions", "--detector", system.address, "--json", "--limit", "110")
    assert code == 0, err
    instances = [r["instance"] for r in one_json(out)["resolutions"]]
    assert instances == list(range(120, 10, -1))
    code, out, err = cli(capsys, "resolutions", "--detector", system.address, "--json")
    assert [r["instance"] for r in one_json(out)["resolutions"]] == list(range(120, 100, -1))  # 20 by default


def test_status_shows_the_latest_break(system: System, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(capsys, "status", "--detector", system.address, "--json")
    assert code == 0, err
    assert one_json(out)["latest_resolution"] is None
    snapshot_id = system.snapshot(DEADLOCK).snapshot.snapshot_id
    assert cli(capsys, "resolve", str(snapshot_id), "--detector", system.address)[0] == 0
    code, out, err = cli(capsys, "status", "--detector", system.address, "--json")
    assert code == 0, err
    latest = one_json(out)["latest_resolution"]
    assert (latest["snapshot_id"], latest["process_id"], latest["outcome"]) == (snapshot_id, "b", "pending")
    code, out, err = cli(capsys, "status", "--detector", system.address)
    assert code == 0, err
    line = f"latest break #{latest['resolution_id']} of wait 7 of b/y (operator, snapshot #{snapshot_id}): pending"
    assert line in flat(out)


# -- stablewatch watch ---------------------------------------------------------------------------------------


def test_watch_streams_breaks_as_json(system: System, capsys: pytest.CaptureFixture[str]) -> None:
    """A break comes twice on the stream, even with --changes-only: when sent, and when answered."""
    snapshot_id = system.snapshot(DEADLOCK).snapshot.snapshot_id
    watch = subprocess.Popen(
        [*STABLEWATCH, "watch", "--detector", system.address, "--json", "--changes-only", "--count", "3"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        lines = LineReader(watch.stdout)
        first = json.loads(lines.next(fail=watch.stderr.read))  # the current values: it is subscribed
        assert first["snapshot_id"] == snapshot_id
        assert {change["name"] for change in first["changes"]} >= {"deadlock"}
        assert "resolution" not in first
        assert cli(capsys, "resolve", str(snapshot_id), "--detector", system.address)[0] == 0
        sent = json.loads(lines.next(fail=watch.stderr.read))
        assert sent["outcome"] is None and "results" not in sent
        assert sent["snapshot_id"] == snapshot_id
        assert (sent["resolution"]["process_id"], sent["resolution"]["outcome"]) == ("b", "pending")
        poll(lambda: system.breaks("b"), "the BreakWait at b")  # on b's own stream: it may come after the event
        (order,) = system.breaks("b")
        answer = BreakReport(break_id=order.break_id, instance=order.instance, outcome=BREAK_OUTCOME_GONE)
        system.agents["b"].send(AgentMessage(break_report=answer))
        answered = json.loads(lines.next(fail=watch.stderr.read))
        assert answered["resolution"]["resolution_id"] == order.break_id
        assert answered["resolution"]["outcome"] == "gone"
        assert watch.wait(timeout=15) == 0
    finally:
        if watch.poll() is None:
            watch.kill()
            watch.wait(timeout=10)


def resolution(**fields: Any) -> Resolution:
    """A break of wait 7 of b/y, sent at 1000 s, with the fields given."""
    sent = Resolution(
        resolution_id=4, snapshot_id=12, process_id="b", task="y", instance=7, policy="youngest", deadlock=CYCLE
    )
    sent.requested_by = "detector"
    sent.sent_at.FromMilliseconds(1_000_000)
    for name, value in fields.items():
        if name == "reported_after_ms":
            sent.reported_at.FromMilliseconds(1_000_000 + value)
        else:
            setattr(sent, name, value)
    return sent


def rendered(renderable: object) -> str:
    console = Console(record=True, width=200, color_system=None)
    console.print(renderable)
    return console.export_text()


def test_the_watch_view_lists_breaks_under_the_table() -> None:
    view = WatchView()
    summary = SnapshotSummary(snapshot_id=12, outcome=SNAPSHOT_OUTCOME_COMPLETED, processes=2)
    deadlock = PredicateResult(name="deadlock", holds=True, summary=f"cycle {CYCLE}")
    view.update(WatchEvent(snapshot_id=12, results=SnapshotResults(snapshot=summary, results=[deadlock])))
    view.update(WatchEvent(snapshot_id=12, resolution=resolution()))
    text = rendered(view.render())
    assert f"break #4 of wait 7 of b/y (youngest, snapshot #12): pending; deadlock {CYCLE}" in text
    assert "snapshot #12 completed" in text  # the latest snapshot stays the header
    view.update(WatchEvent(snapshot_id=12, resolution=resolution(outcome=BREAK_OUTCOME_BROKEN, reported_after_ms=42)))
    text = rendered(view.render())
    assert "break #4 of wait 7 of b/y (youngest, snapshot #12): broken after 42.0 ms" in text
    assert "pending" not in text  # the report replaced the sending
    assert "predicates (3 events)" in text
    for resolution_id in range(5, 12):
        view.update(WatchEvent(snapshot_id=13, resolution=resolution(resolution_id=resolution_id)))
    text = rendered(view.render())
    assert "break #4 " not in text and "break #11 " in text and "break #7 " in text  # the latest five


# -- rendering -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "word", "line"),
    [
        ({}, "pending", f"break #4 of wait 7 of b/y (youngest, snapshot #12): pending; deadlock {CYCLE}"),
        (
            {"outcome": BREAK_OUTCOME_BROKEN, "reported_after_ms": 2_500, "detail": "ABORTED"},
            "broken",
            "break #4 of wait 7 of b/y (youngest, snapshot #12): broken after 2.50 s: ABORTED",
        ),
        (
            {"reported_after_ms": 10_000, "detail": "no report from b within 10 s"},
            "unanswered",
            "break #4 of wait 7 of b/y (youngest, snapshot #12): unanswered after 10.00 s: no report from b",
        ),
        (
            {"reported_after_ms": 0, "detail": "the victim's process is not attached: the break was not sent"},
            "not_attached",
            "break #4 of wait 7 of b/y (youngest, snapshot #12): not_attached after 0.0 ms: the victim's process",
        ),
        (
            {"task": "", "outcome": BREAK_OUTCOME_GONE, "reported_after_ms": 3},
            "gone",
            "break #4 of wait 7 of b (youngest, snapshot #12): gone after 3.0 ms",
        ),
    ],
)
def test_a_break_in_words(fields: dict[str, Any], word: str, line: str) -> None:
    shown = resolution(**fields)
    assert resolution_dict(shown)["outcome"] == word
    assert resolution_line(shown).plain.startswith(line)


def test_the_resolutions_table() -> None:
    answered = resolution(resolution_id=5, outcome=BREAK_OUTCOME_BROKEN, reported_after_ms=12, detail="ABORTED")
    text = rendered(resolutions_table([answered, resolution()], title="2 breaks"))
    headers = ("break", "sent", "snapshot", "victim", "policy, requested by", "outcome, report", "deadlock, detail")
    for header in headers:
        assert header in text, header
    lines = text.splitlines()
    five = next(i for i, line in enumerate(lines) if "#5" in line)  # newest first, as given
    four = next(i for i, line in enumerate(lines) if "#4 " in line)
    assert five < four
    for needle in ("#12", "wait 7 of b/y", "youngest", "broken", CYCLE):
        assert needle in lines[five], needle
    for needle in ("detector", "after 12.0 ms", "ABORTED"):
        assert needle in lines[five + 1], needle
    assert "pending" in lines[four] and "after" not in lines[four + 1]


# -- flags ---------------------------------------------------------------------------------------------------


class _Recorded(Exception):
    """Raised by the stand-in detector once it has the config the flags made."""


def detector_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *flags: str) -> DetectorConfig:
    """The DetectorConfig ``stablewatch detector *flags`` would run with."""
    made: list[DetectorConfig] = []

    class Detector:
        def __init__(self, config: DetectorConfig, plugins: object) -> None:
            made.append(config)
            self.config = config

        async def start(self) -> None:
            raise OSError("not started: the test only wants the config")

        async def stop(self) -> None:
            pass

    monkeypatch.setattr(detector_command, "Detector", Detector)
    argv = ["detector", "--listen", "127.0.0.1:0", "--metrics-port", "none", "--data-dir", str(tmp_path), *flags]
    assert main(argv) == 1  # the stand-in cannot start
    (config,) = made
    return config


def test_resolving_is_off_by_default(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    config = detector_config(monkeypatch, tmp_path)
    assert (config.resolve, config.hints) == (None, True)
    assert config.report_timeout == DetectorConfig().report_timeout
    assert config.limits.hint_rate == Limits().hint_rate


def test_resolve_flags_reach_the_detector(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    flags = ["--resolve", "oldest", "--report-timeout", "2.5", "--no-hints", "--hint-rate", "3/2"]
    config = detector_config(monkeypatch, tmp_path, *flags)
    assert (config.resolve, config.report_timeout, config.hints) == ("oldest", 2.5, False)
    assert config.limits.hint_rate == (3, 2.0)
    assert detector_config(monkeypatch, tmp_path, "--resolve", "youngest").resolve == "youngest"


def test_detector_help_explains_resolve(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["detector", "--help"])
    assert exit_.value.code == 0
    text = flat(capsys.readouterr().out)
    assert "--resolve POLICY" in text
    assert "youngest (the wait that began last) or oldest" in text
    assert "Never on an unknown deadlock" in text
    assert "Default: off" in text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["detector", "--resolve", "newest"], "--resolve: invalid choice: 'newest' (choose from 'youngest', 'oldest')"),
        (["detector", "--resolve"], "argument --resolve: expected one argument"),
        (["detector", "--report-timeout", "0"], "argument --report-timeout: must be above 0"),
        (["detector", "--hint-rate", "fast"], "argument --hint-rate: expected N/S"),
        (["detector", "--hint-rate", "0/1"], "a rate needs a count of at least 1"),
        (["detector", "--hint-rate", "off"], "this rate cannot be off"),
        (["resolve"], "the following arguments are required: SNAPSHOT_ID"),
        (["resolve", "0"], "argument SNAPSHOT_ID: must be at least 1"),
        (["resolve", "latest"], "argument SNAPSHOT_ID: expected an integer"),
        (["resolutions", "--limit", "0"], "argument --limit: must be at least 1"),
    ],
)
def test_bad_flags_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
