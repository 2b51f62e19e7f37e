"""Finding peers: a resolver is asked at every connection attempt, a fixed map fails fast."""

from __future__ import annotations

import asyncio

import pytest

from polling import async_poll
from stablewatch.agents import Agent, AppMessage, ChannelSettings

FAST = ChannelSettings(backoff_initial=0.01, backoff_max=0.1)


def test_a_peer_unknown_at_first_send_is_reached_once_it_resolves() -> None:
    async def scenario() -> None:
        directory: dict[str, str] = {}

        def resolve(peer: str) -> str:
            return directory[peer]  # KeyError until the peer is published

        got: list[bytes] = []
        a = Agent("A", peers=resolve, channel_settings=FAST)
        b = Agent("B", handler=lambda src, message: got.append(message.payload))
        await a.start()
        await b.start()
        try:
            await a.send("B", b"early")  # accepted and kept while B cannot be found
            await async_poll(lambda: "no address for peer B" in a._outbound["B"].last_error, "a failed lookup")
            directory["B"] = b.address
            await async_poll(lambda: got == [b"early"], "the delivery once B resolves")
        finally:
            await a.stop()
            await b.stop()

    asyncio.run(scenario())


def test_a_peer_that_restarts_elsewhere_is_found_again() -> None:
    async def scenario() -> None:
        directory: dict[str, str] = {}
        got: list[bytes] = []

        def handler(src: str, message: AppMessage) -> None:
            got.append(message.payload)

        a = Agent("A", peers=lambda peer: directory[peer], channel_settings=FAST)
        first = Agent("B", handler=handler)
        await a.start()
        await first.start()
        directory["B"] = first.address
        await a.send("B", b"one")
        await async_poll(lambda: got == [b"one"], "the first delivery")
        await first.stop()
        second = Agent("B", handler=handler)  # a new incarnation, on another port
        await second.start()
        directory["B"] = second.address
        try:
            await a.send("B", b"two")
            await async_poll(lambda: got == [b"one", b"two"], "the delivery to the new address")
        finally:
            await a.stop()
            await second.stop()

    asyncio.run(scenario())


def test_a_fixed_map_without_the_peer_fails_at_send() -> None:
    async def scenario() -> None:
        a = Agent("A", peers={"B": "127.0.0.1:1"})
        await a.start()
        try:
            with pytest.raises(LookupError, match="no address known for peer 'C'"):
                await a.send("C", b"x")
        finally:
            await a.stop()

    asyncio.run(scenario())
