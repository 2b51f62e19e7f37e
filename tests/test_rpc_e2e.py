"""RPC mode end to end: a real detector, real gRPC services with the agent's interceptors, on loopback.

Services are generic handlers over raw bytes (no generated code); every agent, server and thread
is started and stopped by its test.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent import futures
from typing import Any

import grpc
import pytest
from rpc_harness import (
    SERVICE,
    Service,
    agent,
    aio_channel_to,
    call,
    channel_to,
    deadlock,
    gate_starts,
    handler_prefix,
    handler_task,
    snapshot,
    stamped,
    stored,
)

from polling import async_poll, poll, run
from stablewatch.agents.rpc.agent import RpcAgent
from stablewatch.agents.rpc.core import STAMP_KEY
from stablewatch.detector.evaluation.waitfor import waking_channels
from stablewatch.detector.service.query import outcome_name
from stablewatch.testing.detector import Running


def test_in_flight_response_and_request_are_in_the_channel_states(running: Running) -> None:
    """A response sent before its server recorded and taken in after its caller recorded is in flight;
    so is a request sent before its caller recorded and taken in after its server recorded."""
    release = threading.Event()
    s_agent = RpcAgent("S", detector=running.detector.address, heartbeat_interval=0.2)
    c_agent = RpcAgent("C", detector=running.detector.address, heartbeat_interval=0.2)
    s_gate, c_gate = gate_starts(s_agent), gate_starts(c_agent)
    s_agent.start()
    c_agent.start()
    service = Service({"Slow": lambda request, context: release.wait(20) and b"done:" + request}, s_agent)
    channel = channel_to(service, c_agent, "S")
    pool = futures.ThreadPoolExecutor(2, thread_name_prefix="caller")
    try:
        poll(lambda: s_agent.detector_connected and c_agent.detector_connected, "both attached")
        # 1. The caller records; the server has not yet when its response leaves.
        c_gate.set()
        reply = pool.submit(call, channel, "Slow", b"r1")
        poll(lambda: stamped(c_agent, "request"), "the request")
        first = asyncio.run_coroutine_threadsafe(running.detector.take_snapshot(deadline=10), running.loop)
        poll(lambda: c_agent.color > 0, "C recorded")
        release.set()
        assert reply.result(10) == b"done:r1"
        s_gate.set()
        results = first.result(20)
        assert outcome_name(results.snapshot.outcome) == "completed", results.snapshot.abort_reason
        cut = stored(running, results)
        channels = {(c.src, c.dst): c for c in cut.channels}
        (response,) = channels[("S", "C")].messages
        assert response.wakes_task.startswith("caller") and not response.no_wake
        assert not channels[("C", "S")].messages
        waits = {p.process_id: p.state.waits for p in cut.processes}
        (wait,) = waits["C"]  # the caller still waited on the callee's task when C recorded
        assert wait.task == response.wakes_task
        assert [(t.process, t.task) for t in wait.targets] == [("S", handler_task("Slow", c_agent, 1))]
        assert not deadlock(results).holds

        # 2. The server records first; the caller's request leaves before the caller records.
        c_gate.clear()
        second = asyncio.run_coroutine_threadsafe(running.detector.take_snapshot(deadline=10), running.loop)
        poll(lambda: s_agent.color > c_agent.color, "S recorded, C not")
        assert call(channel, "Slow", b"r2") == b"done:r2"  # its response makes C record first
        c_gate.set()
        results = second.result(20)
        assert outcome_name(results.snapshot.outcome) == "completed", results.snapshot.abort_reason
        channels = {(c.src, c.dst): c for c in stored(running, results).channels}
        (request,) = channels[("C", "S")].messages
        # It wakes only the handler it starts: no wait of S's, but the cut is not terminated.
        assert not request.no_wake and request.wakes_task == handler_task("Slow", c_agent, 2)
        assert waking_channels(stored(running, results)) == {("C", "S")}
        assert not channels[("S", "C")].messages
    finally:
        release.set()
        s_gate.set()
        c_gate.set()
        pool.shutdown(wait=True)
        channel.close()
        service.stop()
        c_agent.stop()
        s_agent.stop()


def test_a_call_cycle_through_full_pools_is_reported_as_a_deadlock_with_its_calls(running: Running) -> None:
    """T calls A.Ping; A's only worker calls B.Pong; B's only worker calls A.Ping, queued behind A's."""
    a_agent, b_agent, t_agent = agent(running, "A"), agent(running, "B"), agent(running, "T")
    channels: dict[str, grpc.Channel] = {}

    def ping(request: bytes, context: Any) -> bytes:
        return b"" if request == b"inner" else call(channels["A->B"], "Pong", timeout=30)

    def pong(request: bytes, context: Any) -> bytes:
        return call(channels["B->A"], "Ping", b"inner", timeout=30)

    a = Service({"Ping": ping}, a_agent, workers=1)
    b = Service({"Pong": pong}, b_agent, workers=1)
    channels["A->B"] = channel_to(b, a_agent, "B")
    channels["B->A"] = channel_to(a, b_agent, "A")
    t_channel = channel_to(a, t_agent, "A")
    pool = futures.ThreadPoolExecutor(1, thread_name_prefix="driver")
    try:
        outer = pool.submit(call, t_channel, "Ping", b"outer", timeout=30)
        poll(lambda: a_agent._pools[0].queued, "B's call queued at A")
        results = snapshot(running)
        assert outcome_name(results.snapshot.outcome) == "completed", results.snapshot.abort_reason
        found = deadlock(results)
        assert found.holds, found.summary
        cycle = {(node.process, node.task) for node in found.deadlock.cycle}
        ping_outer = handler_task("Ping", t_agent, 1)
        assert (("A", ping_outer)) in cycle
        assert any(p == "B" and t.startswith(handler_prefix("Pong", a_agent)) for p, t in cycle)
        assert any(p == "A" and t.startswith(handler_prefix("Ping", b_agent)) for p, t in cycle)
        assert ("T", "driver_0") in {(n.process, n.task) for n in found.deadlock.deadlocked}
    finally:
        for channel in (*channels.values(), t_channel):
            channel.close()
        a.stop()
        b.stop()
        with pytest.raises(grpc.RpcError):
            outer.result(30)
        pool.shutdown(wait=True)
        for each in (a_agent, b_agent, t_agent):
            each.stop()


