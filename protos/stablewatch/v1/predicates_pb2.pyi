from google.protobuf import struct_pb2 as _struct_pb2
from stablewatch.v1 import state_pb2 as _state_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChannelRef(_message.Message):
    __slots__ = ("src", "dst")
    SRC_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    src: str
    dst: str
    def __init__(self, src: _Optional[str] = ..., dst: _Optional[str] = ...) -> None: ...

class WaitEdge(_message.Message):
    __slots__ = ("waiter", "target", "model", "discounted", "flow_control")
    WAITER_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DISCOUNTED_FIELD_NUMBER: _ClassVar[int]
    FLOW_CONTROL_FIELD_NUMBER: _ClassVar[int]
    waiter: _state_pb2.WaitNode
    target: _state_pb2.WaitNode
    model: _state_pb2.WaitModel
    discounted: bool
    flow_control: bool
    def __init__(self, waiter: _Optional[_Union[_state_pb2.WaitNode, _Mapping]] = ..., target: _Optional[_Union[_state_pb2.WaitNode, _Mapping]] = ..., model: _Optional[_Union[_state_pb2.WaitModel, str]] = ..., discounted: _Optional[bool] = ..., flow_control: _Optional[bool] = ...) -> None: ...

class DeadlockEvidence(_message.Message):
    __slots__ = ("deadlocked", "cycle", "knot", "empty_channels", "separate_deadlocks")
    DEADLOCKED_FIELD_NUMBER: _ClassVar[int]
    CYCLE_FIELD_NUMBER: _ClassVar[int]
    KNOT_FIELD_NUMBER: _ClassVar[int]
    EMPTY_CHANNELS_FIELD_NUMBER: _ClassVar[int]
    SEPARATE_DEADLOCKS_FIELD_NUMBER: _ClassVar[int]
    deadlocked: _containers.RepeatedCompositeFieldContainer[_state_pb2.WaitNode]
    cycle: _containers.RepeatedCompositeFieldContainer[_state_pb2.WaitNode]
    knot: _containers.RepeatedCompositeFieldContainer[_state_pb2.WaitNode]
    empty_channels: _containers.RepeatedCompositeFieldContainer[ChannelRef]
    separate_deadlocks: int
    def __init__(self, deadlocked: _Optional[_Iterable[_Union[_state_pb2.WaitNode, _Mapping]]] = ..., cycle: _Optional[_Iterable[_Union[_state_pb2.WaitNode, _Mapping]]] = ..., knot: _Optional[_Iterable[_Union[_state_pb2.WaitNode, _Mapping]]] = ..., empty_channels: _Optional[_Iterable[_Union[ChannelRef, _Mapping]]] = ..., separate_deadlocks: _Optional[int] = ...) -> None: ...

class CounterHolding(_message.Message):
    __slots__ = ("process", "channel", "amount")
    PROCESS_FIELD_NUMBER: _ClassVar[int]
    CHANNEL_FIELD_NUMBER: _ClassVar[int]
    AMOUNT_FIELD_NUMBER: _ClassVar[int]
    process: str
    channel: ChannelRef
    amount: int
    def __init__(self, process: _Optional[str] = ..., channel: _Optional[_Union[ChannelRef, _Mapping]] = ..., amount: _Optional[int] = ...) -> None: ...

class ConservationEvidence(_message.Message):
    __slots__ = ("counter", "expected", "observed", "drift", "holdings", "baseline")
    COUNTER_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_FIELD_NUMBER: _ClassVar[int]
    DRIFT_FIELD_NUMBER: _ClassVar[int]
    HOLDINGS_FIELD_NUMBER: _ClassVar[int]
    BASELINE_FIELD_NUMBER: _ClassVar[int]
    counter: str
    expected: int
    observed: int
    drift: int
    holdings: _containers.RepeatedCompositeFieldContainer[CounterHolding]
    baseline: bool
    def __init__(self, counter: _Optional[str] = ..., expected: _Optional[int] = ..., observed: _Optional[int] = ..., drift: _Optional[int] = ..., holdings: _Optional[_Iterable[_Union[CounterHolding, _Mapping]]] = ..., baseline: _Optional[bool] = ...) -> None: ...

