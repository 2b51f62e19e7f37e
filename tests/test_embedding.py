"""What the README's *Embedding the agent* and *The query API* promise someone embedding the agent.

A real detector on its own event-loop thread, with real agents on the same loop:

* a new agent's state is active, so a process that never said it is idle keeps termination false;
* state set between construction and ``start()`` is in the first snapshot the agent takes part in;
* a snapshot's ``started_at`` is read before the detector asks any agent to record, and its
  ``finished_at`` after the last part arrived.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from polling import poll
from stablewatch.agents import Agent
from stablewatch.cli.client import DetectorClient
from stablewatch.detector.service.coordinator import Member
from stablewatch.detector.service.detector import DetectorConfig
from stablewatch.testing.detector import Running
from stablewatch.v1 import DetectorMessage, LocalSnapshotPart
from stablewatch.v1.query_pb2 import SNAPSHOT_OUTCOME_COMPLETED, SnapshotResults

pytestmark = pytest.mark.timeout(60)

MEMBERS = ("A", "B")


@pytest.fixture
def running(tmp_path: Path) -> Iterator[Running]:
    config = DetectorConfig(
        data_dir=tmp_path / "data", listen="127.0.0.1:0", metrics_port=None, interval=None, expected_members=MEMBERS
    )
    running = Running(config)
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture
def agents(running: Running) -> Iterator[dict[str, Agent]]:
    """A and B, constructed but not started, for each test to set up first; stopped at the end."""
    made = {pid: Agent(pid, detector=running.detector.address) for pid in MEMBERS}
    try:
        yield made
    finally:
        for agent in made.values():
            running.call(agent.stop())


def start(running: Running, agents: dict[str, Agent]) -> None:
    for agent in agents.values():
        running.call(agent.start())
    poll(lambda: set(running.detector.coordinator.members) == set(agents), "every agent to attach")


def snapshot(running: Running) -> SnapshotResults:
    results = running.call(running.detector.take_snapshot(deadline=10))
    assert results.snapshot.outcome == SNAPSHOT_OUTCOME_COMPLETED, results.snapshot.abort_reason
    return results


def termination(results: SnapshotResults) -> tuple[bool, bool, list[str]]:
    (found,) = [r for r in results.results if r.name == "termination"]
    return found.holds, found.unknown, list(found.termination.active_processes)


def test_an_agent_that_said_nothing_keeps_termination_false(running: Running, agents: dict[str, Agent]) -> None:
    agents["B"].state.set_active(False)  # A never says anything about its activity
    start(running, agents)
    assert termination(snapshot(running)) == (False, False, ["A"])
    agents["A"].state.set_active(False)
    assert termination(snapshot(running)) == (True, False, [])


def test_state_set_before_start_is_in_the_first_snapshot(running: Running, agents: dict[str, Agent]) -> None:
    for tokens, agent in enumerate(agents.values(), 5):
        agent.state.set_counter("tokens", tokens)
        agent.state.set_active(False)
    start(running, agents)
    first = snapshot(running)  # the detector's first (no scheduled ones: interval=None)
    with DetectorClient(running.detector.address) as client:
        state = {p.process_id: p.state for p in client.snapshot(first.snapshot.snapshot_id).processes}
    assert {pid: (s.active, dict(s.counters)) for pid, s in state.items()} == {
        "A": (False, {"tokens": 5}),
        "B": (False, {"tokens": 6}),
    }
    by_name = {r.name: r for r in first.results}
    assert by_name["conservation(tokens)"].conservation.expected == 11  # the baseline counts every token
    assert termination(first) == (True, False, [])


def test_started_at_and_finished_at_bound_the_recordings(
    running: Running, agents: dict[str, Agent], monkeypatch: pytest.MonkeyPatch
) -> None:
    for agent in agents.values():
        agent.state.set_active(False)
    start(running, agents)
    starts_sent: list[float] = []  # when the detector handed each StartSnapshot to a member's stream
    parts_sent: list[float] = []  # when each agent reported a part
    send = Member.send

    def timed_send(member: Member, message: DetectorMessage) -> None:
        if message.WhichOneof("kind") == "start":
            starts_sent.append(time.time())
        send(member, message)

    def timed_part(part: LocalSnapshotPart) -> None:
        parts_sent.append(time.time())

    monkeypatch.setattr(Member, "send", timed_send)
    for agent in agents.values():
        agent.on_part(timed_part)
    snapshot_id = snapshot(running).snapshot.snapshot_id
    assert len(starts_sent) == len(agents) and len(parts_sent) >= len(agents)
    with DetectorClient(running.detector.address) as client:  # as the query API tells them
        summary = client.snapshot_results(snapshot_id).snapshot
        whole = client.snapshot(snapshot_id)
    # Each side converted as the detector converts (monotonic, so the order is kept exactly).
    assert summary.started_at.ToNanoseconds() <= round(min(starts_sent) * 1e9)
    assert summary.finished_at.ToNanoseconds() >= round(max(parts_sent) * 1e9)
    assert whole.started_at.ToMicroseconds() <= int(min(starts_sent) * 1e6)
    assert whole.completed_at.ToMicroseconds() >= int(max(parts_sent) * 1e6)
