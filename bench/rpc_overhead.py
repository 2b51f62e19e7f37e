"""Benchmark: unary gRPC calls through RPC mode against plain gRPC, same run.

Two OS processes on 127.0.0.1, both with the synchronous gRPC API. The server process serves the
same echo method (64-byte requests and responses, generic byte handlers) on four servers with
the same worker pool (``--workers``): a plain one, one with pass-through interceptors, one with a
stamp-only interceptor and one with an RPC-mode agent's server interceptor. The client process
calls from ``--concurrency`` threads, each in a closed loop (the next call as soon as the last
returned), through a matching channel. Both agents attach to a detector in this process. Cases:

* ``plain``: the plain channel to the plain server;
* ``no-op interceptors``: a channel and a server with interceptors that only pass each call on:
  what gRPC's interceptor machinery costs before the agent does anything;
* ``stamp-only``: one constant stamp-sized metadata entry on each request and each response, and
  nothing more, carried the way the agent carries its stamps (a server interceptor that wraps the
  handler once; on the client, the method's ``with_call`` with the entry added and the trailing
  metadata read): the floor of anything that tells the other side something on every call, as a
  coloring protocol must;
* ``client interceptor``: the agent's server interceptor, and its client interceptor through
  ``grpc.intercept_channel``;
* ``instrumented``: the agent's server interceptor and its instrumented channel
  (``agent.instrument_channel``): the set-up the README gives, the one the targets are for (JSON
  key ``intercepted``), the detector taking no snapshot;
* ``instrumented+snapshots``: the same while the detector's own scheduler takes a snapshot every
  0.1 s (10 a second, at most 2 at once: what ``stablewatch detector --interval 0.1`` does).

Each case runs ``--warmup`` seconds, then is measured for ``--seconds``: the latency of every call
that started in that window (its p50 and p99, in µs) and the calls completed per second. The cases
run in interleaved rounds (``--rounds``), in an order that rotates from round to round, all in the
same two processes (the other servers idle while one is measured), so the machine's noise and
drift hit every case alike. Ratios are computed within each round and summarized by their median
and spread (lowest and highest round).

The last line is one JSON object: ``plain_p50_us``, ``noop_p50_us``, ``stamp_only_p50_us``,
``client_interceptor_p50_us``, ``intercepted_p50_us`` (the instrumented case),
``with_snapshots_p50_us`` (medians over rounds) and their ``*_spread``; ``overhead_p50``
(intercepted p50 / plain p50 - 1), ``overhead_p50_with_snapshots``, the floors'
``noop_overhead_p50`` and ``stamp_only_overhead_p50`` and ``client_interceptor_overhead_p50``; the
CPU time per call of each case, both processes together (``*_cpu_us_per_call``) and each
(``*_client_cpu_us``, ``*_server_cpu_us``), read from /proc over the measured window;
``cpu_overhead`` (intercepted over plain, - 1), ``cpu_overhead_with_snapshots`` and the floors'
``noop_cpu_overhead`` and ``stamp_only_cpu_overhead`` (CPU per call is the steadiest measure here:
on 2 cores every microsecond of it is taken from some call's latency or throughput);
``throughput_ratio`` (intercepted calls/s over plain), ``throughput_ratio_with_snapshots``,
``stamp_only_throughput_ratio`` and ``client_interceptor_throughput_ratio``, each with its spread;
the p99s and calls/s of every case; ``snapshots_per_s`` (what the detector achieved while
measured) and ``snapshots_completed``; and the ``targets``: p50 overhead <= 5 %, throughput
>= 0.95 x plain, with and without snapshots.

    python bench/rpc_overhead.py [--seconds 10] [--warmup 1] [--rounds 5] [--concurrency 4] [--probe] [--cases ...]

``--cases CASE[,CASE]`` runs only those cases (no table or JSON line), for a profiler:
``py-spy record --gil --pid PID`` on the ``--role client`` or ``--role server`` process.

``--probe`` times the agent's own steps where they run, in the two processes: each entry point of
the agent and of its interceptors is wrapped to add up the thread CPU time it takes (each wrapper
adds the cost of two ``thread_time_ns`` calls, about a microsecond). At the end each process prints
one line to stderr, ``probe <role> {step: [CPU µs per call, calls]}``: what the agent's Python
costs in place, to set beside the CPU per call of the cases.

A full run takes about 6 x (warm-up + seconds) x rounds + 5 seconds: about 6 minutes by default.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass

import grpc
from child import Child, emit
from coordinator import attached, served_coordinator, stop_snapshots, take_snapshots
from report import json_line, rounds_row, rounds_table, spread

from stablewatch.agents.rpc.agent import RpcAgent
from stablewatch.detector.service.coordinator import Coordinator

ECHO = "/bench.Echo/Call"
PAYLOAD = b"x" * 64
CASES = ("plain", "no-op interceptors", "stamp-only", "client interceptor", "instrumented", "instrumented+snapshots")
CHANNEL = {
    "plain": "plain",
    "no-op interceptors": "noop",
    "stamp-only": "stamp_only",
    "client interceptor": "client_interceptor",
    "instrumented": "intercepted",
    "instrumented+snapshots": "intercepted",
}
#: Each case's key in the JSON line (``intercepted`` is the agent's recommended set-up).
KEYS = {
    "plain": "plain",
    "no-op interceptors": "noop",
    "stamp-only": "stamp_only",
    "client interceptor": "client_interceptor",
    "instrumented": "intercepted",
    "instrumented+snapshots": "with_snapshots",
}
FLOOR_STAMP = ("stablewatch-stamp", "17:1764000000000000.1764000000000000.0.client")


class NoopServerInterceptor(grpc.ServerInterceptor):
    """Passes every call through: what gRPC's interceptor machinery alone costs."""

    def intercept_service(self, continuation, handler_call_details):
        return continuation(handler_call_details)


