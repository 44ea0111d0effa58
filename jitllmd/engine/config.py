"""How the server runs its models: the serve flags about devices, memory, sessions and batching, validated once."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["JOINT_STEPS", "SPEC_MODES", "EngineConfig", "find_model_file", "parse_size"]

JOINT_STEPS = ("auto", "always", "never")
KV_DTYPE_NAMES = ("auto", "f32", "f16", "bf16", "q8_0")  # -kv-dtype's (engine/pages.py KV_DTYPES; auto: the model's own choice)
SPEC_MODES = ("auto", "ngram", "draft", "off")  # engine/speculative.py's (that module imports torch's users; this one is read first)
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """'8G', '512M', '1.5g', '4096' (bytes) -> bytes. Units are binary (K = 1024), as in llama.cpp and Ollama."""
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"{text!r} is not a size: give a number with an optional unit K, M, G or T, e.g. 8G")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass(frozen=True)
class EngineConfig:
    """The spec's serve flags, with their defaults. 0 for max_batch / prompt_chunk means "the device's own choice"."""

    devices: str = ""  # the device grammar; empty opens no device
    maxmem: int | None = None  # host page budget in bytes; None is the engine's own
    gpu_layers: int = -1  # at most this many blocks on a device; -1 is as many as fit
    sessions: int = 1  # KV caches each device block reserves
    max_seq: int | None = None  # KV capacity per session; None is the model's context (memory permitting)
    host_concurrency: int = 1
    device_concurrency: int = 1
    max_batch: int = 0
    prompt_chunk: int = 0
    joint_steps: str = "auto"
    device_mem: int | None = None  # bytes of each device this server's blocks and their KV may take; None: its free memory
    relocate: bool = False  # each model's relocation switch at load (SetRelocation changes it)
    relocate_idle: float = 10.0  # seconds without a row before a relocation-enabled model may be demoted
    relocate_horizon: int = 256  # tokens within which a promotion must repay its copy
    spec: str = "auto"  # speculative decoding: auto (a draft model where a model has one, else ngram), ngram, draft, off
    draft_max: int = 8  # the most tokens a row guesses a step
    kv_mem: int | None = None  # bytes a model's KV pages may take, held and cached; None: as many as its sessions want
    kv_dtype: str = "auto"  # the sessions' K/V: auto (f16 for a kept-quantized model, else its activations'), f32, f16, bf16, q8_0
    prefix_cache: bool = True  # a prompt starts from the K/V pages another request left for the same tokens
    session_dir: Path | None = None  # named sessions kept here across restarts (engine/session_dir.py)

    def __post_init__(self) -> None:
        if self.maxmem is not None and self.maxmem < 1:
            raise ValueError(f"maxmem must be a positive size, got {self.maxmem}")
        if self.gpu_layers < -1:
            raise ValueError(f"gpu_layers must be -1 (as many as fit) or >= 0, got {self.gpu_layers}")
        if self.max_seq is not None and self.max_seq < 1:
            raise ValueError(f"max_seq must be >= 1, got {self.max_seq}")
        for name in ("sessions", "host_concurrency", "device_concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_batch", "prompt_chunk"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0 lets the device choose), got {getattr(self, name)}")
        if self.kv_mem is not None and self.kv_mem < 1:
            raise ValueError(f"kv_mem must be a positive size, got {self.kv_mem}")
        if self.device_mem is not None and self.device_mem < 1:
            raise ValueError(f"device_mem must be a positive size, got {self.device_mem}")
        if self.relocate_idle < 0:
            raise ValueError(f"relocate_idle must be >= 0 seconds, got {self.relocate_idle:g}")
        if self.relocate_horizon < 1:
            raise ValueError(f"relocate_horizon must be >= 1 token, got {self.relocate_horizon}")
        if self.spec not in SPEC_MODES:
            raise ValueError(f"spec must be one of {', '.join(SPEC_MODES)}, got {self.spec!r}")
        if not 0 <= self.draft_max <= 64:
            raise ValueError(f"draft_max must be between 0 and 64, got {self.draft_max}")
        if self.kv_dtype not in KV_DTYPE_NAMES:
            raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPE_NAMES)}, got {self.kv_dtype!r}")
        if self.joint_steps not in JOINT_STEPS:
            raise ValueError(f"joint_steps must be one of {', '.join(JOINT_STEPS)}, got {self.joint_steps!r}")


def find_model_file(file: str, models_dir: Path | None) -> Path:
    """The file a -load argument names: absolute, or relative to -models (else to the working directory), resolved.
    FileNotFoundError says where it was looked for. Imports nothing heavy, so `serve` checks it before loading torch."""
    given = Path(file).expanduser()
    path = (given if given.is_absolute() else (models_dir or Path.cwd()) / given).resolve()
    if not path.is_file():
        where = f" in {models_dir}" if models_dir is not None and not given.is_absolute() else ""
        raise FileNotFoundError(f"{file}: no such model file{where}")
    return path
