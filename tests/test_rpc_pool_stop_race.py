"""A sync server stopped while a call has arrived but its handler has not started yet.

The agent pictures a call as running from its arrival (it has, or is about to get, a worker), so
the picture alone does not say that the worker has started its handler. Stopped in that window
(``stop(grace=0)`` on a loaded machine, before the pool's one thread has reached ``Hold``), gRPC
ends both ``Hold`` and the ``Echo`` queued behind it, neither handler runs, and both leave the
picture: ``test_rpc_sync_review``'s stop test, which expects ``Hold`` to stay, timed out in CI for
that reason. The ordering is forced here by giving the pool's only worker a work item of its own.

The same ordering shows how a call that ran at once leaves the picture when gRPC ends it before
its handler starts: gRPC tells the agent nothing of it (only queued calls ask for a callback), so
the agent looks for such calls when it records, and when an arrival finds the picture full.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import grpc
import pytest
from rpc_harness import SERVICE, recorded
from test_rpc_sync_review import OneWorker, one_worker, pictured  # noqa: F401  (one_worker: a fixture)

from polling import poll
from stablewatch.agents.rpc.agent import RpcAgent
from stablewatch.agents.rpc.calls import IncomingCall


@pytest.fixture
def pinned(one_worker: OneWorker) -> Iterator[threading.Event]:  # noqa: F811
    """The pool's only worker busy with an item that is no call until the event is set."""
    go = threading.Event()
    one_worker.service.pool.submit(go.wait, 30)
    try:
        yield go
    finally:
        go.set()


def test_echo_is_queued_behind_hold_only_once_holds_handler_runs(
    rpc_agents: tuple[RpcAgent, RpcAgent],
    one_worker: OneWorker,  # noqa: F811
    pinned: threading.Event,
) -> None:
    """The helper the pool tests share waits for Hold's handler, not only for the picture."""
    s_agent, _ = rpc_agents
    with pytest.raises(TimeoutError, match="Hold's handler running"):
        one_worker.queue_echo_behind_hold(s_agent, timeout=0.5)  # the worker cannot reach Hold
    assert pictured(s_agent) == ([f"/{SERVICE}/Hold"], [])  # pictured running all the same
    assert not one_worker.held.is_set()
    pinned.set()
    poll(one_worker.held.is_set, "Hold's handler running once the worker is free")


def test_a_server_stopped_before_the_running_calls_handler_started_takes_both_calls_out(
    rpc_agents: tuple[RpcAgent, RpcAgent],
    one_worker: OneWorker,  # noqa: F811
    pinned: threading.Event,
) -> None:
    """Both calls end unrun: the picture empties, and no handler runs once the worker is free."""
    s_agent, _ = rpc_agents
    (pool,) = s_agent._pools
    hold = one_worker.channel.unary_unary(f"/{SERVICE}/Hold").future(b"", timeout=30)
    poll(lambda: pictured(s_agent)[0] == [f"/{SERVICE}/Hold"], "Hold pictured running")
    echo = one_worker.channel.unary_unary(f"/{SERVICE}/Echo").future(b"", timeout=30)

    def echo_queued() -> bool:
        with s_agent._lock:
            return any(call.work is not None for call in pool.queued.values())

    poll(echo_queued, "Echo queued with its work item")
    stopped = one_worker.service.server.stop(grace=0)
    poll(lambda: pictured(s_agent) == ([], []), "an empty picture of the pool")
    assert s_agent.open_waits() == []
    for call in (hold, echo):
        with pytest.raises(grpc.RpcError):
            call.result(10)
    pinned.set()
    assert stopped.wait(10)
    one_worker.service.pool.shutdown(wait=True)  # every item the worker still had is done
    assert not one_worker.held.is_set()
    assert not one_worker.echoed.is_set()
    assert pictured(s_agent) == ([], [])


