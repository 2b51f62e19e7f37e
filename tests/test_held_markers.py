"""Snapshots that cost a channel nothing of its own: held markers and one part per process.

A detector snapshot's marker waits on its channel and goes in front of the next message (the
core's *Markers may wait*); a local snapshot's goes at once. Real agents over gRPC on 127.0.0.1;
the last test adds a real detector.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from polling import async_poll, run
from stablewatch.agents import Agent
from stablewatch.agents.core import LOCAL_ID_BASE
from stablewatch.detector.service.detector import Detector, DetectorConfig
from stablewatch.detector.service.query import outcome_name
from stablewatch.v1 import LocalSnapshotPart


def metric(agent: Agent, name: str) -> float:
    return agent.metrics.registry.get_sample_value(f"stablewatch_agent_{name}_total") or 0.0


async def pair(parts: list[LocalSnapshotPart], delivered: list[bytes]) -> tuple[Agent, Agent]:
    """A -> B, started, with one message delivered (the channel is open), B's parts in ``parts``."""
    b = Agent("B", handler=lambda src, message: delivered.append(message.payload))
    b.on_part(parts.append)
    await b.start()
    a = Agent("A", peers={"B": b.address})
    await a.start()
    await a.send("B", b"before")
    await async_poll(lambda: delivered == [b"before"], "the first message delivered")
    return a, b


def test_a_detector_snapshots_marker_waits_for_the_next_message_and_goes_in_front_of_it() -> None:
    async def scenario() -> None:
        parts: list[LocalSnapshotPart] = []
        delivered: list[bytes] = []
        a, b = await pair(parts, delivered)
        try:
            await b.start_snapshot(5)  # as a detector's start would: B first, then A
            await a.start_snapshot(5)
            assert a._outbound["B"].held_markers == [5]
            assert metric(a, "markers_sent") == 0
            await a.send("B", b"after")
            assert a._outbound["B"].held_markers == []
            await async_poll(lambda: delivered == [b"before", b"after"], "the next message delivered")
            assert metric(a, "markers_sent") == metric(b, "markers_received") == 1
            # The marker came first: B took "after" as sent after A recorded, not as in flight.
            mine = [part for part in parts if part.snapshot_id == 5]
            assert len(mine) == 1 and mine[0].HasField("state")
            (channel,) = mine[0].inbound
            assert (channel.src, channel.received_before_recording, list(channel.messages)) == ("A", 1, [])
        finally:
            await a.stop()
            await b.stop()

    run(scenario())


def test_a_local_snapshots_marker_goes_at_once() -> None:
    """No detector starts a local snapshot's other processes: its markers must travel."""

    async def scenario() -> None:
        parts: list[LocalSnapshotPart] = []
        a, b = await pair(parts, [])
        try:
            snapshot_id = await a.start_snapshot()
            assert snapshot_id >= LOCAL_ID_BASE
            assert a._outbound["B"].held_markers == []
            await async_poll(lambda: any(part.snapshot_id == snapshot_id for part in parts), "B recording from it")
            assert metric(a, "markers_sent") == metric(b, "markers_received") == 1
        finally:
            await a.stop()
            await b.stop()

    run(scenario())


def test_a_held_marker_is_dropped_at_its_snapshots_deadline() -> None:
    async def scenario() -> None:
        delivered: list[bytes] = []
        a, b = await pair([], delivered)
        loop = asyncio.get_running_loop()
        try:
            await a.start_snapshot(7, lifetime=0.05)
            deadline = a._core.deadline(7)
            assert deadline is not None and a._outbound["B"].held_markers == [7]
            await async_poll(lambda: loop.time() > deadline, "the deadline")
            await a.send("B", b"after")
            await async_poll(lambda: delivered == [b"before", b"after"], "the next message delivered")
            assert metric(a, "markers_sent") == metric(b, "markers_received") == 0
        finally:
            await a.stop()
            await b.stop()

    run(scenario())


def test_a_snapshot_of_processes_with_nothing_in_flight_costs_each_one_part_and_no_marker(tmp_path: Path) -> None:
    """Three agents that have all talked to each other: each reports once, and no marker is written."""

    async def scenario() -> None:
        config = DetectorConfig(data_dir=tmp_path / "data", listen="127.0.0.1:0", metrics_port=None, interval=None)
        detector = Detector(config)
        await detector.start()
        peers: dict[str, str] = {}
        ids = ("A", "B", "C")
        agents = [Agent(pid, peers=peers, detector=detector.address, heartbeat_interval=0.2) for pid in ids]
        written: dict[str, int] = dict.fromkeys(ids, 0)
        try:
            for agent in agents:
                await agent.start()
                peers[agent.process_id] = agent.address
            for agent in agents:
                for other in ids:
                    if other != agent.process_id:
                        await agent.send(other, b"hello")
            await async_poll(lambda: len(detector.coordinator.members) == 3, "three agents attached")

            def every_hello_in() -> bool:
                return all(a._core.received_count(o) == 1 for a in agents for o in ids if o != a.process_id)

            await async_poll(every_hello_in, "every hello in")
            for agent in agents:
                report_part = agent._links.clients[0].report_part  # type: ignore[union-attr]

                def counting(part: LocalSnapshotPart, name: str = agent.process_id, send=report_part) -> bool:  # type: ignore[no-untyped-def]
                    written[name] += 1
                    return send(part)

                agent._links.clients[0].report_part = counting  # type: ignore[union-attr,method-assign]
            results = await detector.take_snapshot(deadline=10)
            assert outcome_name(results.snapshot.outcome) == "completed", results.snapshot.abort_reason
            assert results.snapshot.processes == 3 and results.snapshot.channels == 6
            assert written == dict.fromkeys(ids, 1)
            assert sum(metric(a, "markers_sent") for a in agents) == 0
            assert all(a._outbound[o].held_markers for a in agents for o in a._outbound)
        finally:
            for agent in agents:
                await agent.stop()
            await detector.stop()

    run(scenario(), timeout=60)


def test_acknowledged_messages_and_markers_leave_the_window_soon() -> None:
    """A window keeps fewer than 256 acknowledged entries, not thousands: markers are tuples, and
    every full garbage collection of the process walks what it keeps."""

    async def scenario() -> None:
        parts: list[LocalSnapshotPart] = []
        delivered: list[bytes] = []
        a, b = await pair(parts, delivered)
        try:
            for number in range(2000):
                if number % 134 == 0:  # 15 snapshots, within max_recordings (they are never finished)
                    await a.start_snapshot()  # a local snapshot's marker goes into the window at once
                await a.send("B", b"m%d" % number)
            channel = a._outbound["B"]
            await async_poll(lambda: len(delivered) == 2001, "every message delivered")
            await async_poll(lambda: channel.unacknowledged == 0, "every entry acknowledged")
            assert metric(a, "markers_sent") == 15  # the markers did go through the window
            assert len(channel._entries) < 256, len(channel._entries)
        finally:
            await a.stop()
            await b.stop()

    run(scenario())
