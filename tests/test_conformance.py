"""Conformance traces reproduce their expected snapshots through `stablewatch simulate`.

Two sets: the project's own cases in ``tests/conformance`` (always run; see its ``generate.py``),
and the COS 418 traces in ``../shared/conformance/cos418`` (run where that folder is present). The
own cases' expected snapshots come from an independent reference replay
(``tests/conformance/reference.py``), itself checked here against the COS 418 files.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from conformance.reference import Replay, replay

from conftest import DELAY_TAPE, ROOT
from stablewatch.agents.core import DEFAULT_MAX_RECORDINGS
from stablewatch.cli.main import main
from stablewatch.detector.sim.cos418 import (
    Send,
    SnapshotEvent,
    compare_snaps,
    format_events,
    format_snap,
    format_topology,
    parse_delays,
    parse_events,
    parse_snap,
    parse_topology,
    snap_from_snapshot,
)
from stablewatch.detector.sim.generate import random_trace
from stablewatch.detector.sim.simulator import Simulation, tape_delays

OWN = ROOT / "tests" / "conformance"
OWN_CASES = sorted(p.stem for p in OWN.glob("*.events"))

CASES = [
    "2nodes-simple",
    "2nodes-message",
    "3nodes-simple",
    "3nodes-bidirectional-messages",
    "8nodes-sequential-snapshots",
]


def _run(cos418: Path, case: str, out: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict]:
    topology = cos418 / f"{case.split('-')[0]}.top"
    argv = ["simulate", "--topology", str(topology), "--events", str(cos418 / f"{case}.events")]
    argv += ["--delays", str(DELAY_TAPE), "--out", str(out), "--expected", str(cos418 / case), "--json"]
    status = main(argv)
    return status, json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.parametrize("case", CASES)
def test_trace_reproduces_expected_snapshots(
    cos418: Path, case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, report = _run(cos418, case, tmp_path, capsys)
    assert report["differences"] == []
    assert report["matches_expected"] is True
    assert status == 0
    expected = sorted(cos418.glob(f"{case}*.snap"))
    written = sorted(tmp_path.glob("*.snap"))
    assert len(written) == len(expected)
    assert compare_snaps([parse_snap(p) for p in written], [parse_snap(p) for p in expected]) == []


@pytest.mark.parametrize("case", CASES)
def test_every_snapshot_conserves_tokens(
    cos418: Path, case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, report = _run(cos418, case, tmp_path, capsys)
    for snapshot in report["snapshots"]:
        conservation = [r for r in snapshot["results"] if r["name"] == "conservation(tokens)"]
        assert conservation and conservation[0]["holds"] is True


@pytest.mark.parametrize("case", CASES)
def test_the_reference_replay_reproduces_the_cos418_files(cos418: Path, case: str) -> None:
    """The reference that writes the own cases' expected snapshots records what the course's files say."""
    result = replay(cos418 / f"{case.split('-')[0]}.top", cos418 / f"{case}.events", DELAY_TAPE)
    expected = sorted(cos418.glob(f"{case}*.snap"))
    assert len(result.snaps) == len(expected)
    for path in expected:
        assert result.snaps[parse_snap(path).snapshot_id].text() == path.read_text(), path.name


def test_a_wrong_expectation_is_reported(cos418: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    wrong = tmp_path / "expected"
    wrong.mkdir()
    (wrong / "0.snap").write_text("0\nN1 1\nN2 0\nN1 N2 token(1)\n")
    argv = [
        "simulate",
        "--topology",
        str(cos418 / "2nodes.top"),
        "--events",
        str(cos418 / "2nodes-message.events"),
    ]
    argv += ["--delays", str(DELAY_TAPE), "--out", str(tmp_path / "out"), "--expected", str(wrong), "--json"]
    assert main(argv) == 1
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["matches_expected"] is False
    assert any("N1 has 0 tokens, expected 1" in d for d in report["differences"])


def _run_own(case: str, out: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict]:
    argv = ["simulate", "--topology", str(OWN / f"{case}.top"), "--events", str(OWN / f"{case}.events")]
    argv += ["--delays", str(OWN / f"{case}.delays"), "--out", str(out), "--expected", str(OWN / case), "--json"]
    status = main(argv)
    return status, json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def _reference(case: str) -> Replay:
    """The independent reference's replay of own case ``case``."""
    return replay(OWN / f"{case}.top", OWN / f"{case}.events", OWN / f"{case}.delays")


def _snapshots_in(case: str) -> int:
    """How many snapshots the trace of ``case`` starts (its ``snapshot`` lines)."""
    events = parse_events(OWN / f"{case}.events", parse_topology(OWN / f"{case}.top"))
    return sum(isinstance(event, SnapshotEvent) for event in events)


def test_the_project_ships_its_own_cases() -> None:
    assert len(OWN_CASES) >= 7, f"conformance cases missing from {OWN}"


