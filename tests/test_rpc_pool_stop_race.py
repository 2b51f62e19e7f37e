"""A sync server stopped while a call has arrived but its handler has not started yet.

The agent pictures a call as running from its arrival (it has, or is about to get, a worker), so
the picture alone does not say that the worker has started its handler. Stopped in that window
(``stop(grace=0)`` on a loaded machine, before the pool's one thread has reached ``Hold``), gRPC
ends both ``Hold`` and the ``Echo`` queued behind it, neither handler runs, and both leave the
picture: ``test_rpc_sync_review``'s stop test, which expects ``Hold`` to stay, timed out in CI for
that reason. The ordering is forced here by giving the pool's only worker a work item of its own.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import grpc
import pytest
from rpc_harness import SERVICE
from test_rpc_sync_review import OneWorker, one_worker, pictured  # noqa: F401  (one_worker: a fixture)

from polling import poll
from stablewatch.agents.rpc.agent import RpcAgent


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
