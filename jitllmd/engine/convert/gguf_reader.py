"""A GGUF file's metadata and tensor table, read in one pass; tensor data stays in the file until asked for."""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["GGUFFile", "GGUFTensor", "open_gguf"]

_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
_VERSIONS = (2, 3)  # gguf.GGUFReader's
# GGUF value types (gguf.GGUFValueType) -> numpy scalar types; 8 is a string, 9 an array
_SCALARS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9
_HEADER_KEYS = ("GGUF.version", "GGUF.tensor_count", "GGUF.kv_count")  # GGUFReader's fields for the header's own values
_TYPED = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16, "I32": np.int32, "I64": np.int64}


class _Unusual(Exception):
    """What this reader leaves to gguf.GGUFReader: a damaged file, a big-endian one, nested arrays."""


class GGUFField:
    """One metadata value; `contents()` as gguf.GGUFReader's fields give it (strings are decoded when asked for)."""

    def __init__(self, value: Any, kind: int):
        self._value, self._kind = value, kind

    def contents(self) -> Any:
        if isinstance(self._value, bytes):
            return self._value.decode("utf-8")
        if isinstance(self._value, list):  # of strings
            return [s.decode("utf-8") for s in self._value]
        return self._value.tolist() if self._kind == _ARRAY else self._value.tolist()[0]


class GGUFTensor:
    """One entry of the tensor table, with the fields of gguf.GGUFReader's ReaderTensor that the converter reads."""

    def __init__(self, path: Path, name: str, tensor_type: Any, dims: list[int], data_offset: int):
        from gguf import GGML_QUANT_SIZES
        from gguf.quants import quant_shape_to_byte_shape

        self.path, self.name, self.tensor_type = path, name, tensor_type
        self.shape = np.array(dims, dtype=np.uint64)  # GGUF order: the row length first
        self.n_elements = int(np.prod(self.shape))
        block, size = GGML_QUANT_SIZES[tensor_type]
        self.n_bytes = self.n_elements * size // block
        self.data_offset = data_offset
        shape, typed = tuple(reversed(dims)), _TYPED.get(tensor_type.name)
        # the others as bytes, rows of whole blocks: quant_shape_to_byte_shape raises where a row is not, as in GGUFReader
        self._dtype, self._shape = (typed, shape) if typed is not None else (np.uint8, quant_shape_to_byte_shape(shape, tensor_type))

    @property
    def data(self) -> np.ndarray:
        """The tensor's bytes read from the file now (a fresh array, as GGUFReader's view of the map is typed)."""
        count = self.n_bytes // np.dtype(self._dtype).itemsize
        return np.fromfile(self.path, dtype=self._dtype, count=count, offset=self.data_offset).reshape(self._shape)


