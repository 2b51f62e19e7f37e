"""Looking at detectors that run side by side in a test (each a ``stablewatch.testing.detector.Running``):
their snapshots, members and breaks."""

from __future__ import annotations

from polling import poll
from stablewatch.detector.service.query import outcome_name
from stablewatch.detector.service.resolutions import outcome_word
from stablewatch.testing.detector import Running
from stablewatch.v1.query_pb2 import Resolution, SnapshotResults


def take(running: Running, deadline: float = 20) -> SnapshotResults:
    """One snapshot the detector takes now (given ``deadline`` seconds), with its results."""
    return running.call(running.detector.take_snapshot(deadline=deadline), 40)


def attached(running: Running) -> set[str]:
    """The processes attached to the detector."""
    return set(running.detector.coordinator.members)


def deadlocked(results: SnapshotResults) -> bool:
    """Whether a completed snapshot proves a deadlock (the predicate true, not unknown)."""
    assert outcome_name(results.snapshot.outcome) == "completed", results.snapshot.abort_reason
    (deadlock,) = [result for result in results.results if result.name == "deadlock"]
    assert not deadlock.unknown
    return deadlock.holds


def resolutions(running: Running) -> list[Resolution]:
    """The detector's breaks, oldest first."""
    return running.on_loop(lambda: running.detector.store.resolutions(1000))[::-1]


def settled(running: Running) -> list[Resolution]:
    """The detector's breaks once none waits for its agent's report."""

    def look() -> tuple[list[Resolution]] | None:
        found = resolutions(running)
        return None if any(outcome_word(r) == "pending" for r in found) else (found,)

    return poll(look, "every break reported")[0]
