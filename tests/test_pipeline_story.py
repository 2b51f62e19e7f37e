"""What each system went through, told from its history tables (no Spark), and the chart of lanes.

Four scripted systems, one snapshot every 200 ms from :data:`START`, as the demo's four tell them:
a bank whose tokens are conserved throughout, philosophers eating then deadlocked, a job running
then terminated, and a shop that deadlocks again and again, each deadlock broken, orders going on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path

import matplotlib.pyplot as plt
import pyarrow as pa
import pytest
from rich.console import Console

from stablewatch.pipeline.chart import draw_lanes, lanes_figure
from stablewatch.pipeline.story import Story, duration_text, phases, stories_report, tell

START = datetime(2026, 11, 26, 1, 15, 1, tzinfo=UTC)
STEP = timedelta(milliseconds=200)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def at(n: int) -> datetime:
    return START + n * STEP


def timeline(verdicts: Sequence[tuple[str, str, str | None]], nodes: int = 5) -> pa.Table:
    """One row per snapshot n (its deadlock, termination and conservation verdicts)."""
    return pa.Table.from_pylist(
        [
            {
                "snapshot_id": 100 + n,
                "started_at": at(n),
                "deadlock": deadlock,
                "termination": termination,
                "conservation": conservation,
                "deadlocked_processes": nodes if deadlock == "true" else 0,
                "deadlocked_nodes": nodes if deadlock == "true" else 0,
            }
            for n, (deadlock, termination, conservation) in enumerate(verdicts)
        ]
    )


def attributes(name: str, totals: Sequence[float]) -> pa.Table:
    return pa.Table.from_pylist(
        [{"snapshot_id": 100 + n, "started_at": at(n), "attribute": name, "total": t} for n, t in enumerate(totals)]
    )


def conservation(counter: str, observed: Sequence[int], expected: int) -> pa.Table:
    return pa.Table.from_pylist(
        [
            {
                "snapshot_id": 100 + n,
                "started_at": at(n),
                "counter": counter,
                "verdict": "true" if seen == expected else "false",
                "expected": expected,
                "observed": seen,
                "drift": seen - expected,
                "baseline": False,
            }
            for n, seen in enumerate(observed)
        ]
    )


def episodes(processes: list[str]) -> pa.Table:
    return pa.Table.from_pylist([{"episode": 1, "processes": processes, "tasks": [], "ongoing": True}])


RUNNING = ("false", "false", "true")
DEADLOCKED = ("true", "false", "true")
TERMINATED = ("false", "true", "true")
UNKNOWN = ("unknown", "unknown", "true")


def bank() -> Story:
    return tell(
        "bank", {"timeline": timeline([RUNNING] * 30), "conservation": conservation("tokens", [3000] * 30, 3000)}
    )


def philosophers() -> Story:
    verdicts = [RUNNING] * 15 + [UNKNOWN] + [DEADLOCKED] * 10  # an open cut on the way: skipped
    meals = [float(min(n, 15) * 10) for n in range(26)]
    tables = {
        "timeline": timeline(verdicts),
        "attributes": attributes("meals", meals),
        "conservation": conservation("forks", [5] * 26, 5),
        "deadlock_episodes": episodes(["P0", "P1", "P2", "P3", "P4"]),
    }
    return tell("philosophers", tables, progress="meals")


def job() -> Story:
    done = [float(min(n * 10, 156)) for n in range(30)]
    return tell(
        "job",
        {"timeline": timeline([RUNNING] * 18 + [TERMINATED] * 12), "attributes": attributes("done", done)},
        "done",
    )


def shop(with_orders: bool = True) -> Story:
    """Deadlocked at snapshots 1-3, 6, 9-10 (each deadlock broken at the next snapshot), running between."""
    deadlocked = {1, 2, 3, 6, 9, 10}
    verdicts = [(("true" if n in deadlocked else "false"), "false", None) for n in range(12)]
    broken = [n + 1 for n in sorted(deadlocked)]
    breaks = pa.Table.from_pylist(
        [{"outcome": "broken", "reported_at": at(n) - timedelta(milliseconds=50)} for n in broken]
        + [{"outcome": "gone", "reported_at": at(4)}]
    )
    tables = {"timeline": timeline(verdicts, nodes=8), "breaks": breaks}
    if with_orders:
        tables["attributes"] = attributes("orders", [float(n * 3) for n in range(12)])
    return tell("shop", tables, progress="orders")


def test_durations_read_in_milliseconds_below_a_second() -> None:
    assert [duration_text(s) for s in (0.0, 0.0075, 0.32, 0.9996, 3.14, 150, 9000)] == [
        "0.0 ms",
        "7.5 ms",
        "320 ms",
        "1000 ms",
        "3.1 s",
        "2.5 min",
        "2.5 h",
    ]


def test_phases_tile_the_time_line_and_skip_undecided_snapshots() -> None:
    found = phases(timeline([RUNNING] * 3 + [UNKNOWN, RUNNING] + [DEADLOCKED] * 2))
    assert [(p.state, p.snapshots, p.last) for p in found] == [("running", 4, False), ("deadlocked", 2, True)]
    assert (found[0].began_at, found[0].ended_at) == (at(0), at(5))  # to the next phase's first snapshot
    assert (found[1].began_at, found[1].ended_at) == (at(5), at(6))  # the last: to its last snapshot
    assert phases(timeline([UNKNOWN] * 2)) == []


def test_each_system_tells_its_story() -> None:
    assert bank().sentence == "running throughout (5.8 s, 30 snapshots); tokens = 3000 conserved in all 30 snapshots"
    assert philosophers().sentence == (
        "running 3.2 s (meals 0 → 150), then deadlocked to the end (1.8 s): P0, P1, P2, P3, P4"
    )
    assert job().sentence == "running 3.6 s (done 0 → 156), then terminated to the end (2.2 s)"
    assert shop().sentence == (
        "running 200 ms, then deadlocked 3 times (longest 600 ms) and running again in between, running at the end; "
        "orders 0 → 33 in all; 6 deadlocks broken (7 breaks sent)"
    )


def test_each_lane_draws_what_tells_the_work() -> None:
    assert [(s.label, s.values[0], s.values[-1], s.expected) for s in bank().series] == [("tokens", 3000, 3000, 3000)]
    assert [(s.label, s.values[-1]) for s in philosophers().series] == [("meals", 150)]
    assert [(s.label, s.values[-1]) for s in shop().series] == [("orders", 33)]
    # Without the orders attribute, the shop's lane counts the deadlocks broken instead.
    without = shop(with_orders=False)
    assert [(s.label, s.values) for s in without.series] == [("deadlocks broken", (0, 1, 2, 3, 4, 5, 6))]
    assert len(without.broken_at) == 6 and "orders" not in without.sentence


def test_a_violated_counter_is_told() -> None:
    tables = {"timeline": timeline([RUNNING] * 4), "conservation": conservation("tokens", [300, 300, 295, 290], 300)}
    assert tell("bank", tables).sentence == (
        "running throughout (600 ms, 4 snapshots); tokens off in 2 snapshots (drift up to -10)"
    )


def test_the_chart_has_one_lane_per_system_telling_its_story(tmp_path: Path) -> None:
    stories = [bank(), philosophers(), job(), shop()]
    figure = lanes_figure(stories)
    try:
        lanes = figure.axes
        assert [lane.get_ylabel().splitlines()[0] for lane in lanes] == ["bank", "philosophers", "job", "shop"]
        for lane, story in zip(lanes, stories, strict=True):
            assert " ".join(lane.get_title(loc="left").split()) == f"{story.system}: {story.sentence}"
        # Each lane's background: one span per phase, coloured by state.
        assert [len(lane.patches) for lane in lanes] == [1, 2, 2, len(stories[3].phases)]
        assert lanes[-1].get_xlabel() == "seconds since the first snapshot (01:15:01.000 UTC)"
    finally:
        plt.close(figure)
    path = draw_lanes(stories, tmp_path / "lanes.png")
    assert path.read_bytes()[:8] == PNG_MAGIC


def test_the_stories_print_whole_at_80_columns() -> None:
    console = Console(record=True, width=80)
    rows = [story.as_dict() for story in (bank(), philosophers(), job(), shop())]
    console.print(stories_report(rows, "out/history.png", "out"))
    text = console.export_text()
    assert "…" not in text  # nothing cut
    flat = " ".join(text.replace("│", " ").split())
    assert "tokens = 3000 conserved in all 30 snapshots" in flat
    assert "chart: out/history.png" in flat


@pytest.mark.parametrize("story", [bank, philosophers, job, shop])
def test_a_story_is_json_data(story: Callable[[], Story]) -> None:
    told = story()
    data = told.as_dict()
    assert data["system"] == told.system and data["sentence"] == told.sentence
    assert [p["state"] for p in data["phases"]] == [p.state for p in told.phases]
    assert all(isinstance(p["seconds"], float) and p["began_at"].startswith("2026-11-26T01:15") for p in data["phases"])
