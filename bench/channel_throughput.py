"""Benchmark: one agent channel between two OS processes against a raw grpc.aio stream, same run.

Four cases, each a sender process and a receiver process on 127.0.0.1 moving 64-byte messages
that the receiver hands, one at a time, to a handler:

* ``raw``: a bare grpc.aio bidirectional stream carrying frames of up to 512 payloads (the agent's
  frame size), acknowledged per frame, with the same per-message handler call;
* ``agent``: an :class:`~stablewatch.agents.Agent` channel, one ``await send`` per message, both
  agents attached to a detector (this process) that takes no snapshot;
* ``agent+snapshots``: the ``agent`` case while the detector takes snapshots on its own schedule,
  every 0.1 s (10 a second, at most 2 at once: the detector's defaults for ``--interval 0.1``);
* ``agent batches``: an agent channel whose sender hands the agent batches of 512 messages
  (``Agent.send_many``), as the raw sender hands gRPC frames of 512.

The sender sends as fast as the channel takes messages until it is told to stop. The receiver
reports its delivery count every 0.1 s; a case's throughput is the deliveries between the first
report after ``--warmup`` seconds and the first report ``--seconds`` later, over that time: the
steady state, without start-up or the drain at the end.

The cases run in interleaved rounds, ``--rounds`` times, so that the machine's noise hits every
case alike. In each round, ``raw`` and ``agent batches`` run on process pairs of their own;
``agent`` and ``agent+snapshots`` are phases of one agent pair, back to back, as A-S-A: agent,
agent with snapshots, agent again. Two fresh pairs of processes differ by more, from where the
operating system puts them, than the overhead being measured, and one pair's consecutive
10-second windows still differ by a few percent and drift: so the round's ``agent`` rate is the
mean of the two windows around the snapshots' one, which cancels a steady drift instead of
charging it to whichever phase came second. Ratios and the overhead are computed per round (the
cases of one round ran side by side) and summarized by their median and their spread (lowest
and highest round). The table
shows every round. The last line is one JSON object: ``raw_msgs_per_s``, ``agent_msgs_per_s``,
``with_snapshots_msgs_per_s``, ``batch_msgs_per_s`` (medians over rounds); ``ratio`` (agent /
raw), ``batch_ratio`` (agent batches / raw) and ``snapshot_overhead`` (1 - with / without
snapshots) as medians of the per-round values, with ``ratio_spread``, ``batch_ratio_spread`` and
``snapshot_overhead_spread`` ([lowest, highest]); ``*_spread`` for each case's throughput;
``snapshots_completed`` and ``snapshots_per_s`` (what the detector achieved while measured); and
the ``targets``: ratio >= 0.8, agent >= 200 000 messages/s, overhead <= 0.05.

``--detectors 2`` weighs two detectors side by side (issue 26) against one: a second detector
(replica 1, its own id space) is served in this process too, both agents attach to both, and the
agent pair gains a phase, ``agent+2 detectors``: each detector takes 5 snapshots a second on its
own schedule (the second's started half an interval after the first's, so the agents see 10 a
second, spread as one detector's would be; the ``agent+snapshots`` phase is one detector at 10 a
second, the other attached and idle). The pair runs A-S-A-S-A, each snapshot phase between two
agent windows, the two snapshot phases swapping places from round to round; each phase's overhead
is taken against the mean of the two windows around it. The JSON line gains ``detectors``,
``two_detectors_msgs_per_s`` (with ``two_detectors_spread``), ``overhead_one_at_10`` and
``overhead_two_at_5`` (medians, with ``*_spread``), ``ratio_one_at_10`` and ``ratio_two_at_5``
(each snapshot phase / raw), ``overhead_gap_points`` (two at 5 minus one at 10, in percentage
points, computed per round; with its spread), ``two_at_5_snapshots_per_s`` (both detectors) and
``two_at_5_snapshots_per_s_each``, and the target ``overhead_gap_within_2_points``.

    python bench/channel_throughput.py [--seconds 10] [--warmup 2] [--rounds 5] [--detectors 1|2]

A full run takes about (3 x warm-up + 5 x seconds + 9) x rounds seconds: about 5 minutes by
default; with ``--detectors 2``, (3 x warm-up + 7 x seconds + 11) x rounds: about 7 minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import time
from typing import TYPE_CHECKING

import grpc
from child import Child, emit
from coordinator import attached, served_coordinator, stop_snapshots, take_snapshots
from report import json_line, print_whole, rounds_row, rounds_table, spread

from stablewatch.agents import Agent, AppMessage
from stablewatch.agents.breaking import DEFAULT_HINT_AFTER
from stablewatch.detector.service.coordinator import Coordinator
from stablewatch.v1 import ChannelAck, ChannelFrame, channel_pb2_grpc

if TYPE_CHECKING:
    from rich.table import Table

PAYLOAD = b"x" * 64
FRAME_ENTRIES = 512
REPORT_EVERY = 0.1  # seconds between the receiver's delivery counts
CASES = ("raw", "agent", "agent+snapshots", "agent batches")
TWO_DETECTORS = "agent+2 detectors"  # with --detectors 2: two detectors at 5 snapshots/s each
AGAIN = "agent, again"  # the third phase of the agent pair (A-S-A)
THIRD = "agent, third"  # with --detectors 2: the fifth phase of the agent pair (A-S-A-S-A)
#: The snapshot phases: each detector's snapshots per second (the first detector's first).
SCHEDULES: dict[str, tuple[float, ...]] = {"agent+snapshots": (10,), TWO_DETECTORS: (5, 5)}


async def wait_for_stdin_close() -> None:
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)


class Counter:
    """The receiving application: counts deliveries."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, *_: object) -> None:
        self.count += 1


