"""The shop example end to end: three gRPC services and a client, each its own OS process.

* Without stablewatch the shop is plain gRPC: the churn workload keeps completing orders, and the
  deadlock workload really gets stuck (every pool busy, calls out that never end).
* With a detector (``stablewatch detector`` as a process, asked through its query API): the
  deadlock is reported with its cycle of calls (service, method, call), and the churn workload,
  whose call graph has the same cycle, is never reported deadlocked over many snapshots.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from command_line import DetectorProcess

from polling import poll
from stablewatch.examples.shop import CHARGE, CONFIRM, PLACE, RESERVE, ROLES, SERVICES, WORKLOADS
from stablewatch.examples.shop_processes import ShopProcesses
from stablewatch.v1 import query_pb2

pytestmark = pytest.mark.timeout(180)

CALL_NAME = re.compile(r"^(?P<method>/shop\.\w+/\w+)#(?P<caller>\w+)@(?P<incarnation>[0-9a-f]+):(?P<seq>\d+)$")


@pytest.fixture
def detector(tmp_path: Path) -> Iterator[DetectorProcess]:
    options = ["--interval", "0.1", "--deadline", "2", "--min-members", str(len(ROLES)), "--members", ",".join(ROLES)]
    running = DetectorProcess(tmp_path / "data", *options)
    yield running
    code = running.stop()
    print(f"--- detector (exit {code}) ---\n{running.log()}")
    assert code == 0


def shop(folder: Path, workload: str, detector: DetectorProcess | None = None) -> ShopProcesses:
    return ShopProcesses(folder / "shop", workload, None if detector is None else detector.address)


def stop_cleanly(processes: ShopProcesses) -> None:
    codes = processes.stop()
    assert codes == dict.fromkeys(ROLES, 0), f"exit codes after SIGTERM: {codes}"


def show_logs(processes: ShopProcesses) -> None:
    for role in ROLES:  # shown by pytest when the test failed
        print(f"--- {role} ---\n{processes.log(role)[-2000:]}")


# -- without stablewatch: plain gRPC ----------------------------------------------------------------


def test_churn_keeps_completing_orders_without_stablewatch(tmp_path: Path) -> None:
    processes = shop(tmp_path, "churn")
    try:
        processes.start()
        first = poll(processes.placed, "a first completed order")
        poll(lambda: processes.placed() >= first + 100, "a hundred more orders")
        processes.check_running()
        stop_cleanly(processes)
    finally:
        processes.stop()
        show_logs(processes)


def test_the_deadlock_workload_really_gets_stuck_without_stablewatch(tmp_path: Path) -> None:
    processes = shop(tmp_path, "deadlock")
    workers = WORKLOADS["deadlock"].workers
    try:
        processes.start()

        def stuck() -> bool:
            return all(processes.status(s)["busy"] == workers[s] for s in SERVICES)

        poll(stuck, "every worker of every pool busy")
        before = {role: processes.status(role) for role in ROLES}
        time.sleep(1.0)  # a deadlock is stable: a second later nothing has moved
        after = {role: processes.status(role) for role in ROLES}
        for role in ROLES:
            assert after[role]["counts"] == before[role]["counts"], role
            assert {c["id"] for c in after[role]["outstanding"]} == {c["id"] for c in before[role]["outstanding"]}
        # The cycle, in the books: Places wait on Charges, Charges on Reserves, Reserves on Confirms.
        calls_out = {role: {c["method"] for c in after[role]["outstanding"]} for role in SERVICES}
        assert calls_out == {"orders": {CHARGE}, "payments": {RESERVE}, "inventory": {CONFIRM}}
        assert processes.placed() == 0
        stop_cleanly(processes)  # a stuck shop still stops on SIGTERM
    finally:
        processes.stop()
        show_logs(processes)


# -- with stablewatch ---------------------------------------------------------------------------------


def test_the_deadlock_is_reported_with_its_cycle_of_calls(tmp_path: Path, detector: DetectorProcess) -> None:
    processes = shop(tmp_path, "deadlock", detector)
    try:
        processes.start()
        poll(lambda: detector.members() == set(ROLES), "the whole shop attached", timeout=60)
        attached = time.monotonic()

        def deadlock() -> query_pb2.SnapshotResults | None:
            latest = detector.latest()
            if latest is None:
                return None
            found = [r for r in latest.results if r.name == "deadlock" and r.holds]
            return latest if found else None

        results = poll(deadlock, "a deadlock reported", timeout=30, interval=0.05)
        reported_after = time.monotonic() - attached
        snapshot_id = results.snapshot.snapshot_id
        graph = detector.query.GetWaitForGraph(query_pb2.GetSnapshotRequest(snapshot_id=snapshot_id), timeout=10)
        cycle = list(graph.deadlock.cycle)
        print(f"deadlock reported {reported_after:.2f} s after the shop attached; cycle:")
        for node in cycle:
            print(f"  {node.process} {node.task}")

        # The shop deadlocks as soon as its client starts: the first snapshots of the whole shop see it
        # (10 a second here; the issue asks for a report within a second, with room for a loaded machine).
        assert reported_after < 5.0, f"reported {reported_after:.2f} s after the shop attached"
        # Every node is a call: the service serving it, its method, and the call's name.
        assert cycle, graph
        methods = []
        for node in cycle:
            assert node.process in SERVICES, node
            name = CALL_NAME.match(node.task)
            assert name is not None, f"not a call name: {node.task!r}"
            methods.append(name["method"])
            assert {PLACE: "orders", CONFIRM: "orders", CHARGE: "payments", RESERVE: "inventory"}[
                name["method"]
            ] == node.process
        # Round the cycle: Place -> Charge -> Reserve -> Confirm -> (queued behind) Place ...
        assert {PLACE, CHARGE, RESERVE, CONFIRM} <= set(methods), methods
        successor = {PLACE: CHARGE, CHARGE: RESERVE, RESERVE: CONFIRM, CONFIRM: PLACE}
        for here, there in zip(methods, methods[1:] + methods[:1], strict=True):
            assert there == successor[here], methods
        # Who called whom: a Charge is called by orders, a Reserve by payments, a Confirm by inventory.
        callers = {CHARGE: "orders", RESERVE: "payments", CONFIRM: "inventory", PLACE: "client"}
        for node in cycle:
            name = CALL_NAME.match(node.task)
            assert name is not None and name["caller"] == callers[name["method"]], node.task
        # Real: the shop completed no order, and the deadlock stays reported.
        assert processes.placed() == 0
        poll(lambda: detector.latest().snapshot.snapshot_id > snapshot_id + 3, "three more snapshots")
        assert deadlock() is not None
        stop_cleanly(processes)
    finally:
        processes.stop()
        show_logs(processes)


def test_churn_is_never_reported_deadlocked(tmp_path: Path, detector: DetectorProcess) -> None:
    processes = shop(tmp_path, "churn", detector)
    wanted = 100
    try:
        processes.start()
        poll(lambda: detector.members() == set(ROLES), "the whole shop attached", timeout=60)
        placed = processes.placed()
        completed = with_waits = 0
        deadline = time.monotonic() + 90
        for event in detector.query.Watch(query_pb2.WatchRequest(), timeout=120):
            summary = event.results.snapshot
            assert time.monotonic() < deadline, f"only {completed} snapshots completed"
            if summary.outcome != query_pb2.SNAPSHOT_OUTCOME_COMPLETED:
                continue
            completed += 1
            deadlock = next(r for r in event.results.results if r.name == "deadlock")
            assert not deadlock.holds, f"snapshot {summary.snapshot_id}: {deadlock.summary}"
            if completed % 10 == 0:  # now and then, check the cuts see the calls
                snapshot = detector.query.GetSnapshot(
                    query_pb2.GetSnapshotRequest(snapshot_id=summary.snapshot_id), timeout=10
                )
                with_waits += any(p.state.waits for p in snapshot.processes)
            if completed >= wanted:
                break
        assert with_waits > 0, "no cut saw a call out"
        assert processes.placed() > placed + 100, "the shop stopped moving"
        stop_cleanly(processes)
    finally:
        processes.stop()
        show_logs(processes)