class TerminationEvidence(_message.Message):
    __slots__ = ("active_processes", "busy_channels", "released_sends")
    ACTIVE_PROCESSES_FIELD_NUMBER: _ClassVar[int]
    BUSY_CHANNELS_FIELD_NUMBER: _ClassVar[int]
    RELEASED_SENDS_FIELD_NUMBER: _ClassVar[int]
    active_processes: _containers.RepeatedScalarFieldContainer[str]
    busy_channels: _containers.RepeatedCompositeFieldContainer[ChannelRef]
    released_sends: _containers.RepeatedCompositeFieldContainer[ChannelRef]
    def __init__(self, active_processes: _Optional[_Iterable[str]] = ..., busy_channels: _Optional[_Iterable[_Union[ChannelRef, _Mapping]]] = ..., released_sends: _Optional[_Iterable[_Union[ChannelRef, _Mapping]]] = ...) -> None: ...

class PredicateResult(_message.Message):
    __slots__ = ("name", "holds", "summary", "error", "unknown", "missing_processes", "deadlock", "conservation", "termination", "details")
    NAME_FIELD_NUMBER: _ClassVar[int]
    HOLDS_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    UNKNOWN_FIELD_NUMBER: _ClassVar[int]
    MISSING_PROCESSES_FIELD_NUMBER: _ClassVar[int]
    DEADLOCK_FIELD_NUMBER: _ClassVar[int]
    CONSERVATION_FIELD_NUMBER: _ClassVar[int]
    TERMINATION_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    name: str
    holds: bool
    summary: str
    error: str
    unknown: bool
    missing_processes: _containers.RepeatedScalarFieldContainer[str]
    deadlock: DeadlockEvidence
    conservation: ConservationEvidence
    termination: TerminationEvidence
    details: _struct_pb2.Struct
    def __init__(self, name: _Optional[str] = ..., holds: _Optional[bool] = ..., summary: _Optional[str] = ..., error: _Optional[str] = ..., unknown: _Optional[bool] = ..., missing_processes: _Optional[_Iterable[str]] = ..., deadlock: _Optional[_Union[DeadlockEvidence, _Mapping]] = ..., conservation: _Optional[_Union[ConservationEvidence, _Mapping]] = ..., termination: _Optional[_Union[TerminationEvidence, _Mapping]] = ..., details: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class WaitForGraph(_message.Message):
    __slots__ = ("snapshot_id", "nodes", "edges", "deadlock")
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    EDGES_FIELD_NUMBER: _ClassVar[int]
    DEADLOCK_FIELD_NUMBER: _ClassVar[int]
    snapshot_id: int
    nodes: _containers.RepeatedCompositeFieldContainer[_state_pb2.WaitNode]
    edges: _containers.RepeatedCompositeFieldContainer[WaitEdge]
    deadlock: DeadlockEvidence
    def __init__(self, snapshot_id: _Optional[int] = ..., nodes: _Optional[_Iterable[_Union[_state_pb2.WaitNode, _Mapping]]] = ..., edges: _Optional[_Iterable[_Union[WaitEdge, _Mapping]]] = ..., deadlock: _Optional[_Union[DeadlockEvidence, _Mapping]] = ...) -> None: ...

class CutCoverage(_message.Message):
    __slots__ = ("closed", "missing_processes", "missing_unnamed")
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    MISSING_PROCESSES_FIELD_NUMBER: _ClassVar[int]
    MISSING_UNNAMED_FIELD_NUMBER: _ClassVar[int]
    closed: bool
    missing_processes: _containers.RepeatedScalarFieldContainer[str]
    missing_unnamed: int
    def __init__(self, closed: _Optional[bool] = ..., missing_processes: _Optional[_Iterable[str]] = ..., missing_unnamed: _Optional[int] = ...) -> None: ...

class Evaluation(_message.Message):
    __slots__ = ("snapshot_id", "results", "wait_for", "coverage")
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    WAIT_FOR_FIELD_NUMBER: _ClassVar[int]
    COVERAGE_FIELD_NUMBER: _ClassVar[int]
    snapshot_id: int
    results: _containers.RepeatedCompositeFieldContainer[PredicateResult]
    wait_for: WaitForGraph
    coverage: CutCoverage
    def __init__(self, snapshot_id: _Optional[int] = ..., results: _Optional[_Iterable[_Union[PredicateResult, _Mapping]]] = ..., wait_for: _Optional[_Union[WaitForGraph, _Mapping]] = ..., coverage: _Optional[_Union[CutCoverage, _Mapping]] = ...) -> None: ...
