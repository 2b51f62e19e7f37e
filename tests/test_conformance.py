"""Every COS 418 trace reproduces its expected snapshots through `stablewatch simulate`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import DELAY_TAPE
from stablewatch.detector.cli.main import main
from stablewatch.detector.sim.cos418 import compare_snaps, parse_snap

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
