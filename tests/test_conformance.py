"""Conformance traces reproduce their expected snapshots through `stablewatch simulate`.

Two sets: the project's own cases in ``tests/conformance`` (always run; see its ``generate.py``),
and the COS 418 traces in ``../shared/conformance/cos418`` (run where that folder is present).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import DELAY_TAPE, ROOT
from stablewatch.detector.cli.main import main
from stablewatch.detector.sim.cos418 import Send, compare_snaps, parse_events, parse_snap, parse_topology

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


def test_the_project_ships_its_own_cases() -> None:
    assert len(OWN_CASES) >= 4, f"conformance cases missing from {OWN}"


@pytest.mark.parametrize("case", OWN_CASES)
def test_own_trace_reproduces_expected_snapshots(case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, report = _run_own(case, tmp_path, capsys)
    assert report["differences"] == []
    assert status == 0
    assert len(report["snapshots"]) == len(list(OWN.glob(f"{case}*.snap")))


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
