"""Benchmark: unary gRPC calls through RPC mode against plain gRPC and against the floor, same run.

Two OS processes per API on 127.0.0.1: a server process and a client process with the synchronous
gRPC API, and (``--api both``, the default) a pair with the asyncio API. Each server process serves
the same two methods (64-byte requests and responses, generic byte handlers) on five servers: a
plain one, one with pass-through interceptors, one with a stamp-only interceptor, one with the
stamp-only interceptor and the python stand-in (below) and one with its RPC-mode agent's server
interceptor, set up as the README says (sync: ``agent.thread_pool(n)``
given to ``grpc.server`` and to ``agent.server_interceptor(workers=pool)``, ``--workers`` 4 threads
in every server; asyncio: ``agent.aio_server_interceptor()``). The methods:

* ``echo``: returns the request at once (gRPC's own cost is nearly the whole call);
* ``work``, the realistic handler: about 1 ms waiting on I/O (``--io-ms``: ``time.sleep`` in the
  sync server, ``await asyncio.sleep`` in the asyncio one, standing for a downstream call) then
  about 100 µs of CPU (``--cpu-us``: a pure-Python loop of integer additions holding the GIL, its
  iteration count calibrated in each server process at start, from the fastest of 15 timed runs of
  a fixed loop in thread CPU time; the JSON line gives the count and what it measured).

The client process calls from ``--concurrency`` threads (sync) or tasks (asyncio), each in a
closed loop (the next call as soon as the last returned), through a matching channel. Every agent
attaches to a detector in this process. Cases (the asyncio ones are named ``aio <case>``, JSON keys
``aio_<key>``):

* ``plain``: the plain channel to the plain server;
* ``no-op interceptors``: a channel and a server with interceptors that only pass each call on:
  what gRPC's interceptor machinery costs before the agent does anything;
* ``stamp-only`` (JSON key ``stamp_only``): one constant stamp-sized metadata entry on each request
  and each response, and nothing more, carried the way the agent carries its stamps (a server
  interceptor that wraps the handler once; on the client, the method's ``with_call`` (asyncio: the
  call, awaited) with the entry added and the trailing metadata read): the floor of anything that
  tells the other side something on every call, as a coloring protocol must;
* ``stamp-only+snapshots`` (``stamp_only_with_snapshots``): the same while the detector's own
  scheduler takes a snapshot every 0.1 s (10 a second, at most 2 at once: what
  ``stablewatch detector --interval 0.1`` does), which every agent (of both APIs) takes part in;
* ``client interceptor``: the agent's server interceptor, and its client interceptor through
  ``grpc.intercept_channel`` (asyncio: ``agent.aio_client_interceptors`` given to the channel);
* ``instrumented`` (``intercepted``): the agent's server interceptor and its instrumented channel
  (``agent.instrument_channel``, of a sync or an asyncio channel): the README's set-up,
  the detector taking no snapshot;
* ``instrumented+snapshots`` (``with_snapshots``): the same with snapshots at 10 a second;
* ``realistic plain`` (``realistic_plain``): the ``work`` method, plain channel and server;
* ``realistic stamp-only+snapshots`` (``realistic_stamp_only``): the ``work`` method through the
  stamp-only channel and server, snapshots at 10 a second: the floor of the realistic target;
* ``realistic instrumented+snapshots`` (``realistic``): the ``work`` method, the README's set-up,
  snapshots at 10 a second;
* ``python stand-in+snapshots`` (``standin``) and ``realistic python stand-in+snapshots``
  (``realistic_standin``): the stamp-only channel and server, snapshots at 10 a second, each side
  also running ``standin(n)`` once per call: Python of the plainest kind that does nothing (per
  iteration an object of four fields, an f-string, a clock read, a lock taken and released, a dict
  entry set and removed), ``n`` calibrated in each process so that, timed alone, it takes half of
  ``--standin-us`` (4 µs by default: the bound issue 27 sets on the agent's own Python per call,
  both sides, ``hot_path_agent_us`` in ``rpc_hot_path.py``). What it costs in place, beside what it
  costs alone, is what that much Python costs on the call path whatever it does: the floor under
  the targets of any agent written in Python within that bound.
* ``least agent+snapshots`` (``least_agent``), ``realistic least agent+snapshots``
  (``realistic_least_agent``) and ``bare bookkeeping+snapshots`` (``bare_bookkeeping``): the echo
  or ``work`` method through ``least_agent.py``'s client method and server interceptor instead of
  the stamp-only ones, snapshots at 10 a second (the least agent takes part in none; the other
  agents do). The least agent keeps the facts the detector needs, each in the plainest Python;
  bare bookkeeping keeps only counts and waits. What they cost in place is the floor under the
  targets of any agent that keeps those facts, whatever its code.
* ``plain-pool instrumented+snapshots`` (``plain_pool``, sync only): the README's set-up but
  for the pool, a plain ``ThreadPoolExecutor`` with ``agent.server_interceptor()`` (no
  ``workers``), snapshots at 10 a second: the agent without its picture of the pool (which queued
  request waits for which running handlers, what a pool-exhaustion deadlock is made of, and which
  the least agent does not keep either). Set beside ``instrumented+snapshots`` it says what that
  picture costs in place.

Each case runs ``--warmup`` seconds, then is measured for ``--seconds``: the latency of every call
that started in that window (its p50 and p99, in µs) and the calls completed per second. The cases
run in interleaved rounds (``--rounds``), in an order that rotates from round to round, all in the
same processes (the other servers idle while one is measured), so the machine's noise and drift
hit every case alike. Ratios are computed within each round and summarized by their median and
spread (lowest and highest round).

The last line is one JSON object. Per case ``<key>``: ``<key>_p50_us`` (median over rounds) and
``<key>_p50_us_spread``, ``<key>_p99_us``, ``<key>_calls_per_s`` and its spread, and the CPU time per
call of both processes together (``<key>_cpu_us_per_call``) and of each (``<key>_client_cpu_us``,
``<key>_server_cpu_us``), read from /proc over the measured window. The ratios, each with its
``_spread`` (all also with the ``aio_`` prefix):

* the targets' (issue 27): ``floor_overhead_p50`` (instrumented+snapshots p50 / stamp-only+snapshots
  p50 - 1), ``floor_throughput_ratio`` (calls/s, the same two cases), ``floor_cpu_overhead``;
  ``realistic_overhead_p50`` (realistic instrumented+snapshots p50 / realistic plain p50 - 1),
  ``realistic_throughput_ratio``, ``realistic_cpu_overhead``;
  how much of the realistic target the floor takes: ``realistic_floor_overhead_p50`` (realistic
  stamp-only+snapshots p50 / realistic plain p50 - 1), ``realistic_floor_throughput_ratio``,
  ``realistic_floor_cpu_overhead``, and what the agent adds above it: ``realistic_over_floor_p50``
  (realistic instrumented+snapshots p50 / realistic stamp-only+snapshots p50 - 1),
  ``realistic_over_floor_throughput_ratio``;
* the stand-in's: ``standin_floor_overhead_p50``, ``standin_floor_throughput_ratio`` and
  ``standin_floor_cpu_overhead`` (python stand-in+snapshots against stamp-only+snapshots: as the
  floor targets set the agent), ``over_standin_p50`` and ``over_standin_cpu_overhead``
  (instrumented+snapshots against the stand-in: what the agent costs beyond Python of the bound's
  size), ``realistic_standin_overhead_p50``, ``realistic_standin_throughput_ratio`` and
  ``realistic_standin_cpu_overhead`` (against realistic plain, as the realistic targets);
* the least agent's and bare bookkeeping's: ``least_floor_overhead_p50``,
  ``least_floor_throughput_ratio``, ``least_floor_cpu_overhead``, ``bare_floor_overhead_p50``,
  ``bare_floor_throughput_ratio`` and ``bare_floor_cpu_overhead`` (against stamp-only+snapshots, as
  the floor targets set the agent), ``over_least_p50`` and ``over_least_cpu_overhead``
  (instrumented+snapshots against the least agent: what the agent costs beyond the facts it must
  keep), ``realistic_least_overhead_p50``, ``realistic_least_throughput_ratio`` and
  ``realistic_least_cpu_overhead`` (against realistic plain, as the realistic targets);
* the sync agent without its pool's picture: ``plain_pool_floor_overhead_p50``,
  ``plain_pool_floor_throughput_ratio`` and ``plain_pool_floor_cpu_overhead`` (against
  stamp-only+snapshots), ``pool_picture_p50`` and ``pool_picture_cpu_overhead``
  (instrumented+snapshots against it: what the picture of the pool costs), and
  ``plain_pool_over_least_p50`` and ``plain_pool_over_least_cpu_overhead`` (it against the least
  agent, which keeps no picture of the pool either);
* against plain, as before: ``overhead_p50`` (intercepted p50 / plain p50 - 1),
  ``overhead_p50_with_snapshots``, the floors' ``noop_overhead_p50`` and ``stamp_only_overhead_p50``
  and ``client_interceptor_overhead_p50``; ``cpu_overhead`` (intercepted over plain, - 1),
  ``cpu_overhead_with_snapshots``, ``noop_cpu_overhead`` and ``stamp_only_cpu_overhead`` (CPU per
  call is the steadiest measure here: on 2 cores every microsecond of it is taken from some call's
  latency or throughput); ``throughput_ratio`` (intercepted calls/s over plain),
  ``throughput_ratio_with_snapshots``, ``stamp_only_throughput_ratio`` and
  ``client_interceptor_throughput_ratio``.

Then ``snapshots_per_s`` (what the detector achieved while the snapshot cases were measured) and
``snapshots_completed``; ``realistic_handler`` (what the ``work`` method does, with each server's
calibrated iterations and their measured CPU µs); ``python_standin`` (its iterations per side and
what one call's measured alone, in µs, in each process); and the ``targets``, met or not:
``floor_overhead_p50`` <= 0.05, ``floor_throughput_ratio`` >= 0.95, ``realistic_overhead_p50`` <= 0.03,
``realistic_throughput_ratio`` >= 0.97, and the same for the asyncio API. (The former targets
against plain gRPC, p50 overhead <= 5 % and throughput >= 0.95, were restated against the floor by
issue 27: carrying one entry each way already costs an echo call more than that.)

    python bench/rpc_overhead.py [--seconds 10] [--warmup 1] [--rounds 5] [--concurrency 4] [--workers 4]
                                 [--api both|sync|aio] [--io-ms 1] [--cpu-us 100] [--standin-us 4] [--probe]
                                 [--cases ...]

``--cases CASE[,CASE]`` runs only those cases: the table and the JSON line then hold the cases that ran,
the ratios whose two cases ran and the targets whose ratio did (fewer cases leave room for more
rounds in the same time). One case alone is for a profiler:
``py-spy record --gil --pid PID`` on the ``--role client`` or ``--role server`` process (``--role
aio-client``, ``--role aio-server`` for the asyncio ones).

``--probe`` times the agent's own steps where they run, in the processes: each entry point of the
agent and of its interceptors is wrapped to add up the thread CPU time it takes (each wrapper adds
the cost of two ``thread_time_ns`` calls, about a microsecond). At the end each process prints one
line to stderr, ``probe <role> {step: [CPU µs per call, calls]}``: what the agent's Python costs in
place, to set beside the CPU per call of the cases. Whole steps are timed too, to set a case
beside its floor in place: the sync client's call through the instrumented channel
(``instrumented call``) and through the stamp-only or stand-in method (``stamp-only call``), the
start of an asyncio call through the instrumented channel (``aio instrumented call, its start``)
and grpc.aio's own start of any asyncio unary call (``grpc.aio call start``, inside it), the
sync server's ``_handle_call`` (grpc's polling thread: the interceptors and the hand-off to a
worker, with the pools' ``submit``) and ``_unary_response_in_pool`` (the worker: the wrapped
handler), the latter three shared by all of a process's servers, so run one case at a time
(``--cases``) to read them. A second line, ``probe-gc <role> {...}``, counts the garbage
collector's passes per generation and their time.

A full run takes about (cases) x (warm-up + seconds) x rounds + 10 seconds, with 31 cases (16 sync,
15 asyncio): about 29 minutes by default, 15 with ``--api sync``.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import gc
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
from child import Child, emit
from coordinator import attached, served_coordinator, stop_snapshots, take_snapshots
from least_agent import LeastAgent
from report import json_line, print_whole, rounds_row, rounds_table, spread

from stablewatch.agents.rpc.agent import RpcAgent
from stablewatch.detector.service.coordinator import Coordinator

SERVICE = "bench.Echo"
METHODS = {"echo": f"/{SERVICE}/Call", "work": f"/{SERVICE}/Work"}
ECHO = METHODS["echo"]
PAYLOAD = b"x" * 64
FLOOR_STAMP = ("stablewatch-stamp", "17:1764000000000000.1764000000000000.0.client")
SNAPSHOTS_PER_S = 10.0


@dataclass(frozen=True)
class Case:
    """What one case measures: which API, channel (and server), method, and whether snapshots run."""

    api: str  # "sync" or "aio"
    channel: str  # plain, noop, stamp_only, standin, least, bare, client_interceptor, intercepted
    method: str  # echo or work
    snapshots: bool
    key: str  # its name in the JSON line


def _cases() -> dict[str, Case]:
    sync = {
        "plain": Case("sync", "plain", "echo", False, "plain"),
        "no-op interceptors": Case("sync", "noop", "echo", False, "noop"),
        "stamp-only": Case("sync", "stamp_only", "echo", False, "stamp_only"),
        "stamp-only+snapshots": Case("sync", "stamp_only", "echo", True, "stamp_only_with_snapshots"),
        "client interceptor": Case("sync", "client_interceptor", "echo", False, "client_interceptor"),
        "instrumented": Case("sync", "intercepted", "echo", False, "intercepted"),
        "instrumented+snapshots": Case("sync", "intercepted", "echo", True, "with_snapshots"),
        "plain-pool instrumented+snapshots": Case("sync", "plain_pool", "echo", True, "plain_pool"),
        "realistic plain": Case("sync", "plain", "work", False, "realistic_plain"),
        "realistic stamp-only+snapshots": Case("sync", "stamp_only", "work", True, "realistic_stamp_only"),
        "realistic instrumented+snapshots": Case("sync", "intercepted", "work", True, "realistic"),
        "python stand-in+snapshots": Case("sync", "standin", "echo", True, "standin"),
        "realistic python stand-in+snapshots": Case("sync", "standin", "work", True, "realistic_standin"),
        "least agent+snapshots": Case("sync", "least", "echo", True, "least_agent"),
        "realistic least agent+snapshots": Case("sync", "least", "work", True, "realistic_least_agent"),
        "bare bookkeeping+snapshots": Case("sync", "bare", "echo", True, "bare_bookkeeping"),
    }
    aio = {  # an asyncio server has no worker pool: the plain pool's case is the sync server's alone
        f"aio {name}": Case("aio", case.channel, case.method, case.snapshots, f"aio_{case.key}")
        for name, case in sync.items()
        if case.channel != "plain_pool"
    }
    return sync | aio


CASES = _cases()
#: The ratios computed within each round: (JSON key, case, the case it is set against, measure).
#: ``p50`` and ``cpu`` give case / other - 1 (an overhead), ``rate`` case / other (a ratio).
RATIOS = (
    ("floor_overhead_p50", "instrumented+snapshots", "stamp-only+snapshots", "p50"),
    ("floor_throughput_ratio", "instrumented+snapshots", "stamp-only+snapshots", "rate"),
    ("floor_cpu_overhead", "instrumented+snapshots", "stamp-only+snapshots", "cpu"),
    ("realistic_overhead_p50", "realistic instrumented+snapshots", "realistic plain", "p50"),
    ("realistic_throughput_ratio", "realistic instrumented+snapshots", "realistic plain", "rate"),
    ("realistic_cpu_overhead", "realistic instrumented+snapshots", "realistic plain", "cpu"),
    ("realistic_floor_overhead_p50", "realistic stamp-only+snapshots", "realistic plain", "p50"),
    ("realistic_floor_throughput_ratio", "realistic stamp-only+snapshots", "realistic plain", "rate"),
    ("realistic_floor_cpu_overhead", "realistic stamp-only+snapshots", "realistic plain", "cpu"),
    ("realistic_over_floor_p50", "realistic instrumented+snapshots", "realistic stamp-only+snapshots", "p50"),
    (
        "realistic_over_floor_throughput_ratio",
        "realistic instrumented+snapshots",
        "realistic stamp-only+snapshots",
        "rate",
    ),
    # What Python of the agent's size costs in place, whatever it does (see "python stand-in" above).
    ("standin_floor_overhead_p50", "python stand-in+snapshots", "stamp-only+snapshots", "p50"),
    ("standin_floor_throughput_ratio", "python stand-in+snapshots", "stamp-only+snapshots", "rate"),
    ("standin_floor_cpu_overhead", "python stand-in+snapshots", "stamp-only+snapshots", "cpu"),
    ("over_standin_p50", "instrumented+snapshots", "python stand-in+snapshots", "p50"),
    ("over_standin_cpu_overhead", "instrumented+snapshots", "python stand-in+snapshots", "cpu"),
    ("realistic_standin_overhead_p50", "realistic python stand-in+snapshots", "realistic plain", "p50"),
    ("realistic_standin_throughput_ratio", "realistic python stand-in+snapshots", "realistic plain", "rate"),
    ("realistic_standin_cpu_overhead", "realistic python stand-in+snapshots", "realistic plain", "cpu"),
    # What the least agent (least_agent.py) costs in place: the facts any agent must keep, written plainly.
    ("least_floor_overhead_p50", "least agent+snapshots", "stamp-only+snapshots", "p50"),
    ("least_floor_throughput_ratio", "least agent+snapshots", "stamp-only+snapshots", "rate"),
    ("least_floor_cpu_overhead", "least agent+snapshots", "stamp-only+snapshots", "cpu"),
    ("bare_floor_overhead_p50", "bare bookkeeping+snapshots", "stamp-only+snapshots", "p50"),
    ("bare_floor_throughput_ratio", "bare bookkeeping+snapshots", "stamp-only+snapshots", "rate"),
    ("bare_floor_cpu_overhead", "bare bookkeeping+snapshots", "stamp-only+snapshots", "cpu"),
    ("over_least_p50", "instrumented+snapshots", "least agent+snapshots", "p50"),
    ("over_least_cpu_overhead", "instrumented+snapshots", "least agent+snapshots", "cpu"),
    # The sync agent without its worker pool (a plain one): what the pool's picture costs in place.
    ("plain_pool_floor_overhead_p50", "plain-pool instrumented+snapshots", "stamp-only+snapshots", "p50"),
    ("plain_pool_floor_throughput_ratio", "plain-pool instrumented+snapshots", "stamp-only+snapshots", "rate"),
    ("plain_pool_floor_cpu_overhead", "plain-pool instrumented+snapshots", "stamp-only+snapshots", "cpu"),
    ("pool_picture_p50", "instrumented+snapshots", "plain-pool instrumented+snapshots", "p50"),
    ("pool_picture_cpu_overhead", "instrumented+snapshots", "plain-pool instrumented+snapshots", "cpu"),
    ("plain_pool_over_least_p50", "plain-pool instrumented+snapshots", "least agent+snapshots", "p50"),
    ("plain_pool_over_least_cpu_overhead", "plain-pool instrumented+snapshots", "least agent+snapshots", "cpu"),
    ("realistic_least_overhead_p50", "realistic least agent+snapshots", "realistic plain", "p50"),
    ("realistic_least_throughput_ratio", "realistic least agent+snapshots", "realistic plain", "rate"),
    ("realistic_least_cpu_overhead", "realistic least agent+snapshots", "realistic plain", "cpu"),
    ("noop_overhead_p50", "no-op interceptors", "plain", "p50"),
    ("overhead_p50", "instrumented", "plain", "p50"),
    ("overhead_p50_with_snapshots", "instrumented+snapshots", "plain", "p50"),
    ("noop_cpu_overhead", "no-op interceptors", "plain", "cpu"),
    ("stamp_only_overhead_p50", "stamp-only", "plain", "p50"),
    ("stamp_only_cpu_overhead", "stamp-only", "plain", "cpu"),
    ("stamp_only_throughput_ratio", "stamp-only", "plain", "rate"),
    ("client_interceptor_overhead_p50", "client interceptor", "plain", "p50"),
    ("client_interceptor_throughput_ratio", "client interceptor", "plain", "rate"),
    ("cpu_overhead", "instrumented", "plain", "cpu"),
    ("cpu_overhead_with_snapshots", "instrumented+snapshots", "plain", "cpu"),
    ("throughput_ratio", "instrumented", "plain", "rate"),
    ("throughput_ratio_with_snapshots", "instrumented+snapshots", "plain", "rate"),
)
#: Issue 27's targets: (ratio key, "at_most" or "at_least", bound), for each API.
TARGETS = (
    ("floor_overhead_p50", "at_most", 0.05),
    ("floor_throughput_ratio", "at_least", 0.95),
    ("realistic_overhead_p50", "at_most", 0.03),
    ("realistic_throughput_ratio", "at_least", 0.97),
)
#: Each API's server and client roles (one process each), also their agents' process ids.
ROLES_OF = {"sync": ("server", "client"), "aio": ("aio-server", "aio-client")}


class NoopServerInterceptor(grpc.ServerInterceptor):
    """Passes every call through: what gRPC's interceptor machinery alone costs."""

    def intercept_service(self, continuation, handler_call_details):
        return continuation(handler_call_details)


