"""Two detectors side by side over the same agents: both snapshot them, neither waits for the other.

Real detectors on their own threads (replicas 0 and 1), agents in their own OS processes (channel
mode) or in the test (RPC mode), all on loopback.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import pytest
from cuts import assert_consistent
from rpc_harness import Service, call, channel_to, stored

from polling import poll
from stablewatch.agents.agent import Agent
from stablewatch.agents.detectors import DetectorLinks, detector_addresses
from stablewatch.agents.rpc.agent import RpcAgent
from stablewatch.detector.service.detector import DetectorConfig
from stablewatch.detector.service.query import outcome_name
from stablewatch.testing.detector import Running
from stablewatch.testing.token_nodes import Node, connect_all, wait_quiet
from stablewatch.v1 import GlobalSnapshot
from stablewatch.v1.ids import id_space
from stablewatch.v1.query_pb2 import SnapshotResults

TOKENS = 100


def detector(data_dir: Path, replica: int, listen: str = "127.0.0.1:0") -> Running:
    config = DetectorConfig(data_dir=data_dir, listen=listen, metrics_port=None, interval=None, replica=replica)
    return Running(config)


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[list[Running]]:
    """Two detectors, replicas 0 and 1, each with its own store."""
    detectors = [detector(tmp_path / f"d{replica}", replica) for replica in (0, 1)]
    yield detectors
    for running in detectors:
        if running.thread.is_alive():
            running.stop()


def take(running: Running, deadline: float = 20) -> SnapshotResults:
    return running.call(running.detector.take_snapshot(deadline=deadline), 40)


def attached(running: Running) -> set[str]:
    return set(running.detector.coordinator.members)


def test_detector_addresses_take_one_several_or_none() -> None:
    assert detector_addresses(None) == ()
    assert detector_addresses("a:1") == ("a:1",)
    assert detector_addresses("a:1, b:2") == ("a:1", "b:2")
    assert detector_addresses(["a:1", "b:2"]) == ("a:1", "b:2")
    with pytest.raises(ValueError, match="address 2 of 'a:1,' is empty"):
        detector_addresses("a:1,")
    with pytest.raises(ValueError, match="a:1 is given more than once"):
        detector_addresses("a:1,b:2,a:1")
    with pytest.raises(ValueError, match="is empty"):
        Agent("P", detector="a:1,,b:2")


def test_both_detectors_snapshot_the_same_processes_at_once_and_each_cut_holds(pair: list[Running]) -> None:
    """Agents in their own processes, each attached to both detectors, exchange tokens while both
    detectors snapshot them concurrently: every cut of each proves every channel and holds the tokens."""
    addresses = ",".join(running.detector.address for running in pair)
    nodes = [Node(pid, "--tokens", str(TOKENS), "--detector", addresses) for pid in "ABC"]
    try:
        connect_all(nodes)
        for running in pair:
            poll(lambda running=running: attached(running) == {"A", "B", "C"}, "all attached", timeout=30)
        for seed, node in enumerate(nodes):
            node.command("transfer", count=3000, seed=seed)
        with futures.ThreadPoolExecutor(2) as pool:
            rounds = [[pool.submit(take, running) for running in pair] for _ in range(8)]
            results = [[future.result(60) for future in round_] for round_ in rounds]
        for node in nodes:
            node.expect("transferred", timeout=120)
        stats = wait_quiet(nodes)
        cuts: dict[int, list[GlobalSnapshot]] = {0: [], 1: []}
        for round_ in results:
            for replica, (running, outcome) in enumerate(zip(pair, round_, strict=True)):
                assert outcome_name(outcome.snapshot.outcome) == "completed", outcome.snapshot.abort_reason
                assert id_space(outcome.snapshot.snapshot_id) == replica
                cuts[replica].append(stored(running, outcome))
        for replica, snapshots in cuts.items():
            for snapshot in snapshots:
                assert [p.process_id for p in snapshot.processes] == ["A", "B", "C"], replica
                assert_consistent(snapshot, 3 * TOKENS)
        assert any(c.messages for snapshots in cuts.values() for s in snapshots for c in s.channels), (
            "nothing in flight"
        )
        assert all(not s["errors"] for s in stats), [s["errors"] for s in stats]
        assert sum(s["tokens"] for s in stats) == 3 * TOKENS
    finally:
        for node in nodes:
            node.stop()


def test_one_detector_down_holds_up_nothing_and_its_agents_come_back(tmp_path: Path, pair: list[Running]) -> None:
    """With one detector stopped the other goes on snapshotting; restarted on its port, it gets the
    agents back, and the agents' metrics tell which detector each stream is up to."""
    first, second = pair
    addresses = [first.detector.address, second.detector.address]
    nodes = [Node(pid, "--tokens", str(TOKENS), "--detector", ",".join(addresses)) for pid in "AB"]
    try:
        connect_all(nodes)
        for running in pair:
            poll(lambda running=running: attached(running) == {"A", "B"}, "both attached", timeout=30)
        gauge = "stablewatch_agent_detector_connected"
        metrics = {address: (gauge, {"detector": address}) for address in addresses}
        poll(lambda: all(nodes[0].metrics(metrics)[a] == 1 for a in addresses), "both streams up")
        second.stop()
        poll(lambda: nodes[0].metrics(metrics)[addresses[1]] == 0, "the second stream is down")
        for _ in range(3):  # the first detector does not wait for the second
            outcome = take(first)
            assert outcome_name(outcome.snapshot.outcome) == "completed", outcome.snapshot.abort_reason
        back = detector(tmp_path / "d1", 1, listen=addresses[1])
        pair[1] = back  # stopped by the fixture
        poll(lambda: attached(back) == {"A", "B"}, "the agents came back", timeout=30)
        outcome = take(back)
        assert outcome_name(outcome.snapshot.outcome) == "completed", outcome.snapshot.abort_reason
        assert id_space(outcome.snapshot.snapshot_id) == 1
        poll(lambda: all(nodes[0].metrics(metrics)[a] == 1 for a in addresses), "both streams up again")
    finally:
        for node in nodes:
            node.stop()


