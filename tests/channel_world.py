"""Channel mode's property-test driver: real SnapshotCores passing tokens over FIFO links, and the
check that a completed snapshot is exactly the cut the driver's log says the processes recorded.

:class:`TokenNetwork` runs one core per process over one queue per directed link. Every
application message carries a unique id, and the network logs, for each snapshot and process,
which ids the process had sent and received when it recorded: enough for :func:`check_consistent`
to recompute every channel state the snapshot must contain. What a part or a failure means is the
driver's own (one detector in test_properties.py, two side by side in
test_two_detectors_core.py): it overrides :meth:`TokenNetwork.report` and
:meth:`TokenNetwork.failed`.

When the scenario holds markers (the core's *Markers may wait*), the network does what the agent's
transport does: a marker waits on its link and goes in front of the next message sent on it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import permutations
from typing import Protocol

from hypothesis import HealthCheck, settings
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
from stablewatch.detector.assembly import Assembler
from stablewatch.v1 import GlobalSnapshot, LocalSnapshotPart, LocalState

TOKENS = "tokens"
Link = tuple[str, str]

#: The property tests' settings: the same examples every run (derandomized), no per-example deadline.
PROPERTY_SETTINGS = settings(
    derandomize=True,
    deadline=None,
    max_examples=300,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


class Topology(Protocol):
    """What a scenario tells the network: its processes, their first balances and the channels."""

    @property
    def processes(self) -> tuple[str, ...]: ...
    @property
    def balances(self) -> tuple[int, ...]: ...
    @property
    def declared(self) -> frozenset[Link]: ...  # channels every core knows from the start
    @property
    def late(self) -> frozenset[Link]: ...  # channels opened (open_outbound) during the run
    @property
    def hold_markers(self) -> bool: ...  # markers wait for the next message on their link


@dataclass(frozen=True)
class Drawn:
    """A drawn topology and balances (see :func:`networks`)."""

    processes: tuple[str, ...]
    balances: tuple[int, ...]
    declared: frozenset[Link]
    late: frozenset[Link]
    strong: bool  # the declared channels alone make the topology strongly connected


@st.composite
def networks(draw: st.DrawFn, max_processes: int, link_kinds: str) -> Drawn:
    """2..``max_processes`` processes over a ring through all of them (strongly connected) or a
    spanning tree with random directions (weakly); every other ordered pair gets a kind drawn from
    ``link_kinds``: ``d`` declared, ``l`` late (opened during the run), ``-`` none."""
    count = draw(st.integers(2, max_processes))
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
    kinds = draw(st.lists(st.sampled_from(link_kinds), min_size=len(pairs), max_size=len(pairs)))
    declared = base | {pair for pair, kind in zip(pairs, kinds, strict=True) if kind == "d"}
    late = {pair for pair, kind in zip(pairs, kinds, strict=True) if kind == "l"} - declared
    balances = draw(st.lists(st.integers(0, 20), min_size=count, max_size=count))
    return Drawn(processes, tuple(balances), frozenset(declared), frozenset(late), strong)


@dataclass(frozen=True, slots=True)
class Recorded:
    """What one process had done when it recorded one snapshot."""

    balance: int
    sent: frozenset[bytes]  # ids of the messages it had sent
    received: frozenset[bytes]  # ids of the messages it had received


class TokenNetwork(ABC):
    """The cores, the links and the log of one run; the driver decides what to do next."""

    def __init__(self, scenario: Topology, **core_options: int) -> None:
        self.scenario = scenario
        # Scenarios start any number of snapshots at once: the bound on concurrent recordings (its
        # refusals are tested in test_agent_recordings.py) is lifted so every start is explored.
        options = {"max_recordings": 10_000, **core_options}
        self.cores = {
            process: SnapshotCore(process, [d for s, d in sorted(scenario.declared) if s == process], **options)
            for process in scenario.processes
        }
        self.balances = dict(zip(scenario.processes, scenario.balances, strict=True))
        self.total = sum(scenario.balances)  # tokens in the system
        self.links = sorted(scenario.declared | scenario.late)  # every channel that exists or will open
        self.queues: dict[Link, deque[Entry]] = {link: deque() for link in self.links}
        self.held: dict[Link, list[Entry]] = {link: [] for link in self.links}  # markers waiting for a message
        self.opened = set(scenario.declared)
        self.sent_log: dict[Link, list[bytes]] = {link: [] for link in self.links}  # message ids in send order
        self.link_of: dict[bytes, Link] = {}
        self.sent_ids: dict[str, set[bytes]] = {process: set() for process in scenario.processes}
        self.received_ids: dict[str, set[bytes]] = {process: set() for process in scenario.processes}
        self.records: dict[int, dict[str, Recorded]] = {}
        self.links_at_finish: dict[int, frozenset[Link]] = {}
        self.failures: list[SnapshotFailed] = []

    # -- the application ---------------------------------------------------------------------------

    def open(self, link: Link) -> None:
        """``src`` opens its channel to ``dst``: running snapshots put their markers on it first."""
        if link not in self.opened:
            self.opened.add(link)
            self.apply(link[0], self.cores[link[0]].open_outbound(link[1]))

    def send(self, link: Link, seed: int) -> None:
        """Send a token message with a fresh id on ``link`` (opening it first); the sender is debited now."""
        src, dst = link
        self.open(link)
        tokens = seed % (self.balances[src] + 1)
        self.balances[src] -= tokens
        message_id = b"m%d" % len(self.link_of)
        self.link_of[message_id] = link
        self.sent_log[link].append(message_id)
        self.sent_ids[src].add(message_id)
        self.cores[src].send(dst)
        self.queues[link].extend(self.held[link])  # held markers go first
        self.held[link].clear()
        self.queues[link].append(AppMessage(message_id, {TOKENS: tokens}))

    def deliver(self, link: Link) -> None:
        """Deliver the head of ``link``'s queue; a message credits the receiver."""
        src, dst = link
        entry = self.queues[link].popleft()
        self.apply(dst, self.cores[dst].receive(src, entry))
        if isinstance(entry, AppMessage):
            self.received_ids[dst].add(entry.payload)
            self.balances[dst] += (entry.counters or {})[TOKENS]

    # -- the agent -------------------------------------------------------------------------------

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
                self.report(process, action.part)
            else:
                self.failures.append(action)
                self.failed(process, action)

    def capture(self, process: str, snapshot_id: int) -> LocalState:
        """The application's state, and the log of what it had sent and received."""
        recorded = self.records.setdefault(snapshot_id, {})
        assert process not in recorded, f"{process} recorded snapshot {snapshot_id} twice"
        recorded[process] = Recorded(
            self.balances[process], frozenset(self.sent_ids[process]), frozenset(self.received_ids[process])
        )
        return LocalState(counters={TOKENS: self.balances[process]})

    # -- the detector ----------------------------------------------------------------------------

    def start_or_join(self, assembler: Assembler, process: str, seed: int, new_id: Callable[[], int]) -> None:
        """A start step of ``assembler``'s detector: when ``seed`` says so (1 in 4) and one runs,
        ``process`` becomes another initiator of a running snapshot; else a new one (``new_id()``)
        begins, at ``process`` or (1 in 4) at everyone."""
        running = assembler.running
        if seed % 4 == 1 and running:
            self.apply(process, self.cores[process].start_snapshot(running[seed // 4 % len(running)]))
            return
        snapshot_id = new_id()
        assembler.begin(snapshot_id, self.scenario.processes)
        for initiator in self.scenario.processes if seed % 4 == 0 else (process,):
            if snapshot_id in assembler.running:  # an earlier initiator's start may have completed it
                self.apply(initiator, self.cores[initiator].start_snapshot(snapshot_id))

    def remind(self, assembler: Assembler) -> None:
        """As a detector does at a deadline: tell every member of what still runs of ``assembler``'s."""
        for snapshot_id in assembler.running:
            for process in self.scenario.processes:
                if snapshot_id in assembler.running:
                    self.apply(process, self.cores[process].start_snapshot(snapshot_id))

    @abstractmethod
    def report(self, process: str, part: LocalSnapshotPart) -> None:
        """``process`` reported its part: the driver's detector takes it."""

    @abstractmethod
    def failed(self, process: str, failure: SnapshotFailed) -> None:
        """``process`` failed a snapshot (``failures`` has it already): the driver's detector hears of it."""

    def finish(self, snapshot_id: int) -> None:
        """The detector is done with ``snapshot_id``: every core forgets it."""
        self.links_at_finish[snapshot_id] = frozenset(self.opened)
        for core in self.cores.values():
            core.finish_snapshot(snapshot_id)


def check_consistent(run: TokenNetwork, snapshot: GlobalSnapshot) -> None:
    """``snapshot`` is exactly the cut the driver's log says the processes recorded: every channel's
    proof m + len(recorded) == n, its exact contents in FIFO order, no message received before it
    was sent, tokens conserved."""
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
