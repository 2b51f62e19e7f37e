"""A review of the embedded (marker-mode) agent for parts that would claim something untrue.

Each test pins one case where a snapshot could have said something the system never was, or an
agent told its application something untrue: a message lost from the cut after a sender
restarted; an acknowledgement the receiver owes left out of its acknowledgement position (a
flow-control deadlock that is none); a task name the detector reads as one wait of another task,
or refuses (a state keeper's wait, or a blocked send's asyncio task); a threaded send reported
as timed out that went later all the same. Raw ``Peer.Channel`` streams (as in
test_bad_frames.py) stand in for senders, so a restart is one new hello.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable

import grpc
import pytest
from core_actions import parts

from polling import async_poll, poll
from stablewatch.agents import Agent, AppMessage, ChannelSettings, ThreadedAgent
from stablewatch.agents.core import Marker, RecordState, SnapshotCore, SnapshotFailed
from stablewatch.agents.frames import encode
from stablewatch.agents.state import LocalStateKeeper
from stablewatch.v1 import ChannelAck, ChannelFrame, ChannelHello, LocalSnapshotPart, LocalState, channel_pb2_grpc
from stablewatch.v1.bounds import MAX_TASK_BYTES, names_a_wait, text_problem

TIMEOUT = 10.0
FAILED = "stablewatch_agent_snapshots_failed_total"


# -- the state keeper: task names the detector takes for one wait of a task --------------------


@pytest.mark.parametrize("task", ["worker[wait 1]", "t[wait 12]", "[wait 0]"])
def test_a_waiting_task_named_like_one_wait_of_a_task_is_refused(task: str) -> None:
    """The detector names the k-th wait of a task with several ``task[wait k]`` and refuses a part
    whose task has that form; the keeper refuses it at once, naming the task."""
    state = LocalStateKeeper()
    with pytest.raises(ValueError, match=r"\[wait N\]") as info, state.waiting("B", task=task):
        pass
    assert repr(task) in str(info.value)
    with pytest.raises(ValueError, match=r"\[wait N\]"):
        state.add_wait("B", task=task)
    with pytest.raises(ValueError, match=r"wait target task .*\[wait N\]"):
        state.add_wait([("B", task)])
    assert not state.snapshot().waits, "a refused wait must not be registered"


@pytest.mark.parametrize("task", ["worker[wait]", "t[wait 1] ", "t[wait 1]x", "[wait x]", "t [wait1]"])
def test_task_names_that_only_look_alike_are_accepted(task: str) -> None:
    state = LocalStateKeeper()
    with state.waiting([("B", task)], task=task):
        assert [w.task for w in state.snapshot().waits] == [task]


# -- a sender restart with its old messages still queued ---------------------------------------


def _hello(incarnation: int) -> ChannelHello:
    return ChannelHello(src="A", dst="B", sender_incarnation=incarnation)


async def _send(call: grpc.aio.StreamStreamCall, frame: ChannelFrame) -> ChannelAck:
    await call.write(frame)
    ack = await call.read()
    assert ack is not grpc.aio.EOF, "the stream ended instead of acknowledging"
    return ack


def _with_agent_b(
    scenario: Callable[[Agent, channel_pb2_grpc.PeerStub, asyncio.Event], Awaitable[None]],
    settings: ChannelSettings | None = None,
) -> None:
    """Agent B whose async handler blocks on its first message until the event is set."""

    async def main() -> None:
        release = asyncio.Event()
        got: list[bytes] = []

        async def handler(src: str, message: AppMessage) -> None:
            got.append(message.payload)
            if len(got) == 1:
                await release.wait()

        agent = Agent("B", handler=handler, channel_settings=settings)
        await agent.start()
        channel = grpc.aio.insecure_channel(agent.address)
        try:
            await scenario(agent, channel_pb2_grpc.PeerStub(channel), release)
        finally:
            await channel.close()
            await agent.stop()

    asyncio.run(asyncio.wait_for(main(), 3 * TIMEOUT))


def test_a_snapshot_recorded_with_a_restarted_senders_messages_still_queued_fails() -> None:
    """A sender restarts while two of its old incarnation's messages wait in B's receive queue.
    Its counts begin again without them, so a recording made while one still waits could show
    it nowhere: not received (B's state has not had it), not in flight (its channel's counts are
    the new incarnation's). Such a cut would lose a message that is about to wake B (a phantom
    deadlock if B waits on A): the snapshot must fail, not report a part that omits it."""

    async def scenario(agent: Agent, stub: channel_pb2_grpc.PeerStub, release: asyncio.Event) -> None:
        parts: list[LocalSnapshotPart] = []
        agent.on_part(parts.append)
        registry = agent.metrics.registry
        old = stub.Channel(timeout=TIMEOUT)
        # Two frames, so two runs: the handler blocks in the first, the second waits queued.
        assert (await _send(old, encode(0, [AppMessage(b"old0")], _hello(1)))).next_seq == 1
        assert (await _send(old, encode(1, [AppMessage(b"old1", {"tokens": 3})]))).next_seq == 2
        new = stub.Channel(timeout=TIMEOUT)
        assert (await _send(new, encode(0, [], _hello(2)))).next_seq == 0  # A restarted: counts begin again
        failed_before = registry.get_sample_value(FAILED) or 0
        recording = asyncio.ensure_future(agent.start_snapshot())  # waits for the handler to return
        await async_poll(lambda: _lock_waited(agent), "the start waiting for the recording lock")
        release.set()
        snapshot_id = await asyncio.wait_for(recording, TIMEOUT)
        reported = [p for p in parts if p.snapshot_id == snapshot_id]
        in_flight = [bytes(x) for p in reported for c in p.inbound for x in c.payloads]
        assert not reported or b"old1" in in_flight, f"a part that omits the queued old1: {reported}"
        await async_poll(lambda: (registry.get_sample_value(FAILED) or 0) > failed_before, "the snapshot failed")
        old.cancel()
        new.cancel()

    _with_agent_b(scenario)


# -- acknowledgement positions: the one a receiver is bound to send ------------------------------


def _lock_waited(agent: Agent) -> bool:
    """Whether something waits for the agent's recording lock (CPython's asyncio.Lock internals)."""
    lock = agent._lock
    return lock is not None and bool(getattr(lock, "_waiters", None))


def test_a_receiver_recording_as_its_queue_frees_reports_the_acknowledgement_it_owes() -> None:
    """B's receive queue (one message) is full, so it holds A's window: a send of A blocked on it
    is a flow-control wait on B. B's handler then takes the messages and the queue has room: B's
    agent will acknowledge them, with nothing more from B's application, and A's send will go.
    A marker that waited for the handler records B in that very step, before the acknowledgement
    is written. B's part must say where its acknowledgements stand for that cut, the one it owes
    included: otherwise the detector sees no acknowledgement in transit, keeps A's flow-control
    edge, and a wait of B on A closes a cycle that is no deadlock (A is about to send)."""

    async def scenario(agent: Agent, stub: channel_pb2_grpc.PeerStub, release: asyncio.Event) -> None:
        parts: list[LocalSnapshotPart] = []
        agent.on_part(parts.append)
        call = stub.Channel(timeout=TIMEOUT)
        hello = ChannelHello(src="A", dst="B", sender_incarnation=1)
        await call.write(encode(0, [AppMessage(b"m0"), AppMessage(b"m1")], hello))
        # The queue is full: the hello is answered with A's own start, then the window is held.
        assert [(await call.read()).next_seq for _ in range(2)] == [0, 0]
        await call.write(encode(2, [Marker(7)]))  # waits for the handler (it holds the lock)
        await async_poll(lambda: _lock_waited(agent), "the marker waiting for the recording lock")
        release.set()
        ack = await asyncio.wait_for(call.read(), TIMEOUT)
        assert ack.next_seq >= 2, "B acknowledges what its handler took, by itself"
        (part,) = [p for p in parts if p.snapshot_id == 7]
        (channel,) = [c for c in part.inbound if c.src == "A"]
        assert channel.HasField("acked"), part
        assert channel.acked.next_seq == 2, f"B recorded with room in its queue but reported {channel.acked}"
        call.cancel()

    _with_agent_b(scenario, ChannelSettings(inbox_entries=1))


def test_core_fails_a_recording_its_driver_cannot_vouch_for() -> None:
    """``record_state(..., unprovable=reason)``: the snapshot fails with the reason, no part goes
    (no part could be true), and messages recorded later report nothing for it either."""
    core = SnapshotCore("B", ["A"])
    actions = core.start_snapshot(5, now=0.0)
    assert isinstance(actions[0], RecordState)
    done = core.record_state(5, LocalState(active=True), unprovable="a message no channel counts")
    assert done == (SnapshotFailed(5, "process B: a message no channel counts"),)
    assert parts(core.receive_message("A", AppMessage(b"late"))) == []
    assert core.active_snapshots == [5], "it stays until the detector ends it, its markers ignored"
    assert core.receive_marker("A", 5) == ()


# -- a threaded send that timed out -------------------------------------------------------------


def test_a_threaded_send_that_timed_out_is_not_sent_later() -> None:
    """``ThreadedAgent.send(timeout=...)`` raising TimeoutError tells the thread its message (and
    the units it carries) did not go; the send must not go on blocked on the agent's loop and
    leave later, taking the counters then, behind the thread's back."""
    gate = threading.Event()
    got: list[bytes] = []

    def handler(src: str, message: AppMessage) -> None:
        got.append(message.payload)
        if message.payload == b"m1":
            gate.wait(TIMEOUT)  # B's loop stops: nothing is acknowledged, A's window stays full

    with ThreadedAgent("B", handler=handler) as b:
        settings = ChannelSettings(window_entries=1)
        with ThreadedAgent("A", peers={"B": b.address}, channel_settings=settings) as a:
            a.state.set_counter("tokens", 5)
            a.send("B", b"m1")
            poll(lambda: got == [b"m1"], "m1 delivered")
            with pytest.raises(TimeoutError):
                a.send("B", b"m2", counters={"tokens": 2}, timeout=0.2)
            gate.set()
            a.send("B", b"m3")
            poll(lambda: b"m3" in got, "m3 delivered")
            assert got == [b"m1", b"m3"], "the timed-out m2 went all the same"
            assert a.state.counter("tokens") == 5


