"""The embeddable agent: channels over gRPC, the Chandy–Lamport core, the control stream.

Asyncio services use :class:`Agent`; threaded services use :class:`ThreadedAgent`. Services that
talk by ordinary gRPC calls use :class:`RpcAgent` and its interceptors (RPC mode). The protocols
live in pure state machines: :mod:`stablewatch.agents.core` (markers) and
:mod:`stablewatch.agents.rpc.core` (coloring), with the rest of RPC mode in :mod:`stablewatch.agents.rpc`.
"""

from stablewatch.agents.agent import Agent, MessageHandler, MessageTooLarge
from stablewatch.agents.breaking import DeadlockVictim
from stablewatch.agents.certificates import TlsConfig
from stablewatch.agents.core import AppMessage
from stablewatch.agents.metrics import AgentMetrics
from stablewatch.agents.outbound import ChannelSettings
from stablewatch.agents.rpc import RpcAgent
from stablewatch.agents.state import LocalStateKeeper, WaitHandle
from stablewatch.agents.threaded import ThreadedAgent

__all__ = [
    "Agent",
    "AgentMetrics",
    "AppMessage",
    "ChannelSettings",
    "DeadlockVictim",
    "LocalStateKeeper",
    "MessageHandler",
    "MessageTooLarge",
    "RpcAgent",
    "ThreadedAgent",
    "TlsConfig",
    "WaitHandle",
]
