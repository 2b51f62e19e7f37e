"""A deterministic discrete-time simulator of a token bank, driving the real protocol core.

Each process runs a :class:`~stablewatch.agents.core.SnapshotCore`; the simulator plays the
network (per-link FIFO queues with delivery times) and the detector (an
:class:`~stablewatch.detector.assembly.Assembler` over every process). Its timing follows the COS
418 rules exactly (see ``shared/conformance/cos418/README.md``):

* a message sent at time ``t`` is due at ``t + 1 + d``, ``d`` the next value of the delay source;
  one value per token send when the event is read, and one per outbound link, in destination
  order, each time a process records and sends markers;
* a tick advances time by one, then each source (in id order) delivers at most one due message,
  the oldest on the first of its links (in destination order) that has one due;
* after the last event it ticks until every snapshot is complete, then 6 more ticks.

The script is the processes' program, so it decides what each records about itself: a process
is active at its recording when the script still has it send, passive when it never sends again.
``termination`` then holds on a snapshot only if nothing is ever sent after it, as on a real run
(termination is stable). Driven step by step (without :meth:`Simulation.run`), the simulator
knows no program, and records every process active: it never claims a future it cannot see.

It is the reference replay of a trace, so its cores record any number of snapshots at once, of any
size: an agent's bounds (``max_recordings``, ``max_recorded_bytes``) apply only when given. A
snapshot that fails anyway (refused, over a bound, inconsistent) is aborted and kept in
:attr:`Simulation.failed` with its reason, never dropped.
"""

from __future__ import annotations

import random
import sys
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from stablewatch.agents.core import (
    Action,
    AppMessage,
    Entry,
    Marker,
    RecordState,
    ReportPart,
    SendEntry,
    SnapshotCore,
    SnapshotFailed,
)
from stablewatch.detector.assembly import Aborted, Assembler, Completed, PartRejected
from stablewatch.detector.sim.cos418 import TOKENS, Send, SnapshotEvent, Tick, Topology, TraceError, TraceEvent
from stablewatch.v1 import GlobalSnapshot, LocalSnapshotPart, LocalState

__all__ = ["Simulation", "random_delays", "tape_delays"]

# Ticks after every snapshot is complete, as the COS 418 harness does.
_SETTLE_TICKS = 6
# An agent's bound not given: none (a trace may run any number of snapshots, of any size).
_UNBOUNDED = sys.maxsize


def tape_delays(delays: Sequence[int], source: str = "delay tape") -> Iterator[int]:
    """Delays read from a tape, in order; running out is an error rather than a silent wrap."""
    yield from delays
    raise TraceError(source, 0, f"the delay tape ran out after {len(delays)} values")


def random_delays(seed: int, bound: int = 5) -> Iterator[int]:
    """Seeded pseudo-random delays in ``[0, bound)``, like the COS 418 harness's ``rand.Intn(5)``."""
    generator = random.Random(seed)
    while True:
        yield generator.randrange(bound)


@dataclass(slots=True)
class _InTransit:
    due: int
    entry: Entry


