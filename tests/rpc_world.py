"""RPC mode's simulator: real ColorCores calling each other out of order, a detector of its own
(or several: a subclass), and an oracle that checks a completed cut from the definitions alone.

Processes call each other: a request carries units from its caller; once it is delivered, the
callee answers with a response that carries units back. Any message in flight may be delivered
next (calls overtake each other: nothing is FIFO), but slow ones only at a "late" step, so that
some stay in flight across whole snapshots. The detector begins snapshots whose starts reach each
process through its own ordered control stream, at random times, and forwards the outbound counts
of every part as targets through the same streams. A call may end ambiguously at its caller, which
resets the pair: its response is then dropped (gRPC does), its request lost or delivered late, and
sometimes the callee resets too. Every send, delivery and capture of state gets a time of its own,
which is all the oracle (:func:`check_cut`) looks at.

Used by test_rpc_core.py (one detector) and test_two_detectors_core.py (two side by side, each
with its own control streams: :meth:`World.stream_of` says which carry a snapshot's messages).
"""

from __future__ import annotations

import random
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from hypothesis import strategies as st

from stablewatch.agents.core import RecordState, ReportPart
from stablewatch.agents.rpc.core import Action, ColorCore, StaleStamp, Stamp
from stablewatch.v1 import InboundChannelState, LocalSnapshotPart, LocalState, RecordedMessage

WALL = 1_800_000_000.0  # seconds since the epoch: ids (microseconds) far below it are plausible
UNITS = "units"
W = TypeVar("W", bound="World")
Stream = tuple[int, str]  # (detector, process): one detector's ordered control stream to one process

DELIVER, LATE, CALL, RESPOND, CONTROL = "deliver", "late", "call", "respond", "control"
START, FAIL, EXPIRE = "start", "fail", "expire"
# Deliveries and control steps are the most frequent, so that snapshots get to complete.
KINDS = (DELIVER, CALL, CONTROL, DELIVER, RESPOND, CONTROL, START, DELIVER, CALL, CONTROL, FAIL, RESPOND, EXPIRE, LATE)
LIFETIMES = (None, 30.0, 300.0)  # per start: the default, one that often runs out, a long one


@dataclass(frozen=True)
class Scenario:
    """Processes, their units at first, the cores' default lifetime and a script of steps."""

    processes: int
    units: tuple[int, ...]
    default_lifetime: float
    steps: tuple[tuple[str, int, int], ...]


@st.composite
def scenarios(draw: st.DrawFn, max_steps: int = 160) -> Scenario:
    count = draw(st.integers(2, 4))
    units = draw(st.lists(st.integers(0, 9), min_size=count, max_size=count))
    default_lifetime = draw(st.sampled_from([40.0, 400.0]))
    step = st.tuples(st.sampled_from(KINDS), st.integers(0, 1 << 12), st.integers(0, 1 << 12))
    length = draw(st.integers(0, max_steps))  # lists alone stay too short to interleave much
    steps = draw(st.lists(step, min_size=length, max_size=length))
    return Scenario(count, tuple(units), default_lifetime, tuple(steps))


def random_scenario(rng: random.Random, steps: int = 300) -> Scenario:
    """A longer scenario drawn from ``rng``, with fewer ambiguous failures, for the coverage check."""
    count = rng.randint(2, 4)
    kinds = [kind for kind in KINDS if kind != FAIL]
    script = tuple(
        (FAIL if rng.random() < 0.02 else rng.choice(kinds), rng.randrange(1 << 12), rng.randrange(1 << 12))
        for _ in range(steps)
    )
    return Scenario(count, tuple(rng.randint(0, 9) for _ in range(count)), rng.choice([40.0, 400.0]), script)


@dataclass(eq=False)
class Call:
    """One call: its request and (once answered) its response."""

    caller: str
    callee: str
    number: int
    request: Sent | None = None
    response: Sent | None = None
    ended: bool = False  # the caller saw its end: a response, a refusal or an ambiguous failure
    failed: bool = False  # an ambiguous end: a response sent after it never arrives


@dataclass(eq=False)
class Sent:
    """One message of the run, with the times of its send and of its delivery."""

    number: int
    src: str
    dst: str
    stamp: Stamp
    units: int
    call: Call
    request: bool
    sent_at: int
    slow: bool  # delivered only by a "late" step (or at the end)
    delivered_at: int | None = None  # None: never delivered (lost, or refused as stale)


