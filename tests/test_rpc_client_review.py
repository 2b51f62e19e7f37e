"""RPC mode, client side: a call with several blockers waits in each of their names, and gRPC's own
retries keep every pair's counts true (the review's reproductions, made deterministic)."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import grpc
from rpc_harness import SERVICE, AioServer, Service, agent, deadlock, recorded, snapshot, stored

from polling import async_poll, poll, run
from stablewatch.agents.rpc.calls import DeadlockBroken
from stablewatch.agents.rpc.core import ALONE_KEY, ColorCore, Stamp
from stablewatch.agents.rpc.interceptors import stamp_of
from stablewatch.detector.evaluation.verdict import Verdict
from stablewatch.detector.service.query import outcome_name
from stablewatch.testing.detector import Running
from stablewatch.v1.control_pb2 import BREAK_OUTCOME_BROKEN, BreakWait

# -- several blockers of one call ------------------------------------------------------------------


def test_a_second_awaiter_of_a_shared_asyncio_call_waits_and_a_break_frees_both(running: Running) -> None:
    """A.First makes a call to B.Slow and awaits it; A.Second awaits the same call object (request
    coalescing). B.Slow calls A.Second: B.Slow -> A.Second -> B.Slow is a real deadlock, which a
    closed cut must not call false. Breaking A.Second's wait cancels the one call: both awaiters
    get DeadlockBroken."""
    a_agent, b_agent, t_agent = agent(running, "A"), agent(running, "B"), agent(running, "T")
    shared: dict[str, Any] = {}
    channels: dict[str, Any] = {}
    ends: dict[str, BaseException] = {}

    async def body() -> None:
        second_awaits = asyncio.Event()

        async def first(request: bytes, context: Any) -> bytes:
            shared["x"] = channels["A->B"].unary_unary(f"/{SERVICE}/Slow")(b"", timeout=60)
            try:
                return await shared["x"]
            except DeadlockBroken as error:
                ends["first"] = error
                raise

        async def second(request: bytes, context: Any) -> bytes:
            second_awaits.set()  # nothing yields from here into the await below
            try:
                return await shared["x"]
            except DeadlockBroken as error:
                ends["second"] = error
                raise

        async def slow(request: bytes, context: Any) -> bytes:
            return await channels["B->A"].unary_unary(f"/{SERVICE}/Second")(b"", timeout=60)

        unary = grpc.unary_unary_rpc_method_handler
        async with (
            AioServer(a_agent, {"First": unary(first), "Second": unary(second)}) as a,
            AioServer(b_agent, {"Slow": unary(slow)}) as b,
        ):
            channels["A->B"] = a_agent.instrument_channel(grpc.aio.insecure_channel(b.address), "B")
            channels["B->A"] = b_agent.instrument_channel(grpc.aio.insecure_channel(a.address), "A")
            t_channel = t_agent.instrument_channel(grpc.aio.insecure_channel(a.address), "A")

            async def drive() -> bytes:
                return await t_channel.unary_unary(f"/{SERVICE}/First")(b"", timeout=60)

            driver = asyncio.create_task(drive())
            try:
                await asyncio.wait_for(second_awaits.wait(), 20)
                results = await asyncio.wrap_future(
                    asyncio.run_coroutine_threadsafe(running.detector.take_snapshot(deadline=10), running.loop)
                )
                assert outcome_name(results.snapshot.outcome) == "completed", results.snapshot.abort_reason
                cut = stored(running, results)
                a_waits = {w.task: w for p in cut.processes if p.process_id == "A" for w in p.state.waits}
                found = deadlock(results)
                assert Verdict.of(found) == Verdict.TRUE, f"a real deadlock: {found.summary}"
                # Both awaiters wait on B.Slow's handler, with the call's one instance.
                assert len(a_waits) == 2, a_waits
                (first_wait,) = (w for name, w in a_waits.items() if name.startswith(f"/{SERVICE}/First#"))
                (second_wait,) = (w for name, w in a_waits.items() if name.startswith(f"/{SERVICE}/Second#"))
                assert first_wait.targets == second_wait.targets
                assert second_wait.instance == first_wait.instance != 0
                order = BreakWait(break_id=1, snapshot_id=42, instance=second_wait.instance, task=second_wait.task)
                broken = a_agent.break_wait(order)
                assert broken is not None and broken.outcome == BREAK_OUTCOME_BROKEN
                await async_poll(lambda: len(ends) == 2, "both awaiters of the broken call woke")
                assert all(isinstance(error, DeadlockBroken) for error in ends.values())
            finally:
                driver.cancel()
                for channel in (*channels.values(), t_channel):
                    await channel.close()

    try:
        run(body(), 60)
    finally:
        for each in (a_agent, b_agent, t_agent):
            each.stop()


def _waiters(agent_: Any) -> list[str] | None:
    """The waiters of ``agent_``'s state recorded now (None if it keeps too many recordings to record)."""
    state = recorded(agent_, lifetime=0.05)
    return None if state is None else sorted(w.task for w in state.waits)


