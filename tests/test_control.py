"""Tests of the agent's control stream against a minimal in-test detector on a loopback port."""

from __future__ import annotations

import asyncio
import time
from types import ModuleType
from typing import Any

import grpc
import pytest
from fake_detector import Agent, FakeDetector, serve, session, start

from conftest import free_port
from polling import async_poll, run
from stablewatch.agents import control
from stablewatch.v1 import DetectorMessage, InboundChannelState, LocalSnapshotPart
from stablewatch.v1.control_pb2 import AbortSnapshot, Ping, SnapshotsEnded, StartSnapshot

# -- helpers --------------------------------------------------------------------------------------


def part(snapshot_id: int, index: int) -> LocalSnapshotPart:
    """A part told apart from the others of its snapshot by ``index`` (the source of its one channel).

    Parts of one snapshot queued back to back may be merged into one message, in order.
    """
    return LocalSnapshotPart(snapshot_id=snapshot_id, process_id="p1", inbound=[InboundChannelState(src=f"q{index}")])


# -- tests ----------------------------------------------------------------------------------------


def test_registers_with_its_fields_and_sends_heartbeats_at_the_detectors_interval() -> None:
    async def body() -> None:
        detector = FakeDetector(heartbeat_interval_ms=10)
        agent = Agent()
        async with session(detector, agent, incarnation=3, agent_version="1.2.3") as client:
            assert await client.wait_connected(10)
            assert client.connected
            assert agent.events[-1] == ("connected", "fake")
            register = detector.registrations[0].register
            assert (register.process_id, register.address) == ("p1", "127.0.0.1:7001")
            assert (register.incarnation, register.agent_version) == (3, "1.2.3")
            await async_poll(lambda: len(detector.of_kind("heartbeat")) >= 3)
            sequences = [h.sequence for h in detector.of_kind("heartbeat")]
            assert sequences == sorted(sequences) and len(set(sequences)) == len(sequences)

    run(body())


def test_heartbeats_at_its_own_interval_when_the_detector_sets_none() -> None:
    async def body() -> None:
        detector = FakeDetector(heartbeat_interval_ms=0)
        async with session(detector, Agent(), heartbeat_interval=0.01):
            await async_poll(lambda: len(detector.of_kind("heartbeat")) >= 3)

    run(body())


def test_starts_run_in_order_pings_are_answered_meanwhile_and_parts_arrive_in_order() -> None:
    async def body() -> None:
        detector = FakeDetector()
        agent = Agent()
        release = asyncio.Event()

        async def on_start(snapshot_id: int, lifetime: float | None) -> None:
            agent.started.append(snapshot_id)
            if snapshot_id == 1:
                await release.wait()
            for i in range(3):
                assert client.report_part(part(snapshot_id, i))

        async with session(detector, agent, on_start=on_start) as client:
            assert await client.wait_connected(10)
            for k in (1, 2, 3):
                detector.send(start(k))
            detector.send(DetectorMessage(ping=Ping(nonce=42)))
            # The Pong comes back while on_start(1) is still blocked, and nothing else has started.
            await async_poll(lambda: [p.nonce for p in detector.of_kind("pong")] == [42])
            assert agent.started == [1]
            release.set()
            await async_poll(lambda: sum(len(p.inbound) for p in detector.of_kind("part")) == 9)
            assert agent.started == [1, 2, 3]
            received = [(p.snapshot_id, c.src) for p in detector.of_kind("part") for c in p.inbound]
            assert received == [(k, f"q{i}") for k in (1, 2, 3) for i in range(3)]
            assert client.report_failure(3, "too big")
            await async_poll(lambda: len(detector.of_kind("failure")) == 1)
            failure = detector.of_kind("failure")[0]
            assert (failure.snapshot_id, failure.process_id, failure.reason) == (3, "p1", "too big")

    run(body())


