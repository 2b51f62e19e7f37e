"""A detector restarted on an empty store, while its agents stay up, gets its snapshots.

Real detectors (:class:`~stablewatch.detector.service.detector.Detector`) and in-process agents
over gRPC on 127.0.0.1. The first detector's store had handed out ids far ahead of the new one's
(its clock ran an hour fast, say), and the agents finished thousands of them: more than their
bounded memory of finished ids holds, so every id below the oldest they forgot counts as finished
to them. The new detector's ids are all below it. Only the new epoch it announces on registration
makes the agents forget the old ids and take part again.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from polling import async_poll
from stablewatch.agents import Agent
from stablewatch.detector.service.detector import Detector, DetectorConfig
from stablewatch.detector.service.query import outcome_name

FINISHED_BY_THE_AGENTS = 5000  # more than the 4096 finished ids an agent remembers
HOUR_US = 3600 * 10**6


def config(data_dir: Path, listen: str = "127.0.0.1:0") -> DetectorConfig:
    """A detector that takes snapshots only on demand, without /metrics."""
    return DetectorConfig(data_dir=data_dir, listen=listen, metrics_port=None, interval=None, heartbeat_interval=0.2)


def test_snapshots_complete_after_the_detector_restarts_on_an_empty_store(tmp_path: Path) -> None:
    async def scenario() -> None:
        first = Detector(config(tmp_path / "first"))
        await first.start()
        peers: dict[str, str] = {}
        agents = [Agent(pid, peers=peers, detector=first.address, heartbeat_interval=0.2) for pid in ("A", "B")]
        second: Detector | None = None
        stopped = False
        try:
            for agent in agents:
                await agent.start()
                peers[agent.process_id] = agent.address
            await agents[0].send("B", b"hello")
            await agents[1].send("A", b"hello")
            await async_poll(lambda: len(first.coordinator.members) == 2, "both agents attached")
            before = await first.take_snapshot(deadline=10)
            assert outcome_name(before.snapshot.outcome) == "completed", before.snapshot.abort_reason
            ahead = before.snapshot.snapshot_id + HOUR_US
            for agent in agents:
                for snapshot_id in range(ahead, ahead + FINISHED_BY_THE_AGENTS):
                    agent._core.finish_snapshot(snapshot_id)
            epoch, address = first.store.epoch, first.address
            await first.stop()
            stopped = True

            second = Detector(config(tmp_path / "second", listen=address))
            await second.start()
            assert second.store.epoch != epoch
            await async_poll(lambda: len(second.coordinator.members) == 2, "both agents attached again")
            after = await second.take_snapshot(deadline=10)
            assert outcome_name(after.snapshot.outcome) == "completed", after.snapshot.abort_reason
            assert after.snapshot.snapshot_id < ahead
            assert after.snapshot.processes == 2 and after.snapshot.channels == 2
        finally:
            for agent in agents:
                await agent.stop()
            if not stopped:
                await first.stop()
            if second is not None:
                await second.stop()

    asyncio.run(asyncio.wait_for(scenario(), 60))
