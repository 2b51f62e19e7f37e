"""Benchmark: one agent channel between two OS processes against a raw grpc.aio stream, same run.

Three cases, each a sender process and a receiver process on 127.0.0.1 moving 64-byte messages
that the receiver hands, one at a time, to a handler:

* ``raw``: a bare grpc.aio bidirectional stream carrying frames of up to 512 payloads (the agent's
  frame size), acknowledged per frame, with the same per-message handler call;
* ``agent``: an :class:`~stablewatch.agents.Agent` channel, both agents attached to a detector
  (this process) that takes no snapshot;
* ``agent+snapshots``: the same while the detector takes 10 snapshots a second.

Throughput is messages over the time from the sender's start to the receiver's last delivery.
The cases run interleaved, ``--rounds`` times; the table shows each median. The last line is one
JSON object: ``agent_msgs_per_s``, ``raw_msgs_per_s``, ``ratio`` (agent / raw),
``with_snapshots_msgs_per_s`` and ``snapshot_overhead`` (1 - with / without).

    python bench/channel_throughput.py [--messages 300000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

import grpc

from stablewatch.agents import Agent, AppMessage
from stablewatch.detector.service.coordinator import Coordinator, SnapshotAborted
from stablewatch.v1 import ChannelAck, ChannelFrame, channel_pb2_grpc, control_pb2_grpc

PAYLOAD = b"x" * 64
FRAME_ENTRIES = 512


def emit(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


async def wait_for_stdin_close() -> None:
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)


class Counter:
    """The receiving application: counts deliveries and reports the moment the last one arrives."""

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.count = 0

    def __call__(self, *_: object) -> None:
        self.count += 1
        if self.count == self.expected:
            emit(done=time.monotonic())


# -- the four roles, each in its own process -------------------------------------------------------


async def agent_receiver(args: argparse.Namespace) -> None:
    counter = Counter(args.messages)
    agent = Agent("receiver", detector=args.detector, handler=counter)
    await agent.start()
    emit(address=agent.address)
    await wait_for_stdin_close()
    await agent.stop()


async def agent_sender(args: argparse.Namespace) -> None:
    agent = Agent("sender", peers={"receiver": args.peer}, detector=args.detector)
    await agent.start()
    emit(ready=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    emit(start=time.monotonic())
    if args.try_send:  # the non-waiting call, awaiting only when the window is full
        try_send, send = agent.try_send, agent.send
        for _ in range(args.messages):
            if not try_send("receiver", PAYLOAD):
                await send("receiver", PAYLOAD)
    else:
        send = agent.send
        for _ in range(args.messages):
            await send("receiver", PAYLOAD)
    await wait_for_stdin_close()
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
    server = grpc.aio.server()
    channel_pb2_grpc.add_PeerServicer_to_server(RawReceiver(Counter(args.messages)), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    emit(address=f"127.0.0.1:{port}")
    await wait_for_stdin_close()
    await server.stop(0)


async def raw_sender(args: argparse.Namespace) -> None:
    """Queue every message the way an application would, and stream them in frames."""
    async with grpc.aio.insecure_channel(args.peer) as channel:
        call = channel_pb2_grpc.PeerStub(channel).Channel()
        emit(ready=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        emit(start=time.monotonic())
        pending: list[bytes] = []
        acks = asyncio.ensure_future(_drain(call))
        sent = 0
        for _ in range(args.messages):
            pending.append(PAYLOAD)
            if len(pending) == FRAME_ENTRIES:
                await call.write(ChannelFrame(first_seq=sent, payloads=pending))
                sent += len(pending)
                pending = []
        if pending:
            await call.write(ChannelFrame(first_seq=sent, payloads=pending))
        await wait_for_stdin_close()
        acks.cancel()


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


class Child:
    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process

    @classmethod
    async def start(cls, role: str, *extra: str) -> Child:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            __file__,
            "--role",
            role,
            *extra,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        return cls(process)

    async def read(self, timeout: float = 120) -> dict[str, object]:
        assert self.process.stdout is not None
        line = await asyncio.wait_for(self.process.stdout.readline(), timeout)
        if not line:
            raise RuntimeError(f"child exited with {await self.process.wait()}")
        return json.loads(line)

    def write(self, text: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(text.encode())

    async def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        try:
            await asyncio.wait_for(self.process.wait(), 30)
        except TimeoutError:
            self.process.kill()
            await self.process.wait()


async def run_case(case: str, messages: int, coordinator: Coordinator, detector: str) -> tuple[float, int, float]:
    """One sender/receiver pair: messages per second, snapshots completed, this process's CPU share."""
    kind = "raw" if case == "raw" else "agent"
    count = ["--messages", str(messages)]
    with_detector = [] if kind == "raw" else ["--detector", detector]
    receiver = await Child.start(f"{kind}-receiver", *count, *with_detector)
    sender = None
    try:
        address = (await receiver.read())["address"]
        sender = await Child.start(f"{kind}-sender", *count, "--peer", str(address), *with_detector)
        await sender.read()  # ready
        if kind == "agent":
            deadline = time.monotonic() + 30
            while set(coordinator.members) != {"sender", "receiver"}:
                if time.monotonic() > deadline:
                    raise TimeoutError("agents did not attach to the detector")
                await asyncio.sleep(0.01)
        sender.write("go\n")
        cpu_before = time.process_time()
        start = float((await sender.read())["start"])
        snapshots = asyncio.ensure_future(take_snapshots(coordinator)) if case == "agent+snapshots" else None
        done = float((await receiver.read())["done"])
        detector_cpu = (time.process_time() - cpu_before) / (done - start)
        completed = 0
        if snapshots is not None:
            snapshots.cancel()
            completed = await snapshots
        return messages / (done - start), completed, detector_cpu
    finally:
        for child in (sender, receiver):
            if child is not None:
                await child.close()


