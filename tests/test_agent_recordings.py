"""The agent ends its recordings by itself: its event loop expires them; local ids are its own.

In-process asyncio agents over gRPC on 127.0.0.1, without a detector.
"""

from __future__ import annotations

from polling import async_poll, run
from stablewatch.agents import Agent
from stablewatch.agents.core import LOCAL_ID_BASE
from stablewatch.v1 import LocalSnapshotPart

FAILED = "stablewatch_agent_snapshots_failed_total"


def test_recordings_no_one_finishes_are_dropped_at_their_deadline() -> None:
    """A's local snapshots reach B by markers; no detector ever finishes them. Both drop them."""

    async def scenario() -> None:
        b = Agent("B", recording_lifetime=0.5, expire_interval=0.05)
        await b.start()
        a = Agent("A", peers={"B": b.address}, recording_lifetime=0.5, expire_interval=0.05)
        parts: list[LocalSnapshotPart] = []
        b.on_part(parts.append)
        await a.start()
        try:
            await a.send("B", b"opens the channel")
            snapshot_id = await a.start_snapshot()
            assert snapshot_id >= LOCAL_ID_BASE
            assert await a.start_snapshot() == snapshot_id + 1
            await async_poll(lambda: any(p.snapshot_id == snapshot_id for p in parts), "B recording by the marker")
            assert snapshot_id in b._core.active_snapshots
            await async_poll(
                lambda: not a._core.active_snapshots and not b._core.active_snapshots, "both recordings dropped"
            )
            assert a.metrics.registry.get_sample_value(FAILED) == 2
            assert b.metrics.registry.get_sample_value(FAILED) == 2
        finally:
            await a.stop()
            await b.stop()

    run(scenario())


def test_a_start_with_a_lifetime_overrides_the_default() -> None:
    async def scenario() -> None:
        agent = Agent("A", recording_lifetime=3600.0, expire_interval=0.05)
        await agent.start()
        try:
            lasting = await agent.start_snapshot()
            await agent.start_snapshot(lifetime=0.2)
            await async_poll(lambda: agent._core.active_snapshots == [lasting], "the brief one dropped")
        finally:
            await agent.stop()

    run(scenario())


def test_a_part_listener_that_raises_breaks_neither_the_channel_nor_the_other_listeners() -> None:
    """B's first listener raises on every part. The marker's frame is still taken once (had the
    error broken the stream, the frame would come again and its marker twice), later snapshots and
    messages still arrive, and the second listener gets every part."""

    async def scenario() -> None:
        got: list[bytes] = []
        b = Agent("B", handler=lambda src, message: got.append(message.payload))
        parts: list[LocalSnapshotPart] = []

        def broken(part: LocalSnapshotPart) -> None:
            raise RuntimeError("a listener with a bug")

        b.on_part(broken)
        b.on_part(parts.append)
        await b.start()
        a = Agent("A", peers={"B": b.address})
        await a.start()
        try:
            await a.send("B", b"opens the channel")
            first = await a.start_snapshot()
            await a.send("B", b"after the marker")
            second = await a.start_snapshot()
            await async_poll(lambda: {first, second} <= {p.snapshot_id for p in parts if p.inbound}, "both parts")
            await async_poll(lambda: len(got) == 2, "both messages")
            assert got == [b"opens the channel", b"after the marker"]
            assert a._outbound["B"].last_error == ""
        finally:
            await a.stop()
            await b.stop()

    run(scenario())
