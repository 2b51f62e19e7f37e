"""Breaking proven deadlocks in RPC mode (DESIGN.md, "Breaking a proven deadlock"), on real gRPC
servers on loopback.

The ring: services A and B, one worker each, from their agents' ``thread_pool``. A call of A.Ping
from outside takes A's worker, which calls B.Pong; B's worker calls A.Ping again, and that call
queues behind A's only worker: a pool deadlock. Breaking B's outgoing call fails it in B's handler
with ``DeadlockBroken`` (ABORTED, the deadlock named); breaking the queued request refuses it with
ABORTED before its handler runs. Either way the ring recovers. The breaks are driven through the
agent's dispatcher (``agent.breaks.handle``, what the control stream calls for a ``BreakWait``),
and once through a scripted detector on the control stream, with the long-wait hints.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from fake_detector import FakeDetector, serve
from pool_service import PoolService
from rpc_harness import SERVICE, Service, aio_channel_to, call, handler_prefix, new_agent, recorded

from polling import async_poll, poll, run
from stablewatch.agents.rpc import DeadlockBroken, RpcAgent, WorkerExecutor
from stablewatch.v1 import WAIT_MODEL_AND, WAIT_MODEL_OR, DetectorMessage, Wait
from stablewatch.v1.control_pb2 import (
    BREAK_OUTCOME_ALREADY_BROKEN,
    BREAK_OUTCOME_BROKEN,
    BREAK_OUTCOME_GONE,
    BreakReport,
    BreakWait,
)

CYCLE = "A:/test.Svc/Ping -> B:/test.Svc/Pong -> A:/test.Svc/Ping"


def recorded_wait(agent: RpcAgent, which: Callable[[Wait], bool], what: str) -> Wait:
    """The one wait of ``agent``'s recorded state that ``which`` picks, once it is breakable."""

    def look() -> Wait | None:
        state = recorded(agent)
        found = [wait for wait in state.waits if which(wait)] if state is not None else []
        assert len(found) <= 1, found
        return found[0] if found and found[0].instance else None

    return poll(look, what, interval=0.02)


def order(wait: Wait, break_id: int = 1) -> BreakWait:
    return BreakWait(break_id=break_id, snapshot_id=42, instance=wait.instance, task=wait.task, deadlock=CYCLE)


def sample(agent: RpcAgent, name: str, labels: dict[str, str] | None = None) -> float:
    return agent.metrics.registry.get_sample_value(f"stablewatch_agent_rpc_{name}", labels or {}) or 0.0