class GGUFFile:
    """The header of a little-endian GGUF file (version 2 or 3): `fields` and `tensors` as gguf.GGUFReader names them.

    gguf.GGUFReader makes numpy views per string: 6-9 s and hundreds of MB for a 152k-262k-token vocabulary and its
    merges; this reads the same header in 0.05 s. It raises _Unusual on anything it might not read as GGUFReader does."""

    def __init__(self, path: Path):
        from gguf import GGMLQuantizationType

        self.path = path
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            self._buf, self._size = buf, len(buf)
            try:
                if buf[:4] != b"GGUF" or self._u32(4) not in _VERSIONS:
                    raise _Unusual("not a little-endian GGUF of version 2 or 3")
                num_tensors, num_fields = self._u64(8), self._u64(16)
                self.fields: dict[str, GGUFField] = {}
                offset = 24
                for _ in range(num_fields):
                    key, offset = self._str(offset)
                    name = key.decode("utf-8")
                    if name in self.fields or name in _HEADER_KEYS:
                        raise _Unusual(f"duplicate key {name}")
                    kind = self._u32(offset)
                    value, offset = self._value(kind, offset + 4)
                    self.fields[name] = GGUFField(value, kind)
                table = []
                for _ in range(num_tensors):
                    key, offset = self._str(offset)
                    num_dims = self._u32(offset)
                    dims = self._array("<u8", num_dims, offset + 4).tolist()
                    offset += 4 + 8 * num_dims
                    table.append((key.decode("utf-8"), dims, self._u32(offset), self._u64(offset + 4)))
                    offset += 12
            finally:
                del self._buf  # closed with the file
        alignment = 32
        if (align := self.fields.get("general.alignment")) is not None:
            if align._kind != 4:
                raise _Unusual("general.alignment is not a uint32")
            alignment = align.contents()
            if alignment == 0 or alignment & (alignment - 1):
                raise _Unusual("general.alignment is not a power of two")
        start = offset + (-offset % alignment)
        self.tensors: list[GGUFTensor] = []
        names = set()
        for name, dims, kind, at in table:
            if name in names:
                raise _Unusual(f"duplicate tensor {name}")
            names.add(name)
            try:
                tensor = GGUFTensor(path, name, GGMLQuantizationType(kind), dims, start + at)
            except (KeyError, ValueError, IndexError) as exc:  # an unknown type, rows not whole blocks
                raise _Unusual(str(exc)) from None
            if tensor.n_bytes and tensor.data_offset + tensor.n_bytes > self._size:
                raise _Unusual(f"tensor {name} ends past the end of the file")  # GGUFReader fails to shape its view
            self.tensors.append(tensor)

    def _u32(self, offset: int) -> int:
        try:
            return _U32.unpack_from(self._buf, offset)[0]
        except struct.error:
            raise _Unusual("cut short") from None

    def _u64(self, offset: int) -> int:
        try:
            return _U64.unpack_from(self._buf, offset)[0]
        except struct.error:
            raise _Unusual("cut short") from None

    def _str(self, offset: int) -> tuple[bytes, int]:
        end = offset + 8 + self._u64(offset)
        if end > self._size:
            raise _Unusual("cut short")
        return self._buf[offset + 8 : end], end

    def _array(self, dtype: str, count: int, offset: int) -> np.ndarray:
        nbytes = np.dtype(dtype).itemsize * count
        if offset + nbytes > self._size:
            raise _Unusual("cut short")
        return np.frombuffer(self._buf[offset : offset + nbytes], dtype=dtype)

    def _value(self, kind: int, offset: int) -> tuple[Any, int]:
        """(value, offset after it): a scalar or numeric array as a numpy array, a string as bytes, a string array as a
        list of bytes."""
        if kind == _STRING:
            return self._str(offset)
        if kind in _SCALARS:
            value = self._array(_SCALARS[kind], 1, offset)
            return value, offset + value.nbytes
        if kind != _ARRAY:
            raise _Unusual(f"unknown value type {kind}")
        item, count = self._u32(offset), self._u64(offset + 4)
        offset += 12
        if item in _SCALARS:
            value = self._array(_SCALARS[item], count, offset)
            return value, offset + value.nbytes
        if item != _STRING:
            raise _Unusual(f"array of value type {item}")
        return self._strings(count, offset)

    def _strings(self, count: int, offset: int) -> tuple[list[bytes], int]:
        buf, size, unpack = self._buf, self._size, _U64.unpack_from
        out: list[bytes] = []
        append = out.append
        try:
            for _ in range(count):
                start = offset + 8
                offset = start + unpack(buf, offset)[0]
                append(buf[start:offset])
        except struct.error:
            raise _Unusual("cut short") from None
        if offset > size:
            raise _Unusual("cut short")
        return out, offset


def open_gguf(path: Path) -> Any:
    """A GGUF file's header: read by GGUFFile, or by gguf.GGUFReader where GGUFFile finds it unusual, so an odd or
    damaged file is read, or refused, exactly as the gguf package always has. Raises what GGUFReader raises."""
    try:
        return GGUFFile(path)
    except (_Unusual, UnicodeDecodeError, OSError, ValueError):
        import gguf

        return gguf.GGUFReader(path)
