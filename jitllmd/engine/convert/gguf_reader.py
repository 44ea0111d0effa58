"""A GGUF file's metadata and tensor table, read in one pass; tensor data stays in the file until asked for."""

from __future__ import annotations

import math
import mmap
import os
import struct
from pathlib import Path
from typing import Any, Literal

import numpy as np

__all__ = ["GGUFError", "GGUFFile", "GGUFTensor", "open_gguf"]

_VERSIONS = (2, 3)  # gguf.GGUFReader's
# GGUF value types (gguf.GGUFValueType) -> numpy scalar types (in the file's byte order); 8 is a string, 9 an array
_SCALARS = {0: "u1", 1: "i1", 2: "u2", 3: "i2", 4: "u4", 5: "i4", 6: "f4", 7: "?", 10: "u8", 11: "i8", 12: "f8"}
_STRING, _ARRAY = 8, 9
_MAX_NESTING = 8  # arrays of arrays this deep at most (GGUFReader reads them by recursion)
# the fewest bytes one entry takes: a key-value pair (key length, type), a tensor (name length, dims, type, offset),
# an array element that is a string (its length) or an array (type, count)
_MIN_FIELD, _MIN_TENSOR, _MIN_STRING, _MIN_ARRAY = 8 + 4, 8 + 4 + 4 + 8, 8, 4 + 8
_HEADER_KEYS = ("GGUF.version", "GGUF.tensor_count", "GGUF.kv_count")  # GGUFReader's fields for the header's own values
_TYPED = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16, "I32": np.int32, "I64": np.int64}


class GGUFError(ValueError):
    """A GGUF file this reader refuses: damaged or cut short, or a count or size its bytes cannot hold."""