def test_a_start_that_finds_nothing_waiting_is_offered_to_on_start_now_where_it_is_read() -> None:
    """Idle: the start (and the ends riding on it) are taken at once, without the queue; a start
    declined, or one behind a callback still running, goes through the queue in its order."""

    async def body() -> None:
        detector = FakeDetector()
        agent = Agent()
        release = asyncio.Event()
        declining = {3}

        def on_start_now(snapshot_id: int, lifetime: float | None) -> bool:
            if snapshot_id in declining:
                return False
            agent.calls.append(("now", snapshot_id))
            return True

        async def on_start(snapshot_id: int, lifetime: float | None) -> None:
            agent.calls.append(("start", snapshot_id))
            if snapshot_id == 3:
                await release.wait()

        async with session(detector, agent, on_start=on_start, on_start_now=on_start_now) as client:
            assert await client.wait_connected(10)
            detector.send(start(1))
            detector.send(DetectorMessage(start=StartSnapshot(snapshot_id=2, ended=[1])))
            await async_poll(lambda: agent.calls == [("now", 1), ("finish", 1), ("now", 2)], "two starts taken at once")
            detector.send(start(3))  # declined: queued, and blocks in on_start
            detector.send(DetectorMessage(start=StartSnapshot(snapshot_id=4, ended=[2])))  # behind it, in order
            detector.send(DetectorMessage(ping=Ping(nonce=7)))
            await async_poll(lambda: detector.of_kind("pong"), "the pong")
            assert agent.calls[3:] == [("start", 3)]
            release.set()
            await async_poll(lambda: len(agent.calls) == 6, "the queued callbacks")
            assert agent.calls[3:] == [("start", 3), ("finish", 2), ("start", 4)]
        assert sorted(agent.finished) == [1, 2, 3, 4]  # 3 and 4 were open at stop

    run(body())


def test_abort_and_ended_call_on_finish_after_the_start() -> None:
    async def body() -> None:
        detector = FakeDetector()
        agent = Agent()
        async with session(detector, agent) as client:
            assert await client.wait_connected(10)
            detector.send(start(5))
            detector.send(start(6))
            detector.send(DetectorMessage(abort=AbortSnapshot(snapshot_id=5, reason="deadline")))
            # 9 was started by a marker only; 10's end rides on the start of 11.
            detector.send(DetectorMessage(ended=SnapshotsEnded(snapshot_ids=[6, 9])))
            detector.send(DetectorMessage(start=StartSnapshot(snapshot_id=11, ended=[10])))
            await async_poll(lambda: agent.finished == [5, 6, 9, 10])
            await async_poll(lambda: agent.started == [5, 6, 11])
        assert agent.finished == [5, 6, 9, 10, 11]  # 11 was open at stop

    run(body())


def test_detector_down_at_start_then_up_later() -> None:
    async def body() -> None:
        port = free_port()
        agent = Agent()
        client = agent.client(port)
        began = time.monotonic()
        await client.start()
        try:
            assert time.monotonic() - began < 0.5
            assert not client.connected
            assert not client.report_part(part(1, 0))
            assert not client.report_failure(1, "no detector")
            assert not await client.wait_connected(0.05)
            await async_poll(lambda: any(kind == "unreachable" for kind, _ in agent.events))

            detector = FakeDetector()
            server, _ = await serve(detector, port)
            try:
                assert await client.wait_connected(10)
                assert client.report_part(part(1, 0))
                await async_poll(lambda: len(detector.of_kind("part")) == 1)
            finally:
                await server.stop(None)
        finally:
            await client.stop()

    run(body())


def test_lost_stream_finishes_open_snapshots_and_reconnects_to_a_new_detector() -> None:
    async def body() -> None:
        detector = FakeDetector()
        server, port = await serve(detector)
        agent = Agent()
        client = agent.client(port)
        await client.start()
        try:
            assert await client.wait_connected(10)
            for k in (7, 8):
                detector.send(start(k))
            detector.send(DetectorMessage(ended=SnapshotsEnded(snapshot_ids=[8])))
            await async_poll(lambda: agent.finished == [8])

            await server.stop(None)
            await async_poll(lambda: agent.finished == [8, 7])
            assert not client.connected
            assert not client.report_part(part(7, 0))
            assert any(kind == "disconnected" for kind, _ in agent.events)

            second = FakeDetector()
            server, _ = await serve(second, port)
            assert await client.wait_connected(10)
            assert len(second.registrations) == 1
            second.send(start(9))
            await async_poll(lambda: agent.started == [7, 8, 9])
            assert client.report_part(part(9, 0))
            await async_poll(lambda: len(second.of_kind("part")) == 1)
        finally:
            await client.stop()
            await server.stop(None)
        assert agent.finished == [8, 7, 9]  # stop forgets the snapshot still open

    run(body())


