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

    python bench/channel_throughput.py [--seconds 10] [--warmup 2] [--rounds 5]

A full run takes about (3 x warm-up + 5 x seconds + 9) x rounds seconds: about 5 minutes by default.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time

import grpc
from child import Child, emit
from coordinator import attached, served_coordinator, stop_snapshots, take_snapshots
from report import json_line, rounds_row, rounds_table, spread

from stablewatch.agents import Agent, AppMessage
from stablewatch.agents.breaking import DEFAULT_HINT_AFTER
from stablewatch.detector.service.coordinator import Coordinator
from stablewatch.v1 import ChannelAck, ChannelFrame, channel_pb2_grpc

PAYLOAD = b"x" * 64
FRAME_ENTRIES = 512
REPORT_EVERY = 0.1  # seconds between the receiver's delivery counts
CASES = ("raw", "agent", "agent+snapshots", "agent batches")
AGAIN = "agent, again"  # the third phase of the agent pair (A-S-A)


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
    """One case of one round: steady-state throughput, and the snapshots that ran meanwhile."""

    def __init__(self, rate: float, seconds: float, snapshots: int, detector_cpu: float) -> None:
        self.rate = rate
        self.seconds = seconds
        self.snapshots = snapshots
        self.detector_cpu = detector_cpu


async def run_pair(
    kind: str,
    phases: list[str],
    args: argparse.Namespace,
    coordinator: Coordinator,
    detector: str,
    sender_options: tuple[str, ...] = (),
    agent_options: tuple[str, ...] = (),
) -> dict[str, Measured]:
    """One sender/receiver pair of ``kind`` (raw or agent), measured in ``phases`` back to back.

    Each phase is ``args.seconds`` of steady state: the first after ``args.warmup``, the next after
    a settling second. The agent cases are phases of one pair (snapshots off, then on, or the
    other way round), so they differ only in the snapshots: not in the processes or where the
    operating system put them, which moves a 10-second figure by more than the overhead sought.
    ``agent_options`` go to both processes of an agent pair (``--no-hints``: the agents' hints off).
    """
    with_detector = [] if kind == "raw" else ["--detector", detector, *agent_options]
    receiver = await Child.start(__file__, f"{kind}-receiver", *with_detector)
    sender = None
    measured: dict[str, Measured] = {}
    try:
        address = (await receiver.read())["address"]
        sender = await Child.start(__file__, f"{kind}-sender", "--peer", str(address), *with_detector, *sender_options)
        await sender.read()  # ready
        if kind == "agent":
            await attached(coordinator, {"sender", "receiver"})
        sender.write("go\n")
        settle = float((await sender.read())["start"]) + args.warmup
        for case in phases:
            finished: list[float] = []
            snapshots = None
            if case == "agent+snapshots":
                snapshots = asyncio.ensure_future(take_snapshots(coordinator, finished))
            try:
                first = await count_at(receiver, settle)
                cpu_before = time.process_time()
                last = await count_at(receiver, first[0] + args.seconds)
                detector_cpu = (time.process_time() - cpu_before) / (last[0] - first[0])
            finally:
                if snapshots is not None:
                    await stop_snapshots(snapshots)
            completed = sum(first[0] <= t <= last[0] for t in finished)
            seconds = last[0] - first[0]
            measured[case] = Measured((last[1] - first[1]) / seconds, seconds, completed, detector_cpu)
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


async def orchestrate(args: argparse.Namespace) -> None:
    rounds: list[dict[str, Measured]] = []
    async with served_coordinator() as (coordinator, detector):
        for number in range(args.rounds):
            measured: dict[str, Measured] = {}
            if "raw" in args.cases:
                measured.update(await run_pair("raw", ["raw"], args, coordinator, detector))
            agent_phases = [case for case in ("agent", "agent+snapshots") if case in args.cases]
            if agent_phases == ["agent", "agent+snapshots"]:
                # A-S-A: the windows before and after the snapshots' average out the pair's drift.
                pair = await run_pair("agent", [*agent_phases, AGAIN], args, coordinator, detector)
                before, after = pair.pop("agent"), pair.pop(AGAIN)
                rate = (before.rate + after.rate) / 2
                measured.update(pair, agent=Measured(rate, before.seconds + after.seconds, 0, before.detector_cpu))
            elif agent_phases:
                measured.update(await run_pair("agent", agent_phases, args, coordinator, detector))
            if "agent batches" in args.cases:
                batches = await run_pair("agent", ["agent batches"], args, coordinator, detector, ("--batch",))
                measured.update(batches)
            rounds.append(measured)
            rates = ", ".join(f"{case} {m.rate:,.0f}/s" for case, m in measured.items())
            print(f"round {number + 1}/{args.rounds}: {rates}", file=sys.stderr, flush=True)
    if set(args.cases) == set(CASES):
        report(args, rounds)


def report(args: argparse.Namespace, rounds: list[dict[str, Measured]]) -> None:
    from rich.console import Console

    rates = {case: [r[case].rate for r in rounds] for case in CASES}
    median = {case: statistics.median(values) for case, values in rates.items()}
    ratios = [r["agent"].rate / r["raw"].rate for r in rounds]
    batch_ratios = [r["agent batches"].rate / r["raw"].rate for r in rounds]
    overheads = [1 - r["agent+snapshots"].rate / r["agent"].rate for r in rounds]
    snapshot_seconds = sum(r["agent+snapshots"].seconds for r in rounds)
    snapshots = sum(r["agent+snapshots"].snapshots for r in rounds)
    ratio, overhead = statistics.median(ratios), statistics.median(overheads)

    table = rounds_table(
        f"64-byte messages, one channel, 2 processes: {args.rounds} interleaved rounds of "
        f"{args.seconds:g} s per case after {args.warmup:g} s of warm-up",
        len(rounds),
    )
    for case in CASES:
        rounds_row(table, f"{case} msgs/s", rates[case], ",.0f")
    rounds_row(table, "agent / raw", ratios, ".3f", ">= 0.8")
    rounds_row(table, "agent batches / raw", batch_ratios, ".3f")
    rounds_row(table, "snapshot overhead", overheads, ".3f", "<= 0.05")
    rounds_row(table, "detector CPU (snapshots)", [r["agent+snapshots"].detector_cpu for r in rounds], ".1%")
    snapshot_rates = [r["agent+snapshots"].snapshots / r["agent+snapshots"].seconds for r in rounds]
    rounds_row(table, "snapshots/s completed", snapshot_rates, ".1f", "10 asked", snapshots / snapshot_seconds)
    Console().print(table)
    json_line(
        {
            "seconds": args.seconds,
            "warmup": args.warmup,
            "rounds": args.rounds,
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
            "targets": {
                "ratio_at_least_0.8": ratio >= 0.8,
                "agent_at_least_200k": median["agent"] >= 200_000,
                "overhead_at_most_0.05": overhead <= 0.05,
            },
        }
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="steady-state seconds measured per case")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds of each case before measuring")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--cases",
        type=lambda text: text.split(","),
        default=list(CASES),
        help="comma-separated cases to run (all three for the table and the JSON line; fewer to profile one)",
    )
    parser.add_argument("--role", choices=sorted(ROLES), help=argparse.SUPPRESS)
    parser.add_argument("--peer", help=argparse.SUPPRESS)
    parser.add_argument("--detector", help=argparse.SUPPRESS)
    parser.add_argument("--batch", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--no-hints", action="store_true", help=argparse.SUPPRESS)  # the agents' hints off
    args = parser.parse_args()
    asyncio.run(ROLES[args.role](args) if args.role else orchestrate(args))


if __name__ == "__main__":
    main()