class _Unusual(Exception):
    """What this reader leaves to gguf.GGUFReader, once it has walked the whole header and found every count and
    length within the file: a big-endian file, nested arrays."""


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
        self.n_elements = math.prod(dims)  # exact: numpy's uint64 product wraps
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
        self._unusual: list[str] = []  # what sends the file to GGUFReader once the walk is done
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size < 24:
                raise GGUFError("cut short: no room for the GGUF header")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                self._buf, self._size = buf, len(buf)
                try:
                    table, offset = self._walk()
                finally:
                    del self._buf  # closed with the file
        self._check_blocks(len(table))
        alignment = 32
        if (align := self.fields.get("general.alignment")) is not None:
            if align._kind != 4:
                raise GGUFError("general.alignment is not a uint32")
            alignment = align.contents()
            if alignment == 0 or alignment & (alignment - 1):
                raise GGUFError("general.alignment is not a power of two")
        start = offset + (-offset % alignment)
        self.tensors: list[GGUFTensor] = []
        names = set()
        for name, dims, kind, at in table:
            if name in names:
                raise GGUFError(f"duplicate tensor {name}")
            names.add(name)
            if math.prod(dims) > 8 * self._size:  # no type stores a weight in less than a bit
                raise GGUFError(f"tensor {name}: its shape {dims} holds more weights than the file has bits")
            try:
                tensor = GGUFTensor(path, name, GGMLQuantizationType(kind), dims, start + at)
            except (KeyError, ValueError, IndexError) as exc:  # an unknown type, rows not whole blocks
                raise GGUFError(f"tensor {name}: {exc}") from None
            if tensor.n_bytes and tensor.data_offset + tensor.n_bytes > self._size:
                raise GGUFError(f"tensor {name} ends past the end of the file")
            self.tensors.append(tensor)
        if self._unusual:  # well formed, every number checked: GGUFReader may read it
            raise _Unusual(", ".join(self._unusual))

    def _walk(self) -> tuple[list[tuple[str, list[int], int, int]], int]:
        """The key-value pairs into `fields`, and the tensor table: (name, dims, type, offset) each, and the offset
        after it. Every count and length is checked against the bytes left before anything is made by it."""
        buf = self._buf
        if buf[:4] != b"GGUF":
            raise GGUFError("no GGUF magic")
        (version,) = struct.unpack_from("<I", buf, 4)
        if version in _VERSIONS:
            order: Literal["<", ">"] = "<"
        elif int.from_bytes(buf[4:8], "big") in _VERSIONS:
            order = ">"
        else:
            raise GGUFError(f"GGUF version {version} is not one of {', '.join(map(str, _VERSIONS))}")
        if order == ">":
            self._unusual.append("big-endian")
        self._order = order
        self._u32, self._u64 = struct.Struct(order + "I"), struct.Struct(order + "Q")
        num_tensors, num_fields = self._count(8, _MIN_TENSOR, "tensors", 24), self._count(16, _MIN_FIELD, "key-value pairs", 24)
        self.fields: dict[str, GGUFField] = {}
        offset = 24
        for _ in range(num_fields):
            key, offset = self._str(offset)
            name = self._name(key, "key")
            if name in self.fields or name in _HEADER_KEYS:
                raise GGUFError(f"duplicate key {name}")
            kind = self._int(self._u32, offset)
            value, offset = self._value(kind, offset + 4, name)
            self.fields[name] = GGUFField(value, kind)
        table = []
        for _ in range(num_tensors):
            key, offset = self._str(offset)
            name = self._name(key, "tensor name")
            num_dims = self._int(self._u32, offset)
            dims = self._array("u8", num_dims, offset + 4, f"tensor {name}'s dims").tolist()
            offset += 4 + 8 * num_dims
            table.append((name, dims, self._int(self._u32, offset), self._int(self._u64, offset + 4)))
            offset += 12
        return table, offset

    def _check_blocks(self, num_tensors: int) -> None:
        """`{arch}.block_count`, which a family's config sizes per-layer lists by, is at most the tensors there are
        (a block has one at least): a crafted count is refused before anything is made for each block."""
        arch, count = self.fields.get("general.architecture"), None
        if arch is not None and arch._kind == _STRING and isinstance(arch._value, bytes):
            count = self.fields.get(arch._value.decode("utf-8", "replace") + ".block_count")
        if count is not None and count._kind in _SCALARS and count._kind not in (6, 12):  # an integer
            blocks = int(count._value[0])
            if blocks > num_tensors:
                raise GGUFError(f"its block_count is {blocks}, but it holds {num_tensors} tensors")

    def _int(self, fmt: struct.Struct, offset: int) -> int:
        try:
            return fmt.unpack_from(self._buf, offset)[0]
        except struct.error:
            raise GGUFError(f"cut short at byte {offset}") from None

    def _count(self, offset: int, least: int, what: str, at: int) -> int:
        """A count read at `offset` of things that take at least `least` bytes each from `at` on: refused where
        the file cannot hold that many."""
        n = self._int(self._u64, offset)
        if n * least > self._size - at:
            raise GGUFError(f"it declares {n} {what}, more than its {self._size} bytes can hold")
        return n

    def _name(self, raw: bytes, what: str) -> str:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise GGUFError(f"a {what} is not UTF-8") from None

    def _str(self, offset: int) -> tuple[bytes, int]:
        end = offset + 8 + self._int(self._u64, offset)
        if end > self._size:
            raise GGUFError(f"cut short: a string at byte {offset} runs past the end of the file")
        return self._buf[offset + 8 : end], end

    def _array(self, dtype: str, count: int, offset: int, what: str) -> np.ndarray:
        nbytes = np.dtype(dtype).itemsize * count
        if offset + nbytes > self._size:
            raise GGUFError(f"cut short: {what} ({count} of {dtype}) run past the end of the file")
        return np.frombuffer(self._buf[offset : offset + nbytes], dtype=np.dtype(dtype).newbyteorder(self._order))

    def _value(self, kind: int, offset: int, name: str, depth: int = 0) -> tuple[Any, int]:
        """(value, offset after it): a scalar or numeric array as a numpy array, a string as bytes, a string array as a
        list of bytes; nested arrays as a list (the file then goes to GGUFReader)."""
        if kind == _STRING:
            return self._str(offset)
        if kind in _SCALARS:
            value = self._array(_SCALARS[kind], 1, offset, name)
            return value, offset + value.nbytes
        if kind != _ARRAY:
            raise GGUFError(f"{name}: unknown value type {kind}")
        item = self._int(self._u32, offset)
        if item in _SCALARS:
            value = self._array(_SCALARS[item], self._int(self._u64, offset + 4), offset + 12, name)
            return value, offset + 12 + value.nbytes
        if item == _STRING:
            return self._strings(self._count(offset + 4, _MIN_STRING, f"strings in {name}", offset + 12), offset + 12)
        if item != _ARRAY:
            raise GGUFError(f"{name}: an array of unknown value type {item}")
        if depth + 1 >= _MAX_NESTING:
            raise GGUFError(f"{name}: arrays nested deeper than {_MAX_NESTING}")
        if "nested arrays" not in self._unusual:
            self._unusual.append("nested arrays")
        count = self._count(offset + 4, _MIN_ARRAY, f"arrays in {name}", offset + 12)
        items, offset = [], offset + 12
        for _ in range(count):
            value, offset = self._value(_ARRAY, offset, name, depth + 1)
            items.append(value)
        return items, offset

    def _strings(self, count: int, offset: int) -> tuple[list[bytes], int]:
        buf, size, unpack = self._buf, self._size, self._u64.unpack_from
        out: list[bytes] = []
        append = out.append
        try:
            for _ in range(count):
                start = offset + 8
                offset = start + unpack(buf, offset)[0]
                append(buf[start:offset])
        except struct.error:
            raise GGUFError("cut short: a string array runs past the end of the file") from None
        if offset > size:
            raise GGUFError("cut short: a string array runs past the end of the file")
        return out, offset


def open_gguf(path: Path) -> Any:
    """A GGUF file's header: read by GGUFFile, or, where GGUFFile finds it well formed but unusual (big-endian,
    nested arrays), by gguf.GGUFReader, as the gguf package always has. A damaged or crafted file is GGUFError, not
    left to GGUFReader, which sizes its reads by the file's counts (an absurd one loops and allocates without end)."""
    try:
        return GGUFFile(path)
    except _Unusual:
        import gguf

        return gguf.GGUFReader(path)
