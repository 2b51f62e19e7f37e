from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WaitModel(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WAIT_MODEL_UNSPECIFIED: _ClassVar[WaitModel]
    WAIT_MODEL_AND: _ClassVar[WaitModel]
    WAIT_MODEL_OR: _ClassVar[WaitModel]
WAIT_MODEL_UNSPECIFIED: WaitModel
WAIT_MODEL_AND: WaitModel
WAIT_MODEL_OR: WaitModel

class WaitNode(_message.Message):
    __slots__ = ("process", "task")
    PROCESS_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    process: str
    task: str
    def __init__(self, process: _Optional[str] = ..., task: _Optional[str] = ...) -> None: ...

class Wait(_message.Message):
    __slots__ = ("task", "targets", "model", "flow_control", "instance", "began_at_us")
    TASK_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    FLOW_CONTROL_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    BEGAN_AT_US_FIELD_NUMBER: _ClassVar[int]
    task: str
    targets: _containers.RepeatedCompositeFieldContainer[WaitNode]
    model: WaitModel
    flow_control: bool
    instance: int
    began_at_us: int
    def __init__(self, task: _Optional[str] = ..., targets: _Optional[_Iterable[_Union[WaitNode, _Mapping]]] = ..., model: _Optional[_Union[WaitModel, str]] = ..., flow_control: _Optional[bool] = ..., instance: _Optional[int] = ..., began_at_us: _Optional[int] = ...) -> None: ...

class LocalState(_message.Message):
    __slots__ = ("active", "waits", "counters", "attributes", "handler_waits")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    WAITS_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    ATTRIBUTES_FIELD_NUMBER: _ClassVar[int]
    HANDLER_WAITS_FIELD_NUMBER: _ClassVar[int]
    active: bool
    waits: _containers.RepeatedCompositeFieldContainer[Wait]
    counters: _containers.ScalarMap[str, int]
    attributes: _struct_pb2.Struct
    handler_waits: bool
    def __init__(self, active: _Optional[bool] = ..., waits: _Optional[_Iterable[_Union[Wait, _Mapping]]] = ..., counters: _Optional[_Mapping[str, int]] = ..., attributes: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., handler_waits: _Optional[bool] = ...) -> None: ...
