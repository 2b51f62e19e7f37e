"""Benchmark: breaking the proven deadlocks of gRPC services: every one, once, and soon.

The shop of ``stablewatch.examples.shop`` (orders, payments, inventory and a client, each its own
OS process, plain gRPC servers whose worker pools come from their RPC-mode agents, so that a
queued request can be refused) watched by a detector in this process. Four parts, one run:

1. **Breaking.** The ``deadlock`` workload (pools of 2, the client keeping 4 orders going, every
   Reserve calling back ``orders.Confirm``) deadlocks as soon as two Places hold both orders
   workers and their Confirms queue behind them. The detector runs with ``resolve="youngest"``,
   scheduled snapshots at only 1 a second (``--interval``) and the agents' long-wait hints on: it
   refuses the youngest queued Confirm with ``ABORTED``, the chain above it fails back to the
   client, which places the order again after a 10-50 ms back-off, and the shop soon deadlocks
   anew. Runs until ``--deadlocks`` deadlocks were broken (or ``--max-seconds``).

   * ``deadlocks``: the distinct deadlocks the detector proved (the sink components its breaks
     name, ``Resolution.component``), plus 1 if the shop is stuck at the end (no service call
     finished for 2 s) with no break under way; ``resolved``: those with a break reported BROKEN
     after which the victim's caller saw ``ABORTED`` (naming that snapshot) in its own books.
   * ``recovery_p50_ms``/``recovery_p99_ms``: per victim ``ABORTED`` (a finished call whose
     details begin "stablewatch broke": the calls above it quote them after words of their own),
     the moment its caller saw it minus the moment the last worker blocked, both as the services
     record them (``/shop.Admin/Status``, the wall clock of the same machine): the latest start
     among the services' outgoing calls that were out at the moment of the ``ABORTED``. Every
     worker of the three services is in the deadlock, so those calls are its edges. Split (p50
     and p99 of each) in ``recovery_start_*`` (to the start of the snapshot that proved it: the
     hints' or the schedule's wait), ``recovery_snapshot_*`` (that snapshot), ``recovery_break_*``
     (from its end to the ``ABORTED``), and ``recovery_detect_*`` (the first two together, as in
     part 3). A deadlock that formed before all four agents were attached (the shop starting) is
     left out (``recoveries_before_attach``). Each recovery over 300 ms is shown on stderr with
     where its time went.
   * ``double_breaks``: deadlocks with more than one break reported BROKEN.
   * ``scheduled_snapshots_per_s`` (asked), ``snapshots_per_s`` (completed, scheduled and hinted)
     and ``hint_snapshots`` (``stablewatch_wait_hints_total{outcome="snapshot"}``).

2. **Churn.** The ``churn`` workload (never deadlocks) with ``resolve="youngest"`` and snapshots
   every ``--churn-interval`` (0.02 s) until ``--churn-snapshots`` completed: ``churn_breaks``
   (breaks sent) must be 0.

3. **Detection alone** (no breaking): hints on and off at 1 and 10 scheduled snapshots a second,
   ``--detection-rounds`` interleaved rounds. A round starts a fresh detector and the deadlock
   shop (after a random fraction of the interval: the deadlock meets the schedule at a random
   phase), waits for the first complete snapshot whose deadlock is true, reads the books and stops
   both: the latency is that snapshot's ``finished_at`` minus the last worker's block (as in 1).
   A round whose deadlock formed before all four agents were attached (a hint sent then is lost)
   is run again (``detect_retried``). Keys ``detect_hints_on_1_p50_ms``,
   ``detect_hints_off_10_spread`` ...

4. **What the hints cost a busy system**: ``bench/channel_throughput.py``'s agent channel at full
   speed, in interleaved rounds of one pair of processes with the agents' hints on and one with
   them off, each measured A-S-A (no snapshots, snapshots every 0.1 s, none again) against a
   detector that takes a snapshot for every hint it is sent (its rate limit permitting).
   ``hint_throughput_ratio`` (agent msgs/s, hints on / off, per round) and
   ``snapshot_overhead_hints_on``/``_off`` (1 - with snapshots / without, within a pair), with
   spreads; ``hints_per_s`` the hints the agents sent meanwhile, ``hint_snapshots_per_s`` the
   snapshots the detector took for them. ``--hint-rounds 0`` skips it.

Prints tables and, as the last line, one JSON object with the figures above and ``targets``
(``resolved == deadlocks``, ``recovery_p50_ms <= 100``, ``recovery_p99_ms <= 300``,
``churn_breaks == 0``, ``double_breaks == 0``, and enough deadlocks and churn snapshots) and
``target_met``. Exits 1 when the churn workload got a break (a break of a wait that was not
deadlocked is a bug).

    python bench/resolution.py [--deadlocks 30] [--churn-snapshots 1000] [--detection-rounds 5] [--hint-rounds 3]

About 3 minutes on a 2-core machine: breaking a few seconds, the churn part about 20 s (some 50
snapshots a second), each detection round about 4 s (starting and stopping four processes), each
hint-cost round about 40 s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import re
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from google.protobuf.timestamp_pb2 import Timestamp
from report import json_line, percentile, print_whole, quiet_teardown, rounds_row, rounds_table, spread
from rich.console import Console
from rich.table import Table

from stablewatch.detector.evaluation import Verdict
from stablewatch.detector.service.detector import Detector, DetectorConfig
from stablewatch.detector.service.resolutions import outcome_word
from stablewatch.examples.shop import ROLES, SERVICES
from stablewatch.examples.shop_processes import ShopProcesses
from stablewatch.v1.control_pb2 import BREAK_OUTCOME_BROKEN, BREAK_OUTCOME_UNSPECIFIED
from stablewatch.v1.query_pb2 import Resolution, SnapshotResults

# How the details of the ABORTED a victim's caller sees begin; the calls above it, failing in turn,
# quote them after words of their own.
VICTIM = "stablewatch broke"
VICTIM_SNAPSHOT = re.compile(r"proven by snapshot (\d+)")
SLOW = 0.3  # seconds: a recovery beyond the p99 target is shown, with where its time went
STUCK_AFTER = 2.0  # seconds without a finished service call: the shop is stuck
BOOKS_EVERY = 5.0  # seconds between reads of the books while breaking (they keep the latest 5000 calls)
DETECTION_CASES = {  # name -> (hints, scheduled interval)
    "hints_on_1": (True, 1.0),
    "hints_off_1": (False, 1.0),
    "hints_on_10": (True, 0.1),
    "hints_off_10": (False, 0.1),
}


# -- the shop's own books ---------------------------------------------------------------------------


class Call(NamedTuple):
    """An outgoing call of a service, as the service booked it (wall-clock seconds)."""

    role: str
    method: str
    began: float
    ended: float | None  # None: still out at the last read
    code: str = ""
    details: str = ""


@dataclass
class Books:
    """The services' outgoing calls: every finished one seen in any read, and those out at the last."""

    finished: dict[tuple[str, float, float, str], Call] = field(default_factory=dict)
    outstanding: list[Call] = field(default_factory=list)
    read_at: float = 0.0  # wall clock of the last read

    def read(self, shop: ShopProcesses) -> None:
        """Read every service's books (blocking: run it in a thread) and merge them in."""
        outstanding: list[Call] = []
        for role in SERVICES:
            status = shop.status(role)
            for call in status["outstanding"]:
                outstanding.append(Call(role, call["method"], call["began"], None))
            for call in status["finished"]:
                key = (role, call["began"], call["ended"], call["method"])
                self.finished[key] = Call(
                    role, call["method"], call["began"], call["ended"], call["code"], call["details"]
                )
        self.outstanding = outstanding
        self.read_at = time.time()

    def calls(self) -> Iterable[Call]:
        yield from self.finished.values()
        yield from self.outstanding

    def last_block(self, moment: float) -> float | None:
        """When the last worker blocked before ``moment``: the latest start among the calls out then."""
        starts = [c.began for c in self.calls() if c.began <= moment and (c.ended is None or c.ended >= moment)]
        return max(starts, default=None)

    def victims(self) -> list[tuple[int, Call]]:
        """The ABORTEDs stablewatch's breaks caused, with the snapshot each names, in time order."""
        found = []
        for call in self.finished.values():
            match = VICTIM_SNAPSHOT.search(call.details)
            if call.code == "ABORTED" and call.details.startswith(VICTIM) and match:
                found.append((int(match.group(1)), call))
        return sorted(found, key=lambda found: found[1].ended or 0.0)

    def last_finished(self) -> float | None:
        return max((c.ended for c in self.finished.values() if c.ended is not None), default=None)


