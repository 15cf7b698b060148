from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Identity(_message.Message):
    __slots__ = ("cluster", "worker_id", "incarnation", "term")
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    TERM_FIELD_NUMBER: _ClassVar[int]
    cluster: str
    worker_id: str
    incarnation: int
    term: int
    def __init__(self, cluster: _Optional[str] = ..., worker_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., term: _Optional[int] = ...) -> None: ...

class PingRequest(_message.Message):
    __slots__ = ("to",)
    TO_FIELD_NUMBER: _ClassVar[int]
    to: Identity
    def __init__(self, to: _Optional[_Union[Identity, _Mapping]] = ...) -> None: ...

class PingResponse(_message.Message):
    __slots__ = ("worker_id", "incarnation", "devices", "state")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    incarnation: int
    devices: int
    state: str
    def __init__(self, worker_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., devices: _Optional[int] = ..., state: _Optional[str] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("to", "coordinator_id", "interval_s")
    TO_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_ID_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    to: Identity
    coordinator_id: str
    interval_s: float
    def __init__(self, to: _Optional[_Union[Identity, _Mapping]] = ..., coordinator_id: _Optional[str] = ..., interval_s: _Optional[float] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("worker_id", "incarnation", "seq", "fenced")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    FENCED_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    incarnation: int
    seq: int
    fenced: bool
    def __init__(self, worker_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., seq: _Optional[int] = ..., fenced: _Optional[bool] = ...) -> None: ...
