"""Breaking the waits of embedded (marker-mode) agents from a detector's control stream, over real
gRPC on 127.0.0.1: application waits in asyncio tasks and on threads, a send blocked in a
flow-control deadlock, a break for a wait that is not there, and the long-wait hints.

The detector is the scripted :class:`~fake_detector.FakeDetector`: it sends the ``BreakWait`` a
resolving detector would, and collects the ``BreakReport`` and ``WaitHint`` messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import pytest
from fake_detector import FakeDetector, serve

from polling import async_poll, run
from stablewatch.agents import Agent, AppMessage, ChannelSettings, DeadlockVictim, ThreadedAgent, WaitHandle
from stablewatch.v1.control_pb2 import BREAK_OUTCOME_ALREADY_BROKEN, BREAK_OUTCOME_BROKEN, BREAK_OUTCOME_GONE

JOIN_TIMEOUT = 30.0
BALLS = "balls"


def breaks(agent: Agent, kind: str) -> float:
    """``stablewatch_agent_breaks_total{kind}`` of ``agent``."""
    return agent.metrics.registry.get_sample_value("stablewatch_agent_breaks_total", {"kind": kind}) or 0.0


@contextlib.asynccontextmanager
async def fleet(detector: FakeDetector, make: Callable[[str], list[Agent]]) -> AsyncIterator[list[Agent]]:
    """Serve ``detector`` on a free port, start the agents ``make(address)`` returns, and wait until
    every one is attached; stop them and the server at the end."""
    server, port = await serve(detector)
    agents = make(f"127.0.0.1:{port}")
    try:
        for agent in agents:
            await agent.start()
        await async_poll(
            lambda: all(detector.attached(a.process_id) and a.detector_connected for a in agents), "agents attached"
        )
        yield agents
    finally:
        for agent in agents:
            await agent.stop()
        await server.stop(None)


# -- application waits ----------------------------------------------------------------------------


def test_an_asyncio_tasks_wait_is_broken_once_and_the_task_gets_the_victim() -> None:
    detector = FakeDetector()

    async def scenario() -> None:
        async with fleet(detector, lambda address: [Agent("A", detector=address, hint_after=None)]) as (agent,):
            waits: list[WaitHandle] = []
            victims: list[DeadlockVictim] = []
            retry = asyncio.Event()

            async def worker() -> str:
                try:
                    with agent.state.waiting("B", task="worker") as wait:
                        waits.append(wait)
                        await asyncio.Event().wait()  # B never answers: only a break ends this
                except DeadlockVictim as victim:
                    victims.append(victim)
                with agent.state.waiting("B", task="worker") as wait:  # the retry: a new instance
                    waits.append(wait)
                    await retry.wait()
                return "done"

            task = asyncio.create_task(worker(), name="worker")
            await async_poll(lambda: waits, "the wait")
            first = waits[0]
            assert [(w.task, w.instance) for w in agent.state.snapshot().waits] == [("worker", first.instance)]

            detector.break_wait("A", first.instance, break_id=1, snapshot_id=3, task="worker")
            report = await async_poll(lambda: detector.report(1), "the report of the break")
            assert (report.instance, report.outcome) == (first.instance, BREAK_OUTCOME_BROKEN)
            assert "'worker'" in report.detail and "DeadlockVictim" in report.detail
            await async_poll(lambda: len(waits) == 2, "the retry")
            (victim,) = victims
            assert victim is first.victim and victim.instance == first.instance and victim.snapshot_id == 3
            assert "A -> B -> A" in str(victim)

            # The same break again (a second detector, say): nothing happens to the retry.
            detector.break_wait("A", first.instance, break_id=2, snapshot_id=4)
            again = await async_poll(lambda: detector.report(2), "the report of the second break")
            assert again.outcome in (BREAK_OUTCOME_ALREADY_BROKEN, BREAK_OUTCOME_GONE), again
            second = waits[1]
            assert second.instance != first.instance and second.victim is None and not task.done()
            assert [w.instance for w in agent.state.snapshot().waits] == [second.instance]
            retry.set()
            assert await asyncio.wait_for(task, JOIN_TIMEOUT) == "done"
            assert victims == [victim] and breaks(agent, "application") == 1

    run(scenario())


def test_a_break_for_an_unknown_wait_is_answered_gone_and_changes_nothing() -> None:
    detector = FakeDetector()

    async def scenario() -> None:
        async with fleet(detector, lambda address: [Agent("A", detector=address, hint_after=None)]) as (agent,):
            release = asyncio.Event()
            waits: list[WaitHandle] = []

            async def worker() -> str:
                with agent.state.waiting(["B", "C"], model="or", task="worker") as wait:
                    waits.append(wait)
                    await release.wait()
                return "done"

            task = asyncio.create_task(worker())
            other = agent.state.add_wait("D", task="other")
            await async_poll(lambda: waits, "the wait")
            before = agent.state.snapshot()

            unknown = max(waits[0].instance, other) + 10**9  # never handed out
            detector.break_wait("A", unknown, break_id=7)
            report = await async_poll(lambda: detector.report(7), "the report")
            assert (report.instance, report.outcome) == (unknown, BREAK_OUTCOME_GONE)
            assert "not waiting here" in report.detail
            assert agent.state.snapshot() == before
            assert waits[0].victim is None and agent.state.handle(other).victim is None and not task.done()
            assert breaks(agent, "application") == breaks(agent, "send") == 0

            release.set()
            assert await asyncio.wait_for(task, JOIN_TIMEOUT) == "done"
            agent.state.remove_wait(other)
            detector.break_wait("A", other, break_id=8)  # a wait that ended: gone too
            assert (await async_poll(lambda: detector.report(8), "the report")).outcome == BREAK_OUTCOME_GONE

    run(scenario())


def test_a_threads_wait_is_broken_through_its_handle() -> None:
    detector = FakeDetector()

    async def scenario() -> None:
        server, port = await serve(detector)
        threaded = ThreadedAgent("T", detector=f"127.0.0.1:{port}", hint_after=None)
        await asyncio.to_thread(threaded.start)
        try:
            await async_poll(lambda: detector.attached("T") and threaded.agent.detector_connected, "attached")
            entered, release = threading.Event(), threading.Event()
            handles: list[WaitHandle] = []
            calls: list[tuple[str, DeadlockVictim]] = []
            seen: list[object] = []

            def waiter() -> None:
                with threaded.state.waiting("B", task="db-writer") as wait:
                    handles.append(wait)
                    wait.on_break(lambda victim: calls.append((threading.current_thread().name, victim)))
                    entered.set()
                    seen.append(wait.broken.wait(JOIN_TIMEOUT))  # beside what it waits for, in real code
                    release.wait(JOIN_TIMEOUT)
                    try:
                        wait.check()
                    except DeadlockVictim as victim:
                        seen.append(victim)

            thread = threading.Thread(target=waiter, name="db-writer")
            thread.start()
            try:
                await asyncio.to_thread(entered.wait, JOIN_TIMEOUT)
                (wait,) = handles
                detector.break_wait("T", wait.instance, break_id=1, task="db-writer")
                report = await async_poll(lambda: detector.report(1), "the report")
                assert report.outcome == BREAK_OUTCOME_BROKEN and "1 callback" in report.detail
                await async_poll(lambda: seen, "the thread to see the break")
                assert seen == [True]
                # Still inside its with block: a second break is "already broken", no second callback.
                detector.break_wait("T", wait.instance, break_id=2)
                again = await async_poll(lambda: detector.report(2), "the second report")
                assert again.outcome == BREAK_OUTCOME_ALREADY_BROKEN
                release.set()
            finally:
                release.set()
                await asyncio.to_thread(thread.join, JOIN_TIMEOUT)
            assert not thread.is_alive()
            assert calls == [("stablewatch-agent-T", wait.victim)]  # once, on the agent's thread
            assert seen == [True, wait.victim] and threaded.state.snapshot().waits == []
            assert breaks(threaded.agent, "application") == 1
        finally:
            await asyncio.to_thread(threaded.stop)
            await server.stop(None)

    run(scenario())


# -- a flow-control deadlock ----------------------------------------------------------------------


class Court:
    """Agents A and B passing balls to each other from their handlers; every hop of a ball is a
    message of its own (``ball:hop``), so a message not sent is a payload never received."""

    def __init__(self) -> None:
        self.agents: dict[str, Agent] = {}
        self.peers: dict[str, str] = {}
        self.received: dict[str, list[bytes]] = {"A": [], "B": []}
        self.victims: dict[str, list[tuple[bytes, DeadlockVictim]]] = {"A": [], "B": []}
        self.serves: list[asyncio.Task[None]] = []

    def make(self, address: str) -> list[Agent]:
        settings = ChannelSettings(window_entries=2, inbox_entries=2, read_ahead_entries=64)
        for pid, other in (("A", "B"), ("B", "A")):
            self.agents[pid] = Agent(
                pid,
                peers=self.peers,
                detector=address,
                handler=self._player(pid, other),
                channel_settings=settings,
                hint_after=None,
            )
        return list(self.agents.values())

    def _player(self, pid: str, other: str) -> Callable[[str, AppMessage], Coroutine[Any, Any, None]]:
        async def handler(src: str, message: AppMessage) -> None:
            self.received[pid].append(message.payload)
            if self.victims[pid]:
                return  # once broken, this player keeps every ball it gets: the play winds down
            ball, hop = message.payload.split(b":")
            forward = b"%s:%d" % (ball, int(hop) + 1)
            try:
                await self.agents[pid].send(other, forward, counters={BALLS: 1})
            except DeadlockVictim as victim:
                self.victims[pid].append((forward, victim))

        return handler

    def serve(self, balls_each: int) -> None:
        for pid, other in (("A", "B"), ("B", "A")):
            agent = self.agents[pid]
            self.peers[pid] = agent.address
            agent.state.set_counter(BALLS, balls_each)

            async def serve(agent: Agent = agent, pid: str = pid, other: str = other) -> None:
                for k in range(balls_each):
                    await agent.send(other, b"%s%d:0" % (pid.encode(), k), counters={BALLS: 1})

            self.serves.append(asyncio.create_task(serve(), name="serve"))

    def stuck(self, pid: str, peer: str) -> int | None:
        """The instance of ``pid``'s handler's send blocked on ``peer``, whose queue holds the window."""
        waits = self.agents[pid]._blocked.waits()
        return next((w.instance for w in waits if w.task == "" and [t.process for t in w.targets] == [peer]), None)

    async def stop(self) -> None:
        for task in self.serves:
            task.cancel()
        await asyncio.gather(*self.serves, return_exceptions=True)


def test_a_send_broken_in_a_flow_control_deadlock_raises_and_its_message_is_not_sent() -> None:
    detector = FakeDetector()
    court = Court()
    balls = 60  # far more than two windows of 2 and two receive queues of 2 hold

    async def scenario() -> None:
        async with fleet(detector, court.make):
            a, b = court.agents["A"], court.agents["B"]
            try:
                court.serve(balls // 2)
                await async_poll(lambda: court.stuck("A", "B") and court.stuck("B", "A"), "both handlers stuck")
                instance = court.stuck("A", "B")
                assert instance is not None

                detector.break_wait("A", instance, break_id=1)
                report = await async_poll(lambda: detector.report(1), "the report")
                assert report.outcome == BREAK_OUTCOME_BROKEN, report
                assert "to B" in report.detail and "not sent" in report.detail
                (forward, victim), *more = await async_poll(lambda: court.victims["A"], "the victim")
                assert not more and victim.instance == instance
                # A keeps what it gets from now on: B's handler and both serves drain into A, and
                # every ball ends up there, the victim's too (its unit never left A).
                await async_poll(lambda: a.state.counter(BALLS) == balls, "every ball at A", timeout=60)
                assert b.state.counter(BALLS) == 0
                assert forward not in court.received["B"]
                assert court.stuck("A", "B") is None and court.victims["B"] == []
                assert breaks(a, "send") == 1 and breaks(b, "send") == 0
                detector.break_wait("A", instance, break_id=2)  # long over
                assert (await async_poll(lambda: detector.report(2), "the report")).outcome == BREAK_OUTCOME_GONE
            finally:
                await court.stop()

    run(scenario(), timeout=120)


# -- hints ----------------------------------------------------------------------------------------


def hints_of(detector: FakeDetector, instance: int) -> list[Any]:
    return [hint for hint in detector.of_kind("hint") if hint.instance == instance]


def test_a_long_wait_is_hinted_exactly_once() -> None:
    detector = FakeDetector()

    async def scenario() -> None:
        make = lambda address: [Agent("A", detector=address, hint_after=0.02)]  # noqa: E731
        async with fleet(detector, make) as (agent,):
            first = agent.state.add_wait("B", task="slow")
            (hint,) = await async_poll(lambda: hints_of(detector, first), "the hint")
            assert hint.task == "slow" and hint.waited_ms >= 20
            # A later wait's hint comes on the same stream after every hint the first could have
            # had meanwhile (its own took at least two more looks at the first).
            second = agent.state.add_wait("C")
            await async_poll(lambda: hints_of(detector, second), "the second hint")
            assert len(hints_of(detector, first)) == 1 and len(detector.of_kind("hint")) == 2
            hinted = agent.metrics.registry.get_sample_value("stablewatch_agent_wait_hints_total")
            assert hinted == 2
            agent.state.remove_wait(first)
            agent.state.remove_wait(second)

    run(scenario())


def test_an_agent_without_a_hint_threshold_sends_no_hints() -> None:
    detector = FakeDetector()

    async def scenario() -> None:
        make = lambda address: [Agent("A", detector=address, hint_after=None, heartbeat_interval=0.05)]  # noqa: E731
        async with fleet(detector, make) as (agent,):

            def heartbeats() -> int:
                return max((h.sequence for h in detector.of_kind("heartbeat")), default=0)

            seen = heartbeats()
            token = agent.state.add_wait("B")
            # Heartbeats sent at least 0.15 s after the wait began (far past any threshold): a hint
            # would have come before them, on the same stream.
            await async_poll(lambda: heartbeats() >= seen + 4, "four more heartbeats")
            assert detector.of_kind("hint") == [] and agent._hints is None
            agent.state.remove_wait(token)

    run(scenario())


def test_a_bad_hint_threshold_is_refused_at_construction() -> None:
    with pytest.raises(ValueError, match="positive"):
        Agent("A", hint_after=0)