def test_a_call_run_at_once_asks_grpc_for_no_end_callback_and_leaves_once_the_picture_fills(
    rpc_agents: tuple[RpcAgent, RpcAgent],
    one_worker: OneWorker,  # noqa: F811
    pinned: threading.Event,
) -> None:
    """Hold runs at once in the picture (its worker, pinned, never reaches it) and is cancelled: a
    callback per call would cost grpc's polling thread, so gRPC tells the agent nothing; the next
    arrival, finding the picture full, takes Hold out, and Echo runs at once in its place."""
    s_agent, _ = rpc_agents
    (pool,) = s_agent._pools
    hold = one_worker.channel.unary_unary(f"/{SERVICE}/Hold").future(b"", timeout=30)

    def hold_tied() -> IncomingCall | None:
        with s_agent._lock:
            calls = list(pool.running.values())
        return calls[0] if calls and calls[0].work is not None else None

    held_call = poll(hold_tied, "Hold pictured running with its work item")
    grpc_state = held_call.work.args[2]
    assert not held_call.instance  # it ran at once: no wait to break
    with grpc_state.condition:
        assert grpc_state.callbacks == []  # the agent asked for no callback
    assert hold.cancel()
    poll(held_call.work.call_over, "gRPC's state of Hold saying it was cancelled")
    with s_agent._lock:
        assert list(pool.running) == [held_call.name]  # nothing told the agent: still pictured
    echo = one_worker.channel.unary_unary(f"/{SERVICE}/Echo").future(b"", timeout=30)

    def running_as_is() -> list[str]:  # read without taking out what gRPC ended, as pictured() does
        with s_agent._lock:
            return [name.split("#")[0] for name in pool.running]

    poll(lambda: running_as_is() == [f"/{SERVICE}/Echo"], "Echo pictured running in Hold's place")
    assert held_call.done and held_call.work is None
    assert pictured(s_agent) == ([f"/{SERVICE}/Echo"], [])  # it never queued behind the cancelled Hold
    pinned.set()
    assert echo.result(10) == b"echo"
    poll(lambda: pictured(s_agent) == ([], []), "an empty picture of the pool")
    assert not one_worker.held.is_set()  # the worker skipped the cancelled Hold


def test_a_recording_leaves_out_a_call_run_at_once_that_grpc_ended_before_its_handler_started(
    rpc_agents: tuple[RpcAgent, RpcAgent],
    one_worker: OneWorker,  # noqa: F811
    pinned: threading.Event,
) -> None:
    """Echo queues behind Hold, which ran at once but whose worker never reached it; Hold is
    cancelled. A recording then shows no wait on Hold: Echo, next in line, has the worker."""
    s_agent, _ = rpc_agents
    (pool,) = s_agent._pools
    hold = one_worker.channel.unary_unary(f"/{SERVICE}/Hold").future(b"", timeout=30)
    poll(lambda: pictured(s_agent)[0] == [f"/{SERVICE}/Hold"], "Hold pictured running")
    echo = one_worker.channel.unary_unary(f"/{SERVICE}/Echo").future(b"", timeout=30)

    def echo_queued_behind(name: str) -> bool:
        state = recorded(s_agent)
        return state is not None and [(w.task.split("#")[0], w.targets[0].task) for w in state.waits] == [
            (f"/{SERVICE}/Echo", name)
        ]

    with s_agent._lock:
        (held_call,) = pool.running.values()
    poll(lambda: echo_queued_behind(held_call.name), "Echo recorded waiting on Hold")
    assert hold.cancel()
    poll(lambda: held_call.work is not None and held_call.work.call_over(), "gRPC's state of Hold: cancelled")
    state = recorded(s_agent)
    assert state is not None and list(state.waits) == []  # no wait on the cancelled Hold
    assert held_call.done
    assert pictured(s_agent) == ([f"/{SERVICE}/Echo"], [])
    pinned.set()
    assert echo.result(10) == b"echo"
    assert not one_worker.held.is_set()
