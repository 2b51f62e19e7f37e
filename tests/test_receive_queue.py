"""The agent's receive queue: its accounting, and acknowledgements that say when it is full.

The inbox is tested on its own; the acknowledgements through a raw ``Peer.Channel`` client that
plays the sender A to a live agent B whose handler blocks.
"""

from __future__ import annotations

import asyncio

import grpc

from polling import async_poll, run
from stablewatch.agents import Agent, AppMessage, ChannelSettings
from stablewatch.agents.core import Run
from stablewatch.agents.frames import encode
from stablewatch.agents.inbox import Inbox
from stablewatch.v1 import ChannelAck, ChannelHello, channel_pb2_grpc


def messages(*payloads: bytes) -> list[AppMessage]:
    return [AppMessage(payload) for payload in payloads]


def test_the_inbox_counts_runs_reports_what_waits_and_says_when_it_has_room_again() -> None:
    async def scenario() -> None:
        inbox = Inbox(max_entries=3, max_bytes=1000)
        rooms: list[int] = []
        inbox.on_room(lambda: rooms.append(inbox.entries))
        inbox.put("q", messages(b"a", b"b"), 1, 2)
        inbox.put("r", messages(b"c"), 3, 1)
        inbox.put("q", messages(b"d"), 4, 1)
        assert (len(inbox), inbox.entries, inbox.nbytes, inbox.has_room()) == (3, 4, 4, False)
        first = await inbox.next()
        first.taken = 1  # the handler has the first message of the first run
        assert inbox.undelivered() == {
            "q": [Run(messages(b"b"), 2), Run(messages(b"d"), 4)],
            "r": [Run(messages(b"c"), 3)],
        }
        inbox.done(first)
        assert rooms == [2]  # full before, room now
        inbox.forget("r")  # r's sender restarted: its message is still delivered, no longer counted
        assert inbox.undelivered() == {"q": [Run(messages(b"d"), 4)]}
        assert (await inbox.next()).src == "r"

    run(scenario())


def test_a_full_receive_queue_holds_the_window_until_the_handler_consumes() -> None:
    """B's queue holds two messages; its handler blocks on the first one.

    The first acknowledgement answers at once; once the queue is full an acknowledgement repeats
    ``next_seq`` once (the hold) and no more go out; when the handler consumes, the next one
    covers everything read meanwhile. Everything is delivered once, in order.
    """

    async def scenario() -> None:
        release = asyncio.Event()
        got: list[bytes] = []

        async def handler(src: str, message: AppMessage) -> None:
            got.append(message.payload)
            await release.wait()

        b = Agent("B", handler=handler, channel_settings=ChannelSettings(inbox_entries=2))
        await b.start()
        channel = grpc.aio.insecure_channel(b.address)
        call = channel_pb2_grpc.PeerStub(channel).Channel()
        try:
            hello = ChannelHello(src="A", dst="B", sender_incarnation=1)

            async def ack() -> ChannelAck:
                reply = await call.read()
                assert reply is not grpc.aio.EOF
                return reply

            await call.write(encode(0, messages(b"m0"), hello))
            assert (await ack()).next_seq == 1  # room: one message waits
            await async_poll(lambda: got == [b"m0"], "the handler blocking on m0")
            await call.write(encode(1, messages(b"m1", b"m2")))
            assert (await ack()).next_seq == 1  # three wait now: the window is held
            await call.write(encode(3, messages(b"m3")))  # read ahead, not acknowledged
            await async_poll(lambda: b._core.received_count("A") == 4, "m3 read ahead")
            release.set()
            assert (await ack()).next_seq == 4
            await async_poll(lambda: len(got) == 4, "every delivery")
            assert got == [b"m0", b"m1", b"m2", b"m3"]
        finally:
            release.set()
            call.cancel()
            await channel.close()
            await b.stop()

    run(scenario())
