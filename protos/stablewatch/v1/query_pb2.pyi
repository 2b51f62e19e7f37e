import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from stablewatch.v1 import control_pb2 as _control_pb2
from stablewatch.v1 import predicates_pb2 as _predicates_pb2
from stablewatch.v1 import snapshot_pb2 as _snapshot_pb2
from stablewatch.v1 import state_pb2 as _state_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SnapshotOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SNAPSHOT_OUTCOME_UNSPECIFIED: _ClassVar[SnapshotOutcome]
    SNAPSHOT_OUTCOME_RUNNING: _ClassVar[SnapshotOutcome]
    SNAPSHOT_OUTCOME_COMPLETED: _ClassVar[SnapshotOutcome]
    SNAPSHOT_OUTCOME_ABORTED: _ClassVar[SnapshotOutcome]
SNAPSHOT_OUTCOME_UNSPECIFIED: SnapshotOutcome
SNAPSHOT_OUTCOME_RUNNING: SnapshotOutcome
SNAPSHOT_OUTCOME_COMPLETED: SnapshotOutcome
SNAPSHOT_OUTCOME_ABORTED: SnapshotOutcome

class SnapshotSummary(_message.Message):
    __slots__ = ("snapshot_id", "outcome", "abort_reason", "started_at", "finished_at", "processes", "channels", "messages_in_flight", "abort_kind")
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    ABORT_REASON_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_FIELD_NUMBER: _ClassVar[int]
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    CHANNELS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    ABORT_KIND_FIELD_NUMBER: _ClassVar[int]
    snapshot_id: int
    outcome: SnapshotOutcome
    abort_reason: str
    started_at: _timestamp_pb2.Timestamp
    finished_at: _timestamp_pb2.Timestamp
    processes: int
    channels: int
    messages_in_flight: int
    abort_kind: str
    def __init__(self, snapshot_id: _Optional[int] = ..., outcome: _Optional[_Union[SnapshotOutcome, str]] = ..., abort_reason: _Optional[str] = ..., started_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., finished_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., processes: _Optional[int] = ..., channels: _Optional[int] = ..., messages_in_flight: _Optional[int] = ..., abort_kind: _Optional[str] = ...) -> None: ...

class SnapshotResults(_message.Message):
    __slots__ = ("snapshot", "results")
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    snapshot: SnapshotSummary
    results: _containers.RepeatedCompositeFieldContainer[_predicates_pb2.PredicateResult]
    def __init__(self, snapshot: _Optional[_Union[SnapshotSummary, _Mapping]] = ..., results: _Optional[_Iterable[_Union[_predicates_pb2.PredicateResult, _Mapping]]] = ...) -> None: ...

class GetLatestResultsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetSnapshotRequest(_message.Message):
    __slots__ = ("snapshot_id",)
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    snapshot_id: int
    def __init__(self, snapshot_id: _Optional[int] = ...) -> None: ...