class NoopClientInterceptor(grpc.UnaryUnaryClientInterceptor):
    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(client_call_details, request)


class StampOnlyServerInterceptor(grpc.ServerInterceptor):
    """Sees each call arrive and sets one stamp-sized trailing metadata entry when its handler ends,
    and nothing more; the handler is wrapped once, as the agent's interceptor does. With ``standin``,
    each call also runs :func:`standin` with that many iterations as its handler starts."""

    def __init__(self, standin: int = 0) -> None:
        self._wrapped: dict[int, object] = {}
        self._standin = standin

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        wrapped = self._wrapped.get(id(handler))
        if wrapped is None:
            behavior, iterations = handler.unary_unary, self._standin

            def stamped(request, context):
                if iterations:
                    standin(iterations)
                try:
                    return behavior(request, context)
                finally:
                    context.set_trailing_metadata((FLOOR_STAMP,))

            wrapped = self._wrapped[id(handler)] = handler._replace(unary_unary=stamped)
        return wrapped


class StampOnlyMethod:
    """A unary method that adds one stamp-sized metadata entry to each request and reads the
    response's trailing metadata, and nothing more, the way the agent's instrumented channel calls
    (with ``standin``, after :func:`standin` with that many iterations, as the call goes out)."""

    def __init__(self, method: grpc.UnaryUnaryMultiCallable, standin: int = 0) -> None:
        self._method = method
        self._standin = standin

    def __call__(self, request, metadata=None, **options):
        if self._standin:
            standin(self._standin)
        metadata = (*metadata, FLOOR_STAMP) if metadata else (FLOOR_STAMP,)
        response, call = self._method.with_call(request, metadata=metadata, **options)
        call.trailing_metadata()
        return response


