"""The detector's side of long-wait hints: a hint starts a snapshot at once, a storm of them is
rate limited and counted (never dropped: one more snapshot covers what came meanwhile), and a
detector told to ignore them does."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from control_streams import RawAgent

from polling import poll
from stablewatch.detector.service.detector import DetectorConfig
from stablewatch.detector.service.limits import Limits
from stablewatch.testing.detector import Running
from stablewatch.v1 import AgentMessage, control_pb2

pytestmark = pytest.mark.timeout(60)


def detector(tmp_path: Path, **options: object) -> Running:
    # No schedule: every snapshot here is a hint's. The raw agent never answers a start, so each
    # snapshot ends at its short deadline.
    config = DetectorConfig(
        data_dir=tmp_path / "data",
        listen="127.0.0.1:0",
        metrics_port=None,
        interval=None,
        deadline=0.2,
        heartbeat_timeout=60,  # the raw agent sends no heartbeats
        **options,
    )
    return Running(config)


@pytest.fixture
def hinting(tmp_path: Path) -> Iterator[tuple[Running, RawAgent]]:
    running = detector(tmp_path, limits=Limits(hint_rate=(2, 1.0)))
    agent = RawAgent(running, "A")
    poll(lambda: "A" in running.detector.coordinator.members, "A to attach")
    yield running, agent
    agent.close()
    running.stop()


def hint(instance: int, waited_ms: int = 25) -> AgentMessage:
    return AgentMessage(hint=control_pb2.WaitHint(instance=instance, task="t", waited_ms=waited_ms))


def outcomes(running: Running) -> dict[str, float]:
    names = ("snapshot", "coalesced", "rate_limited", "ignored")
    return {name: running.metric("stablewatch_wait_hints_total", outcome=name) for name in names}


def test_a_hint_starts_a_snapshot_at_once(hinting: tuple[Running, RawAgent]) -> None:
    running, agent = hinting
    agent.send(hint(1))
    poll(lambda: len(agent.starts()) == 1, "the hint's snapshot")
    assert outcomes(running)["snapshot"] == 1


def test_a_hint_storm_is_rate_limited_counted_and_still_covered(hinting: tuple[Running, RawAgent]) -> None:
    running, agent = hinting
    started = time.monotonic()
    agent.send(hint(1))
    poll(lambda: len(agent.starts()) == 1, "the first hint's snapshot")
    # Waits that began after that snapshot started (1 ms ago each): it cannot have recorded them.
    for instance in range(2, 202):
        agent.send(hint(instance, waited_ms=1))
    poll(lambda: sum(outcomes(running).values()) == 201, "every hint counted")
    counted = outcomes(running)
    assert counted["ignored"] == 0 and counted["rate_limited"] + counted["coalesced"] >= 195
    # Never dropped: one more snapshot covers the storm's waits.
    poll(lambda: len(agent.starts()) >= 2, "a snapshot after the storm", timeout=10)
    elapsed = time.monotonic() - started
    # Never more than the rate allows (a burst of 2, then 2 a second), whatever the agent sends.
    assert len(agent.starts()) <= 2 + 2 * elapsed + 1
    assert running.detector.coordinator.members.keys() == {"A"}  # nothing else changed
    assert running.metric("stablewatch_refused_total", reason="rate_limited") == 0


def test_a_detector_told_to_ignore_hints_counts_them_and_starts_nothing(tmp_path: Path) -> None:
    running = detector(tmp_path, hints=False)
    agent = RawAgent(running, "A")
    try:
        poll(lambda: "A" in running.detector.coordinator.members, "A to attach")
        for instance in range(1, 6):
            agent.send(hint(instance))
        poll(lambda: outcomes(running)["ignored"] == 5, "the hints counted as ignored")
        agent.send(AgentMessage(heartbeat=control_pb2.Heartbeat(sequence=1)))  # after the hints, in order
        poll(lambda: running.detector.coordinator.members["A"].last_heartbeat > 0, "the heartbeat")
        assert agent.starts() == []
    finally:
        agent.close()
        running.stop()
