"""From a review (read only) of what the detector service publishes.

* Concurrent snapshots finish in any order. An older snapshot that finished after a newer one
  overwrote the gauges (the deadlock alert resolved while a proven deadlock stood, the "latest"
  id went back) and Watch measured its changes against it, sending false changes. Now the
  gauges, the latest results and the changes are always the newest snapshot's; an older one is
  still stored, counted, archived and streamed, without changes.
* A restarted detector showed its stored latest snapshot in the query API and the web view, but
  its gauges started empty: the deadlock alert resolved on every restart. The gauges now start
  from the stored latest snapshot.
* The deadlock count gauges said 0 (nothing deadlocked) when deadlock was unknown; they say NaN.
* Retention ran on ids divisible by 100, which a replica whose number is not a multiple of 4 never
  has, and never after aborted snapshots: it now runs after every 100 finished snapshots.
"""

from __future__ import annotations

import asyncio
import json
import math
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
from control_streams import RawAgent

from polling import poll
from stablewatch.detector.evaluation import Verdict
from stablewatch.detector.service.detector import DetectorConfig
from stablewatch.testing.detector import Running
from stablewatch.v1 import WAIT_MODEL_AND, LocalSnapshotPart, LocalState, Wait, WaitNode
from stablewatch.v1.query_pb2 import SNAPSHOT_OUTCOME_COMPLETED, SnapshotResults, WatchEvent

pytestmark = pytest.mark.timeout(120)


def wait(task: str, target: tuple[str, str], instance: int, began_at_us: int) -> Wait:
    waited = WaitNode(process=target[0], task=target[1])
    return Wait(task=task, targets=[waited], model=WAIT_MODEL_AND, instance=instance, began_at_us=began_at_us)


DEADLOCK = {"a": [wait("x", ("b", "y"), 1, 1_000)], "b": [wait("y", ("a", "x"), 7, 2_000)]}
FREE: dict[str, list[Wait]] = {}


class System:
    """A detector on `data_dir` with two hand-driven agents, a and b, whose snapshots can overlap
    and finish in any order."""

    def __init__(self, data_dir: Path, **config: Any) -> None:
        self.config = DetectorConfig(
            data_dir=data_dir, listen="127.0.0.1:0", metrics_port=None, interval=None, heartbeat_timeout=120, **config
        )
        self.running = Running(self.config)
        self.detector = self.running.detector
        self.agents = [RawAgent(self.running, pid) for pid in ("a", "b")]
        poll(lambda: {"a", "b"} <= set(self.detector.coordinator.members), "a and b to attach")

    def begin(self) -> tuple[Future[SnapshotResults], int]:
        """Start a snapshot: the future of its results, and its id."""
        before = {agent: len(agent.starts()) for agent in self.agents}
        pending = asyncio.run_coroutine_threadsafe(self.detector.take_snapshot(deadline=30), self.running.loop)
        poll(lambda: all(len(a.starts()) > before[a] for a in self.agents), "StartSnapshot at every agent")
        [snapshot_id] = {agent.starts()[-1] for agent in self.agents}
        return pending, snapshot_id

    def send(self, snapshot_id: int, waits: dict[str, list[Wait]]) -> None:
        for agent in self.agents:
            mine = waits.get(agent.process_id, [])
            state = LocalState(active=bool(mine), waits=mine)
            agent.send_part(LocalSnapshotPart(snapshot_id=snapshot_id, process_id=agent.process_id, state=state))

    def snapshot(self, waits: dict[str, list[Wait]]) -> SnapshotResults:
        pending, snapshot_id = self.begin()
        self.send(snapshot_id, waits)
        return pending.result(20)

    def metric(self, name: str, **labels: str) -> float | None:
        return self.detector.metrics.registry.get_sample_value(name, labels)

    def stop(self) -> None:
        for agent in self.agents:
            agent.close()
        self.running.stop()


@pytest.fixture
def system(tmp_path: Path) -> Any:
    system = System(tmp_path / "data")
    try:
        yield system
    finally:
        system.stop()


def deadlock(results: SnapshotResults) -> Verdict:
    return next(Verdict.of(r) for r in results.results if r.name == "deadlock")


def overlap(system: System) -> tuple[int, int]:
    """s1 (older, nothing deadlocked) and s2 (newer, a deadlock) overlap; s2 completes first."""
    pending1, s1 = system.begin()
    pending2, s2 = system.begin()
    assert s1 < s2
    system.send(s2, DEADLOCK)
    newer = pending2.result(20)
    system.send(s1, FREE)
    older = pending1.result(20)
    assert older.snapshot.outcome == newer.snapshot.outcome == SNAPSHOT_OUTCOME_COMPLETED
    assert deadlock(newer) is Verdict.TRUE and deadlock(older) is Verdict.FALSE
    return s1, s2