@dataclass
class Tally:
    """What the detector knows of one snapshot."""

    resets_before: int  # ambiguous call ends in the run when it began
    states: dict[str, LocalSnapshotPart] = field(default_factory=dict)
    counts: dict[tuple[str, str], tuple[int, int]] = field(default_factory=dict)  # (src, dst): (n, session)
    channels: dict[tuple[str, str], InboundChannelState] = field(default_factory=dict)
    outcome: str | None = None  # "completed" or "failed"
    across_resets: bool = False  # completed after an ambiguous call end that came while it ran


class World:
    """Cores, network, control streams and detector of one scenario, and the log the oracle reads.

    ``detectors`` detectors (0, 1, ...) each have an ordered control stream to every process; this
    class's own detector is detector 0 and numbers its snapshots 1, 2, ...
    """

    def __init__(self, scenario: Scenario, detectors: int = 1, max_recordings: int | None = None) -> None:
        self.scenario = scenario
        self.names = [f"p{i}" for i in range(scenario.processes)]
        options = {} if max_recordings is None else {"max_recordings": max_recordings}
        self.cores = {
            name: ColorCore(name, incarnation=100 + i, default_lifetime=scenario.default_lifetime, **options)
            for i, name in enumerate(self.names)
        }
        self.units = dict(zip(self.names, scenario.units, strict=True))
        self.total = sum(scenario.units)
        self.clock = 0
        self.network: list[Sent] = []
        self.log: list[Sent] = []
        self.calls: list[Call] = []
        self.answering: list[Call] = []  # calls whose request was delivered and not yet answered
        self.control: dict[Stream, deque[tuple[Any, ...]]] = {
            (detector, name): deque() for detector in range(detectors) for name in self.names
        }
        self.captures: list[tuple[str, int]] = []  # (process, time) of every state captured
        self.snapshots: dict[int, Tally] = {}
        self.resets = 0
        self.stale = 0

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    # -- the script ----------------------------------------------------------------------------

    def steps(self) -> dict[str, Callable[[int, int], None]]:
        """What each kind of step of the script does."""
        return {
            DELIVER: self.deliver,
            LATE: self.deliver_late,
            CALL: self.call,
            RESPOND: self.respond,
            CONTROL: self.control_step,
            START: self.start,
            FAIL: self.fail,
            EXPIRE: self.expire,
        }

    def play(self) -> None:
        steps = self.steps()
        for kind, x, y in self.scenario.steps:
            steps[kind](x, y)

    def settle(self) -> None:
        """Deliver, answer and carry out everything still pending, until nothing is."""
        while self.network or self.answering or any(self.control.values()):
            while self.network:
                self.deliver_one(0, self.network)
            while self.answering:
                self.respond(0, 0)
            for stream in sorted(self.control):
                while self.control[stream]:
                    self.control_one(stream)

    def call(self, x: int, y: int) -> None:
        caller = self.names[x % len(self.names)]
        others = [name for name in self.names if name != caller]
        call = Call(caller, others[y % len(others)], len(self.calls))
        self.calls.append(call)
        units = y % (self.units[caller] + 1)
        call.request = self.send(call, caller, call.callee, units, request=True, slow=x >> 9 == 0)

    def respond(self, x: int, _y: int) -> None:
        if not self.answering:
            return
        call = self.answering.pop(x % len(self.answering))
        units = x % (self.units[call.callee] + 1)
        call.response = self.send(call, call.callee, call.caller, units, request=False, slow=x >> 9 == 1)
        if call.failed:  # its caller gave up: gRPC drops the response
            self.network.remove(call.response)

    def send(self, call: Call, src: str, dst: str, units: int, *, request: bool, slow: bool) -> Sent:
        self.units[src] -= units
        sent = Sent(len(self.log), src, dst, self.cores[src].send(dst), units, call, request, self.tick(), slow)
        self.log.append(sent)
        self.network.append(sent)
        return sent

    def deliver(self, x: int, _y: int) -> None:
        """Deliver any message in flight but the slow ones."""
        self.deliver_one(x, [sent for sent in self.network if not sent.slow])

    def deliver_late(self, x: int, _y: int) -> None:
        self.deliver_one(x, [sent for sent in self.network if sent.slow])

    def deliver_one(self, x: int, candidates: list[Sent]) -> None:
        if not candidates:
            return
        sent = candidates[x % len(candidates)]
        self.network.remove(sent)
        recorded = RecordedMessage(
            payload=b"%d" % sent.number,
            counters={UNITS: sent.units},
            no_wake=sent.request,
            wakes_task="" if sent.request else f"call#{sent.call.number}",
        )
        source: RecordedMessage | Callable[[], RecordedMessage] = recorded if sent.number % 2 else lambda: recorded
        core = self.cores[sent.dst]
        try:
            # Two of three messages as the agent delivers them (the clock-free path first), the rest
            # through receive() alone: the two must agree.
            actions = core.receive_checked(sent.stamp, source) if sent.number % 3 else None
            if actions is None:
                actions = core.receive(sent.stamp, source, now=self.clock, wall=WALL)
        except StaleStamp:
            self.stale += 1  # refused: never delivered, and a refused request ends its call
            sent.call.ended = sent.call.ended or sent.request
            return
        self.apply(sent.dst, actions)  # a state captured here is captured before the delivery
        sent.delivered_at = self.tick()
        self.units[sent.dst] += sent.units
        if sent.request:
            self.answering.append(sent.call)
        else:
            sent.call.ended = True

    def fail(self, x: int, y: int) -> None:
        """A call ends ambiguously at its caller (UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED)."""
        running = [call for call in self.calls if not call.ended]
        if not running:
            return
        call = running[x % len(running)]
        call.ended = call.failed = True
        self.resets += 1
        self.apply(call.caller, self.cores[call.caller].reset_peer(call.callee, "call ended in UNAVAILABLE"))
        if call.response in self.network:
            self.network.remove(call.response)
        assert call.request is not None
        if call.request in self.network:
            if y % 2:
                self.network.remove(call.request)  # lost
            else:
                call.request.slow = True  # it may still arrive, late
        if y % 3 == 0 and call.request.delivered_at is not None:  # the callee saw the end too
            self.resets += 1
            self.apply(call.callee, self.cores[call.callee].reset_peer(call.caller, "call CANCELLED"))

    def expire(self, x: int, _y: int) -> None:
        name = self.names[x % len(self.names)]
        self.apply(name, self.cores[name].expire(self.clock))

    # -- the detector --------------------------------------------------------------------------

    def start(self, _x: int, y: int) -> None:
        snapshot_id = len(self.snapshots) + 1
        self.snapshots[snapshot_id] = Tally(self.resets)
        for name in self.names:
            self.control[0, name].append(("start", snapshot_id, LIFETIMES[y % len(LIFETIMES)]))

    def stream_of(self, snapshot_id: int) -> int:
        """The detector whose streams carry ``snapshot_id``'s targets and finish."""
        return 0

    def control_step(self, x: int, y: int) -> None:
        """Carry out the next few messages of one control stream (it is ordered)."""
        busy = [stream for stream in sorted(self.control) if self.control[stream]]
        if busy:
            stream = busy[x % len(busy)]
            for _ in range(min(1 + y % 4, len(self.control[stream]))):
                self.control_one(stream)

    def control_one(self, stream: Stream) -> None:
        event, *fields = self.control[stream].popleft()
        self.carry_out(stream, event, *fields)

    def carry_out(self, stream: Stream, event: str, *fields: Any) -> None:
        """One message of a control stream at its process: a start, a target or a finish."""
        name = stream[1]
        core = self.cores[name]
        if event == "start":
            snapshot_id, lifetime = fields
            self.apply(name, core.start_snapshot(snapshot_id, now=self.clock, lifetime=lifetime))
        elif event == "target":
            self.apply(name, core.channel_target(*fields))
        else:
            core.finish_snapshot(*fields)

    def apply(self, name: str, actions: Sequence[Action]) -> None:
        for action in actions:
            if isinstance(action, RecordState):
                self.captures.append((name, self.tick()))
                captured = LocalState(counters={UNITS: self.units[name]})
                captured.attributes["capture"] = len(self.captures) - 1
                self.apply(name, self.cores[name].record_state(action.snapshot_id, captured))
            elif isinstance(action, ReportPart):
                self.take_part(name, action.part)
            else:
                self.end(action.snapshot_id, "failed")

    def take_part(self, name: str, part: LocalSnapshotPart) -> None:
        assert part.process_id == name
        tally = self.snapshots[part.snapshot_id]
        if tally.outcome is not None:
            return  # the detector ignores parts of a snapshot it ended (or never heard of)
        if part.HasField("state"):
            assert name not in tally.states, f"{name} reported its state twice for {part.snapshot_id}"
            tally.states[name] = part
            for count in part.outbound:
                tally.counts[name, count.dst] = (count.sent_before_marker, count.session)
                forwarded = (name, count.sent_before_marker, self.cores[name].incarnation, count.session)
                stream = (self.stream_of(part.snapshot_id), count.dst)
                self.control[stream].append(("target", part.snapshot_id, *forwarded))
        for inbound in part.inbound:
            assert (inbound.src, name) not in tally.channels, f"channel {inbound.src} -> {name} reported twice"
            tally.channels[inbound.src, name] = inbound
        if len(tally.states) == len(self.names) and tally.counts.keys() <= tally.channels.keys():
            tally.across_resets = self.resets > tally.resets_before
            self.end(part.snapshot_id, "completed")

    def end(self, snapshot_id: int, outcome: str) -> None:
        tally = self.snapshots[snapshot_id]
        if tally.outcome is None:  # a failure reported after completion comes too late to matter
            tally.outcome = outcome
            for name in self.names:
                self.control[self.stream_of(snapshot_id), name].append(("finish", snapshot_id))