def test_a_churning_call_graph_reports_no_deadlock(running: Running) -> None:
    a_agent, b_agent, t_agent = agent(running, "A"), agent(running, "B"), agent(running, "T")
    b = Service({"Leaf": lambda request, context: request}, b_agent, workers=1)
    a_to_b = channel_to(b, a_agent, "B")
    a = Service({"Work": lambda request, context: call(a_to_b, "Leaf", request)}, a_agent, workers=1)
    t_channel = channel_to(a, t_agent, "A")
    stop = threading.Event()

    def churn() -> int:
        done = 0
        while not stop.is_set():
            assert call(t_channel, "Work", b"x", timeout=20) == b"x"
            done += 1
        return done

    pool = futures.ThreadPoolExecutor(4, thread_name_prefix="churn")
    workers = [pool.submit(churn) for _ in range(4)]
    try:
        completed = 0
        for _ in range(15):
            results = snapshot(running)
            assert outcome_name(results.snapshot.outcome) == "completed", results.snapshot.abort_reason
            assert not deadlock(results).holds, deadlock(results).summary
            completed += 1
        assert completed == 15
    finally:
        stop.set()
        calls = sum(worker.result(30) for worker in workers)
        pool.shutdown(wait=True)
        assert calls > 0
        for channel in (a_to_b, t_channel):
            channel.close()
        a.stop()
        b.stop()
        for each in (a_agent, b_agent, t_agent):
            each.stop()


@pytest.mark.parametrize(
    ("stamp", "why"),
    [("1:garbage", "stamp"), ("1:-1.0.0.X", "stamp"), (f"1:{(1 << 62)}.1.0.X", "color"), ("0.0.0.X", "seq")],
)
def test_a_bad_stamp_is_refused_with_invalid_argument_and_counted(running: Running, stamp: str, why: str) -> None:
    s_agent = agent(running, "S")
    handled: list[bytes] = []
    service = Service({"Echo": lambda request, context: handled.append(request) or request}, s_agent)
    try:
        with grpc.insecure_channel(service.address) as channel, pytest.raises(grpc.RpcError) as refused:
            call(channel, "Echo", b"x", metadata=((STAMP_KEY, stamp),), timeout=10)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "bad stamp" in refused.value.details() and why in refused.value.details()
        assert not handled
        assert s_agent.color == 0
        value = s_agent.metrics.registry.get_sample_value("stablewatch_agent_rpc_bad_stamps_total", {"side": "server"})
        assert value == 1
    finally:
        service.stop()
        s_agent.stop()


