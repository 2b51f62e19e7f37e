import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from stablewatch.v1 import channel_pb2 as _channel_pb2
from stablewatch.v1 import state_pb2 as _state_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RecordedMessage(_message.Message):
    __slots__ = ("payload", "counters", "no_wake", "receive_index", "wakes_task")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    NO_WAKE_FIELD_NUMBER: _ClassVar[int]
    RECEIVE_INDEX_FIELD_NUMBER: _ClassVar[int]
    WAKES_TASK_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    counters: _containers.ScalarMap[str, int]
    no_wake: bool
    receive_index: int
    wakes_task: str
    def __init__(self, payload: _Optional[bytes] = ..., counters: _Optional[_Mapping[str, int]] = ..., no_wake: _Optional[bool] = ..., receive_index: _Optional[int] = ..., wakes_task: _Optional[str] = ...) -> None: ...

class AckPosition(_message.Message):
    __slots__ = ("sender_incarnation", "receiver_incarnation", "next_seq")
    SENDER_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    NEXT_SEQ_FIELD_NUMBER: _ClassVar[int]
    sender_incarnation: int
    receiver_incarnation: int
    next_seq: int
    def __init__(self, sender_incarnation: _Optional[int] = ..., receiver_incarnation: _Optional[int] = ..., next_seq: _Optional[int] = ...) -> None: ...

class OutboundCount(_message.Message):
    __slots__ = ("dst", "sent_before_marker", "ack_seen", "session")
    DST_FIELD_NUMBER: _ClassVar[int]
    SENT_BEFORE_MARKER_FIELD_NUMBER: _ClassVar[int]
    ACK_SEEN_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    dst: str
    sent_before_marker: int
    ack_seen: AckPosition
    session: int
    def __init__(self, dst: _Optional[str] = ..., sent_before_marker: _Optional[int] = ..., ack_seen: _Optional[_Union[AckPosition, _Mapping]] = ..., session: _Optional[int] = ...) -> None: ...

class InboundChannelState(_message.Message):
    __slots__ = ("src", "received_before_recording", "messages", "payloads", "run_starts", "run_lengths", "extras", "acked", "session", "open")
    SRC_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_BEFORE_RECORDING_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    PAYLOADS_FIELD_NUMBER: _ClassVar[int]
    RUN_STARTS_FIELD_NUMBER: _ClassVar[int]
    RUN_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    EXTRAS_FIELD_NUMBER: _ClassVar[int]
    ACKED_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    OPEN_FIELD_NUMBER: _ClassVar[int]
    src: str
    received_before_recording: int
    messages: _containers.RepeatedCompositeFieldContainer[RecordedMessage]
    payloads: _containers.RepeatedScalarFieldContainer[bytes]
    run_starts: _containers.RepeatedScalarFieldContainer[int]
    run_lengths: _containers.RepeatedScalarFieldContainer[int]
    extras: _containers.RepeatedCompositeFieldContainer[_channel_pb2.EntryExtras]
    acked: AckPosition
    session: int
    open: bool
    def __init__(self, src: _Optional[str] = ..., received_before_recording: _Optional[int] = ..., messages: _Optional[_Iterable[_Union[RecordedMessage, _Mapping]]] = ..., payloads: _Optional[_Iterable[bytes]] = ..., run_starts: _Optional[_Iterable[int]] = ..., run_lengths: _Optional[_Iterable[int]] = ..., extras: _Optional[_Iterable[_Union[_channel_pb2.EntryExtras, _Mapping]]] = ..., acked: _Optional[_Union[AckPosition, _Mapping]] = ..., session: _Optional[int] = ..., open: _Optional[bool] = ...) -> None: ...

class LocalSnapshotPart(_message.Message):
    __slots__ = ("snapshot_id", "process_id", "state", "outbound", "inbound")
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    PROCESS_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    OUTBOUND_FIELD_NUMBER: _ClassVar[int]
    INBOUND_FIELD_NUMBER: _ClassVar[int]
    snapshot_id: int
    process_id: str
    state: _state_pb2.LocalState
    outbound: _containers.RepeatedCompositeFieldContainer[OutboundCount]
    inbound: _containers.RepeatedCompositeFieldContainer[InboundChannelState]
    def __init__(self, snapshot_id: _Optional[int] = ..., process_id: _Optional[str] = ..., state: _Optional[_Union[_state_pb2.LocalState, _Mapping]] = ..., outbound: _Optional[_Iterable[_Union[OutboundCount, _Mapping]]] = ..., inbound: _Optional[_Iterable[_Union[InboundChannelState, _Mapping]]] = ...) -> None: ...

class ProcessSnapshot(_message.Message):
    __slots__ = ("process_id", "state")
    PROCESS_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    process_id: str
    state: _state_pb2.LocalState
    def __init__(self, process_id: _Optional[str] = ..., state: _Optional[_Union[_state_pb2.LocalState, _Mapping]] = ...) -> None: ...

class ChannelSnapshot(_message.Message):
    __slots__ = ("src", "dst", "sent_before_marker", "received_before_recording", "messages", "receiver_acked", "sender_ack_seen")
    SRC_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    SENT_BEFORE_MARKER_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_BEFORE_RECORDING_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_ACKED_FIELD_NUMBER: _ClassVar[int]
    SENDER_ACK_SEEN_FIELD_NUMBER: _ClassVar[int]
    src: str
    dst: str
    sent_before_marker: int
    received_before_recording: int
    messages: _containers.RepeatedCompositeFieldContainer[RecordedMessage]
    receiver_acked: AckPosition
    sender_ack_seen: AckPosition
    def __init__(self, src: _Optional[str] = ..., dst: _Optional[str] = ..., sent_before_marker: _Optional[int] = ..., received_before_recording: _Optional[int] = ..., messages: _Optional[_Iterable[_Union[RecordedMessage, _Mapping]]] = ..., receiver_acked: _Optional[_Union[AckPosition, _Mapping]] = ..., sender_ack_seen: _Optional[_Union[AckPosition, _Mapping]] = ...) -> None: ...

class GlobalSnapshot(_message.Message):
    __slots__ = ("snapshot_id", "processes", "channels", "started_at", "completed_at", "expected_members", "expected_member_count", "outside_peers")
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    CHANNELS_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_AT_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_MEMBERS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_MEMBER_COUNT_FIELD_NUMBER: _ClassVar[int]
    OUTSIDE_PEERS_FIELD_NUMBER: _ClassVar[int]
    snapshot_id: int
    processes: _containers.RepeatedCompositeFieldContainer[ProcessSnapshot]
    channels: _containers.RepeatedCompositeFieldContainer[ChannelSnapshot]
    started_at: _timestamp_pb2.Timestamp
    completed_at: _timestamp_pb2.Timestamp
    expected_members: _containers.RepeatedScalarFieldContainer[str]
    expected_member_count: int
    outside_peers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, snapshot_id: _Optional[int] = ..., processes: _Optional[_Iterable[_Union[ProcessSnapshot, _Mapping]]] = ..., channels: _Optional[_Iterable[_Union[ChannelSnapshot, _Mapping]]] = ..., started_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., completed_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., expected_members: _Optional[_Iterable[str]] = ..., expected_member_count: _Optional[int] = ..., outside_peers: _Optional[_Iterable[str]] = ...) -> None: ...
