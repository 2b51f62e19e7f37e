"""The detector service end to end: untrusted parts, members that die mid-snapshot, metrics."""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from control_streams import RawAgent

from polling import poll
from stablewatch.detector.service.detector import DetectorConfig
from stablewatch.detector.service.query import outcome_name
from stablewatch.testing.detector import Running
from stablewatch.testing.token_nodes import Node, connect_all
from stablewatch.v1 import AgentMessage, LocalSnapshotPart, LocalState
from stablewatch.v1.control_pb2 import Heartbeat


@pytest.fixture
def running(tmp_path: Path) -> Iterator[Running]:
    config = DetectorConfig(data_dir=tmp_path / "data", listen="127.0.0.1:0", metrics_port=0, interval=None)
    service = Running(config)
    yield service
    service.stop()


def test_bad_parts_are_rejected_with_reasons_and_counted(running: Running) -> None:
    p, q = RawAgent(running, "P"), RawAgent(running, "Q")
    try:
        poll(lambda: len(running.detector.coordinator.members) == 2, "two members")
        trigger = asyncio.run_coroutine_threadsafe(running.detector.take_snapshot(deadline=10), running.loop)
        poll(lambda: p.starts() and q.starts(), "StartSnapshot at both")
        snapshot_id = p.starts()[0]
        state = LocalState(counters={"tokens": 5})
        rejected = "stablewatch_rejected_parts_total"

        # Spoofed: P's stream carries a part that claims to be Q's.
        p.send_part(LocalSnapshotPart(snapshot_id=snapshot_id, process_id="Q", state=state))
        poll(lambda: running.metric(rejected, reason="spoofed") == 1, "the spoofed part counted")
        # Unknown snapshot, malformed (a channel to itself), then a good part and its duplicate.
        p.send_part(LocalSnapshotPart(snapshot_id=snapshot_id + 100, process_id="P", state=state))
        p.send_part(LocalSnapshotPart(snapshot_id=snapshot_id, process_id="P", inbound=[{"src": "P"}]))
        p.send_part(LocalSnapshotPart(snapshot_id=snapshot_id, process_id="P", state=state))
        p.send_part(LocalSnapshotPart(snapshot_id=snapshot_id, process_id="P", state=state))
        poll(lambda: running.metric(rejected, reason="duplicate_part") == 1, "the duplicate counted")
        assert running.metric(rejected, reason="unknown_snapshot") == 1
        assert running.metric(rejected, reason="malformed") == 1
        # What was accepted is kept: Q's state completes the snapshot (no channels between them).
        q.send_part(LocalSnapshotPart(snapshot_id=snapshot_id, process_id="Q", state=state))
        results = trigger.result(20)
        assert outcome_name(results.snapshot.outcome) == "completed"
        assert {r.name: r.holds for r in results.results}["conservation(tokens)"]
        # Late: a part for the finished snapshot; the sender is told to forget that snapshot. (A
        # message on a channel the cut never counted would be excused: it opened after the cut.)
        q.send_part(LocalSnapshotPart(snapshot_id=snapshot_id, process_id="Q", state=state))
        poll(lambda: running.metric(rejected, reason="late") == 1, "the late part counted")
        poll(lambda: any(m.WhichOneof("kind") == "abort" for m in q.received), "an abort sent back to Q")
        # A second stream for an attached process id is refused.
        duplicate = RawAgent(running, "P")
        poll(lambda: any(m.WhichOneof("kind") == "refused" for m in duplicate.received), "the refusal")
        assert "already attached" in next(
            m.refused.reason for m in duplicate.received if m.WhichOneof("kind") == "refused"
        )
        duplicate.close()
        text = urllib.request.urlopen(running.detector.metrics_url, timeout=10).read().decode()
        assert 'stablewatch_rejected_parts_total{reason="spoofed"} 1.0' in text
    finally:
        p.close()
        q.close()


def test_an_agent_following_another_epoch_joins_snapshots_once_a_heartbeat_says_it_forgot(running: Running) -> None:
    """Until then its old finished ids could swallow the markers of this detector's new ones."""
    coordinator = running.detector.coordinator
    p, q = RawAgent(running, "P"), RawAgent(running, "Q", known_epoch=coordinator.epoch + 1)
    try:
        poll(lambda: "P" in coordinator.members and "Q" in coordinator.joining, "P a member, Q joining")
        trigger = asyncio.run_coroutine_threadsafe(running.detector.take_snapshot(deadline=10), running.loop)
        poll(lambda: p.starts(), "StartSnapshot at P")
        first = p.starts()[0]
        p.send_part(LocalSnapshotPart(snapshot_id=first, process_id="P", state=LocalState()))
        assert trigger.result(20).snapshot.processes == 1  # Q was left out, and nothing waited for it
        assert q.starts() == []

        # A heartbeat of another epoch changes nothing; Q's part after it (processed in order) is
        # rejected and Q told to drop that recording, as it is no member.
        q.send(AgentMessage(heartbeat=Heartbeat(sequence=1, epoch=coordinator.epoch + 2)))
        q.send_part(LocalSnapshotPart(snapshot_id=first, process_id="Q", state=LocalState()))
        poll(lambda: first in q.aborts(), "the abort sent back to joining Q")
        assert "Q" in coordinator.joining and "Q" not in coordinator.members

        q.send(AgentMessage(heartbeat=Heartbeat(sequence=2, epoch=coordinator.epoch)))
        poll(lambda: "Q" in coordinator.members and not coordinator.joining, "Q admitted")
        trigger = asyncio.run_coroutine_threadsafe(running.detector.take_snapshot(deadline=10), running.loop)
        poll(lambda: len(p.starts()) == 2 and q.starts(), "StartSnapshot at both")
        second = q.starts()[0]
        for agent in (p, q):
            agent.send_part(LocalSnapshotPart(snapshot_id=second, process_id=agent.process_id, state=LocalState()))
        assert trigger.result(20).snapshot.processes == 2
    finally:
        p.close()
        q.close()


