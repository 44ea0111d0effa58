"""Sources (GGUF files, Hugging Face directories) to .jlm."""

from __future__ import annotations

import functools
import logging
import math
import re
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..jlm import TensorSpec, remove_stale_parts, write_jlm
from ..layers.formats import FORMATS, quantizable, quantize
from .gguf import is_gguf, read_gguf
from .hf import is_hf_dir, read_hf
from .source import ConvertError, Source

__all__ = ["DTYPES", "FLOAT_DTYPES", "QUANT_DTYPES", "ConvertError", "ConvertResult", "convert", "read_source"]

FLOAT_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
# -dtype q*: each 2-D weight quantized to the first of these its row length allows (llama.cpp's fallbacks), else
# kept f32; the head (a tied embedding included) to Q8_0, as llama.cpp keeps its output tensor at more bits.
QUANT_DTYPES = {"q8_0": ("Q8_0",), "q4_0": ("Q4_0", "Q8_0"), "q4_k": ("Q4_K", "Q5_0", "Q8_0")}
DTYPES = ("auto", *FLOAT_DTYPES, *QUANT_DTYPES)  # auto: a quantized GGUF keeps its quantization; anything else bf16
_HEAD = ("Q8_0",)
_BLOCK = re.compile(r"blocks\.(0|[1-9][0-9]*)\.", re.ASCII)

log = logging.getLogger("jitllmd.convert")


@dataclass(frozen=True)
class ConvertResult:
    path: Path
    arch: str
    num_tensors: int
    num_params: int
    nbytes: int
    seconds: float
    source_kind: str
    types: dict[str, int] = field(default_factory=dict)  # stored type -> tensors stored so
    notes: list[str] = field(default_factory=list)  # what the conversion changed on the way


def read_source(src: Path, dtype: str = "auto") -> Source:
    """Recognise a GGUF file or a Hugging Face directory and describe the .jlm it becomes: `dtype` as `convert
    -dtype` takes it (auto, f32, bf16, f16, q8_0, q4_0, q4_k)."""
    if dtype not in DTYPES:
        raise ConvertError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if not src.exists():
        raise ConvertError(f"{src}: no such file or directory")
    float_dtype = FLOAT_DTYPES.get(dtype, torch.float32 if dtype in QUANT_DTYPES else torch.bfloat16)
    try:
        if src.is_dir():
            if not is_hf_dir(src):
                raise ConvertError(f"{src}: a directory without config.json is not a Hugging Face model directory")
            source = read_hf(src, float_dtype)
        elif not is_gguf(src):
            raise ConvertError(f"{src}: not a GGUF file (no GGUF magic) or a Hugging Face model directory")
        else:
            source = read_gguf(src, float_dtype, keep=dtype == "auto")  # a quantized file keeps its blocks
    except (ConvertError, OSError):
        raise
    except (ValueError, LookupError, TypeError, ArithmeticError, RecursionError) as exc:
        # a damaged or crafted source reaches the readers' lookups and arithmetic: its error, named, not a traceback
        log.debug("%s: %s: %s", src, type(exc).__name__, exc)
        raise ConvertError(f"{src}: cannot be read ({type(exc).__name__}: {exc})") from None
    _check_layers(src, source)
    if dtype in QUANT_DTYPES:
        if source.embeds:
            raise ConvertError(f"{src}: an embedding model is stored as floats (-dtype f32, bf16 or f16), not {dtype}")
        _quantize(source, QUANT_DTYPES[dtype])
    return source


def _check_layers(src: Path, source: Source) -> None:
    """The layers the config declares are the blocks the source holds: a .jlm that says otherwise would not load."""
    layers = source.config.get("num_layers")
    held = sorted({int(m.group(1)) for spec in source.tensors if (m := _BLOCK.match(spec.name))})
    if not isinstance(layers, int) or held != list(range(layers)):
        raise ConvertError(f"{src}: it declares {layers!r} layers but holds the tensors of {len(held)}")


def _quantize(source: Source, kinds: tuple[str, ...]) -> None:
    """Rewrite the source's 2-D weights as quantized blocks: each to the first of `kinds` (the head: Q8_0) whose
    block divides its rows; a weight none fits stays f32, and the source's notes say so."""
    head = "embed.weight" if source.config.get("tie_word_embeddings") else "head.lm_head.weight"
    fallbacks: Counter[tuple[str, str]] = Counter()
    for i, spec in enumerate(source.tensors):
        if len(spec.shape) != 2:
            continue
        wanted = _HEAD if spec.name == head else kinds
        kind = next((k for k in wanted if quantizable(k, spec.shape[1])), None)
        if kind != wanted[0]:
            fallbacks[(wanted[0], kind or "F32")] += 1
        if kind is None:
            continue
        source.quantization[spec.name] = {"type": kind, "shape": list(spec.shape)}
        shape = (spec.shape[0], FORMATS[kind].row_bytes(spec.shape[1]))
        source.tensors[i] = TensorSpec(spec.name, torch.uint8, shape, functools.partial(_quantized, spec.produce, kind))
    for (first, got), n in fallbacks.items():
        source.notes.append(f"{n} tensor{'s' * (n > 1)} stored as {got}, not {first}: rows not a multiple of its block")


def _quantized(produce: Callable[[], torch.Tensor], kind: str) -> torch.Tensor:
    return quantize(produce(), kind)


def convert(
    src: str | Path,
    dst: str | Path,
    dtype: str = "auto",
    on_progress: Callable[[int, int], None] | None = None,
) -> ConvertResult:
    """Convert `src` to the .jlm `dst`. The output appears whole or not at all.

    on_progress(done_bytes, total_bytes) is called after each tensor is written.
    """
    t0 = time.perf_counter()
    src, dst = Path(src), Path(dst)
    if dst.parent.is_dir():
        remove_stale_parts(dst)  # what killed writers left, now, even if this conversion fails before it writes
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
    quant = source.quantization
    num_params = sum(math.prod(quant[s.name]["shape"]) if s.name in quant else math.prod(s.shape) for s in source.tensors)
    types = Counter(quant[s.name]["type"] if s.name in quant else _DTYPE_NAMES[s.dtype] for s in source.tensors)
    return ConvertResult(dst, source.arch, len(source.tensors), num_params, size, time.perf_counter() - t0, source.source["kind"],
                         dict(types.most_common()), source.notes)


_DTYPE_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
