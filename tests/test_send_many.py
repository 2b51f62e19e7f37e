"""``Agent.send_many``: a batch is the same as its messages sent one by one, in fewer steps.

In-process asyncio agents over gRPC on 127.0.0.1, without a detector; snapshots are started on
each agent by hand, the receiver first, so that batches are in flight when it records.
"""

from __future__ import annotations

import asyncio

import pytest

from polling import async_poll, run
from stablewatch.agents import Agent, AppMessage, ChannelSettings, MessageTooLarge
from stablewatch.detector.assembly import Assembler, Completed
from stablewatch.v1 import GlobalSnapshot, LocalSnapshotPart

SMALL_WINDOW = ChannelSettings(window_entries=64, max_frame_entries=16, inbox_entries=64)


def numbered(first: int, count: int) -> list[bytes]:
    return [str(n).encode() for n in range(first, first + count)]


def test_a_batch_larger_than_the_window_arrives_whole_and_in_order_between_single_sends() -> None:
    async def scenario() -> None:
        received: list[bytes] = []
        b = Agent("B", channel_settings=SMALL_WINDOW, handler=lambda src, m: received.append(m.payload))
        await b.start()
        a = Agent("A", peers={"B": b.address}, channel_settings=SMALL_WINDOW)
        await a.start()
        try:
            await a.send("B", b"0")
            await a.send_many("B", numbered(1, 1000))  # about 16 windows' worth
            await a.send("B", b"1001")
            await a.send_many("B", [])
            await async_poll(lambda: len(received) == 1002, "every message delivered")
            assert received == numbered(0, 1002)
            assert a._core.sent_count("B") == 1002
        finally:
            await a.stop()
            await b.stop()

    run(scenario())


def test_snapshots_taken_while_batches_flow_count_every_message_once() -> None:
    """For each cut: n (sent before the marker) = m (received before recording) + recorded, and
    the recorded messages are exactly the ones numbered m .. n-1: no batch is split by a cut."""

    async def scenario() -> None:
        snapshot_ids = list(range(1, 13))  # under max_recordings (16): none is refused
        assembler = Assembler()  # the detector's merging of the parts, without a detector
        for snapshot_id in snapshot_ids:
            assembler.begin(snapshot_id, ["A", "B"])
        completed: dict[int, GlobalSnapshot] = {}

        def take(part: LocalSnapshotPart) -> None:
            outcome = assembler.add_part(part, sender=part.process_id)
            if isinstance(outcome, Completed):
                completed[part.snapshot_id] = outcome.snapshot

        b = Agent("B", channel_settings=SMALL_WINDOW, handler=lambda src, m: None)
        b.on_part(take)
        await b.start()
        a = Agent("A", peers={"B": b.address}, channel_settings=SMALL_WINDOW)
        a.on_part(take)
        await a.start()

        async def batches() -> None:
            sent = 1
            for size in [1, 37, 300, 5, 120, 64, 65, 1000, 2] * 10:
                await a.send_many("B", numbered(sent, size))
                sent += size

        try:
            await a.send("B", b"0")  # opens the channel before any cut: message k carries k - 1
            sender = asyncio.ensure_future(batches())
            for snapshot_id in snapshot_ids:
                # B records first, while A's batches are in flight (sent, not yet arrived at B).
                await async_poll(
                    lambda: sender.done() or a._core.sent_count("B") > b._core.received_count("A"), "messages in flight"
                )
                await b.start_snapshot(snapshot_id)
                await asyncio.sleep(0)
                await a.start_snapshot(snapshot_id)
            await sender
            await async_poll(lambda: len(completed) == len(snapshot_ids), "every snapshot proven complete")
            recorded_somewhere = False
            for snapshot_id in snapshot_ids:
                (channel,) = completed[snapshot_id].channels
                sent, received = channel.sent_before_marker, channel.received_before_recording
                assert (channel.src, channel.dst) == ("A", "B")
                assert received + len(channel.messages) == sent
                assert [m.payload for m in channel.messages] == numbered(received, sent - received)
                recorded_somewhere |= bool(channel.messages)
            assert recorded_somewhere, "no cut caught a batch in flight: the test proved nothing"
        finally:
            await a.stop()
            await b.stop()

    run(scenario())


@pytest.mark.parametrize(
    ("payloads", "error", "message"),
    [
        ([b"fine", "not bytes", b"fine"], TypeError, "send_many takes bytes payloads, got str"),
        ([b"fine", b"x" * 2000], MessageTooLarge, "message of 2000 bytes to B exceeds max_message_bytes=1000"),
    ],
)
def test_a_bad_payload_refuses_the_whole_batch_and_sends_nothing(
    payloads: list[bytes], error: type[Exception], message: str
) -> None:
    async def scenario() -> None:
        received: list[AppMessage] = []
        b = Agent("B", handler=lambda src, m: received.append(m))
        await b.start()
        a = Agent("A", peers={"B": b.address}, max_message_bytes=1000)
        await a.start()
        try:
            await a.send("B", b"before")
            with pytest.raises(error, match=message):
                await a.send_many("B", payloads)
            await a.send("B", b"after")  # the channel goes on, with what was accepted before
            await async_poll(lambda: len(received) == 2, "the two good messages")
            assert [m.payload for m in received] == [b"before", b"after"]
            assert a._core.sent_count("B") == 2
        finally:
            await a.stop()
            await b.stop()

    run(scenario())
