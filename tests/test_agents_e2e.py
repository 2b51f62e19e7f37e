"""Agents in separate OS processes exchange tokens over real gRPC while snapshots run."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from cuts import assert_consistent
from detector_stub import StubDetector

from stablewatch.testing.token_nodes import Node, connect_all, wait_quiet

TOKENS = 100


@pytest.fixture
def start_nodes() -> Iterator[callable]:
    started: list[Node] = []

    def start(*ids: str, args: tuple[str, ...] = ()) -> list[Node]:
        nodes = [Node(pid, "--tokens", str(TOKENS), *args) for pid in ids]
        started.extend(nodes)
        return nodes

    yield start
    for node in started:
        node.stop()


def test_snapshots_during_transfers_are_consistent_and_conserve_tokens(detector: StubDetector, start_nodes) -> None:
    nodes = start_nodes("A", "B", "C", args=("--detector", detector.address))
    connect_all(nodes)
    detector.wait_members({"A", "B", "C"})
    for seed, node in enumerate(nodes):
        node.command("transfer", count=3000, seed=seed)
    snapshots = [detector.snapshot() for _ in range(10)]
    for node in nodes:
        node.expect("transferred", timeout=120)
    snapshots.append(detector.snapshot())
    stats = wait_quiet(nodes)

    assert not detector.rejections, detector.rejections
    for snapshot in snapshots:
        assert [p.process_id for p in snapshot.processes] == ["A", "B", "C"]
        assert_consistent(snapshot, 3 * TOKENS)
    assert any(c.messages for s in snapshots for c in s.channels), "no snapshot caught a message in flight"
    assert all(not s["errors"] for s in stats), [s["errors"] for s in stats]
    assert sum(s["tokens"] for s in stats) == 3 * TOKENS
    quiet = detector.snapshot()
    assert_consistent(quiet, 3 * TOKENS)
    assert not any(c.messages for c in quiet.channels)