# -- the detector and the shop ----------------------------------------------------------------------


def detector_config(
    folder: Path, args: argparse.Namespace, *, interval: float, resolve: str | None, hints: bool
) -> DetectorConfig:
    return DetectorConfig(
        data_dir=folder / "data",
        listen="127.0.0.1:0",
        metrics_port=None,
        interval=interval,
        deadline=args.deadline,
        max_concurrent=args.max_concurrent,
        min_members=len(ROLES),  # no snapshot before the whole shop is attached
        expected_members=ROLES,
        max_snapshots=100_000,
        seed=args.seed,
        resolve=resolve,
        hints=hints,
    )


@contextlib.asynccontextmanager
async def watched_shop(
    workload: str,
    args: argparse.Namespace,
    *,
    interval: float,
    resolve: str | None,
    hints: bool,
    phase: float = 0.0,
) -> AsyncIterator[tuple[Detector, ShopProcesses, Attached]]:
    """A fresh detector in this process and the shop's four processes attached to it; both stopped after.

    The shop starts ``phase`` seconds after the detector, whose schedule is a timetable from its
    start: the shop's deadlock, which forms about as long after the shop's start every time, then
    meets the schedule at that phase.
    """
    with tempfile.TemporaryDirectory(prefix="stablewatch-resolution-") as name:
        folder = Path(name)
        detector = Detector(detector_config(folder, args, interval=interval, resolve=resolve, hints=hints))
        await detector.start()
        await asyncio.sleep(phase)
        shop = ShopProcesses(folder / "shop", workload, detector.address, ("--seed", str(args.seed)))
        attached = Attached(detector)
        try:
            await asyncio.to_thread(shop.start)
            yield detector, shop, attached
            shop.check_running()
        finally:
            quiet_teardown()  # snapshots in flight abort as the shop stops
            await attached.stop()
            await asyncio.to_thread(shop.stop)
            await detector.stop()