def test_an_older_snapshot_finishing_last_leaves_the_newest_published(system: System) -> None:
    _, s2 = overlap(system)
    assert system.detector.latest().snapshot.snapshot_id == s2
    assert json.loads(system.detector.web.json()[1])["snapshot"]["id"] == s2
    assert system.metric("stablewatch_last_completed_snapshot_id") == s2
    assert system.metric("stablewatch_predicate_value", predicate="deadlock") == 1
    assert system.metric("stablewatch_deadlocked_nodes") == 2
    assert system.metric("stablewatch_snapshots_total", outcome="completed") == 2  # both counted


def test_watch_changes_are_against_the_newest_snapshot_not_the_last_to_finish(system: System) -> None:
    events: list[WatchEvent] = []

    async def collect() -> None:
        async for event in system.detector.watch("reviewer"):
            events.append(event)

    assert deadlock(system.snapshot(FREE)) is Verdict.FALSE  # the watcher's starting point
    watching = asyncio.run_coroutine_threadsafe(collect(), system.running.loop)
    try:
        poll(lambda: events, "the watcher's first event")
        s1, s2 = overlap(system)
        s3 = system.snapshot(DEADLOCK).snapshot.snapshot_id  # the deadlock goes on: no change
        poll(lambda: any(e.snapshot_id == s3 for e in events), "s3's event")
    finally:
        watching.cancel()
    changes = [
        (e.snapshot_id, c.previous_holds, c.holds) for e in events[1:] for c in e.changes if c.name == "deadlock"
    ]
    # In snapshot order: false (first), false (s1), true (s2), true (s3): one change, at s2.
    assert changes == [(s2, False, True)]
    assert [e.snapshot_id for e in events[1:]] == [s2, s1, s3]  # s1 still streamed, in finishing order


def test_a_restarted_detector_publishes_its_stored_latest_snapshot(tmp_path: Path) -> None:
    system = System(tmp_path / "data")
    try:
        proved = system.snapshot(DEADLOCK)
        assert deadlock(proved) is Verdict.TRUE
    finally:
        system.stop()
    system = System(tmp_path / "data")
    try:
        assert system.detector.latest().snapshot.snapshot_id == proved.snapshot.snapshot_id
        assert system.metric("stablewatch_last_completed_snapshot_id") == proved.snapshot.snapshot_id
        assert system.metric("stablewatch_predicate_value", predicate="deadlock") == 1
        assert system.metric("stablewatch_deadlocked_nodes") == 2
        finished = proved.snapshot.finished_at.ToMicroseconds() / 1e6
        assert system.metric("stablewatch_last_completed_snapshot_timestamp_seconds") == pytest.approx(finished)
        assert system.metric("stablewatch_in_flight_messages") == 0
        assert math.isnan(system.metric("stablewatch_recorded_bytes"))  # type: ignore[arg-type]  # not stored
    finally:
        system.stop()


def test_deadlock_counts_are_not_zero_when_deadlock_is_unknown(system: System) -> None:
    system.snapshot(DEADLOCK)
    assert system.metric("stablewatch_deadlocked_nodes") == 2
    # a waits on c, which is no member: the cut is open and "no deadlock" cannot be said.
    undecided = system.snapshot({"a": [wait("x", ("c", ""), 9, 3_000)]})
    assert deadlock(undecided) is Verdict.UNKNOWN
    assert system.metric("stablewatch_predicate_unknown", predicate="deadlock") == 1
    assert math.isnan(system.metric("stablewatch_deadlocked_nodes"))  # type: ignore[arg-type]
    assert math.isnan(system.metric("stablewatch_deadlock_cycles"))  # type: ignore[arg-type]


def test_retention_runs_while_a_detector_of_replica_1_runs(tmp_path: Path) -> None:
    # Every id of replica 1 is 1 modulo 128, so none is a multiple of 100 (what retention waited for).
    system = System(tmp_path / "data", replica=1, max_snapshots=5)
    try:
        for _ in range(130):
            system.snapshot(FREE)
        kept = system.running.on_loop(lambda: len(system.detector.store.list(1000)))
    finally:
        system.stop()
    assert kept <= 5 + 30, f"{kept} snapshots kept with max_snapshots=5"  # it ran once 100 had finished
