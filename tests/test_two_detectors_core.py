"""Property tests: two detectors snapshotting the same processes at once, through the real cores.

Two detectors side by side (id spaces 0 and 1) start their own snapshots of the same processes,
with ids of their own spaces that interleave by time. The cores key everything by the whole id,
so each detector must get exactly the cuts it would get alone.

*Channel mode* (:class:`SnapshotCore`): a driver plays one script three times, with both
detectors, with only the first and with only the second, and checks that each detector's
completed global snapshots are the same, proto for proto, in the run with both as in its run
alone, and that each is the exact cut the driver's log says it is (``check_consistent`` of
``channel_world.py``: every channel's proof m + len(recorded) == n, its exact contents in FIFO
order, no message received before it was sent, tokens conserved). For that the other detector's
markers must be invisible to the schedule of everything else, so the driver never delivers an
entry by its place in a queue alone: a *deliver* step delivers the markers at the head of a link
and then its next application message, a *flush* step only the markers at the head. Application
messages are then delivered in the same order in every run, and so are each detector's markers
relative to them (markers between two messages may only change order among themselves, which
records nothing different). Channels open during snapshots (``open_outbound``), markers may wait
for the next message on their link, and a detector may start again on a fresh store (a new epoch
of its id space at every process, its running snapshots abandoned).

*RPC mode* (:class:`ColorCore`): the simulator of ``rpc_world.py`` (calls overtaking each
other, ambiguous call ends, resets, stale messages, expiry) with two detectors, each with its own
ordered control stream to every process, so one detector's start can reach a process long after
the other's. Every completed cut of either detector is checked by that module's oracle; every
snapshot ends (completes or fails) once the processes drop what passed its deadline; and without
call failures or expiry every snapshot completes, also when a process serves it from a jump the
other detector's id made.
"""

from __future__ import annotations

import math
import random
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import permutations
from typing import Any

from channel_world import PROPERTY_SETTINGS, TOKENS, Link, TokenNetwork, check_consistent, networks
from hypothesis import given
from hypothesis import strategies as st
from rpc_world import (
    CALL,
    CONTROL,
    DELIVER,
    EXPIRE,
    FAIL,
    LATE,
    LIFETIMES,
    RESPOND,
    START,
    Scenario,
    Stream,
    Tally,
    World,
    play_checked,
)

from stablewatch.agents.core import AppMessage, Marker, SnapshotFailed
from stablewatch.detector.assembly import Assembler, Completed
from stablewatch.v1 import GlobalSnapshot, LocalSnapshotPart, LocalState
from stablewatch.v1.ids import id_space, next_id

#: The two detectors' id spaces (replica numbers), by detector index.
SPACES = (0, 1)
BOTH = frozenset({0, 1})
# A step's time in microseconds: ids of the two detectors interleave, in either order (skews).
STEP_US = 1000
MAX_SKEW_US = 3000


def detector_of(snapshot_id: int) -> int:
    """The detector (index into :data:`SPACES`) whose id space holds ``snapshot_id``."""
    return SPACES.index(id_space(snapshot_id))


# -- channel mode ---------------------------------------------------------------------------------

SEND, TAKE, FLUSH, OPEN, BEGIN, EPOCH = "send", "take", "flush", "open", "begin", "epoch"
# Deliveries are the most frequent step, so that queues do not only grow; a restart is rare.
CHANNEL_KINDS = (TAKE, SEND, TAKE, BEGIN, SEND, FLUSH, TAKE, OPEN, BEGIN, SEND, TAKE, FLUSH) * 2 + (EPOCH,)


@dataclass(frozen=True)
class ChannelScenario:
    """A topology, initial balances, the detectors' clock skews and a script of steps."""

    processes: tuple[str, ...]
    balances: tuple[int, ...]
    declared: frozenset[Link]  # channels every core knows from the start
    late: frozenset[Link]  # channels opened (open_outbound) by an open step or before their first send
    skews: tuple[int, int]  # microseconds each detector's clock is ahead
    steps: tuple[tuple[str, int, int], ...]
    hold_markers: bool  # markers wait for the next message on their link


