"""Property tests: the real core and assembler over random topologies and random interleavings.

A small driver (not the COS 418 simulator and its tick rule) runs one SnapshotCore per process over
FIFO queues, one per directed link; hypothesis chooses the interleaving of token sends, deliveries
of the head of a queue, and snapshot starts. Every application message carries a unique id, and the
driver logs, for each snapshot and process, which ids the process had sent and received when it
recorded: enough to recompute every channel state the snapshot must contain.

In half the scenarios the driver also does what the agent's transport does (the core's *Markers
may wait*): a marker waits on its link and goes in front of the next message sent on it; one that
no message follows is never delivered. Snapshots must then still be exact, and complete once every
member was told to start.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import permutations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stablewatch.agents.core import (
    Action,
    AppMessage,
    Entry,
    RecordState,
    ReportPart,
    SendEntry,
    SnapshotCore,
    SnapshotFailed,
)
from stablewatch.detector.assembly import Assembler, Completed
from stablewatch.v1 import GlobalSnapshot, LocalState

TOKENS = "tokens"
Link = tuple[str, str]

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
    count = draw(st.integers(2, 6))
    processes = tuple(f"p{i}" for i in range(count))
    order = draw(st.permutations(processes))
    strong = draw(st.booleans())
    base: set[Link] = set()
    if strong:  # a ring through every process
        base = {(order[i], order[(i + 1) % count]) for i in range(count)}
    else:  # a spanning tree with random directions
        for i in range(1, count):
            parent, child = order[draw(st.integers(0, i - 1))], order[i]
            base.add((parent, child) if draw(st.booleans()) else (child, parent))
    pairs = list(permutations(processes, 2))
    kinds = draw(st.lists(st.sampled_from("-dl-"), min_size=len(pairs), max_size=len(pairs)))
    declared = base | {pair for pair, kind in zip(pairs, kinds, strict=True) if kind == "d"}
    late = {pair for pair, kind in zip(pairs, kinds, strict=True) if kind == "l"} - declared
    balances = draw(st.lists(st.integers(0, 20), min_size=count, max_size=count))
    step = st.tuples(st.sampled_from(KINDS), st.integers(0, 1 << 16), st.integers(0, 1 << 16))
    length = draw(st.integers(0, max_steps))  # lists alone stay too short to interleave much
    steps = draw(st.lists(step, min_size=length, max_size=length))
    hold = draw(st.booleans())
    return Scenario(processes, tuple(balances), frozenset(declared), frozenset(late), strong, tuple(steps), hold)


@dataclass(frozen=True, slots=True)
class Recorded:
    """What one process had done when it recorded one snapshot."""

    balance: int
    sent: frozenset[bytes]  # ids of the messages it had sent
    received: frozenset[bytes]  # ids of the messages it had received


@dataclass
class Run:
    """One run of a scenario: the cores, the network, the detector and the instrumentation."""

    scenario: Scenario
    max_recorded_bytes: int | None = None
    cores: dict[str, SnapshotCore] = field(init=False)
    balances: dict[str, int] = field(init=False)
    queues: dict[Link, deque[Entry]] = field(init=False)
    held: dict[Link, list[Entry]] = field(init=False)  # markers waiting for the next message
    opened: set[Link] = field(init=False)
    sent_log: dict[Link, list[bytes]] = field(init=False)  # message ids per link, in send order
    link_of: dict[bytes, Link] = field(init=False, default_factory=dict)
    sent_ids: dict[str, set[bytes]] = field(init=False)
    received_ids: dict[str, set[bytes]] = field(init=False)
    records: dict[int, dict[str, Recorded]] = field(init=False, default_factory=dict)
    links_at_finish: dict[int, frozenset[Link]] = field(init=False, default_factory=dict)
    started: list[int] = field(init=False, default_factory=list)
    completed: dict[int, GlobalSnapshot] = field(init=False, default_factory=dict)
    aborted: dict[int, str] = field(init=False, default_factory=dict)
    failures: list[SnapshotFailed] = field(init=False, default_factory=list)
    assembler: Assembler = field(init=False, default_factory=Assembler)
    total: int = field(init=False)  # tokens in the system
    links: list[Link] = field(init=False)  # every channel that exists or will open, sorted

    def __post_init__(self) -> None:
        scenario = self.scenario
        # Scenarios start any number of snapshots at once: the bound on concurrent recordings (its
        # refusals are tested in test_agent_recordings.py) is lifted so every start is explored.
        options: dict[str, int] = {"max_recordings": 10_000}
        if self.max_recorded_bytes is not None:
            options["max_recorded_bytes"] = self.max_recorded_bytes
        self.cores = {
            process: SnapshotCore(process, [d for s, d in sorted(scenario.declared) if s == process], **options)
            for process in scenario.processes
        }
        self.balances = dict(zip(scenario.processes, scenario.balances, strict=True))
        self.links = sorted(scenario.declared | scenario.late)
        self.queues = {link: deque() for link in self.links}
        self.held = {link: [] for link in self.links}
        self.opened = set(scenario.declared)
        self.sent_log = {link: [] for link in self.links}
        self.sent_ids = {process: set() for process in scenario.processes}
        self.received_ids = {process: set() for process in scenario.processes}
        self.total = sum(scenario.balances)

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

    def send(self, link: Link, seed: int) -> None:
        """Send a token message with a fresh id on ``link``; the sender is debited now."""
        src, dst = link
        if link not in self.opened:
            self.opened.add(link)
            self.apply(src, self.cores[src].open_outbound(dst))
        tokens = seed % (self.balances[src] + 1)
        self.balances[src] -= tokens
        message_id = b"m%d" % len(self.link_of)
        self.link_of[message_id] = link
        self.sent_log[link].append(message_id)
        self.sent_ids[src].add(message_id)
        message = AppMessage(message_id, {TOKENS: tokens})
        self.cores[src].send(dst)
        self.queues[link].extend(self.held[link])  # held markers go first
        self.held[link].clear()
        self.queues[link].append(message)

    def deliver(self, link: Link) -> None:
        """Deliver the head of ``link``'s queue; a message credits the receiver."""
        src, dst = link
        entry = self.queues[link].popleft()
        self.apply(dst, self.cores[dst].receive(src, entry))
        if isinstance(entry, AppMessage):
            self.received_ids[dst].add(entry.payload)
            self.balances[dst] += (entry.counters or {})[TOKENS]

    def start(self, process: str, seed: int) -> None:
        """A new snapshot at ``process`` or at everyone, or another initiator of a running one."""
        running = self.assembler.running
        if seed % 4 == 1 and running:
            self.apply(process, self.cores[process].start_snapshot(running[seed // 4 % len(running)]))
            return
        snapshot_id = len(self.started) + 1
        self.started.append(snapshot_id)
        self.assembler.begin(snapshot_id, self.scenario.processes)
        initiators = self.scenario.processes if seed % 4 == 0 else (process,)
        for initiator in initiators:
            if snapshot_id in self.assembler.running:
                self.apply(initiator, self.cores[initiator].start_snapshot(snapshot_id))

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
        for snapshot_id in self.assembler.running:
            for process in self.scenario.processes:
                if snapshot_id in self.assembler.running:
                    self.apply(process, self.cores[process].start_snapshot(snapshot_id))
        self.drain()

    # -- the agent and the detector ------------------------------------------------------------

    def apply(self, process: str, actions: Sequence[Action]) -> None:
        """Carry out ``process``'s actions in order, the recorded part before the markers."""
        pending = deque(actions)
        while pending:
            action = pending.popleft()
            if isinstance(action, RecordState):
                state = self.capture(process, action.snapshot_id)
                pending.extendleft(reversed(self.cores[process].record_state(action.snapshot_id, state)))
            elif isinstance(action, SendEntry):
                link = (process, action.dst)
                if self.scenario.hold_markers:
                    self.held[link].append(action.entry)
                else:
                    self.queues[link].append(action.entry)
            elif isinstance(action, ReportPart):
                outcome = self.assembler.add_part(action.part, sender=process)
                if isinstance(outcome, Completed):
                    self.completed[outcome.snapshot.snapshot_id] = outcome.snapshot
                    self.finish(outcome.snapshot.snapshot_id)
            else:
                self.failures.append(action)
                aborted = self.assembler.fail(action.snapshot_id, process, action.reason)
                assert aborted is not None, f"{action} for a snapshot that is not running"
                self.aborted[action.snapshot_id] = aborted.reason
                self.finish(action.snapshot_id)

    def capture(self, process: str, snapshot_id: int) -> LocalState:
        """The application's state, and the log of what it had sent and received."""
        recorded = self.records.setdefault(snapshot_id, {})
        assert process not in recorded, f"{process} recorded snapshot {snapshot_id} twice"
        recorded[process] = Recorded(
            self.balances[process], frozenset(self.sent_ids[process]), frozenset(self.received_ids[process])
        )
        return LocalState(counters={TOKENS: self.balances[process]})

    def finish(self, snapshot_id: int) -> None:
        """The detector is done with ``snapshot_id``: every core forgets it."""
        self.links_at_finish[snapshot_id] = frozenset(self.opened)
        for core in self.cores.values():
            core.finish_snapshot(snapshot_id)


def check_consistent(run: Run, snapshot: GlobalSnapshot) -> None:
    """``snapshot`` is exactly the cut the driver's log says the processes recorded."""
    snapshot_id = snapshot.snapshot_id
    records = run.records[snapshot_id]
    processes = list(run.scenario.processes)
    assert [process.process_id for process in snapshot.processes] == processes
    assert sorted(records) == processes
    for process in snapshot.processes:
        assert process.state.counters[TOKENS] == records[process.process_id].balance

    # No message is received before its receiver recorded but sent after its sender recorded.
    for receiver, record in records.items():
        for message_id in record.received:
            sender = run.link_of[message_id][0]
            assert message_id in records[sender].sent, (
                f"snapshot {snapshot_id}: {receiver} received {message_id!r} before recording, "
                f"but {sender} sent it after recording"
            )

    channels = {(channel.src, channel.dst): channel for channel in snapshot.channels}
    assert set(channels) == run.links_at_finish[snapshot_id]
    in_flight = 0
    for link, log in run.sent_log.items():
        src, dst = link
        sent_before = [message_id for message_id in log if message_id in records[src].sent]
        received_before = [message_id for message_id in log if message_id in records[dst].received]
        expected = [message_id for message_id in sent_before if message_id not in records[dst].received]
        channel = channels.get(link)
        if channel is None:  # opened after the snapshot completed
            assert sent_before == [], f"snapshot {snapshot_id} lost channel {src}->{dst}"
            continue
        n, m, recorded = channel.sent_before_marker, channel.received_before_recording, channel.messages
        assert m + len(recorded) == n, f"snapshot {snapshot_id} channel {src}->{dst}: {m} + {len(recorded)}"
        assert (n, m) == (len(sent_before), len(received_before))
        assert [message.payload for message in recorded] == expected  # FIFO order
        indices = [message.receive_index for message in recorded]
        assert indices == sorted(indices)
        in_flight += sum(message.counters[TOKENS] for message in recorded)

    held = sum(process.state.counters[TOKENS] for process in snapshot.processes)
    assert held + in_flight == run.total, f"snapshot {snapshot_id}: {held} + {in_flight} != {run.total}"


PROPERTY_SETTINGS = settings(
    derandomize=True,
    deadline=None,
    max_examples=300,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


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