def test_a_second_detector_with_the_same_replica_is_refused_until_the_first_is_gone(tmp_path: Path) -> None:
    """Two detectors that share an id space could hand out the same id: the agent attaches to one."""
    first = detector(tmp_path / "a", 3)
    second = detector(tmp_path / "b", 3)
    agent = RpcAgent("P", detector=[first.detector.address, second.detector.address], heartbeat_interval=0.2)
    agent.start()
    try:
        # The owner is the one the agent says it attached to. A detector counts the agent a member
        # from its answer until the agent refuses it, so the detectors' own lists may both name P
        # for a moment at each retry of the refused one.
        owner_address = poll(
            lambda: next((s.address for s in agent.detectors if s.connected and s.id_space == 3), None),
            "attached to one",
        )
        owner, other = (first, second) if first.detector.address == owner_address else (second, first)
        poll(lambda: attached(owner) == {"P"}, "the owner counts the agent")
        poll(lambda: {s.address: s for s in agent.detectors}[other.detector.address].event == "refused", "refused")
        status = {s.address: s for s in agent.detectors}
        refused = status[other.detector.address]
        assert not refused.connected
        assert f"the detector at {owner.detector.address} already has id space 3" in refused.detail
        assert status[owner.detector.address].connected and status[owner.detector.address].id_space == 3
        poll(lambda: attached(other) == set(), "the refused detector drops the agent")
        owner.stop()
        poll(lambda: attached(other) == {"P"}, "the other one takes the agent", timeout=30)
        other.stop()
    finally:
        agent.stop()


def test_rpc_mode_agents_take_part_in_both_detectors_snapshots(pair: list[Running]) -> None:
    """A caller and a server in RPC mode, both attached to both detectors, under a stream of calls:
    each detector's snapshots complete with both processes, and every channel is proved."""
    addresses = [running.detector.address for running in pair]
    s_agent = RpcAgent("S", detector=addresses, heartbeat_interval=0.2).start()
    c_agent = RpcAgent("C", detector=addresses, heartbeat_interval=0.2).start()
    service = Service({"Echo": lambda request, context: request}, s_agent)
    channel = channel_to(service, c_agent, "S")
    stop = threading.Event()

    def caller() -> int:
        count = 0
        while not stop.is_set():
            assert call(channel, "Echo", b"x", timeout=10) == b"x"
            count += 1
        return count

    pool = futures.ThreadPoolExecutor(3)
    try:
        for running in pair:
            poll(lambda running=running: attached(running) == {"S", "C"}, "both attached", timeout=30)
        calls = pool.submit(caller)
        rounds = [[pool.submit(take, running) for running in pair] for _ in range(6)]
        for round_ in rounds:
            for running, future in zip(pair, round_, strict=True):
                outcome = future.result(60)
                assert outcome_name(outcome.snapshot.outcome) == "completed", outcome.snapshot.abort_reason
                cut = stored(running, outcome)
                assert [p.process_id for p in cut.processes] == ["C", "S"]
                for c in cut.channels:
                    assert c.received_before_recording + len(c.messages) == c.sent_before_marker
        stop.set()
        assert calls.result(30) > 0
        assert [s.connected for s in s_agent.detectors] == [True, True]
    finally:
        stop.set()
        pool.shutdown(wait=True)
        channel.close()
        service.stop()
        c_agent.stop()
        s_agent.stop()


def test_links_route_each_part_to_the_detector_of_its_id_space() -> None:
    """Parts, failures and hints go where they belong, without a network: clients are stand-ins."""

    class Client:
        def __init__(self, target: str) -> None:
            self.target, self.connected, self.id_space = target, True, None
            self.sent: list[tuple[str, int]] = []

        async def start(self) -> None: ...

        def report_part(self, part) -> bool:
            self.sent.append(("part", part.snapshot_id))
            return True

        def report_failure(self, snapshot_id: int, reason: str) -> bool:
            self.sent.append(("failure", snapshot_id))
            return True

        def send_hint(self, hint) -> bool:
            self.sent.append(("hint", 0))
            return True

    claims = {}

    def make(address, on_registered, on_event):
        claims[address] = on_registered
        return Client(address)

    links = DetectorLinks(["a:1", "b:2"], make)  # type: ignore[arg-type]
    a, b = links.clients
    assert claims["a:1"](0) is None and claims["b:2"](1) is None
    from stablewatch.v1 import LocalSnapshotPart
    from stablewatch.v1.control_pb2 import WaitHint

    assert links.report_part(LocalSnapshotPart(snapshot_id=256))  # space 0
    assert links.report_part(LocalSnapshotPart(snapshot_id=257))  # space 1
    assert not links.report_part(LocalSnapshotPart(snapshot_id=258))  # space 2: no such detector
    assert not links.report_part(LocalSnapshotPart(snapshot_id=(1 << 63) + 1))  # a local snapshot
    assert links.report_failure(385, "why")  # space 1
    assert links.send_hint(WaitHint())
    assert a.sent == [("part", 256), ("hint", 0)]
    assert b.sent == [("part", 257), ("failure", 385), ("hint", 0)]
    assert claims["b:2"](0) is not None  # a's space, a is up: refused
    a.connected = False
    assert claims["b:2"](0) is None  # a is gone: b may have it
    assert links.client_for(128) is b
