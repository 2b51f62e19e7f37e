"""The detector service end to end: untrusted parts, members that die mid-snapshot, metrics."""

from __future__ import annotations

import asyncio
import threading
import urllib.request
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest
from nodes import Node, connect_all

from polling import poll
from stablewatch.detector.service.detector import Detector, DetectorConfig
from stablewatch.detector.service.query import outcome_name
from stablewatch.v1 import AgentMessage, DetectorMessage, LocalSnapshotPart, LocalState, control_pb2, control_pb2_grpc

T = TypeVar("T")


class Running:
    """A Detector on its own event-loop thread."""

    def __init__(self, config: DetectorConfig) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.detector = Detector(config)
        self.call(self.detector.start())

    def call(self, coroutine: Coroutine[Any, Any, T], timeout: float = 30) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def on_loop(self, function: Callable[[], T]) -> T:
        """Run ``function`` on the detector's thread (the store belongs to it)."""

        async def run() -> T:
            return function()

        return self.call(run())

    def metric(self, name: str, **labels: str) -> float:
        value = self.detector.metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value

    def stop(self) -> None:
        self.call(self.detector.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture
def running(tmp_path: Path) -> Iterator[Running]:
    config = DetectorConfig(data_dir=tmp_path / "data", listen="127.0.0.1:0", metrics_port=0, interval=None)
    service = Running(config)
    yield service
    service.stop()


class RawAgent:
    """A hand-driven control stream: registers as ``process_id`` and sends whatever a test wants."""

    def __init__(self, running: Running, process_id: str) -> None:
        self.running = running
        self.received: list[DetectorMessage] = []
        self.outbox: asyncio.Queue[AgentMessage | None] = asyncio.Queue()
        self.task = asyncio.run_coroutine_threadsafe(self._run(process_id), running.loop)

    async def _run(self, process_id: str) -> None:
        async with grpc.aio.insecure_channel(self.running.detector.address) as channel:
            call = control_pb2_grpc.ControlStub(channel).Attach()
            await call.write(AgentMessage(register=control_pb2.Register(process_id=process_id, address="x:1")))

            async def read() -> None:
                async for message in call:
                    self.received.append(message)

            reader = asyncio.ensure_future(read())
            while (message := await self.outbox.get()) is not None:
                await call.write(message)
            reader.cancel()
            call.cancel()

    def send_part(self, part: LocalSnapshotPart) -> None:
        self.running.loop.call_soon_threadsafe(self.outbox.put_nowait, AgentMessage(part=part))

    def starts(self) -> list[int]:
        return [m.start.snapshot_id for m in self.received if m.WhichOneof("kind") == "start"]

    def close(self) -> None:
        self.running.loop.call_soon_threadsafe(self.outbox.put_nowait, None)
        self.task.result(10)


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
        # Late: a part for the finished snapshot; the sender is told to forget that snapshot.
        q.send_part(
            LocalSnapshotPart(snapshot_id=snapshot_id, process_id="Q", inbound=[{"src": "P", "messages": [{}]}])
        )
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