class AioStampOnlyServerInterceptor(grpc.aio.ServerInterceptor):
    """The asyncio server's stamp-only floor: one stamp-sized trailing entry set when the handler ends,
    the handler wrapped once per method, as the agent's asyncio interceptor does (``standin``: as
    :class:`StampOnlyServerInterceptor`'s)."""

    def __init__(self, standin: int = 0) -> None:
        self._wrapped: dict[int, tuple[object, object]] = {}
        self._standin = standin

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]], handler_call_details: Any
    ) -> Any:
        handler = await continuation(handler_call_details)
        kept = self._wrapped.get(id(handler))
        if kept is None or kept[0] is not handler:
            behavior, iterations = handler.unary_unary, self._standin

            async def stamped(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if iterations:
                    standin(iterations)
                try:
                    return await behavior(request, context)
                finally:
                    context.set_trailing_metadata((FLOOR_STAMP,))

            kept = self._wrapped[id(handler)] = (handler, handler._replace(unary_unary=stamped))
        return kept[1]


class AioStampOnlyMethod:
    """An asyncio unary method that adds one stamp-sized entry to each request and reads the response's
    trailing metadata, and nothing more, as the agent's asyncio client interceptor reads it
    (``standin``: as :class:`StampOnlyMethod`'s)."""

    def __init__(self, method: grpc.aio.UnaryUnaryMultiCallable, standin: int = 0) -> None:
        self._method = method
        self._standin = standin

    async def __call__(self, request: Any, metadata: Any = None, **options: Any) -> Any:
        if self._standin:
            standin(self._standin)
        metadata = (*metadata, FLOOR_STAMP) if metadata else (FLOOR_STAMP,)
        call = self._method(request, metadata=metadata, **options)
        response = await call
        await call.trailing_metadata()
        return response


class AioNoopServerInterceptor(grpc.aio.ServerInterceptor):
    """Passes every asyncio call through: what grpc.aio's interceptor machinery alone costs."""

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]], handler_call_details: Any
    ) -> Any:
        return await continuation(handler_call_details)


