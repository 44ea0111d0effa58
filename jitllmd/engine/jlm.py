"""The .jlm file format: one safetensors file with a `jlm` metadata document; write, open (mmap), read one block."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import mmap
import os
import re
import struct
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .layers.formats import FORMATS, QFormat, lanes_

__all__ = [
    "FORMAT_VERSION",
    "JLMError",
    "JLMFile",
    "TensorSpec",
    "pread_into",
    "remove_stale_parts",
    "write_jlm",
]

# 2: a K-format's code bytes are in lane order (layers/formats.py's `lanes_`: as the kernels read them, so neither the
# load nor a step reorders them). 1 held them in ggml's order: such a file still opens where it has no K-format tensor
# (its bytes are the same), and is refused with what to do where it has one.
FORMAT_VERSION = 2

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
_ITEM_BYTES = {dtype: torch.empty((), dtype=dtype).element_size() for dtype in _NAMES}
_MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit
_MAX_DEPTH = 32  # JSON nesting a header may have (a real one nests 4 deep); deeper is a crafted file
_BLOCK = re.compile(r"blocks\.(0|[1-9][0-9]*)\.", re.ASCII)
# config sizes a file's weights must hold: none can exceed its bytes (checked before a loader sizes anything by them)
_SIZES = ("num_layers", "vocab_size", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim", "type_vocab_size")
_CONTEXTS = ("max_position_embeddings", "max_seq_length")  # positions: at most what the wire's uint32 carries
_META_TYPES: dict[str, tuple[type, ...]] = {"arch": (str,), "config": (dict,), "tokenizer": (str,), "chat_template": (str,),
                                            "special_tokens": (dict,), "quantization": (dict,), "source": (dict,)}
_KIND: dict[type, str] = {str: "string", dict: "object"}


class JLMError(ValueError):
    """A .jlm file is missing, truncated, or not a .jlm file."""


def _parse(raw: str | bytes, path: Path, what: str) -> Any:
    """JSON from a file's header, refused (JLMError naming the file) where it is not JSON or nests deeper than a
    header does: the parser's recursion, or a reader's walk over what it returns, never meets a crafted depth."""
    try:
        doc = json.loads(raw)
    except RecursionError:
        raise JLMError(f"{path}: not a .jlm file (its {what} nests JSON deeper than {_MAX_DEPTH} levels)") from None
    except ValueError:  # UnicodeDecodeError included
        raise JLMError(f"{path}: not a .jlm file (its {what} is not JSON)") from None
    level = [doc]
    for _ in range(_MAX_DEPTH):
        level = [v for c in level if isinstance(c, (dict, list)) for v in (c.values() if isinstance(c, dict) else c)]
        if not level:
            return doc
    raise JLMError(f"{path}: not a .jlm file (its {what} nests JSON deeper than {_MAX_DEPTH} levels)")


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
    fd, tmp = _new_part(path)
    try:
        with contextlib.ExitStack() as files:
            files.callback(os.close, fd)  # written through the descriptor: the kernel's copies append to it too
            _write_all(fd, struct.pack("<Q", len(raw)) + raw)
            opened: dict[Path, int] = {}
            for spec in specs:
                fmt = _lane_format(meta, spec)  # K-format blocks: written with their codes in lane order
                if spec.stored_at is not None:
                    file, at = spec.stored_at
                    if file not in opened:
                        opened[file] = files.enter_context(open(file, "rb")).fileno()
                    if fmt is None:
                        _copy_range(opened[file], fd, at, spec.nbytes, spec.name)
                    else:  # read, reordered and written a run of whole blocks at a time
                        step = _CHUNK // fmt.nbytes * fmt.nbytes
                        buf = torch.empty(min(step, spec.nbytes), dtype=torch.uint8)
                        for pos in range(0, spec.nbytes, step):
                            part = buf[: min(step, spec.nbytes - pos)]
                            pread_into(opened[file], part.numpy().data.cast("B"), at + pos, f"{spec.name}: its source file ends short of its data")
                            lanes_(part.view(-1, fmt.nbytes), fmt)
                            _write_all(fd, part.numpy().data)
                else:
                    t = spec.produce()
                    if t.dtype != spec.dtype or tuple(t.shape) != spec.shape:
                        raise JLMError(f"{spec.name}: produced {t.dtype} {tuple(t.shape)}, declared {spec.dtype} {spec.shape}")
                    if fmt is not None:  # reordered in a copy: a produced tensor may be its source's own bytes
                        t = t.reshape(-1).clone()
                        lanes_(t.view(-1, fmt.nbytes), fmt)
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


def _lane_format(meta: dict[str, Any], spec: TensorSpec) -> QFormat | None:
    """The format of a tensor `meta` says is stored quantized in one whose code bytes a .jlm holds in lane order."""
    entry = (meta.get("quantization") or {}).get(spec.name)
    fmt = FORMATS.get(str(entry.get("type"))) if isinstance(entry, dict) else None
    if fmt is None or fmt.lanes < 0:
        return None
    if spec.dtype != torch.uint8 or spec.nbytes % fmt.nbytes:
        raise JLMError(f"{spec.name}: {spec.dtype} {list(spec.shape)} is no run of {fmt.name} blocks")
    return fmt


def pread_into(fd: int, buf: memoryview, offset: int, ended: str) -> None:
    """Fill `buf` from `fd` at `offset` (preads may come back short); JLMError(`ended`) where the file ends first."""
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n == 0:
            raise JLMError(ended)
        done += n


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


STALE_SECONDS = 600  # a part of another output no one has written for this long, and no one holds, is a dead writer's


def _new_part(path: Path) -> tuple[int, str]:
    """A fresh `.NAME.jlm.XXXX.part` beside `path`, open and locked: the lock is held while this writer lives, so a
    part no one holds is a dead writer's. Between its creation and the lock a cleaner may take it for one and remove
    it: then this makes another."""
    while True:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".part", dir=path.parent)
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            if os.stat(tmp).st_ino == os.fstat(fd).st_ino:
                return fd, tmp
        except FileNotFoundError:
            pass
        os.close(fd)


def remove_stale_parts(path: str | Path) -> list[Path]:
    """Remove the temp files that writers killed mid-write (`kill -9`, a crash) left beside `path`: its own
    (`.NAME.jlm.*.part`) that no writer holds, and those of other outputs in its directory that no writer holds and
    none has written for STALE_SECONDS (a writer of an older jitllmd held no lock). Returns those removed."""
    path = Path(path)
    removed = []
    now = time.time()
    for part in path.parent.glob(".*.jlm.*.part"):
        own = part.name.startswith(f".{path.name}.")
        try:
            fd = os.open(part, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue  # gone meanwhile, a link, or not ours to read
        try:
            if not own and now - os.fstat(fd).st_mtime < STALE_SECONDS:
                continue  # another output's, written lately: maybe a live writer's
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
            header = _parse(f.read(n), self.path, "header")
            meta = header.pop("__metadata__", None) if isinstance(header, dict) else None
            if not isinstance(meta, dict) or not isinstance(meta.get("jlm"), str):
                raise JLMError(f"{self.path}: not a .jlm file (no jlm metadata)")
            meta = _parse(meta["jlm"], self.path, "jlm metadata")
            if not isinstance(meta, dict):
                raise JLMError(f"{self.path}: not a .jlm file (its jlm metadata is not an object)")
            # ACCESS_COPY: a private mapping, writable for torch.frombuffer, never written back.
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        self._data_start = 8 + n
        self.meta: dict[str, Any] = meta
        if meta.get("format_version") not in (1, FORMAT_VERSION):
            raise JLMError(f"{self.path}: .jlm format version {meta.get('format_version')} is not {FORMAT_VERSION}")
        self._index: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        for name, info in header.items():
            try:
                dtype = _DTYPES[info["dtype"]]
                shape, offsets = info["shape"], info["data_offsets"]
                if not (isinstance(shape, list) and isinstance(offsets, list) and len(offsets) == 2):
                    raise TypeError
                if not all(type(d) is int for d in (*shape, *offsets)):  # not a bool, float or string
                    raise TypeError
                shape, (start, end) = tuple(shape), offsets
            except (KeyError, TypeError):
                raise JLMError(f"{self.path}: bad header entry for tensor {name!r}") from None
            numel = 1
            for d in shape:
                numel *= d
            if min(shape, default=0) < 0 or max(shape, default=0) > size or end - start != numel * _ITEM_BYTES[dtype]:
                raise JLMError(f"{self.path}: tensor {name!r} offsets do not match its shape {list(shape)}")
            if start < 0 or self._data_start + end > size:
                raise JLMError(f"{self.path}: truncated (tensor {name} ends past the end of the file)")
            if name.startswith("blocks.") and not _BLOCK.match(name):
                raise JLMError(f"{self.path}: tensor {name!r} is not named blocks.<layer>.<part>")
            self._index[name] = (dtype, shape, start, end)
        self._check_meta(size)

    def _check_meta(self, size: int) -> None:
        """What readers take from the metadata has the type they take it as, and no number in the config that sizes
        something exceeds what the file holds: a crafted file is refused here, before anything is sized by it."""
        for key, kinds in _META_TYPES.items():
            if self.meta.get(key) is not None and not isinstance(self.meta[key], kinds):
                raise JLMError(f"{self.path}: jlm metadata {key} is not a{'n' * (kinds[0] is dict)} {_KIND[kinds[0]]}")
        quant = self.meta.get("quantization") or {}
        if (bad := next((n for n, e in quant.items() if not isinstance(e, dict)), None)) is not None:
            raise JLMError(f"{self.path}: jlm metadata quantization[{bad!r}] is not an object")
        if self.meta.get("format_version") == 1:
            old = sorted({str(e.get("type")) for e in quant.values() if (f := FORMATS.get(str(e.get("type")))) is not None and f.lanes >= 0})
            if old:
                source = self.meta.get("source")
                src = (source.get("file") or source.get("dir") if isinstance(source, dict) else None) or "SOURCE"  # what it was made from
                raise JLMError(f"{self.path}: converted by an older jitllmd (.jlm format version 1), whose {', '.join(old)} blocks this one "
                               f"reads in another order: convert its source again (jitllmd convert {src} -o {self.path.name})")
        config = self.meta.get("config") or {}
        if (layers := config.get("num_layers")) is not None:
            held = sorted({int(m.group(1)) for n in self._index if (m := _BLOCK.match(n))})
            if type(layers) is not int or held != list(range(layers)):
                what = f"blocks 0 to {held[-1]}" if held and held == list(range(len(held))) else f"{len(held)} layers' blocks"
                raise JLMError(f"{self.path}: config.num_layers is {layers!r}, but the file holds {what}")
        for key in _SIZES + _CONTEXTS:
            value = config.get(key)
            if value is None:
                continue
            most = size if key in _SIZES else 2**32 - 1
            if type(value) is not int or not 0 <= value <= most:
                bound = f"the file's size, {most}" if key in _SIZES else str(most)
                raise JLMError(f"{self.path}: config.{key} is {value!r}: not a whole number from 0 to {bound}")

    @property
    def names(self) -> list[str]:
        return list(self._index)

    @property
    def arch(self) -> str:
        if not self.meta.get("arch"):
            raise JLMError(f"{self.path}: its jlm metadata names no arch")
        return self.meta["arch"]

    @property
    def config(self) -> dict[str, Any]:
        if self.meta.get("config") is None:
            raise JLMError(f"{self.path}: its jlm metadata has no config")
        return self.meta["config"]

    def _entry(self, name: str) -> tuple[torch.dtype, tuple[int, ...], int, int]:
        try:
            return self._index[name]
        except KeyError:
            raise JLMError(f"{self.path}: has no tensor {name!r} (its arch and config need it)") from None

    def tensor(self, name: str) -> torch.Tensor:
        """One tensor, mapped from the file (no copy)."""
        dtype, shape, start, end = self._entry(name)
        if end == start:
            return torch.empty(shape, dtype=dtype)
        count = (end - start) // _ITEM_BYTES[dtype]
        t = torch.frombuffer(self._map, dtype=dtype, count=count, offset=self._data_start + start)
        return t.view(shape)

    @property
    def block_names(self) -> list[str]:
        """The blocks the file holds, in model order: embed, blocks.0 ..., head (an encoder has none)."""
        layers = sorted({int(n.split(".")[1]) for n in self._index if n.startswith("blocks.")})
        return [p for p in ("embed",) if self.block_nbytes(p)] + [f"blocks.{i}" for i in layers] + [p for p in ("head",) if self.block_nbytes(p)]

    def locate(self, name: str) -> tuple[torch.dtype, tuple[int, ...], int, int]:
        """Where a tensor's bytes are: (dtype, shape, offset in the file, byte count), for reads that bypass the map."""
        dtype, shape, start, end = self._entry(name)
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
            kind = str(quant[name].get("type")) if name in quant else _NAMES[dtype]
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
