"""Breaking proven deadlocks end to end: real processes, a real detector with ``--resolve``.

* The RPC shop (``stablewatch.examples.shop``, deadlock workload): its pools deadlock again and
  again; each time the detector breaks one call of the cycle, the buyer whose order was the victim
  sees ``ABORTED`` naming the deadlock, retries, and orders keep completing. No deadlock is broken
  twice, and every break is listed with its evidence.
* The churn workload (the same call cycle, never deadlocked) with ``--resolve``: nothing is broken.
* Embedded agents (``stablewatch.testing.deadlock_node``, one OS process each): an application
  wait in an asyncio task and on a service thread, and a send blocked in a flow-control deadlock,
  each broken once; the victim gets ``DeadlockVictim`` and the services go on.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from command_line import DetectorProcess

from polling import poll
from stablewatch.examples.shop import ROLES, SERVICES
from stablewatch.examples.shop_processes import ShopProcesses
from stablewatch.testing.deadlock_node import DeadlockProcess, introduce
from stablewatch.v1 import query_pb2
from stablewatch.v1.control_pb2 import BREAK_OUTCOME_BROKEN

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def resolving(tmp_path: Path) -> Iterator[DetectorProcess]:
    """A detector that breaks deadlocks (youngest wait first), on a slow schedule: hints start snapshots."""
    detector = DetectorProcess(
        tmp_path / "data",
        "--resolve",
        "youngest",
        "--interval",
        "1",
        "--deadline",
        "2",
        "--members",
        ",".join(ROLES),
    )
    yield detector
    assert detector.stop() == 0


def aborted_places(shop: ShopProcesses) -> list[dict[str, object]]:
    """The client's Places that came back ABORTED because stablewatch broke their chain."""
    finished = shop.status("client")["finished"]
    assert isinstance(finished, list)
    return [call for call in finished if call["code"] == "ABORTED"]


def test_the_shops_deadlocks_are_broken_once_each_and_orders_go_on(tmp_path: Path, resolving: DetectorProcess) -> None:
    shop = ShopProcesses(tmp_path / "shop", "deadlock", resolving.address)
    try:
        shop.start()
        # The shop deadlocks within moments of starting; a break lets orders go on, and it
        # deadlocks again: three broken deadlocks, each seen by a buyer as an aborted order.
        poll(lambda: len(aborted_places(shop)) >= 3, "three orders aborted by broken deadlocks", timeout=90)
        placed = shop.placed()
        poll(lambda: shop.placed() > placed, "orders completing after the breaks", timeout=60)
        shop.check_running()
        for call in aborted_places(shop)[:3]:
            assert "deadlock" in str(call["details"]), call
    finally:
        shop.stop()
        for role in ROLES:
            print(f"--- {role} ---\n{shop.log(role)[-1500:]}")
    breaks = resolving.resolutions()
    broken = [r for r in breaks if r.outcome == BREAK_OUTCOME_BROKEN]
    assert len(broken) >= 3, breaks
    for resolution in broken:
        assert resolution.process_id in SERVICES
        assert resolution.policy == "youngest" and resolution.requested_by == "detector"
        assert resolution.instance > 0 and resolution.HasField("wait_began_at")
        assert {node.process for node in resolution.component} <= set(SERVICES)
        assert resolution.deadlock.count("->") >= 2
    # Exactly once: no deadlock (its sink component) was broken twice.
    components = Counter(tuple(sorted((n.process, n.task) for n in r.component)) for r in broken)
    assert max(components.values()) == 1, components


