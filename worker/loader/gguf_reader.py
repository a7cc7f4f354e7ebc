"""A small GGUF reader: the header (metadata + tensor directory) parsed in one pass, tensor data as
memory-mapped views, dequantized by `gguf.quants.dequantize`.

Why not `gguf.GGUFReader`: it turns every element of every metadata array into its own memmap slice,
which takes 2-4 s for a 49k-token vocabulary on a small CPU; the worker reads a model's config before
deciding anything, and that read should cost milliseconds. Layout (little-endian, versions 2 and 3):

    "GGUF" | version u32 | tensor_count u64 | kv_count u64
    kv_count x   key: string | value_type u32 | value        (string = u64 length + UTF-8 bytes;
                                                               array = item_type u32 | count u64 | items)
    tensor_count x  name: string | n_dims u32 | dims u64[n_dims] (fastest first) | ggml_type u32 | offset u64
    padding to `general.alignment` (default 32), then tensor data at data_start + offset
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9


class GGUFFormatError(ValueError):
    """The file is not a GGUF file this reader understands, or is cut short."""


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (slowest first): a weight is (out_features, in_features)
    qtype: gguf.GGMLQuantizationType
    offset: int  # absolute, in the file
    num_bytes: int

    @property
    def num_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


class GGUFContents:
    """Metadata (`dict` of key -> value; arrays as lists) and the tensor directory of a GGUF file.
    Tensor data is mapped, not read, until `tensor(info)` is called."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with open(path, "rb") as f:
            try:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError as e:  # an empty file cannot be mapped
                raise GGUFFormatError("the file is empty") from e
        try:
            self.metadata, self.tensors = self._parse()
        except (struct.error, UnicodeDecodeError, IndexError) as e:
            raise GGUFFormatError(f"the header is cut short or garbled ({e})") from e

    def tensor(self, info: TensorInfo) -> np.ndarray:
        """The tensor as float32, shape `info.shape` (may be a read-only view for F32 data)."""
        row_len = info.shape[-1] if info.shape else 1
        block, type_size = gguf.GGML_QUANT_SIZES[info.qtype]
        raw = np.frombuffer(self._map, dtype=np.uint8, count=info.num_bytes, offset=info.offset)
        rows = raw.reshape(-1, row_len // block * type_size)
        return gguf.quants.dequantize(rows, info.qtype).reshape(info.shape).astype(np.float32, copy=False)

    def _parse(self) -> tuple[dict[str, Any], list[TensorInfo]]:
        buf = self._map
        if buf[:4] != b"GGUF":
            raise GGUFFormatError(f"bad magic {bytes(buf[:4])!r} (expected b'GGUF')")
        version, num_tensors, num_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise GGUFFormatError(
                f"GGUF version {version} is not supported (2 or 3; big-endian files are not)"
            )
        self._pos = 24
        metadata = {}
        for _ in range(num_kv):
            key = self._string()
            metadata[key] = self._value(self._unpack("<I"))
        raw_infos = []
        for _ in range(num_tensors):
            name = self._string()
            dims = struct.unpack_from(f"<{self._unpack('<I')}Q", buf, self._pos)
            self._pos += 8 * len(dims)
            qtype, offset = self._unpack("<I"), self._unpack("<Q")
            raw_infos.append((name, dims, qtype, offset))
        alignment = int(metadata.get("general.alignment", 32))
        data_start = -(-self._pos // alignment) * alignment
        tensors = []
        for name, dims, qtype, offset in raw_infos:
            try:
                kind = gguf.GGMLQuantizationType(qtype)
                block, type_size = gguf.GGML_QUANT_SIZES[kind]
            except (ValueError, KeyError) as e:
                raise GGUFFormatError(f"tensor {name!r} has unknown ggml type {qtype}") from e
            num_elements = int(np.prod(dims, dtype=np.int64))
            info = TensorInfo(
                name,
                tuple(int(d) for d in reversed(dims)),
                kind,
                data_start + offset,
                num_elements // block * type_size,
            )
            if info.offset + info.num_bytes > len(buf):
                raise GGUFFormatError(
                    f"truncated: tensor {name!r} ends at byte {info.offset + info.num_bytes} "
                    f"but the file has {len(buf)} bytes"
                )
            tensors.append(info)
        return metadata, tensors

    def _unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self._map, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        length = self._unpack("<Q")
        end = self._pos + length
        if end > len(self._map):
            raise GGUFFormatError("a string runs past the end of the file")
        text = self._map[self._pos : end].decode("utf-8")
        self._pos = end
        return text

    def _value(self, kind: int) -> Any:
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            item_kind, count = self._unpack("<I"), self._unpack("<Q")
            if item_kind in _SCALARS:
                fmt = _SCALARS[item_kind]
                items = list(struct.unpack_from(f"<{count}{fmt[1]}", self._map, self._pos))
                self._pos += count * struct.calcsize(fmt)
                return items
            return [self._value(item_kind) for _ in range(count)]
        if kind not in _SCALARS:
            raise GGUFFormatError(f"unknown metadata value type {kind}")
        return self._unpack(_SCALARS[kind])
