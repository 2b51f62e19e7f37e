"""Benchmark: the Python work of one RPC-mode unary call, client and server side, in one process.

``rpc_overhead.py`` measures whole calls between two processes, where gRPC's own work (about
400 µs of CPU a call here) and the machine's noise hide differences of a few microseconds. This
benchmark takes gRPC's transport away: a loopback channel hands each call straight to a server
side, which finds its handler through gRPC's own server interceptor pipeline
(``grpc._interceptor.service_pipeline``) in a fresh ``contextvars.Context`` per call, as the sync
server does, and runs it with a servicer context that keeps the metadata. So what is timed is the
Python the instrumentation adds to a call, on both sides, with no noise but the CPU's. Cases:

* ``loopback``: the loopback alone (a plain method and a server without interceptors): the cost of
  the harness, to subtract;
* ``stamp_only``: one stamp-sized entry carried each way, as ``rpc_overhead.py``'s stamp-only case
  carries it, and nothing else;
* ``instrumented``: two agents (no detector), the server's interceptor and the client's
  instrumented channel, with no snapshot running: what the agents add to every call;
* ``instrumented_recording``: the same while a snapshot records on both sides (started and never
  finished), so that every call is also checked against a running recording;
* ``client_interceptor``: the server's interceptor and the client interceptor through
  ``grpc.intercept_channel``.

Each case runs in interleaved rounds of ``--seconds`` (1) each, ``--rounds`` (5). The table and the
last line (JSON) give the median µs per call and the spread (lowest and highest round), each case
less ``loopback`` (``*_added_us``), and for the agents' cases the requests their client stamped
(``*_stamped_requests``: one per call made).

    python bench/rpc_hot_path.py [--seconds 1] [--rounds 5] [--profile CASE]

``--profile CASE`` runs one case under cProfile for ``--seconds`` and prints where its time goes.
"""

from __future__ import annotations

import argparse
import contextvars
import cProfile
import pstats
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import grpc
from grpc import _interceptor
from report import interleaved, json_line, medians_and_spreads, spread_row
from rich.console import Console
from rich.table import Table
from rpc_overhead import StampOnlyMethod, StampOnlyServerInterceptor

from stablewatch.agents.rpc.agent import RpcAgent

METHOD = "/bench.Echo/Call"
PAYLOAD = b"x" * 64
_OK = grpc.StatusCode.OK


class _Details(NamedTuple):
    method: str
    invocation_metadata: Sequence[tuple[str, str]]


class HandlerCallDetails(_Details, grpc.HandlerCallDetails):
    """What the server's interceptors see of an arriving call."""


class ServerContext:
    """The part of a sync ``grpc.ServicerContext`` that the agent uses, keeping the trailing metadata."""

    def __init__(self, metadata: Sequence[tuple[str, str]]) -> None:
        self._metadata = metadata
        self._trailing: Sequence[tuple[str, str]] = ()

    def invocation_metadata(self) -> Sequence[tuple[str, str]]:
        return self._metadata

    def trailing_metadata(self) -> Sequence[tuple[str, str]]:
        return self._trailing

    def set_trailing_metadata(self, metadata: Sequence[tuple[str, str]]) -> None:
        self._trailing = metadata

    def is_active(self) -> bool:
        return True

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise RuntimeError(f"aborted: {code.name}: {details}")


class Ended:
    """The finished call a blocking ``with_call`` returns."""

    def __init__(self, trailing: Sequence[tuple[str, str]]) -> None:
        self._trailing = trailing

    def trailing_metadata(self) -> Sequence[tuple[str, str]]:
        return self._trailing

    def code(self) -> grpc.StatusCode:
        return _OK


class LoopbackServer:
    """One echo method behind a server's interceptors, found the way grpc's sync server finds it."""

    def __init__(self, interceptors: Sequence[grpc.ServerInterceptor]) -> None:
        self._handler = grpc.unary_unary_rpc_method_handler(lambda request, context: request)
        self._pipeline = _interceptor.service_pipeline(interceptors)

    def _query(self, details: HandlerCallDetails) -> grpc.RpcMethodHandler:
        return self._handler

    def call(self, request: Any, metadata: Sequence[tuple[str, str]]) -> tuple[Any, Ended]:
        details = HandlerCallDetails(METHOD, metadata)
        context = contextvars.Context()  # one per call, for its interceptors and its handler
        if self._pipeline is None:
            handler = context.run(self._query, details)
        else:
            handler = context.run(self._pipeline.execute, self._query, details)
        servicer_context = ServerContext(metadata)
        response = context.run(handler.unary_unary, request, servicer_context)
        return response, Ended(servicer_context.trailing_metadata())