class NoopClientInterceptor(grpc.UnaryUnaryClientInterceptor):
    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(client_call_details, request)


class StampOnlyServerInterceptor(grpc.ServerInterceptor):
    """Sees each call arrive and sets one stamp-sized trailing metadata entry when its handler ends,
    and nothing more; the handler is wrapped once, as the agent's interceptor does."""

    def __init__(self) -> None:
        self._wrapped: dict[int, object] = {}

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        wrapped = self._wrapped.get(id(handler))
        if wrapped is None:
            behavior = handler.unary_unary

            def stamped(request, context):
                try:
                    return behavior(request, context)
                finally:
                    context.set_trailing_metadata((FLOOR_STAMP,))

            wrapped = self._wrapped[id(handler)] = handler._replace(unary_unary=stamped)
        return wrapped


class StampOnlyMethod:
    """A unary method that adds one stamp-sized metadata entry to each request and reads the
    response's trailing metadata, and nothing more, the way the agent's instrumented channel calls."""

    def __init__(self, method: grpc.UnaryUnaryMultiCallable) -> None:
        self._method = method

    def __call__(self, request, metadata=None, **options):
        metadata = (*metadata, FLOOR_STAMP) if metadata else (FLOOR_STAMP,)
        response, call = self._method.with_call(request, metadata=metadata, **options)
        call.trailing_metadata()
        return response


SNAPSHOTS_PER_S = 10.0


PROBED = {
    "agent": ("arrive", "handler_started", "respond", "call_out", "call_returned"),
    "interceptors": ("_end_sync", "_details_with", "stamp_of", "current_task_name"),
    "channel": ("with_stamp", "take_in_end", "current_task_name"),
}


def install_probe(role: str) -> None:
    """Wrap the agent's and the interceptors' steps to add up their thread CPU time; print it at exit."""
    from stablewatch.agents.rpc import agent as rpc_agent
    from stablewatch.agents.rpc import channel as rpc_channel
    from stablewatch.agents.rpc import interceptors as rpc_interceptors

    cost: dict[str, int] = {}
    calls: dict[str, int] = {}

    def timed(owner: object, name: str) -> None:
        original = getattr(owner, name)
        clock = time.thread_time_ns

        def step(*args: object, **kwargs: object) -> object:
            began = clock()
            try:
                return original(*args, **kwargs)
            finally:
                cost[name] = cost.get(name, 0) + clock() - began
                calls[name] = calls.get(name, 0) + 1

        setattr(owner, name, step)

    for name in PROBED["agent"]:
        timed(rpc_agent.RpcAgent, name)
    for name in PROBED["interceptors"]:
        timed(rpc_interceptors, name)
    for name in PROBED["channel"]:  # the same helpers, as the instrumented channel's module holds them
        timed(rpc_channel, name)
    timed(rpc_interceptors.ServerInterceptor, "intercept_service")

    def report() -> None:
        steps = {name: [round(cost[name] / calls[name] / 1000, 2), calls[name]] for name in cost}
        print(f"probe {role} {json.dumps(steps)}", file=sys.stderr, flush=True)

    atexit.register(report)