@st.composite
def channel_scenarios(draw: st.DrawFn, max_steps: int = 100) -> ChannelScenario:
    """2..5 processes over a strongly or weakly connected topology, with a random script."""
    network = draw(networks(5, "-dll"))
    skews = (draw(st.integers(0, MAX_SKEW_US)), draw(st.integers(0, MAX_SKEW_US)))
    step = st.tuples(st.sampled_from(CHANNEL_KINDS), st.integers(0, 1 << 16), st.integers(0, 1 << 16))
    length = draw(st.integers(0, max_steps))  # lists alone stay too short to interleave much
    steps = draw(st.lists(step, min_size=length, max_size=length))
    topology = (network.processes, network.balances, network.declared, network.late)
    return ChannelScenario(*topology, skews, tuple(steps), draw(st.booleans()))


def random_channel_scenario(rng: random.Random, steps: int = 160) -> ChannelScenario:
    """A longer scenario drawn from ``rng``, for the check that the properties are not vacuous."""
    count = rng.randint(3, 5)
    processes = tuple(f"p{i}" for i in range(count))
    ring = {(processes[i], processes[(i + 1) % count]) for i in range(count)}
    others = [pair for pair in permutations(processes, 2) if pair not in ring]
    late = frozenset(pair for pair in others if rng.random() < 0.4)
    declared = frozenset(ring | {pair for pair in others if pair not in late and rng.random() < 0.3})
    kinds = [kind for kind in CHANNEL_KINDS if kind != EPOCH]
    script = tuple(
        (EPOCH if rng.random() < 0.01 else rng.choice(kinds), rng.randrange(1 << 16), rng.randrange(1 << 16))
        for _ in range(steps)
    )
    balances = tuple(rng.randint(5, 20) for _ in processes)
    skews = (rng.randrange(MAX_SKEW_US), rng.randrange(MAX_SKEW_US))
    return ChannelScenario(processes, balances, declared, late, skews, script, rng.random() < 0.3)


