"""The .jlm file format: one safetensors file with a `jlm` metadata document; write, open (mmap), read one block."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import mmap
import os
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "FORMAT_VERSION",
    "JLMError",
    "JLMFile",
    "TensorSpec",
    "remove_stale_parts",
    "write_jlm",
]

FORMAT_VERSION = 1

# safetensors dtype names <-> torch dtypes
_DTYPES: dict[str, torch.dtype] = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
}
_NAMES = {v: k for k, v in _DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit


class JLMError(ValueError):
    """A .jlm file is missing, truncated, or not a .jlm file."""


@dataclass(frozen=True)
class TensorSpec:
    """A tensor to write: its name, dtype and shape up front, its data produced when its turn comes."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    produce: Callable[[], torch.Tensor]
    # (file, offset): its bytes already lie there as stored, so write_jlm copies them file to file (in the kernel,
    # at the speed of a copy, through no memory of this process) and does not call `produce`
    stored_at: tuple[Path, int] | None = None

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


def write_jlm(
    path: str | Path,
    specs: list[TensorSpec],
    meta: dict[str, Any],
    *,
    on_tensor: Callable[[TensorSpec], None] | None = None,
) -> int:
    """Write a .jlm atomically: stream tensors into a temp file beside `path`, rename at the end.

    Returns the file size. On any error the temp file is removed and `path` is untouched.
    """
    path = Path(path)
    header: dict[str, Any] = {"__metadata__": {"jlm": json.dumps({"format_version": FORMAT_VERSION, **meta})}}
    offset = 0
    if len({spec.name for spec in specs}) != len(specs):
        dup = sorted({s.name for s in specs if sum(t.name == s.name for t in specs) > 1})
        raise JLMError(f"duplicate tensor names: {', '.join(dup[:5])}")
    for spec in specs:
        if spec.dtype not in _NAMES:
            raise JLMError(f"{spec.name}: dtype {spec.dtype} cannot be stored")
        header[spec.name] = {
            "dtype": _NAMES[spec.dtype],
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as safetensors writes it
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_parts(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".part", dir=path.parent)
    fcntl.flock(fd, fcntl.LOCK_EX)  # held while this writer lives: a part no one holds is a dead writer's
    try:
        with contextlib.ExitStack() as files:
            files.callback(os.close, fd)  # written through the descriptor: the kernel's copies append to it too
            _write_all(fd, struct.pack("<Q", len(raw)) + raw)
            opened: dict[Path, int] = {}
            for spec in specs:
                if spec.stored_at is not None:
                    file, at = spec.stored_at
                    if file not in opened:
                        opened[file] = files.enter_context(open(file, "rb")).fileno()
                    _copy_range(opened[file], fd, at, spec.nbytes, spec.name)
                else:
                    t = spec.produce()
                    if t.dtype != spec.dtype or tuple(t.shape) != spec.shape:
                        raise JLMError(f"{spec.name}: produced {t.dtype} {tuple(t.shape)}, declared {spec.dtype} {spec.shape}")
                    if t.numel():
                        _write_all(fd, t.contiguous().reshape(-1).view(torch.uint8).numpy().data)
                    del t  # one produced tensor in memory at a time
                if on_tensor is not None:
                    on_tensor(spec)
            os.fsync(fd)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path.stat().st_size


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view) :]  # a write(2) may be short: Linux writes at most ~2 GiB at a time


def _copy_range(src: int, dst: int, offset: int, count: int, name: str) -> None:
    """Append `count` bytes at `offset` of `src` to `dst`: by copy_file_range where the kernel and the file systems
    allow it, else read and written in bounded chunks."""
    fast = hasattr(os, "copy_file_range")  # Linux
    while count:
        if fast:
            try:
                n = os.copy_file_range(src, dst, count, offset)
            except OSError as exc:
                if exc.errno not in _NO_COPY_RANGE:
                    raise
                fast = False
                continue
        else:
            n = len(chunk := os.pread(src, min(count, _CHUNK), offset))
            _write_all(dst, chunk)
        if n == 0:
            raise JLMError(f"{name}: its source file ends {count} bytes short of its data")
        offset += n
        count -= n


_NO_COPY_RANGE = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EPERM, errno.ETXTBSY}
_CHUNK = 16 << 20


def remove_stale_parts(path: str | Path) -> list[Path]:
    """Remove the temp files (`.NAME.jlm.*.part`) that writers of `path` killed mid-write left behind (a live
    writer holds a lock on its own, so its part stays); returns those removed."""
    path = Path(path)
    removed = []
    for part in path.parent.glob(f".{path.name}.*.part"):
        try:
            fd = os.open(part, os.O_RDONLY)
        except OSError:
            continue  # gone meanwhile, or not ours to read
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # a live writer's
        else:
            part.unlink(missing_ok=True)
            removed.append(part)
        finally:
            os.close(fd)
    return removed