def _poll_waiters(agent_: Any, expected: list[str]) -> None:
    """Wait until ``agent_``'s recorded state shows exactly the waiters ``expected``."""
    poll(lambda: _waiters(agent_) == expected, f"waiters {expected}", 10, interval=0.02)


def _two_blockers(rpc_agents: Any, first_blocks_first: bool) -> None:
    """Threads "first" and "second" block on one future of the instrumented channel (in the order
    given): both wait; when "first" stops blocking (its result(timeout) runs out) while "second"
    still blocks, "second" waits on, alone, until the call ends."""
    s_agent, c_agent = rpc_agents
    release, leave = threading.Event(), threading.Event()

    def slow(request: bytes, context: Any) -> bytes:
        release.wait(30)
        return b"ok"

    service = Service({"Slow": slow}, s_agent)
    channel = c_agent.instrument_channel(grpc.insecure_channel(service.address), "S")
    threads: list[threading.Thread] = []
    try:
        future = channel.unary_unary(f"/{SERVICE}/Slow").future(b"", timeout=30)

        def first() -> None:
            while not leave.is_set():  # blocks in short turns until told to leave
                try:
                    future.result(timeout=0.05)
                except grpc.FutureTimeoutError:
                    continue

        def second() -> None:
            future.result()

        threads = [threading.Thread(target=first, name="first"), threading.Thread(target=second, name="second")]
        if not first_blocks_first:
            threads.reverse()
        threads[0].start()
        _poll_waiters(c_agent, [threads[0].name])
        threads[1].start()
        _poll_waiters(c_agent, ["first", "second"])
        leave.set()
        next(t for t in threads if t.name == "first").join(10)
        waiters = poll(lambda: (w := _waiters(c_agent)) is not None and (w,), "a recording", 5, interval=0.02)[0]
        assert waiters == ["second"], "the thread still blocked on the call waits"
        release.set()
        next(t for t in threads if t.name == "second").join(10)
        _poll_waiters(c_agent, [])
    finally:
        release.set()
        leave.set()
        for thread in threads:
            if thread.ident is not None:
                thread.join(10)
        channel.close()
        service.stop()


def test_a_later_blocker_of_a_future_waits_until_it_leaves(rpc_agents: Any) -> None:
    _two_blockers(rpc_agents, first_blocks_first=False)


def test_the_first_blocker_leaving_hands_the_wait_to_the_next(rpc_agents: Any) -> None:
    """The first thread that blocked leaves while another still blocks: the call's wait goes on in
    the other's name, not ended by the first one's timeout."""
    _two_blockers(rpc_agents, first_blocks_first=True)


# -- gRPC's retries ---------------------------------------------------------------------------------

RETRY = json.dumps({
    "methodConfig": [{
        "name": [{"service": SERVICE}],
        "retryPolicy": {
            "maxAttempts": 3, "initialBackoff": "0.01s", "maxBackoff": "0.05s",
            "backoffMultiplier": 1, "retryableStatusCodes": ["UNAVAILABLE"],
        },
    }]
})  # fmt: skip


def _counts_agree(c_agent: Any, s_agent: Any) -> None:
    """Each direction's counts, in the session the receiver counts: what was received was sent."""
    with c_agent._lock, s_agent._lock:
        c, s = c_agent._core, s_agent._core
        assert s.view("C")[1] == c.session("S") and s.received_count("C") == c.sent_count("S")
        assert c.view("S")[1] == s.session("C") and c.received_count("S") == s.sent_count("C")


