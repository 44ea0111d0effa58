from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Residency(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RESIDENCY_UNSPECIFIED: _ClassVar[Residency]
    RESIDENCY_RESIDENT: _ClassVar[Residency]
    RESIDENCY_PAGED: _ClassVar[Residency]
    RESIDENCY_DEVICE: _ClassVar[Residency]
RESIDENCY_UNSPECIFIED: Residency
RESIDENCY_RESIDENT: Residency
RESIDENCY_PAGED: Residency
RESIDENCY_DEVICE: Residency

class BlockPlacement(_message.Message):
    __slots__ = ("index", "name", "place", "bytes", "kv_bytes", "residency")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    PLACE_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESIDENCY_FIELD_NUMBER: _ClassVar[int]
    index: int
    name: str
    place: str
    bytes: int
    kv_bytes: int
    residency: Residency
    def __init__(self, index: _Optional[int] = ..., name: _Optional[str] = ..., place: _Optional[str] = ..., bytes: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., residency: _Optional[_Union[Residency, str]] = ...) -> None: ...

class Placement(_message.Message):
    __slots__ = ("model", "session_id", "blocks", "device_blocks", "host_blocks", "num_seams", "relocation", "moves")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_SEAMS_FIELD_NUMBER: _ClassVar[int]
    RELOCATION_FIELD_NUMBER: _ClassVar[int]
    MOVES_FIELD_NUMBER: _ClassVar[int]
    model: str
    session_id: str
    blocks: _containers.RepeatedCompositeFieldContainer[BlockPlacement]
    device_blocks: int
    host_blocks: int
    num_seams: int
    relocation: bool
    moves: _containers.RepeatedCompositeFieldContainer[RelocationMove]
    def __init__(self, model: _Optional[str] = ..., session_id: _Optional[str] = ..., blocks: _Optional[_Iterable[_Union[BlockPlacement, _Mapping]]] = ..., device_blocks: _Optional[int] = ..., host_blocks: _Optional[int] = ..., num_seams: _Optional[int] = ..., relocation: _Optional[bool] = ..., moves: _Optional[_Iterable[_Union[RelocationMove, _Mapping]]] = ...) -> None: ...

class RelocationMove(_message.Message):
    __slots__ = ("at_unix", "direction", "first", "last", "source", "to", "bytes", "reason")
    AT_UNIX_FIELD_NUMBER: _ClassVar[int]
    DIRECTION_FIELD_NUMBER: _ClassVar[int]
    FIRST_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    TO_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    at_unix: float
    direction: str
    first: int
    last: int
    source: str
    to: str
    bytes: int
    reason: str
    def __init__(self, at_unix: _Optional[float] = ..., direction: _Optional[str] = ..., first: _Optional[int] = ..., last: _Optional[int] = ..., source: _Optional[str] = ..., to: _Optional[str] = ..., bytes: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class GetPlacementRequest(_message.Message):
    __slots__ = ("session_id", "model")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    model: str
    def __init__(self, session_id: _Optional[str] = ..., model: _Optional[str] = ...) -> None: ...

class GetPlacementResponse(_message.Message):
    __slots__ = ("placement",)
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    placement: Placement
    def __init__(self, placement: _Optional[_Union[Placement, _Mapping]] = ...) -> None: ...

class SetPlacementRequest(_message.Message):
    __slots__ = ("session_id", "model", "devices", "gpu_layers")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    GPU_LAYERS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    model: str
    devices: str
    gpu_layers: int
    def __init__(self, session_id: _Optional[str] = ..., model: _Optional[str] = ..., devices: _Optional[str] = ..., gpu_layers: _Optional[int] = ...) -> None: ...

class SetPlacementResponse(_message.Message):
    __slots__ = ("placement",)
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    placement: Placement
    def __init__(self, placement: _Optional[_Union[Placement, _Mapping]] = ...) -> None: ...

class RelocateBlocksRequest(_message.Message):
    __slots__ = ("session_id", "model", "first", "last", "to")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    FIRST_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    TO_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    model: str
    first: int
    last: int
    to: str
    def __init__(self, session_id: _Optional[str] = ..., model: _Optional[str] = ..., first: _Optional[int] = ..., last: _Optional[int] = ..., to: _Optional[str] = ...) -> None: ...

class RelocateBlocksResponse(_message.Message):
    __slots__ = ("placement",)
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    placement: Placement
    def __init__(self, placement: _Optional[_Union[Placement, _Mapping]] = ...) -> None: ...

class SetRelocationRequest(_message.Message):
    __slots__ = ("model", "enabled")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    model: str
    enabled: bool
    def __init__(self, model: _Optional[str] = ..., enabled: _Optional[bool] = ...) -> None: ...

class SetRelocationResponse(_message.Message):
    __slots__ = ("enabled", "placement")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    placement: Placement
    def __init__(self, enabled: _Optional[bool] = ..., placement: _Optional[_Union[Placement, _Mapping]] = ...) -> None: ...

class TuneSeamRequest(_message.Message):
    __slots__ = ("session_id", "model")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    model: str
    def __init__(self, session_id: _Optional[str] = ..., model: _Optional[str] = ...) -> None: ...

class SeamCandidate(_message.Message):
    __slots__ = ("device_blocks", "decode_tokens_per_second")
    DEVICE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    device_blocks: int
    decode_tokens_per_second: float
    def __init__(self, device_blocks: _Optional[int] = ..., decode_tokens_per_second: _Optional[float] = ...) -> None: ...

class TuneSeamResponse(_message.Message):
    __slots__ = ("candidates", "placement")
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    candidates: _containers.RepeatedCompositeFieldContainer[SeamCandidate]
    placement: Placement
    def __init__(self, candidates: _Optional[_Iterable[_Union[SeamCandidate, _Mapping]]] = ..., placement: _Optional[_Union[Placement, _Mapping]] = ...) -> None: ...

class BlockResidency(_message.Message):
    __slots__ = ("index", "name", "residency", "bytes", "reads", "read_ms")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    RESIDENCY_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    READS_FIELD_NUMBER: _ClassVar[int]
    READ_MS_FIELD_NUMBER: _ClassVar[int]
    index: int
    name: str
    residency: Residency
    bytes: int
    reads: int
    read_ms: float
    def __init__(self, index: _Optional[int] = ..., name: _Optional[str] = ..., residency: _Optional[_Union[Residency, str]] = ..., bytes: _Optional[int] = ..., reads: _Optional[int] = ..., read_ms: _Optional[float] = ...) -> None: ...

class GetResidencyRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class GetResidencyResponse(_message.Message):
    __slots__ = ("model", "blocks", "page_budget_bytes", "resident_bytes", "relocation", "moves")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PAGE_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    RELOCATION_FIELD_NUMBER: _ClassVar[int]
    MOVES_FIELD_NUMBER: _ClassVar[int]
    model: str
    blocks: _containers.RepeatedCompositeFieldContainer[BlockResidency]
    page_budget_bytes: int
    resident_bytes: int
    relocation: bool
    moves: _containers.RepeatedCompositeFieldContainer[RelocationMove]
    def __init__(self, model: _Optional[str] = ..., blocks: _Optional[_Iterable[_Union[BlockResidency, _Mapping]]] = ..., page_budget_bytes: _Optional[int] = ..., resident_bytes: _Optional[int] = ..., relocation: _Optional[bool] = ..., moves: _Optional[_Iterable[_Union[RelocationMove, _Mapping]]] = ...) -> None: ...

class SetPageBudgetRequest(_message.Message):
    __slots__ = ("model", "budget_bytes")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    model: str
    budget_bytes: int
    def __init__(self, model: _Optional[str] = ..., budget_bytes: _Optional[int] = ...) -> None: ...

class SetPageBudgetResponse(_message.Message):
    __slots__ = ("residency",)
    RESIDENCY_FIELD_NUMBER: _ClassVar[int]
    residency: GetResidencyResponse
    def __init__(self, residency: _Optional[_Union[GetResidencyResponse, _Mapping]] = ...) -> None: ...
