"""The first line of a COS 418 .top and .snap file: one integer, read by one rule, each error naming file and line."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from stablewatch.detector.sim.cos418 import TraceError, parse_snap, parse_topology


@pytest.mark.parametrize(
    ("parse", "text", "line", "reason"),
    [
        (parse_topology, "# nothing but a comment\n", 0, "empty topology: expected the number of processes"),
        (parse_topology, "2 3\nA 1\nB 1\n", 1, "expected the number of processes, got '2 3'"),
        (parse_topology, "two\n", 1, "the number of processes must be an integer, got 'two'"),
        (parse_topology, "\n0\n", 2, "the number of processes must be at least 1, got 0"),
        (parse_snap, "\n", 0, "empty snapshot file"),
        (parse_snap, "4 A\nA 1\n", 1, "expected the snapshot id, got '4 A'"),
        (parse_snap, "-1\n", 1, "the snapshot id must be at least 0, got -1"),
    ],
)
def test_a_bad_first_line_is_an_error_naming_file_and_line(
    tmp_path: Path, parse: Callable[[Path], object], text: str, line: int, reason: str
) -> None:
    path = tmp_path / "trace"
    path.write_text(text)
    with pytest.raises(TraceError) as raised:
        parse(path)
    assert (raised.value.path, raised.value.line) == (str(path), line)
    assert raised.value.reason.startswith(reason)


def test_what_follows_the_first_line_is_read_after_it(tmp_path: Path) -> None:
    top, snap = tmp_path / "t.top", tmp_path / "s.snap"
    top.write_text("# a comment line is not the first line\n2\nA 3\nB 0\nA B\n")
    snap.write_text("0\nA 1\nB 2\nA B token(1)\n")
    topology = parse_topology(top)
    assert (topology.balances, topology.links) == ({"A": 3, "B": 0}, {"A": ["B"], "B": []})
    read = parse_snap(snap)
    assert (read.snapshot_id, read.balances, read.messages) == (0, {"A": 1, "B": 2}, [("A", "B", 1)])
