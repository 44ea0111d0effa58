from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RequestState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REQUEST_STATE_UNSPECIFIED: _ClassVar[RequestState]
    REQUEST_STATE_WAITING: _ClassVar[RequestState]
    REQUEST_STATE_PREFILL: _ClassVar[RequestState]
    REQUEST_STATE_DECODE: _ClassVar[RequestState]
REQUEST_STATE_UNSPECIFIED: RequestState
REQUEST_STATE_WAITING: RequestState
REQUEST_STATE_PREFILL: RequestState
REQUEST_STATE_DECODE: RequestState

class SaveSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class SessionChunk(_message.Message):
    __slots__ = ("data", "model")
    DATA_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    model: str
    def __init__(self, data: _Optional[bytes] = ..., model: _Optional[str] = ...) -> None: ...

class RestoreSessionResponse(_message.Message):
    __slots__ = ("session", "positions")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    session: Session
    positions: int
    def __init__(self, session: _Optional[_Union[Session, _Mapping]] = ..., positions: _Optional[int] = ...) -> None: ...

class Session(_message.Message):
    __slots__ = ("id", "model", "position", "max_seq", "device_ids", "busy", "created_unix", "kv_bytes", "num_messages")
    ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQ_FIELD_NUMBER: _ClassVar[int]
    DEVICE_IDS_FIELD_NUMBER: _ClassVar[int]
    BUSY_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    id: str
    model: str
    position: int
    max_seq: int
    device_ids: _containers.RepeatedScalarFieldContainer[str]
    busy: bool
    created_unix: int
    kv_bytes: int
    num_messages: int
    def __init__(self, id: _Optional[str] = ..., model: _Optional[str] = ..., position: _Optional[int] = ..., max_seq: _Optional[int] = ..., device_ids: _Optional[_Iterable[str]] = ..., busy: _Optional[bool] = ..., created_unix: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., num_messages: _Optional[int] = ...) -> None: ...

class CreateSessionRequest(_message.Message):
    __slots__ = ("model", "devices", "max_seq")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQ_FIELD_NUMBER: _ClassVar[int]
    model: str
    devices: str
    max_seq: int
    def __init__(self, model: _Optional[str] = ..., devices: _Optional[str] = ..., max_seq: _Optional[int] = ...) -> None: ...

class CreateSessionResponse(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: Session
    def __init__(self, session: _Optional[_Union[Session, _Mapping]] = ...) -> None: ...

class GetSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class GetSessionResponse(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: Session
    def __init__(self, session: _Optional[_Union[Session, _Mapping]] = ...) -> None: ...

class ListSessionsRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class ListSessionsResponse(_message.Message):
    __slots__ = ("sessions",)
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[Session]
    def __init__(self, sessions: _Optional[_Iterable[_Union[Session, _Mapping]]] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResetSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class ResetSessionResponse(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: Session
    def __init__(self, session: _Optional[_Union[Session, _Mapping]] = ...) -> None: ...

class QueueEntry(_message.Message):
    __slots__ = ("request_id", "session_id", "state", "prompt_tokens", "generated_tokens", "age_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    AGE_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    session_id: str
    state: RequestState
    prompt_tokens: int
    generated_tokens: int
    age_ms: float
    def __init__(self, request_id: _Optional[str] = ..., session_id: _Optional[str] = ..., state: _Optional[_Union[RequestState, str]] = ..., prompt_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., age_ms: _Optional[float] = ...) -> None: ...

class GetDeviceQueueRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class ModelQueue(_message.Message):
    __slots__ = ("model", "device_ids", "max_rows", "running", "waiting")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DEVICE_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_ROWS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    model: str
    device_ids: _containers.RepeatedScalarFieldContainer[str]
    max_rows: int
    running: _containers.RepeatedCompositeFieldContainer[QueueEntry]
    waiting: _containers.RepeatedCompositeFieldContainer[QueueEntry]
    def __init__(self, model: _Optional[str] = ..., device_ids: _Optional[_Iterable[str]] = ..., max_rows: _Optional[int] = ..., running: _Optional[_Iterable[_Union[QueueEntry, _Mapping]]] = ..., waiting: _Optional[_Iterable[_Union[QueueEntry, _Mapping]]] = ...) -> None: ...

class GetDeviceQueueResponse(_message.Message):
    __slots__ = ("queues",)
    QUEUES_FIELD_NUMBER: _ClassVar[int]
    queues: _containers.RepeatedCompositeFieldContainer[ModelQueue]
    def __init__(self, queues: _Optional[_Iterable[_Union[ModelQueue, _Mapping]]] = ...) -> None: ...
