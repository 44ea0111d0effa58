"""GGUF file -> .jlm: quantized tensors kept as their blocks, or dequantized; the family maps metadata to config,
names, and fixes tensors."""

from __future__ import annotations

import dataclasses
import functools
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..jlm import TensorSpec
from ..models import family_for_gguf
from ..models.family import TensorFix
from .gguf_reader import GGUFError, open_gguf
from .gguf_tokenizer import tokenizer_from_gguf
from .source import ConvertError, Source, block_order, naming

log = logging.getLogger("jitllmd.convert")

__all__ = ["GGUF_TYPES", "is_gguf", "read_gguf"]

# Quantization types this converter reads (gguf.quants dequantizes each); those in layers/formats.py's FORMATS can be
# kept as they are, the others (Q2_K, Q3_K) become f32, which loses nothing.
GGUF_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
FLOAT_TYPES = ("F32", "F16", "BF16")
_REQUIRED = object()


def is_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def _quantized(reader: Any) -> bool:
    """Whether a GGUF file holds any quantized tensor (then `convert` keeps its quantization by default)."""
    return any(t.tensor_type.name not in FLOAT_TYPES for t in reader.tensors)


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


class _Meta:
    """A GGUF file as a family reads it for its config (models/family.py's GGUFMeta)."""

    def __init__(self, reader: Any, arch: str):
        self.reader = reader
        self.arch = arch
        self.tensors = {t.name: t for t in reader.tensors}
        self.shapes = {t.name: tuple(int(s) for s in reversed(t.shape.tolist())) for t in reader.tensors}

    def field(self, key: str, default: Any = _REQUIRED) -> Any:
        value = _field(self.reader, key, default)
        if value is _REQUIRED:
            raise KeyError(key)
        return value

    def values(self, name: str) -> list[float]:
        import gguf

        t = self.tensors[name]
        return np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(-1).tolist()


def read_gguf(path: Path, dtype: torch.dtype, keep: bool = False) -> Source:
    """Open a GGUF file and describe the .jlm it becomes. `keep`, where the file holds a quantized tensor: those of a
    type the engine runs stay as their blocks (rows of bytes, `quantization` says their type and shape) and the others
    become f32; else every tensor is dequantized to `dtype` when written. Bytes that go into the .jlm as they are (kept
    blocks, f32 tensors stored as f32) are copied file to file when written, not read into memory."""
    import gguf

    from ..layers.formats import FORMATS

    try:
        reader = open_gguf(path)
    except GGUFError as exc:  # what our own walk of the header found wrong
        raise ConvertError(f"{path}: not a readable GGUF file ({exc})") from None
    except Exception as exc:  # the gguf package raises many kinds on a damaged file
        log.debug("%s: %s: %s", path, type(exc).__name__, exc)
        raise ConvertError(f"{path}: not a readable GGUF file (its header, metadata or tensor table is damaged or cut short)") from None
    keep = keep and _quantized(reader)
    if keep:
        dtype = torch.float32  # beside kept blocks, the float tensors (norms, biases) are f32
    size = path.stat().st_size
    arch_name = _field(reader, "general.architecture")
    family = naming(path, lambda: family_for_gguf(arch_name))
    assert family.gguf is not None
    gguf_source = family.gguf
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise ConvertError(f"{path}: truncated (tensor {t.name} ends past the end of the file)")
        if t.tensor_type.name not in GGUF_TYPES:
            raise ConvertError(f"{path}: tensor {t.name} has type {t.tensor_type.name}, not one of {', '.join(GGUF_TYPES)}")

    meta = _Meta(reader, arch_name)
    try:
        tok = tokenizer_from_gguf(reader, gguf_source.tokenizer)
        config = gguf_source.config(meta)
        family.config(config)
    except (KeyError, TypeError) as exc:
        raise ConvertError(f"{path}: missing or bad metadata {exc}") from None
    except ValueError as exc:
        raise ConvertError(f"{path}: {exc}") from None

    def produce(t: Any, fix: TensorFix | None) -> torch.Tensor:
        data = gguf.quants.dequantize(t.data, t.tensor_type)
        w = torch.from_numpy(np.require(data, np.float32, "W"))  # copied only where read-only (GGUFReader's map)
        if fix is not None:
            w = fix(w)
        return w.to(dtype)

    def raw(t: Any, fix: TensorFix | None) -> torch.Tensor:
        w = torch.from_numpy(np.require(t.data, np.uint8, "W")).reshape(meta.shapes[t.name][0], -1)  # [rows, row bytes]
        return w if fix is None else fix(w).contiguous()  # a row permutation moves whole rows of blocks

    def copied(spec: TensorSpec, t: Any, fix: TensorFix | None) -> TensorSpec:
        """`spec`, copied from the file when written, where the .jlm stores the tensor's bytes as they lie there."""
        return spec if fix is not None or t.n_bytes != spec.nbytes else dataclasses.replace(spec, stored_at=(path, t.data_offset))

    specs: list[TensorSpec] = []
    quantization: dict[str, dict[str, Any]] = {}
    notes: dict[str, int] = {}
    for t in reader.tensors:
        if t.name in gguf_source.config_tensors:
            continue
        name = gguf_source.tensor_name(t.name)
        if name is None:
            raise ConvertError(f"{path}: unexpected tensor {t.name} for architecture {arch_name}")
        fix = gguf_source.fix(meta, name, config) if gguf_source.fix is not None else None
        kind, shape = t.tensor_type.name, meta.shapes[t.name]
        if keep and kind in FORMATS and len(shape) == 2:
            quantization[name] = {"type": kind, "shape": list(shape)}
            spec = TensorSpec(name, torch.uint8, (shape[0], FORMATS[kind].row_bytes(shape[1])), functools.partial(raw, t, fix))
            specs.append(copied(spec, t, fix))
            continue
        if keep and kind not in FLOAT_TYPES:
            notes[kind] = notes.get(kind, 0) + 1
        spec = TensorSpec(name, dtype, shape, functools.partial(produce, t, fix))
        specs.append(copied(spec, t, fix) if kind == "F32" and dtype == torch.float32 else spec)  # F16 and BF16 are recast
    specs.sort(key=block_order)
    return Source(
        arch=gguf_source.archs[arch_name],
        config=config,
        tensors=specs,
        tokenizer_json=tok.tokenizer_json,
        tokenizer=tok.tokenizer,
        bos_token=tok.bos_token,
        eos_token=tok.eos_token,
        eos_token_ids=tok.eos_token_ids,
        add_bos_token=tok.add_bos_token,
        chat_template=tok.chat_template,
        source={"kind": "gguf", "file": path.name, "name": _field(reader, "general.name"), "file_type": _field(reader, "general.file_type")},
        quantization=quantization,
        notes=[f"{n} {kind} tensor{'s' * (n > 1)} stored as F32 (no kernel runs {kind}; F32 loses nothing)" for kind, n in notes.items()],
    )
