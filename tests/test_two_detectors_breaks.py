"""Breaking a proven deadlock exactly once with two detectors side by side (DESIGN.md, "Breaking a
proven deadlock" and "Several detectors side by side"; issue 26, item 4).

Both detectors run ``resolve="youngest"`` over the same agents (replicas 0 and 1). Whichever proves
the deadlock first breaks its youngest wait; the other, on a cut that still shows it, picks the
same wait, and the agent, which breaks an instance at most once, answers it ``ALREADY_BROKEN`` (or
``GONE`` once the victim has left it). So per deadlock: one victim, one break in the agents'
metrics, at most one ``BROKEN`` among both detectors' resolutions.

* On demand (the test decides which detector looks when): the second detector's cut is taken
  while the victim has not yet left its broken wait, which its agent no longer reports, so the
  second detector sees no deadlock and breaks nothing. Once with both detectors up, once with the
  second stopped while the deadlock forms and restarted (same port, same data) after the first
  broke it.
* Scheduled (0.2 s) with the agents' long-wait hints on: a hint goes to both detectors at once, so
  both usually snapshot the deadlocked cut before either break lands: the race the exactly-once
  rule is for. Embedded agents as OS processes (``stablewatch.testing.deadlock_node``: an
  application wait in an asyncio task and on a thread, a send blocked by flow control), and RPC
  mode (a worker-pool deadlock).
* A deadlock that forms while one detector is down is broken by the other; the one that comes back
  breaks nothing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from detector_pair import attached, deadlocked, settled, take
from pool_service import PoolService
from rpc_harness import call

from polling import poll
from stablewatch.agents import DeadlockVictim, ThreadedAgent, WaitHandle
from stablewatch.agents.metrics import BREAK_KINDS
from stablewatch.agents.rpc import RpcAgent
from stablewatch.agents.rpc.metrics import BREAK_KINDS as RPC_BREAK_KINDS
from stablewatch.detector.service.detector import DetectorConfig
from stablewatch.detector.service.resolutions import outcome_word
from stablewatch.testing.deadlock_node import DeadlockProcess, introduce
from stablewatch.testing.detector import Running
from stablewatch.v1.control_pb2 import BREAK_OUTCOME_ALREADY_BROKEN, BREAK_OUTCOME_BROKEN, BREAK_OUTCOME_GONE
from stablewatch.v1.ids import id_space
from stablewatch.v1.query_pb2 import Resolution, SnapshotResults

pytestmark = pytest.mark.timeout(180)

JOIN_TIMEOUT = 30.0
SCHEDULE = 0.2  # seconds between scheduled snapshots


def detector(data_dir: Path, replica: int, *, scheduled: bool, listen: str = "127.0.0.1:0") -> Running:
    """A detector that breaks deadlocks (youngest wait first). ``scheduled``: snapshots every 0.2 s
    and the agents' hints start more; else only the test's snapshots run."""
    config = DetectorConfig(
        data_dir=data_dir,
        listen=listen,
        metrics_port=None,
        interval=SCHEDULE if scheduled else None,
        hints=scheduled,
        replica=replica,
        resolve="youngest",
    )
    return Running(config)


class Pair:
    """Two resolving detectors, replicas 0 and 1, each with its own store; ``restart`` brings one
    back on its port and data."""

    def __init__(self, folder: Path, *, scheduled: bool) -> None:
        self.folder = folder
        self.scheduled = scheduled
        self.detectors = [detector(folder / f"d{replica}", replica, scheduled=scheduled) for replica in (0, 1)]
        self.addresses = [running.detector.address for running in self.detectors]

    def __getitem__(self, replica: int) -> Running:
        return self.detectors[replica]

    def restart(self, replica: int) -> Running:
        data = self.folder / f"d{replica}"
        back = detector(data, replica, scheduled=self.scheduled, listen=self.addresses[replica])
        self.detectors[replica] = back
        return back

    def stop(self) -> None:
        for running in self.detectors:
            if running.thread.is_alive():
                running.stop()


@pytest.fixture
def on_demand(tmp_path: Path) -> Iterator[Pair]:
    pair = Pair(tmp_path, scheduled=False)
    yield pair
    pair.stop()


@pytest.fixture
def scheduled(tmp_path: Path) -> Iterator[Pair]:
    pair = Pair(tmp_path, scheduled=True)
    yield pair
    pair.stop()


# -- looking at the detectors ---------------------------------------------------------------------


def a_later_snapshot(running: Running, what: str) -> SnapshotResults:
    """The detector's newest completed snapshot once one that started after now has completed (one
    started earlier may complete later, and show what was before)."""
    now_us = time.time_ns() // 1000

    def started_later() -> SnapshotResults | None:
        latest = running.detector.latest()
        return latest if latest is not None and latest.snapshot.started_at.ToMicroseconds() > now_us else None

    return poll(started_later, f"{what}: a snapshot started later", timeout=30)


def broken_once(found: list[Resolution]) -> Resolution:
    """Both detectors' breaks of one deadlock: exactly one BROKEN, and any other break names the
    same wait and was answered already broken (or gone: the victim had left it)."""
    broken = [r for r in found if r.outcome == BREAK_OUTCOME_BROKEN]
    assert len(broken) == 1, found
    (victim,) = broken
    for resolution in found:
        assert (resolution.process_id, resolution.instance) == (victim.process_id, victim.instance), found
        assert resolution.outcome in (BREAK_OUTCOME_BROKEN, BREAK_OUTCOME_ALREADY_BROKEN, BREAK_OUTCOME_GONE), found
        assert resolution.policy == "youngest" and resolution.requested_by == "detector"
    return victim


def both_resolutions(pair: Pair) -> list[Resolution]:
    """Both detectors' settled breaks, each checked to carry a snapshot id of its detector's space."""
    found = []
    for replica in (0, 1):
        mine = settled(pair[replica])
        assert all(id_space(r.snapshot_id) == replica for r in mine), mine
        found += mine
    return found


# -- on demand: the second detector breaks a wait the first has broken ------------------------------


def application_breaks(agent: ThreadedAgent) -> int:
    registry = agent.agent.metrics.registry
    return int(sum(registry.get_sample_value("stablewatch_agent_breaks_total", {"kind": k}) or 0 for k in BREAK_KINDS))


class Waiter:
    """A service thread that holds its own lock and waits for its peer's (an application wait).

    It wakes when its peer hands the lock over (``wake``) or when its wait is broken. A victim
    stays in its broken wait until ``leave`` is set, as a thread slow to notice would: meanwhile
    the wait is still in every snapshot. Then it takes the ``DeadlockVictim``, gives its lock to
    its peer, and ends; the peer completes.
    """

    def __init__(self, agent: ThreadedAgent, peer: str) -> None:
        self.agent = agent
        self.peer = peer
        self.other: Waiter | None = None
        self.wake = threading.Event()
        self.leave = threading.Event()
        self.handle: WaitHandle | None = None
        self.victims: list[DeadlockVictim] = []
        self.completed = False
        self.thread = threading.Thread(target=self._run, name=f"waiter-{agent.process_id}")

    def _run(self) -> None:
        try:
            with self.agent.state.waiting(self.peer) as wait:
                wait.on_break(lambda victim: self.wake.set())
                self.handle = wait
                self.wake.wait(JOIN_TIMEOUT)
                if wait.victim is not None:
                    self.leave.wait(JOIN_TIMEOUT)
                wait.check()
        except DeadlockVictim as victim:
            self.victims.append(victim)
            assert self.other is not None
            self.other.wake.set()  # my lock goes to my peer
            return
        self.completed = True


@pytest.mark.parametrize("restarted", [False, True], ids=["both-up", "second-restarted"])
def test_a_deadlock_one_detector_broke_is_not_broken_again_by_the_other(on_demand: Pair, restarted: bool) -> None:
    """A and B each wait for the other. The first detector proves the deadlock and breaks B's wait
    (the youngest). While B has not yet left it, the second detector's cut no longer shows the
    deadlock (B's agent leaves a broken wait out of its state), so it breaks nothing: one victim.
    With ``restarted``, the second detector was stopped while the deadlock formed and comes back on
    its port and data after the break, knowing nothing of it: the same."""
    first, second = on_demand[0], on_demand[1]
    agents = {pid: ThreadedAgent(pid, detector=on_demand.addresses, hint_after=None) for pid in "AB"}
    waiters: dict[str, Waiter] = {}
    try:
        for agent in agents.values():
            agent.start()
        for running in (first, second):
            poll(lambda running=running: attached(running) == {"A", "B"}, "both attached to both", timeout=30)
        if restarted:
            second.stop()
            for agent in agents.values():
                poll(lambda agent=agent: not agent.agent.detectors[1].connected, "the second stream down")

        waiters = {"A": Waiter(agents["A"], "B"), "B": Waiter(agents["B"], "A")}
        waiters["A"].other, waiters["B"].other = waiters["B"], waiters["A"]
        for pid in "AB":  # one after the other: B's wait is the youngest
            waiters[pid].thread.start()
            poll(lambda pid=pid: waiters[pid].handle, f"{pid} waiting")
        a_wait, b_wait = waiters["A"].handle, waiters["B"].handle
        assert a_wait is not None and b_wait is not None
        assert b_wait.began_at_us > a_wait.began_at_us

        assert deadlocked(take(first))
        (broken,) = settled(first)
        assert (broken.process_id, broken.instance, broken.outcome) == ("B", b_wait.instance, BREAK_OUTCOME_BROKEN)
        assert b_wait.victim is not None and a_wait.victim is None  # B lingers in its broken wait

        if restarted:
            second = on_demand.restart(1)
            poll(lambda: attached(second) == {"A", "B"}, "both attached to the second again", timeout=30)
        assert not deadlocked(take(second))  # B lingers, but its broken wait holds no deadlock
        assert settled(second) == []

        waiters["B"].leave.set()
        for waiter in waiters.values():
            waiter.thread.join(JOIN_TIMEOUT)
            assert not waiter.thread.is_alive()
        assert waiters["A"].completed and not waiters["A"].victims
        (victim,) = waiters["B"].victims
        assert victim is b_wait.victim and victim.instance == b_wait.instance
        assert id_space(victim.snapshot_id) == 0  # the first detector's break reached the waiter
        assert "A -> B -> A" in str(victim) or "B -> A -> B" in str(victim)

        for running in (first, second):  # nothing left to break, by either
            assert not deadlocked(take(running))
        assert [r.resolution_id for r in settled(first)] == [broken.resolution_id]
        assert settled(second) == []
        assert sum(application_breaks(agent) for agent in agents.values()) == 1
    finally:
        for waiter in waiters.values():
            waiter.wake.set()
            waiter.leave.set()
            if waiter.thread.is_alive():
                waiter.thread.join(JOIN_TIMEOUT)
        for agent in agents.values():
            agent.stop()


# -- scheduled, with hints: embedded agents in their own processes --------------------------------


class Nodes:
    """Two deadlock nodes (``stablewatch.testing.deadlock_node``) of one kind attached to both detectors."""

    def __init__(self, pair: Pair, kind: str) -> None:
        addresses = ",".join(pair.addresses)
        self.nodes: list[DeadlockProcess] = []
        try:
            for mine, peer in ("AB", "BA"):
                self.nodes.append(DeadlockProcess(mine, peer, kind, addresses))
            introduce(self.nodes)
        except BaseException:
            self.stop()
            raise

    def go(self) -> None:
        """Deadlock them: each takes its own lock first (so neither lends it), then asks for the other's."""
        for node in self.nodes:
            node.command("hold")
            node.expect("holding")
        for node in self.nodes:
            node.command("go")

    def victims(self) -> list[dict[str, Any]]:
        return [event for node in self.nodes for event in node.victims()]

    def breaks(self) -> int:
        return sum(node.breaks() for node in self.nodes)

    def connected(self, address: str) -> list[float | None]:
        sample = ("stablewatch_agent_detector_connected", {"detector": address})
        return [node.metrics({"up": sample})["up"] for node in self.nodes]

    def stop(self) -> None:
        codes = [node.stop() for node in self.nodes]
        for node in self.nodes:
            print(f"--- {node.process_id} ---\n{node.log()}")
        assert codes == [0] * len(codes), codes


@pytest.fixture
def nodes_of(scheduled: Pair) -> Iterator[Callable[[str], Nodes]]:
    made: list[Nodes] = []

    def make(kind: str) -> Nodes:
        made.append(Nodes(scheduled, kind))
        return made[-1]

    yield make
    for nodes in made:
        nodes.stop()


def quiet_after_victim(pair: Pair, nodes: Nodes, kind: str) -> None:
    """Wait until the deadlock is over: both services done, or (flow) a snapshot of each detector
    shows no deadlock; then one more snapshot of each, so any late break would have been sent."""
    if kind == "flow":
        poll(lambda: nodes.victims(), "the victim", timeout=60)
        for running in pair.detectors:
            poll(lambda running=running: not deadlocked(a_later_snapshot(running, "no deadlock")), "no deadlock")
    else:
        for node in nodes.nodes:
            node.expect("done", timeout=60)
    for running in pair.detectors:
        assert not deadlocked(a_later_snapshot(running, "after the deadlock"))


@pytest.mark.parametrize("kind", ["asyncio", "threaded", "flow"])
def test_both_scheduled_detectors_resolving_end_a_deadlock_with_one_break(
    scheduled: Pair, nodes_of: Callable[[str], Nodes], kind: str
) -> None:
    """Hints start a snapshot on both detectors as soon as the last wait of the deadlock lasts:
    whichever finishes first breaks the youngest wait, the other breaks the same one or nothing."""
    nodes = nodes_of(kind)
    for running in scheduled.detectors:
        poll(lambda running=running: attached(running) == {"A", "B"}, "both attached to both", timeout=30)
    nodes.go()
    quiet_after_victim(scheduled, nodes, kind)
    (victim,) = nodes.victims()
    assert victim["kind"] == kind and "stablewatch broke this wait" in str(victim["message"])
    found = both_resolutions(scheduled)
    broken = broken_once(found)
    assert broken.instance == victim["instance"]
    print(f"{kind}: breaks sent {[(id_space(r.snapshot_id), outcome_word(r)) for r in found]}")
    assert nodes.breaks() == 1


def test_a_deadlock_formed_while_one_detector_is_down_is_broken_by_the_other_and_not_again(
    scheduled: Pair, nodes_of: Callable[[str], Nodes]
) -> None:
    """The second detector is stopped; the services deadlock; the first breaks it. The second comes
    back on its port and data: its agents return, its snapshots show no deadlock, it breaks nothing."""
    first, second = scheduled[0], scheduled[1]
    nodes = nodes_of("asyncio")
    for running in (first, second):
        poll(lambda running=running: attached(running) == {"A", "B"}, "both attached to both", timeout=30)
    second.stop()
    poll(lambda: nodes.connected(scheduled.addresses[1]) == [0, 0], "the agents saw the second go")
    nodes.go()
    for node in nodes.nodes:
        node.expect("done", timeout=60)
    (victim,) = nodes.victims()
    broken = broken_once(settled(first))
    assert broken.instance == victim["instance"] and id_space(broken.snapshot_id) == 0

    second = scheduled.restart(1)
    poll(lambda: attached(second) == {"A", "B"}, "both back on the second", timeout=30)
    poll(lambda: nodes.connected(scheduled.addresses[1]) == [1, 1], "the agents' streams to the second up")
    for _ in range(2):
        assert not deadlocked(a_later_snapshot(second, "the restarted detector"))
    assert settled(second) == []
    assert [r.resolution_id for r in settled(first)] == [broken.resolution_id]
    assert nodes.breaks() == 1


# -- scheduled, with hints: RPC mode ---------------------------------------------------------------


def rpc_breaks(agent: RpcAgent) -> int:
    registry = agent.metrics.registry
    return int(
        sum(registry.get_sample_value("stablewatch_agent_rpc_breaks_total", {"kind": k}) or 0 for k in RPC_BREAK_KINDS)
    )


def test_rpc_mode_a_pool_deadlock_is_broken_once_by_two_resolving_detectors(scheduled: Pair) -> None:
    """T calls A.Ping; A's only worker calls B.Pong; B's only worker calls A.Ping, which queues behind
    A's worker: a pool deadlock. Both detectors prove it; one call of the ring is broken, once, and
    the caller of that call gets ABORTED once."""
    agents = {pid: RpcAgent(pid, detector=scheduled.addresses, heartbeat_interval=0.2).start() for pid in "ABT"}
    errors: list[grpc.RpcError] = []
    channels: dict[str, grpc.Channel] = {}

    def ping(request: bytes, context: Any) -> bytes:
        return b"pinged" if request == b"inner" else call(channels["A->B"], "Pong", timeout=30)

    def pong(request: bytes, context: Any) -> bytes:
        try:
            return call(channels["B->A"], "Ping", b"inner", timeout=30)
        except grpc.RpcError as error:
            errors.append(error)
            return b"gave up: " + error.code().name.encode()

    services = {"A": PoolService({"Ping": ping}, agents["A"]), "B": PoolService({"Pong": pong}, agents["B"])}
    for name, (caller, callee) in {"A->B": ("A", "B"), "B->A": ("B", "A"), "T->A": ("T", "A")}.items():
        plain = grpc.insecure_channel(services[callee].address)
        channels[name] = agents[caller].instrument_channel(plain, callee, breakable=True)
    driver = futures.ThreadPoolExecutor(1)
    try:
        for running in scheduled.detectors:
            poll(lambda running=running: attached(running) == {"A", "B", "T"}, "all attached to both", timeout=30)
        outer = driver.submit(call, channels["T->A"], "Ping", b"outer", timeout=30)
        assert outer.result(60) == b"gave up: ABORTED"
        (error,) = errors
        assert error.code() == grpc.StatusCode.ABORTED and "deadlock" in error.details()
        for running in scheduled.detectors:
            assert not deadlocked(a_later_snapshot(running, "after the deadlock"))
        found = both_resolutions(scheduled)
        broken = broken_once(found)
        assert broken.process_id in ("A", "B")
        print(f"rpc: breaks sent {[(id_space(r.snapshot_id), outcome_word(r)) for r in found]}")
        assert sum(rpc_breaks(agent) for agent in agents.values()) == 1
        assert len(errors) == 1
    finally:
        driver.shutdown(wait=True, cancel_futures=True)
        for channel in channels.values():
            channel.close()
        for service in services.values():
            service.stop()
        for agent in agents.values():
            agent.stop()
