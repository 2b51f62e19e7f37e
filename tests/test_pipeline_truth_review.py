"""Truth review of the pipeline: what it says about archived snapshots must be true.

A result is true, false or unknown; a summary over many snapshots may neither turn an unknown into
a decided verdict nor claim "all" of snapshots it did not decide.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from snapshot_gen import Archived, pair_break, pair_deadlocked, summary_of, write_archive

from stablewatch.detector.archive.writer import write_resolution_batch
from stablewatch.pipeline.history import run_history
from stablewatch.pipeline.story import tell

pytestmark = pytest.mark.timeout(600)

START = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)
STEP = timedelta(milliseconds=200)


def _at(n: int) -> datetime:
    return START + n * STEP


def _timeline(verdicts: Sequence[tuple[str, str, str | None]]) -> pa.Table:
    """One timeline row per completed snapshot n: its deadlock, termination and conservation verdicts."""
    return pa.Table.from_pylist(
        [
            {
                "snapshot_id": 100 + n,
                "started_at": _at(n),
                "deadlock": deadlock,
                "termination": termination,
                "conservation": conservation,
                "deadlocked_processes": 0,
                "deadlocked_nodes": 0,
            }
            for n, (deadlock, termination, conservation) in enumerate(verdicts)
        ]
    )


def _conservation(counter: str, verdicts: Sequence[tuple[int, str]], expected: int) -> pa.Table:
    """``conservation`` rows of `counter`: (snapshot n, verdict), as :func:`conservation_drift` writes them
    (an unknown result has no drift)."""
    return pa.Table.from_pylist(
        [
            {
                "snapshot_id": 100 + n,
                "started_at": _at(n),
                "counter": counter,
                "verdict": word,
                "expected": expected,
                "observed": expected,
                "drift": 0,
                "baseline": False,
            }
            for n, word in verdicts
        ]
    )


def test_conserved_in_all_is_not_claimed_when_open_cuts_left_the_counter_unknown() -> None:
    # 10 completed snapshots: 8 closed cuts where the tokens held, 2 open cuts (unknown) among them.
    unknown_at = {3, 7}
    verdicts = [("false", "unknown", "unknown") if n in unknown_at else ("false", "false", "true") for n in range(10)]
    rows = [(n, "unknown" if n in unknown_at else "true") for n in range(10)]
    story = tell("bank", {"timeline": _timeline(verdicts), "conservation": _conservation("tokens", rows, 3000)})
    assert "conserved in all" not in story.sentence
    assert "tokens = 3000 conserved in 8 of 10 snapshots (2 unknown)" in story.sentence


def test_conserved_in_all_is_not_claimed_when_some_snapshots_lacked_the_counter() -> None:
    # 10 completed snapshots, all closed and running; the counter appears only from the 5th on.
    verdicts = [("false", "false", None)] * 4 + [("false", "false", "true")] * 6
    rows = [(n, "true") for n in range(4, 10)]
    story = tell("bank", {"timeline": _timeline(verdicts), "conservation": _conservation("tokens", rows, 3000)})
    assert "conserved in all" not in story.sentence
    assert "tokens = 3000 conserved in 6 of 10 snapshots (4 without it)" in story.sentence


def test_conserved_in_all_is_said_when_every_snapshot_held() -> None:
    verdicts = [("false", "false", "true")] * 5
    rows = [(n, "true") for n in range(5)]
    story = tell("bank", {"timeline": _timeline(verdicts), "conservation": _conservation("tokens", rows, 3000)})
    assert story.sentence.endswith("tokens = 3000 conserved in all 5 snapshots")


# -- breaks of an episode at the edge of a day range ---------------------------------------------------------

MIDNIGHT = datetime(2026, 3, 2, tzinfo=UTC)


def test_a_break_sent_after_midnight_counts_for_the_episode_of_a_day_range(spark: Any, tmp_path: Path) -> None:
    # The deadlock is proven by a snapshot that started 2 s before midnight (day 2026-03-01); its
    # break is sent and answered just after (the resolutions table is partitioned by the day it was
    # sent: 2026-03-02). The history of 2026-03-01 alone must still count the break of its episode.
    root = tmp_path / "archive"
    snapshot = pair_deadlocked(1, MIDNIGHT - timedelta(seconds=2))
    write_archive(root, [Archived(summary_of(snapshot), snapshot)])
    write_resolution_batch(root, [pair_break(1, MIDNIGHT + timedelta(milliseconds=100))])
    history = run_history(root, tmp_path / "out", chart=False, first_day="2026-03-01", last_day="2026-03-01")
    episodes = history.tables["deadlock_episodes"].to_pylist()
    assert [(e["first_snapshot_id"], e["breaks"], e["broken"]) for e in episodes] == [(1, 1, 1)]