class Ring:
    """A and B with one worker each, deadlocked by one call of A.Ping (see the module docstring).

    ``ran`` lists the handlers' runs of the inner A.Ping (the one B calls); ``errors`` the errors
    B's handler got from its call to A. With ``plain_pools`` the servers have plain thread pools
    and the interceptors are given their size only.
    """

    def __init__(self, plain_pools: bool = False) -> None:
        self.a_agent, self.b_agent, self.t_agent = new_agent("A"), new_agent("B"), new_agent("T")
        self.ran: list[bytes] = []
        self.errors: list[grpc.RpcError] = []
        self.channels: dict[str, grpc.Channel] = {}
        handlers_a = {"Ping": self._ping}
        handlers_b = {"Pong": self._pong}
        if plain_pools:
            self.a: Service | PoolService = Service(handlers_a, self.a_agent, workers=1)
            self.b: Service | PoolService = Service(handlers_b, self.b_agent, workers=1)
        else:
            self.a, self.b = PoolService(handlers_a, self.a_agent, 1), PoolService(handlers_b, self.b_agent, 1)
        self.channels["A->B"] = self.a_agent.instrument_channel(
            grpc.insecure_channel(self.b.address), "B", breakable=True
        )
        self.channels["B->A"] = self.b_agent.instrument_channel(
            grpc.insecure_channel(self.a.address), "A", breakable=True
        )
        self.channels["T->A"] = self.t_agent.instrument_channel(
            grpc.insecure_channel(self.a.address), "A", breakable=True
        )
        self.channels["T->B"] = self.t_agent.instrument_channel(
            grpc.insecure_channel(self.b.address), "B", breakable=True
        )
        self.driver = futures.ThreadPoolExecutor(1, thread_name_prefix="driver")

    def _ping(self, request: bytes, context: Any) -> bytes:
        if request.startswith(b"inner"):
            self.ran.append(request)
            return b"pinged"
        return call(self.channels["A->B"], "Pong", timeout=30)

    def _pong(self, request: bytes, context: Any) -> bytes:
        try:
            return call(self.channels["B->A"], "Ping", b"inner", timeout=30)
        except grpc.RpcError as error:
            self.errors.append(error)
            return b"gave up: " + error.code().name.encode()

    def deadlock(self) -> futures.Future[bytes]:
        """Drive the ring into its deadlock; returns the outer call, which completes only once it is broken."""
        outer = self.driver.submit(call, self.channels["T->A"], "Ping", b"outer", timeout=30)
        b_ping = handler_prefix("Ping", self.b_agent)  # B's call of Ping, queued at A
        poll(lambda: any(w.task.startswith(b_ping) for w in self.a_agent.open_waits()), "A queued")
        return outer

    def queued_wait(self) -> Wait:
        return recorded_wait(self.a_agent, lambda w: w.model == WAIT_MODEL_OR, "the queued request at A")

    def outgoing_wait(self) -> Wait:
        return recorded_wait(self.b_agent, lambda w: w.model == WAIT_MODEL_AND, "B's call to A")

    def recovered(self) -> None:
        """Both pools serve again: B's handler calls A and gets its answer."""
        assert call(self.channels["T->B"], "Pong", timeout=10) == b"pinged"

    def stop(self) -> None:
        for channel in self.channels.values():
            channel.close()
        self.a.stop()
        self.b.stop()
        self.driver.shutdown(wait=True, cancel_futures=True)
        for agent in (self.a_agent, self.b_agent, self.t_agent):
            agent.stop()


@pytest.fixture
def ring() -> Iterator[Ring]:
    made = Ring()
    yield made
    made.stop()


def test_waits_carry_distinct_instances_and_when_they_began(ring: Ring) -> None:
    began = time.time_ns() // 1000
    outer = ring.deadlock()
    waits = [
        ring.queued_wait(),
        ring.outgoing_wait(),
        recorded_wait(ring.a_agent, lambda w: w.model == WAIT_MODEL_AND, "A's call to B"),
        recorded_wait(ring.t_agent, lambda w: True, "T's call to A"),
    ]
    now = time.time_ns() // 1000
    assert len({wait.instance for wait in waits}) == 4
    assert all(wait.instance > 0 and began <= wait.began_at_us <= now for wait in waits), waits
    # The outer call went out first, the queued request arrived last.
    assert sorted(waits, key=lambda w: w.began_at_us)[-1].model == WAIT_MODEL_OR
    ring.b_agent.breaks.handle(order(ring.outgoing_wait()))  # let the ring go
    assert outer.result(20) == b"gave up: ABORTED"


def test_breaking_the_outgoing_call_aborts_its_caller_and_the_ring_recovers(ring: Ring) -> None:
    outer = ring.deadlock()
    wait = ring.outgoing_wait()
    report = ring.b_agent.breaks.handle(order(wait, break_id=7))
    assert (report.break_id, report.instance, report.outcome) == (7, wait.instance, BREAK_OUTCOME_BROKEN)
    assert "cancelled" in report.detail and wait.task in report.detail
    assert outer.result(20) == b"gave up: ABORTED"
    (error,) = ring.errors
    assert isinstance(error, DeadlockBroken) and isinstance(error, grpc.Call)
    assert error.code() == grpc.StatusCode.ABORTED
    assert CYCLE in error.details() and "snapshot 42" in error.details() and error.instance == wait.instance
    # Its end was taken in once, as an end without the server's stamp: the pair's counts restart.
    assert sample(ring.b_agent, "peer_resets_total") == 1
    assert sample(ring.b_agent, "breaks_total", {"kind": "call"}) == 1
    ring.recovered()
    assert ring.b_agent.open_waits() == [] and ring.a_agent.open_waits() == []
    # Never twice: the same instance again is already broken, here or from another detector.
    again = ring.b_agent.breaks.handle(order(wait, break_id=8))
    assert (again.break_id, again.outcome) == (8, BREAK_OUTCOME_ALREADY_BROKEN)
    assert sample(ring.b_agent, "breaks_total", {"kind": "call"}) == 1


