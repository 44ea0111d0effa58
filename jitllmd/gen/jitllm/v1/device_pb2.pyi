from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Device(_message.Message):
    __slots__ = ("id", "kind", "name", "total_bytes", "free_bytes", "spendable_bytes", "opened", "budget_bytes", "held_bytes", "rank", "host", "reachable", "quantized")
    ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SPENDABLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    OPENED_FIELD_NUMBER: _ClassVar[int]
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    HELD_BYTES_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    REACHABLE_FIELD_NUMBER: _ClassVar[int]
    QUANTIZED_FIELD_NUMBER: _ClassVar[int]
    id: str
    kind: str
    name: str
    total_bytes: int
    free_bytes: int
    spendable_bytes: int
    opened: bool
    budget_bytes: int
    held_bytes: int
    rank: int
    host: str
    reachable: bool
    quantized: str
    def __init__(self, id: _Optional[str] = ..., kind: _Optional[str] = ..., name: _Optional[str] = ..., total_bytes: _Optional[int] = ..., free_bytes: _Optional[int] = ..., spendable_bytes: _Optional[int] = ..., opened: _Optional[bool] = ..., budget_bytes: _Optional[int] = ..., held_bytes: _Optional[int] = ..., rank: _Optional[int] = ..., host: _Optional[str] = ..., reachable: _Optional[bool] = ..., quantized: _Optional[str] = ...) -> None: ...

class HostMemory(_message.Message):
    __slots__ = ("total_bytes", "available_bytes", "page_budget_bytes", "num_cpus", "cpu_name", "kernels")
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAGE_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_CPUS_FIELD_NUMBER: _ClassVar[int]
    CPU_NAME_FIELD_NUMBER: _ClassVar[int]
    KERNELS_FIELD_NUMBER: _ClassVar[int]
    total_bytes: int
    available_bytes: int
    page_budget_bytes: int
    num_cpus: int
    cpu_name: str
    kernels: str
    def __init__(self, total_bytes: _Optional[int] = ..., available_bytes: _Optional[int] = ..., page_budget_bytes: _Optional[int] = ..., num_cpus: _Optional[int] = ..., cpu_name: _Optional[str] = ..., kernels: _Optional[str] = ...) -> None: ...

class ListDevicesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListDevicesResponse(_message.Message):
    __slots__ = ("devices", "host")
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    devices: _containers.RepeatedCompositeFieldContainer[Device]
    host: HostMemory
    def __init__(self, devices: _Optional[_Iterable[_Union[Device, _Mapping]]] = ..., host: _Optional[_Union[HostMemory, _Mapping]] = ...) -> None: ...

class GetDeviceRequest(_message.Message):
    __slots__ = ("device",)
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    device: str
    def __init__(self, device: _Optional[str] = ...) -> None: ...

class GetDeviceResponse(_message.Message):
    __slots__ = ("device",)
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    device: Device
    def __init__(self, device: _Optional[_Union[Device, _Mapping]] = ...) -> None: ...

class MemoryDomain(_message.Message):
    __slots__ = ("name", "device_ids", "total_bytes", "free_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DEVICE_IDS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    device_ids: _containers.RepeatedScalarFieldContainer[str]
    total_bytes: int
    free_bytes: int
    def __init__(self, name: _Optional[str] = ..., device_ids: _Optional[_Iterable[str]] = ..., total_bytes: _Optional[int] = ..., free_bytes: _Optional[int] = ...) -> None: ...

class GetMemoryTopologyRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetMemoryTopologyResponse(_message.Message):
    __slots__ = ("domains",)
    DOMAINS_FIELD_NUMBER: _ClassVar[int]
    domains: _containers.RepeatedCompositeFieldContainer[MemoryDomain]
    def __init__(self, domains: _Optional[_Iterable[_Union[MemoryDomain, _Mapping]]] = ...) -> None: ...
