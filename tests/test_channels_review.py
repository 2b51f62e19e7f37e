"""From a review (read only) of the agents' channels around reconnects and flow control.

* A failed reconnect cleared ``held`` although the receiver's full queue still held the window:
  while the sender's reconnects kept failing, its blocked send was recorded as nothing, and a real
  flow-control deadlock was reported false. ``held`` now stays until the next stream's first
  acknowledgement says otherwise.
* A send blocked on a full window that the receiver does not hold (its stream is being
  reconnected, or acknowledgements are on their way) was recorded as nothing at all, and a passive
  process with such a send looked as if its other tasks' waits were all it had: the quiet rule
  made a deadlock up. Such a process is now recorded as active: one of its tasks is about to send.
* A receiver whose full queue held heartbeats only, its handler idle, held its sender's window;
  on a quiet cut its process node stood for its tasks, and a deadlock was made up through the
  blocked send (and that send chosen as victim), though the idle handler takes the heartbeats and
  the receiver acknowledges at once. A flow-control edge is now met when its target records no wait
  of its own (task ""): its handler is idle or in a send about to go on (waitfor.consuming).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from prometheus_client import CollectorRegistry
from snapshot_gen import rows_of
from test_acks_owed import P_INC, Q_INC, PeerStream, q_inbound

from stablewatch.agents import Agent, AppMessage, ChannelSettings
from stablewatch.agents.blocked import BlockedSends
from stablewatch.agents.core import RecordState, ReportPart, SnapshotCore
from stablewatch.agents.frames import encode
from stablewatch.agents.inbox import Inbox
from stablewatch.agents.metrics import AgentMetrics
from stablewatch.agents.outbound import OutboundChannel
from stablewatch.detector.assembly import Assembler, Completed
from stablewatch.detector.evaluation import choose_victims, evaluate, verdict
from stablewatch.detector.evaluation.columnar import evaluate_rows
from stablewatch.v1 import (
    AckPosition,
    ChannelAck,
    ChannelHello,
    ChannelSnapshot,
    GlobalSnapshot,
    LocalSnapshotPart,
    LocalState,
    ProcessSnapshot,
    RecordedMessage,
    Wait,
    WaitNode,
)

pytestmark = pytest.mark.timeout(30)

UNREACHABLE = "127.0.0.1:1"  # nothing listens there: every connection attempt fails


def full_window(*entries: object, **settings: float) -> OutboundChannel:
    """P's channel to Q (unreachable) with a window of `entries`, all written and none acknowledged,
    the hello answered (Q holds nothing yet)."""
    channel = OutboundChannel(
        "P", "Q", UNREACHABLE, incarnation=P_INC, settings=ChannelSettings(window_entries=len(entries), **settings),
        metrics=AgentMetrics(CollectorRegistry()), on_receiver_restart=lambda in_transit: None,
    )  # fmt: skip
    for entry in entries:
        channel.push(entry, 10)
    channel._acknowledge(ChannelAck(next_seq=0, receiver_incarnation=Q_INC))  # the hello's answer
    channel._next_frame()
    return channel


def hold(channel: OutboundChannel) -> None:
    """Q repeats its acknowledgement: its queue is full, and it holds the window."""
    channel._acknowledge(ChannelAck(next_seq=0, receiver_incarnation=Q_INC))


@contextlib.asynccontextmanager
async def blocked_send(blocked: BlockedSends, waiter: str, channel: OutboundChannel) -> AsyncIterator[None]:
    """A send of `waiter` ("" for the message handler) blocked on `channel` while the block lasts."""
    release = asyncio.Event()

    async def send() -> None:
        with blocked.waiting(waiter, channel):
            await release.wait()

    sending = asyncio.get_running_loop().create_task(send())
    await asyncio.sleep(0)  # the send blocks
    try:
        yield
    finally:
        release.set()
        await sending


async def waits_before_and_after_a_failed_reconnect() -> tuple[list[Wait], list[Wait]]:
    """P's handler blocked sending to Q, whose full queue holds P's window; then P's stream breaks
    and its next connection attempt fails. The flow-control waits recorded before and after."""
    channel = full_window(b"m1", b"m2", backoff_initial=0.01, backoff_max=0.02)
    hold(channel)
    assert channel.held and not channel.has_space()
    blocked = BlockedSends()
    async with blocked_send(blocked, "", channel):
        before = blocked.waits()
        channel._acks_on_stream, channel._next_to_write = 0, channel._head  # the stream broke
        with contextlib.suppress(Exception):  # the attempt to reconnect fails
            await asyncio.wait_for(channel._stream(), 10)
        after = blocked.waits()
    if channel._grpc_channel is not None:
        await channel._grpc_channel.close()
    return before, after


def two_handlers_sending_to_each_other(p_waits: list[Wait]) -> GlobalSnapshot:
    """P's and Q's handlers blocked sending to each other, both receive queues full and holding;
    Q reports no position for P (its queue full, P's stream down)."""
    q_wait = Wait(task="", targets=[WaitNode(process="P")], flow_control=True, instance=5, began_at_us=5)
    pq = ChannelSnapshot(src="P", dst="Q", sent_before_marker=2, received_before_recording=2)
    pq.sender_ack_seen.CopyFrom(AckPosition(sender_incarnation=1, receiver_incarnation=2, next_seq=0))
    qp = ChannelSnapshot(src="Q", dst="P", sent_before_marker=2, received_before_recording=2)
    held = AckPosition(sender_incarnation=2, receiver_incarnation=1, next_seq=0)
    qp.receiver_acked.CopyFrom(held)
    qp.sender_ack_seen.CopyFrom(held)
    return GlobalSnapshot(
        snapshot_id=3,
        processes=[
            ProcessSnapshot(process_id="P", state=LocalState(active=True, waits=p_waits)),
            ProcessSnapshot(process_id="Q", state=LocalState(active=True, waits=[q_wait])),
        ],
        channels=[pq, qp],
    )


def test_a_failed_reconnect_keeps_the_hold_and_the_deadlock_through_it() -> None:
    before, after = asyncio.run(waits_before_and_after_a_failed_reconnect())
    assert [w.flow_control for w in before] == [True]
    assert verdict(evaluate(two_handlers_sending_to_each_other(before)).results[0]) == "true"
    # Nothing changed at Q: its queue still holds P's window, and the deadlock stands.
    assert after == before
    assert verdict(evaluate(two_handlers_sending_to_each_other(after)).results[0]) == "true"


def test_a_passive_process_with_a_send_about_to_go_on_is_recorded_active() -> None:
    async def recorded() -> LocalState:
        # P's stream to Q never comes up (nothing listens): two heartbeats fill the window of two,
        # unacknowledged and never held, and P's task "pump" blocks on its next send.
        settings = ChannelSettings(window_entries=2, backoff_initial=0.01, backoff_max=0.02)
        agent = Agent("P", peers={"Q": UNREACHABLE}, channel_settings=settings, hint_after=None)
        await agent.start()
        try:
            assert agent.try_send("Q", b"hb", wakes=False) and agent.try_send("Q", b"hb", wakes=False)
            pump = asyncio.get_running_loop().create_task(agent.send("Q", b"work"), name="pump")
            await asyncio.sleep(0.05)
            assert not pump.done()
            agent.state.set_active(False)  # P's own work is done once pump's message is out
            parts: list[LocalSnapshotPart] = []
            agent.on_part(parts.append)
            await agent.start_snapshot(lifetime=5)
            pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pump
            [state] = [part.state for part in parts if part.HasField("state")]
            return state
        finally:
            await agent.stop()

    state = asyncio.run(recorded())
    assert state.active  # one of its tasks is about to send: not a process whose tasks all wait
    assert not any(wait.flow_control for wait in state.waits)  # the window is not held


def test_a_send_held_by_the_receiver_is_a_wait_and_leaves_the_process_passive() -> None:
    async def going_on() -> tuple[bool, list[Wait]]:
        channel = full_window(AppMessage(b"hb", None, True))
        blocked = BlockedSends()
        async with blocked_send(blocked, "pump", channel):
            unheld = blocked.going_on(), blocked.waits()
            hold(channel)
            held = blocked.going_on(), blocked.waits()
        assert unheld == (True, [])
        return held

    about_to_go, waits = asyncio.run(going_on())
    assert not about_to_go and [w.task for w in waits] == ["pump"]


HEARTBEAT = AppMessage(b"hb", None, True)  # wakes no one


def test_a_queue_full_of_heartbeats_holds_no_deadlock_when_its_handler_is_idle() -> None:
    async def q_side() -> tuple[dict[str, AckPosition], object, int]:
        inbox = Inbox(max_entries=2, max_bytes=1 << 20)
        inbound = q_inbound(inbox)
        stream = PeerStream(inbound)
        await stream.frames.put(encode(0, (), ChannelHello(src="P", dst="Q", sender_incarnation=P_INC)))
        await stream.frames.put(encode(0, [HEARTBEAT, HEARTBEAT]))
        assert (await stream.ack()).next_seq == 0  # the hello's answer: the queue is full
        assert (await stream.ack()).next_seq == 0  # the hold: P's next send is a flow-control wait
        acked, undelivered = inbound.acked(), inbox.undelivered()
        inbox.done(await inbox.next())  # Q's idle handler takes the heartbeats, nothing more
        released = (await stream.ack()).next_seq
        await stream.broken()
        return acked, undelivered, released

    acked, undelivered, released = asyncio.run(q_side())
    assert released == 2  # P's window frees as soon as Q's handler has the heartbeats
    p, q = SnapshotCore("P", ["Q"]), SnapshotCore("Q", ["P"])
    p.send("Q", 2)
    q.receive_messages("P", [HEARTBEAT, HEARTBEAT])
    seen = AckPosition(sender_incarnation=P_INC, receiver_incarnation=Q_INC, next_seq=0)
    pump = Wait(task="pump", targets=[WaitNode(process="Q")], flow_control=True, instance=9, began_at_us=9)
    t = Wait(task="t", targets=[WaitNode(process="P")], instance=1, began_at_us=1)
    assembler = Assembler()
    assembler.begin(7, ["P", "Q"])
    results = []
    for core, state, positions in (
        (p, LocalState(active=False, waits=[pump]), {"acks_seen": {"Q": seen}}),
        (q, LocalState(active=False, waits=[t]), {"acked": acked, "undelivered": undelivered}),
    ):
        assert isinstance(core.start_snapshot(7, now=0.0)[0], RecordState)
        results += [
            assembler.add_part(a.part) for a in core.record_state(7, state, **positions) if isinstance(a, ReportPart)
        ]
    [done] = [result for result in results if isinstance(result, Completed)]  # closed, every channel proven
    evaluation = evaluate(done.snapshot)
    assert verdict(evaluation.results[0]) == "false"  # P/pump is released by Q consuming
    assert choose_victims(done.snapshot, evaluation.wait_for, "youngest") == []
    assert verdict(evaluate_rows(rows_of(done.snapshot))[0]) == "false"
    # Handlers blocked on each other's held windows consume nothing: that cycle stands.
    blocked = GlobalSnapshot()
    blocked.CopyFrom(done.snapshot)
    for process, other in (("P", "Q"), ("Q", "P")):
        sends = Wait(task="", targets=[WaitNode(process=other)], flow_control=True, instance=3, began_at_us=3)
        next(proc for proc in blocked.processes if proc.process_id == process).state.waits.append(sends)
    assert verdict(evaluate(blocked).results[0]) == "true"
    assert verdict(evaluate_rows(rows_of(blocked))[0]) == "true"


def test_a_handler_whose_send_has_space_but_not_the_lock_yet_is_recorded_active() -> None:
    # From a review (read only) of 4e6ce89: P's handler blocks on a full window and gives the
    # recording lock up; two recordings wait for it (two detectors, or a hint and the schedule).
    # Space comes, the handler leaves the blocked send and waits for the lock behind the second
    # recording, which recorded P passive with nothing about the send that is about to go out.
    async def recorded() -> LocalState:
        agent = Agent("P", peers={"Q": UNREACHABLE}, hint_after=None)
        agent._lock = asyncio.Lock()  # what start() makes, without any network
        channel = full_window(b"m")
        agent._outbound["Q"] = channel
        agent._carry_out(agent._core.open_outbound("Q"))
        agent.state.set_active(False)
        parts: list[LocalSnapshotPart] = []
        agent.on_part(parts.append)
        loop = asyncio.get_running_loop()
        go = asyncio.Event()

        async def handler() -> None:  # the delivery task, running an asyncio handler's run
            async with agent._lock:
                await go.wait()
                # The acknowledgement is ready to run just as the handler blocks on the window.
                loop.call_soon(channel._acknowledge, ChannelAck(next_seq=1, receiver_incarnation=Q_INC))
                await agent.send("Q", b"x")

        agent._delivery = loop.create_task(handler())
        await asyncio.sleep(0)
        first, second = loop.create_task(agent.start_snapshot(1)), loop.create_task(agent.start_snapshot(2))
        await asyncio.sleep(0)
        go.set()
        await asyncio.gather(agent._delivery, first, second)
        [state] = [part.state for part in parts if part.snapshot_id == 2 and part.HasField("state")]
        return state

    assert asyncio.run(recorded()).active  # its handler is about to send


def test_a_task_asyncio_let_go_unnamed_is_not_the_message_handler() -> None:
    async def recorded() -> list[Wait]:
        agent = Agent("P", peers={"Q": UNREACHABLE}, hint_after=None)
        agent._lock = asyncio.Lock()
        channel = full_window(b"m")
        hold(channel)
        agent._outbound["Q"] = channel
        agent._carry_out(agent._core.open_outbound("Q"))
        loop = asyncio.get_running_loop()
        agent._delivery = loop.create_task(asyncio.sleep(3600), name="delivery-P")  # an idle handler
        pump = loop.create_task(agent.send("Q", b"x"), name="")  # a task of P's, not its handler
        await asyncio.sleep(0)
        waits = agent._blocked.waits()
        for task in (pump, agent._delivery):
            task.cancel()
        await asyncio.gather(pump, agent._delivery, return_exceptions=True)
        return waits

    [wait] = asyncio.run(recorded())
    assert wait.flow_control and wait.task.startswith("asyncio task 0x")  # not "": the process's own


def test_a_wait_the_handler_declares_holds_up_the_sends_to_it() -> None:
    # From a review (read only): P's handler declares a wait on R (state.waiting, task "") and
    # sends to Q, a send about to go on (not recorded; P active); the handler will then await R's
    # answer, holding the recording lock. R's handler is blocked on P's full window, R's heartbeats
    # queued at P. A real deadlock, P -> R -> P: P's handler never takes them.
    waits_on_r = Wait(task="", targets=[WaitNode(process="R")], instance=1, began_at_us=1)
    r_sends = Wait(task="", targets=[WaitNode(process="P")], flow_control=True, instance=2, began_at_us=2)
    into_p = ChannelSnapshot(src="R", dst="P", sent_before_marker=2)
    into_p.messages.extend(RecordedMessage(payload=b"hb", no_wake=True) for _ in range(2))  # R's heartbeats
    snapshot = GlobalSnapshot(
        snapshot_id=5,
        processes=[
            ProcessSnapshot(process_id="P", state=LocalState(active=True, waits=[waits_on_r])),
            ProcessSnapshot(process_id="Q", state=LocalState(active=False)),
            ProcessSnapshot(process_id="R", state=LocalState(active=True, waits=[r_sends])),
        ],
        channels=[into_p],
    )
    assert verdict(evaluate(snapshot).results[0]) == "true"
    assert verdict(evaluate_rows(rows_of(snapshot))[0]) == "true"