def test_breaking_the_queued_request_refuses_it_before_its_handler_runs(ring: Ring) -> None:
    outer = ring.deadlock()
    wait = ring.queued_wait()
    assert wait.task.startswith(handler_prefix("Ping", ring.b_agent))
    report = ring.a_agent.breaks.handle(order(wait))
    assert report.outcome == BREAK_OUTCOME_BROKEN and "before its handler ran" in report.detail
    assert outer.result(20) == b"gave up: ABORTED"
    (error,) = ring.errors
    assert error.code() == grpc.StatusCode.ABORTED and CYCLE in error.details()
    assert not isinstance(error, DeadlockBroken)  # refused by A's server, not cancelled at B
    # The refusal is a response with A's stamp: B's counts need no restart.
    assert sample(ring.b_agent, "peer_resets_total") == 0
    assert sample(ring.a_agent, "breaks_total", {"kind": "queued"}) == 1
    ring.recovered()  # A's worker has passed the refused request's work item by now
    assert ring.ran == [b"inner"]  # only the recovery's call: the refused one never ran
    assert ring.a_agent.open_waits() == []
    assert ring.a_agent.breaks.handle(order(wait)).outcome == BREAK_OUTCOME_ALREADY_BROKEN


@pytest.mark.parametrize("process", ["A", "B"])
def test_concurrent_breaks_of_one_wait_break_it_once(ring: Ring, process: str) -> None:
    """Eight threads break the same wait at once: one breaks it, the others hear it was broken.

    One wait at a time: A's queued request and B's call to A are the two ends of one call, so
    breaking either ends the other (a call that ends queued leaves the pool's picture), and the
    other's breaks would be answered gone."""
    outer = ring.deadlock()
    agent = {"A": ring.a_agent, "B": ring.b_agent}[process]
    wait = ring.queued_wait() if process == "A" else ring.outgoing_wait()
    barrier = threading.Barrier(8)

    def attempt(_: int) -> int:
        barrier.wait(10)
        return agent.breaks.handle(order(wait)).outcome

    with futures.ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(attempt, range(8)))
    assert sorted(outcomes) == sorted([BREAK_OUTCOME_BROKEN] + [BREAK_OUTCOME_ALREADY_BROKEN] * 7), outcomes
    assert outer.result(20).startswith(b"gave up")
    ring.recovered()


@dataclass
class SlowPair:
    """A caller C and a server S whose one handler ``Slow`` answers once ``release`` is set."""

    release: threading.Event
    c_agent: RpcAgent
    channel: grpc.Channel
    caller: futures.ThreadPoolExecutor


@contextlib.contextmanager
def slow_pair(breakable: bool) -> Iterator[SlowPair]:
    """C calls S over an instrumented channel (``breakable`` or not); everything stopped at the end."""
    release = threading.Event()
    s_agent, c_agent = new_agent("S"), new_agent("C")
    service = Service({"Slow": lambda request, context: release.wait(20) and b"done"}, s_agent)
    channel = c_agent.instrument_channel(grpc.insecure_channel(service.address), "S", breakable=breakable)
    caller = futures.ThreadPoolExecutor(1)
    try:
        yield SlowPair(release, c_agent, channel, caller)
    finally:
        release.set()
        caller.shutdown(wait=True)
        channel.close()
        service.stop()
        c_agent.stop()
        s_agent.stop()


def test_a_break_for_an_ended_or_unknown_wait_is_gone_and_changes_nothing() -> None:
    with slow_pair(breakable=True) as pair:
        c_agent, channel = pair.c_agent, pair.channel
        reply = pair.caller.submit(call, channel, "Slow", timeout=30)
        wait = recorded_wait(c_agent, lambda w: True, "C's call")
        pair.release.set()
        assert reply.result(10) == b"done"
        for instance in (wait.instance, 2**63):
            report = c_agent.breaks.handle(BreakWait(break_id=3, instance=instance, deadlock=CYCLE))
            assert (report.instance, report.outcome) == (instance, BREAK_OUTCOME_GONE)
            assert "nothing done" in report.detail
        assert sample(c_agent, "breaks_total", {"kind": "call"}) == 0
        assert sample(c_agent, "peer_resets_total") == 0
        assert call(channel, "Slow", timeout=10) == b"done"