def test_members_hear_that_a_snapshot_ended_from_the_next_start_or_on_their_own_shortly_after(
    running: Running,
) -> None:
    """The end of a snapshot costs no message of its own while snapshots keep coming."""

    def ended(agent: RawAgent) -> list[list[int]]:
        return [list(m.ended.snapshot_ids) for m in agent.received if m.WhichOneof("kind") == "ended"]

    def take(agents: tuple[RawAgent, ...]) -> int:
        count = len(agents[0].starts())  # before the start is sent: it may arrive at once
        trigger = asyncio.run_coroutine_threadsafe(running.detector.take_snapshot(deadline=10), running.loop)
        poll(lambda: all(len(agent.starts()) == count + 1 for agent in agents), "the start at every member")
        snapshot_id = agents[0].starts()[-1]
        for agent in agents:
            agent.send_part(LocalSnapshotPart(snapshot_id=snapshot_id, process_id=agent.process_id, state=LocalState()))
        assert outcome_name(trigger.result(20).snapshot.outcome) == "completed"
        return snapshot_id

    coordinator = running.detector.coordinator
    p, q = RawAgent(running, "P"), RawAgent(running, "Q")
    try:
        poll(lambda: len(coordinator.members) == 2, "two members")
        coordinator.ended_notice_delay = 60.0  # the next start comes long before
        first = take((p, q))
        second = take((p, q))
        starts = [m.start for m in p.received if m.WhichOneof("kind") == "start"]
        assert [list(start.ended) for start in starts] == [[], [first]]
        assert ended(p) == ended(q) == []
        # No start follows the third: its end goes on its own, once, to each member.
        coordinator.ended_notice_delay = 0.01
        third = take((p, q))
        poll(lambda: ended(p) == ended(q) == [[third]], "SnapshotsEnded at both")
        starts = [m.start for m in q.received if m.WhichOneof("kind") == "start"]
        assert [list(start.ended) for start in starts] == [[], [first], [second]]
        assert not any(m.WhichOneof("kind") == "abort" for agent in (p, q) for m in agent.received)
    finally:
        p.close()
        q.close()


def test_a_member_killed_mid_snapshot_aborts_it_and_the_next_completes_without_it(running: Running) -> None:
    nodes = [Node(pid, "--tokens", "100", "--detector", running.detector.address) for pid in ("A", "B", "C")]
    try:
        connect_all(nodes)
        poll(lambda: len(running.detector.coordinator.members) == 3, "three members")
        nodes[2].command("slow", seconds=0.5)  # C's handler dawdles over each message
        nodes[0].command("transfer", count=20, seed=1)
        nodes[0].expect("transferred")
        # C records only between handlers (its queue holds the rest), so a snapshot begun while C
        # handles the first of A's five messages to it waits for C.
        poll(lambda: nodes[2].stats()["received"].get("A", 0) >= 1, "C handling A's first message")
        pending = asyncio.run_coroutine_threadsafe(running.detector.take_snapshot(deadline=20), running.loop)
        poll(lambda: running.detector.coordinator.running, "the snapshot running")
        nodes[2].kill()
        aborted = pending.result(30)
        assert outcome_name(aborted.snapshot.outcome) == "aborted"
        assert "member C detached" in aborted.snapshot.abort_reason
        assert running.metric("stablewatch_snapshot_aborts_total", kind="member_detached") == 1
        poll(lambda: set(running.detector.coordinator.members) == {"A", "B"}, "C gone")
        nodes[1].command("slow", seconds=0)
        following = running.call(running.detector.take_snapshot(deadline=20), 40)
        assert outcome_name(following.snapshot.outcome) == "completed"
        assert following.snapshot.processes == 2
        stored = running.on_loop(lambda: running.detector.store.results(aborted.snapshot.snapshot_id))
        assert stored is not None and stored.snapshot.abort_reason == aborted.snapshot.abort_reason
    finally:
        for node in nodes:
            node.stop()