class Attached:
    """When (wall clock) the whole shop was first attached to the detector."""

    def __init__(self, detector: Detector) -> None:
        self.at: float | None = None
        self._task = asyncio.ensure_future(self._run(detector))

    async def _run(self, detector: Detector) -> None:
        while len(detector.coordinator.members) < len(ROLES):
            await asyncio.sleep(0.002)
        self.at = time.time()

    async def stop(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


def metric(detector: Detector, name: str, **labels: str) -> float:
    return detector.metrics.registry.get_sample_value(name, labels) or 0.0


def hint_outcomes(detector: Detector) -> dict[str, int]:
    outcomes = ("snapshot", "coalesced", "rate_limited", "ignored")
    return {o: int(metric(detector, "stablewatch_wait_hints_total", outcome=o)) for o in outcomes}


def all_resolutions(detector: Detector) -> list[Resolution]:
    """Every break the detector stored, oldest first."""
    found: list[Resolution] = []
    before = None
    while page := detector.store.resolutions(1000, before_id=before):
        found.extend(page)
        before = page[-1].resolution_id
    return found[::-1]


Component = tuple[tuple[str, str], ...]


def component_of(resolution: Resolution) -> Component:
    return tuple(sorted((node.process, node.task) for node in resolution.component))


def deadlock_holds(results: SnapshotResults | None) -> bool:
    if results is None:
        return False
    result = next((r for r in results.results if r.name == "deadlock"), None)
    return result is not None and Verdict.of(result) is Verdict.TRUE


def seconds_of(timestamp: Timestamp) -> float:
    return timestamp.ToMicroseconds() / 1e6


def ms(values: list[float], fraction: float | None) -> float | None:
    """The median (``fraction`` None) or a percentile of ``values`` in milliseconds; None when empty."""
    if not values:
        return None
    value = statistics.median(values) if fraction is None else percentile(values, fraction)
    return round(value * 1000, 1)


# -- 1. breaking -----------------------------------------------------------------------------------


async def breaking(args: argparse.Namespace) -> dict[str, object]:
    """The deadlock workload with breaking on, until ``--deadlocks`` deadlocks were broken."""
    books = Books()
    async with watched_shop("deadlock", args, interval=args.interval, resolve="youngest", hints=True) as (
        detector,
        shop,
        attached,
    ):
        started = time.monotonic()
        completed_before = metric(detector, "stablewatch_snapshots_total", outcome="completed")
        hints_before = hint_outcomes(detector)
        last_read = last_change = started
        seen = 0
        while True:
            resolutions = all_resolutions(detector)
            broken = {component_of(r) for r in resolutions if r.outcome == BREAK_OUTCOME_BROKEN}
            now = time.monotonic()
            if len(resolutions) != seen:
                seen, last_change = len(resolutions), now
            if len(broken) >= args.deadlocks or now - started > args.max_seconds:
                break
            if now - last_change > args.stuck_seconds:  # no break for that long: the shop will not move again
                break
            if now - last_read > BOOKS_EVERY:
                await asyncio.to_thread(books.read, shop)
                last_read = time.monotonic()
            await asyncio.sleep(0.1)
        elapsed = time.monotonic() - started
        completed = metric(detector, "stablewatch_snapshots_total", outcome="completed") - completed_before
        hints = {o: n - hints_before[o] for o, n in hint_outcomes(detector).items()}
        counted = {component_of(r) for r in resolutions}  # the deadlocks formed so far
        # Let the last victims' ABORTEDs reach the books and the last reports come back.
        await asyncio.sleep(args.settle)
        await asyncio.to_thread(books.read, shop)
        resolutions = [r for r in all_resolutions(detector) if component_of(r) in counted]
        summaries = {r.snapshot_id: detector.store.summary(r.snapshot_id) for r in resolutions}
        placed = await asyncio.to_thread(shop.placed)
    proofs = {  # snapshot id -> when the snapshot that proved a deadlock started and finished
        sid: (seconds_of(s.started_at), seconds_of(s.finished_at)) for sid, s in summaries.items() if s is not None
    }
    return {
        "books": books,
        "resolutions": resolutions,
        "proofs": proofs,
        "elapsed": elapsed,
        "completed": completed,
        "hints": hints,
        "placed": placed,
        "attached_at": attached.at,
    }


def breaking_figures(outcome: dict[str, object], args: argparse.Namespace) -> dict[str, object]:
    books: Books = outcome["books"]  # type: ignore[assignment]
    resolutions: list[Resolution] = outcome["resolutions"]  # type: ignore[assignment]
    proofs: dict[int, tuple[float, float]] = outcome["proofs"]  # type: ignore[assignment]
    attached_at: float | None = outcome["attached_at"]  # type: ignore[assignment]
    by_component: dict[Component, list[Resolution]] = {}
    for resolution in resolutions:
        by_component.setdefault(component_of(resolution), []).append(resolution)
    victims = books.victims()
    recoveries: list[float] = []
    parts: dict[str, list[float]] = {"detect": [], "start": [], "snapshot": [], "break": []}
    resolved = before_attach = 0
    matched: set[int] = set()  # victims' ABORTEDs that answer one of the counted breaks
    for group in by_component.values():
        ok = False
        for resolution in group:
            if resolution.outcome != BREAK_OUTCOME_BROKEN:
                continue
            for index, (snapshot_id, call) in enumerate(victims):
                if snapshot_id == resolution.snapshot_id and resolution.deadlock[:40] in call.details:
                    ok = True
                    matched.add(index)
        resolved += ok
    for index in sorted(matched):
        snapshot_id, call = victims[index]
        assert call.ended is not None
        blocked = books.last_block(call.ended)
        if blocked is None:
            continue
        if attached_at is None or blocked < attached_at:
            before_attach += 1  # formed while the shop was starting: no detector could see it yet
            continue
        recoveries.append(call.ended - blocked)
        if snapshot_id not in proofs:
            continue
        started, finished = proofs[snapshot_id]
        parts["detect"].append(finished - blocked)
        parts["start"].append(started - blocked)
        parts["snapshot"].append(finished - started)
        parts["break"].append(call.ended - finished)
        if call.ended - blocked > SLOW:
            print(
                f"slow recovery: {(call.ended - blocked) * 1000:.1f} ms = the proving snapshot {snapshot_id} started "
                f"{(started - blocked) * 1000:.1f} ms after the last block, took {(finished - started) * 1000:.1f} ms, "
                f"and the ABORTED came {(call.ended - finished) * 1000:.1f} ms later",
                file=sys.stderr,
            )
    pending = any(r.outcome == BREAK_OUTCOME_UNSPECIFIED and not r.HasField("reported_at") for r in resolutions)
    last = books.last_finished()
    stuck = not pending and (last is None or books.read_at - last >= STUCK_AFTER)
    double = sum(1 for group in by_component.values() if sum(r.outcome == BREAK_OUTCOME_BROKEN for r in group) > 1)
    outcomes: dict[str, int] = {}
    for resolution in resolutions:
        word = outcome_word(resolution)
        outcomes[word] = outcomes.get(word, 0) + 1
    elapsed: float = outcome["elapsed"]  # type: ignore[assignment]
    return {
        "deadlocks": len(by_component) + stuck,
        "resolved": resolved,
        "victim_aborteds": len(matched),  # one per deadlock resolved: the victim's caller's ABORTED
        "recoveries": len(recoveries),
        "recoveries_before_attach": before_attach,
        "recovery_p50_ms": ms(recoveries, None),
        "recovery_p99_ms": ms(recoveries, 0.99),
        "recovery_spread": spread([r * 1000 for r in recoveries], 1) if recoveries else None,
        **{f"recovery_{part}_p50_ms": ms(values, None) for part, values in parts.items()},
        **{f"recovery_{part}_p99_ms": ms(values, 0.99) for part, values in parts.items()},
        "double_breaks": double,
        "breaks_sent": len(resolutions),
        "break_outcomes": outcomes,
        "stuck_at_end": stuck,
        "scheduled_snapshots_per_s": round(1 / args.interval, 3),
        "snapshots_per_s": round(outcome["completed"] / elapsed, 2),  # type: ignore[operator]
        "hint_snapshots": outcome["hints"]["snapshot"],  # type: ignore[index]
        "hint_outcomes": outcome["hints"],
        "breaking_places": outcome["placed"],
        "breaking_seconds": round(elapsed, 2),
    }


# -- 2. churn --------------------------------------------------------------------------------------


async def churn(args: argparse.Namespace) -> dict[str, object]:
    """The churn workload with breaking on, until ``--churn-snapshots`` snapshots completed."""
    async with watched_shop("churn", args, interval=args.churn_interval, resolve="youngest", hints=True) as (
        detector,
        shop,
        _,
    ):
        placed_before = await asyncio.to_thread(shop.placed)
        before = metric(detector, "stablewatch_snapshots_total", outcome="completed")
        started = time.monotonic()
        completed = 0.0
        while completed < args.churn_snapshots and time.monotonic() - started < args.max_seconds:
            await asyncio.sleep(0.1)
            completed = metric(detector, "stablewatch_snapshots_total", outcome="completed") - before
        elapsed = time.monotonic() - started
        breaks = len(all_resolutions(detector))
        placed = await asyncio.to_thread(shop.placed) - placed_before
    return {
        "churn_snapshots": int(completed),
        "churn_breaks": breaks,
        "churn_snapshots_per_s": round(completed / elapsed, 2),
        "churn_interval": args.churn_interval,
        "churn_places": placed,
        "churn_seconds": round(elapsed, 2),
    }


# -- 3. detection alone ----------------------------------------------------------------------------


class Detection(NamedTuple):
    latency: float | None  # seconds from the last worker's block to the proving snapshot's end
    valid: bool  # the deadlock formed after the whole shop was attached


async def detect_once(args: argparse.Namespace, hints: bool, interval: float, phase: float) -> Detection:
    """One round: a fresh detector (no breaking) and deadlock shop; the time to the first proof."""
    books = Books()
    async with watched_shop("deadlock", args, interval=interval, resolve=None, hints=hints, phase=phase) as (
        detector,
        shop,
        attached,
    ):
        deadline = time.monotonic() + args.detect_timeout
        while not deadlock_holds(detector.latest()):
            if time.monotonic() > deadline:
                return Detection(None, True)
            await asyncio.sleep(0.02)
        await asyncio.to_thread(books.read, shop)
        first = first_deadlock(detector)
    if first is None:
        return Detection(None, True)
    blocked = books.last_block(first)
    if blocked is None:
        return Detection(None, True)
    return Detection(first - blocked, attached.at is not None and attached.at <= blocked)


def first_deadlock(detector: Detector) -> float | None:
    """The earliest finish (wall clock) of a complete snapshot whose deadlock is true."""
    earliest = None
    before = None
    while page := detector.store.list(1000, before_id=before):
        for summary in page:
            if summary.HasField("finished_at") and deadlock_holds(detector.store.results(summary.snapshot_id)):
                finished = seconds_of(summary.finished_at)
                earliest = finished if earliest is None else min(earliest, finished)
        before = page[-1].snapshot_id
    return earliest


async def detection(args: argparse.Namespace) -> tuple[dict[str, list[float]], int, int]:
    """Every case of DETECTION_CASES in interleaved rounds; per case the latencies, then retries and misses."""
    latencies: dict[str, list[float]] = {name: [] for name in DETECTION_CASES}
    retried = missed = 0
    rng = random.Random(args.seed)
    for number in range(args.detection_rounds):
        for name, (hints, interval) in DETECTION_CASES.items():
            for _ in range(args.detection_tries):
                # A random phase of the schedule, as a deadlock meets it in production.
                found = await detect_once(args, hints, interval, rng.uniform(0, interval))
                if found.valid:
                    break
                retried += 1
            if found.latency is None or not found.valid:
                missed += 1
            else:
                latencies[name].append(found.latency * 1000)
            shown = "missed" if found.latency is None else f"{found.latency * 1000:.1f} ms"
            print(f"detection round {number + 1}, {name}: {shown}", file=sys.stderr, flush=True)
    return latencies, retried, missed


# -- 4. what the hints cost a busy system ----------------------------------------------------------


class HintRound(NamedTuple):
    on: dict[str, float]  # case -> msgs/s, hints on
    off: dict[str, float]  # hints off
    hints: float  # hints the detector was sent per second of the hints-on pair's life
    hint_snapshots: float  # snapshots it took for them, per second


async def hint_cost(args: argparse.Namespace) -> list[HintRound]:
    """``channel_throughput.py``'s agent pair with hints on and off, in interleaved rounds."""
    import channel_throughput

    options = argparse.Namespace(seconds=args.hint_seconds, warmup=args.hint_warmup)
    phases = ["agent", "agent+snapshots", channel_throughput.AGAIN]
    rounds: list[HintRound] = []
    with tempfile.TemporaryDirectory(prefix="stablewatch-resolution-hints-") as name:
        # A whole detector, not the coordinator alone: a hint it is sent starts a snapshot, as it would
        # in production. It schedules none itself; the snapshot phases take their own.
        config = DetectorConfig(data_dir=Path(name), listen="127.0.0.1:0", metrics_port=None, interval=None)
        detector = Detector(config)
        await detector.start()
        try:
            for number in range(args.hint_rounds):
                rates: dict[bool, dict[str, float]] = {}
                hinted: dict[str, float] = {}
                # Alternate which pair goes first, so that a drift of the machine favours neither.
                for hints in (True, False) if number % 2 == 0 else (False, True):
                    before, started = hint_outcomes(detector), time.monotonic()
                    measured = await channel_throughput.run_pair(
                        "agent",
                        phases,
                        options,
                        detector.coordinator,
                        detector.address,
                        agent_options=() if hints else ("--no-hints",),
                    )
                    if hints:
                        seconds = time.monotonic() - started
                        hinted = {o: (n - before[o]) / seconds for o, n in hint_outcomes(detector).items()}
                    rates[hints] = {
                        "agent": (measured["agent"].rate + measured[channel_throughput.AGAIN].rate) / 2,
                        "agent+snapshots": measured["agent+snapshots"].rate,
                    }
                rounds.append(HintRound(rates[True], rates[False], sum(hinted.values()), hinted["snapshot"]))
                print(
                    f"hint cost round {number + 1}: hints on {rates[True]['agent']:,.0f}/s, "
                    f"off {rates[False]['agent']:,.0f}/s",
                    file=sys.stderr,
                    flush=True,
                )
        finally:
            quiet_teardown()
            await detector.stop()
    return rounds


def hint_figures(rounds: list[HintRound]) -> dict[str, object]:
    if not rounds:
        return {}
    ratios = [r.on["agent"] / r.off["agent"] for r in rounds]
    on_overheads = [1 - r.on["agent+snapshots"] / r.on["agent"] for r in rounds]
    off_overheads = [1 - r.off["agent+snapshots"] / r.off["agent"] for r in rounds]
    return {
        "hint_rounds": len(rounds),
        "agent_hints_on_msgs_per_s": round(statistics.median(r.on["agent"] for r in rounds)),
        "agent_hints_off_msgs_per_s": round(statistics.median(r.off["agent"] for r in rounds)),
        "hint_throughput_ratio": round(statistics.median(ratios), 4),
        "hint_throughput_ratio_spread": spread(ratios, 4),
        "snapshot_overhead_hints_on": round(statistics.median(on_overheads), 4),
        "snapshot_overhead_hints_on_spread": spread(on_overheads, 4),
        "snapshot_overhead_hints_off": round(statistics.median(off_overheads), 4),
        "snapshot_overhead_hints_off_spread": spread(off_overheads, 4),
        "hints_per_s": round(statistics.median(r.hints for r in rounds), 2),
        "hint_snapshots_per_s": round(statistics.median(r.hint_snapshots for r in rounds), 2),
    }


# -- the report ------------------------------------------------------------------------------------


def targets(figures: dict[str, object], args: argparse.Namespace) -> dict[str, bool]:
    p50, p99 = figures["recovery_p50_ms"], figures["recovery_p99_ms"]
    return {
        "resolved_equals_deadlocks": figures["resolved"] == figures["deadlocks"],
        "recovery_p50_at_most_100ms": p50 is not None and p50 <= 100,  # type: ignore[operator]
        "recovery_p99_at_most_300ms": p99 is not None and p99 <= 300,  # type: ignore[operator]
        "churn_breaks_zero": figures["churn_breaks"] == 0,
        "double_breaks_zero": figures["double_breaks"] == 0,
        "enough_deadlocks": figures["deadlocks"] >= args.deadlocks,  # type: ignore[operator]
        "enough_churn_snapshots": figures["churn_snapshots"] >= args.churn_snapshots,  # type: ignore[operator]
    }


def print_tables(
    console: Console,
    figures: dict[str, object],
    detections: dict[str, list[float]],
    hint_rounds: list[HintRound],
    args: argparse.Namespace,
) -> None:
    met = figures["targets"]
    table = Table(title=f"breaking the shop's deadlocks, snapshots scheduled every {args.interval:g} s, hints on")
    for column in ("figure", "value", "target", "met"):
        table.add_column(column, justify="right" if column != "figure" else "left")

    def row(label: str, key: str, target: str = "", verdict: str | None = None) -> None:
        mark = "" if verdict is None else ("yes" if met[verdict] else "MISSED")  # type: ignore[index]
        table.add_row(label, str(figures[key]), target, mark)

    row("deadlocks formed", "deadlocks", f">= {args.deadlocks}", "enough_deadlocks")
    row("resolved (BROKEN, then the victim's ABORTED)", "resolved", "= deadlocks", "resolved_equals_deadlocks")
    row("recovery p50 ms (last block -> ABORTED)", "recovery_p50_ms", "<= 100", "recovery_p50_at_most_100ms")
    row("recovery p99 ms", "recovery_p99_ms", "<= 300", "recovery_p99_at_most_300ms")
    row("recovery lowest, highest ms", "recovery_spread")
    row("  of which: to the proving snapshot's start, p50 ms", "recovery_start_p50_ms")
    row("                                       p99 ms", "recovery_start_p99_ms")
    row("  the proving snapshot, p50 ms", "recovery_snapshot_p50_ms")
    row("  from its end to the ABORTED, p50 ms", "recovery_break_p50_ms")
    row("deadlocks broken twice", "double_breaks", "0", "double_breaks_zero")
    row("breaks sent, by outcome", "break_outcomes")
    row("stuck at the end", "stuck_at_end")
    row("snapshots/s completed (scheduled + hinted)", "snapshots_per_s")
    row("hints, by what the detector did", "hint_outcomes")
    row("churn: snapshots (resolve on)", "churn_snapshots", f">= {args.churn_snapshots}", "enough_churn_snapshots")
    row("churn: breaks", "churn_breaks", "0", "churn_breaks_zero")
    row("churn: snapshots/s", "churn_snapshots_per_s")
    console.print(table)
    if all(detections.values()):
        rounds = min(len(v) for v in detections.values())
        detect = rounds_table("detection alone (no breaking): last worker blocked -> proof, ms", rounds)
        for name, values in detections.items():
            rounds_row(detect, name.replace("_", " ") + "/s", values[:rounds], ".1f")
        print_whole(detect, console.width)
    if hint_rounds:
        cost = rounds_table("what the hints cost: one agent channel at full speed, hints on and off", len(hint_rounds))
        rounds_row(cost, "agent msgs/s, hints on", [r.on["agent"] for r in hint_rounds], ",.0f")
        rounds_row(cost, "agent msgs/s, hints off", [r.off["agent"] for r in hint_rounds], ",.0f")
        rounds_row(cost, "hints on / off", [r.on["agent"] / r.off["agent"] for r in hint_rounds], ".3f")
        on = [1 - r.on["agent+snapshots"] / r.on["agent"] for r in hint_rounds]
        off = [1 - r.off["agent+snapshots"] / r.off["agent"] for r in hint_rounds]
        rounds_row(cost, "snapshot overhead, hints on", on, ".3f", "<= 0.05")
        rounds_row(cost, "snapshot overhead, hints off", off, ".3f")
        rounds_row(cost, "hints sent/s, hints on", [r.hints for r in hint_rounds], ".2f")
        rounds_row(cost, "snapshots taken for them/s", [r.hint_snapshots for r in hint_rounds], ".2f")
        print_whole(cost, console.width)


async def run(args: argparse.Namespace) -> dict[str, object]:
    figures = breaking_figures(await breaking(args), args)
    print(f"breaking: {figures['resolved']} of {figures['deadlocks']} deadlocks resolved", file=sys.stderr, flush=True)
    figures |= await churn(args)
    print(f"churn: {figures['churn_breaks']} breaks in {figures['churn_snapshots']} snapshots", file=sys.stderr)
    detections, retried, missed = await detection(args)
    for name, values in detections.items():
        figures[f"detect_{name}_p50_ms"] = round(statistics.median(values), 1) if values else None
        figures[f"detect_{name}_spread"] = spread(values, 1) if values else None
    figures["detect_rounds"] = args.detection_rounds
    figures["detect_retried"] = retried
    figures["detect_missed"] = missed
    hint_rounds = await hint_cost(args) if args.hint_rounds else []
    figures |= hint_figures(hint_rounds)
    figures["seed"] = args.seed
    figures["targets"] = targets(figures, args)
    figures["target_met"] = all(figures["targets"].values())  # type: ignore[union-attr]
    print_tables(Console(width=160), figures, detections, hint_rounds, args)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--deadlocks", type=int, default=30, help="deadlocks to break (30)")
    parser.add_argument("--interval", type=float, default=1.0, help="scheduled snapshots while breaking, seconds (1)")
    parser.add_argument("--churn-snapshots", type=int, default=1000, help="complete snapshots of the churn (1000)")
    parser.add_argument("--churn-interval", type=float, default=0.02, help="seconds between churn snapshots (0.02)")
    parser.add_argument("--detection-rounds", type=int, default=5, help="rounds of each detection case (5)")
    parser.add_argument("--detection-tries", type=int, default=3, help="tries of a round the shop raced (3)")
    parser.add_argument("--detect-timeout", type=float, default=30.0, help="seconds to wait for a proof (30)")
    parser.add_argument("--hint-rounds", type=int, default=3, help="rounds of the hints' cost (3; 0: skip)")
    parser.add_argument("--hint-seconds", type=float, default=5.0, help="seconds measured per phase (5)")
    parser.add_argument("--hint-warmup", type=float, default=2.0, help="seconds before measuring a pair (2)")
    parser.add_argument("--max-concurrent", type=int, default=2, help="scheduled snapshots at once (2)")
    parser.add_argument("--deadline", type=float, default=2.0, help="snapshot deadline, seconds (2)")
    parser.add_argument("--settle", type=float, default=1.0, help="seconds for the last breaks to finish (1)")
    parser.add_argument(
        "--stuck-seconds", type=float, default=15.0, help="end breaking after this long without one (15)"
    )
    parser.add_argument("--max-seconds", type=float, default=600, help="give up on a part after this long (600)")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    figures = asyncio.run(run(args))
    json_line(figures)
    if figures["churn_breaks"]:
        sys.exit(1)  # a wait broken in a system that never deadlocks: a bug


if __name__ == "__main__":
    main()
