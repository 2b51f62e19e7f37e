"""RPC-mode plumbing: the detector forwards counts as ChannelTargets, the control client delivers them in order."""

from __future__ import annotations

import asyncio

from control_streams import RawAgent
from fake_detector import Agent, FakeDetector, session, start

from polling import async_poll, poll, run
from stablewatch.agents.control import ControlClient
from stablewatch.testing.detector import Running
from stablewatch.v1 import DetectorMessage, LocalSnapshotPart, LocalState, OutboundCount
from stablewatch.v1.control_pb2 import ChannelTarget, Ping, SnapshotsEnded


def target(k: int, src: str = "q", sent: int = 3) -> DetectorMessage:
    return DetectorMessage(
        channel_target=ChannelTarget(snapshot_id=k, src=src, sent=sent, src_incarnation=7, session=2)
    )


def test_rpc_mode_registers_and_channel_targets_run_in_order_with_starts_and_finishes() -> None:
    async def body() -> None:
        detector = FakeDetector()
        agent = Agent()
        targets: list[ChannelTarget] = []
        release = asyncio.Event()

        async def on_start(snapshot_id: int, lifetime: float | None) -> None:
            agent.calls.append(("start", snapshot_id))
            if snapshot_id == 1:
                await release.wait()

        def on_channel_target(channel_target: ChannelTarget) -> None:
            targets.append(channel_target)
            agent.calls.append(("target", channel_target.snapshot_id))

        async with session(
            detector, agent, on_start=on_start, rpc_mode=True, on_channel_target=on_channel_target
        ) as client:
            assert await client.wait_connected(10)
            assert detector.registrations[0].register.rpc_mode
            done = DetectorMessage(ended=SnapshotsEnded(snapshot_ids=[1]))
            for message in (start(1), target(1), done, start(2), target(2), DetectorMessage(ping=Ping(nonce=9))):
                detector.send(message)
            # The Pong shows that everything before it was read; the targets wait for their starts.
            await async_poll(lambda: detector.of_kind("pong"), "the pong")
            assert agent.calls == [("start", 1)]
            release.set()
            await async_poll(lambda: len(agent.calls) == 5, "every callback")
            assert agent.calls == [("start", 1), ("target", 1), ("finish", 1), ("start", 2), ("target", 2)]
            got = targets[0]
            assert (got.snapshot_id, got.src, got.sent, got.src_incarnation, got.session) == (1, "q", 3, 7, 2)

    run(body())


def test_without_rpc_mode_the_registration_says_so_and_a_target_without_callback_is_ignored() -> None:
    async def body() -> None:
        detector = FakeDetector()
        agent = Agent()
        async with session(detector, agent) as client:
            assert await client.wait_connected(10)
            assert not detector.registrations[0].register.rpc_mode
            detector.send(target(1))
            detector.send(start(2))
            await async_poll(lambda: agent.started == [2])
            assert client.connected and not [e for e in agent.events if e[0] == "callback-error"]

    run(body())


def test_the_coordinator_forwards_counts_to_rpc_mode_members_only(running: Running) -> None:
    """Q's part counts messages to P (RPC mode), R (marker mode) and X (not attached): only P hears."""
    targets: list[ChannelTarget] = []
    starts: list[int] = []

    async def on_start(snapshot_id: int, lifetime: float | None) -> None:
        starts.append(snapshot_id)

    def client(process_id: str, rpc_mode: bool) -> ControlClient:
        return ControlClient(
            process_id,
            "127.0.0.1:1",
            running.detector.address,
            on_start=on_start,
            on_finish=lambda snapshot_id: None,
            incarnation=41 if process_id == "R" else 0,
            rpc_mode=rpc_mode,
            on_channel_target=targets.append if rpc_mode else None,
        )

    p, r = client("P", True), client("R", False)
    running.call(p.start())
    running.call(r.start())
    q = RawAgent(running, "Q")  # registers with incarnation 0, without RPC mode
    try:
        poll(lambda: len(running.detector.coordinator.members) == 3, "three members")
        assert running.detector.coordinator.members["P"].rpc_mode
        assert not running.detector.coordinator.members["Q"].rpc_mode
        pending = asyncio.run_coroutine_threadsafe(running.detector.take_snapshot(deadline=10), running.loop)
        poll(lambda: q.starts() and len(starts) == 2, "the starts")
        k = q.starts()[0]
        outbound = [
            OutboundCount(dst="P", sent_before_marker=5, session=3),
            OutboundCount(dst="R", sent_before_marker=1),
            OutboundCount(dst="X", sent_before_marker=2),
        ]
        q.send_part(LocalSnapshotPart(snapshot_id=k, process_id="Q", state=LocalState(), outbound=outbound))
        poll(lambda: targets, "a channel target at P")
        (got,) = targets
        assert (got.snapshot_id, got.src, got.sent, got.src_incarnation, got.session) == (k, "Q", 5, 0, 3)

        # R's count towards P comes with R's registered incarnation; P's part aims at Q, which is
        # not in RPC mode: nothing is forwarded to Q.
        r_part = LocalSnapshotPart(
            snapshot_id=k,
            process_id="R",
            state=LocalState(),
            inbound=[{"src": "Q", "received_before_recording": 1}],
            outbound=[{"dst": "Q"}, {"dst": "P", "sent_before_marker": 4, "session": 1}],
        )
        running.loop.call_soon_threadsafe(r.report_part, r_part)
        poll(lambda: len(targets) == 2, "R's count at P")
        assert (targets[1].src, targets[1].sent, targets[1].src_incarnation, targets[1].session) == ("R", 4, 41, 1)
        p_part = LocalSnapshotPart(
            snapshot_id=k,
            process_id="P",
            state=LocalState(),
            # Each in the session the sender's count is of, as an RPC-mode agent reports it.
            inbound=[
                {"src": "Q", "received_before_recording": 5, "session": 3},
                {"src": "R", "received_before_recording": 4, "session": 1},
            ],
            outbound=[{"dst": "Q"}],
        )
        running.loop.call_soon_threadsafe(p.report_part, p_part)
        q.send_part(LocalSnapshotPart(snapshot_id=k, process_id="Q", inbound=[{"src": "P"}, {"src": "R"}]))
        results = pending.result(20)
        assert results.snapshot.outcome == 2  # completed
        assert not any(m.WhichOneof("kind") == "channel_target" for m in q.received)
        assert len(targets) == 2
    finally:
        q.close()
        running.call(p.stop())
        running.call(r.stop())