def echo_handler() -> grpc.GenericRpcHandler:
    handler = grpc.unary_unary_rpc_method_handler(lambda request, context: request)
    return grpc.method_handlers_generic_handler("bench.Echo", {"Call": handler})


def start_agent(process_id: str, detector: str) -> RpcAgent:
    agent = RpcAgent(process_id, detector=detector)
    agent.start()
    return agent


# -- the two roles, each in its own process --------------------------------------------------------


def serve(args: argparse.Namespace) -> None:
    """The plain and the intercepted server, until stdin closes."""
    agent = start_agent("server", args.detector)
    servers = {}
    kinds = (
        ("plain", []),
        ("noop", [NoopServerInterceptor()]),
        ("stamp_only", [StampOnlyServerInterceptor()]),
        ("intercepted", [agent.server_interceptor(workers=args.workers)]),  # for both of the agent's clients
    )
    for kind, interceptors in kinds:
        pool = futures.ThreadPoolExecutor(args.workers, thread_name_prefix=f"{kind}-worker")
        server = grpc.server(pool, interceptors=interceptors)
        server.add_generic_rpc_handlers([echo_handler()])
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers[kind] = (server, f"127.0.0.1:{port}")
    emit(**{kind: address for kind, (_, address) in servers.items()})
    sys.stdin.read()  # until the orchestrator closes it
    for server, _ in servers.values():
        server.stop(0).wait()
    agent.stop()


def call(args: argparse.Namespace) -> None:
    """Measure phases on the orchestrator's command (one JSON line in, one out) until stdin closes."""
    agent = start_agent("client", args.detector)
    addresses = json.loads(args.peer)
    channels = {
        "plain": grpc.insecure_channel(addresses["plain"]),
        "noop": grpc.intercept_channel(grpc.insecure_channel(addresses["noop"]), NoopClientInterceptor()),
        "stamp_only": grpc.insecure_channel(addresses["stamp_only"]),
        "client_interceptor": grpc.intercept_channel(
            grpc.insecure_channel(addresses["intercepted"]), agent.client_interceptor("server")
        ),
        "intercepted": agent.instrument_channel(grpc.insecure_channel(addresses["intercepted"]), "server"),
    }
    methods = {kind: channel.unary_unary(ECHO) for kind, channel in channels.items()}
    methods["stamp_only"] = StampOnlyMethod(methods["stamp_only"])
    for method in methods.values():  # connect both before anything is measured
        method(PAYLOAD, wait_for_ready=True, timeout=30)
    emit(ready=True)
    for line in sys.stdin:
        phase = json.loads(line)
        method = methods[phase["channel"]]
        emit(**measure(method, args.concurrency, phase["warmup"], phase["seconds"], args.server_pid))
    for channel in channels.values():
        channel.close()
    agent.stop()