def test_a_blocking_call_of_a_default_instrumented_channel_is_unbreakable_and_works() -> None:
    """Without breakable=True the instrumented channel's blocking call is grpc's with_call: out of
    reach, so its wait has instance 0 (never a victim) and a break for it does nothing."""
    with slow_pair(breakable=False) as pair:
        c_agent = pair.c_agent
        reply = pair.caller.submit(call, pair.channel, "Slow", timeout=30)
        state = poll(lambda: (s := recorded(c_agent)) is not None and s.waits and s, "C's call in its state")
        (wait,) = state.waits
        assert wait.instance == 0 and wait.began_at_us > 0
        (open_wait,) = c_agent.open_waits()
        report = c_agent.breaks.handle(BreakWait(break_id=1, instance=open_wait.instance, deadlock=CYCLE))
        assert report.outcome == BREAK_OUTCOME_GONE
        pair.release.set()
        assert reply.result(10) == b"done"


def test_with_a_plain_pool_a_queued_request_is_reported_unbreakable() -> None:
    """A plain pool cannot give a queued call back: refusing it would wait for a worker that, in a
    deadlock, never comes. Its wait has instance 0 (never a victim) and a break for it does nothing;
    the outgoing calls of the same deadlock stay breakable."""
    ring = Ring(plain_pools=True)
    try:
        outer = ring.deadlock()
        state = poll(lambda: recorded(ring.a_agent), "A's state")
        (queued,) = [wait for wait in state.waits if wait.model == WAIT_MODEL_OR]
        assert queued.instance == 0 and queued.began_at_us > 0
        (open_queued,) = [w for w in ring.a_agent.open_waits() if w.task == queued.task]
        report = ring.a_agent.breaks.handle(BreakWait(break_id=1, instance=open_queued.instance))
        assert report.outcome == BREAK_OUTCOME_GONE
        assert ring.b_agent.breaks.handle(order(ring.outgoing_wait())).outcome == BREAK_OUTCOME_BROKEN
        assert outer.result(20) == b"gave up: ABORTED"
        ring.recovered()
    finally:
        ring.stop()


def test_a_future_through_the_client_interceptor_is_broken_and_a_blocking_call_is_not() -> None:
    release = threading.Event()
    s_agent, c_agent = new_agent("S"), new_agent("C")
    service = Service({"Slow": lambda request, context: release.wait(20) and b"done"}, s_agent)
    channel = grpc.intercept_channel(grpc.insecure_channel(service.address), c_agent.client_interceptor("S"))
    caller = futures.ThreadPoolExecutor(1, thread_name_prefix="blocking")
    try:
        method = channel.unary_unary(f"/{SERVICE}/Slow")
        # A blocking call: grpc waits for it inside the interceptor's continuation, out of reach.
        blocking = caller.submit(method, b"", timeout=30)
        poll(lambda: c_agent.open_waits(), "the blocking call out")
        state = poll(lambda: recorded(c_agent), "C's state")
        (unbreakable,) = state.waits
        assert unbreakable.instance == 0 and unbreakable.task.startswith("blocking")
        (opened,) = c_agent.open_waits()
        assert c_agent.breaks.handle(BreakWait(instance=opened.instance)).outcome == BREAK_OUTCOME_GONE

        future = method.future(b"", timeout=30)
        wait = recorded_wait(c_agent, lambda w: w.instance != 0, "the future's wait")
        assert c_agent.breaks.handle(order(wait)).outcome == BREAK_OUTCOME_BROKEN
        with pytest.raises(DeadlockBroken) as raised:
            future.result(10)
        assert raised.value.code() == grpc.StatusCode.ABORTED and CYCLE in raised.value.details()
        assert isinstance(future.exception(1), DeadlockBroken)
        assert (future.code(), future.cancelled(), future.done()) == (grpc.StatusCode.ABORTED, False, True)
        release.set()
        assert blocking.result(10) == b"done"
        assert c_agent.open_waits() == []
    finally:
        release.set()
        caller.shutdown(wait=True)
        channel.close()
        service.stop()
        c_agent.stop()
        s_agent.stop()