def test_uninstrumented_peers_pass_through_and_are_outside_peers(running: Running) -> None:
    s_agent = agent(running, "S")
    plain = Service({"Echo": lambda request, context: request}, None)  # a service without an agent
    to_plain = channel_to(plain, s_agent, None)
    service = Service({"Relay": lambda request, context: call(to_plain, "Echo", request)}, s_agent)
    try:
        with grpc.insecure_channel(service.address) as channel:  # a client without an agent
            assert call(channel, "Relay", b"hello", timeout=10) == b"hello"
        sample = s_agent.metrics.registry.get_sample_value
        assert sample("stablewatch_agent_rpc_uninstrumented_calls_total", {"direction": "inbound"}) == 1
        assert sample("stablewatch_agent_rpc_uninstrumented_calls_total", {"direction": "outbound"}) == 1
        results = snapshot(running)
        assert outcome_name(results.snapshot.outcome) == "completed", results.snapshot.abort_reason
        outside = set(stored(running, results).outside_peers)
        assert outside == {f"grpc://{plain.address}", "grpc://127.0.0.1"}
    finally:
        to_plain.close()
        service.stop()
        plain.stop()
        s_agent.stop()


def test_a_peer_restart_mid_snapshot_fails_that_snapshot_and_the_next_completes(running: Running) -> None:
    c_agent = agent(running, "C", gate=True)
    c_gate: threading.Event = c_agent.gate  # type: ignore[attr-defined]
    s_agent = agent(running, "S")
    service = Service({"Echo": lambda request, context: request}, s_agent)
    channel = channel_to(service, c_agent, "S")
    try:
        assert call(channel, "Echo", b"1", timeout=10) == b"1"
        pending = asyncio.run_coroutine_threadsafe(running.detector.take_snapshot(deadline=10), running.loop)
        poll(lambda: s_agent.color > 0, "S recorded")
        s_agent.stop()  # S restarts: a new incarnation behind the same address
        s_agent = agent(running, "S")
        service.stop()
        service = Service({"Echo": lambda request, context: request}, s_agent)
        channel.close()
        channel = channel_to(service, c_agent, "S")
        c_gate.set()
        results = pending.result(20)
        assert outcome_name(results.snapshot.outcome) == "aborted"
        assert "S" in results.snapshot.abort_reason
        # The response to this call shows C the new incarnation: C restarts its counts with S under
        # a new session, which S adopts from the stamp of C's next call. Until then the pair's
        # counts cannot be compared and a snapshot would fail (never complete wrongly).
        assert call(channel, "Echo", b"2", timeout=10) == b"2"
        assert call(channel, "Echo", b"3", timeout=10) == b"3"
        following = snapshot(running)
        assert outcome_name(following.snapshot.outcome) == "completed", following.snapshot.abort_reason
    finally:
        c_gate.set()
        channel.close()
        service.stop()
        s_agent.stop()
        c_agent.stop()


@pytest.mark.parametrize("setup", ["interceptors", "channel"])
def test_asyncio_services_snapshot_with_a_call_in_flight(running: Running, setup: str) -> None:
    s_agent, c_agent = agent(running, "S"), agent(running, "C")

    async def body() -> None:
        release = asyncio.Event()

        async def slow(request: bytes, context: Any) -> bytes:
            await release.wait()
            return b"done:" + request

        server = grpc.aio.server(interceptors=[s_agent.aio_server_interceptor()])
        methods = {"Slow": grpc.unary_unary_rpc_method_handler(slow)}
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, methods)])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = aio_channel_to(f"127.0.0.1:{port}", c_agent, setup)
        try:

            async def caller() -> bytes:
                return await channel.unary_unary(f"/{SERVICE}/Slow")(b"a", timeout=20)

            reply = asyncio.create_task(caller(), name="caller")
            await async_poll(lambda: stamped(c_agent, "request"), "the request sent")
            first = asyncio.run_coroutine_threadsafe(running.detector.take_snapshot(deadline=10), running.loop)
            results = await asyncio.wrap_future(first)
            assert outcome_name(results.snapshot.outcome) == "completed", results.snapshot.abort_reason
            waits = {p.process_id: p.state.waits for p in stored(running, results).processes}
            (wait,) = waits["C"]
            # The caller's task, through the interceptors too (grpc.aio runs them in a task of its own,
            # which the caller awaits)
            assert wait.task == "caller"
            assert [(t.process, t.task) for t in wait.targets] == [("S", handler_task("Slow", c_agent, 1))]
            release.set()
            assert await reply == b"done:a"
            assert stamped(s_agent, "response") == 1
            after = asyncio.run_coroutine_threadsafe(running.detector.take_snapshot(deadline=10), running.loop)
            results = await asyncio.wrap_future(after)
            assert outcome_name(results.snapshot.outcome) == "completed", results.snapshot.abort_reason
            assert not [w for p in stored(running, results).processes for w in p.state.waits]
        finally:
            release.set()
            await channel.close()
            await server.stop(0)

    try:
        run(body(), 60)
    finally:
        c_agent.stop()
        s_agent.stop()