class ListSnapshotsRequest(_message.Message):
    __slots__ = ("page_size", "page_token")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListSnapshotsResponse(_message.Message):
    __slots__ = ("snapshots", "next_page_token")
    SNAPSHOTS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    snapshots: _containers.RepeatedCompositeFieldContainer[SnapshotSummary]
    next_page_token: str
    def __init__(self, snapshots: _Optional[_Iterable[_Union[SnapshotSummary, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class TriggerSnapshotRequest(_message.Message):
    __slots__ = ("timeout_ms", "expected_members")
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_MEMBERS_FIELD_NUMBER: _ClassVar[int]
    timeout_ms: int
    expected_members: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, timeout_ms: _Optional[int] = ..., expected_members: _Optional[_Iterable[str]] = ...) -> None: ...

class Member(_message.Message):
    __slots__ = ("process_id", "address", "attached_at", "last_heartbeat")
    PROCESS_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ATTACHED_AT_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    process_id: str
    address: str
    attached_at: _timestamp_pb2.Timestamp
    last_heartbeat: _timestamp_pb2.Timestamp
    def __init__(self, process_id: _Optional[str] = ..., address: _Optional[str] = ..., attached_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., last_heartbeat: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class ListMembersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListMembersResponse(_message.Message):
    __slots__ = ("members", "expected_missing", "expected_count")
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_MISSING_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_COUNT_FIELD_NUMBER: _ClassVar[int]
    members: _containers.RepeatedCompositeFieldContainer[Member]
    expected_missing: _containers.RepeatedScalarFieldContainer[str]
    expected_count: int
    def __init__(self, members: _Optional[_Iterable[_Union[Member, _Mapping]]] = ..., expected_missing: _Optional[_Iterable[str]] = ..., expected_count: _Optional[int] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("changes_only",)
    CHANGES_ONLY_FIELD_NUMBER: _ClassVar[int]
    changes_only: bool
    def __init__(self, changes_only: _Optional[bool] = ...) -> None: ...

class PredicateChange(_message.Message):
    __slots__ = ("name", "holds", "previous_holds", "first", "unknown", "previous_unknown")
    NAME_FIELD_NUMBER: _ClassVar[int]
    HOLDS_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_HOLDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_FIELD_NUMBER: _ClassVar[int]
    UNKNOWN_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_UNKNOWN_FIELD_NUMBER: _ClassVar[int]
    name: str
    holds: bool
    previous_holds: bool
    first: bool
    unknown: bool
    previous_unknown: bool
    def __init__(self, name: _Optional[str] = ..., holds: _Optional[bool] = ..., previous_holds: _Optional[bool] = ..., first: _Optional[bool] = ..., unknown: _Optional[bool] = ..., previous_unknown: _Optional[bool] = ...) -> None: ...

class Resolution(_message.Message):
    __slots__ = ("resolution_id", "snapshot_id", "process_id", "task", "instance", "wait_began_at", "policy", "requested_by", "component", "deadlock", "sent_at", "reported_at", "outcome", "detail")
    RESOLUTION_ID_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    PROCESS_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    WAIT_BEGAN_AT_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_BY_FIELD_NUMBER: _ClassVar[int]
    COMPONENT_FIELD_NUMBER: _ClassVar[int]
    DEADLOCK_FIELD_NUMBER: _ClassVar[int]
    SENT_AT_FIELD_NUMBER: _ClassVar[int]
    REPORTED_AT_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    resolution_id: int
    snapshot_id: int
    process_id: str
    task: str
    instance: int
    wait_began_at: _timestamp_pb2.Timestamp
    policy: str
    requested_by: str
    component: _containers.RepeatedCompositeFieldContainer[_state_pb2.WaitNode]
    deadlock: str
    sent_at: _timestamp_pb2.Timestamp
    reported_at: _timestamp_pb2.Timestamp
    outcome: _control_pb2.BreakOutcome
    detail: str
    def __init__(self, resolution_id: _Optional[int] = ..., snapshot_id: _Optional[int] = ..., process_id: _Optional[str] = ..., task: _Optional[str] = ..., instance: _Optional[int] = ..., wait_began_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., policy: _Optional[str] = ..., requested_by: _Optional[str] = ..., component: _Optional[_Iterable[_Union[_state_pb2.WaitNode, _Mapping]]] = ..., deadlock: _Optional[str] = ..., sent_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., reported_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., outcome: _Optional[_Union[_control_pb2.BreakOutcome, str]] = ..., detail: _Optional[str] = ...) -> None: ...

class ResolveRequest(_message.Message):
    __slots__ = ("snapshot_id",)
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    snapshot_id: int
    def __init__(self, snapshot_id: _Optional[int] = ...) -> None: ...

class ResolveResponse(_message.Message):
    __slots__ = ("resolutions",)
    RESOLUTIONS_FIELD_NUMBER: _ClassVar[int]
    resolutions: _containers.RepeatedCompositeFieldContainer[Resolution]
    def __init__(self, resolutions: _Optional[_Iterable[_Union[Resolution, _Mapping]]] = ...) -> None: ...

class ListResolutionsRequest(_message.Message):
    __slots__ = ("page_size", "page_token")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListResolutionsResponse(_message.Message):
    __slots__ = ("resolutions", "next_page_token")
    RESOLUTIONS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    resolutions: _containers.RepeatedCompositeFieldContainer[Resolution]
    next_page_token: str
    def __init__(self, resolutions: _Optional[_Iterable[_Union[Resolution, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class WatchEvent(_message.Message):
    __slots__ = ("results", "changes", "snapshot_id", "resolution")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    CHANGES_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    RESOLUTION_FIELD_NUMBER: _ClassVar[int]
    results: SnapshotResults
    changes: _containers.RepeatedCompositeFieldContainer[PredicateChange]
    snapshot_id: int
    resolution: Resolution
    def __init__(self, results: _Optional[_Union[SnapshotResults, _Mapping]] = ..., changes: _Optional[_Iterable[_Union[PredicateChange, _Mapping]]] = ..., snapshot_id: _Optional[int] = ..., resolution: _Optional[_Union[Resolution, _Mapping]] = ...) -> None: ...
