from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChannelHello(_message.Message):
    __slots__ = ("src", "dst", "sender_incarnation")
    SRC_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    SENDER_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    src: str
    dst: str
    sender_incarnation: int
    def __init__(self, src: _Optional[str] = ..., dst: _Optional[str] = ..., sender_incarnation: _Optional[int] = ...) -> None: ...

class EntryExtras(_message.Message):
    __slots__ = ("position", "counters", "no_wake")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    POSITION_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    NO_WAKE_FIELD_NUMBER: _ClassVar[int]
    position: int
    counters: _containers.ScalarMap[str, int]
    no_wake: bool
    def __init__(self, position: _Optional[int] = ..., counters: _Optional[_Mapping[str, int]] = ..., no_wake: _Optional[bool] = ...) -> None: ...

class MarkerEntry(_message.Message):
    __slots__ = ("position", "snapshot_id")
    POSITION_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    position: int
    snapshot_id: int
    def __init__(self, position: _Optional[int] = ..., snapshot_id: _Optional[int] = ...) -> None: ...

class ChannelFrame(_message.Message):
    __slots__ = ("hello", "first_seq", "payloads", "markers", "extras", "ack_later")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    FIRST_SEQ_FIELD_NUMBER: _ClassVar[int]
    PAYLOADS_FIELD_NUMBER: _ClassVar[int]
    MARKERS_FIELD_NUMBER: _ClassVar[int]
    EXTRAS_FIELD_NUMBER: _ClassVar[int]
    ACK_LATER_FIELD_NUMBER: _ClassVar[int]
    hello: ChannelHello
    first_seq: int
    payloads: _containers.RepeatedScalarFieldContainer[bytes]
    markers: _containers.RepeatedCompositeFieldContainer[MarkerEntry]
    extras: _containers.RepeatedCompositeFieldContainer[EntryExtras]
    ack_later: bool
    def __init__(self, hello: _Optional[_Union[ChannelHello, _Mapping]] = ..., first_seq: _Optional[int] = ..., payloads: _Optional[_Iterable[bytes]] = ..., markers: _Optional[_Iterable[_Union[MarkerEntry, _Mapping]]] = ..., extras: _Optional[_Iterable[_Union[EntryExtras, _Mapping]]] = ..., ack_later: _Optional[bool] = ...) -> None: ...

class ChannelAck(_message.Message):
    __slots__ = ("next_seq", "receiver_incarnation")
    NEXT_SEQ_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    next_seq: int
    receiver_incarnation: int
    def __init__(self, next_seq: _Optional[int] = ..., receiver_incarnation: _Optional[int] = ...) -> None: ...