@pytest.mark.parametrize("case", OWN_CASES)
def test_own_trace_reproduces_expected_snapshots(case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Every snapshot of the trace is replayed, none fails, and each matches its expected one exactly."""
    status, report = _run_own(case, tmp_path, capsys)
    assert report["failed"] == []
    assert report["differences"] == []
    assert status == 0
    assert report["started"] == len(report["snapshots"]) == _snapshots_in(case)
    expected = sorted(OWN.glob(f"{case}*.snap"))
    assert len(expected) == _snapshots_in(case)
    written = [parse_snap(path) for path in sorted(tmp_path.glob("*.snap"))]
    assert len(written) == len(expected)
    assert compare_snaps(written, [parse_snap(path) for path in expected]) == []


@pytest.mark.parametrize("case", OWN_CASES)
def test_own_expected_snapshots_are_the_reference_replays(case: str) -> None:
    """The expected files are what the independent reference records (not stale, not the simulator's)."""
    result = _reference(case)
    files = {parse_snap(path).snapshot_id: path for path in OWN.glob(f"{case}*.snap")}
    assert sorted(files) == sorted(result.snaps) == list(range(_snapshots_in(case)))
    for snapshot_id, path in files.items():
        assert path.read_text() == result.snaps[snapshot_id].text(), path.name


def test_own_cases_run_up_to_64_snapshots_at_once() -> None:
    """The cases go past the agents' bound on concurrent recordings: the issue's 11 processes with
    29 snapshots, and up to 64 snapshots running at once."""
    most = {case: _reference(case).most_running for case in OWN_CASES}
    assert max(most.values()) == 64
    assert _snapshots_in("11nodes-29snapshots") == 29
    assert most["11nodes-29snapshots"] > DEFAULT_MAX_RECORDINGS


@pytest.mark.parametrize("case", ["11nodes-29snapshots", "5nodes-64snapshots", "12nodes-64snapshots"])
def test_with_the_agents_bound_refused_snapshots_are_reported_not_dropped(case: str) -> None:
    """Given the agents' bound, the simulator refuses snapshots past it, and says which and why."""
    topology = parse_topology(OWN / f"{case}.top")
    delays = tape_delays(parse_delays(OWN / f"{case}.delays"))
    simulation = Simulation(topology, delays, max_recordings=DEFAULT_MAX_RECORDINGS)
    completed = simulation.run(parse_events(OWN / f"{case}.events", topology))
    assert simulation.failed, f"{case} never runs more than {DEFAULT_MAX_RECORDINGS} snapshots at one process"
    for aborted in simulation.failed:
        assert f"refused, {DEFAULT_MAX_RECORDINGS} snapshots are recording" in aborted.reason
    ids = sorted([snapshot.snapshot_id for snapshot in completed] + [a.snapshot_id for a in simulation.failed])
    assert ids == list(range(simulation.started)) == list(range(_snapshots_in(case)))


@pytest.mark.parametrize("case", OWN_CASES)
def test_own_trace_snapshots_are_consistent(case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Checked apart from the simulator: tokens are conserved, and what a snapshot records on a
    channel is a run of consecutive token messages that the script really sent on that channel."""
    _, report = _run_own(case, tmp_path, capsys)
    topology = parse_topology(OWN / f"{case}.top")
    sent: dict[tuple[str, str], list[int]] = {}
    for event in parse_events(OWN / f"{case}.events", topology):
        if isinstance(event, Send):
            sent.setdefault((event.src, event.dst), []).append(event.tokens)
    total = sum(topology.balances.values())
    for path in sorted(OWN.glob(f"{case}*.snap")):
        snap = parse_snap(path)
        in_flight = [tokens for _, _, tokens in snap.messages]
        assert sum(snap.balances.values()) + sum(in_flight) == total, path.name
        for (src, dst), tokens in sent.items():
            recorded = [n for s, d, n in snap.messages if (s, d) == (src, dst)]
            runs = [tokens[i : i + len(recorded)] for i in range(len(tokens) - len(recorded) + 1)]
            assert recorded in runs, f"{path.name}: {src}->{dst} recorded {recorded}, sent {tokens}"
    for snapshot in report["snapshots"]:
        conservation = [r for r in snapshot["results"] if r["name"] == "conservation(tokens)"]
        assert conservation and conservation[0]["holds"] is True


@pytest.mark.parametrize(("seed", "processes", "snapshots"), [(11, 4, 300), (12, 9, 150), (13, 16, 100)])
def test_the_simulator_matches_the_reference_on_fresh_traces(
    seed: int, processes: int, snapshots: int, tmp_path: Path
) -> None:
    """Beyond the shipped cases: fresh random traces with hundreds of snapshots at once replay whole."""
    topology, script = random_trace(seed, processes, 2 * snapshots, snapshots)
    rng = random.Random(seed)
    delays = [rng.randrange(5) for _ in range(len(script) + snapshots * sum(map(len, topology.links.values())))]
    (tmp_path / "t.top").write_text(format_topology(topology))
    (tmp_path / "t.events").write_text(format_events(script))
    (tmp_path / "t.delays").write_text("".join(f"{d}\n" for d in delays))
    reference = replay(tmp_path / "t.top", tmp_path / "t.events", tmp_path / "t.delays")
    assert reference.most_running > DEFAULT_MAX_RECORDINGS
    simulation = Simulation(topology, tape_delays(delays))
    completed = simulation.run(script)
    assert simulation.failed == []
    assert [snapshot.snapshot_id for snapshot in completed] == sorted(reference.snaps) == list(range(snapshots))
    for snapshot in completed:
        assert format_snap(snap_from_snapshot(snapshot)) == reference.snaps[snapshot.snapshot_id].text()
