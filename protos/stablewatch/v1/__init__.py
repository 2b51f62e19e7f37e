"""The wire contract, package ``stablewatch.v1``: messages generated from the .proto files beside this one."""

from stablewatch.v1.channel_pb2 import ChannelAck, ChannelFrame, ChannelHello, EntryExtras, MarkerEntry
from stablewatch.v1.control_pb2 import AgentMessage, DetectorMessage
from stablewatch.v1.predicates_pb2 import (
    ChannelRef,
    ConservationEvidence,
    CounterHolding,
    CutCoverage,
    DeadlockEvidence,
    Evaluation,
    PredicateResult,
    TerminationEvidence,
    WaitEdge,
    WaitForGraph,
)
from stablewatch.v1.snapshot_pb2 import (
    AckPosition,
    ChannelSnapshot,
    GlobalSnapshot,
    InboundChannelState,
    LocalSnapshotPart,
    OutboundCount,
    ProcessSnapshot,
    RecordedMessage,
)
from stablewatch.v1.state_pb2 import WAIT_MODEL_AND, WAIT_MODEL_OR, LocalState, Wait, WaitModel, WaitNode

__all__ = [
    "WAIT_MODEL_AND",
    "WAIT_MODEL_OR",
    "AckPosition",
    "AgentMessage",
    "ChannelAck",
    "ChannelFrame",
    "ChannelHello",
    "ChannelRef",
    "ChannelSnapshot",
    "ConservationEvidence",
    "CounterHolding",
    "CutCoverage",
    "DeadlockEvidence",
    "DetectorMessage",
    "EntryExtras",
    "Evaluation",
    "GlobalSnapshot",
    "InboundChannelState",
    "LocalSnapshotPart",
    "LocalState",
    "MarkerEntry",
    "OutboundCount",
    "PredicateResult",
    "ProcessSnapshot",
    "RecordedMessage",
    "TerminationEvidence",
    "Wait",
    "WaitEdge",
    "WaitForGraph",
    "WaitModel",
    "WaitNode",
]