def test_refused_registration_is_retried() -> None:
    async def body() -> None:
        detector = FakeDetector(refuse=2)
        agent = Agent()
        async with session(detector, agent) as client:
            assert await client.wait_connected(10)
            assert len(detector.registrations) == 3
            refusals = [event for event in agent.events if event[0] == "refused"]
            assert refusals == [("refused", "attached elsewhere")] * 2

    run(body())


class AbortingDetector(FakeDetector):
    """Ends every stream with one status after reading its Register, as a detector refusing it does."""

    def __init__(self, code: grpc.StatusCode) -> None:
        super().__init__()
        self.code = code

    async def Attach(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        self.registrations.append(await context.read())
        await context.abort(self.code, "the Register's process id holds a control character")


@pytest.mark.parametrize("code", [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED])
def test_a_registration_refused_with_a_status_is_reported_as_refused(code: grpc.StatusCode) -> None:
    """A malformed Register (INVALID_ARGUMENT) is a refusal the agent logs, not a detector that is down."""

    async def body() -> None:
        detector = AbortingDetector(code)
        agent = Agent()
        async with session(detector, agent):
            await async_poll(lambda: any(kind == "refused" for kind, _ in agent.events), "a refusal")
            refused = [detail for kind, detail in agent.events if kind == "refused"]
            assert "control character" in refused[0]
            assert not any(kind == "unreachable" for kind, _ in agent.events)

    run(body())


def test_full_queue_drops_without_blocking() -> None:
    async def body() -> None:
        detector = FakeDetector()
        agent = Agent()
        async with session(detector, agent, max_queued=10) as client:
            assert await client.wait_connected(10)
            # No await in between, so the writer cannot drain the queue.
            results = [client.report_part(part(1, i)) for i in range(15)]
            assert results == [True] * 10 + [False] * 5
            assert client.dropped == 5
            assert agent.events.count(("dropped", "part")) == 5
            channels = lambda: [c.src for p in detector.of_kind("part") for c in p.inbound]  # noqa: E731
            await async_poll(lambda: len(channels()) == 10)
            assert channels() == [f"q{i}" for i in range(10)]  # the first ten, in order (merged)

    run(body())


@pytest.mark.parametrize("right_away", [False, True], ids=["on_start", "on_start_now"])
def test_failing_callback_reports_a_failure_and_the_client_carries_on(right_away: bool) -> None:
    async def body() -> None:
        detector = FakeDetector()
        agent = Agent()

        async def on_start(snapshot_id: int, lifetime: float | None) -> None:
            agent.started.append(snapshot_id)
            if snapshot_id == 1:
                raise RuntimeError("boom")

        def on_start_now(snapshot_id: int, lifetime: float | None) -> bool:
            agent.started.append(snapshot_id)
            if snapshot_id == 1:
                raise RuntimeError("boom")
            return True

        extra = {"on_start_now": on_start_now} if right_away else {}
        async with session(detector, agent, on_start=on_start, **extra) as client:
            assert await client.wait_connected(10)
            detector.send(start(1))
            detector.send(start(2))
            await async_poll(lambda: agent.started == [1, 2])
            await async_poll(lambda: len(detector.of_kind("failure")) == 1)
            assert detector.of_kind("failure")[0].snapshot_id == 1
            assert "boom" in detector.of_kind("failure")[0].reason
            assert client.connected

    run(body())


@pytest.mark.parametrize("detector_up", [True, False])
def test_stop_leaves_no_tasks_behind(detector_up: bool) -> None:
    async def body() -> None:
        baseline = asyncio.all_tasks()  # this test and the runner's wait_for
        detector = FakeDetector()
        server, port = await serve(detector) if detector_up else (None, free_port())
        agent = Agent()
        blocked = asyncio.Event()

        async def on_start(snapshot_id: int, lifetime: float | None) -> None:
            agent.started.append(snapshot_id)
            await blocked.wait()  # still running when stop() comes

        client = agent.client(port, on_start=on_start, heartbeat_interval=0.01)
        await client.start()
        try:
            if detector_up:
                assert await client.wait_connected(10)
                detector.send(start(4))
                await async_poll(lambda: agent.started == [4])
            else:
                await async_poll(lambda: any(kind == "unreachable" for kind, _ in agent.events))
            await client.stop()
            await client.stop()  # idempotent
            assert not client.connected
            assert agent.finished == ([4] if detector_up else [])
            # At once, nothing of the client's; once the server is gone too (it cleans up its side
            # of the cancelled stream in its own time), nothing but this test.
            assert not [task for task in asyncio.all_tasks() if runs_code_of(task, control)]
        finally:
            await client.stop()
            if server is not None:
                await server.stop(None)
        await async_poll(lambda: asyncio.all_tasks() == baseline)

    run(body())


def runs_code_of(task: asyncio.Task[Any], module: ModuleType) -> bool:
    """Whether ``task`` runs a coroutine defined in ``module``."""
    code = getattr(task.get_coro(), "cr_code", None)
    return code is not None and code.co_filename == module.__file__


def test_a_starts_deadline_reaches_on_start_in_seconds() -> None:
    async def body() -> None:
        detector = FakeDetector()
        agent = Agent()
        async with session(detector, agent) as client:
            assert await client.wait_connected(10)
            detector.send(DetectorMessage(start=StartSnapshot(snapshot_id=1, deadline_ms=2500)))
            detector.send(start(2))  # no deadline: the agent's own default applies
            await async_poll(lambda: agent.started == [1, 2])
            assert agent.lifetimes == [2.5, None]

    run(body())


def test_a_part_reported_while_the_registration_is_answered_reaches_the_detector() -> None:
    """The detector counts the agent a member once it answers, and a peer's marker can make the
    agent record before it has read that answer: the part must not be dropped."""

    async def body() -> None:
        answer = asyncio.Event()
        detector = FakeDetector(answer=answer)
        async with session(detector, Agent()) as client:
            await async_poll(lambda: detector.registrations, "the registration")
            assert not client.connected
            assert client.report_part(part(7, 0))
            answer.set()
            await async_poll(lambda: detector.of_kind("part"), "the part")
            assert client.connected
            assert [p.snapshot_id for p in detector.of_kind("part")] == [7]
            assert client.dropped == 0

    run(body())


def test_a_new_detector_epoch_is_reported_before_any_start_of_the_new_stream() -> None:
    """Not at the first registration, nor when a restarted detector keeps its store (same epoch).

    Each registration names the epoch the agent follows, and once ``on_epoch`` has run a heartbeat
    carries the new one at once (this agent's own heartbeats are a minute apart).
    """

    async def body() -> None:
        first = FakeDetector(epoch=11)
        server, port = await serve(first)
        agent = Agent()
        client = agent.client(port)
        await client.start()
        try:
            assert await client.wait_connected(10)
            first.send(start(1))
            await async_poll(lambda: agent.started == [1])
            detectors = (FakeDetector(epoch=11), FakeDetector(epoch=22))
            for starts, detector in zip((2, 3), detectors, strict=True):
                await server.stop(None)
                server, _ = await serve(detector, port)
                await async_poll(lambda detector=detector: detector.registrations, "the registration")
                assert await client.wait_connected(10)
                detector.send(start(1))  # a small id again, from a fresh store
                await async_poll(lambda starts=starts: agent.started.count(1) == starts, "the start")
            assert agent.calls == [
                ("start", 1),
                ("finish", 1),  # the first stream was lost
                ("start", 1),
                ("finish", 1),  # the second was lost
                ("epoch", 22),
                ("start", 1),
            ]
            await async_poll(lambda: detector.of_kind("heartbeat"), "the heartbeat that follows the epoch")
            assert [h.epoch for h in detector.of_kind("heartbeat")] == [22]
            known = [r.register.known_epoch for d in (first, *detectors) for r in d.registrations]
            assert known == [0, 11, 11]  # the third registers still following 11: it has not forgotten yet
        finally:
            await client.stop()
            await server.stop(None)

    run(body())
