"""The embeddable agent: channels over gRPC, the Chandy–Lamport core, the control stream.

Asyncio services use :class:`Agent`; threaded services use :class:`ThreadedAgent`. The protocol
itself lives in :mod:`stablewatch.agents.core`, a pure state machine.
"""

from stablewatch.agents.agent import Agent, MessageHandler, MessageTooLarge
from stablewatch.agents.core import AppMessage
from stablewatch.agents.metrics import AgentMetrics
from stablewatch.agents.outbound import ChannelSettings
from stablewatch.agents.state import LocalStateKeeper
from stablewatch.agents.threaded import ThreadedAgent
from stablewatch.agents.tls import TlsConfig

__all__ = [
    "Agent",
    "AgentMetrics",
    "AppMessage",
    "ChannelSettings",
    "LocalStateKeeper",
    "MessageHandler",
    "MessageTooLarge",
    "ThreadedAgent",
    "TlsConfig",
]
