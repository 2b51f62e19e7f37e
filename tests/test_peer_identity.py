"""With mutual TLS an agent opens channels only as a process its certificate names.

Q requires client certificates from the CA (the ``pki`` fixture). P, with P's certificate, feeds Q's
channel. An impostor runs the real agent code under a process id its certificate does not name
(another process's, or any id with a certificate that names none): Q refuses the stream with
PERMISSION_DENIED before anything is delivered, and counts the frame as ``spoofed``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from certs import tls_config

from polling import async_poll
from stablewatch.agents import Agent, ChannelSettings

pytestmark = pytest.mark.timeout(60)

REJECTED = "stablewatch_agent_rejected_frames_total"
RECONNECTS = "stablewatch_agent_reconnects_total"


def run(coroutine) -> None:  # type: ignore[no-untyped-def]
    asyncio.run(asyncio.wait_for(coroutine, 45))


def test_a_process_named_by_its_certificate_delivers(pki: dict[str, Path]) -> None:
    async def scenario() -> None:
        got: list[tuple[str, bytes]] = []
        q = Agent("Q", tls=tls_config(pki, "agent_Q"), handler=lambda src, m: got.append((src, m.payload)))
        await q.start()
        p = Agent("P", peers={"Q": q.address}, tls=tls_config(pki, "agent_P"))
        await p.start()
        try:
            await p.send("Q", b"it is me")
            await async_poll(lambda: got == [("P", b"it is me")], "P's message")
            assert (q.metrics.registry.get_sample_value(REJECTED, {"reason": "spoofed"}) or 0) == 0
        finally:
            await p.stop()
            await q.stop()

    run(scenario())


@pytest.mark.parametrize(
    ("claimed", "certificate"),
    [("P", "agent_Q"), ("P", "nobody"), ("X", "agent_P")],
    ids=["another-process", "no-process", "unnamed-id"],
)
def test_a_peer_cannot_open_a_channel_as_another_process(pki: dict[str, Path], claimed: str, certificate: str) -> None:
    """The impostor keeps retrying (its reconnects count up) and Q never delivers a thing."""
    receiver = "Q"

    async def scenario() -> None:
        got: list[bytes] = []
        q = Agent(receiver, tls=tls_config(pki, f"agent_{receiver}"), handler=lambda src, m: got.append(m.payload))
        await q.start()
        impostor = Agent(
            claimed,
            peers={receiver: q.address},
            tls=tls_config(pki, certificate),
            channel_settings=ChannelSettings(backoff_initial=0.01, backoff_max=0.2),
        )
        await impostor.start()
        try:
            await impostor.send(receiver, b"let me in")
            rejected = lambda: q.metrics.registry.get_sample_value(REJECTED, {"reason": "spoofed"}) or 0  # noqa: E731
            await async_poll(lambda: rejected() >= 2, "two refused attempts")
            channel = impostor._outbound[receiver]
            # The impostor's next frame may race the refusal, which gRPC then reports as INTERNAL:
            # one of its attempts shows the status Q sent.
            await async_poll(lambda: channel.last_error.startswith("PERMISSION_DENIED"), "Q's status")
            assert f"claims to be {claimed!r}" in channel.last_error
            assert got == []
            assert channel.unacknowledged == 1
        finally:
            await impostor.stop()
            await q.stop()

    run(scenario())
