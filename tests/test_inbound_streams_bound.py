"""An agent's read-ahead is bounded per channel, not per stream.

A raw gRPC client plays process A sending to agent B, whose handler is held: B's receive queue
fills, and only the channel's read-ahead may go beyond it. Opening more streams for the channel
must not buy more, nor may announcing new sender incarnations beyond twice the read-ahead (a
restarted sender reads ahead in full, so that its markers behind a full window still arrive); a
frame larger than the read-ahead is refused; a sender that reconnects still has every message
delivered once and in order, and its older stream ends as ``superseded``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import grpc
import pytest
from prometheus_client import CollectorRegistry

from polling import async_poll
from stablewatch.agents import Agent, AppMessage, ChannelSettings
from stablewatch.agents.core import Marker
from stablewatch.agents.frames import MAX_FRAME_ENTRIES, encode
from stablewatch.agents.metrics import AgentMetrics
from stablewatch.agents.outbound import OutboundChannel
from stablewatch.v1 import ChannelAck, ChannelHello, channel_pb2_grpc

pytestmark = pytest.mark.timeout(60)

TIMEOUT = 10.0
INBOX, READ_AHEAD, FRAME, STREAMS = 8, 16, 16, 30
REJECTED = "stablewatch_agent_rejected_frames_total"


def hello(incarnation: int = 1) -> ChannelHello:
    return ChannelHello(src="A", dst="B", sender_incarnation=incarnation)


def numbered(start: int, stop: int) -> list[AppMessage]:
    return [AppMessage(b"m%d" % i) for i in range(start, stop)]


async def first_ack(call: grpc.aio.StreamStreamCall) -> ChannelAck:
    ack = await call.read()
    assert ack is not grpc.aio.EOF, "the stream ended instead of answering its hello"
    return ack


def with_held_b(
    scenario: Callable[[Agent, channel_pb2_grpc.PeerStub, list[bytes], asyncio.Event], Awaitable[None]],
) -> None:
    """Start agent B, whose handler waits for ``release`` before each message, and run ``scenario``."""

    async def main() -> None:
        got: list[bytes] = []
        release = asyncio.Event()

        async def handler(src: str, message: AppMessage) -> None:
            await release.wait()
            got.append(message.payload)

        settings = ChannelSettings(
            window_entries=8, max_frame_entries=8, inbox_entries=INBOX, read_ahead_entries=READ_AHEAD
        )
        agent = Agent("B", handler=handler, channel_settings=settings)
        await agent.start()
        channel = grpc.aio.insecure_channel(agent.address)
        try:
            await scenario(agent, channel_pb2_grpc.PeerStub(channel), got, release)
        finally:
            release.set()
            await channel.close()
            await agent.stop()

    asyncio.run(asyncio.wait_for(main(), 5 * TIMEOUT))


@pytest.mark.parametrize("new_incarnations", [False, True], ids=["same-incarnation", "new-incarnations"])
def test_more_streams_for_one_channel_do_not_buy_more_queue(new_incarnations: bool) -> None:
    """The reviewer's reproduction: 30 streams for A -> B, each opening with a frame of 16 messages
    where the sender's acknowledged position was. Per stream, B held 480 messages (16 each)."""

    async def scenario(agent: Agent, stub: channel_pb2_grpc.PeerStub, got: list[bytes], _: asyncio.Event) -> None:
        calls = []
        try:
            for k in range(STREAMS):
                call = stub.Channel(timeout=4 * TIMEOUT)
                calls.append(call)
                # Each stream starts where the channel stands (the most a sender can ask for).
                expected = agent._inbound._expected.get("A")
                incarnation, first_seq = (k + 1, 0) if new_incarnations else (1, expected.next_seq if expected else 0)
                await call.write(encode(first_seq, numbered(first_seq, first_seq + FRAME), hello(incarnation)))
                # The hello is answered only once its first frame is taken or waits for the read-ahead.
                await first_ack(call)
            queued = agent._inbox.entries
            # New incarnations: the current one's read-ahead, and at most as much again left by earlier ones.
            bound = INBOX + (2 if new_incarnations else 1) * READ_AHEAD + FRAME
            assert queued <= bound, f"{queued} messages queued at B from {STREAMS} streams"
        finally:
            for call in calls:
                call.cancel()

    with_held_b(scenario)


async def ended_with(call: grpc.aio.StreamStreamCall) -> grpc.aio.AioRpcError:
    """Read acknowledgements from ``call`` until the error that ends it."""
    with pytest.raises(grpc.aio.AioRpcError) as info:
        while True:
            ack = await asyncio.wait_for(call.read(), TIMEOUT)
            assert ack is not grpc.aio.EOF, "the stream ended without an error"
    return info.value


