"""A caller that restarts while a sync server still runs one of its old incarnation's calls.

A handler is named after its caller and the caller's call number, and a restarted caller numbers
its calls from 1 again. The caller's incarnation is in the name too, so that its new call's handler
is not taken for the orphan (whose caller is gone, but whose sync handler runs on): otherwise the
new caller's wait led to the orphan, and if the orphan was stuck in a deadlock the new caller was
listed among the deadlocked, and a wait of the new handler could be chosen to break it.
"""

from __future__ import annotations

import contextlib
import threading

import grpc
import pytest
from pool_service import PoolService
from rpc_harness import SERVICE, new_agent, recorded

from polling import poll
from stablewatch.agents.rpc import RpcAgent

pytestmark = pytest.mark.timeout(60)

HOLD = f"/{SERVICE}/Hold"


def running(agent: RpcAgent) -> list[str]:
    """The handlers now running in ``agent``'s one pool."""
    with agent._lock:
        [pool] = agent._pools
        return sorted(pool.running)


def waits_on(agent: RpcAgent) -> list[str]:
    """The tasks ``agent``'s recorded waits wait on, once it records one."""
    state = poll(lambda: (state := recorded(agent)) and state.waits and state, f"{agent.process_id} waiting")
    return [target.task for wait in state.waits for target in wait.targets]


def channel_to(address: str) -> grpc.Channel:
    """A channel with a connection of its own (a closed channel's shared one may be slow to come back)."""
    return grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])


def call_in_thread(channel: grpc.Channel) -> threading.Thread:
    """A blocking call of Hold made in a thread of its own (its caller waits on the handler)."""

    def calling() -> None:
        with contextlib.suppress(grpc.RpcError):  # cancelled when its channel closes
            channel.unary_unary(HOLD)(b"", timeout=30)

    thread = threading.Thread(target=calling, daemon=True)
    thread.start()
    return thread


def test_a_restarted_callers_call_is_not_taken_for_its_old_incarnations_orphan() -> None:
    s_agent, old = new_agent("S"), new_agent("C", incarnation=0x10)
    new: RpcAgent | None = None
    new_caller: threading.Thread | None = None
    release = threading.Event()

    entered = threading.Semaphore(0)

    def holding(request: bytes, context: grpc.ServicerContext) -> bytes:
        entered.release()
        release.wait(30)  # a sync handler: it runs on after its caller is gone
        return b"held"

    service = PoolService({"Hold": grpc.unary_unary_rpc_method_handler(holding)}, s_agent, workers=2)
    old_channel = old.instrument_channel(channel_to(service.address), "S")
    new_channel = None
    try:
        old_caller = call_in_thread(old_channel)
        [orphan] = waits_on(old)
        assert entered.acquire(timeout=10), "the old call's handler did not start"
        assert running(s_agent) == [orphan]
        old_channel.close()  # the caller restarts: its calls are cancelled, its handler runs on
        old_caller.join(10)
        old.stop()

        new = new_agent("C", incarnation=0x11)
        new_channel = new.instrument_channel(channel_to(service.address), "S")
        new_caller = call_in_thread(new_channel)
        [handler] = waits_on(new)
        # The same call number, the first of each incarnation, but another task.
        assert handler != orphan
        assert entered.acquire(timeout=10), "the new call's handler did not start"
        assert running(s_agent) == sorted([orphan, handler])
        assert (orphan, handler) == (f"{HOLD}#C@10:1", f"{HOLD}#C@11:1")  # incarnations 0x10 and 0x11
    finally:
        release.set()
        if new_caller is not None:
            new_caller.join(10)
        for channel in (old_channel, new_channel):
            if channel is not None:
                channel.close()
        service.stop()
        for agent in (old, new, s_agent):
            if agent is not None:
                agent.stop()