def test_churn_is_never_broken(tmp_path: Path) -> None:
    members = ",".join(ROLES)
    detector = DetectorProcess(
        tmp_path / "data", "--resolve", "youngest", "--interval", "0.05", "--deadline", "2", "--members", members
    )
    shop = ShopProcesses(tmp_path / "shop", "churn", detector.address)
    try:
        shop.start()

        def completed() -> int:
            page = detector.query.ListSnapshots(query_pb2.ListSnapshotsRequest(page_size=1000), timeout=10)
            return sum(1 for s in page.snapshots if s.outcome == query_pb2.SNAPSHOT_OUTCOME_COMPLETED)

        poll(lambda: completed() >= 150, "150 completed snapshots of the churning shop", timeout=120)
        shop.check_running()
        assert aborted_places(shop) == []
        assert detector.resolutions() == []
        assert shop.placed() > 0
    finally:
        shop.stop()
        assert detector.stop() == 0


# -- embedded agents: an application wait (asyncio, threaded) and a blocked send ------------------


@contextlib.contextmanager
def deadlocking_pair(folder: Path, kind: str) -> Iterator[tuple[DetectorProcess, list[DeadlockProcess]]]:
    detector = DetectorProcess(folder / "data", "--resolve", "youngest", "--interval", "1", "--members", "A,B")
    nodes: list[DeadlockProcess] = []
    try:
        nodes = [DeadlockProcess("A", "B", kind, detector.address), DeadlockProcess("B", "A", kind, detector.address)]
        introduce(nodes)
        if kind != "flow":  # both hold their own lock first: "go" then deadlocks them for sure
            for node in nodes:
                node.command("hold")
                node.expect("holding")
        for node in nodes:
            node.command("go")
        yield detector, nodes
    finally:
        codes = [node.stop() for node in nodes]
        for node in nodes:
            print(f"--- {node.process_id} ---\n{node.log()}")
        assert detector.stop() == 0
        assert codes == [0] * len(nodes), codes


@pytest.mark.parametrize("kind", ["asyncio", "threaded"])
def test_an_application_wait_of_an_embedded_agent_is_broken_and_both_complete(tmp_path: Path, kind: str) -> None:
    """Each holds its lock and waits for the other's: one wait is broken, the victim gives its lock
    away, its peer completes, then the victim asks again and completes too."""
    with deadlocking_pair(tmp_path, kind) as (detector, nodes):
        dones = {node.process_id: node.expect("done", timeout=60) for node in nodes}
        victims = [event for node in nodes for event in node.victims()]
        assert len(victims) == 1, [node.events for node in nodes]
        (victim,) = victims
        assert victim["kind"] == kind and "stablewatch broke this wait" in str(victim["message"])
        assert set(dones) == {"A", "B"}
        breaks = poll(lambda: detector.resolutions(), "the break in the detector's list")
        (broken,) = [r for r in breaks if r.outcome == BREAK_OUTCOME_BROKEN]
        assert broken.instance == victim["instance"]
        assert {(n.process, n.task) for n in broken.component} == {("A", ""), ("B", "")}


def test_a_blocked_send_in_a_flow_control_deadlock_is_broken(tmp_path: Path) -> None:
    """Handlers pass balls both ways over windows of two: both block in send. The victim's send
    raises DeadlockVictim (that ball not sent), the play winds down, and no deadlock remains."""
    with deadlocking_pair(tmp_path, "flow") as (detector, nodes):
        (victim,) = poll(lambda: [event for node in nodes for event in node.victims()], "the victim", timeout=60)
        assert victim["kind"] == "flow" and "stablewatch broke this wait" in str(victim["message"])
        breaks = poll(
            lambda: [r for r in detector.resolutions() if r.outcome == BREAK_OUTCOME_BROKEN],
            "the break reported broken",
        )
        assert [r.instance for r in breaks] == [victim["instance"]]

        def no_deadlock() -> bool:
            results = detector.query.TriggerSnapshot(query_pb2.TriggerSnapshotRequest(timeout_ms=5000), timeout=10)
            deadlock = next(r for r in results.results if r.name == "deadlock")
            return not deadlock.holds and not deadlock.unknown

        poll(no_deadlock, "a snapshot without a deadlock after the break", timeout=30, interval=0.2)
