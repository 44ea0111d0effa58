"""Sources (GGUF files, Hugging Face directories) to .jlm."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..jlm import write_jlm
from .gguf import is_gguf, read_gguf
from .hf import is_hf_dir, read_hf
from .source import ConvertError, Source

__all__ = ["DTYPES", "ConvertError", "ConvertResult", "convert", "read_source"]

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


@dataclass(frozen=True)
class ConvertResult:
    path: Path
    arch: str
    num_tensors: int
    num_params: int
    nbytes: int
    seconds: float
    source_kind: str


def read_source(src: Path, dtype: str = "bf16") -> Source:
    """Recognise a GGUF file or a Hugging Face directory and describe the .jlm it becomes."""
    if dtype not in DTYPES:
        raise ConvertError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if not src.exists():
        raise ConvertError(f"{src}: no such file or directory")
    if src.is_dir():
        if not is_hf_dir(src):
            raise ConvertError(f"{src}: a directory without config.json is not a Hugging Face model directory")
        return read_hf(src, DTYPES[dtype])
    if not is_gguf(src):
        raise ConvertError(f"{src}: not a GGUF file (no GGUF magic) or a Hugging Face model directory")
    return read_gguf(src, DTYPES[dtype])


def convert(
    src: str | Path,
    dst: str | Path,
    dtype: str = "bf16",
    on_progress: Callable[[int, int], None] | None = None,
) -> ConvertResult:
    """Convert `src` to the .jlm `dst`. The output appears whole or not at all.

    on_progress(done_bytes, total_bytes) is called after each tensor is written.
    """
    t0 = time.perf_counter()
    src, dst = Path(src), Path(dst)
    source = read_source(src, dtype)
    total = sum(s.nbytes for s in source.tensors)
    done = 0

    def tick(spec) -> None:
        nonlocal done
        done += spec.nbytes
        if on_progress is not None:
            on_progress(done, total)

    try:
        size = write_jlm(dst, source.tensors, source.meta(), on_tensor=tick)
    except ConvertError:
        raise
    except (ValueError, OSError, RuntimeError) as exc:
        raise ConvertError(f"{src}: conversion failed ({type(exc).__name__}: {exc})") from None
    num_params = sum(s.nbytes // torch.empty((), dtype=s.dtype).element_size() for s in source.tensors)
    return ConvertResult(dst, source.arch, len(source.tensors), num_params, size, time.perf_counter() - t0, source.source["kind"])