# -- the oracle -------------------------------------------------------------------------------------


def check_cut(world: World, snapshot_id: int) -> None:
    """Check a completed snapshot against the run's log, from the definitions alone.

    Each process's cut point is the time its reported state was captured. The cut is consistent
    when no message was delivered before its receiver's cut point and sent after its sender's. The
    state of channel q -> p is the messages sent before q's point and delivered after p's. And the
    units held at the cut points plus those in the channels equal the total, less the units of
    messages sent before their sender's point that were never delivered (lost).
    """
    tally = world.snapshots[snapshot_id]
    at: dict[str, int] = {}
    held = 0
    for name, part in tally.states.items():
        process, captured_at = world.captures[int(part.state.attributes["capture"])]
        assert process == name
        at[name] = captured_at
        held += part.state.counters[UNITS]
    assert sorted(at) == world.names
    for sent in world.log:
        if sent.delivered_at is not None and sent.delivered_at < at[sent.dst]:
            assert sent.sent_at < at[sent.src], f"snapshot {snapshot_id}: message {sent.number} received, never sent"
    assert tally.channels.keys() <= tally.counts.keys()
    in_channels = 0
    for src in world.names:
        for dst in world.names:
            if src == dst:
                continue
            expected = Counter(
                b"%d" % sent.number
                for sent in world.log
                if sent.src == src
                and sent.dst == dst
                and sent.sent_at < at[src]
                and sent.delivered_at is not None
                and sent.delivered_at > at[dst]
            )
            reported = tally.channels.get((src, dst))
            messages = list(reported.messages) if reported else []
            got = Counter(recorded.payload for recorded in messages)
            where = f"snapshot {snapshot_id}, channel {src} -> {dst}"
            assert got == expected, f"{where}: recorded {sorted(got)}, in flight {sorted(expected)}"
            assert len(messages) == sum(expected.values())
            if reported is not None:
                sent_before, session = tally.counts[src, dst]
                assert reported.received_before_recording + len(messages) == sent_before, where
                assert reported.session == session, where
            in_channels += sum(recorded.counters[UNITS] for recorded in messages)
    lost = sum(sent.units for sent in world.log if sent.delivered_at is None and sent.sent_at < at[sent.src])
    assert held + in_channels == world.total - lost, f"snapshot {snapshot_id}: units not conserved"


def play_checked(world: W) -> W:
    """Play ``world``'s scenario until nothing is pending, and check every completed cut with the oracle."""
    world.play()
    world.settle()
    for snapshot_id, tally in world.snapshots.items():
        if tally.outcome == "completed":
            check_cut(world, snapshot_id)
    return world
