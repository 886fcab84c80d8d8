"""A GGUF file's header, metadata and tensor views, read in one pass over a memory map.

`gguf.GGUFReader` builds a numpy view for every part of every metadata value, the 262,144 tokens of a
Gemma vocabulary among them (7 s on 2 vCPUs for Gemma 3 270M; 2 s for SmolLM2's 49,152), and most of that is
thrown away. This reader decodes the values straight to Python (an array of numbers in one `np.frombuffer`)
and maps each tensor's data as the `gguf` package's reader does, so its dequantizers take the arrays as
they are: F32, F16, F64 and the integer types as arrays of their own dtype in numpy order (the dimensions
reversed), every other type as uint8 rows of its blocks' bytes.

Layout (GGUF v2 and v3, little-endian): magic "GGUF", u32 version, u64 tensor count, u64 metadata count;
the metadata as (string key, u32 type, value); each tensor as (string name, u32 dims, u64 x dims, u32 type,
u64 offset); the data from the next multiple of `general.alignment` (default 32), offsets relative to it.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

# Metadata value types: scalars by struct format and numpy dtype; 8 is a string, 9 an array.
_SCALARS = {0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16),
            4: ("<I", np.uint32), 5: ("<i", np.int32), 6: ("<f", np.float32), 7: ("<?", np.bool_),
            10: ("<Q", np.uint64), 11: ("<q", np.int64), 12: ("<d", np.float64)}
_STRING, _ARRAY = 8, 9
# Tensor types whose data is an array of one numpy dtype; the rest are blocks of bytes.
_PLAIN = {gguf.GGMLQuantizationType.F32: np.float32, gguf.GGMLQuantizationType.F16: np.float16,
          gguf.GGMLQuantizationType.F64: np.float64, gguf.GGMLQuantizationType.I8: np.int8,
          gguf.GGMLQuantizationType.I16: np.int16, gguf.GGMLQuantizationType.I32: np.int32,
          gguf.GGMLQuantizationType.I64: np.int64}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF's order: the fastest-varying dimension first
    data: np.ndarray  # a read-only view of the file (see the module's docstring)


class GGUFFile:
    """`metadata` (key -> str, int, float, bool or list of them) and `tensors`, in file order. ValueError
    (or struct.error for a file cut short) for anything that is not a well-formed GGUF v2/v3 file."""

    def __init__(self, path: str | Path) -> None:
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        data = self._map
        magic, version, num_tensors, num_fields = struct.unpack_from("<4sIQQ", data, 0)
        if magic != b"GGUF":
            raise ValueError("not a GGUF file (bad magic)")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2 or 3)")
        self._offset = 24
        self.metadata: dict[str, Any] = {}
        for _ in range(num_fields):
            key = self._string()
            if key in self.metadata:
                raise ValueError(f"metadata key {key!r} appears twice")
            self.metadata[key] = self._value(self._unpack("<I"))
        infos = []
        for _ in range(num_tensors):
            name = self._string()
            num_dims = self._unpack("<I")
            dims = struct.unpack_from(f"<{num_dims}Q", data, self._offset)
            self._offset += 8 * num_dims
            kind = gguf.GGMLQuantizationType(self._unpack("<I"))
            infos.append((name, dims, kind, self._unpack("<Q")))
        alignment = int(self.metadata.get("general.alignment", 32))
        start = -(-self._offset // alignment) * alignment
        self.tensors: list[GGUFTensor] = []
        names = set()
        for name, dims, kind, offset in infos:
            if name in names:
                raise ValueError(f"tensor {name!r} appears twice")
            names.add(name)
            self.tensors.append(GGUFTensor(name, kind, dims, self._view(start + offset, dims, kind)))

    def release_pages(self) -> None:
        """Drop the file's pages from this process's memory map (they stay in the page cache, and whatever is
        still read through the map, a block embedding's rows, faults them back in one by one): once a model
        is built from the file its weights are copies, and the pages read to make them counted in the
        process's resident memory, as much as the file itself (a container's limit counts them too)."""
        if hasattr(self._map, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
            self._map.madvise(mmap.MADV_DONTNEED)

    def _unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self._map, self._offset)
        self._offset += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        length = self._unpack("<Q")
        end = self._offset + length
        if end > len(self._map):
            raise ValueError("a string runs past the end of the file")
        text = self._map[self._offset:end].decode("utf-8", errors="replace")
        self._offset = end
        return text

    def _value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self._unpack(_SCALARS[kind][0])
        if kind == _STRING:
            return self._string()
        if kind != _ARRAY:
            raise ValueError(f"unknown metadata value type {kind}")
        element, count = self._unpack("<I"), self._unpack("<Q")
        if element in _SCALARS:
            dtype = np.dtype(_SCALARS[element][1]).newbyteorder("<")
            values = np.frombuffer(self._map, dtype, count, self._offset)
            self._offset += count * dtype.itemsize
            return values.tolist()
        return [self._value(element) for _ in range(count)]

    def _view(self, offset: int, dims: tuple[int, ...], kind: gguf.GGMLQuantizationType) -> np.ndarray:
        shape = tuple(reversed(dims))
        count = int(np.prod(dims, dtype=np.int64))
        if kind in _PLAIN:
            dtype = np.dtype(_PLAIN[kind])
        else:
            block_size, type_size = gguf.GGML_QUANT_SIZES[kind]
            if shape[-1] % block_size:
                raise ValueError(f"a row of {shape[-1]} values is not whole {kind.name} blocks")
            dtype = np.dtype(np.uint8)
            shape = (*shape[:-1], shape[-1] // block_size * type_size)
            count = int(np.prod(shape, dtype=np.int64))
        if offset + count * dtype.itemsize > len(self._map):
            raise ValueError("tensor data runs past the end of the file")
        return np.frombuffer(self._map, dtype, count, offset).reshape(shape)