async def report_counts(counter: Counter) -> None:
    """Print the delivery count, with the time, every REPORT_EVERY seconds until cancelled."""
    while True:
        emit(t=time.monotonic(), count=counter.count)
        await asyncio.sleep(REPORT_EVERY)


async def receive_until_closed(counter: Counter) -> None:
    reporter = asyncio.ensure_future(report_counts(counter))
    await wait_for_stdin_close()
    reporter.cancel()


async def wait_for_go() -> None:
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)


# -- the four roles, each in its own process -------------------------------------------------------


def hint_after(args: argparse.Namespace) -> float | None:
    """The agents' long-wait hint threshold: the default, or none with ``--no-hints``."""
    return None if args.no_hints else DEFAULT_HINT_AFTER


async def agent_receiver(args: argparse.Namespace) -> None:
    counter = Counter()
    agent = Agent("receiver", detector=args.detector, handler=counter, hint_after=hint_after(args))
    await agent.start()
    emit(address=agent.address)
    await receive_until_closed(counter)
    await agent.stop()


async def agent_sender(args: argparse.Namespace) -> None:
    agent = Agent("sender", peers={"receiver": args.peer}, detector=args.detector, hint_after=hint_after(args))
    await agent.start()
    emit(ready=True)
    await wait_for_go()
    stopping = asyncio.ensure_future(wait_for_stdin_close())
    emit(start=time.monotonic())
    if args.batch:  # queue messages the way the raw case does, and hand the agent the batch
        send_many = agent.send_many
        while not stopping.done():
            pending: list[bytes] = []
            for _ in range(FRAME_ENTRIES):
                pending.append(PAYLOAD)
            await send_many("receiver", pending)
    else:
        send = agent.send
        while not stopping.done():
            for _ in range(FRAME_ENTRIES):  # check for the stop only now and then
                await send("receiver", PAYLOAD)
    await agent.stop()


class RawReceiver(channel_pb2_grpc.PeerServicer):
    def __init__(self, handler: Counter) -> None:
        self.handler = handler

    async def Channel(self, request_iterator, context):
        handler = self.handler
        next_seq = 0
        async for frame in request_iterator:
            for payload in frame.payloads:
                handler("sender", AppMessage(payload))
            next_seq = frame.first_seq + len(frame.payloads)
            yield ChannelAck(next_seq=next_seq)


