"""From a review (read only): an acknowledgement owed to a sender whose stream is down is in the cut.

P's task sends to Q; Q's receive queue is full, so Q answers P's hello with P's own starting point
and then holds P's window: P's send is a flow-control wait on Q. P's stream to Q breaks (a network
blip, or Q's gRPC server restarted to reload certificates, which the sequence state survives) and
P backs off before reconnecting. Meanwhile Q's handler consumes the queue, and Q's task waits on P
for its next message, the one P's blocked send carries. A snapshot recorded now showed the channel
without Q's position (only open streams counted), so no acknowledgement was in transit and the
flow-control edge stood: deadlock true. But the answer to P's next hello acknowledges everything
Q accepted, P's send goes out and Q's task is woken: the deadlock was made up. Q now reports the
position it owes to every sender of its current incarnation while its queue has room.

Everything here is real code: Q's ``InboundChannels`` (driven with in-memory request streams),
both processes' ``SnapshotCore``, the detector's ``Assembler``, ``evaluate`` and the columnar
evaluation.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from prometheus_client import CollectorRegistry
from snapshot_gen import rows_of

from stablewatch.agents.core import AppMessage, Entry, RecordState, ReportPart, SnapshotCore
from stablewatch.agents.frames import encode
from stablewatch.agents.inbound import InboundChannels
from stablewatch.agents.inbox import Inbox
from stablewatch.agents.metrics import AgentMetrics
from stablewatch.detector.assembly import Assembler, Completed
from stablewatch.detector.evaluation import evaluate, verdict
from stablewatch.detector.evaluation.columnar import evaluate_rows
from stablewatch.v1 import (
    AckPosition,
    ChannelAck,
    ChannelFrame,
    ChannelHello,
    GlobalSnapshot,
    LocalState,
    Wait,
    WaitNode,
)

pytestmark = pytest.mark.timeout(30)

P_INC, Q_INC = 1, 2


class _Plaintext:
    """A servicer context without a peer certificate."""

    def auth_context(self) -> dict[str, list[bytes]]:
        return {}


class PeerStream:
    """One ``Channel`` call from P: the frames P writes in, the acknowledgements Q yields out."""

    def __init__(self, inbound: InboundChannels) -> None:
        self.frames: asyncio.Queue[ChannelFrame | None] = asyncio.Queue()
        self.acks = inbound.Channel(self._requests(), _Plaintext())  # type: ignore[arg-type]

    async def _requests(self) -> AsyncIterator[ChannelFrame]:
        while (frame := await self.frames.get()) is not None:
            yield frame

    async def ack(self) -> ChannelAck:
        return await asyncio.wait_for(self.acks.__anext__(), 5)

    async def broken(self) -> list[ChannelAck]:
        """The stream ends; what Q still yielded on it (lost with the stream)."""
        await self.frames.put(None)
        return [ack async for ack in self.acks]


def q_inbound(inbox: Inbox) -> InboundChannels:
    """Q's receiving end, its accepted entries put in ``inbox`` (two entries fill it)."""

    def accept(src: str, entries: list[Entry], only_messages: bool) -> None:
        inbox.put(src, entries, 1, sum(len(entry.payload) for entry in entries))

    return InboundChannels(
        "Q",
        Q_INC,
        lock=asyncio.Lock(),
        inbox=inbox,
        accept=accept,
        on_sender_restart=lambda src: None,
        metrics=AgentMetrics(CollectorRegistry()),
        read_ahead_entries=1000,
        read_ahead_bytes=1 << 20,
        ack_delay=0.05,
    )


async def q_positions() -> tuple[dict[str, AckPosition], dict[str, AckPosition], int]:
    """Q's ``acked()`` while its queue is full (stream open), then with the stream broken and the
    queue consumed, and the first acknowledgement P's next stream gets."""
    inbox = Inbox(max_entries=2, max_bytes=1 << 20)
    inbound = q_inbound(inbox)
    hello = ChannelHello(src="P", dst="Q", sender_incarnation=P_INC)
    first = PeerStream(inbound)
    await first.frames.put(encode(0, (), hello))
    await first.frames.put(encode(0, [b"m1", b"m2"]))
    assert (await first.ack()).next_seq == 0  # the hello's answer: the queue is full
    assert (await first.ack()).next_seq == 0  # the hold: P's send is now a flow-control wait
    while_full = inbound.acked()
    assert all(ack.next_seq == 0 for ack in await first.broken())
    inbox.done(await inbox.next())  # Q's handler consumes both messages: room again
    at_recording = inbound.acked()
    second = PeerStream(inbound)  # P reconnects, from what it knows acknowledged (0)
    await second.frames.put(encode(0, (), hello))
    await second.frames.put(encode(0, [b"m1", b"m2"]))  # P resends its window
    after_reconnect = (await second.ack()).next_seq
    await second.broken()
    return while_full, at_recording, after_reconnect


