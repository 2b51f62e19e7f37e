"""Handlers that send to each other: acknowledgements never wait for a handler blocked on a send.

In-process asyncio agents over gRPC on 127.0.0.1, attached to a ``StubDetector``. Balls are
tokens (counter ``balls``): each handler passes every ball it gets on to the other process with
``await send``, so a handler is often blocked on a full window while the other one sends to it.

* With fewer balls than the channels and receive queues hold, play goes on however small the
  windows: a receiver acknowledges what it queued, not what its handler finished. Snapshots taken
  meanwhile are consistent and find no deadlock (no receiver ever holds a window).
* With more balls than they hold, both handlers end up blocked sending to each other, each
  receiver's queue full: a genuine deadlock. The processes still record (a handler blocked in
  ``send`` lets them), markers still get through the full windows, and the detector's evaluation
  reports the deadlock with its cycle A -> B -> A.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

from detector_stub import StubDetector

from polling import async_poll, run
from stablewatch.agents import Agent, AppMessage, ChannelSettings
from stablewatch.detector.evaluation import evaluate, result_named, verdict
from stablewatch.detector.evaluation.waitfor import label
from stablewatch.v1 import AckPosition, Evaluation, GlobalSnapshot

BALLS = "balls"


class Court:
    """Agents A and B passing balls back and forth, each serving its first balls from a task."""

    def __init__(self, detector: StubDetector, settings: ChannelSettings) -> None:
        self.peers: dict[str, str] = {}
        self.hops = {"A": 0, "B": 0}
        self.agents = {
            pid: Agent(
                pid,
                peers=self.peers,
                detector=detector.address,
                handler=self._player(pid, other),
                channel_settings=settings,
                heartbeat_interval=0.2,
            )
            for pid, other in (("A", "B"), ("B", "A"))
        }
        self.serves: list[asyncio.Task[None]] = []

    def _player(self, pid: str, other: str) -> Callable[[str, AppMessage], Coroutine[Any, Any, None]]:
        async def handler(src: str, message: AppMessage) -> None:
            self.hops[pid] += 1
            await self.agents[pid].send(other, message.payload, counters={BALLS: 1})

        return handler

    async def start(self) -> None:
        for agent in self.agents.values():
            agent.state.set_counter(BALLS, 0)
            await agent.start()
            self.peers[agent.process_id] = agent.address

    def serve(self, balls_each: int) -> None:
        """Each process sends ``balls_each`` balls to the other from a task named ``serve``."""
        for pid, other in (("A", "B"), ("B", "A")):
            agent = self.agents[pid]
            agent.state.add(BALLS, balls_each)

            async def serve(agent: Agent = agent, other: str = other) -> None:
                for _ in range(balls_each):
                    await agent.send(other, b"ball", counters={BALLS: 1})

            self.serves.append(asyncio.get_running_loop().create_task(serve(), name="serve"))

    async def stop(self) -> None:
        for task in self.serves:
            task.cancel()
        await asyncio.gather(*self.serves, return_exceptions=True)
        for agent in self.agents.values():
            await agent.stop()


def assert_consistent(snapshot: GlobalSnapshot, balls: int) -> Evaluation:
    """Both processes in the cut, every channel proved, every ball somewhere; the evaluation."""
    assert [p.process_id for p in snapshot.processes] == ["A", "B"]
    for channel in snapshot.channels:
        assert channel.received_before_recording + len(channel.messages) == channel.sent_before_marker
    evaluation = evaluate(snapshot, {BALLS: balls})
    conservation = result_named(evaluation, f"conservation({BALLS})")
    assert conservation is not None and verdict(conservation) == "true", conservation
    return evaluation


def test_handlers_ping_ponging_through_windows_of_one_make_progress(detector: StubDetector) -> None:
    balls = 40  # in flight at once: far fewer than the receive queues (4096 each) hold

    async def scenario() -> None:
        court = Court(detector, ChannelSettings(window_entries=1))
        try:
            await court.start()
            await asyncio.to_thread(detector.wait_members, {"A", "B"})
            court.serve(balls // 2)
            snapshots = []
            for round_ in range(1, 4):
                target = 300 * round_
                await async_poll(lambda t=target: min(court.hops.values()) >= t, f"{target} hops each", timeout=60)
                snapshots.append(await asyncio.to_thread(detector.snapshot, 20))
            for snapshot in snapshots:
                deadlock = result_named(assert_consistent(snapshot, balls), "deadlock")
                assert deadlock is not None and verdict(deadlock) == "false", deadlock
        finally:
            await court.stop()

    run(scenario(), timeout=90)


def test_handlers_blocked_sending_to_each_other_are_reported_as_a_deadlock_with_its_cycle(
    detector: StubDetector,
) -> None:
    balls = 60  # far more than two windows of 2 and two receive queues of 2 hold

    async def scenario() -> None:
        settings = ChannelSettings(window_entries=2, inbox_entries=2, read_ahead_entries=64)
        court = Court(detector, settings)
        a, b = court.agents["A"], court.agents["B"]

        def stuck(agent: Agent, peer: str) -> bool:
            """The agent's handler is blocked sending to ``peer``, whose queue holds the window."""
            return any(w.task == "" and [t.process for t in w.targets] == [peer] for w in agent._blocked.waits())

        try:
            await court.start()
            await asyncio.to_thread(detector.wait_members, {"A", "B"})
            court.serve(balls // 2)
            await async_poll(lambda: stuck(a, "B") and stuck(b, "A"), "both handlers stuck", timeout=60)
            snapshot = await asyncio.to_thread(detector.snapshot, 20)
            evaluation = assert_consistent(snapshot, balls)
            deadlock = result_named(evaluation, "deadlock")
            assert deadlock is not None and verdict(deadlock) == "true", deadlock
            cycle = [label(node) for node in deadlock.deadlock.cycle]
            assert " -> ".join([*cycle, cycle[0]]) == "A -> B -> A"
            assert {label(node) for node in deadlock.deadlock.deadlocked} >= {"A", "B"}
            # The balls stuck in the full windows and queues are in flight: they wake no one,
            # since only the receiver consuming releases a flow-control wait.
            assert any(channel.messages for channel in snapshot.channels)
            # Every acknowledgement has arrived: the positions at the two ends' recordings are
            # those of the channel's incarnations, and equal (none is in transit to release a wait).
            for channel in snapshot.channels:
                sender, receiver = court.agents[channel.src], court.agents[channel.dst]
                position = AckPosition(
                    sender_incarnation=sender.incarnation,
                    receiver_incarnation=receiver.incarnation,
                    next_seq=channel.sender_ack_seen.next_seq,
                )
                assert channel.sender_ack_seen == position, channel
                assert channel.receiver_acked == position, channel
        finally:
            await court.stop()

    run(scenario(), timeout=90)
