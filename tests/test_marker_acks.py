"""Frames that wait for the next acknowledgement (``ChannelFrame.ack_later``).

A sender marks a frame ``ack_later`` while at most half its window is taken; the receiver then
leaves it to its next acknowledgement, or acknowledges it ``ack_delay`` after it came. These tests
check the receiver's rule through a raw ``Peer.Channel`` client playing the sender A to a live
agent B, and the sender's rule end to end: an idle channel with a small window keeps taking
snapshots and sends, and sparse messages cost no acknowledgement each.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from polling import async_poll, run
from stablewatch.agents import Agent, AppMessage, ChannelSettings
from stablewatch.agents.core import Marker
from stablewatch.agents.frames import encode
from stablewatch.v1 import ChannelFrame, ChannelHello, LocalSnapshotPart, channel_pb2_grpc

HELLO = ChannelHello(src="A", dst="B", sender_incarnation=1)


def later(frame: ChannelFrame) -> ChannelFrame:
    frame.ack_later = True
    return frame


@contextlib.asynccontextmanager
async def agent_b(**options: Any) -> AsyncIterator[tuple[Agent, channel_pb2_grpc.PeerStub]]:
    """A live agent B and a stub for raw ``Peer.Channel`` streams into it; all closed afterwards."""
    b = Agent("B", **options)
    await b.start()
    channel = grpc.aio.insecure_channel(b.address)
    try:
        yield b, channel_pb2_grpc.PeerStub(channel)
    finally:
        await channel.close()  # ends the raw streams too
        await b.stop()


async def next_ack(call: Any) -> int:
    """The ``next_seq`` of the next acknowledgement on ``call``."""
    reply = await call.read()
    assert reply is not grpc.aio.EOF, "the stream ended instead of acknowledging"
    return reply.next_seq


def test_a_frame_left_for_later_is_acknowledged_with_what_follows() -> None:
    """Acknowledgements come in order: had the receiver answered a waiting frame by itself, the
    next one read would stop at it. (No delay runs out here: B's ack_delay is an hour.)"""

    async def scenario() -> None:
        async with agent_b(channel_settings=ChannelSettings(ack_delay=3600)) as (_, stub):
            call = stub.Channel(timeout=10)
            await call.write(encode(0, [AppMessage(b"m0")], HELLO))
            assert await next_ack(call) == 1
            await call.write(later(encode(1, [Marker(7)])))
            await call.write(later(encode(2, [AppMessage(b"m2")])))
            await call.write(encode(3, [AppMessage(b"m3")]))
            assert await next_ack(call) == 4  # one acknowledgement for the marker, m2 and m3
            await call.write(later(encode(4, [Marker(8), AppMessage(b"m5")])))
            await call.write(encode(6, [Marker(9)]))  # a frame without the flag is answered at once
            assert await next_ack(call) == 7

    run(scenario())


def test_a_frame_left_for_later_is_acknowledged_after_the_receivers_ack_delay() -> None:
    async def scenario() -> None:
        async with agent_b(channel_settings=ChannelSettings(ack_delay=0.05)) as (_, stub):
            call = stub.Channel(timeout=10)
            await call.write(encode(0, [AppMessage(b"m0")], HELLO))
            assert await next_ack(call) == 1
            await call.write(later(encode(1, [AppMessage(b"m1"), AppMessage(b"m2")])))
            assert await next_ack(call) == 3  # nothing else came: the delay ran out

    run(scenario())


def test_sparse_messages_are_acknowledged_together_until_half_the_window_is_taken() -> None:
    """A sends one message at a time into a window of 64: none is answered by itself (B's
    ack_delay is an hour) until the window is half taken; then every frame is."""

    async def scenario() -> None:
        got: list[bytes] = []
        settings = ChannelSettings(window_entries=64, ack_delay=3600)
        b = Agent("B", handler=lambda src, message: got.append(message.payload), channel_settings=settings)
        await b.start()
        a = Agent("A", peers={"B": b.address}, channel_settings=settings)
        await a.start()
        try:
            await a.send("B", b"0")
            await async_poll(lambda: len(got) == 1, "the first message delivered")
            channel = a._outbound["B"]
            first = channel.unacknowledged  # 0 if the answer to the stream's hello covered it
            for i in range(1, 31):
                await a.send("B", b"%d" % i)
                await async_poll(lambda i=i: len(got) == i + 1, "the message delivered")
            assert channel.unacknowledged == first + 30  # one at a time, and not one answered
            await a.send("B", b"31")
            await a.send("B", b"32")  # past half the window: a frame that wants its acknowledgement
            await async_poll(lambda: channel.unacknowledged == 0, "everything acknowledged at once")
        finally:
            await a.stop()
            await b.stop()

    run(scenario())


def test_markers_left_for_later_are_acknowledged_once_the_receiver_reads_ahead_as_far_as_allowed() -> None:
    """B reads at most two entries beyond its acknowledgements: the second waiting marker makes it
    acknowledge, or it would stop reading and the markers behind would never arrive."""

    async def scenario() -> None:
        async with agent_b(channel_settings=ChannelSettings(read_ahead_entries=2)) as (_, stub):
            call = stub.Channel(timeout=10)
            await call.write(encode(0, [AppMessage(b"m0")], HELLO))
            assert await next_ack(call) == 1
            await call.write(later(encode(1, [Marker(7)])))
            await call.write(later(encode(2, [Marker(8)])))
            assert await next_ack(call) == 3
            await call.write(later(encode(3, [Marker(9)])))
            await call.write(encode(4, [AppMessage(b"m4")]))
            assert await next_ack(call) == 5

    run(scenario())


def test_an_idle_channel_with_a_small_window_keeps_taking_snapshots_and_sends() -> None:
    """A's window holds four entries and A sends nothing between twelve snapshots: markers wait
    for an acknowledgement only while half the window is free, so every snapshot reaches B and
    A's sends still go; the acknowledgement of a message covers the markers before it."""

    async def scenario() -> None:
        got: list[bytes] = []
        b = Agent("B", handler=lambda src, message: got.append(message.payload))
        recorded: set[int] = set()

        def on_part(part: LocalSnapshotPart) -> None:
            if any(channel.src == "A" for channel in part.inbound):
                recorded.add(part.snapshot_id)

        b.on_part(on_part)
        await b.start()
        a = Agent("A", peers={"B": b.address}, channel_settings=ChannelSettings(window_entries=4))
        await a.start()
        try:
            await a.send("B", b"first")
            await async_poll(lambda: got == [b"first"], "the first message")
            started = [await a.start_snapshot() for _ in range(12)]
            await async_poll(lambda: recorded >= set(started), "B's part of every snapshot")
            await async_poll(lambda: a._outbound["B"].unacknowledged <= 2, "at most half the window taken")
            for i in range(8):  # twice the window: each send needs acknowledgements to come back
                await a.send("B", b"%d" % i)
            await async_poll(lambda: len(got) == 9, "every message")
            assert got == [b"first", *(b"%d" % i for i in range(8))]
            await async_poll(lambda: a._outbound["B"].unacknowledged == 0, "the last acknowledgement")
        finally:
            await a.stop()
            await b.stop()

    run(scenario())


def test_a_hold_is_lifted_at_once_even_when_only_waiting_markers_are_unacknowledged() -> None:
    """B's receive queue holds two entries; B's handler blocks on a0 and then on c0, each time
    holding the recording lock. A's marker that may wait is read and waits for the lock; when a0
    is released the marker is taken, then c0 blocks the handler with C's two messages filling the
    queue: B answers the marker with a hold, as it answers anything while full. When the queue has
    room again B acknowledges the marker at once: otherwise A would go on believing its window
    held, and a blocked send of A's could be recorded as a flow-control wait that is over."""

    async def scenario() -> None:
        release = {b"a0": asyncio.Event(), b"c0": asyncio.Event()}
        got: list[bytes] = []

        async def handler(src: str, message: AppMessage) -> None:
            got.append(message.payload)
            if message.payload in release:
                await release[message.payload].wait()

        try:
            async with agent_b(handler=handler, channel_settings=ChannelSettings(inbox_entries=2)) as (b, stub):
                from_a, from_c = stub.Channel(timeout=10), stub.Channel(timeout=10)
                await from_a.write(encode(0, [AppMessage(b"a0")], HELLO))
                assert await next_ack(from_a) == 1
                await async_poll(lambda: got == [b"a0"], "the handler blocking on a0")
                await from_a.write(later(encode(1, [Marker(7)])))
                # asyncio.Lock keeps its waiters in order: the marker is taken before C's messages are handed over.
                await async_poll(lambda: len(b._lock._waiters or ()) == 1, "the marker waiting for the recording lock")
                c_hello = ChannelHello(src="C", dst="B", sender_incarnation=1)
                await from_c.write(encode(0, [AppMessage(b"c0"), AppMessage(b"c1")], c_hello))
                assert [await next_ack(from_c), await next_ack(from_c)] == [0, 0]  # full: C's hello, then a hold
                release[b"a0"].set()
                assert await next_ack(from_a) == 1  # the hold: c0 and c1 fill the queue
                assert got == [b"a0", b"c0"]
                release[b"c0"].set()
                assert await next_ack(from_a) == 2  # lifted as soon as there is room: the marker acknowledged
                assert await next_ack(from_c) == 2
                assert got == [b"a0", b"c0", b"c1"]
        finally:
            for event in release.values():
                event.set()

    run(scenario())


def test_channel_settings_refuse_bounds_that_cannot_work() -> None:
    with pytest.raises(ValueError, match="ack_delay must not be negative"):
        ChannelSettings(ack_delay=-1)
    with pytest.raises(ValueError, match="must be positive"):
        ChannelSettings(window_entries=0)
    assert ChannelSettings(ack_delay=0).ack_delay == 0  # every frame answered as soon as it can be