def recorded_cut(acked_by_q: dict[str, AckPosition], p_task: str, q_task: str, active: bool) -> GlobalSnapshot:
    """The snapshot the detector completes from P's and Q's parts, recorded at that moment."""
    seen_by_p = AckPosition(sender_incarnation=P_INC, receiver_incarnation=Q_INC, next_seq=0)
    p, q = SnapshotCore("P", ["Q"]), SnapshotCore("Q", ["P"])
    p.send("Q", 2)
    q.receive_messages("P", [AppMessage(b"m1"), AppMessage(b"m2")])
    blocked = Wait(task=p_task, targets=[WaitNode(process="Q")], flow_control=True, instance=1, began_at_us=1)
    waiting = Wait(task=q_task, targets=[WaitNode(process="P")], instance=2, began_at_us=2)
    assembler = Assembler()
    assembler.begin(7, ["P", "Q"])
    results = []
    for core, state, positions in (
        (p, LocalState(active=active, waits=[blocked]), {"acks_seen": {"Q": seen_by_p}}),
        (q, LocalState(active=active, waits=[waiting]), {"acked": acked_by_q}),
    ):
        assert isinstance(core.start_snapshot(7, now=0.0)[0], RecordState)
        for action in core.record_state(7, state, **positions):
            if isinstance(action, ReportPart):
                results.append(assembler.add_part(action.part))
    [done] = [result for result in results if isinstance(result, Completed)]  # every channel proven, closed
    return done.snapshot


# The tasks "pump" and "t" with both processes passive (the cycle runs through the process nodes,
# where the quiet rule decides), or P's send in its message handler and Q's wait declared by Q
# itself, both active (an AND cycle of the two processes, the quiet rule not involved).
@pytest.mark.parametrize(("p_task", "q_task", "active"), [("pump", "t", False), ("", "", True)])
def test_an_acknowledgement_owed_to_a_sender_whose_stream_is_down_makes_no_deadlock_up(
    p_task: str, q_task: str, active: bool
) -> None:
    while_full, at_recording, after_reconnect = asyncio.run(q_positions())
    # Q had nothing more to acknowledge while its queue was full; P's next stream gets everything.
    assert while_full == {"P": AckPosition(sender_incarnation=P_INC, receiver_incarnation=Q_INC, next_seq=0)}
    assert after_reconnect == 2
    # The position Q owes is in its state though no stream is open ...
    assert at_recording == {"P": AckPosition(sender_incarnation=P_INC, receiver_incarnation=Q_INC, next_seq=2)}
    snapshot = recorded_cut(at_recording, p_task, q_task, active)
    # ... so the acknowledgement rule meets P's wait: no deadlock, in both evaluations.
    assert verdict(evaluate(snapshot).results[0]) == "false"
    assert verdict(evaluate_rows(rows_of(snapshot))[0]) == "false"


def test_with_the_queue_full_and_no_stream_open_nothing_is_owed_and_the_deadlock_stands() -> None:
    # The other side: Q's queue still full while P's stream is down. P's next hello is answered
    # with P's own starting point, so no acknowledgement is on its way, and the cycle is proven.
    held = {"P": AckPosition(sender_incarnation=P_INC, receiver_incarnation=Q_INC, next_seq=0)}

    async def full_and_down() -> dict[str, AckPosition]:
        inbox = Inbox(max_entries=2, max_bytes=1 << 20)
        inbound = q_inbound(inbox)
        stream = PeerStream(inbound)
        await stream.frames.put(encode(0, (), ChannelHello(src="P", dst="Q", sender_incarnation=P_INC)))
        await stream.frames.put(encode(0, [b"m1", b"m2"]))
        await stream.ack()
        await stream.broken()
        return inbound.acked()

    assert asyncio.run(full_and_down()) == {}
    snapshot = recorded_cut({}, "", "", True)
    assert verdict(evaluate(snapshot).results[0]) == "true"
    # Q's hold, reported while a stream is open, says the same.
    assert verdict(evaluate(recorded_cut(held, "", "", True)).results[0]) == "true"
