"""`stablewatch simulate` and `stablewatch demo`: outputs, and bad input that exits 2 naming file and line."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest

from stablewatch.cli.main import main
from stablewatch.detector.sim.cos418 import TraceError, compare_snaps, parse_snap, parse_topology
from stablewatch.detector.sim.simulator import Simulation, random_delays

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


def _termination(report: dict[str, object], snapshot_id: int) -> dict[str, object]:
    snapshots = report["snapshots"]
    assert isinstance(snapshots, list)
    snapshot = next(s for s in snapshots if s["snapshot_id"] == snapshot_id)
    return next(r for r in snapshot["results"] if r["name"] == "termination")


def test_termination_is_claimed_only_when_the_script_never_sends_again(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The script is the processes' program: a process it has send later records itself active, so
    termination (stable) is false on snapshot 0 and true on snapshot 1, after the last send."""
    events = "snapshot A\ntick 10\nsend A B 3\ntick 10\nsnapshot B\n"
    top, ev = _write(tmp_path, TOPOLOGY, events)
    assert _simulate(top, ev, tmp_path / "out", "--json") == 0
    report = json.loads(capsys.readouterr().out)
    before = _termination(report, 0)
    assert before.get("holds", False) is False
    assert before["termination"]["activeProcesses"] == ["A"]
    assert before["summary"] == "not terminated: 1 active (A)"
    after = _termination(report, 1)
    assert after["holds"] is True, after["summary"]


def test_a_simulation_driven_step_by_step_never_claims_termination(tmp_path: Path) -> None:
    """Without a script (no run), the simulator cannot know that a process will not send: active."""
    top, _ = _write(tmp_path, "2\nA 1\nB 0\nA B\nB A\n", "")
    simulation = Simulation(parse_topology(top), random_delays(0))
    simulation.start_snapshot("A")
    simulation.finish()
    assert [p.state.active for p in simulation.completed[0].processes] == [True, True]


LONG = "A" * 300
TWO = "2\nN1 5\nN2 0\nN1 N2\nN2 N1\n"


@pytest.mark.parametrize(
    ("topology", "events", "where", "reason"),
    [
        (f"2\n{LONG} 5\nB 0\n", "tick\n", "t.top:2", "is longer than 256 bytes"),
        ("2\nN\x01 5\nN2 0\n", "tick\n", "t.top:2", "process id 'N\\x01' holds a control character"),
        (TWO, "tick\nsnapshot N\x02\n", "t.events:2", "process id 'N\\x02' holds a control character"),
        (TWO, f"send N1 {LONG} 1\n", "t.events:1", "is longer than 256 bytes"),
        ("2\nN1 5\nN2 0\nN1 N\x03\n", "tick\n", "t.top:4", "process id 'N\\x03' holds a control character"),
        (TWO.encode(), b"tick\nsend N1 N2 \xff\n", "t.events:2", "is not UTF-8 text (byte 0xff)"),
        (b"2\nN1 5\nN2 0\n\xc3(\n", "tick\n", "t.top:4", "is not UTF-8 text (byte 0xc3)"),
        ("2\nN1 99999999999999999999999\nN2 0\n", "tick\n", "t.top:2", "the initial balance must be at most"),
        (f"2\nN1 {2**62 - 1}\nN2 1\n", "tick\n", "t.top", f"the initial balances add up to {2**62}, past the"),
        (TWO, "send N1 N2 99999999999999999999999\n", "t.events:1", "the number of tokens must be at most"),
        (TWO, "snapshot N1\ntick 100000000000\n", "t.events:2", "the number of ticks must be at most 1000000"),
    ],
)
def test_bad_ids_text_and_counts_exit_2_naming_file_line_and_reason(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    topology: str | bytes,
    events: str | bytes,
    where: str,
    reason: str,
) -> None:
    """Ids the detector would refuse, text that is not UTF-8, token counts past the units a total is
    counted in, a tick that would run for hours: exit 2 naming file, line and reason, no traceback."""
    top, ev = tmp_path / "t.top", tmp_path / "t.events"
    for path, text in ((top, topology), (ev, events)):
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
    assert _simulate(top, ev, tmp_path / "out") == 2
    error = capsys.readouterr().err
    assert f"{where}: " in error
    assert reason in error
    assert not (tmp_path / "out").exists(), "nothing is written for a bad trace"


def test_a_delay_past_the_bound_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    top, ev = _write(tmp_path, TWO, "snapshot N1\n")
    tape = tmp_path / "t.delays"
    tape.write_text("0\n100000000000\n")
    assert _simulate(top, ev, tmp_path / "out", "--delays", str(tape)) == 2
    assert "t.delays:2: a delay must be at most 1000000" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("snap", "reason"),
    [
        (b"0\nN1 5\nN2 \xff\n", "0.snap:3: is not UTF-8 text (byte 0xff)"),
        (b"0\nN1 5\nN2\x01 0\n", "0.snap:3: process id 'N2\\x01' holds a control character"),
        (b"0\nN1 5\nN1 N2 token(99999999999999999999999)\n", "0.snap:3: a token count must be at most"),
        (f"0\nN1 {2**62 - 1}\nN1 N2 token(1)\n".encode(), f"0.snap: its tokens add up to {2**62}, past the"),
    ],
)
def test_a_bad_expected_file_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], snap: bytes, reason: str
) -> None:
    top, ev = _write(tmp_path, TWO, "snapshot N1\n")
    (tmp_path / "expected").mkdir()
    (tmp_path / "expected" / "0.snap").write_bytes(snap)
    assert _simulate(top, ev, tmp_path / "out", "--expected", str(tmp_path / "expected")) == 2
    assert reason in capsys.readouterr().err


def test_two_expected_files_with_one_snapshot_id_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Keyed by id, one would silently replace the other (and "all 2 match" be printed): refused,
    naming both, before anything is simulated or written."""
    top, ev = _write(tmp_path, TWO, "snapshot N1\n")
    expected = tmp_path / "expected"
    expected.mkdir()
    (expected / "a.snap").write_text("0\nN1 0\nN2 99\n")  # wrong
    (expected / "b.snap").write_text("0\nN1 5\nN2 0\n")  # right
    assert _simulate(top, ev, tmp_path / "out", "--expected", str(expected)) == 2
    error = capsys.readouterr().err
    assert f"{expected / 'b.snap'}:1: snapshot 0 is expected twice: here and in {expected / 'a.snap'}" in error
    assert not (tmp_path / "out").exists()
    with pytest.raises(TraceError, match="snapshot 0 is expected twice"):
        compare_snaps([], [parse_snap(expected / "a.snap"), parse_snap(expected / "b.snap")])


@pytest.mark.parametrize(("spec", "name"), [("expected", "0.snap"), ("expected/case", "case1.snap")])
def test_an_expected_file_named_for_another_snapshot_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], spec: str, name: str
) -> None:
    top, ev = _write(tmp_path, TWO, "snapshot N1\nsnapshot N2\n")
    (tmp_path / "expected").mkdir()
    (tmp_path / "expected" / name).write_text("2\nN1 5\nN2 0\n")
    assert _simulate(top, ev, tmp_path / "out", "--expected", str(tmp_path / spec)) == 2
    named = int(name.removesuffix(".snap").removeprefix("case"))
    assert f"{name}:1: holds snapshot 2, but its name says snapshot {named}" in capsys.readouterr().err
