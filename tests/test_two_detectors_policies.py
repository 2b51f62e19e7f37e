"""Two detectors side by side whose ``--resolve`` policies differ must not make two victims of one
deadlock (DESIGN.md, "Breaking a proven deadlock" and "Several detectors side by side").

Exactly once rests on both detectors choosing the same victim. With ``youngest`` on one and
``oldest`` on the other they choose different waits of the same deadlock, and each agent breaks a
wait at most once: both waits would be broken. So each detector states its policy when it registers
an agent, and an agent attached to detectors whose automatic policies differ refuses their
automatic breaks (``BREAK_OUTCOME_POLICIES_DISAGREE``, naming the policies); an operator's break
(``stablewatch resolve``) is one explicit order and goes through.

* End to end: real detectors (replicas 0 and 1) on their own threads, threaded agents. A third
  agent, C, holds both detectors' snapshots open (its message handler is running, so it cannot
  record) until A and B have recorded both: both cuts show the deadlock before either detector can
  break anything, which is the race two detectors resolve side by side.
* The agent's rule (:class:`~stablewatch.agents.breaking.PolicyAgreement`) and the detector's
  (:class:`~stablewatch.detector.service.resolver.Resolver`), pure, without I/O.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path

import pytest
from detector_pair import attached, deadlocked, settled, take

from polling import poll
from stablewatch.agents import ThreadedAgent, WaitHandle
from stablewatch.agents.breaking import PolicyAgreement
from stablewatch.agents.control import ControlClient
from stablewatch.agents.core import LOCAL_ID_BASE, AppMessage
from stablewatch.agents.detectors import DetectorLinks
from stablewatch.detector.archive.schema import RESOLUTION_OUTCOMES as ARCHIVED_OUTCOMES
from stablewatch.detector.archive.schema import resolution_from_row, resolution_row
from stablewatch.detector.evaluation import evaluate
from stablewatch.detector.evaluation.victims import Victim
from stablewatch.detector.service.detector import DetectorConfig
from stablewatch.detector.service.metrics import RESOLUTION_OUTCOMES, DetectorMetrics
from stablewatch.detector.service.resolutions import Resolutions, outcome_word
from stablewatch.detector.service.resolver import Resolver
from stablewatch.detector.service.store import Store
from stablewatch.testing.detector import Running
from stablewatch.v1 import (
    WAIT_MODEL_AND,
    Evaluation,
    GlobalSnapshot,
    LocalSnapshotPart,
    LocalState,
    ProcessSnapshot,
    Wait,
    WaitNode,
)
from stablewatch.v1.control_pb2 import BREAK_OUTCOME_POLICIES_DISAGREE, BreakReport, BreakWait
from stablewatch.v1.ids import id_space
from stablewatch.v1.query_pb2 import Resolution, SnapshotResults

pytestmark = pytest.mark.timeout(120)

JOIN_TIMEOUT = 30.0


def detector(data_dir: Path, replica: int, resolve: str | None) -> Running:
    """A detector that snapshots only when the test asks, breaking deadlocks by ``resolve``."""
    config = DetectorConfig(
        data_dir=data_dir, listen="127.0.0.1:0", metrics_port=None, interval=None, hints=False,
        replica=replica, resolve=resolve,
    )  # fmt: skip
    return Running(config)


class Waiter:
    """A service thread of ``agent`` that waits for ``peer`` (an application wait) until it is
    released or its wait is broken."""

    def __init__(self, agent: ThreadedAgent, peer: str) -> None:
        self.agent = agent
        self.peer = peer
        self.release = threading.Event()
        self.handle: WaitHandle | None = None
        self.thread = threading.Thread(target=self._run, name=f"waiter-{agent.process_id}")

    def _run(self) -> None:
        with self.agent.state.waiting(self.peer) as wait:
            wait.on_break(lambda victim: self.release.set())
            self.handle = wait
            self.release.wait(JOIN_TIMEOUT)

    def broken(self) -> bool:
        return self.handle is not None and self.handle.victim is not None

    def instance(self) -> int:
        assert self.handle is not None
        return self.handle.instance


class World:
    """Detectors (``policies``, one per replica) and agents A, B, C attached to all of them.

    ``stated``: what each detector tells the agents instead (as one older or misconfigured would).

    A and B deadlock (A waits first, so B's wait is the youngest). C's message handler blocks
    until :meth:`let_c_record`: while it runs, C records no snapshot, so no snapshot completes.
    """

    def __init__(self, folder: Path, policies: list[str | None], stated: list[str] | None = None) -> None:
        self.detectors: list[Running] = []
        self.agents: dict[str, ThreadedAgent] = {}
        self.waiters: dict[str, Waiter] = {}
        self.gate = threading.Event()
        self.holding = threading.Event()
        self.spaces: dict[str, set[int]] = {"A": set(), "B": set(), "C": set()}
        for replica, policy in enumerate(policies):
            self.detectors.append(detector(folder / f"d{replica}", replica, policy))
        for running, policy in zip(self.detectors, stated or [], strict=False):  # what it tells agents
            running.on_loop(lambda running=running, policy=policy: _state(running, policy))
        self.addresses = [running.detector.address for running in self.detectors]

    def start(self) -> None:
        c = self.agent("C")

        async def hold(src: str, message: AppMessage) -> None:
            self.holding.set()
            await asyncio.to_thread(self.gate.wait, JOIN_TIMEOUT)

        c.on_message(hold)
        c.start()
        self.agent("A", peers={"C": c.address}).start()
        self.agent("B").start()
        for running in self.detectors:
            poll(lambda running=running: attached(running) == {"A", "B", "C"}, "all attached", timeout=30)
        for pid in "AB":  # the detectors have them; they have read the detectors' registrations too
            poll(
                lambda pid=pid: all(s.id_space is not None for s in self.agents[pid].agent.detectors),
                f"{pid} registered with every detector",
            )
        self.waiters = {"A": Waiter(self.agents["A"], "B"), "B": Waiter(self.agents["B"], "A")}
        for pid in "AB":  # one after the other: B's wait is the youngest
            self.waiters[pid].thread.start()
            poll(lambda pid=pid: self.waiters[pid].handle, f"{pid} waiting")

    def agent(self, pid: str, **options: object) -> ThreadedAgent:
        agent = ThreadedAgent(pid, detector=self.addresses, hint_after=None, **options)
        agent.agent.on_part(lambda part, pid=pid: self._recorded(pid, part))
        self.agents[pid] = agent
        return agent

    def _recorded(self, pid: str, part: LocalSnapshotPart) -> None:
        if part.snapshot_id < LOCAL_ID_BASE:
            self.spaces[pid].add(id_space(part.snapshot_id))

    def snapshot_all_at_once(self) -> list[SnapshotResults]:
        """One snapshot of each detector, every cut taken before any of them completes."""
        self.agents["A"].send("C", b"hold")
        poll(self.holding.is_set, "C's handler running")
        spaces = set(range(len(self.detectors)))
        with futures.ThreadPoolExecutor(len(self.detectors)) as pool:
            taking = [pool.submit(take, running) for running in self.detectors]
            poll(lambda: self.spaces["A"] >= spaces and self.spaces["B"] >= spaces, "A and B recorded every cut")
            self.let_c_record()
            return [done.result(60) for done in taking]

    def let_c_record(self) -> None:
        self.gate.set()

    def stop(self) -> None:
        self.gate.set()
        for waiter in self.waiters.values():
            waiter.release.set()
            if waiter.thread.is_alive():
                waiter.thread.join(JOIN_TIMEOUT)
        for agent in self.agents.values():
            agent.stop()
        for running in self.detectors:
            if running.thread.is_alive():
                running.stop()


def _state(running: Running, policy: str) -> None:
    running.detector.coordinator.resolve_policy = policy


@pytest.fixture
def world_of(tmp_path: Path) -> Iterator[Callable[..., World]]:
    made: list[World] = []

    def make(policies: list[str | None], stated: list[str] | None = None) -> World:
        made.append(World(tmp_path / f"w{len(made)}", policies, stated))
        made[-1].start()
        return made[-1]

    yield make
    for world in made:
        world.stop()


# -- the agent's rule --------------------------------------------------------------------------------


def an_order(policy: str, instance: int = 7, break_id: int = 3) -> BreakWait:
    return BreakWait(break_id=break_id, snapshot_id=11, instance=instance, policy=policy)


def test_an_agent_carries_out_every_break_while_its_detectors_state_one_policy() -> None:
    agreement = PolicyAgreement()
    assert agreement.disagreement() is None and agreement.refusal(an_order("youngest")) is None
    assert agreement.stated("d0:1", "youngest") is None
    assert agreement.stated("d1:1", "youngest") is None
    assert agreement.stated("d2:1", "off") is None  # breaks nothing unasked: agrees with any policy
    assert agreement.stated("d3:1", "") is None  # older: states nothing, cannot be compared
    for policy in ("youngest", "oldest", "operator", ""):
        assert agreement.refusal(an_order(policy)) is None
    assert [agreement.policy(d) for d in ("d0:1", "d2:1", "d3:1", "d9:1")] == ["youngest", "off", "", ""]


def test_an_agent_refuses_automatic_breaks_while_its_detectors_policies_differ_and_says_so_once() -> None:
    agreement = PolicyAgreement()
    agreement.stated("d0:1", "youngest")
    told = agreement.stated("d1:1", "oldest")
    assert told is not None and "youngest at d0:1" in told and "oldest at d1:1" in told and "--resolve" in told
    assert agreement.stated("d1:1", "oldest") is None  # the same again (a reconnection): said once
    assert agreement.stated("d0:1", "youngest") is None
    for policy in ("youngest", "oldest", ""):  # "": an older detector's order, taken as automatic
        refused = agreement.refusal(an_order(policy))
        assert refused is not None
        assert (refused.break_id, refused.instance, refused.outcome) == (3, 7, BREAK_OUTCOME_POLICIES_DISAGREE)
        assert refused.detail == f"automatic break of wait 7 refused: {agreement.disagreement()}"
    assert agreement.refusal(an_order("operator")) is None  # one explicit order

    assert agreement.stated("d2:1", "oldest") is not None  # a third detector: the message names it
    assert "oldest at d2:1" in (agreement.disagreement() or "")
    agreement.stated("d0:1", "oldest")  # the first one restarted with the others' policy
    agreement.stated("d2:1", "oldest")
    assert agreement.disagreement() is None and agreement.refusal(an_order("oldest")) is None


def test_an_agent_says_once_when_its_detectors_policies_agree_again() -> None:
    agreement = PolicyAgreement()
    agreement.stated("d0:1", "youngest")
    assert agreement.stated("d1:1", "oldest") is not None
    again = agreement.stated("d1:1", "off")
    assert again is not None and "agree again" in again
    assert agreement.stated("d1:1", "off") is None
    assert agreement.refusal(an_order("youngest")) is None


def test_every_control_client_of_an_agent_shares_one_agreement() -> None:
    made: list[ControlClient] = []

    def make(address: str, on_registered: object, on_event: object) -> ControlClient:
        async def start(snapshot_id: int, lifetime: float | None) -> None:
            pass

        made.append(ControlClient("P", "", address, on_start=start, on_finish=lambda snapshot_id: None))
        return made[-1]

    links = DetectorLinks(["d0:1", "d1:1"], make)  # type: ignore[arg-type]
    assert [client.policies for client in made] == [links.policies, links.policies]
    assert [status.resolve_policy for status in links.status()] == ["", ""]
    links.policies.stated("d0:1", "youngest")
    links.policies.stated("d1:1", "oldest")
    assert [status.resolve_policy for status in links.status()] == ["youngest", "oldest"]
    assert links.disagreement == links.policies.disagreement() is not None


# -- the detector's rule ----------------------------------------------------------------------------


def deadlock_of_two(snapshot_id: int) -> tuple[GlobalSnapshot, Evaluation]:
    """a/x waits on b/y (instance 1, the oldest), b/y on a/x (instance 7, the youngest)."""

    def waits(task: str, on: tuple[str, str], instance: int, began_us: int) -> LocalState:
        target = WaitNode(process=on[0], task=on[1])
        wait = Wait(task=task, targets=[target], model=WAIT_MODEL_AND, instance=instance, began_at_us=began_us)
        return LocalState(active=True, waits=[wait])

    processes = [
        ProcessSnapshot(process_id="a", state=waits("x", ("b", "y"), 1, 1_000)),
        ProcessSnapshot(process_id="b", state=waits("y", ("a", "x"), 7, 2_000)),
    ]
    snapshot = GlobalSnapshot(snapshot_id=snapshot_id, processes=processes, expected_members=["a", "b"])
    return snapshot, evaluate(snapshot)


def named(victims: list[Victim]) -> list[tuple[str, int]]:
    return [(victim.process, victim.instance) for victim in victims]


def test_a_refused_break_names_the_same_wait_again_after_the_pause_and_an_operator_at_once() -> None:
    """Refused: nothing was broken, so the wait is not named (the next candidate would be a second
    victim once the policies agree); the policy tries again only after the pause; an operator at once."""
    resolver = Resolver(refusal_pause=60.0)
    snapshot, evaluation = deadlock_of_two(1)
    (victim,) = resolver.victims(snapshot, evaluation, 100.0, "youngest")
    assert named([victim]) == [("b", 7)]
    resolver.sent(victim, 1, 100.5)
    assert resolver.victims(snapshot, evaluation, 100.8, "youngest", operator=True) == []  # under way
    assert resolver.reported(1, 101.0, refused=True)
    assert resolver.victims(snapshot, evaluation, 102.0, "youngest") == []
    assert resolver.victims(snapshot, evaluation, 160.9, "youngest") == []
    assert named(resolver.victims(snapshot, evaluation, 100.0, "youngest", operator=True)) == [("b", 7)]
    assert named(resolver.victims(snapshot, evaluation, 161.0, "youngest")) == [("b", 7)]


def test_an_ordinary_report_still_holds_an_operator_back_and_names_its_wait() -> None:
    """Only a refusal lets an operator through at once; after a wait really broken, a snapshot begun
    before the report gets no second victim, and a later one moves on to the next candidate."""
    resolver = Resolver(refusal_pause=60.0)
    snapshot, evaluation = deadlock_of_two(1)
    (victim,) = resolver.victims(snapshot, evaluation, 100.0, "youngest")
    resolver.sent(victim, 1, 100.5)
    resolver.reported(1, 101.0)
    assert resolver.victims(snapshot, evaluation, 100.0, "youngest", operator=True) == []
    assert named(resolver.victims(snapshot, evaluation, 102.0, "youngest")) == [("a", 1)]


def test_the_detector_records_counts_archives_a_refusal_and_warns_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    now = [1_700_000_000.0]
    sent: list[BreakWait] = []
    archived: list[Resolution] = []
    metrics = DetectorMetrics()
    resolutions = Resolutions(
        send=lambda process, order: sent.append(order) is None,
        metrics=metrics,
        publish=lambda resolution: None,
        policy="youngest",
        clock=lambda: now[0],
    )
    with Store(tmp_path / "data") as store:
        resolutions.store, resolutions.archive = store, archived.append
        refusals = []
        for snapshot_id in (1, 2):
            snapshot, evaluation = deadlock_of_two(snapshot_id)
            store.begin(snapshot_id, now[0], 2)
            store.complete(snapshot, evaluation, now[0] + 0.01)
            (sending,) = resolutions.after_snapshot(snapshot, evaluation, now[0])
            order = sent[-1]
            assert order.break_id == sending.resolution_id
            assert (order.instance, order.policy) == (7, "youngest")
            why = "automatic break of wait 7 refused: the detectors break deadlocks by different policies (...)"
            report = BreakReport(
                break_id=order.break_id, instance=7, outcome=BREAK_OUTCOME_POLICIES_DISAGREE, detail=why
            )
            now[0] += 1
            with caplog.at_level(logging.WARNING, "stablewatch.detector.service.resolutions"):
                refusals.append(resolutions.reported("b", report))
            now[0] += 61  # past the pause: the same wait is named again
        assert [outcome_word(r) for r in refusals if r is not None] == ["policies_disagree"] * 2
        assert [resolution_row(r)["outcome"] for r in archived] == ["policies_disagree"] * 2
        assert "policies_disagree" in RESOLUTION_OUTCOMES and "policies_disagree" in ARCHIVED_OUTCOMES
        assert (
            metrics.registry.get_sample_value("stablewatch_deadlocks_resolved_total", {"outcome": "policies_disagree"})
            == 2
        )
        assert len([r for r in caplog.records if "refused to break" in r.getMessage()]) == 1

        (ordered,) = resolutions.resolve(2, "operator:alice")  # refused, so not held back
        assert (sent[-1].instance, sent[-1].policy, ordered.policy) == (7, "operator", "operator")
        assert resolution_from_row(resolution_row(refusals[0])).outcome == BREAK_OUTCOME_POLICIES_DISAGREE


# -- end to end -------------------------------------------------------------------------------------


def test_detectors_with_different_policies_break_no_wait_of_a_deadlock_both_prove(
    world_of: Callable[..., World],
) -> None:
    """``youngest`` would break B's wait and ``oldest`` A's: two victims of one deadlock. Both cuts
    show it before either detector breaks anything; each agent, attached to both, refuses both
    automatic breaks, and both detectors record and count the refusal, naming the two policies."""
    world = world_of(["youngest", "oldest"])
    assert all(deadlocked(results) for results in world.snapshot_all_at_once())
    young, old = (settled(running) for running in world.detectors)
    assert [(r.process_id, r.policy) for r in young] == [("B", "youngest")]
    assert [(r.process_id, r.policy) for r in old] == [("A", "oldest")]
    for resolution in young + old:
        assert outcome_word(resolution) == "policies_disagree", resolution
        assert "youngest" in resolution.detail and "oldest" in resolution.detail, resolution.detail
    assert not world.waiters["A"].broken() and not world.waiters["B"].broken()
    for running in world.detectors:
        assert running.metric("stablewatch_deadlocks_resolved_total", outcome="policies_disagree") == 1
        assert running.metric("stablewatch_deadlocks_resolved_total", outcome="broken") == 0


def test_an_operator_breaks_one_wait_of_the_deadlock_the_policies_left(world_of: Callable[..., World]) -> None:
    """After both refusals the deadlock stays: each detector's policy waits before it tries again
    (a later snapshot sends nothing), and the agents show what each detector stated. An
    operator's request to one detector is one explicit order: it breaks one wait, and the
    deadlock is over."""
    world = world_of(["youngest", "oldest"])
    world.snapshot_all_at_once()
    for running in world.detectors:
        settled(running)
    for pid in "AB":
        statuses = world.agents[pid].agent.detectors
        assert [(s.address, s.resolve_policy) for s in statuses] == [
            (world.addresses[0], "youngest"),
            (world.addresses[1], "oldest"),
        ]

    later = [take(running) for running in world.detectors]
    assert all(deadlocked(results) for results in later)
    assert [len(settled(running)) for running in world.detectors] == [1, 1]  # within the refusal pause

    old = world.detectors[1]
    (ordered,) = old.on_loop(lambda: old.detector.resolve(later[1].snapshot.snapshot_id, "operator:test"))
    assert (ordered.process_id, ordered.policy, ordered.requested_by) == ("A", "operator", "operator:test")
    (broken,) = [r for r in settled(old) if r.resolution_id == ordered.resolution_id]
    assert outcome_word(broken) == "broken", broken
    poll(lambda: world.waiters["A"].broken(), "A's wait broken")
    assert not world.waiters["B"].broken()
    assert not any(deadlocked(take(running)) for running in world.detectors)
    assert old.metric("stablewatch_deadlocks_resolved_total", outcome="broken") == 1


@pytest.mark.parametrize(
    ("policies", "victim"),
    [(["youngest", "youngest"], "B"), (["oldest", None], "A")],
    ids=["same-policy", "one-off"],
)
def test_detectors_whose_policies_agree_still_break_one_wait_of_a_deadlock_both_prove(
    world_of: Callable[..., World], policies: list[str | None], victim: str
) -> None:
    """With the same policy on both, or with one that breaks nothing unasked (``off``, which agrees
    with every policy), the race above ends as before: one wait broken, any other break of the
    same wait answered already broken (or gone)."""
    world = world_of(policies)
    assert all(deadlocked(results) for results in world.snapshot_all_at_once())
    found = [r for running in world.detectors for r in settled(running)]
    assert all(outcome_word(r) in ("broken", "already_broken", "gone") for r in found), found
    assert {(r.process_id, r.instance) for r in found} == {(victim, world.waiters[victim].instance())}
    assert [outcome_word(r) for r in found].count("broken") == 1, found
    assert [pid for pid in "AB" if world.waiters[pid].broken()] == [victim]


def test_a_detector_that_states_no_policy_is_not_compared_and_its_breaks_go_through(
    world_of: Callable[..., World],
) -> None:
    """A detector older than ``Registered.resolve_policy`` states nothing: the agents cannot compare
    it, so they hold it agreeing (as before the rule), and carry out the other's automatic break."""
    world = world_of(["youngest", "oldest"], stated=["youngest", ""])
    for pid in "AB":
        statuses = world.agents[pid].agent.detectors
        assert [s.resolve_policy for s in statuses] == ["youngest", ""]
    assert deadlocked(take(world.detectors[0]))
    (broken,) = settled(world.detectors[0])
    assert (broken.process_id, outcome_word(broken)) == ("B", "broken")
    poll(lambda: world.waiters["B"].broken(), "B's wait broken")
