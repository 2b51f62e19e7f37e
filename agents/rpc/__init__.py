"""RPC mode: ordinary gRPC services take part in snapshots through interceptors (DESIGN.md "RPC mode").

A service creates one :class:`RpcAgent` and installs its interceptors on its server and channels.
The protocol, Lai–Yang coloring, lives in the pure :class:`ColorCore` (:mod:`.core`); the agent
(:mod:`.agent`) carries out its actions, and the interceptors (:mod:`.interceptors`) and the
instrumented channels (:mod:`.channel`, :mod:`.aio_channel`) report each call to it through :class:`~.calls.CallEvents`;
:mod:`.pool` is a sync server's thread pool whose queued calls a break can refuse.
"""

from stablewatch.agents.rpc.agent import RpcAgent
from stablewatch.agents.rpc.aio_channel import AioInstrumentedChannel
from stablewatch.agents.rpc.calls import BadStamp, DeadlockBroken, RefusedResponse, StaleResponse
from stablewatch.agents.rpc.channel import InstrumentedChannel
from stablewatch.agents.rpc.core import STAMP_KEY, ColorCore, Stamp
from stablewatch.agents.rpc.interceptors import CURRENT_TASK
from stablewatch.agents.rpc.metrics import RpcAgentMetrics
from stablewatch.agents.rpc.pool import WorkerExecutor

__all__ = [
    "CURRENT_TASK",
    "STAMP_KEY",
    "AioInstrumentedChannel",
    "BadStamp",
    "ColorCore",
    "DeadlockBroken",
    "InstrumentedChannel",
    "RefusedResponse",
    "RpcAgent",
    "RpcAgentMetrics",
    "StaleResponse",
    "Stamp",
    "WorkerExecutor",
]