def test_a_reconnecting_sender_delivers_everything_once_in_order_and_the_old_stream_is_superseded() -> None:
    """A sends m0..m15 on a first stream while B's handler is held (B's queue is full, its
    read-ahead taken), then reconnects with the same incarnation: a new stream resends from what
    it saw acknowledged and goes on to m31. The first stream ends as superseded (ABORTED); once
    the handler runs, it has every message once, in order, and the channel's counts agree."""

    async def scenario(agent: Agent, stub: channel_pb2_grpc.PeerStub, got: list[bytes], release: asyncio.Event) -> None:
        first = stub.Channel(timeout=4 * TIMEOUT)
        await first.write(encode(0, numbered(0, 8), hello()))
        seen = (await first_ack(first)).next_seq
        await first.write(encode(8, numbered(8, 16)))
        await async_poll(lambda: agent._inbound._expected["A"].next_seq == 16, "m0..m15 accepted")

        second = stub.Channel(timeout=4 * TIMEOUT)
        await second.write(encode(seen, numbered(seen, 16), hello()))  # a resend
        await second.write(encode(16, numbered(16, 24)))  # then m16..m23
        error = await ended_with(first)
        assert error.code() == grpc.StatusCode.ABORTED, (error.code(), error.details())
        assert "superseded: " in (error.details() or "")
        assert agent.metrics.registry.get_sample_value(REJECTED, {"reason": "superseded"}) == 1
        await first_ack(second)
        assert agent._inbox.entries <= INBOX + READ_AHEAD, agent._inbox.entries  # nothing new beyond it

        release.set()
        await second.write(encode(24, numbered(24, 32)))
        await async_poll(lambda: len(got) == 32, "m0..m31 delivered")
        last = 0
        while last < 32:
            last = (await asyncio.wait_for(second.read(), TIMEOUT)).next_seq
        assert got == [b"m%d" % i for i in range(32)]
        assert agent._core.received_count("A") == 32
        second.cancel()

    with_held_b(scenario)


def test_a_new_stream_that_is_refused_supersedes_nothing() -> None:
    """A second stream whose first frame skips ahead is refused; the first stream goes on."""

    async def scenario(agent: Agent, stub: channel_pb2_grpc.PeerStub, got: list[bytes], release: asyncio.Event) -> None:
        release.set()
        first = stub.Channel(timeout=4 * TIMEOUT)
        await first.write(encode(0, numbered(0, 2), hello()))
        assert (await first_ack(first)).next_seq == 2
        bad = stub.Channel(timeout=4 * TIMEOUT)
        await bad.write(encode(5, numbered(5, 6), hello()))
        error = await ended_with(bad)
        assert error.code() == grpc.StatusCode.OUT_OF_RANGE, (error.code(), error.details())
        await first.write(encode(2, numbered(2, 3)))
        assert (await asyncio.wait_for(first.read(), TIMEOUT)).next_seq == 3
        await async_poll(lambda: len(got) == 3, "m0..m2 delivered")
        assert got == [b"m0", b"m1", b"m2"]
        first.cancel()

    with_held_b(scenario)


def test_a_restarted_sender_behind_a_full_queue_is_not_stalled_by_what_it_inherits() -> None:
    """A's first incarnation fills B's queue and its read-ahead; A restarts (incarnation 2) while
    the queue is full and fills its own read-ahead, so its next frame waits (the channel holds
    twice the read-ahead); once the handler runs and the queue has room, it is taken and
    acknowledged, and every message is delivered."""

    async def scenario(agent: Agent, stub: channel_pb2_grpc.PeerStub, got: list[bytes], release: asyncio.Event) -> None:
        old = stub.Channel(timeout=4 * TIMEOUT)
        await old.write(encode(0, numbered(0, FRAME), hello(1)))
        await first_ack(old)
        await async_poll(lambda: agent._inbound._expected["A"].next_seq == FRAME, "A1's messages taken")
        # Incarnation 2 reads ahead in full (its own), up to twice the read-ahead with what A1 left.
        new = stub.Channel(timeout=4 * TIMEOUT)
        await new.write(encode(0, numbered(0, FRAME), hello(2)))
        await first_ack(new)
        await new.write(encode(FRAME, [AppMessage(b"n0"), AppMessage(b"n1")]))
        held = agent._inbound._expected["A"].held()[0]
        assert held <= 2 * READ_AHEAD, held
        release.set()
        acked = 0
        while acked < FRAME + 2:
            acked = (await asyncio.wait_for(new.read(), TIMEOUT)).next_seq
        await async_poll(lambda: len(got) == 2 * FRAME + 2, "every message delivered")
        assert got == [b"m%d" % i for i in range(FRAME)] * 2 + [b"n0", b"n1"]
        old.cancel()
        new.cancel()

    with_held_b(scenario)