class AioNoopClientInterceptor(grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(
        self, continuation: Callable[..., Any], client_call_details: Any, request: Any
    ) -> Any:
        return await continuation(client_call_details, request)


PROBED = {
    "agent": ("arrive", "handler_started", "respond", "call_ended", "call_out", "call_returned"),
    "interceptors": ("_details_with", "_aio_details_with", "stamp_of", "current_task_name"),
    "channel": ("stamp_of", "take_in_end", "current_task_name"),
}


def install_probe(role: str) -> None:
    """Wrap the agent's and the interceptors' steps to add up their thread CPU time; print it at exit."""
    import grpc._server

    from stablewatch.agents.rpc import agent as rpc_agent
    from stablewatch.agents.rpc import aio_channel as rpc_aio_channel
    from stablewatch.agents.rpc import channel as rpc_channel
    from stablewatch.agents.rpc import interceptors as rpc_interceptors
    from stablewatch.agents.rpc import pool as rpc_pool

    cost: dict[str, int] = {}
    calls: dict[str, int] = {}

    def timed(owner: object, name: str, label: str | None = None) -> None:
        original, label = getattr(owner, name), label or name
        clock = time.thread_time_ns

        def step(*args: object, **kwargs: object) -> object:
            began = clock()
            try:
                return original(*args, **kwargs)
            finally:
                cost[label] = cost.get(label, 0) + clock() - began
                calls[label] = calls.get(label, 0) + 1

        setattr(owner, name, step)

    for name in PROBED["agent"]:
        timed(rpc_agent.RpcAgent, name)
    for name in PROBED["interceptors"]:
        timed(rpc_interceptors, name)
    for name in PROBED["channel"]:  # the same helpers, as the instrumented channel's module holds them
        timed(rpc_channel, name)
    timed(rpc_interceptors.ServerInterceptor, "intercept_service")
    timed(rpc_pool.WorkerExecutor, "submit", "WorkerExecutor.submit")  # the agent's pool, its base's inside it
    timed(futures.ThreadPoolExecutor, "submit", "ThreadPoolExecutor.submit")
    # Whole steps, the agent's and its floor's alike (see the module docstring).
    timed(rpc_channel._UnaryUnary, "__call__", "instrumented call")
    timed(rpc_aio_channel._Method, "__call__", "aio instrumented call, its start")
    timed(grpc.aio._channel.UnaryUnaryMultiCallable, "__call__", "grpc.aio call start")
    timed(StampOnlyMethod, "__call__", "stamp-only call")
    for name in ("_handle_call", "_unary_response_in_pool"):
        timed(grpc._server, name, f"grpc {name}")
    collections = {"began": 0, "passes": [0, 0, 0], "ns": [0, 0, 0]}

    def collected(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            collections["began"] = time.perf_counter_ns()
        else:
            collections["passes"][info["generation"]] += 1
            collections["ns"][info["generation"]] += time.perf_counter_ns() - collections["began"]

    gc.callbacks.append(collected)

    def report() -> None:
        steps = {name: [round(cost[name] / calls[name] / 1000, 2), calls[name]] for name in cost}
        print(f"probe {role} {json.dumps(steps)}", file=sys.stderr, flush=True)
        passes, took = collections["passes"], [round(ns / 1e6, 1) for ns in collections["ns"]]
        print(f"probe-gc {role} {json.dumps({'passes': passes, 'ms': took})}", file=sys.stderr, flush=True)

    atexit.register(report)


# -- the realistic handler -----------------------------------------------------------------------------


def busy(iterations: int) -> int:
    """CPU work in pure Python, holding the GIL as a handler's own code does."""
    total = 0
    for number in range(iterations):
        total += number
    return total


class _StandInItem:
    __slots__ = ("at", "name", "peer", "seq")

    def __init__(self, seq: int, peer: str, name: str, at: int) -> None:
        self.seq, self.peer, self.name, self.at = seq, peer, name, at


_STANDIN_LOCK = threading.Lock()
_STANDIN_TABLE: dict[int, _StandInItem] = {}


def standin(iterations: int) -> None:
    """Python of the plainest kind, the kind an agent's step per call is made of, that does nothing:
    per iteration an object with four fields, an f-string, a clock read, a lock taken and released,
    and a dict entry set and removed. Its cost in place, set beside its cost here alone, is what
    any Python on the call path costs (the ``python stand-in`` cases), at least: a loop touches the
    same few objects each turn, so only its first turn runs cold, where the agent's steps, each its
    own code and objects, run cold throughout (``rpc_hot_path.py --cold``)."""
    for seq in range(iterations):
        item = _StandInItem(seq, "peer", f"/bench.Echo/Call#peer:{seq}", time.time_ns())
        _STANDIN_LOCK.acquire()
        try:
            _STANDIN_TABLE[seq] = item
        finally:
            _STANDIN_LOCK.release()
        _STANDIN_TABLE.pop(seq, None)


def cpu_us_of(work: Callable[[int], object], iterations: int, repeats: int = 15) -> float:
    """The fewest µs of this thread's CPU time that ``work(iterations)`` took in ``repeats`` runs."""
    fastest = None
    for _ in range(repeats):
        began = time.thread_time_ns()
        work(iterations)
        took = time.thread_time_ns() - began
        fastest = took if fastest is None else min(fastest, took)
    return (fastest or 1) / 1000


def calibrate_busy(cpu_us: float) -> tuple[int, float]:
    """Iterations of :func:`busy` that take about ``cpu_us`` of CPU here, and the µs they measured."""
    probe = 20_000
    iterations = max(1, round(probe * cpu_us / cpu_us_of(busy, probe)))
    return iterations, round(cpu_us_of(busy, iterations), 1)


def calibrate_standin(standin_us: float) -> tuple[int, float]:
    """One side's :func:`standin` iterations for half of ``standin_us`` (the whole call's, both sides),
    and the µs they measured: the count whose one call comes nearest, each count timed as it runs
    (an iteration is about half a microsecond, so a count from a long run's rate would miss by one)."""
    target, iterations = standin_us / 2, 1
    measured = cpu_us_of(standin, iterations, repeats=200)
    while measured < target:
        more = cpu_us_of(standin, iterations + 1, repeats=200)
        if more - target > target - measured:
            break
        iterations, measured = iterations + 1, more
    return iterations, round(measured, 2)


def sync_handlers(io_seconds: float, iterations: int) -> grpc.GenericRpcHandler:
    def work(request: bytes, context: grpc.ServicerContext) -> bytes:
        time.sleep(io_seconds)  # standing for a downstream call
        busy(iterations)
        return request

    methods = {
        "Call": grpc.unary_unary_rpc_method_handler(lambda request, context: request),
        "Work": grpc.unary_unary_rpc_method_handler(work),
    }
    return grpc.method_handlers_generic_handler(SERVICE, methods)


def aio_handlers(io_seconds: float, iterations: int) -> grpc.GenericRpcHandler:
    async def echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return request

    async def work(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        await asyncio.sleep(io_seconds)  # standing for a downstream call
        busy(iterations)
        return request

    methods = {"Call": grpc.unary_unary_rpc_method_handler(echo), "Work": grpc.unary_unary_rpc_method_handler(work)}
    return grpc.method_handlers_generic_handler(SERVICE, methods)


def start_agent(process_id: str, detector: str) -> RpcAgent:
    agent = RpcAgent(process_id, detector=detector)
    agent.start()
    return agent


# -- the roles, each in its own process ------------------------------------------------------------


def serve(args: argparse.Namespace) -> None:
    """The sync servers, until stdin closes."""
    agent = start_agent("server", args.detector)
    iterations, measured = calibrate_busy(args.cpu_us)
    standins, standin_us = calibrate_standin(args.standin_us)
    servers = {}
    instrumented_pool = agent.thread_pool(args.workers, thread_name_prefix="intercepted-worker")  # the README's
    least, bare = LeastAgent("server"), LeastAgent("server", facts=False)
    kinds = (
        ("plain", [], None),
        ("noop", [NoopServerInterceptor()], None),
        ("stamp_only", [StampOnlyServerInterceptor()], None),
        ("standin", [StampOnlyServerInterceptor(standins)], None),
        ("least", [least.server_interceptor()], None),
        ("bare", [bare.server_interceptor()], None),
        # for both of the agent's clients (the instrumented channel and the client interceptor)
        ("intercepted", [agent.server_interceptor(workers=instrumented_pool)], instrumented_pool),
        ("plain_pool", [agent.server_interceptor()], None),  # the agent without its pool's picture
    )
    for kind, interceptors, own_pool in kinds:
        pool = own_pool or futures.ThreadPoolExecutor(args.workers, thread_name_prefix=f"{kind}-worker")
        server = grpc.server(pool, interceptors=interceptors)
        server.add_generic_rpc_handlers([sync_handlers(args.io_ms / 1000, iterations)])
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers[kind] = (server, f"127.0.0.1:{port}")
    emit(
        addresses={kind: address for kind, (_, address) in servers.items()},
        iterations=iterations,
        cpu_us=measured,
        standin_iterations=standins,
        standin_us=standin_us,
    )
    sys.stdin.read()  # until the orchestrator closes it
    for server, _ in servers.values():
        server.stop(0).wait()
    agent.stop()


def aio_serve(args: argparse.Namespace) -> None:
    """The asyncio servers, until stdin closes."""
    asyncio.run(aio_servers(args))


async def aio_servers(args: argparse.Namespace) -> None:
    agent = start_agent("aio-server", args.detector)
    iterations, measured = calibrate_busy(args.cpu_us)
    standins, standin_us = calibrate_standin(args.standin_us)
    kinds = (
        ("plain", []),
        ("noop", [AioNoopServerInterceptor()]),
        ("stamp_only", [AioStampOnlyServerInterceptor()]),
        ("standin", [AioStampOnlyServerInterceptor(standins)]),
        ("least", [LeastAgent("aio-server").aio_server_interceptor()]),
        ("bare", [LeastAgent("aio-server", facts=False).aio_server_interceptor()]),
        ("intercepted", [agent.aio_server_interceptor()]),
    )
    servers = {}
    for kind, interceptors in kinds:
        server = grpc.aio.server(interceptors=interceptors)
        server.add_generic_rpc_handlers([aio_handlers(args.io_ms / 1000, iterations)])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers[kind] = (server, f"127.0.0.1:{port}")
    emit(
        addresses={kind: address for kind, (_, address) in servers.items()},
        iterations=iterations,
        cpu_us=measured,
        standin_iterations=standins,
        standin_us=standin_us,
    )
    await asyncio.to_thread(sys.stdin.read)  # until the orchestrator closes it
    for server, _ in servers.values():
        await server.stop(0)
    agent.stop()


def call(args: argparse.Namespace) -> None:
    """Measure sync phases on the orchestrator's command (one JSON line in, one out) until stdin closes."""
    agent = start_agent("client", args.detector)
    least, bare = LeastAgent("client"), LeastAgent("client", facts=False)
    addresses = json.loads(args.peer)
    channels = {
        "plain": grpc.insecure_channel(addresses["plain"]),
        "noop": grpc.intercept_channel(grpc.insecure_channel(addresses["noop"]), NoopClientInterceptor()),
        "stamp_only": grpc.insecure_channel(addresses["stamp_only"]),
        "standin": grpc.insecure_channel(addresses["standin"]),
        "least": grpc.insecure_channel(addresses["least"]),
        "bare": grpc.insecure_channel(addresses["bare"]),
        "client_interceptor": grpc.intercept_channel(
            grpc.insecure_channel(addresses["intercepted"]), agent.client_interceptor("server")
        ),
        "intercepted": agent.instrument_channel(grpc.insecure_channel(addresses["intercepted"]), "server"),
        "plain_pool": agent.instrument_channel(grpc.insecure_channel(addresses["plain_pool"]), "server"),
    }
    methods = {
        (kind, name): channel.unary_unary(path) for kind, channel in channels.items() for name, path in METHODS.items()
    }
    standins, standin_us = calibrate_standin(args.standin_us)
    for name in METHODS:
        methods["stamp_only", name] = StampOnlyMethod(methods["stamp_only", name])
        methods["standin", name] = StampOnlyMethod(methods["standin", name], standins)
        methods["least", name] = least.method(methods["least", name], "server")
        methods["bare", name] = bare.method(methods["bare", name], "server")
    for method in methods.values():  # connect every channel before anything is measured
        method(PAYLOAD, wait_for_ready=True, timeout=30)
    emit(ready=True, standin_iterations=standins, standin_us=standin_us)
    for line in sys.stdin:
        phase = json.loads(line)
        method = methods[phase["channel"], phase["method"]]
        emit(**measure(method, args.concurrency, phase["warmup"], phase["seconds"], args.server_pid))
    for channel in channels.values():
        channel.close()
    agent.stop()


def aio_call(args: argparse.Namespace) -> None:
    """Measure asyncio phases on the orchestrator's command until stdin closes."""
    asyncio.run(aio_client(args))


async def aio_client(args: argparse.Namespace) -> None:
    agent = start_agent("aio-client", args.detector)
    least, bare = LeastAgent("aio-client"), LeastAgent("aio-client", facts=False)
    addresses = json.loads(args.peer)
    channels = {
        "plain": grpc.aio.insecure_channel(addresses["plain"]),
        "noop": grpc.aio.insecure_channel(addresses["noop"], interceptors=[AioNoopClientInterceptor()]),
        "stamp_only": grpc.aio.insecure_channel(addresses["stamp_only"]),
        "standin": grpc.aio.insecure_channel(addresses["standin"]),
        "least": grpc.aio.insecure_channel(addresses["least"]),
        "bare": grpc.aio.insecure_channel(addresses["bare"]),
        "client_interceptor": grpc.aio.insecure_channel(
            addresses["intercepted"], interceptors=agent.aio_client_interceptors("aio-server")
        ),
        "intercepted": agent.instrument_channel(grpc.aio.insecure_channel(addresses["intercepted"]), "aio-server"),
    }
    methods = {
        (kind, name): channel.unary_unary(path) for kind, channel in channels.items() for name, path in METHODS.items()
    }
    standins, standin_us = calibrate_standin(args.standin_us)
    for name in METHODS:
        methods["stamp_only", name] = AioStampOnlyMethod(methods["stamp_only", name])
        methods["standin", name] = AioStampOnlyMethod(methods["standin", name], standins)
        methods["least", name] = least.aio_method(methods["least", name], "aio-server")
        methods["bare", name] = bare.aio_method(methods["bare", name], "aio-server")
    for method in methods.values():  # connect every channel before anything is measured
        await method(PAYLOAD, wait_for_ready=True, timeout=30)
    emit(ready=True, standin_iterations=standins, standin_us=standin_us)
    while line := await asyncio.to_thread(sys.stdin.readline):
        phase = json.loads(line)
        method = methods[phase["channel"], phase["method"]]
        emit(**await aio_measure(method, args.concurrency, phase["warmup"], phase["seconds"], args.server_pid))
    for channel in channels.values():
        await channel.close()
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


class Window:
    """One measured phase: its window, and what the callers record in it."""

    def __init__(self, concurrency: int, warmup: float, seconds: float) -> None:
        self.start = time.monotonic() + warmup
        self.end = self.start + seconds
        self.seconds = seconds
        self.start_ns, self.end_ns = int(self.start * 1e9), int(self.end * 1e9)
        self.latencies: list[list[int]] = [[] for _ in range(concurrency)]
        self.completed_at: list[int] = [0] * concurrency
        self.straddling: list[int] = []  # calls that began in the warm-up and ended in the window
        self.cpu: list[tuple[float, float]] = []

    def record(self, number: int, began: int, done: int) -> None:
        """Caller `number`'s call from `began` to `done` (monotonic ns): measured if it began in the
        window, kept aside if it began in the warm-up and ended in the window."""
        if began >= self.start_ns:
            self.latencies[number].append(done - began)
            self.completed_at[number] = done
        elif done >= self.start_ns:
            self.straddling.append(done - began)

    def result(self) -> dict:
        """The calls started in the window, and the CPU time both processes spent in it.

        Should no call that started in the window end (every caller stalled for longer than the
        window, as happened once on a loaded machine with a window of half a second), the calls
        that ended in it stand for them."""
        samples = sorted(value for mine in self.latencies for value in mine) or sorted(self.straddling)
        if not samples:
            raise RuntimeError(f"no call ended in the {self.seconds:g} s window: every caller stalled through it")
        started = any(self.latencies)
        window = max(max(self.completed_at) - self.start_ns, 1) / 1e9 if started else self.seconds
        cpu = self.cpu
        return {
            "calls": len(samples),
            "window": [self.start, self.start + window],
            "per_s": len(samples) / window,
            "p50_us": samples[len(samples) // 2] / 1000,
            "p99_us": samples[min(len(samples) - 1, int(len(samples) * 0.99))] / 1000,
            "client_cpu_s": cpu[1][0] - cpu[0][0],
            "server_cpu_s": cpu[1][1] - cpu[0][1],
        }


def measure(
    method: Callable[[bytes], object], concurrency: int, warmup: float, seconds: float, server_pid: int
) -> dict:
    """``concurrency`` closed-loop caller threads for warmup + seconds (see :class:`Window`)."""
    window = Window(concurrency, warmup, seconds)

    def loop(number: int) -> None:
        clock, record, end_ns = time.monotonic_ns, window.record, window.end_ns
        while True:
            began = clock()
            if began >= end_ns:
                return
            method(PAYLOAD)
            record(number, began, clock())

    threads = [threading.Thread(target=loop, args=(n,)) for n in range(concurrency)]
    threads.append(threading.Thread(target=sample_cpu, args=(server_pid, window.start, window.end, window.cpu)))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return window.result()


async def aio_measure(
    method: Callable[[bytes], Awaitable[object]], concurrency: int, warmup: float, seconds: float, server_pid: int
) -> dict:
    """``concurrency`` closed-loop caller tasks for warmup + seconds (see :class:`Window`)."""
    window = Window(concurrency, warmup, seconds)

    async def loop(number: int) -> None:
        clock, record, end_ns = time.monotonic_ns, window.record, window.end_ns
        while True:
            began = clock()
            if began >= end_ns:
                return
            await method(PAYLOAD)
            record(number, began, clock())

    sampler = asyncio.to_thread(sample_cpu, server_pid, window.start, window.end, window.cpu)
    await asyncio.gather(*(loop(n) for n in range(concurrency)), sampler)
    return window.result()


ROLES = {"server": serve, "client": call, "aio-server": aio_serve, "aio-client": aio_call}


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

    def measure(self, kind: str) -> float:
        """The figure a ratio of ``kind`` (p50, rate, cpu) is taken of."""
        return {"p50": self.p50_us, "rate": self.per_s, "cpu": self.cpu_us}[kind]


async def run_phase(client: Child, case: str, args: argparse.Namespace, coordinator: Coordinator) -> Phase:
    completed: list[float] = []
    snapshots = None
    if CASES[case].snapshots:
        snapshots = asyncio.ensure_future(take_snapshots(coordinator, completed, SNAPSHOTS_PER_S))
    try:
        client.send(channel=CASES[case].channel, method=CASES[case].method, warmup=args.warmup, seconds=args.seconds)
        result = await client.read(timeout=args.warmup + args.seconds + 120)
    finally:
        if snapshots is not None:
            await stop_snapshots(snapshots)
    start, end = result["window"]
    taken = sum(start <= t <= end for t in completed)
    calls = result["calls"] or 1
    client_cpu, server_cpu = result["client_cpu_s"] * 1e6 / calls, result["server_cpu_s"] * 1e6 / calls
    return Phase(result["p50_us"], result["p99_us"], result["per_s"], end - start, client_cpu, server_cpu, taken)


def apis(args: argparse.Namespace) -> tuple[str, ...]:
    return ("sync", "aio") if args.api == "both" else (args.api,)


async def orchestrate(args: argparse.Namespace) -> tuple[list[dict[str, Phase]], dict[str, dict]]:
    async with served_coordinator() as (coordinator, detector):
        return await measure_rounds(args, coordinator, detector)


async def measure_rounds(
    args: argparse.Namespace, coordinator: Coordinator, detector: str
) -> tuple[list[dict[str, Phase]], dict[str, dict]]:
    """Start each API's server and client processes, attached to ``detector``, and run every round.
    Returns the rounds and each server's calibration (``iterations``, ``cpu_us``)."""
    children: list[Child] = []
    clients: dict[str, Child] = {}
    calibration: dict[str, dict] = {}
    rounds: list[dict[str, Phase]] = []
    probe = ["--probe"] if args.probe else []
    try:
        for api in apis(args):
            server_role, client_role = ROLES_OF[api]
            realistic = ["--io-ms", str(args.io_ms), "--cpu-us", str(args.cpu_us), "--standin-us", str(args.standin_us)]
            server = await Child.start(
                __file__, server_role, "--detector", detector, "--workers", str(args.workers), *realistic, *probe
            )
            children.append(server)
            config = await server.read()
            calibrated = ("iterations", "cpu_us", "standin_iterations", "standin_us")
            calibration[api] = {key: config[key] for key in calibrated}
            client = await Child.start(
                __file__,
                client_role,
                "--detector",
                detector,
                "--peer",
                json.dumps(config["addresses"]),
                "--concurrency",
                str(args.concurrency),
                "--server-pid",
                str(server.process.pid),
                "--standin-us",
                str(args.standin_us),
                *probe,
            )
            children.append(client)
            ready = await client.read()  # every channel connected
            calibration[api] |= {f"client_{key}": ready[key] for key in ("standin_iterations", "standin_us")}
            clients[api] = client
        members = {agent for api in apis(args) for agent in ROLES_OF[api]}
        await attached(coordinator, members)
        cases = tuple(case for case in CASES if case in args.cases and CASES[case].api in clients)
        for number in range(args.rounds):
            order = cases[number % len(cases) :] + cases[: number % len(cases)]  # rotate against drift
            measured = {case: await run_phase(clients[CASES[case].api], case, args, coordinator) for case in order}
            rounds.append(measured)
            line = ", ".join(
                f"{case} p50 {m.p50_us:.0f} µs {m.per_s:,.0f}/s CPU {m.cpu_us:.0f} µs/call"
                for case, m in measured.items()
            )
            print(f"round {number + 1}/{args.rounds}: {line}", file=sys.stderr, flush=True)
    finally:
        for child in reversed(children):  # clients first
            await child.close()
        deadline = time.monotonic() + 5
        while coordinator.members and time.monotonic() < deadline:  # the control streams end first
            await asyncio.sleep(0.01)
    return rounds, calibration


def ratios(rounds: list[dict[str, Phase]], prefix: str, names: dict[str, str]) -> dict[str, list[float]]:
    """Every ratio of :data:`RATIOS` whose cases ran, per round; ``names`` maps a sync case's name to
    the name it has in this API (``prefix`` goes before the keys)."""
    found: dict[str, list[float]] = {}
    for key, case, other, kind in RATIOS:
        if case not in names or other not in names:
            continue
        case, other = names[case], names[other]
        # A round whose window saw its process use less than a clock tick of CPU (a stall on a
        # loaded machine, in a short window) has no CPU ratio: it is left out.
        values = [r[case].measure(kind) / r[other].measure(kind) for r in rounds if r[other].measure(kind)]
        values = values or [float("nan")]
        found[prefix + key] = values if kind == "rate" else [value - 1 for value in values]
    return found


def api_names(api: str, ran: Iterable[str]) -> dict[str, str]:
    """Each sync case's name in ``api`` (the asyncio ones are ``aio <case>``), for its cases that ran."""
    prefix, ran = "aio " if api == "aio" else "", set(ran)
    return {name: prefix + name for name in CASES if CASES[name].api == "sync" and prefix + name in ran}


def all_ratios(args: argparse.Namespace, rounds: list[dict[str, Phase]]) -> dict[str, list[float]]:
    """Every ratio whose two cases ran, of each API, per round."""
    figures: dict[str, list[float]] = {}
    for api in apis(args):
        figures |= ratios(rounds, "aio_" if api == "aio" else "", api_names(api, rounds[0]))
    return figures


def report(
    args: argparse.Namespace,
    rounds: list[dict[str, Phase]],
    calibration: dict[str, dict],
    figures: dict[str, list[float]],
) -> dict[str, object]:
    """The JSON line's object: each case that ran, the ``figures`` (:func:`all_ratios`) and their targets."""

    def per_round(function: Callable[[dict[str, Phase]], float]) -> list[float]:
        return [function(r) for r in rounds]

    median = statistics.median
    ran = [case for case in CASES if case in rounds[0]]
    result: dict[str, object] = {"seconds": args.seconds, "warmup": args.warmup, "rounds": args.rounds}
    result |= {"concurrency": args.concurrency, "workers": args.workers, "api": args.api}
    for case in ran:
        key = CASES[case].key
        p50, rate = per_round(lambda r, c=case: r[c].p50_us), per_round(lambda r, c=case: r[c].per_s)
        result[f"{key}_p50_us"] = round(median(p50), 1)
        result[f"{key}_p50_us_spread"] = spread(p50, 1)
        result[f"{key}_p99_us"] = round(median(per_round(lambda r, c=case: r[c].p99_us)), 1)
        result[f"{key}_calls_per_s"] = round(median(rate))
        result[f"{key}_calls_per_s_spread"] = spread(rate, 0)
        result[f"{key}_cpu_us_per_call"] = round(median(per_round(lambda r, c=case: r[c].cpu_us)), 1)
        result[f"{key}_client_cpu_us"] = round(median(per_round(lambda r, c=case: r[c].client_cpu_us)), 1)
        result[f"{key}_server_cpu_us"] = round(median(per_round(lambda r, c=case: r[c].server_cpu_us)), 1)
    for key, values in figures.items():
        result[key] = round(median(values), 4)
        result[f"{key}_spread"] = spread(values, 4)
    snapshot_cases = [case for case in ran if CASES[case].snapshots]
    snapshots = sum(r[case].snapshots for r in rounds for case in snapshot_cases)
    snapshot_seconds = sum(r[case].seconds for r in rounds for case in snapshot_cases)
    result["snapshots_completed"] = snapshots
    result["snapshots_per_s"] = round(snapshots / snapshot_seconds, 2) if snapshot_seconds else None
    result["realistic_handler"] = {
        "io_ms": args.io_ms,
        "io": "time.sleep (sync server), await asyncio.sleep (asyncio server): a downstream call",
        "cpu_us": args.cpu_us,
        "cpu": "busy(n): a pure-Python loop of n integer additions, n calibrated in each server process",
        **{f"{api}_iterations": calibration[api]["iterations"] for api in calibration},
        **{f"{api}_cpu_us_measured": calibration[api]["cpu_us"] for api in calibration},
    }
    result["python_standin"] = {
        "us_per_call": args.standin_us,
        "what": "standin(n) on each side, n calibrated in each process for half of us_per_call alone: per "
        "iteration an object of four fields, an f-string, a clock read, a lock, a dict entry set and removed",
        **{
            f"{api}_{side}_{measure}": calibration[api][f"{prefix}standin_{measure}"]
            for api in calibration
            for side, prefix in (("server", ""), ("client", "client_"))
            for measure in ("iterations", "us")
        },
    }
    targets: dict[str, bool] = {}
    for api in apis(args):
        prefix = "aio_" if api == "aio" else ""
        for key, sense, bound in TARGETS:
            if prefix + key not in figures:
                continue  # one of its cases did not run
            value = median(figures[prefix + key])
            targets[f"{prefix}{key}_{sense}_{bound:g}"] = value <= bound if sense == "at_most" else value >= bound
    result["targets"] = targets
    return result


def print_table(
    args: argparse.Namespace, rounds: list[dict[str, Phase]], result: dict[str, object], figures: dict[str, list[float]]
) -> None:
    table = rounds_table(
        f"unary calls, 64-byte echo and the realistic handler, {args.concurrency} client threads or tasks, "
        f"{args.workers} sync server workers: {args.rounds} interleaved rounds of {args.seconds:g} s per case "
        f"after {args.warmup:g} s of warm-up",
        len(rounds),
    )
    ran = [case for case in CASES if case in rounds[0]]
    for label, form, value in (
        ("p50 µs", ".0f", lambda p: p.p50_us),
        ("calls/s", ",.0f", lambda p: p.per_s),
        ("CPU µs/call", ".0f", lambda p: p.cpu_us),
    ):
        for case in ran:
            rounds_row(table, f"{case} {label}", [value(r[case]) for r in rounds], form)
    bounds = {key: f"{'<=' if sense == 'at_most' else '>='} {bound:g}" for key, sense, bound in TARGETS}
    for key, values in figures.items():
        rounds_row(table, key, values, ".3f", bounds.get(key.removeprefix("aio_"), ""))
    if result["snapshots_per_s"] is not None:
        rates = [
            sum(r[case].snapshots for case in ran if CASES[case].snapshots)
            / sum(r[case].seconds for case in ran if CASES[case].snapshots)
            for r in rounds
        ]
        rounds_row(table, "snapshots/s completed", rates, ".1f", "10 asked", result["snapshots_per_s"])
    print_whole(table, 220)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--seconds", type=float, default=10.0, help="seconds measured per case and round (10)")
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds of each case before measuring (1)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (5)")
    parser.add_argument("--concurrency", type=int, default=4, help="client threads (or tasks) calling at once (4)")
    parser.add_argument("--workers", type=int, default=4, help="worker threads of each sync server (4)")
    parser.add_argument("--api", choices=("both", "sync", "aio"), default="both", help="which gRPC API (both)")
    parser.add_argument("--io-ms", type=float, default=1.0, help="the realistic handler's wait on I/O, ms (1)")
    parser.add_argument("--cpu-us", type=float, default=100.0, help="the realistic handler's CPU, µs (100)")
    parser.add_argument(
        "--standin-us",
        type=float,
        default=4.0,
        help="the python stand-in's CPU per call alone, both sides together, µs (4: hot_path_agent_us's bound)",
    )
    parser.add_argument("--probe", action="store_true", help="time the agent's steps in place (see above)")
    parser.add_argument(
        "--cases",
        type=lambda text: [name.strip() for name in text.split(",")],  # a wrapped line's spaces too
        default=list(CASES),
        help="comma-separated cases to run (all by default; fewer for more rounds, one to profile)",
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
    if not any(CASES[case].api in apis(args) for case in args.cases):
        parser.error(f"none of the cases {', '.join(args.cases)} is of --api {args.api}")
    rounds, calibration = asyncio.run(orchestrate(args))
    figures = all_ratios(args, rounds)
    result = report(args, rounds, calibration, figures)
    print_table(args, rounds, result, figures)
    json_line(result)


if __name__ == "__main__":
    main()
