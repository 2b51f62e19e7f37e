"""RPC mode, client side: a call with several blockers waits in each of their names, and one
leaving ends only its own part (the reviews' reproductions, made deterministic)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import grpc
from rpc_harness import SERVICE, AioServer, Service, agent, deadlock, recorded, stored

from polling import async_poll, poll, run
from stablewatch.agents.rpc.calls import DeadlockBroken
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


def test_a_blocker_of_a_name_another_blocker_has_keeps_waiting_when_that_one_leaves(rpc_agents: Any) -> None:
    """From a review (read only) of the first version: two threads of one name block on one future;
    the first leaving (its result(timeout) runs out) ended the call's wait, the other still blocked."""
    s_agent, c_agent = rpc_agents
    release = threading.Event()

    def slow(request: bytes, context: Any) -> bytes:
        release.wait(30)
        return b"ok"

    service = Service({"Slow": slow}, s_agent)
    channel = c_agent.instrument_channel(grpc.insecure_channel(service.address), "S")
    threads = []
    try:
        future = channel.unary_unary(f"/{SERVICE}/Slow").future(b"", timeout=30)
        first_left = threading.Event()

        def first() -> None:
            try:
                future.result(timeout=3)  # long enough for the second to block meanwhile
            except grpc.FutureTimeoutError:
                first_left.set()

        def second() -> None:
            future.result()

        threads = [threading.Thread(target=first, name="worker"), threading.Thread(target=second, name="worker")]
        threads[0].start()
        _poll_waiters(c_agent, ["worker"])
        threads[1].start()
        # Each blocker is one of the call's, whatever its name (a name waits once in the state).
        poll(lambda: any(call.others for call in c_agent._outgoing.values()), "the second blocking", 10, interval=0.02)
        assert first_left.wait(10)
        threads[0].join(5)
        assert _waiters(c_agent) == ["worker"]  # the second is still blocked in result(): it waits on S
    finally:
        release.set()
        for t in threads:
            if t.ident is not None:
                t.join(10)
        channel.close()
        service.stop()