def test_a_retried_call_keeps_the_counts_true(running: Running) -> None:
    """gRPC's retry sends one stamped request twice: the repeat is not counted, and the retried
    attempt's response goes alone in a session, which the caller leaves at once. Counts agree after
    the next call, and every later snapshot of the pair completes."""
    c_agent, s_agent = agent(running, "C"), agent(running, "S")
    attempts: list[bytes] = []

    def handler(payload: bytes, context: grpc.ServicerContext) -> bytes:
        attempts.append(payload)
        if payload == b"flaky" and attempts.count(b"flaky") == 1:
            context.abort(grpc.StatusCode.UNAVAILABLE, "try again")
        return payload

    service = Service({"Echo": handler}, s_agent)
    raw = grpc.insecure_channel(service.address, options=[("grpc.service_config", RETRY)])
    channel = c_agent.instrument_channel(raw, "S")
    echo = channel.unary_unary(f"/{SERVICE}/Echo")
    try:
        assert echo(b"ok", timeout=10) == b"ok"
        assert outcome_name(snapshot(running, deadline=3).snapshot.outcome) == "completed"
        assert echo(b"flaky", timeout=10) == b"flaky"
        assert attempts.count(b"flaky") == 2  # grpc retried it once
        for _ in range(3):
            assert echo(b"more", timeout=10) == b"more"
            _counts_agree(c_agent, s_agent)
            after = snapshot(running, deadline=3)
            assert outcome_name(after.snapshot.outcome) == "completed", after.snapshot.abort_reason
    finally:
        channel.close()
        service.stop()
        c_agent.stop()
        s_agent.stop()


def test_a_retried_request_is_counted_once_in_its_session() -> None:
    """The core: a repeated request is not counted again; a response sent alone leaves its session,
    and its receiver, told so, moves to the next one with the sender."""
    c, s = ColorCore("C", incarnation=1), ColorCore("S", incarnation=2)
    request = c.send("S")
    s.receive(request, lambda: None, now=0.0, wall=1e9)  # type: ignore[arg-type]
    assert s.receive_again(request, now=0.0, wall=1e9) == ()
    assert s.received_count("C") == c.sent_count("S") == 1
    lost = s.send("C")  # the first attempt's response, which gRPC drops
    response, _ = s.send_alone("C", "retried")
    assert response.session == lost.session + 1 and s.session("C") == response.session + 1
    c.receive(response, lambda: None, now=0.0, wall=1e9)  # type: ignore[arg-type]
    assert c.received_count("S") == 1
    c.session_closed(response)
    # Both sides now count in the server's next session, from zero: the lost response is behind them.
    assert c.view("S") == (2, s.session("C")) and c.received_count("S") == s.sent_count("C") == 0
    assert c.session("S") == s.session("C") and c.sent_count("S") == 0
    assert isinstance(response, Stamp)


def test_every_attempt_of_a_repeated_call_answers_alone(rpc_agents: Any) -> None:
    """A hedged call (other languages' clients hedge; grpc's C core does not): the first attempt may
    answer after a later one arrived, and its response may be dropped. Each attempt's response then
    goes alone in a session, and the caller that gets one moves on with the server."""
    s_agent, c_agent = rpc_agents
    call = c_agent.call_out("S", "/test.Svc/Echo", "caller", True)
    first = s_agent.arrive("/test.Svc/Echo", call.metadata, None)
    second = s_agent.arrive("/test.Svc/Echo", (("grpc-previous-rpc-attempts", "1"), *call.metadata), None)
    assert first.name == second.name
    assert s_agent._core.received_count("C") == 1  # the repeat is not counted
    second_entry = s_agent.respond(second, "ipv4:127.0.0.1:1", True)
    first_entry = s_agent.respond(first, "ipv4:127.0.0.1:1", True)  # the loser, answering late
    assert second_entry is not None and first_entry is not None
    assert second_entry[0] == first_entry[0] == ALONE_KEY  # an older caller ignores the key: no stamp
    # The caller got the first attempt's response (its channel reads the key: stamp_of).
    c_agent.call_returned(call, stamp_of((first_entry,)), None)
    with c_agent._lock, s_agent._lock:
        assert c_agent._core.view("S")[1] == s_agent._core.session("C")
        assert c_agent._core.received_count("S") == s_agent._core.sent_count("C") == 0
