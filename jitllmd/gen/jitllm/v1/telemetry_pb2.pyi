from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ModelStats(_message.Message):
    __slots__ = ("model", "requests", "cancelled", "prompt_tokens", "generated_tokens", "steps", "active_rows", "queue_depth", "rows_per_step", "prompt_tokens_per_step", "tokens_per_second", "weight_bytes", "kv_bytes", "sessions", "max_rows", "joint_steps", "joint", "prompt_chunk", "relocation", "demotions", "promotions", "rows_why", "prompt_chunk_why", "speculative", "drafted_tokens", "accepted_tokens", "prefix_cache", "prefix_hit_tokens", "prefix_query_tokens", "kv_pages_held", "kv_pages_cached", "kv_pages_free", "kv_pages_shared", "kv_pages_host", "kv_pages_file")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_ROWS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    ROWS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_ROWS_FIELD_NUMBER: _ClassVar[int]
    JOINT_STEPS_FIELD_NUMBER: _ClassVar[int]
    JOINT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_CHUNK_FIELD_NUMBER: _ClassVar[int]
    RELOCATION_FIELD_NUMBER: _ClassVar[int]
    DEMOTIONS_FIELD_NUMBER: _ClassVar[int]
    PROMOTIONS_FIELD_NUMBER: _ClassVar[int]
    ROWS_WHY_FIELD_NUMBER: _ClassVar[int]
    PROMPT_CHUNK_WHY_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_HELD_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_CACHED_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_FREE_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_SHARED_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_HOST_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_FILE_FIELD_NUMBER: _ClassVar[int]
    model: str
    requests: int
    cancelled: int
    prompt_tokens: int
    generated_tokens: int
    steps: int
    active_rows: int
    queue_depth: int
    rows_per_step: float
    prompt_tokens_per_step: float
    tokens_per_second: float
    weight_bytes: int
    kv_bytes: int
    sessions: int
    max_rows: int
    joint_steps: str
    joint: _containers.RepeatedCompositeFieldContainer[JointStep]
    prompt_chunk: int
    relocation: bool
    demotions: int
    promotions: int
    rows_why: str
    prompt_chunk_why: str
    speculative: str
    drafted_tokens: int
    accepted_tokens: int
    prefix_cache: bool
    prefix_hit_tokens: int
    prefix_query_tokens: int
    kv_pages_held: int
    kv_pages_cached: int
    kv_pages_free: int
    kv_pages_shared: int
    kv_pages_host: int
    kv_pages_file: int
    def __init__(self, model: _Optional[str] = ..., requests: _Optional[int] = ..., cancelled: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., steps: _Optional[int] = ..., active_rows: _Optional[int] = ..., queue_depth: _Optional[int] = ..., rows_per_step: _Optional[float] = ..., prompt_tokens_per_step: _Optional[float] = ..., tokens_per_second: _Optional[float] = ..., weight_bytes: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., sessions: _Optional[int] = ..., max_rows: _Optional[int] = ..., joint_steps: _Optional[str] = ..., joint: _Optional[_Iterable[_Union[JointStep, _Mapping]]] = ..., prompt_chunk: _Optional[int] = ..., relocation: _Optional[bool] = ..., demotions: _Optional[int] = ..., promotions: _Optional[int] = ..., rows_why: _Optional[str] = ..., prompt_chunk_why: _Optional[str] = ..., speculative: _Optional[str] = ..., drafted_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., prefix_cache: _Optional[bool] = ..., prefix_hit_tokens: _Optional[int] = ..., prefix_query_tokens: _Optional[int] = ..., kv_pages_held: _Optional[int] = ..., kv_pages_cached: _Optional[int] = ..., kv_pages_free: _Optional[int] = ..., kv_pages_shared: _Optional[int] = ..., kv_pages_host: _Optional[int] = ..., kv_pages_file: _Optional[int] = ...) -> None: ...

class JointStep(_message.Message):
    __slots__ = ("rows", "choice", "joint_ms", "sequential_ms")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    JOINT_MS_FIELD_NUMBER: _ClassVar[int]
    SEQUENTIAL_MS_FIELD_NUMBER: _ClassVar[int]
    rows: int
    choice: str
    joint_ms: float
    sequential_ms: float
    def __init__(self, rows: _Optional[int] = ..., choice: _Optional[str] = ..., joint_ms: _Optional[float] = ..., sequential_ms: _Optional[float] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("uptime_s", "requests", "active_rows", "queue_depth", "prompt_tokens", "generated_tokens", "tokens_per_second", "models", "rss_bytes", "sessions")
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_ROWS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    uptime_s: float
    requests: int
    active_rows: int
    queue_depth: int
    prompt_tokens: int
    generated_tokens: int
    tokens_per_second: float
    models: _containers.RepeatedCompositeFieldContainer[ModelStats]
    rss_bytes: int
    sessions: int
    def __init__(self, uptime_s: _Optional[float] = ..., requests: _Optional[int] = ..., active_rows: _Optional[int] = ..., queue_depth: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., tokens_per_second: _Optional[float] = ..., models: _Optional[_Iterable[_Union[ModelStats, _Mapping]]] = ..., rss_bytes: _Optional[int] = ..., sessions: _Optional[int] = ...) -> None: ...

class WatchStatsRequest(_message.Message):
    __slots__ = ("interval_ms",)
    INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    interval_ms: int
    def __init__(self, interval_ms: _Optional[int] = ...) -> None: ...

class GetServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetServerInfoResponse(_message.Message):
    __slots__ = ("version", "uptime_s", "address", "models_dir", "started_unix", "surfaces", "torch_version")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODELS_DIR_FIELD_NUMBER: _ClassVar[int]
    STARTED_UNIX_FIELD_NUMBER: _ClassVar[int]
    SURFACES_FIELD_NUMBER: _ClassVar[int]
    TORCH_VERSION_FIELD_NUMBER: _ClassVar[int]
    version: str
    uptime_s: float
    address: str
    models_dir: str
    started_unix: int
    surfaces: _containers.RepeatedScalarFieldContainer[str]
    torch_version: str
    def __init__(self, version: _Optional[str] = ..., uptime_s: _Optional[float] = ..., address: _Optional[str] = ..., models_dir: _Optional[str] = ..., started_unix: _Optional[int] = ..., surfaces: _Optional[_Iterable[str]] = ..., torch_version: _Optional[str] = ...) -> None: ...
