"""`stablewatch simulate` and `stablewatch demo`: outputs, and bad input that exits 2 naming file and line."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest

from stablewatch.cli.main import main
from stablewatch.detector.sim.cos418 import parse_snap

TOPOLOGY = "3\nA 5\nB 3\nC 2\nA B\nB C\nC A\n"


def _write(folder: Path, topology: str, events: str) -> tuple[Path, Path]:
    top, ev = folder / "t.top", folder / "t.events"
    top.write_text(topology)
    ev.write_text(events)
    return top, ev


def _simulate(top: Path, ev: Path, out: Path, *extra: str) -> int:
    return main(["simulate", "--topology", str(top), "--events", str(ev), "--out", str(out), *extra])


@pytest.mark.parametrize(
    ("topology", "events", "where", "reason"),
    [
        (TOPOLOGY, "send A X 1\n", "t.events:1", "unknown process X"),
        (TOPOLOGY, "tick\nsend A C 1\n", "t.events:2", "no link A -> C"),
        (TOPOLOGY, "send A B 2\nsend A B 4\n", "t.events:2", "A sends 4 tokens but has only 3"),
        (TOPOLOGY, "send A B two\n", "t.events:1", "the number of tokens must be an integer"),
        (TOPOLOGY, "jump A\n", "t.events:1", "expected 'send SRC DST N'"),
        (TOPOLOGY, "snapshot Q\n", "t.events:1", "unknown process Q"),
        (TOPOLOGY, "tick 0\n", "t.events:1", "the number of ticks must be at least 1"),
        ("2\nA 1\n", "tick\n", "t.top", "declares 2 processes but lists 1"),
        ("2\nA 1\nB x\n", "tick\n", "t.top:3", "the initial balance must be an integer"),
        ("2\nA 1\nB 0\nA Z\n", "tick\n", "t.top:4", "link names unknown process Z"),
        ("2\nA 1\nA 0\n", "tick\n", "t.top:3", "process A is listed twice"),
    ],
)
def test_bad_input_exits_2_naming_file_line_and_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], topology: str, events: str, where: str, reason: str
) -> None:
    top, ev = _write(tmp_path, topology, events)
    assert _simulate(top, ev, tmp_path / "out") == 2
    error = capsys.readouterr().err
    assert where in error
    assert reason in error
    assert not (tmp_path / "out").exists(), "nothing is written for a bad trace"


def test_the_console_script_exits_2_on_a_missing_file(tmp_path: Path) -> None:
    script = Path(sys.executable).with_name("stablewatch")
    missing = tmp_path / "nope.top"
    run = subprocess.run(
        [
            str(script),
            "simulate",
            "--topology",
            str(missing),
            "--events",
            str(missing),
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2
    assert "nope.top: cannot read" in run.stderr


def test_a_disconnected_process_makes_the_snapshot_fail_with_a_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    top, ev = _write(tmp_path, "2\nA 1\nB 0\nA B\n", "snapshot B\n")  # B has no outbound link: A never hears
    assert _simulate(top, ev, tmp_path / "out") == 2
    assert "snapshot cannot complete" in capsys.readouterr().err


def test_snap_files_and_predicates_for_concurrent_snapshots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    events = "send A B 2\nsnapshot A\nsend A B 1\nsnapshot C\ntick\nsend B C 1\ntick 3\nsnapshot B\n"
    top, ev = _write(tmp_path, TOPOLOGY, events)
    assert _simulate(top, ev, tmp_path / "out", "--seed", "7", "--json") == 0
    report = json.loads(capsys.readouterr().out)
    assert [s["snapshot_id"] for s in report["snapshots"]] == [0, 1, 2]
    for snapshot in report["snapshots"]:
        snap = parse_snap(tmp_path / "out" / f"{snapshot['snapshot_id']}.snap")
        assert sum(snap.balances.values()) + sum(tokens for _, _, tokens in snap.messages) == 10
        names = [r["name"] for r in snapshot["results"]]
        assert names[:2] == ["deadlock", "termination"]
        assert "conservation(tokens)" in names


def test_the_same_seed_gives_the_same_snapshots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    events = "send A B 3\nsnapshot B\ntick\nsend B C 2\ntick\nsend C A 1\n"
    top, ev = _write(tmp_path, TOPOLOGY, events)
    runs = []
    for attempt in range(2):
        assert _simulate(top, ev, tmp_path / f"out{attempt}", "--seed", "42") == 0
        runs.append((tmp_path / f"out{attempt}" / "0.snap").read_text())
    capsys.readouterr()
    assert runs[0] == runs[1]


def test_the_bundled_sample_trace_conserves_tokens(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    traces = resources.files("stablewatch.detector.sim.traces")
    with resources.as_file(traces) as folder:
        argv = ["simulate", "--topology", str(folder / "bank.top"), "--events", str(folder / "bank.events")]
        assert main([*argv, "--out", str(tmp_path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert len(report["snapshots"]) == 3
    for snapshot in report["snapshots"]:
        by_name = {r["name"]: r for r in snapshot["results"]}
        assert by_name["conservation(tokens)"]["holds"] is True
        assert by_name["deadlock"].get("holds", False) is False


def test_out_naming_an_existing_file_exits_2_with_a_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    top, ev = _write(tmp_path, TOPOLOGY, "send A B 1\nsnapshot A\ntick 5\n")
    taken = tmp_path / "taken"
    taken.write_text("keep me")
    assert _simulate(top, ev, taken) == 2
    error = capsys.readouterr().err
    assert f"{taken}: --out must be a folder, and this is an existing file" in error
    assert "Traceback" not in error
    assert taken.read_text() == "keep me"


def test_one_snapshot_is_singular(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    top, ev = _write(tmp_path, TOPOLOGY, "send A B 1\nsnapshot A\ntick 5\n")
    assert _simulate(top, ev, tmp_path / "out") == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "1 snapshot of t.events" in text
    assert "wrote 1 .snap file to" in text


def test_a_refused_snapshot_is_printed_with_its_reason_and_exits_3(tmp_path: Path) -> None:
    """Given an agent's bound on snapshots recording at once, the one refused is reported, not dropped."""
    top, ev = _write(tmp_path, TOPOLOGY, "snapshot A\nsnapshot B\ntick 10\n")  # B records 1 before marker 0 comes
    script = Path(sys.executable).with_name("stablewatch")
    argv = [str(script), "simulate", "--topology", str(top), "--events", str(ev)]
    run = subprocess.run(
        [*argv, "--out", str(tmp_path / "out"), "--max-recordings", "1"], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 3, run.stderr
    text = " ".join(run.stdout.split())
    assert "failed: snapshot 0: process B: refused, 1 snapshots are recording, the bound (max_recordings)" in text
    assert "1 of 2 snapshots failed" in text
    assert sorted(path.name for path in (tmp_path / "out").iterdir()) == ["1.snap"]
    # Without the bound (the default) the same trace replays both, and a failure outranks a difference.
    unbounded = subprocess.run([*argv, "--out", str(tmp_path / "all")], capture_output=True, text=True, timeout=60)
    assert unbounded.returncode == 0, unbounded.stderr
    assert sorted(path.name for path in (tmp_path / "all").iterdir()) == ["0.snap", "1.snap"]
    expected = [*argv, "--out", str(tmp_path / "again"), "--expected", str(tmp_path / "all"), "--max-recordings", "1"]
    again = subprocess.run(expected, capture_output=True, text=True, timeout=60)
    assert again.returncode == 3
    assert "differs: snapshot 0: expected but not produced" in " ".join(again.stdout.split())


def test_a_snapshot_past_the_recorded_bytes_bound_fails_in_the_json_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A snapshot whose recording passes an agent's byte bound fails, with its reason in the JSON."""
    # Both messages reach A after it records and before C's marker (16 bytes charged for each).
    top, ev = _write(tmp_path, TOPOLOGY, "snapshot A\nsend C A 1\nsend C A 1\ntick 10\n")
    assert _simulate(top, ev, tmp_path / "out", "--max-recorded-bytes", "16", "--json") == 3
    report = json.loads(capsys.readouterr().out)
    assert report["started"] == 1
    assert report["snapshots"] == []
    assert report["failed"] == [{"snapshot_id": 0, "reason": "process A: recorded bytes exceeded the bound (32 > 16)"}]
    assert _simulate(top, ev, tmp_path / "unbounded", "--json") == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["started"], report["failed"]) == (1, [])
    assert report["snapshots"][0]["snap"].count("C A token(1)") == 2
