"""Property tests: the real core and assembler over random topologies and random interleavings.

A small driver (not the COS 418 simulator and its tick rule; the network is channel_world.py's)
runs one SnapshotCore per process over FIFO queues, one per directed link; hypothesis chooses the
interleaving of token sends, deliveries of the head of a queue, and snapshot starts. Every
application message carries a unique id, and the driver logs, for each snapshot and process, which
ids the process had sent and received when it recorded: enough to recompute every channel state
the snapshot must contain.

In half the scenarios the driver also does what the agent's transport does (the core's *Markers
may wait*): a marker waits on its link and goes in front of the next message sent on it; one that
no message follows is never delivered. Snapshots must then still be exact, and complete once every
member was told to start.
"""

from __future__ import annotations

from dataclasses import dataclass

from channel_world import PROPERTY_SETTINGS, Link, TokenNetwork, check_consistent, networks
from hypothesis import given, settings
from hypothesis import strategies as st

from stablewatch.agents.core import SnapshotFailed
from stablewatch.detector.assembly import Assembler, Completed
from stablewatch.v1 import GlobalSnapshot, LocalSnapshotPart

SEND, DELIVER, START = "send", "deliver", "start"
# Deliveries are the most frequent step, so that queues do not only grow.
KINDS = (DELIVER, SEND, DELIVER, START, SEND, DELIVER)


@dataclass(frozen=True)
class Scenario:
    """A topology, initial balances and a script of steps for the driver."""

    processes: tuple[str, ...]
    balances: tuple[int, ...]
    declared: frozenset[Link]  # channels every core knows from the start
    late: frozenset[Link]  # channels opened (open_outbound) just before their first send
    strong: bool  # the declared channels alone make the topology strongly connected
    steps: tuple[tuple[str, int, int], ...]
    hold_markers: bool = False  # markers wait for the next message on their link


@st.composite
def scenarios(draw: st.DrawFn, max_steps: int = 120) -> Scenario:
    """2..6 processes over a strongly or weakly connected topology, with a random script."""
    network = draw(networks(6, "-dl-"))
    step = st.tuples(st.sampled_from(KINDS), st.integers(0, 1 << 16), st.integers(0, 1 << 16))
    length = draw(st.integers(0, max_steps))  # lists alone stay too short to interleave much
    steps = draw(st.lists(step, min_size=length, max_size=length))
    hold = draw(st.booleans())
    topology = (network.processes, network.balances, network.declared, network.late, network.strong)
    return Scenario(*topology, tuple(steps), hold)


class Run(TokenNetwork):
    """One run of a scenario: the network (channel_world.TokenNetwork) and one detector."""

    scenario: Scenario

    def __init__(self, scenario: Scenario, max_recorded_bytes: int | None = None) -> None:
        options = {} if max_recorded_bytes is None else {"max_recorded_bytes": max_recorded_bytes}
        super().__init__(scenario, **options)
        self.assembler = Assembler()
        self.started: list[int] = []
        self.completed: dict[int, GlobalSnapshot] = {}
        self.aborted: dict[int, str] = {}

    # -- the script ----------------------------------------------------------------------------

    def play(self) -> None:
        """Carry out every step of the scenario."""
        for kind, x, y in self.scenario.steps:
            if kind == SEND:
                self.send(self.links[x % len(self.links)], y)
            elif kind == DELIVER:
                busy = [link for link in self.links if self.queues[link]]
                if busy:
                    self.deliver(busy[x % len(busy)])
            else:
                self.start(self.scenario.processes[x % len(self.scenario.processes)], y)

    def start(self, process: str, seed: int) -> None:
        """A new snapshot at ``process`` or at everyone, or another initiator of a running one."""

        def new_id() -> int:
            self.started.append(len(self.started) + 1)
            return self.started[-1]

        self.start_or_join(self.assembler, process, seed, new_id)

    def drain(self) -> None:
        """Deliver everything in flight, taking the links in turn."""
        while True:
            busy = [link for link in self.links if self.queues[link]]
            if not busy:
                return
            for link in busy:
                self.deliver(link)

    def settle(self) -> None:
        """Drain; then, as the detector does at a deadline, tell every member of what still runs."""
        self.drain()
        self.remind(self.assembler)
        self.drain()

    # -- the detector --------------------------------------------------------------------------

    def report(self, process: str, part: LocalSnapshotPart) -> None:
        outcome = self.assembler.add_part(part, sender=process)
        if isinstance(outcome, Completed):
            self.completed[outcome.snapshot.snapshot_id] = outcome.snapshot
            self.finish(outcome.snapshot.snapshot_id)

    def failed(self, process: str, failure: SnapshotFailed) -> None:
        aborted = self.assembler.fail(failure.snapshot_id, process, failure.reason)
        assert aborted is not None, f"{failure} for a snapshot that is not running"
        self.aborted[failure.snapshot_id] = aborted.reason
        self.finish(failure.snapshot_id)


@PROPERTY_SETTINGS
@given(scenarios())
def test_every_completed_snapshot_is_a_consistent_cut(scenario: Scenario) -> None:
    run = Run(scenario)
    run.play()
    run.settle()
    assert run.failures == []
    for snapshot in run.completed.values():
        check_consistent(run, snapshot)


@PROPERTY_SETTINGS
@given(scenarios())
def test_every_started_snapshot_completes_once_queues_are_drained(scenario: Scenario) -> None:
    run = Run(scenario)
    run.play()
    run.drain()
    if scenario.strong and not scenario.hold_markers:  # markers reach everyone on their own
        assert run.assembler.running == [], [run.assembler.missing(k) for k in run.assembler.running]
    run.settle()  # a weakly connected topology may need the detector to tell everyone
    assert run.assembler.running == []
    assert sorted(run.completed) == run.started
    assert run.aborted == {}


@settings(PROPERTY_SETTINGS, max_examples=200)
@given(scenarios(), st.integers(1, 60))
def test_bounded_recording_completes_consistently_or_fails(scenario: Scenario, bound: int) -> None:
    run = Run(scenario, max_recorded_bytes=bound)
    run.play()
    run.settle()
    assert run.assembler.running == []
    assert sorted([*run.completed, *run.aborted]) == run.started  # each exactly once
    for failure in run.failures:
        assert "recorded bytes exceeded the bound" in failure.reason
        assert failure.snapshot_id in run.aborted
    for snapshot in run.completed.values():
        check_consistent(run, snapshot)