class ChannelRun(TokenNetwork):
    """One run of a scenario with the detectors in ``active``: the network (channel_world's) and
    the detectors, one assembler and one store's last id each."""

    scenario: ChannelScenario

    def __init__(self, scenario: ChannelScenario, active: frozenset[int]) -> None:
        super().__init__(scenario)  # any number of snapshots at once: none refused for the other's load
        self.active = active  # the detectors that take snapshots in this run
        self.assemblers = (Assembler(), Assembler())  # one per detector
        self.last_ids = [0, 0]  # per detector: its store's last id
        self.started: tuple[list[int], list[int]] = ([], [])
        self.completed: tuple[dict[int, GlobalSnapshot], dict[int, GlobalSnapshot]] = ({}, {})
        self.abandoned: set[int] = set()  # running when their detector restarted
        # Begun before their detector restarted: their late markers record again, for nobody.
        self.old_epoch: set[int] = set()
        self.step = 0
        self.overlaps = 0  # starts while the other detector had one running

    # -- the script ----------------------------------------------------------------------------

    def play(self) -> None:
        for step, (kind, x, y) in enumerate(self.scenario.steps):
            self.step = step
            link = self.links[x % len(self.links)]
            if kind == SEND:
                self.send(link, y)
            elif kind == TAKE:
                self.take(link)
            elif kind == FLUSH:
                self.flush(link)
            elif kind == OPEN:
                self.open(link)
            elif kind == BEGIN:
                self.begin(y % 2, self.scenario.processes[x % len(self.scenario.processes)], y // 2)
            else:
                self.restart(y % 2)

    def flush(self, link: Link) -> None:
        """Deliver the markers at the head of ``link``, whichever detector's, up to its next message."""
        queue = self.queues[link]
        while queue and isinstance(queue[0], Marker):
            self.deliver(link)

    def take(self, link: Link) -> None:
        """Deliver the next application message of ``link``, and the markers ahead of it first."""
        self.flush(link)
        if self.queues[link]:
            self.deliver(link)

    def begin(self, detector: int, process: str, seed: int) -> None:
        """A new snapshot of ``detector`` at ``process`` or at everyone, or another initiator of a
        running one; nothing when ``detector`` takes no part in this run."""
        if detector not in self.active:
            return

        def new_id() -> int:
            self.overlaps += bool(self.assemblers[1 - detector].running)
            now_us = self.step * STEP_US + self.scenario.skews[detector]
            snapshot_id = self.last_ids[detector] = next_id(self.last_ids[detector], now_us, SPACES[detector])
            self.started[detector].append(snapshot_id)
            return snapshot_id

        self.start_or_join(self.assemblers[detector], process, seed, new_id)

    def restart(self, detector: int) -> None:
        """``detector`` starts again on a fresh store: its running snapshots are lost to it, and
        every agent, registered again, forgets that detector's snapshots (a new epoch of its space).

        A restart takes far longer than a marker's trip: the old snapshots' markers still in flight
        arrived before it and recorded for nobody, so they leave the links here (the other
        detector's markers and every message stay where they are).
        """
        if detector not in self.active:
            return
        assembler = self.assemblers[detector]
        for snapshot_id in assembler.running:
            assembler.abort(snapshot_id, "detector restarted")
            self.abandoned.add(snapshot_id)
        self.old_epoch.update(self.started[detector])

        def current(entry: AppMessage | Marker) -> bool:
            return not isinstance(entry, Marker) or entry.snapshot_id not in self.old_epoch

        for link in self.links:
            self.queues[link] = deque(filter(current, self.queues[link]))
            self.held[link] = list(filter(current, self.held[link]))  # type: ignore[arg-type]
        for core in self.cores.values():
            core.new_epoch(SPACES[detector])

    def drain(self) -> None:
        """Deliver everything in flight, in an order that the other detector's markers cannot change:
        every marker at a head first, then the next application message of the first link with one."""
        while True:
            while heads := [
                link for link in self.links if self.queues[link] and isinstance(self.queues[link][0], Marker)
            ]:
                for link in heads:
                    self.flush(link)
            busy = [link for link in self.links if self.queues[link]]
            if not busy:
                return
            self.deliver(busy[0])

    def settle(self) -> None:
        """Drain; then, as each detector does at a deadline, tell every member of what still runs."""
        self.drain()
        for detector in sorted(self.active):
            self.remind(self.assemblers[detector])
        self.drain()

    # -- the detectors -------------------------------------------------------------------------

    def capture(self, process: str, snapshot_id: int) -> LocalState:
        if snapshot_id in self.old_epoch:  # a late marker of an abandoned snapshot: recorded for nobody
            return LocalState(counters={TOKENS: self.balances[process]})
        return super().capture(process, snapshot_id)

    def report(self, process: str, part: LocalSnapshotPart) -> None:
        if part.snapshot_id in self.old_epoch:
            return  # a part of an abandoned snapshot that came before the restart
        detector = detector_of(part.snapshot_id)
        outcome = self.assemblers[detector].add_part(part, sender=process)
        if isinstance(outcome, Completed):
            self.completed[detector][part.snapshot_id] = outcome.snapshot
            self.finish(part.snapshot_id)

    def failed(self, process: str, failure: SnapshotFailed) -> None:
        """Nothing more: no failure is expected (play_channels checks ``failures``)."""


def play_channels(scenario: ChannelScenario, active: frozenset[int]) -> ChannelRun:
    """Play ``scenario`` to the end with the detectors in ``active``; every snapshot must complete."""
    run = ChannelRun(scenario, active)
    run.play()
    run.settle()
    assert run.failures == []
    for detector in active:
        assert run.assemblers[detector].running == []
        kept = [k for k in run.started[detector] if k not in run.abandoned]
        assert sorted(run.completed[detector]) == kept
        assert all(id_space(k) == SPACES[detector] for k in run.started[detector])
    return run


def check_channel_scenario(scenario: ChannelScenario) -> ChannelRun:
    """Both detectors' cuts are exact, and each is the cut that detector records alone."""
    both = play_channels(scenario, BOTH)
    for detector in (0, 1):
        for snapshot in both.completed[detector].values():
            check_consistent(both, snapshot)
        alone = play_channels(scenario, frozenset({detector}))
        assert alone.started[detector] == both.started[detector]
        assert alone.completed[detector] == both.completed[detector], f"detector {detector}'s cuts differ"
    return both


@PROPERTY_SETTINGS
@given(channel_scenarios())
def test_each_detector_records_exactly_the_cuts_it_records_alone(scenario: ChannelScenario) -> None:
    check_channel_scenario(scenario)


def test_the_channel_scenarios_overlap_snapshots_with_messages_in_flight_and_new_channels() -> None:
    """The property above is not vacuous: both detectors' snapshots run at once, with messages in
    flight on channels opened during them, ids cross in either order, and restarts happen."""
    rng = random.Random(26)
    seen: Counter[str] = Counter()
    for _ in range(25):
        run = check_channel_scenario(random_channel_scenario(rng))
        seen["overlaps"] += run.overlaps
        seen["restarts"] += bool(run.old_epoch)
        for detector in (0, 1):
            seen["completed"] += len(run.completed[detector])
            for snapshot in run.completed[detector].values():
                late = [c for c in snapshot.channels if (c.src, c.dst) in run.scenario.late]
                seen["in flight"] += any(c.messages for c in snapshot.channels)
                seen["in flight on a new channel"] += any(c.messages for c in late)
        firsts = [run.started[0][0] if run.started[0] else None, run.started[1][0] if run.started[1] else None]
        if None not in firsts:
            seen["first is detector 1"] += firsts[1] < firsts[0]  # type: ignore[operator]
    assert seen["completed"] >= 300 and seen["overlaps"] >= 300, seen
    assert seen["in flight"] >= 300 and seen["in flight on a new channel"] >= 150, seen
    assert seen["restarts"] >= 10 and seen["first is detector 1"] >= 5, seen


# -- RPC mode -------------------------------------------------------------------------------------

RESTART = "restart"
RPC_KINDS = (DELIVER, CALL, CONTROL, DELIVER, RESPOND, CONTROL, START, DELIVER, CALL, CONTROL, FAIL, RESPOND, EXPIRE)
RPC_KINDS = RPC_KINDS * 4 + (LATE,) * 4 + (RESTART,)  # a restart about once in 60 steps
CALM_KINDS = tuple(kind for kind in RPC_KINDS if kind not in (FAIL, EXPIRE))


@dataclass(frozen=True)
class RpcScenario(Scenario):
    """What ``rpc_world.World`` plays, and the detectors' clock skews."""

    skews: tuple[int, int]


@st.composite
def rpc_scenarios(draw: st.DrawFn, kinds: Sequence[str] = RPC_KINDS, max_steps: int = 160) -> RpcScenario:
    count = draw(st.integers(2, 4))
    units = draw(st.lists(st.integers(0, 9), min_size=count, max_size=count))
    default_lifetime = draw(st.sampled_from([40.0, 400.0]))
    skews = (draw(st.integers(0, MAX_SKEW_US)), draw(st.integers(0, MAX_SKEW_US)))
    step = st.tuples(st.sampled_from(kinds), st.integers(0, 1 << 12), st.integers(0, 1 << 12))
    length = draw(st.integers(0, max_steps))
    steps = draw(st.lists(step, min_size=length, max_size=length))
    return RpcScenario(count, tuple(units), default_lifetime, tuple(steps), skews)


class TwoDetectorWorld(World):
    """``rpc_world``'s world with two detectors: each has its own ordered control stream to every
    process, allocates ids of its own space from a clock of its own, and may start again (a new
    epoch: its stream to every process is replaced, and the first thing on the new one is the epoch)."""

    scenario: RpcScenario

    def __init__(self, scenario: RpcScenario, max_recordings: int) -> None:
        super().__init__(scenario, detectors=2, max_recordings=max_recordings)
        self.last_ids = [0, 0]
        self.shared = 0  # starts served from a jump whose top is the other detector's id
        self.restarts = 0

    def steps(self) -> dict[str, Callable[[int, int], None]]:
        return {**super().steps(), RESTART: self.restart}

    def expire_all(self) -> None:
        """Every process drops what is left, as its deadlines pass."""
        for name in self.names:
            self.apply(name, self.cores[name].expire(math.inf))

    # -- the detectors -------------------------------------------------------------------------

    def start(self, x: int, y: int) -> None:
        detector = x % 2
        now_us = self.clock * STEP_US + self.scenario.skews[detector]
        snapshot_id = self.last_ids[detector] = next_id(self.last_ids[detector], now_us, SPACES[detector])
        self.snapshots[snapshot_id] = Tally(self.resets)
        for name in self.names:
            self.control[detector, name].append(("start", snapshot_id, LIFETIMES[y % len(LIFETIMES)]))

    def restart(self, x: int, _y: int) -> None:
        detector = x % 2
        self.restarts += 1
        for snapshot_id, tally in self.snapshots.items():
            if detector_of(snapshot_id) == detector and tally.outcome is None:
                tally.outcome = "abandoned"  # the new detector never heard of it
        for name in self.names:  # the old stream is gone with what it still held
            self.control[detector, name] = deque([("epoch",)])

    def stream_of(self, snapshot_id: int) -> int:
        return detector_of(snapshot_id)

    def carry_out(self, stream: Stream, event: str, *fields: Any) -> None:
        detector, name = stream
        core = self.cores[name]
        if event == "epoch":
            core.new_epoch(SPACES[detector])
            return
        if event == "start":
            snapshot_id = fields[0]
            covering = [hi for lo, hi in core.recorded_ranges if lo < snapshot_id <= hi]
            self.shared += bool(covering) and id_space(covering[0]) != id_space(snapshot_id)
        super().carry_out(stream, event, *fields)


def play_rpc(scenario: RpcScenario, max_recordings: int = 16) -> TwoDetectorWorld:
    """Play ``scenario`` until nothing is pending, and check every completed cut with the oracle."""
    return play_checked(TwoDetectorWorld(scenario, max_recordings))


@PROPERTY_SETTINGS
@given(rpc_scenarios())
def test_rpc_cuts_of_both_detectors_are_exact_and_every_snapshot_ends(scenario: RpcScenario) -> None:
    world = play_rpc(scenario)
    world.expire_all()
    world.settle()
    unended = [k for k, tally in world.snapshots.items() if tally.outcome is None]
    assert unended == [], f"snapshots that neither completed nor failed: {unended}"


@PROPERTY_SETTINGS
@given(rpc_scenarios(CALM_KINDS))
def test_rpc_snapshots_of_both_detectors_complete_without_failures_or_expiry(scenario: RpcScenario) -> None:
    """No call fails and nothing expires: every snapshot completes, however late one detector's
    start reaches a process after the other's."""
    world = play_rpc(scenario, max_recordings=10_000)
    outcomes = {k: tally.outcome for k, tally in world.snapshots.items() if tally.outcome != "abandoned"}
    assert set(outcomes.values()) <= {"completed"}, outcomes


def test_the_rpc_scenarios_share_jumps_between_detectors() -> None:
    """The properties above are not vacuous: cuts of both detectors complete, with messages in
    flight, served from jumps the other detector's ids made, across restarts."""
    rng = random.Random(26)
    seen: Counter[str] = Counter()
    for _ in range(20):
        kinds = [kind for kind in CALM_KINDS if kind != RESTART]
        steps = tuple(
            (RESTART if rng.random() < 0.005 else rng.choice(kinds), rng.randrange(1 << 12), rng.randrange(1 << 12))
            for _ in range(rng.randint(150, 300))
        )
        count = rng.randint(2, 4)
        units = tuple(rng.randint(0, 9) for _ in range(count))
        skews = (rng.randrange(MAX_SKEW_US), rng.randrange(MAX_SKEW_US))
        scenario = RpcScenario(count, units, 400.0, steps, skews)
        world = play_rpc(scenario, max_recordings=10_000)
        seen["shared"] += world.shared
        seen["restarts"] += world.restarts
        for snapshot_id, tally in world.snapshots.items():
            seen[f"{tally.outcome} by {detector_of(snapshot_id)}"] += 1
            if tally.outcome == "completed":
                seen["in flight"] += any(channel.messages for channel in tally.channels.values())
    assert seen["completed by 0"] >= 100 and seen["completed by 1"] >= 100, seen
    assert seen["failed by 0"] == seen["failed by 1"] == 0, seen
    assert seen["shared"] >= 100 and seen["in flight"] >= 150 and seen["restarts"] >= 8, seen