def test_a_blocking_stream_unary_call_of_an_instrumented_channel_is_broken() -> None:
    release = threading.Event()
    s_agent, c_agent = new_agent("S"), new_agent("C")
    pool = s_agent.thread_pool(2)
    server = grpc.server(pool, interceptors=[s_agent.server_interceptor(workers=pool)])
    total = grpc.stream_unary_rpc_method_handler(lambda requests, context: release.wait(20) and b"".join(requests))
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, {"Total": total})])
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    channel = c_agent.instrument_channel(grpc.insecure_channel(address), "S", breakable=True)
    caller = futures.ThreadPoolExecutor(1)
    try:
        method = channel.stream_unary(f"/{SERVICE}/Total")
        reply = caller.submit(method, iter([b"a", b"b"]), timeout=30)
        wait = recorded_wait(c_agent, lambda w: True, "the stream-unary call's wait")
        assert c_agent.breaks.handle(order(wait)).outcome == BREAK_OUTCOME_BROKEN
        with pytest.raises(DeadlockBroken):
            reply.result(10)
        release.set()
        assert method.with_call(iter([b"c"]), timeout=10)[0] == b"c"
    finally:
        release.set()
        caller.shutdown(wait=True)
        channel.close()
        server.stop(grace=0).wait(10)
        pool.shutdown(wait=True)
        c_agent.stop()
        s_agent.stop()


def test_a_call_reported_broken_is_recorded_waiting_no_more_before_its_caller_wakes() -> None:
    # The break's report goes to the detector at once, while the caller may not have woken to the
    # cancel yet: a cut begun after the report must not show the wait, or the detector (its hold
    # released by the report) would name another wait of the same deadlock.
    agent = RpcAgent("B", hint_after=None).start()
    try:
        call = agent.call_out("A", "/test.Svc/Ping", "handler-1", True, waits=True)
        call.handle, call.cancel = object(), (lambda handle: True)  # grpc's cancel succeeds; nobody woke
        assert [wait.instance for wait in recorded(agent).waits] == [call.instance]
        assert [wait.instance for wait in agent.open_waits()] == [call.instance] and not agent.idle()
        report = agent.breaks.handle(BreakWait(break_id=1, snapshot_id=7, instance=call.instance, deadlock=CYCLE))
        assert report.outcome == BREAK_OUTCOME_BROKEN
        assert [wait.instance for wait in recorded(agent).waits] == []
        assert agent.open_waits() == [] and agent.idle()
    finally:
        agent.stop()


@pytest.mark.parametrize("setup", ["interceptors", "channel"])
def test_an_asyncio_call_is_broken_with_deadlock_broken_not_cancelled(setup: str) -> None:
    release = threading.Event()
    s_agent, c_agent = new_agent("S"), new_agent("C")
    service = Service({"Slow": lambda request, context: release.wait(20) and b"done"}, s_agent)

    async def scenario() -> None:
        async with aio_channel_to(service.address, c_agent, setup) as channel:
            method = channel.unary_unary(f"/{SERVICE}/Slow")

            async def caller() -> bytes:
                return await method(b"", timeout=30)

            broken = asyncio.create_task(caller(), name="caller")
            wait = await asyncio.to_thread(recorded_wait, c_agent, lambda w: True, "the asyncio call's wait")
            # The call waits in its caller's task, through the interceptors too (the task awaiting grpc.aio's).
            assert wait.task == "caller"
            # As the control stream would: from the agent's own thread, not the caller's loop. The
            # loop is kept busy meanwhile (blocked here), as a service's may be, so the cancel that
            # the break schedules on it has not run when a snapshot taken after the report records:
            # the wait is left out all the same (the detector would name another wait of it).

            def break_then_record() -> tuple[BreakReport, list[int]]:
                report = c_agent.breaks.handle(order(wait))
                return report, [w.instance for w in recorded(c_agent).waits]

            with futures.ThreadPoolExecutor(1) as thread:
                report, waits_after = thread.submit(break_then_record).result(timeout=20)
            assert report.outcome == BREAK_OUTCOME_BROKEN
            assert waits_after == []
            with pytest.raises(DeadlockBroken) as raised:
                await broken
            assert raised.value.code() == grpc.StatusCode.ABORTED and CYCLE in raised.value.details()
            await async_poll(lambda: not c_agent.open_waits(), "the call's end taken in")
            assert sample(c_agent, "peer_resets_total") == 1
            # A caller's own cancellation stays a cancellation.
            cancelled = asyncio.ensure_future(method(b"", timeout=30))
            await async_poll(lambda: c_agent.open_waits(), "the second call out")
            cancelled.cancel()
            with pytest.raises(asyncio.CancelledError):
                await cancelled
            release.set()
            assert await method(b"", timeout=10) == b"done"

    try:
        run(scenario())
    finally:
        release.set()
        service.stop()
        c_agent.stop()
        s_agent.stop()


