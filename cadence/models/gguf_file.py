"""``GGUFFile``: a GGUF file's metadata as Python values and its tensors as numpy
views of the memory-mapped file.

Why not ``gguf.GGUFReader``: it builds a numpy array for every part of every
key/value (length, bytes, type of each of a tokenizer's ~100k strings), which
costs ~175 MiB of memory for a 135M model's metadata. Here each value becomes
the Python value it decodes to (what ``ModelConfig`` and ``Tokenizer`` read),
and only each tensor gets an array. gguf-py's constants stay the vocabulary.

Layout (versions 2 and 3, little-endian; a string is a u64 length then UTF-8
bytes, an array is a u32 item type, a u64 count, then the items):

    magic b"GGUF" | version u32 | num_tensors u64 | num_kvs u64
    num_kvs     x  key string | value type u32 | value
    num_tensors x  name string | n_dims u32 | dims u64[n_dims] (fastest first)
                   | ggml type u32 | offset u64 (from the data start)
    padding to general.alignment (default 32)
    data start: each tensor's bytes at data start + its offset

A tensor's ``data`` has what ``GGUFReader`` gives: F32/F16/F64/I8..I64 as typed
values of shape dims reversed, every other type (BF16 and the block types) as
raw bytes, uint8, of shape dims reversed with the last dim in bytes per row.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType, GGUFValueType

SUPPORTED_VERSIONS = (2, 3)
_MAGIC = b"GGUF"

# struct codes of the fixed-size value types (little-endian: "<" + code).
_NUMBER_CODES = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b",
    GGUFValueType.UINT16: "H", GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i",
    GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT32: "f", GGUFValueType.FLOAT64: "d",
    GGUFValueType.BOOL: "?",
}
# Tensor types whose data is typed values; every other type is raw bytes.
_TYPED_DTYPES = {
    GGMLQuantizationType.F32: np.dtype("<f4"), GGMLQuantizationType.F16: np.dtype("<f2"),
    GGMLQuantizationType.F64: np.dtype("<f8"), GGMLQuantizationType.I8: np.dtype("i1"),
    GGMLQuantizationType.I16: np.dtype("<i2"), GGMLQuantizationType.I32: np.dtype("<i4"),
    GGMLQuantizationType.I64: np.dtype("<i8"),
}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF's order: fastest-varying dim first
    n_elements: int
    n_bytes: int
    data_offset: int  # from the start of the file
    data: np.ndarray  # read-only view of the mapped file (see the module doc)


class GGUFFile:
    """An opened GGUF file: ``metadata`` (key -> str, int, float, bool, or a list of
    them), ``value_types`` (key -> its GGUFValueType) and ``tensors`` in file order.
    Raises ValueError, naming the file, on anything it cannot read."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._buffer = _map_file(self.path)
        cursor = _Cursor(self._buffer, self.path)
        self.version, num_tensors, num_kvs = _read_header(cursor)
        self.metadata: dict[str, Any] = {}
        self.value_types: dict[str, GGUFValueType] = {}
        for _ in range(num_kvs):
            self._read_key_value(cursor)
        infos = [_read_tensor_info(cursor) for _ in range(num_tensors)]
        self.alignment = self._alignment()
        self.data_offset = -(-cursor.offset // self.alignment) * self.alignment
        self.tensors = self._tensors(infos)
        self._drop_pages(0, self.data_offset)  # the header is decoded: its pages are not read again

    def drop_pages(self, tensor: GGUFTensor) -> None:
        """Let this process's memory drop ``tensor``'s pages once its values are copied out.

        The mapping stays valid: the pages stay in the OS page cache and a later
        read of ``tensor.data`` faults them back in. Without this, a load holds the
        whole file in its RSS (mapped pages count) on top of the weights it copied.
        """
        self._drop_pages(tensor.data_offset, tensor.data_offset + tensor.n_bytes)

    def _drop_pages(self, start: int, end: int) -> None:
        if not isinstance(self._buffer, mmap.mmap) or not hasattr(mmap, "MADV_DONTNEED"):
            return  # an empty file, or an OS without madvise: nothing to drop, nothing lost
        page_start = start - start % mmap.PAGESIZE  # madvise takes whole pages
        if end > page_start:
            self._buffer.madvise(mmap.MADV_DONTNEED, page_start, end - page_start)

    def _read_key_value(self, cursor: _Cursor) -> None:
        key = cursor.string("a metadata key")
        if key in self.metadata:
            raise ValueError(f"{self.path}: metadata key {key!r} appears twice")
        kind = cursor.value_type(f"the type of {key!r}")
        self.value_types[key] = kind
        self.metadata[key] = _read_value(cursor, kind, key)

    def _alignment(self) -> int:
        if "general.alignment" not in self.metadata:
            return GGUF_DEFAULT_ALIGNMENT
        alignment = self.metadata["general.alignment"]
        if self.value_types["general.alignment"] != GGUFValueType.UINT32:
            raise ValueError(f"{self.path}: general.alignment must be a uint32, "
                             f"not {self.value_types['general.alignment'].name}")
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"{self.path}: general.alignment must be a power of two, got {alignment}")
        return alignment

    def _tensors(self, infos: list[tuple[str, tuple[int, ...], int, int]]) -> list[GGUFTensor]:
        tensors, names = [], set()
        for name, shape, raw_type, offset in infos:
            if name in names:
                raise ValueError(f"{self.path}: tensor {name!r} appears twice")
            names.add(name)
            tensors.append(self._tensor(name, shape, raw_type, self.data_offset + offset))
        return tensors

    def _tensor(self, name: str, shape: tuple[int, ...], raw_type: int, start: int) -> GGUFTensor:
        try:
            tensor_type = GGMLQuantizationType(raw_type)
        except ValueError:
            raise ValueError(f"{self.path}: tensor {name!r} has unknown ggml type {raw_type}") from None
        block_size, type_size = GGML_QUANT_SIZES[tensor_type]
        n_elements = math.prod(shape)
        n_bytes = n_elements * type_size // block_size
        if start + n_bytes > len(self._buffer):
            raise ValueError(f"{self.path}: truncated GGUF file: tensor {name!r} needs bytes "
                             f"{start}..{start + n_bytes}, the file has {len(self._buffer)}")
        dims = tuple(reversed(shape))  # slowest first, as numpy lays them out
        dtype = _TYPED_DTYPES.get(tensor_type)
        if dtype is None:
            dtype, dims = np.dtype(np.uint8), self._byte_dims(name, dims, tensor_type)
        data = np.frombuffer(self._buffer, dtype, n_bytes // dtype.itemsize, start).reshape(dims)
        return GGUFTensor(name, tensor_type, shape, n_elements, n_bytes, start, data)

    def _byte_dims(self, name: str, dims: tuple[int, ...], tensor_type: GGMLQuantizationType) -> tuple[int, ...]:
        """Numpy dims of a block type's raw bytes: whole blocks per row."""
        block_size, type_size = GGML_QUANT_SIZES[tensor_type]
        if not dims or dims[-1] % block_size:
            raise ValueError(f"{self.path}: tensor {name!r} of type {tensor_type.name}: rows of "
                             f"{dims[-1] if dims else 0} values are no whole {block_size}-value blocks")
        return (*dims[:-1], dims[-1] // block_size * type_size)


class _Cursor:
    """Reads little-endian values in file order; every read first checks the file holds it."""

    def __init__(self, buffer: mmap.mmap | bytes, path: str) -> None:
        self.buffer, self.path, self.offset = buffer, path, 0

    def need(self, num_bytes: int, what: str) -> None:
        """Raise unless the file holds ``num_bytes`` more bytes (``what`` they hold)."""
        if self.offset + num_bytes > len(self.buffer):
            raise ValueError(f"{self.path}: truncated GGUF file: {what} needs {num_bytes} bytes "
                             f"at byte {self.offset}, the file has {len(self.buffer)}")

    def take(self, num_bytes: int, what: str) -> int:
        """The offset of the next ``num_bytes`` bytes (``what`` they hold), moving past them."""
        self.need(num_bytes, what)
        start, self.offset = self.offset, self.offset + num_bytes
        return start

    def unpack(self, layout: struct.Struct, what: str) -> tuple:
        return layout.unpack_from(self.buffer, self.take(layout.size, what))

    def raw_string(self, what: str) -> bytes:
        (length,) = self.unpack(_U64, f"the length of {what}")
        start = self.take(length, what)
        return self.buffer[start:start + length]

    def string(self, what: str) -> str:
        # As gguf-py's callers decode: bytes that are no UTF-8 become U+FFFD.
        return self.raw_string(what).decode("utf-8", errors="replace")

    def value_type(self, what: str) -> GGUFValueType:
        (raw,) = self.unpack(_U32, what)
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise ValueError(f"{self.path}: {what} is {raw}, no GGUF value type") from None


def _map_file(path: str) -> mmap.mmap | bytes:
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return b""  # mmap refuses empty files; the header read reports it
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


def _read_header(cursor: _Cursor) -> tuple[int, int, int]:
    """(version, number of tensors, number of key/values)."""
    magic = cursor.buffer[cursor.take(4, "the magic"):4]
    if magic != _MAGIC:
        raise ValueError(f"{cursor.path}: not a GGUF file (starts with {magic!r}, not {_MAGIC!r})")
    (version,) = cursor.unpack(_U32, "the version")
    if version != 0 and version & 0xFFFF == 0:  # a small version written big-endian
        swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
        raise ValueError(f"{cursor.path}: a big-endian GGUF file (version {swapped}); "
                         "only little-endian files are read")
    if version not in SUPPORTED_VERSIONS:
        raise ValueError(f"{cursor.path}: GGUF version {version} is not supported "
                         f"(versions {', '.join(map(str, SUPPORTED_VERSIONS))} are)")
    num_tensors, num_kvs = cursor.unpack(struct.Struct("<QQ"), "the tensor and key/value counts")
    return version, num_tensors, num_kvs


def _read_value(cursor: _Cursor, kind: GGUFValueType, key: str) -> Any:
    if kind == GGUFValueType.STRING:
        return cursor.string(f"the value of {key!r}")
    if kind == GGUFValueType.ARRAY:
        return _read_array(cursor, key)
    (value,) = cursor.unpack(struct.Struct("<" + _NUMBER_CODES[kind]), f"the value of {key!r}")
    if kind == GGUFValueType.FLOAT32:
        # The shortest decimal that is this float32: 1e-05, not 9.999999747378752e-06.
        return float(str(np.float32(value)))
    return value


def _read_array(cursor: _Cursor, key: str) -> list:
    """The items as a flat list (arrays of arrays flatten, as gguf-py's fields do);
    float32 items are the exact float32 values, not their shortest decimals."""
    item_kind = cursor.value_type(f"the item type of {key!r}")
    (count,) = cursor.unpack(_U64, f"the length of {key!r}")
    if item_kind in _NUMBER_CODES:
        code = _NUMBER_CODES[item_kind]
        cursor.need(count * struct.calcsize(code), f"the items of {key!r}")
        return list(cursor.unpack(struct.Struct(f"<{count}{code}"), f"the items of {key!r}"))
    # A string or an array takes 8 bytes at least: a count past the file's end fails here, not in the loop.
    cursor.need(8 * count, f"the items of {key!r}")
    if item_kind == GGUFValueType.STRING:
        return [cursor.string(f"an item of {key!r}") for _ in range(count)]
    return [item for _ in range(count) for item in _read_array(cursor, key)]



def _read_tensor_info(cursor: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
    """(name, dims fastest first, raw ggml type, offset from the data start)."""
    name = cursor.string("a tensor name")
    (n_dims,) = cursor.unpack(_U32, f"the dims of tensor {name!r}")
    shape = cursor.unpack(struct.Struct(f"<{n_dims}Q"), f"the dims of tensor {name!r}")
    raw_type, offset = cursor.unpack(struct.Struct("<IQ"), f"the type and offset of tensor {name!r}")
    return name, shape, raw_type, offset
