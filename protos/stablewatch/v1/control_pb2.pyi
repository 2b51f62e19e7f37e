from stablewatch.v1 import snapshot_pb2 as _snapshot_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class BreakOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BREAK_OUTCOME_UNSPECIFIED: _ClassVar[BreakOutcome]
    BREAK_OUTCOME_BROKEN: _ClassVar[BreakOutcome]
    BREAK_OUTCOME_GONE: _ClassVar[BreakOutcome]
    BREAK_OUTCOME_ALREADY_BROKEN: _ClassVar[BreakOutcome]
    BREAK_OUTCOME_POLICIES_DISAGREE: _ClassVar[BreakOutcome]
    BREAK_OUTCOME_FAILED: _ClassVar[BreakOutcome]
BREAK_OUTCOME_UNSPECIFIED: BreakOutcome
BREAK_OUTCOME_BROKEN: BreakOutcome
BREAK_OUTCOME_GONE: BreakOutcome
BREAK_OUTCOME_ALREADY_BROKEN: BreakOutcome
BREAK_OUTCOME_POLICIES_DISAGREE: BreakOutcome
BREAK_OUTCOME_FAILED: BreakOutcome

class Register(_message.Message):
    __slots__ = ("process_id", "address", "incarnation", "agent_version", "rpc_mode", "known_epoch")
    PROCESS_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    AGENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    RPC_MODE_FIELD_NUMBER: _ClassVar[int]
    KNOWN_EPOCH_FIELD_NUMBER: _ClassVar[int]
    process_id: str
    address: str
    incarnation: int
    agent_version: str
    rpc_mode: bool
    known_epoch: int
    def __init__(self, process_id: _Optional[str] = ..., address: _Optional[str] = ..., incarnation: _Optional[int] = ..., agent_version: _Optional[str] = ..., rpc_mode: _Optional[bool] = ..., known_epoch: _Optional[int] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("sequence", "epoch")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    epoch: int
    def __init__(self, sequence: _Optional[int] = ..., epoch: _Optional[int] = ...) -> None: ...

class SnapshotFailure(_message.Message):
    __slots__ = ("snapshot_id", "process_id", "reason")
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    PROCESS_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    snapshot_id: int
    process_id: str
    reason: str
    def __init__(self, snapshot_id: _Optional[int] = ..., process_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class Pong(_message.Message):
    __slots__ = ("nonce",)
    NONCE_FIELD_NUMBER: _ClassVar[int]
    nonce: int
    def __init__(self, nonce: _Optional[int] = ...) -> None: ...

class BreakReport(_message.Message):
    __slots__ = ("break_id", "instance", "outcome", "detail")
    BREAK_ID_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    break_id: int
    instance: int
    outcome: BreakOutcome
    detail: str
    def __init__(self, break_id: _Optional[int] = ..., instance: _Optional[int] = ..., outcome: _Optional[_Union[BreakOutcome, str]] = ..., detail: _Optional[str] = ...) -> None: ...

class WaitHint(_message.Message):
    __slots__ = ("instance", "task", "waited_ms")
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    WAITED_MS_FIELD_NUMBER: _ClassVar[int]
    instance: int
    task: str
    waited_ms: int
    def __init__(self, instance: _Optional[int] = ..., task: _Optional[str] = ..., waited_ms: _Optional[int] = ...) -> None: ...

class AgentMessage(_message.Message):
    __slots__ = ("register", "heartbeat", "part", "failure", "pong", "break_report", "hint")
    REGISTER_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    PONG_FIELD_NUMBER: _ClassVar[int]
    BREAK_REPORT_FIELD_NUMBER: _ClassVar[int]
    HINT_FIELD_NUMBER: _ClassVar[int]
    register: Register
    heartbeat: Heartbeat
    part: _snapshot_pb2.LocalSnapshotPart
    failure: SnapshotFailure
    pong: Pong
    break_report: BreakReport
    hint: WaitHint
    def __init__(self, register: _Optional[_Union[Register, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., part: _Optional[_Union[_snapshot_pb2.LocalSnapshotPart, _Mapping]] = ..., failure: _Optional[_Union[SnapshotFailure, _Mapping]] = ..., pong: _Optional[_Union[Pong, _Mapping]] = ..., break_report: _Optional[_Union[BreakReport, _Mapping]] = ..., hint: _Optional[_Union[WaitHint, _Mapping]] = ...) -> None: ...

class Registered(_message.Message):
    __slots__ = ("detector_id", "heartbeat_interval_ms", "detector_epoch", "id_space", "resolve_policy")
    DETECTOR_ID_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    DETECTOR_EPOCH_FIELD_NUMBER: _ClassVar[int]
    ID_SPACE_FIELD_NUMBER: _ClassVar[int]
    RESOLVE_POLICY_FIELD_NUMBER: _ClassVar[int]
    detector_id: str
    heartbeat_interval_ms: int
    detector_epoch: int
    id_space: int
    resolve_policy: str
    def __init__(self, detector_id: _Optional[str] = ..., heartbeat_interval_ms: _Optional[int] = ..., detector_epoch: _Optional[int] = ..., id_space: _Optional[int] = ..., resolve_policy: _Optional[str] = ...) -> None: ...

class Refused(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class StartSnapshot(_message.Message):
    __slots__ = ("snapshot_id", "deadline_ms", "ended")
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    ENDED_FIELD_NUMBER: _ClassVar[int]
    snapshot_id: int
    deadline_ms: int
    ended: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, snapshot_id: _Optional[int] = ..., deadline_ms: _Optional[int] = ..., ended: _Optional[_Iterable[int]] = ...) -> None: ...

class AbortSnapshot(_message.Message):
    __slots__ = ("snapshot_id", "reason")
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    snapshot_id: int
    reason: str
    def __init__(self, snapshot_id: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class SnapshotsEnded(_message.Message):
    __slots__ = ("snapshot_ids",)
    SNAPSHOT_IDS_FIELD_NUMBER: _ClassVar[int]
    snapshot_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, snapshot_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ChannelTarget(_message.Message):
    __slots__ = ("snapshot_id", "src", "sent", "src_incarnation", "session")
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    SRC_FIELD_NUMBER: _ClassVar[int]
    SENT_FIELD_NUMBER: _ClassVar[int]
    SRC_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    snapshot_id: int
    src: str
    sent: int
    src_incarnation: int
    session: int
    def __init__(self, snapshot_id: _Optional[int] = ..., src: _Optional[str] = ..., sent: _Optional[int] = ..., src_incarnation: _Optional[int] = ..., session: _Optional[int] = ...) -> None: ...

class Ping(_message.Message):
    __slots__ = ("nonce",)
    NONCE_FIELD_NUMBER: _ClassVar[int]
    nonce: int
    def __init__(self, nonce: _Optional[int] = ...) -> None: ...

class BreakWait(_message.Message):
    __slots__ = ("break_id", "snapshot_id", "instance", "task", "deadlock", "policy", "chosen_by", "knows_failed")
    BREAK_ID_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    DEADLOCK_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    CHOSEN_BY_FIELD_NUMBER: _ClassVar[int]
    KNOWS_FAILED_FIELD_NUMBER: _ClassVar[int]
    break_id: int
    snapshot_id: int
    instance: int
    task: str
    deadlock: str
    policy: str
    chosen_by: str
    knows_failed: bool
    def __init__(self, break_id: _Optional[int] = ..., snapshot_id: _Optional[int] = ..., instance: _Optional[int] = ..., task: _Optional[str] = ..., deadlock: _Optional[str] = ..., policy: _Optional[str] = ..., chosen_by: _Optional[str] = ..., knows_failed: _Optional[bool] = ...) -> None: ...

class DetectorMessage(_message.Message):
    __slots__ = ("registered", "refused", "start", "abort", "ended", "ping", "channel_target", "break_wait")
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    ENDED_FIELD_NUMBER: _ClassVar[int]
    PING_FIELD_NUMBER: _ClassVar[int]
    CHANNEL_TARGET_FIELD_NUMBER: _ClassVar[int]
    BREAK_WAIT_FIELD_NUMBER: _ClassVar[int]
    registered: Registered
    refused: Refused
    start: StartSnapshot
    abort: AbortSnapshot
    ended: SnapshotsEnded
    ping: Ping
    channel_target: ChannelTarget
    break_wait: BreakWait
    def __init__(self, registered: _Optional[_Union[Registered, _Mapping]] = ..., refused: _Optional[_Union[Refused, _Mapping]] = ..., start: _Optional[_Union[StartSnapshot, _Mapping]] = ..., abort: _Optional[_Union[AbortSnapshot, _Mapping]] = ..., ended: _Optional[_Union[SnapshotsEnded, _Mapping]] = ..., ping: _Optional[_Union[Ping, _Mapping]] = ..., channel_target: _Optional[_Union[ChannelTarget, _Mapping]] = ..., break_wait: _Optional[_Union[BreakWait, _Mapping]] = ...) -> None: ...