@dataclass
class Simulation:
    """One run of a topology through a script of events.

    ``max_recordings`` and ``max_recorded_bytes`` give every process an agent's bounds (None: no
    bound). Every snapshot started ends in :attr:`completed` or in :attr:`failed`.
    """

    topology: Topology
    delays: Iterator[int]
    events_source: str = "events"
    max_recorded_bytes: int | None = None
    max_recordings: int | None = None
    now: int = 0
    balances: dict[str, int] = field(init=False)
    completed: list[GlobalSnapshot] = field(init=False, default_factory=list)
    failed: list[Aborted] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self.balances = dict(self.topology.balances)
        self._cores = {
            process: SnapshotCore(
                process,
                self.topology.links[process],
                max_recorded_bytes=_UNBOUNDED if self.max_recorded_bytes is None else self.max_recorded_bytes,
                max_recordings=_UNBOUNDED if self.max_recordings is None else self.max_recordings,
            )
            for process in self.topology.processes
        }
        self._links: dict[str, dict[str, deque[_InTransit]]] = {
            src: {dst: deque() for dst in dsts} for src, dsts in self.topology.links.items()
        }
        self._assembler = Assembler()
        self._next_snapshot_id = 0
        # Sends the script still has per process (None: no script, the future unknown).
        self._sends_left: dict[str, int] | None = None

    @property
    def started(self) -> int:
        """How many snapshots the script has started so far."""
        return self._next_snapshot_id

    # -- the script ----------------------------------------------------------------------------

    def run(self, events: Sequence[TraceEvent]) -> list[GlobalSnapshot]:
        """Play ``events``, then tick until every snapshot has ended; return the completed ones by id
        (the others are in :attr:`failed`, by id too)."""
        self._sends_left = dict.fromkeys(self.topology.processes, 0)
        for event in events:
            if isinstance(event, Send):
                self._sends_left[event.src] += 1
        for event in events:
            if isinstance(event, Send):
                self._sends_left[event.src] -= 1  # this send is no longer ahead of a recording
                self.send(event.src, event.dst, event.tokens, line=event.line)
            elif isinstance(event, SnapshotEvent):
                self.start_snapshot(event.process)
            elif isinstance(event, Tick):
                self.advance(event.steps)
        self.finish()
        self.failed.sort(key=lambda aborted: aborted.snapshot_id)
        return sorted(self.completed, key=lambda snapshot: snapshot.snapshot_id)

    def send(self, src: str, dst: str, tokens: int, line: int = 0) -> None:
        """``src`` sends ``tokens`` to ``dst``: debited now, credited on delivery."""
        if self.balances[src] < tokens:
            raise TraceError(self.events_source, line, f"{src} sends {tokens} tokens but has only {self.balances[src]}")
        self.balances[src] -= tokens
        message = AppMessage(b"", {TOKENS: tokens})
        self._cores[src].send(dst)
        self._enqueue(src, dst, message)

    def start_snapshot(self, initiator: str) -> int:
        """``initiator`` starts the next snapshot id; every process is a member."""
        snapshot_id = self._next_snapshot_id
        self._next_snapshot_id += 1
        self._assembler.begin(snapshot_id, self.topology.processes)
        self._apply(initiator, self._cores[initiator].start_snapshot(snapshot_id))
        return snapshot_id

    def advance(self, steps: int) -> None:
        """Tick ``steps`` times; once nothing is in flight the remaining ticks deliver nothing, so
        time jumps over them at once."""
        for done in range(steps):
            if not any(queue for queues in self._links.values() for queue in queues.values()):
                self.now += steps - done
                return
            self.tick()

    def tick(self) -> None:
        """Advance time by one and deliver at most one due message per source."""
        self.now += 1
        for src in self.topology.processes:
            for dst, queue in self._links[src].items():
                if queue and queue[0].due <= self.now:
                    self._deliver(src, dst, queue.popleft().entry)
                    break

    def finish(self) -> None:
        """Tick until every snapshot is complete, then settle for a few more ticks."""
        while self._assembler.running:
            if not any(queue for links in self._links.values() for queue in links.values()):
                stuck = [f"{k}: {self._assembler.missing(k)}" for k in self._assembler.running]
                raise TraceError(self.events_source, 0, "snapshot cannot complete: " + "; ".join(stuck))
            self.tick()
        self.advance(_SETTLE_TICKS)

    # -- internals -----------------------------------------------------------------------------

    def _enqueue(self, src: str, dst: str, entry: Entry) -> None:
        self._links[src][dst].append(_InTransit(self.now + 1 + next(self.delays), entry))

    def _deliver(self, src: str, dst: str, entry: Entry) -> None:
        core = self._cores[dst]
        if isinstance(entry, Marker):
            self._apply(dst, core.receive_marker(src, entry.snapshot_id))
            return
        self._apply(dst, core.receive_message(src, entry))
        self.balances[dst] += (entry.counters or {}).get(TOKENS, 0)

    def _apply(self, process: str, actions: Sequence[Action]) -> None:
        """Carry out a core's actions for ``process``, in order."""
        pending = deque(actions)
        while pending:
            action = pending.popleft()
            if isinstance(action, RecordState):
                state = LocalState(active=self._will_send(process), counters={TOKENS: self.balances[process]})
                pending.extendleft(reversed(self._cores[process].record_state(action.snapshot_id, state)))
            elif isinstance(action, SendEntry):
                self._enqueue(process, action.dst, action.entry)
            elif isinstance(action, ReportPart):
                self._report(action.part)
            elif isinstance(action, SnapshotFailed):
                self._abort(action.snapshot_id, action.reason)  # the reason names the process

    def _will_send(self, process: str) -> bool:
        """Whether ``process`` may still send: the script has it send later (no script: it may)."""
        return self._sends_left is None or self._sends_left[process] > 0

    def _report(self, part: LocalSnapshotPart) -> None:
        try:
            outcome = self._assembler.add_part(part, sender=part.process_id)
        except PartRejected as rejected:
            if rejected.aborted is not None:  # the part proved the cut inconsistent
                self.failed.append(rejected.aborted)
                self._finish_everywhere(part.snapshot_id)
            else:  # a part the detector would refuse: the snapshot cannot be trusted whole
                self._abort(part.snapshot_id, f"a part of {part.process_id} was rejected: {rejected}")
            return
        if isinstance(outcome, Completed):
            self.completed.append(outcome.snapshot)
            self._finish_everywhere(outcome.snapshot.snapshot_id)

    def _abort(self, snapshot_id: int, reason: str) -> None:
        """End ``snapshot_id`` as failed, if it is still running (a failure after the first adds nothing)."""
        aborted = self._assembler.abort(snapshot_id, reason)
        if aborted is not None:
            self.failed.append(aborted)
            self._finish_everywhere(snapshot_id)

    def _finish_everywhere(self, snapshot_id: int) -> None:
        for core in self._cores.values():
            core.finish_snapshot(snapshot_id)