class LoopbackMethod(grpc.UnaryUnaryMultiCallable):
    def __init__(self, server: LoopbackServer) -> None:
        self._server = server

    def __call__(self, request: Any, timeout: Any = None, metadata: Any = None, **options: Any) -> Any:
        return self._server.call(request, metadata or ())[0]

    def with_call(self, request: Any, timeout: Any = None, metadata: Any = None, **options: Any) -> Any:
        return self._server.call(request, metadata or ())

    def future(self, request: Any, timeout: Any = None, metadata: Any = None, **options: Any) -> Any:
        raise NotImplementedError("the loopback makes blocking calls only")


class LoopbackChannel(grpc.Channel):
    """A channel whose unary methods call a :class:`LoopbackServer` in the caller's thread."""

    def __init__(self, server: LoopbackServer) -> None:
        self._server = server

    def unary_unary(self, method: str, *args: Any, **kwargs: Any) -> LoopbackMethod:
        return LoopbackMethod(self._server)

    def unary_stream(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def stream_unary(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def stream_stream(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def subscribe(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError

    def unsubscribe(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError

    def close(self) -> None:
        return None


def stamped_requests(agent: RpcAgent) -> int:
    """How many requests ``agent`` has sent with a stamp."""
    value = agent.metrics.registry.get_sample_value("stablewatch_agent_rpc_stamped_messages_total", {"kind": "request"})
    return int(value or 0)


def cases() -> tuple[dict[str, Callable[[bytes], Any]], dict[str, RpcAgent]]:
    """Each case's blocking unary method (called with the payload), and the client agent of each
    case that has one."""
    plain = LoopbackChannel(LoopbackServer([])).unary_unary(METHOD)
    stamp_only = StampOnlyMethod(LoopbackChannel(LoopbackServer([StampOnlyServerInterceptor()])).unary_unary(METHOD))

    def agents(recording: bool) -> tuple[RpcAgent, LoopbackChannel]:
        client, server = RpcAgent("client"), RpcAgent("server")
        if recording:
            for agent in (client, server):
                agent.start_snapshot(1, lifetime=3600)
        return client, LoopbackChannel(LoopbackServer([server.server_interceptor(workers=4)]))

    clients: dict[str, RpcAgent] = {}
    clients["instrumented"], channel = agents(False)
    instrumented = clients["instrumented"].instrument_channel(channel, "server").unary_unary(METHOD)
    clients["instrumented_recording"], channel = agents(True)
    recording = clients["instrumented_recording"].instrument_channel(channel, "server").unary_unary(METHOD)
    clients["client_interceptor"], channel = agents(False)
    interceptor = clients["client_interceptor"].client_interceptor("server")
    intercepted = grpc.intercept_channel(channel, interceptor).unary_unary(METHOD)
    methods = {
        "loopback": plain,
        "stamp_only": stamp_only,
        "instrumented": instrumented,
        "instrumented_recording": recording,
        "client_interceptor": intercepted,
    }
    return methods, clients


def per_call(method: Callable[[bytes], Any], seconds: float) -> tuple[float, int]:
    """Seconds per call, calling ``method`` in batches for ``seconds``, and the calls made."""
    calls, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        for _ in range(1000):
            method(PAYLOAD)
        calls += 1000
    return elapsed / calls, calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--seconds", type=float, default=1.0, help="seconds per case per round (1)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (5)")
    parser.add_argument("--profile", metavar="CASE", help="profile one case instead of the benchmark")
    args = parser.parse_args()
    methods, clients = cases()
    if args.profile:
        profiler = cProfile.Profile()
        profiler.runcall(per_call, methods[args.profile], args.seconds)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
        return
    calls = dict.fromkeys(methods, 0)

    def microseconds_per_call(name: str, method: Callable[[bytes], Any]) -> float:
        seconds, made = per_call(method, args.seconds)
        calls[name] += made
        return seconds * 1e6

    results = interleaved(methods, args.rounds, microseconds_per_call)

    table = Table(title=f"one unary call's Python, µs: {args.rounds} interleaved rounds of {args.seconds:g} s per case")
    for column in ("case", "median", "lowest", "highest", "added to loopback"):
        table.add_column(column, justify="left" if column == "case" else "right")
    summary: dict[str, object] = {"seconds": args.seconds, "rounds": args.rounds}
    summary |= medians_and_spreads(results, "us", 2)
    floor = statistics.median(results["loopback"])
    for name, values in results.items():
        added = statistics.median(values) - floor
        table.add_row(name, *spread_row(values, ".2f"), "" if name == "loopback" else f"{added:.2f}")
        summary[f"{name}_calls"] = calls[name]
        if name != "loopback":
            summary[f"{name}_added_us"] = round(added, 2)
        if name in clients:  # the agent was really on the path: it stamped every request
            summary[f"{name}_stamped_requests"] = stamped_requests(clients[name])
    Console().print(table)
    json_line(summary)


if __name__ == "__main__":
    main()