def test_a_restarted_senders_entry_behind_its_full_window_still_arrives() -> None:
    """Read-ahead exists so that markers behind a full window arrive (a snapshot can then record a
    flow-control deadlock). A1 left its window unacknowledged behind B's full queue; A restarts and
    fills its own window, then sends one entry more: it is read, though with what A1 left the
    channel holds more than one read-ahead (a review's case: inheriting A1's share stopped it)."""

    async def scenario(agent: Agent, stub: channel_pb2_grpc.PeerStub, got: list[bytes], _: asyncio.Event) -> None:
        old = stub.Channel(timeout=4 * TIMEOUT)
        await old.write(encode(0, numbered(0, INBOX - 1), hello(1)))
        assert (await first_ack(old)).next_seq == INBOX - 1  # B's queue: all but one place taken
        await old.write(encode(INBOX - 1, numbered(INBOX - 1, INBOX + 7)))  # A1's window of 8: held
        await async_poll(lambda: agent._inbound._expected["A"].next_seq == INBOX + 7, "A1's window taken")
        old.cancel()
        new = stub.Channel(timeout=4 * TIMEOUT)
        await new.write(encode(0, numbered(0, 8), hello(2)))
        await first_ack(new)
        await new.write(encode(8, numbered(8, READ_AHEAD)))  # A2's read-ahead, all but its last entry
        await async_poll(lambda: agent._inbound._expected["A"].next_seq == READ_AHEAD, "A2's entries taken")
        new.cancel()

    with_held_b(scenario)


def test_a_frame_of_more_entries_than_the_wire_contract_allows_is_refused() -> None:
    """One frame of many small entries would escape the bound, which is checked between frames (a
    review sent 100,000 empty messages in one 200 KB frame): refused as malformed, nothing taken."""

    async def scenario(agent: Agent, stub: channel_pb2_grpc.PeerStub, got: list[bytes], _: asyncio.Event) -> None:
        call = stub.Channel(timeout=4 * TIMEOUT)
        await call.write(encode(0, [b""] * (MAX_FRAME_ENTRIES + 1), hello()))
        error = await ended_with(call)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (error.code(), error.details())
        assert f"entries is more than {MAX_FRAME_ENTRIES}" in (error.details() or "")
        assert agent._inbox.entries == 0 and "A" not in agent._inbound._expected

    with_held_b(scenario)


def test_a_message_larger_than_the_read_ahead_is_delivered() -> None:
    """One entry may be larger than the window (it goes alone) and than the read-ahead: a review
    found the first version of the bound refusing its frame on every resend, a dead channel."""

    async def scenario() -> None:
        got: list[int] = []
        settings = ChannelSettings(window_bytes=64 * 1024, backoff_initial=0.01, backoff_max=0.05)
        b = Agent("B", handler=lambda src, m: got.append(len(m.payload)), channel_settings=settings)
        await b.start()
        a = Agent("A", peers={"B": b.address}, channel_settings=settings)
        await a.start()
        try:
            await a.send("B", b"x" * (200 * 1024))  # over 2 x 64 KiB, within max_message_bytes
            await async_poll(lambda: got == [200 * 1024], "the 200 KiB message delivered")
        finally:
            await a.stop()
            await b.stop()

    asyncio.run(asyncio.wait_for(scenario(), 5 * TIMEOUT))


def test_held_markers_and_a_message_past_a_small_read_ahead_are_taken() -> None:
    """With a one-entry window the read-ahead is two entries, but an honest sender puts the markers
    it held while its window was empty in front of its next message, in one frame (three entries
    for two snapshots): the receiver takes it (a review found it refused, the channel dead)."""
    settings = ChannelSettings(window_entries=1)

    async def scenario() -> None:
        b = Agent("B", channel_settings=settings)
        await b.start()
        out = OutboundChannel(
            "A", "B", b.address, incarnation=1, settings=settings,
            metrics=AgentMetrics(CollectorRegistry()), on_receiver_restart=lambda lost: None,
        )  # fmt: skip
        far = asyncio.get_running_loop().time() + 3600
        out.put_marker(Marker(1), hold_until=far)  # the window is empty: the markers wait for the next entry
        out.put_marker(Marker(2), hold_until=far)
        out.push(b"m0", 16)
        frame = out._next_frame()
        frame.hello.CopyFrom(out._hello)
        assert len(frame.markers) == 2 and len(frame.payloads) == 3  # the honest sender's frame
        channel = grpc.aio.insecure_channel(b.address)
        try:
            call = channel_pb2_grpc.PeerStub(channel).Channel(timeout=TIMEOUT)
            await call.write(frame)
            assert (await first_ack(call)).next_seq == 3
            call.cancel()
        finally:
            await channel.close()
            await b.stop()

    asyncio.run(asyncio.wait_for(scenario(), 5 * TIMEOUT))


def test_a_sender_cannot_be_set_to_send_frames_receivers_refuse() -> None:
    with pytest.raises(ValueError, match=f"max_frame_entries is at most {MAX_FRAME_ENTRIES}"):
        ChannelSettings(max_frame_entries=MAX_FRAME_ENTRIES + 1)
    assert ChannelSettings(max_frame_entries=MAX_FRAME_ENTRIES).max_frame_entries == MAX_FRAME_ENTRIES
