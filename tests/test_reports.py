"""One report per process and snapshot: the ReportGatherer alone, then agents with a real detector."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from polling import async_poll
from stablewatch.agents import Agent
from stablewatch.agents.reports import ReportGatherer
from stablewatch.detector.service.detector import Detector, DetectorConfig
from stablewatch.detector.service.query import outcome_name
from stablewatch.v1 import InboundChannelState, LocalSnapshotPart, LocalState, OutboundCount


def state_part(snapshot_id: int = 1, closed: tuple[str, ...] = ()) -> LocalSnapshotPart:
    """What the core reports when it records: state, outbound counts, channels already closed."""
    part = LocalSnapshotPart(snapshot_id=snapshot_id, process_id="p", state=LocalState(active=True))
    part.outbound.append(OutboundCount(dst="q", sent_before_marker=3))
    part.inbound.extend(InboundChannelState(src=src) for src in closed)
    return part


def channel_part(src: str, snapshot_id: int = 1, received: int = 0) -> LocalSnapshotPart:
    part = LocalSnapshotPart(snapshot_id=snapshot_id, process_id="p")
    part.inbound.append(InboundChannelState(src=src, received_before_recording=received))
    return part


def run(body, window: float = 0.05) -> list[LocalSnapshotPart]:  # type: ignore[no-untyped-def]
    """Run ``body(gatherer)`` on an event loop; the parts the gatherer sent, in order."""
    sent: list[LocalSnapshotPart] = []

    async def main() -> None:
        await body(ReportGatherer(sent.append, window))

    asyncio.run(main())
    return sent


def test_a_state_part_with_no_channel_to_wait_for_goes_at_once() -> None:
    async def body(gatherer: ReportGatherer) -> None:
        gatherer.add(state_part(), open_channels=[])
        gatherer.add(state_part(2, closed=("a",)), open_channels=["a"])  # its only channel closed at recording
        assert gatherer.held == []

    assert [part.snapshot_id for part in run(body)] == [1, 2]


def test_the_channels_open_at_recording_go_with_the_state_in_one_report() -> None:
    async def body(gatherer: ReportGatherer) -> None:
        gatherer.add(state_part(closed=("a",)), open_channels=["a", "b", "c"])
        gatherer.add(channel_part("b", received=2))
        assert gatherer.held == [1]
        gatherer.add(channel_part("c", received=5))
        assert gatherer.held == []

    (report,) = run(body, window=30)  # the window never passes: the last channel sends it
    assert report.state == LocalState(active=True)
    assert [(c.src, c.received_before_recording) for c in report.inbound] == [("a", 0), ("b", 2), ("c", 5)]
    assert [(c.dst, c.sent_before_marker) for c in report.outbound] == [("q", 3)]


def test_the_report_is_merged_into_its_largest_channel_so_the_recorded_messages_are_not_copied() -> None:
    big = channel_part("b")
    big.inbound[0].messages.add(payload=b"in flight", receive_index=7)

    async def body(gatherer: ReportGatherer) -> None:
        gatherer.add(state_part(closed=("a",)), open_channels=["a", "b", "c"])
        gatherer.add(big)
        gatherer.add(channel_part("c", received=5))

    (report,) = run(body, window=30)
    assert report is big  # the others were merged into it
    assert report.state == LocalState(active=True)
    assert [(c.dst, c.sent_before_marker) for c in report.outbound] == [("q", 3)]
    assert sorted(c.src for c in report.inbound) == ["a", "b", "c"]
    (b,) = [c for c in report.inbound if c.src == "b"]
    assert [(m.payload, m.receive_index) for m in b.messages] == [(b"in flight", 7)]


def test_the_window_bounds_the_wait_and_later_channels_go_alone() -> None:
    async def body(gatherer: ReportGatherer) -> None:
        gatherer.add(state_part(), open_channels=["a", "b"])
        gatherer.add(channel_part("a"))
        await async_poll(lambda: gatherer.held == [], "the window to pass", timeout=5)
        gatherer.add(channel_part("b"))  # its sender was slow, or no member: it goes on its own

    first, second = run(body, window=0.01)
    assert first.HasField("state") and [c.src for c in first.inbound] == ["a"]
    assert not second.HasField("state") and [c.src for c in second.inbound] == ["b"]


def test_a_dropped_report_is_never_sent() -> None:
    async def body(gatherer: ReportGatherer) -> None:
        gatherer.add(state_part(1), open_channels=["a"])
        gatherer.add(state_part(2), open_channels=["a"])
        gatherer.drop(1)
        gatherer.drop_all()
        await asyncio.sleep(0.05)  # longer than the window: a timer left running would send now

    assert run(body, window=0.01) == []


def test_window_zero_sends_every_piece_at_once_and_a_negative_one_is_refused() -> None:
    async def body(gatherer: ReportGatherer) -> None:
        gatherer.add(state_part(), open_channels=["a"])
        gatherer.add(channel_part("a"))

    assert len(run(body, window=0)) == 2
    with pytest.raises(ValueError, match="report window"):
        ReportGatherer(print, -1)


@pytest.mark.parametrize("window", [0.0, 5.0])
def test_agents_send_one_report_per_snapshot_to_a_real_detector(tmp_path: Path, window: float) -> None:
    """Three agents sending to each other: with a window, one part each per snapshot (without one, each
    piece goes as it comes, merged only when it queues behind another: the snapshot completes too)."""

    async def scenario() -> dict[str, int]:
        config = DetectorConfig(data_dir=tmp_path / "data", listen="127.0.0.1:0", metrics_port=None, interval=None)
        detector = Detector(config)
        await detector.start()
        peers: dict[str, str] = {}
        ids = ("A", "B", "C")
        agents = [
            Agent(pid, peers=peers, detector=detector.address, heartbeat_interval=0.2, report_window=window)
            for pid in ids
        ]
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
            await async_poll(lambda: all(a._inbound and len(a._inbound.acked()) == 2 for a in agents), "channels open")
            for agent in agents:
                report_part = agent._control.report_part  # type: ignore[union-attr]

                def counting(part: LocalSnapshotPart, name: str = agent.process_id, send=report_part) -> bool:  # type: ignore[no-untyped-def]
                    written[name] += 1
                    return send(part)

                agent._control.report_part = counting  # type: ignore[union-attr,method-assign]
            results = await detector.take_snapshot(deadline=10)
            assert outcome_name(results.snapshot.outcome) == "completed", results.snapshot.abort_reason
            assert results.snapshot.processes == 3 and results.snapshot.channels == 6
            return written
        finally:
            for agent in agents:
                await agent.stop()
            await detector.stop()

    written = asyncio.run(asyncio.wait_for(scenario(), 60))
    if window:
        assert written == dict.fromkeys(("A", "B", "C"), 1)