def test_a_detector_is_hinted_of_a_long_wait_and_breaks_it_on_the_control_stream() -> None:
    release = threading.Event()
    s_agent = new_agent("S")
    service = Service({"Slow": lambda request, context: release.wait(20) and b"done"}, s_agent)

    async def scenario() -> None:
        detector = FakeDetector()
        server, port = await serve(detector)
        c_agent = RpcAgent("C", detector=f"127.0.0.1:{port}", hint_after=0.02, heartbeat_interval=0.2).start()
        channel = c_agent.instrument_channel(grpc.insecure_channel(service.address), "S", breakable=True)
        caller: asyncio.Future[bytes] | None = None
        try:
            await async_poll(lambda: c_agent.detector_connected, "C attached")
            began = time.time_ns() // 1000
            caller = asyncio.ensure_future(asyncio.to_thread(call, channel, "Slow", timeout=30))
            (hint,) = await async_poll(lambda: detector.of_kind("hint"), "a hint of the long wait")
            (opened,) = c_agent.open_waits()
            assert (hint.instance, hint.task) == (opened.instance, opened.task) and hint.waited_ms >= 20
            assert opened.began_at_us >= began
            detector.send(DetectorMessage(break_wait=order(Wait(instance=hint.instance, task=hint.task), 5)))
            detector.send(DetectorMessage(break_wait=order(Wait(instance=hint.instance, task=hint.task), 6)))
            reports: list[BreakReport] = await async_poll(
                lambda: found if len(found := detector.of_kind("break_report")) == 2 else None, "two reports"
            )
            assert [(r.break_id, r.instance, r.outcome) for r in reports] == [
                (5, hint.instance, BREAK_OUTCOME_BROKEN),
                (6, hint.instance, BREAK_OUTCOME_ALREADY_BROKEN),
            ]
            with pytest.raises(DeadlockBroken):
                await caller
            assert len(detector.of_kind("hint")) == 1  # once per wait
        finally:
            release.set()
            if caller is not None:
                await asyncio.gather(caller, return_exceptions=True)
            channel.close()
            await asyncio.to_thread(c_agent.stop)
            await server.stop(None)

    try:
        run(scenario())
    finally:
        release.set()
        service.stop()
        s_agent.stop()


def test_the_worker_pool_serves_one_interceptor_and_runs_other_work_as_usual() -> None:
    agent = new_agent("P")
    pool = agent.thread_pool(3, thread_name_prefix="shop-worker")
    try:
        assert isinstance(pool, WorkerExecutor) and pool.max_workers == 3
        agent.server_interceptor(workers=pool)
        with pytest.raises(ValueError, match="another server interceptor"):
            agent.server_interceptor(workers=pool)
        assert pool.submit(lambda x: x * 2, 21).result(5) == 42  # not a call: runs as in any pool
        assert pool.submit(threading.current_thread).result(5).name.startswith("shop-worker")
        with pytest.raises(ValueError, match="at least 1"):
            agent.thread_pool(0)
    finally:
        pool.shutdown(wait=True)
        agent.stop()
