"""Helpers of the RPC-mode end-to-end tests: raw-bytes gRPC services, agents attached to an in-test
detector (the ``running`` fixture of conftest.py), calls and snapshots."""

from __future__ import annotations

import asyncio
import itertools
import threading
from concurrent import futures
from typing import Any

import grpc

from polling import poll
from stablewatch.agents.rpc.agent import RpcAgent
from stablewatch.agents.rpc.calls import caller_tag
from stablewatch.testing.detector import Running
from stablewatch.v1 import GlobalSnapshot, LocalSnapshotPart, LocalState
from stablewatch.v1.query_pb2 import SnapshotResults

SERVICE = "test.Svc"
# Snapshot ids only ever grow, over all agents of the process: a start always records afresh.
_snapshot_ids = itertools.count(1)


def new_agent(process_id: str, **options: Any) -> RpcAgent:
    """A started agent without a detector; its recordings for tests expire quickly."""
    return RpcAgent(process_id, expire_interval=0.05, hint_after=None, **options).start()


def _method_path(method: str) -> str:
    return method if method.startswith("/") else f"/{SERVICE}/{method}"


def handler_prefix(method: str, caller: RpcAgent) -> str:
    """How the names of the handlers of ``caller``'s calls of ``method`` (``"Slow"`` for
    ``/{SERVICE}/Slow``, or a full path) begin, up to their call number: ``"{method}#{caller}@{incarnation}:"``."""
    return f"{_method_path(method)}#{caller_tag(caller.process_id, caller.incarnation)}:"


def handler_task(method: str, caller: RpcAgent, seq: int) -> str:
    """The name of the handler of ``caller``'s call number ``seq``, a call of ``method`` (as in
    :func:`handler_prefix`): ``"{method}#{caller}@{incarnation}:{seq}"``."""
    return f"{handler_prefix(method, caller)}{seq}"


def recorded(agent: RpcAgent, lifetime: float = 0.2) -> LocalState | None:
    """The local state ``agent`` records for a new snapshot now (None if it could not record: it keeps
    at most 16 recordings at once, and polls make one each look, kept for ``lifetime`` seconds)."""
    parts: list[LocalSnapshotPart] = []
    snapshot_id = next(_snapshot_ids)
    agent.on_part(lambda part: parts.append(part) if part.snapshot_id == snapshot_id else None)
    agent.start_snapshot(snapshot_id, lifetime=lifetime)
    states = [part.state for part in parts if part.HasField("state")]
    return states[0] if states else None


class Service:
    """A sync gRPC server on 127.0.0.1 with the given raw-bytes unary handlers, or method handlers of
    any kind (``grpc.unary_stream_rpc_method_handler(...)``), and its agent's interceptor."""

    def __init__(self, handlers: dict[str, Any], agent: RpcAgent | None, workers: int = 4) -> None:
        self.pool = futures.ThreadPoolExecutor(workers)
        interceptors = [agent.server_interceptor(workers=workers)] if agent is not None else []
        self.server = grpc.server(self.pool, interceptors=interceptors)
        methods = {
            name: fn if isinstance(fn, grpc.RpcMethodHandler) else grpc.unary_unary_rpc_method_handler(fn)
            for name, fn in handlers.items()
        }
        self.server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, methods)])
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.stop(grace=0).wait(10)
        self.pool.shutdown(wait=True, cancel_futures=True)


def channel_to(service: Service, agent: RpcAgent | None, peer: str | None) -> grpc.Channel:
    """A channel to ``service``, instrumented by ``agent`` as the README says (``instrument_channel``)."""
    channel = grpc.insecure_channel(service.address)
    if agent is None:
        return channel
    if peer:
        return agent.instrument_channel(channel, peer)
    return agent.instrument_channel(channel, target=service.address)


def aio_channel_to(address: str, c_agent: RpcAgent, setup: str, peer: str = "S") -> grpc.aio.Channel:
    """An asyncio channel to the process ``peer`` at ``address``, instrumented the ``setup`` way:
    grpc.aio's client interceptors, or the agent's instrumented channel."""
    if setup == "interceptors":
        return grpc.aio.insecure_channel(address, interceptors=c_agent.aio_client_interceptors(peer))
    return c_agent.instrument_channel(grpc.aio.insecure_channel(address), peer)


class AioServer:
    """An asyncio gRPC server on 127.0.0.1 serving ``handlers``, with ``agent``'s interceptor (or none).
    Made inside the event loop of its test; ``async with`` starts and stops it."""

    def __init__(self, agent: RpcAgent | None, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        self.server = grpc.aio.server(interceptors=[agent.aio_server_interceptor()] if agent is not None else [])
        self.server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, handlers)])
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"

    async def __aenter__(self) -> AioServer:
        await self.server.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.server.stop(0)


def pictured_calls(agent: RpcAgent) -> tuple[list[str], list[str]]:
    """The agent's picture of its one pool as a recording reads it (calls gRPC ended before their
    handler started taken out first): the running calls' and the queued calls' names."""
    (pool,) = agent._pools
    with agent._lock:
        agent._forget_ended(pool)
        return list(pool.running), list(pool.queued)


def outstanding(agent: RpcAgent) -> int:
    """The calls ``agent`` has out (waiting or not) whose end it has not taken in."""
    with agent._lock:
        return len(agent._outgoing)


def sample(agent: RpcAgent, name: str, **labels: str) -> float:
    """The agent's counter ``stablewatch_agent_rpc_{name}_total`` with ``labels`` (0 before its first count)."""
    return agent.metrics.registry.get_sample_value(f"stablewatch_agent_rpc_{name}_total", labels) or 0.0


def call(channel: grpc.Channel, method: str, payload: bytes = b"", **kwargs: Any) -> bytes:
    return channel.unary_unary(f"/{SERVICE}/{method}")(payload, **kwargs)


def agent(running: Running, process_id: str, gate: bool = False) -> RpcAgent:
    """A started agent attached to the detector; with ``gate``, its recordings for starts wait for ``agent.gate``."""
    new = RpcAgent(process_id, detector=running.detector.address, heartbeat_interval=0.2)
    if gate:
        new.gate = gate_starts(new)  # type: ignore[attr-defined]
    new.start()
    poll(lambda: new.detector_connected, f"{process_id} attached")
    return new


def snapshot(running: Running, deadline: float = 10) -> SnapshotResults:
    return running.call(running.detector.take_snapshot(deadline=deadline), 30)


def stored(running: Running, results: SnapshotResults) -> GlobalSnapshot:
    found = running.on_loop(lambda: running.detector.store.snapshot(results.snapshot.snapshot_id))
    assert found is not None
    return found


def stamped(agent: RpcAgent, kind: str) -> float | None:
    return agent.metrics.registry.get_sample_value("stablewatch_agent_rpc_stamped_messages_total", {"kind": kind})


def deadlock(results: SnapshotResults) -> Any:
    return next(r for r in results.results if r.name.startswith("deadlock"))


def gate_starts(agent: RpcAgent) -> threading.Event:
    """Hold back the agent's recordings for the detector's starts until the returned event is set
    (before the agent starts)."""
    gate = threading.Event()
    original = agent._detector_start  # a test seam: delay one side of a one-hop snapshot

    async def gated(snapshot_id: int, lifetime: float | None) -> None:
        await asyncio.to_thread(gate.wait, 20)
        await original(snapshot_id, lifetime)

    agent._detector_start = gated  # type: ignore[method-assign]
    return gate