async def raw_receiver(args: argparse.Namespace) -> None:
    counter = Counter()
    server = grpc.aio.server()
    channel_pb2_grpc.add_PeerServicer_to_server(RawReceiver(counter), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    emit(address=f"127.0.0.1:{port}")
    await receive_until_closed(counter)
    await server.stop(0)


async def raw_sender(args: argparse.Namespace) -> None:
    """Queue messages the way an application would, and stream them in frames."""
    async with grpc.aio.insecure_channel(args.peer) as channel:
        call = channel_pb2_grpc.PeerStub(channel).Channel()
        emit(ready=True)
        await wait_for_go()
        stopping = asyncio.ensure_future(wait_for_stdin_close())
        emit(start=time.monotonic())
        acks = asyncio.ensure_future(_drain(call))
        sent = 0
        while not stopping.done():
            pending: list[bytes] = []
            for _ in range(FRAME_ENTRIES):
                pending.append(PAYLOAD)
            await call.write(ChannelFrame(first_seq=sent, payloads=pending))
            sent += len(pending)
        acks.cancel()
        call.cancel()


async def _drain(call: grpc.aio.StreamStreamCall) -> None:
    async for _ in call:
        pass


ROLES = {
    "agent-receiver": agent_receiver,
    "agent-sender": agent_sender,
    "raw-receiver": raw_receiver,
    "raw-sender": raw_sender,
}


# -- the orchestrator --------------------------------------------------------------------------------


class Measured:
    """One case of one round: steady-state throughput, and the snapshots that ran meanwhile.

    ``by_detector`` counts the snapshots completed by each detector that took some; ``baseline`` is
    the agent pair's rate without snapshots in the windows around a snapshot phase (None: not set).
    """

    def __init__(
        self,
        rate: float,
        seconds: float,
        snapshots: int,
        detector_cpu: float,
        by_detector: tuple[int, ...] = (),
        baseline: float | None = None,
    ) -> None:
        self.rate = rate
        self.seconds = seconds
        self.snapshots = snapshots
        self.detector_cpu = detector_cpu
        self.by_detector = by_detector
        self.baseline = baseline

    @property
    def overhead(self) -> float:
        """1 - this phase's rate / the agent windows' around it: what the snapshots cost."""
        assert self.baseline is not None, "a snapshot phase measured without agent windows around it"
        return 1 - self.rate / self.baseline


async def snapshots_later(coordinator: Coordinator, completed: list[float], per_second: float, delay: float) -> None:
    """:func:`take_snapshots` at ``per_second``, its schedule started ``delay`` seconds from now.

    Two detectors' schedulers started together with the same seed would tick together; starting
    the second half an interval late spreads their snapshots as one detector's at twice the rate.
    """
    await asyncio.sleep(delay)
    await take_snapshots(coordinator, completed, per_second)


async def run_pair(
    kind: str,
    phases: list[str],
    args: argparse.Namespace,
    coordinator: Coordinator,
    detector: str,
    sender_options: tuple[str, ...] = (),
    agent_options: tuple[str, ...] = (),
    second: Coordinator | None = None,
) -> dict[str, Measured]:
    """One sender/receiver pair of ``kind`` (raw or agent), measured in ``phases`` back to back.

    Each phase is ``args.seconds`` of steady state: the first after ``args.warmup``, the next after
    a settling second. The agent cases are phases of one pair (snapshots off, then on, or the
    other way round), so they differ only in the snapshots: not in the processes or where the
    operating system put them, which moves a 10-second figure by more than the overhead sought.
    ``agent_options`` go to both processes of an agent pair (``--no-hints``: the agents' hints off).
    ``second``: a second detector's coordinator, for the ``agent+2 detectors`` phase (``detector``
    then names both, comma-separated, and the agents attach to both).
    """
    with_detector = [] if kind == "raw" else ["--detector", detector, *agent_options]
    coordinators = [coordinator] if second is None else [coordinator, second]
    receiver = await Child.start(__file__, f"{kind}-receiver", *with_detector)
    sender = None
    measured: dict[str, Measured] = {}
    try:
        address = (await receiver.read())["address"]
        sender = await Child.start(__file__, f"{kind}-sender", "--peer", str(address), *with_detector, *sender_options)
        await sender.read()  # ready
        if kind == "agent":
            for each in coordinators:
                await attached(each, {"sender", "receiver"})
        sender.write("go\n")
        settle = float((await sender.read())["start"]) + args.warmup
        for case in phases:
            rates = SCHEDULES.get(case, ())
            if len(rates) > len(coordinators):
                raise ValueError(f"{case!r} needs {len(rates)} detectors")
            finished: list[list[float]] = [[] for _ in rates]
            # The i-th of n detectors at the same rate starts i/n of an interval late (see snapshots_later).
            snapshots = [
                asyncio.ensure_future(snapshots_later(each, done, rate, number / (len(rates) * rate)))
                for number, (each, done, rate) in enumerate(zip(coordinators, finished, rates, strict=False))
            ]
            try:
                first = await count_at(receiver, settle)
                cpu_before = time.process_time()
                last = await count_at(receiver, first[0] + args.seconds)
                detector_cpu = (time.process_time() - cpu_before) / (last[0] - first[0])
            finally:
                for task in snapshots:
                    await stop_snapshots(task)
            by_detector = tuple(sum(first[0] <= t <= last[0] for t in done) for done in finished)
            seconds = last[0] - first[0]
            rate = (last[1] - first[1]) / seconds
            measured[case] = Measured(rate, seconds, sum(by_detector), detector_cpu, by_detector)
            settle = time.monotonic() + 1.0  # the last snapshots finish, the pipeline refills
        return measured
    finally:
        for child in (sender, receiver):
            if child is not None:
                await child.close()


async def count_at(receiver: Child, moment: float) -> tuple[float, int]:
    """The receiver's first (time, count) report at or after ``moment``."""
    while True:
        report = await receiver.read(timeout=60)
        if float(report["t"]) >= moment:
            return float(report["t"]), int(report["count"])


def agent_windows(pair: dict[str, Measured], order: list[str]) -> dict[str, Measured]:
    """An A-S-A(-S-A) pair's figures: each snapshot phase with the mean of the agent windows around
    it as its baseline (a steady drift of the pair cancels), and ``agent`` the mean of them all.

    ``order`` is the phases as run: agent windows and snapshot phases alternating, agent first.
    """
    windows = [pair.pop(case) for case in order[::2]]
    for number, case in enumerate(order[1::2]):
        pair[case].baseline = (windows[number].rate + windows[number + 1].rate) / 2
    rate = statistics.mean(window.rate for window in windows)
    seconds = sum(window.seconds for window in windows)
    return {"agent": Measured(rate, seconds, 0, windows[0].detector_cpu), **pair}


async def orchestrate(args: argparse.Namespace) -> None:
    rounds: list[dict[str, Measured]] = []
    async with contextlib.AsyncExitStack() as stack:
        coordinator, detector = await stack.enter_async_context(served_coordinator())
        second = None
        if args.detectors == 2:
            second, second_address = await stack.enter_async_context(served_coordinator(id_space=1))
            detector = f"{detector},{second_address}"
        for number in range(args.rounds):
            measured: dict[str, Measured] = {}
            if "raw" in args.cases:
                measured.update(await run_pair("raw", ["raw"], args, coordinator, detector))
            snapshot_phases = [case for case in ("agent+snapshots", TWO_DETECTORS) if case in args.cases]
            if "agent" in args.cases and snapshot_phases:
                # A-S-A (or A-S-A-S-A): the windows before and after each snapshot phase average out
                # the pair's drift; two snapshot phases swap places from round to round.
                if number % 2:
                    snapshot_phases.reverse()
                order = ["agent", snapshot_phases[0], AGAIN]
                if len(snapshot_phases) == 2:
                    order += [snapshot_phases[1], THIRD]
                pair = await run_pair("agent", order, args, coordinator, detector, second=second)
                measured.update(agent_windows(pair, order))
            else:
                agent_phases = [case for case in ("agent", *snapshot_phases) if case in args.cases]
                if agent_phases:
                    measured.update(await run_pair("agent", agent_phases, args, coordinator, detector, second=second))
            if "agent batches" in args.cases:
                batches = await run_pair(
                    "agent", ["agent batches"], args, coordinator, detector, ("--batch",), second=second
                )
                measured.update(batches)
            rounds.append(measured)
            rates = ", ".join(f"{case} {m.rate:,.0f}/s" for case, m in measured.items())
            print(f"round {number + 1}/{args.rounds}: {rates}", file=sys.stderr, flush=True)
    if set(args.cases) == set(all_cases(args.detectors)):
        report(args, rounds)


def all_cases(detectors: int) -> tuple[str, ...]:
    """Every case of a run with ``detectors`` detectors: what the table and the JSON line need."""
    return CASES if detectors == 1 else (*CASES, TWO_DETECTORS)


def report(args: argparse.Namespace, rounds: list[dict[str, Measured]]) -> None:
    cases = all_cases(args.detectors)
    rates = {case: [r[case].rate for r in rounds] for case in cases}
    median = {case: statistics.median(values) for case, values in rates.items()}
    ratios = [r["agent"].rate / r["raw"].rate for r in rounds]
    batch_ratios = [r["agent batches"].rate / r["raw"].rate for r in rounds]
    overheads = [r["agent+snapshots"].overhead for r in rounds]
    snapshot_seconds = sum(r["agent+snapshots"].seconds for r in rounds)
    snapshots = sum(r["agent+snapshots"].snapshots for r in rounds)
    ratio, overhead = statistics.median(ratios), statistics.median(overheads)

    table = rounds_table(
        f"64-byte messages, one channel, 2 processes: {args.rounds} interleaved rounds of "
        f"{args.seconds:g} s per case after {args.warmup:g} s of warm-up"
        + (", agents attached to 2 detectors" if args.detectors == 2 else ""),
        len(rounds),
    )
    for case in cases:
        rounds_row(table, f"{case} msgs/s", rates[case], ",.0f")
    rounds_row(table, "agent / raw", ratios, ".3f", ">= 0.8")
    rounds_row(table, "agent batches / raw", batch_ratios, ".3f")
    rounds_row(table, "snapshot overhead", overheads, ".3f", "<= 0.05")
    rounds_row(table, "detector CPU (snapshots)", [r["agent+snapshots"].detector_cpu for r in rounds], ".1%")
    snapshot_rates = [r["agent+snapshots"].snapshots / r["agent+snapshots"].seconds for r in rounds]
    rounds_row(table, "snapshots/s completed", snapshot_rates, ".1f", "10 asked", snapshots / snapshot_seconds)
    two = two_detector_figures(rounds, table) if args.detectors == 2 else {}
    print_whole(table, 100)
    json_line(
        {
            "seconds": args.seconds,
            "warmup": args.warmup,
            "rounds": args.rounds,
            "detectors": args.detectors,
            "raw_msgs_per_s": round(median["raw"]),
            "agent_msgs_per_s": round(median["agent"]),
            "with_snapshots_msgs_per_s": round(median["agent+snapshots"]),
            "raw_spread": spread(rates["raw"]),
            "agent_spread": spread(rates["agent"]),
            "with_snapshots_spread": spread(rates["agent+snapshots"]),
            "batch_msgs_per_s": round(median["agent batches"]),
            "batch_spread": spread(rates["agent batches"]),
            "batch_ratio": round(statistics.median(batch_ratios), 4),
            "batch_ratio_spread": spread(batch_ratios, 4),
            "ratio": round(ratio, 4),
            "ratio_spread": spread(ratios, 4),
            "snapshot_overhead": round(overhead, 4),
            "snapshot_overhead_spread": spread(overheads, 4),
            "snapshots_completed": snapshots,
            "snapshots_per_s": round(snapshots / snapshot_seconds, 2),
            **{key: value for key, value in two.items() if key != "targets"},
            "targets": {
                "ratio_at_least_0.8": ratio >= 0.8,
                "agent_at_least_200k": median["agent"] >= 200_000,
                "overhead_at_most_0.05": overhead <= 0.05,
                **two.get("targets", {}),
            },
        }
    )


def two_detector_figures(rounds: list[dict[str, Measured]], table: Table) -> dict[str, object]:
    """One detector at 10 snapshots/s against two at 5/s each: rows of ``table``, and the JSON keys.

    The gap (two at 5 minus one at 10, in percentage points) is taken within each round, where the
    two phases ran on the same pair of processes between the same agent windows.
    """
    one = [r["agent+snapshots"] for r in rounds]
    two = [r[TWO_DETECTORS] for r in rounds]
    one_overheads = [m.overhead for m in one]
    two_overheads = [m.overhead for m in two]
    gaps = [100 * (b - a) for a, b in zip(one_overheads, two_overheads, strict=True)]
    gap = statistics.median(gaps)
    seconds = sum(m.seconds for m in two)
    each = [sum(m.by_detector[n] for m in two) / seconds for n in range(2)]
    rounds_row(table, "overhead, 2 detectors at 5/s", two_overheads, ".3f")
    rounds_row(table, "detector CPU (2 detectors)", [m.detector_cpu for m in two], ".1%")
    rounds_row(table, "gap, 2 at 5/s - 1 at 10/s (points)", gaps, "+.2f", "|gap| <= 2")
    two_rates = [m.snapshots / m.seconds for m in two]
    rounds_row(table, "snapshots/s completed, 2 detectors", two_rates, ".1f", "5 + 5 asked", sum(each))
    raw = [r["raw"].rate for r in rounds]
    return {
        "two_detectors_msgs_per_s": round(statistics.median(m.rate for m in two)),
        "two_detectors_spread": spread([m.rate for m in two]),
        "overhead_one_at_10": round(statistics.median(one_overheads), 4),
        "overhead_one_at_10_spread": spread(one_overheads, 4),
        "overhead_two_at_5": round(statistics.median(two_overheads), 4),
        "overhead_two_at_5_spread": spread(two_overheads, 4),
        "ratio_one_at_10": round(statistics.median(m.rate / r for m, r in zip(one, raw, strict=True)), 4),
        "ratio_two_at_5": round(statistics.median(m.rate / r for m, r in zip(two, raw, strict=True)), 4),
        "overhead_gap_points": round(gap, 2),
        "overhead_gap_points_spread": spread(gaps, 2),
        "two_at_5_snapshots_per_s": round(sum(each), 2),
        "two_at_5_snapshots_per_s_each": [round(value, 2) for value in each],
        "targets": {"overhead_gap_within_2_points": abs(gap) <= 2},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="steady-state seconds measured per case")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds of each case before measuring")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--cases",
        type=lambda text: text.split(","),
        help="comma-separated cases to run (all of them for the table and the JSON line; fewer to profile one)",
    )
    parser.add_argument(
        "--detectors",
        type=int,
        choices=(1, 2),
        default=1,
        help=f"2: agents attach to two detectors, and the case {TWO_DETECTORS!r} (5 snapshots/s each) is added",
    )
    parser.add_argument("--role", choices=sorted(ROLES), help=argparse.SUPPRESS)
    parser.add_argument("--peer", help=argparse.SUPPRESS)
    parser.add_argument("--detector", help=argparse.SUPPRESS)
    parser.add_argument("--batch", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--no-hints", action="store_true", help=argparse.SUPPRESS)  # the agents' hints off
    args = parser.parse_args()
    if args.cases is None:
        args.cases = list(all_cases(args.detectors))
    if TWO_DETECTORS in args.cases and args.detectors != 2:
        parser.error(f"the case {TWO_DETECTORS!r} needs --detectors 2")
    asyncio.run(ROLES[args.role](args) if args.role else orchestrate(args))


if __name__ == "__main__":
    main()