class JLMFile:
    """An opened .jlm: the `jlm` metadata, and tensors mapped lazily from the file (pages are read on first touch)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            f = open(self.path, "rb")
        except FileNotFoundError:
            raise JLMError(f"{self.path}: no such file") from None
        except IsADirectoryError:
            raise JLMError(f"{self.path}: is a directory, not a .jlm file") from None
        with f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise JLMError(f"{self.path}: not a .jlm file (too short)")
            (n,) = struct.unpack("<Q", f.read(8))
            if n > _MAX_HEADER or 8 + n > size:
                raise JLMError(f"{self.path}: not a .jlm file (bad header length)")
            try:
                header = json.loads(f.read(n))
                meta = json.loads(header.pop("__metadata__")["jlm"])
                if not isinstance(meta, dict):
                    raise TypeError("jlm metadata is not an object")
            except (ValueError, KeyError, TypeError, AttributeError):
                raise JLMError(f"{self.path}: not a .jlm file (no jlm metadata)") from None
            # ACCESS_COPY: a private mapping, writable for torch.frombuffer, never written back.
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        self._data_start = 8 + n
        self.meta: dict[str, Any] = meta
        if meta.get("format_version") != FORMAT_VERSION:
            raise JLMError(f"{self.path}: .jlm format version {meta.get('format_version')} is not {FORMAT_VERSION}")
        self._index: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        for name, info in header.items():
            try:
                dtype = _DTYPES[info["dtype"]]
                shape = tuple(int(d) for d in info["shape"])
                start, end = (int(o) for o in info["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise JLMError(f"{self.path}: bad header entry for tensor {name!r}") from None
            numel = 1
            for d in shape:
                numel *= d
            if min(shape, default=0) < 0 or end - start != numel * torch.empty((), dtype=dtype).element_size():
                raise JLMError(f"{self.path}: tensor {name!r} offsets do not match its shape {list(shape)}")
            if start < 0 or self._data_start + end > size:
                raise JLMError(f"{self.path}: truncated (tensor {name} ends past the end of the file)")
            self._index[name] = (dtype, shape, start, end)

    @property
    def names(self) -> list[str]:
        return list(self._index)

    @property
    def arch(self) -> str:
        return self.meta["arch"]

    @property
    def config(self) -> dict[str, Any]:
        return self.meta["config"]

    def tensor(self, name: str) -> torch.Tensor:
        """One tensor, mapped from the file (no copy)."""
        dtype, shape, start, end = self._index[name]
        if end == start:
            return torch.empty(shape, dtype=dtype)
        count = (end - start) // torch.empty((), dtype=dtype).element_size()
        t = torch.frombuffer(self._map, dtype=dtype, count=count, offset=self._data_start + start)
        return t.view(shape)

    @property
    def block_names(self) -> list[str]:
        """The blocks the file holds, in model order: embed, blocks.0 ..., head (an encoder has none)."""
        layers = sorted({int(n.split(".")[1]) for n in self._index if n.startswith("blocks.")})
        return [p for p in ("embed",) if self.block_nbytes(p)] + [f"blocks.{i}" for i in layers] + [p for p in ("head",) if self.block_nbytes(p)]

    def locate(self, name: str) -> tuple[torch.dtype, tuple[int, ...], int, int]:
        """Where a tensor's bytes are: (dtype, shape, offset in the file, byte count), for reads that bypass the map."""
        dtype, shape, start, end = self._index[name]
        return dtype, shape, self._data_start + start, end - start

    def block(self, prefix: str) -> dict[str, torch.Tensor]:
        """The tensors of one block (`embed`, `blocks.3`, `head`), keyed by the name after the prefix."""
        p = prefix + "."
        return {name[len(p):]: self.tensor(name) for name in self._index if name.startswith(p)}

    def stored_types(self) -> list[str]:
        """How the tensors are stored, most tensors first: a quantized one's type (Q4_K, ...) or its dtype (F32, BF16)."""
        quant = self.meta.get("quantization") or {}
        counts: dict[str, int] = {}
        for name, (dtype, *_) in self._index.items():
            kind = str(quant[name]["type"]) if name in quant else _NAMES[dtype]
            counts[kind] = counts.get(kind, 0) + 1
        return sorted(counts, key=lambda k: -counts[k])

    def block_nbytes(self, prefix: str) -> int:
        p = prefix + "."
        return sum(end - start for name, (_, _, start, end) in self._index.items() if name.startswith(p))

    def close(self) -> None:
        try:
            self._map.close()
        except BufferError:
            pass  # tensors still view the map; it is released when they are.