async def take_snapshots(coordinator: Coordinator, per_second: float = 10) -> int:
    """Begin a snapshot every 1/per_second seconds until cancelled; returns how many completed."""
    completed = 0
    pending: list[asyncio.Future] = []
    try:
        while True:
            _, result = coordinator.begin_snapshot()
            pending.append(result)
            await asyncio.sleep(1 / per_second)
    except asyncio.CancelledError:
        for result in pending:
            try:
                await asyncio.wait_for(asyncio.shield(result), 5)
                completed += 1
            except (SnapshotAborted, TimeoutError):
                pass
        return completed


async def orchestrate(args: argparse.Namespace) -> None:
    coordinator = Coordinator(heartbeat_interval=1.0)
    server = grpc.aio.server()
    control_pb2_grpc.add_ControlServicer_to_server(coordinator, server)
    detector = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    cases = ("raw", "agent", "agent+snapshots")
    rates: dict[str, list[float]] = {case: [] for case in cases}
    detector_cpu: dict[str, list[float]] = {case: [] for case in cases}
    snapshots = 0
    for _ in range(args.rounds):
        for case in cases:
            rate, completed, cpu = await run_case(case, args.messages, coordinator, detector)
            rates[case].append(rate)
            detector_cpu[case].append(cpu)
            snapshots += completed
    await server.stop(0)

    median = {case: statistics.median(values) for case, values in rates.items()}
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"64-byte messages, one channel, 2 processes, {args.messages:,} messages, {args.rounds} rounds")
    table.add_column("case")
    table.add_column("median msgs/s", justify="right")
    table.add_column("all rounds", justify="right")
    table.add_column("detector CPU", justify="right")
    for case in cases:
        cpu = f"{statistics.median(detector_cpu[case]):.1%}"
        table.add_row(case, f"{median[case]:,.0f}", ", ".join(f"{r:,.0f}" for r in rates[case]), cpu)
    table.add_row("agent / raw", f"{median['agent'] / median['raw']:.3f}", "target >= 0.8")
    table.add_row("snapshot overhead", f"{1 - median['agent+snapshots'] / median['agent']:.3f}", "target <= 0.05")
    table.add_row("snapshots completed", str(snapshots), "during agent+snapshots")
    Console().print(table)
    print(
        json.dumps(
            {
                "messages": args.messages,
                "rounds": args.rounds,
                "raw_msgs_per_s": round(median["raw"]),
                "agent_msgs_per_s": round(median["agent"]),
                "ratio": round(median["agent"] / median["raw"], 4),
                "with_snapshots_msgs_per_s": round(median["agent+snapshots"]),
                "snapshot_overhead": round(1 - median["agent+snapshots"] / median["agent"], 4),
                "snapshots_completed": snapshots,
            }
        ),
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=300_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--role", choices=sorted(ROLES), help=argparse.SUPPRESS)
    parser.add_argument("--peer", help=argparse.SUPPRESS)
    parser.add_argument("--detector", help=argparse.SUPPRESS)
    parser.add_argument("--try-send", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    asyncio.run(ROLES[args.role](args) if args.role else orchestrate(args))


if __name__ == "__main__":
    main()
