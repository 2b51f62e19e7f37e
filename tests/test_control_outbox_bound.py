"""What the detector queues for an agent's control stream is bounded (SECURITY.md, "Bounds").

An attached agent that sends parts for snapshots that are not running, and never reads its
stream, made the detector queue one AbortSnapshot per part without limit (45 686 messages, 13 MB
for 60 000 parts) and log a warning for each. Now a member's queue holds one abort per snapshot
id and at most ``OUTBOX_LIMIT`` messages; past that the member is detached (counted in
``stablewatch_agents_detached_total{reason="outbox_full"}``), and those rejections warn once a
minute. A member that reads its stream still gets every message, however many.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from polling import poll
from stablewatch.detector.service.coordinator import OUTBOX_LIMIT, Member
from stablewatch.detector.service.detector import DetectorConfig
from stablewatch.detector.service.limits import Limits
from stablewatch.testing.detector import Running
from stablewatch.v1 import AgentMessage, LocalSnapshotPart, control_pb2, control_pb2_grpc

pytestmark = pytest.mark.timeout(180)

# More than the transport buffers for a stream that is not read (about 14 000 of these aborts,
# some 4 MB) plus OUTBOX_LIMIT: without the bound, this many leave thousands queued.
PARTS = 40_000
MADE_UP = 10**12  # snapshot ids that no detector here ever starts
PID = "P" * 200  # a legal process id (256 bytes at most): each abort quotes it
REJECTED = "stablewatch_rejected_parts_total"
OUTBOX_FULL = {"reason": "outbox_full"}


@pytest.fixture
def running(tmp_path: Path) -> Iterator[Running]:
    config = DetectorConfig(
        data_dir=tmp_path / "d", listen="127.0.0.1:0", metrics_port=None, interval=None,
        heartbeat_timeout=600, limits=Limits(),
    )  # fmt: skip
    service = Running(config)
    try:
        yield service
    finally:
        service.stop()


class Agent:
    """A raw control stream: registers, waits for ``go``, sends ``ids`` as parts, then stays open."""

    def __init__(self, running: Running, ids: Iterator[int]) -> None:
        self.go = threading.Event()
        self.done = threading.Event()
        self.channel = grpc.insecure_channel(running.detector.address)
        self.replies = control_pb2_grpc.ControlStub(self.channel).Attach(self._messages(ids), timeout=150)

    def _messages(self, ids: Iterator[int]) -> Iterator[AgentMessage]:
        yield AgentMessage(register=control_pb2.Register(process_id=PID, address="x:1"))
        self.go.wait(60)
        for snapshot_id in ids:  # a 10-byte part for a snapshot that never ran
            yield AgentMessage(part=LocalSnapshotPart(snapshot_id=snapshot_id, process_id=PID))
        self.done.wait(150)  # half-closing would end the stream: stay attached

    def close(self) -> None:
        self.go.set()
        self.done.set()
        self.replies.cancel()
        self.channel.close()


def registered(running: Running) -> Member:
    """The member PID, once the detector has registered it."""
    return poll(lambda: running.on_loop(lambda: running.detector.coordinator.members.get(PID)), "the registration")


def aborts_queued(member: Member) -> int:
    return sum(1 for message in list(member.outbox._queue) if message.WhichOneof("kind") == "abort")


def test_a_member_that_does_not_read_is_detached_and_its_queue_bounded(running: Running) -> None:
    agent = Agent(running, iter(range(MADE_UP, MADE_UP + PARTS)))
    try:
        member = registered(running)
        agent.go.set()
        # Without the bound every part is read and answered into the queue; with it the member is detached.
        poll(
            lambda: (
                running.metric("stablewatch_agents_detached_total", **OUTBOX_FULL) >= 1
                or running.metric(REJECTED, reason="unknown_snapshot") >= PARTS
            ),
            "the member's detachment, or every part rejected",
            timeout=120,
        )
        queued = running.on_loop(member.outbox.qsize)
        assert queued <= OUTBOX_LIMIT, f"{queued} messages held for a member that does not read"
        assert running.metric("stablewatch_agents_detached_total", **OUTBOX_FULL) == 1
        assert running.on_loop(lambda: PID not in running.detector.coordinator.members)
        assert running.metric("stablewatch_agents_attached") == 0
    finally:
        agent.close()


def test_one_abort_per_snapshot_waits_for_a_member(running: Running, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="stablewatch.detector.service.detector")
    agent = Agent(running, iter([MADE_UP] * PARTS))  # all for one snapshot that never ran
    try:
        member = registered(running)
        agent.go.set()
        poll(lambda: running.metric(REJECTED, reason="unknown_snapshot") >= PARTS, "every part rejected", timeout=120)
        assert running.on_loop(lambda: aborts_queued(member)) <= 1
        assert running.on_loop(lambda: running.detector.coordinator.members.get(PID)) is member  # still attached
        assert running.metric("stablewatch_agents_detached_total", **OUTBOX_FULL) == 0
        # Every rejection is counted, but they warn once a minute, not once each.
        warnings = [r for r in caplog.records if "rejected a snapshot part" in r.getMessage()]
        assert len(warnings) <= 2, f"{len(warnings)} warnings for {PARTS} rejected parts"
    finally:
        agent.close()


def test_a_member_that_reads_gets_every_message(running: Running) -> None:
    agent = Agent(running, iter(range(MADE_UP, MADE_UP + PARTS)))
    try:
        registered(running)
        agent.go.set()
        replies = iter(agent.replies)
        assert next(replies).WhichOneof("kind") == "registered"
        aborted = [next(replies).abort.snapshot_id for _ in range(PARTS)]
        assert aborted == list(range(MADE_UP, MADE_UP + PARTS))  # every abort, in order

        def start_and_break() -> int:
            coordinator = running.detector.coordinator
            snapshot_id, _ = coordinator.begin_snapshot()
            assert coordinator.send_break(PID, control_pb2.BreakWait(break_id=7, snapshot_id=snapshot_id))
            return snapshot_id

        snapshot_id = running.on_loop(start_and_break)
        start, order = next(replies), next(replies)
        assert start.start.snapshot_id == snapshot_id
        assert order.break_wait.break_id == 7
        assert running.metric("stablewatch_agents_detached_total", **OUTBOX_FULL) == 0
        running.on_loop(lambda: running.detector.coordinator.abort(snapshot_id, "test over", "shutdown"))
    finally:
        agent.close()