def cpu_seconds(pid: int) -> float:
    """The CPU time (user + system) process ``pid`` has used, from /proc."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def sample_cpu(server_pid: int, start: float, end: float, samples: list[tuple[float, float]]) -> None:
    """The client's and the server's CPU time at ``start`` and at ``end`` (monotonic), into ``samples``."""
    for moment in (start, end):
        delay = moment - time.monotonic()
        if delay > 0:
            threading.Event().wait(delay)  # a timer, not a wait for an event: nothing signals it
        samples.append((cpu_seconds(os.getpid()), cpu_seconds(server_pid)))


def measure(
    method: grpc.UnaryUnaryMultiCallable, concurrency: int, warmup: float, seconds: float, server_pid: int
) -> dict:
    """`concurrency` closed-loop callers for warmup + seconds; the calls started in the measured window,
    and the CPU time both processes spent in it."""
    start = time.monotonic() + warmup
    end = start + seconds
    start_ns, end_ns = int(start * 1e9), int(end * 1e9)
    latencies: list[list[int]] = [[] for _ in range(concurrency)]
    completed_at: list[int] = [0] * concurrency

    def loop(mine: list[int], number: int) -> None:
        clock = time.monotonic_ns
        while True:
            began = clock()
            if began >= end_ns:
                return
            method(PAYLOAD)
            done = clock()
            if began >= start_ns:
                mine.append(done - began)
                completed_at[number] = done

    cpu: list[tuple[float, float]] = []
    threads = [threading.Thread(target=loop, args=(latencies[n], n)) for n in range(concurrency)]
    threads.append(threading.Thread(target=sample_cpu, args=(server_pid, start, end, cpu)))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    samples = sorted(value for mine in latencies for value in mine)
    window = (max(completed_at) - start_ns) / 1e9 if samples else seconds
    return {
        "calls": len(samples),
        "window": [start, start + window],
        "per_s": len(samples) / window,
        "p50_us": samples[len(samples) // 2] / 1000,
        "p99_us": samples[min(len(samples) - 1, int(len(samples) * 0.99))] / 1000,
        "client_cpu_s": cpu[1][0] - cpu[0][0],
        "server_cpu_s": cpu[1][1] - cpu[0][1],
    }


ROLES = {"server": serve, "client": call}


# -- the orchestrator ------------------------------------------------------------------------------------


@dataclass
class Phase:
    """One case of one round."""

    p50_us: float
    p99_us: float
    per_s: float
    seconds: float
    client_cpu_us: float  # CPU per call, client process
    server_cpu_us: float  # CPU per call, server process
    snapshots: int = 0

    @property
    def cpu_us(self) -> float:
        """CPU per call, both processes."""
        return self.client_cpu_us + self.server_cpu_us


async def run_phase(client: Child, case: str, args: argparse.Namespace, coordinator: Coordinator) -> Phase:
    completed: list[float] = []
    snapshots = None
    if case.endswith("snapshots"):
        snapshots = asyncio.ensure_future(take_snapshots(coordinator, completed, SNAPSHOTS_PER_S))
    try:
        client.send(channel=CHANNEL[case], warmup=args.warmup, seconds=args.seconds)
        result = await client.read(timeout=args.warmup + args.seconds + 120)
    finally:
        if snapshots is not None:
            await stop_snapshots(snapshots)
    start, end = result["window"]
    taken = sum(start <= t <= end for t in completed)
    calls = result["calls"] or 1
    client_cpu, server_cpu = result["client_cpu_s"] * 1e6 / calls, result["server_cpu_s"] * 1e6 / calls
    return Phase(result["p50_us"], result["p99_us"], result["per_s"], end - start, client_cpu, server_cpu, taken)


async def orchestrate(args: argparse.Namespace) -> list[dict[str, Phase]]:
    async with served_coordinator() as (coordinator, detector):
        return await measure_rounds(args, coordinator, detector)


async def measure_rounds(args: argparse.Namespace, coordinator: Coordinator, detector: str) -> list[dict[str, Phase]]:
    """Start the server and client processes, attached to ``detector``, and run every round."""
    server = client = None
    rounds: list[dict[str, Phase]] = []
    try:
        probe = ["--probe"] if args.probe else []
        server = await Child.start(__file__, "server", "--detector", detector, "--workers", str(args.workers), *probe)
        addresses = await server.read()
        client = await Child.start(
            __file__,
            "client",
            "--detector",
            detector,
            "--peer",
            json.dumps(addresses),
            "--concurrency",
            str(args.concurrency),
            "--server-pid",
            str(server.process.pid),
            *probe,
        )
        await client.read()  # ready: both channels connected
        await attached(coordinator, {"server", "client"})
        cases = tuple(case for case in CASES if case in args.cases)
        for number in range(args.rounds):
            order = cases[number % len(cases) :] + cases[: number % len(cases)]  # rotate against drift
            measured = {case: await run_phase(client, case, args, coordinator) for case in order}
            rounds.append(measured)
            line = ", ".join(f"{case} p50 {m.p50_us:.0f} µs {m.per_s:,.0f}/s" for case, m in measured.items())
            print(f"round {number + 1}/{args.rounds}: {line}", file=sys.stderr, flush=True)
    finally:
        for child in (client, server):
            if child is not None:
                await child.close()
        deadline = time.monotonic() + 5
        while coordinator.members and time.monotonic() < deadline:  # the control streams end first
            await asyncio.sleep(0.01)
    return rounds


def report(args: argparse.Namespace, rounds: list[dict[str, Phase]]) -> dict[str, object]:
    def per_round(function: Callable[[dict[str, Phase]], float]) -> list[float]:
        return [function(r) for r in rounds]

    p50 = {case: per_round(lambda r, c=case: r[c].p50_us) for case in CASES}
    p99 = {case: per_round(lambda r, c=case: r[c].p99_us) for case in CASES}
    rate = {case: per_round(lambda r, c=case: r[c].per_s) for case in CASES}
    overhead = per_round(lambda r: r["instrumented"].p50_us / r["plain"].p50_us - 1)
    overhead_snap = per_round(lambda r: r["instrumented+snapshots"].p50_us / r["plain"].p50_us - 1)
    ratio = per_round(lambda r: r["instrumented"].per_s / r["plain"].per_s)
    ratio_snap = per_round(lambda r: r["instrumented+snapshots"].per_s / r["plain"].per_s)
    snapshots = sum(r["instrumented+snapshots"].snapshots for r in rounds)
    snapshot_seconds = sum(r["instrumented+snapshots"].seconds for r in rounds)
    median = statistics.median
    floor = per_round(lambda r: r["no-op interceptors"].p50_us / r["plain"].p50_us - 1)
    cpu_floor = per_round(lambda r: r["no-op interceptors"].cpu_us / r["plain"].cpu_us - 1)
    stamp_floor = per_round(lambda r: r["stamp-only"].p50_us / r["plain"].p50_us - 1)
    stamp_cpu_floor = per_round(lambda r: r["stamp-only"].cpu_us / r["plain"].cpu_us - 1)
    stamp_ratio = per_round(lambda r: r["stamp-only"].per_s / r["plain"].per_s)
    interceptor_overhead = per_round(lambda r: r["client interceptor"].p50_us / r["plain"].p50_us - 1)
    interceptor_ratio = per_round(lambda r: r["client interceptor"].per_s / r["plain"].per_s)
    cpu_overhead = per_round(lambda r: r["instrumented"].cpu_us / r["plain"].cpu_us - 1)
    cpu_overhead_snap = per_round(lambda r: r["instrumented+snapshots"].cpu_us / r["plain"].cpu_us - 1)
    result: dict[str, object] = {"seconds": args.seconds, "warmup": args.warmup, "rounds": args.rounds}
    result["concurrency"] = args.concurrency
    result["workers"] = args.workers
    for case, key in KEYS.items():
        result[f"{key}_p50_us"] = round(median(p50[case]), 1)
        result[f"{key}_p50_us_spread"] = spread(p50[case], 1)
        result[f"{key}_p99_us"] = round(median(p99[case]), 1)
        result[f"{key}_calls_per_s"] = round(median(rate[case]))
        result[f"{key}_calls_per_s_spread"] = spread(rate[case], 0)
        result[f"{key}_cpu_us_per_call"] = round(median(per_round(lambda r, c=case: r[c].cpu_us)), 1)
        result[f"{key}_client_cpu_us"] = round(median(per_round(lambda r, c=case: r[c].client_cpu_us)), 1)
        result[f"{key}_server_cpu_us"] = round(median(per_round(lambda r, c=case: r[c].server_cpu_us)), 1)
    result |= {
        "noop_overhead_p50": round(median(floor), 4),
        "noop_overhead_p50_spread": spread(floor, 4),
        "overhead_p50": round(median(overhead), 4),
        "overhead_p50_spread": spread(overhead, 4),
        "overhead_p50_with_snapshots": round(median(overhead_snap), 4),
        "overhead_p50_with_snapshots_spread": spread(overhead_snap, 4),
        "noop_cpu_overhead": round(median(cpu_floor), 4),
        "noop_cpu_overhead_spread": spread(cpu_floor, 4),
        "stamp_only_overhead_p50": round(median(stamp_floor), 4),
        "stamp_only_overhead_p50_spread": spread(stamp_floor, 4),
        "stamp_only_cpu_overhead": round(median(stamp_cpu_floor), 4),
        "stamp_only_cpu_overhead_spread": spread(stamp_cpu_floor, 4),
        "stamp_only_throughput_ratio": round(median(stamp_ratio), 4),
        "stamp_only_throughput_ratio_spread": spread(stamp_ratio, 4),
        "client_interceptor_overhead_p50": round(median(interceptor_overhead), 4),
        "client_interceptor_overhead_p50_spread": spread(interceptor_overhead, 4),
        "client_interceptor_throughput_ratio": round(median(interceptor_ratio), 4),
        "client_interceptor_throughput_ratio_spread": spread(interceptor_ratio, 4),
        "cpu_overhead": round(median(cpu_overhead), 4),
        "cpu_overhead_spread": spread(cpu_overhead, 4),
        "cpu_overhead_with_snapshots": round(median(cpu_overhead_snap), 4),
        "cpu_overhead_with_snapshots_spread": spread(cpu_overhead_snap, 4),
        "throughput_ratio": round(median(ratio), 4),
        "throughput_ratio_spread": spread(ratio, 4),
        "throughput_ratio_with_snapshots": round(median(ratio_snap), 4),
        "throughput_ratio_with_snapshots_spread": spread(ratio_snap, 4),
        "snapshots_completed": snapshots,
        "snapshots_per_s": round(snapshots / snapshot_seconds, 2),
        "targets": {
            "overhead_p50_at_most_0.05": median(overhead) <= 0.05,
            "throughput_ratio_at_least_0.95": median(ratio) >= 0.95,
            "overhead_p50_with_snapshots_at_most_0.05": median(overhead_snap) <= 0.05,
            "throughput_ratio_with_snapshots_at_least_0.95": median(ratio_snap) >= 0.95,
        },
    }
    return result


def print_table(args: argparse.Namespace, rounds: list[dict[str, Phase]], result: dict[str, object]) -> None:
    from rich.console import Console

    table = rounds_table(
        f"unary calls, 64-byte echo, {args.concurrency} client threads, {args.workers} server workers: "
        f"{args.rounds} interleaved rounds of {args.seconds:g} s per case after {args.warmup:g} s of warm-up",
        len(rounds),
    )
    for case in CASES:
        rounds_row(table, f"{case} p50 µs", [r[case].p50_us for r in rounds], ".0f")
    for case in CASES:
        rounds_row(table, f"{case} calls/s", [r[case].per_s for r in rounds], ",.0f")
    for case in CASES:
        rounds_row(table, f"{case} CPU µs/call", [r[case].cpu_us for r in rounds], ".0f")
    for label, case, target in (
        ("p50 overhead, no-op interceptors", "no-op interceptors", ""),
        ("p50 overhead, stamp-only", "stamp-only", ""),
        ("p50 overhead, client interceptor", "client interceptor", ""),
        ("p50 overhead", "instrumented", "<= 0.05"),
        ("p50 overhead, snapshots", "instrumented+snapshots", "<= 0.05"),
    ):
        rounds_row(table, label, [r[case].p50_us / r["plain"].p50_us - 1 for r in rounds], ".3f", target)
    for label, case in (
        ("CPU overhead, no-op interceptors", "no-op interceptors"),
        ("CPU overhead, stamp-only", "stamp-only"),
        ("CPU overhead, client interceptor", "client interceptor"),
        ("CPU overhead", "instrumented"),
        ("CPU overhead, snapshots", "instrumented+snapshots"),
    ):
        rounds_row(table, label, [r[case].cpu_us / r["plain"].cpu_us - 1 for r in rounds], ".3f")
    for label, case, target in (
        ("throughput ratio, stamp-only", "stamp-only", ""),
        ("throughput ratio, client interceptor", "client interceptor", ""),
        ("throughput ratio", "instrumented", ">= 0.95"),
        ("throughput ratio, snapshots", "instrumented+snapshots", ">= 0.95"),
    ):
        rounds_row(table, label, [r[case].per_s / r["plain"].per_s for r in rounds], ".3f", target)
    rates = [r["instrumented+snapshots"].snapshots / r["instrumented+snapshots"].seconds for r in rounds]
    rounds_row(table, "snapshots/s completed", rates, ".1f", "10 asked", result["snapshots_per_s"])
    Console(width=200).print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--seconds", type=float, default=10.0, help="seconds measured per case and round (10)")
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds of each case before measuring (1)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (5)")
    parser.add_argument("--concurrency", type=int, default=4, help="client threads calling at once (4)")
    parser.add_argument("--workers", type=int, default=4, help="worker threads of each server (4)")
    parser.add_argument("--probe", action="store_true", help="time the agent's steps in place (see above)")
    parser.add_argument(
        "--cases",
        type=lambda text: text.split(","),
        default=list(CASES),
        help="comma-separated cases to run (all for the table and the JSON line; fewer to profile one)",
    )
    parser.add_argument("--role", choices=sorted(ROLES), help=argparse.SUPPRESS)
    parser.add_argument("--detector", help=argparse.SUPPRESS)
    parser.add_argument("--peer", help=argparse.SUPPRESS)
    parser.add_argument("--server-pid", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role:
        if args.probe:
            install_probe(args.role)
        ROLES[args.role](args)
        return
    unknown = set(args.cases) - set(CASES)
    if unknown:
        parser.error(f"unknown cases {sorted(unknown)}: the cases are {', '.join(CASES)}")
    rounds = asyncio.run(orchestrate(args))
    if set(args.cases) != set(CASES):
        return  # a profiling run: no ratios without every case
    result = report(args, rounds)
    print_table(args, rounds, result)
    json_line(result)


if __name__ == "__main__":
    main()
