"""Agents exchange channel messages over TLS and mutual TLS, in process and as token_node processes.

Certificates come from tests/certs.py: every leaf certificate it makes is valid for both server and
client use (an agent is both), for localhost and 127.0.0.1. An agent that cannot show a client
certificate from the trusted CA must not be able to feed a mutual-TLS agent's channels.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import grpc
import pytest

from polling import async_poll
from stablewatch.agents import Agent, ChannelSettings, TlsConfig
from stablewatch.agents.certificates import channel_credentials
from stablewatch.testing.tcp_proxy import TcpProxy
from stablewatch.testing.token_nodes import Node, connect_all, wait_quiet

T = TypeVar("T")

TIMEOUT = 20.0
TOKENS = 100
RECONNECTS = "stablewatch_agent_reconnects_total"
RECEIVED = "stablewatch_agent_messages_received_total"


class WithoutClientCertificate(TlsConfig):
    """A TLS identity whose client side shows no certificate (it still verifies the server)."""

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return channel_credentials(self.ca_file)


def run(coroutine) -> None:
    asyncio.run(asyncio.wait_for(coroutine, 3 * TIMEOUT))


# -- in process -----------------------------------------------------------------------------------


@pytest.mark.parametrize("mutual", [False, True], ids=["tls", "mutual-tls"])
def test_agents_exchange_messages_over_tls(certs: dict[str, Path], mutual: bool) -> None:
    """A and B send to each other over TLS (server verified by its 127.0.0.1 address) or mTLS."""
    tls = TlsConfig(certs["server_cert"], certs["server_key"], certs["ca_cert"], mutual=mutual)

    async def scenario() -> None:
        got: dict[str, list[bytes]] = {"A": [], "B": []}
        peers: dict[str, str] = {}
        agents = {
            pid: Agent(pid, peers=peers, tls=tls, handler=lambda src, m, pid=pid: got[pid].append(m.payload))
            for pid in ("A", "B")
        }
        for agent in agents.values():
            agent.state.set_counter("tokens", TOKENS)
            await agent.start()
            peers[agent.process_id] = agent.address
        try:
            for i in range(200):
                await agents["A"].send("B", b"a%d" % i, counters={"tokens": 1})
            for i in range(50):
                await agents["B"].send("A", b"b%d" % i, counters={"tokens": 2})
            await async_poll(lambda: len(got["B"]) == 200 and len(got["A"]) == 50, "every delivery", TIMEOUT)
            assert got["B"] == [b"a%d" % i for i in range(200)]
            assert got["A"] == [b"b%d" % i for i in range(50)]
            assert agents["A"].state.counter("tokens") == TOKENS - 200 + 100
            assert agents["B"].state.counter("tokens") == TOKENS + 200 - 100
            for agent in agents.values():
                assert not any(channel.last_error for channel in agent._outbound.values())
        finally:
            for agent in agents.values():
                await agent.stop()

    run(scenario())


@pytest.mark.parametrize("client", ["no-certificate", "foreign-ca"])
def test_agent_without_trusted_client_certificate_cannot_feed_mutual_tls_agent(
    certs: dict[str, Path], foreign: dict[str, Path], client: str
) -> None:
    """B requires client certificates from its CA; A shows none, or one from another CA.

    A trusts B's server certificate, so only B's check of the client refuses it. A keeps trying
    (the proxy in between sees at least two connection attempts) and nothing is ever delivered;
    A's channel reports the failure in ``last_error`` and its reconnect counter.
    """
    server_tls = TlsConfig(certs["server_cert"], certs["server_key"], certs["ca_cert"])
    if client == "no-certificate":
        client_tls: TlsConfig = WithoutClientCertificate(certs["client_cert"], certs["client_key"], certs["ca_cert"])
    else:
        client_tls = TlsConfig(foreign["client_cert"], foreign["client_key"], certs["ca_cert"])

    async def scenario() -> None:
        got: list[bytes] = []
        b = Agent("B", tls=server_tls, handler=lambda src, m: got.append(m.payload))
        await b.start()
        proxy = await asyncio.to_thread(TcpProxy, b.address)
        a = Agent(
            "A",
            peers={"B": proxy.address},
            tls=client_tls,
            channel_settings=ChannelSettings(backoff_initial=0.01, backoff_max=0.2),
        )
        await a.start()
        try:
            await a.send("B", b"let me in")
            await async_poll(lambda: proxy.accepted >= 2, "a second connection attempt", TIMEOUT)
            await async_poll(
                lambda: (a.metrics.registry.get_sample_value(RECONNECTS, {"peer": "B"}) or 0) >= 2,
                "failed streams counted",
            )
            assert got == []
            assert b.metrics.registry.get_sample_value(RECEIVED, {"peer": "A"}) is None
            assert a._outbound["B"].unacknowledged == 1
            assert a._outbound["B"].last_error.startswith("UNAVAILABLE"), a._outbound["B"].last_error
        finally:
            await a.stop()
            await b.stop()
            await asyncio.to_thread(proxy.stop)

    run(scenario())


# -- token_node processes -------------------------------------------------------------------------


@pytest.fixture
def tls_dir(certs: dict[str, Path], tmp_path: Path) -> Path:
    """The files token_node --tls-dir reads: node.pem, node.key (one certificate for both sides), ca.pem."""
    folder = tmp_path / "tls"
    folder.mkdir()
    shutil.copy(certs["server_cert"], folder / "node.pem")
    shutil.copy(certs["server_key"], folder / "node.key")
    shutil.copy(certs["ca_cert"], folder / "ca.pem")
    return folder


@pytest.fixture
def start_nodes() -> Iterator[Callable[..., list[Node]]]:
    started: list[Node] = []

    def start(*ids: str, args: tuple[str, ...] = ()) -> list[Node]:
        for pid in ids:
            started.append(Node(pid, "--tokens", str(TOKENS), *args))
        return started[-len(ids) :]

    yield start
    for node in started:
        node.stop()


def test_token_nodes_over_mutual_tls(tls_dir: Path, start_nodes) -> None:
    """Three token_node processes with --tls-dir (mutual TLS, one certificate for both sides)
    exchange tokens, and go on after B's server restarts (which reads the certificate files
    again); nothing is lost, duplicated or reordered and tokens are conserved."""
    nodes = start_nodes("A", "B", "C", args=("--tls-dir", str(tls_dir)))
    connect_all(nodes)
    for round_, count in enumerate((1000, 500), start=1):
        if round_ == 2:
            nodes[1].command("restart_server")
            nodes[1].expect("restarted")
        for seed, node in enumerate(nodes):
            node.command("transfer", count=count, seed=10 * round_ + seed)
        for node in nodes:
            node.wait_seen("transferred", round_)
        stats = wait_quiet(nodes)

    assert all(not s["errors"] for s in stats), [s["errors"] for s in stats]
    assert sum(s["tokens"] for s in stats) == 3 * TOKENS
    ids = [node.process_id for node in nodes]
    for node, s in zip(nodes, stats, strict=True):
        for dst, sent in s["sent"].items():
            assert stats[ids.index(dst)]["received"][node.process_id] == sent
    assert sum(sum(s["received"].values()) for s in stats) == 3 * 1500