# -- flow-control waits named by their asyncio task ---------------------------------------------


@pytest.mark.parametrize("name", ["sender[wait 2]", "line\nbreak", "x" * 2000])
def test_a_flow_control_wait_of_a_task_named_as_the_detector_refuses_still_counts(name: str) -> None:
    """A send blocked on a full window is recorded as a wait of its asyncio task, by the task's
    name. A name the detector refuses (the form it gives one wait of a task, a control character,
    over its length) would make every part recorded meanwhile malformed, and the deadlock behind
    the full window never found: the wait is reported under a name the detector takes."""

    async def scenario(b: Agent, stub: channel_pb2_grpc.PeerStub, release: asyncio.Event) -> None:
        a = Agent("A", peers={"B": b.address}, channel_settings=ChannelSettings(window_entries=1))
        await a.start()
        parts: list[LocalSnapshotPart] = []
        a.on_part(parts.append)
        try:

            async def sender() -> None:
                await a.send("B", b"m0")
                await a.send("B", b"m1")  # B's queue holds m0: B holds the window, this blocks

            task = asyncio.get_running_loop().create_task(sender(), name=name)
            await async_poll(
                lambda: "B" in a._outbound and a._outbound["B"].held and not task.done(), "A's window held by B"
            )
            snapshot_id = await a.start_snapshot()
            (part,) = [p for p in parts if p.snapshot_id == snapshot_id]
            (wait,) = part.state.waits
            assert wait.flow_control and [t.process for t in wait.targets] == ["B"]
            assert wait.task, "a task's wait, not the whole process's"
            assert not names_a_wait(wait.task) and text_problem(wait.task, MAX_TASK_BYTES) is None, wait.task[:80]
            release.set()
            await asyncio.wait_for(task, TIMEOUT)
        finally:
            await a.stop()

    _with_agent_b(scenario, ChannelSettings(inbox_entries=1))
