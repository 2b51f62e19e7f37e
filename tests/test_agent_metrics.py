"""The agent's Prometheus metrics: values in the registry, and the HTTP exposition."""

from __future__ import annotations

import asyncio
import urllib.request

import prometheus_client
import pytest
from prometheus_client import CollectorRegistry

from conftest import free_port
from stablewatch.agents.agent import Agent
from stablewatch.agents.metrics import REJECT_REASONS, AgentMetrics
from stablewatch.agents.rpc.agent import RpcAgent

P = "stablewatch_agent_"


@pytest.fixture
def metrics() -> AgentMetrics:
    return AgentMetrics(CollectorRegistry())


def value(metrics: AgentMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(P + name, labels)


def test_traffic_per_peer(metrics: AgentMetrics) -> None:
    metrics.sent("B", 3, 120)
    metrics.sent("B", 2, 80)
    metrics.sent("C", 1, 10)
    metrics.received("B", 4, 200)
    assert value(metrics, "messages_sent_total", peer="B") == 5
    assert value(metrics, "sent_bytes_total", peer="B") == 200
    assert value(metrics, "messages_sent_total", peer="C") == 1
    assert value(metrics, "messages_received_total", peer="B") == 4
    assert value(metrics, "received_bytes_total", peer="B") == 200
    assert value(metrics, "messages_received_total", peer="C") == 0  # the peer's series exist at once


def test_channel_health_per_peer(metrics: AgentMetrics) -> None:
    metrics.retransmitted("B", 7)
    metrics.reconnected("B")
    metrics.reconnected("B")
    metrics.receiver_restarted("B")
    metrics.window("B", 12, 3000)
    metrics.window("B", 2, 500)
    assert value(metrics, "retransmitted_entries_total", peer="B") == 7
    assert value(metrics, "reconnects_total", peer="B") == 2
    assert value(metrics, "receiver_restarts_total", peer="B") == 1
    assert value(metrics, "window_entries", peer="B") == 2
    assert value(metrics, "window_bytes", peer="B") == 500


def test_process_wide_counters(metrics: AgentMetrics) -> None:
    metrics.markers_sent(3)
    metrics.markers_received(2)
    metrics.snapshot_recorded()
    metrics.snapshot_failed()
    metrics.recorded(4096)
    metrics.recorded(4)
    assert value(metrics, "markers_sent_total") == 3
    assert value(metrics, "markers_received_total") == 2
    assert value(metrics, "snapshots_recorded_total") == 1
    assert value(metrics, "snapshots_failed_total") == 1
    assert value(metrics, "recorded_bytes_total") == 4100


def test_rejected_frames_have_a_bounded_reason(metrics: AgentMetrics) -> None:
    for reason in REJECT_REASONS:
        assert value(metrics, "rejected_frames_total", reason=reason) == 0
    metrics.frame_rejected("malformed")
    metrics.frame_rejected("never heard of it")
    assert value(metrics, "rejected_frames_total", reason="malformed") == 1
    assert value(metrics, "rejected_frames_total", reason="other") == 1
    assert value(metrics, "rejected_frames_total", reason="never heard of it") is None


def test_control_connected(metrics: AgentMetrics) -> None:
    assert value(metrics, "control_connected") == 0
    metrics.control_connected(True)
    assert value(metrics, "control_connected") == 1
    metrics.control_connected(False)
    assert value(metrics, "control_connected") == 0


def test_remove_peer_drops_its_series(metrics: AgentMetrics) -> None:
    metrics.sent("B", 1, 1)
    metrics.window("B", 1, 1)
    metrics.remove_peer("B")
    metrics.remove_peer("B")  # a second time is harmless
    assert value(metrics, "messages_sent_total", peer="B") is None
    assert value(metrics, "window_entries", peer="B") is None
    metrics.sent("B", 1, 1)  # a peer that comes back starts again
    assert value(metrics, "messages_sent_total", peer="B") == 1


def test_negative_amounts_are_refused(metrics: AgentMetrics) -> None:
    with pytest.raises(ValueError):
        metrics.sent("B", -1, 0)


def test_registries_are_private_unless_asked() -> None:
    own = AgentMetrics()
    other = AgentMetrics()  # no clash: each has its own registry
    assert own.registry is not other.registry
    assert own.registry is not prometheus_client.REGISTRY
    assert prometheus_client.REGISTRY.get_sample_value(P + "markers_sent_total") is None
    shared = CollectorRegistry()
    AgentMetrics(shared)
    with pytest.raises(ValueError, match="Duplicated"):
        AgentMetrics(shared)


def test_http_exposition() -> None:
    metrics = AgentMetrics()
    metrics.sent("B", 2, 64)
    server, thread = metrics.serve_http(0)
    try:
        host, port = server.server_address[:2]
        assert host == "127.0.0.1"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            assert response.status == 200
            body = response.read().decode()
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
    assert not thread.is_alive()
    assert 'stablewatch_agent_messages_sent_total{peer="B"} 2.0' in body
    assert "# TYPE stablewatch_agent_window_entries gauge" in body


def _unreachable_detectors() -> list[str]:
    """Two detector addresses where nothing listens: the agents dial them in vain."""
    return [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]


def test_a_detector_never_reached_reads_0() -> None:
    """An agent exports ``detector_connected`` 0 for each configured detector from its start, before
    (and without) any stream coming up, so an alert or panel sees a detector it never reached."""
    detectors = _unreachable_detectors()

    async def scenario() -> None:
        agent = Agent("A", detector=detectors)
        await agent.start()
        try:
            for address in detectors:
                assert value(agent.metrics, "detector_connected", detector=address) == 0, address
            assert value(agent.metrics, "control_connected") == 0
        finally:
            await agent.stop()

    asyncio.run(scenario())


def test_an_rpc_detector_never_reached_reads_0() -> None:
    """The same for an RPC-mode agent's ``stablewatch_agent_rpc_detector_connected``."""
    detectors = _unreachable_detectors()
    with RpcAgent("A", detector=detectors, hint_after=None) as agent:
        for address in detectors:
            sample = agent.metrics.registry.get_sample_value(
                "stablewatch_agent_rpc_detector_connected", {"detector": address}
            )
            assert sample == 0, address
