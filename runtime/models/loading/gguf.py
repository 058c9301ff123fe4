"""GGUF model files (llama.cpp's format), read without the `gguf` package.

`read_gguf(path)` parses the header (GGUF v2/v3, little-endian) eagerly and maps the tensor
data with `numpy.memmap`; `GGUFFile.tensor(name, dtype)` dequantizes one tensor on demand,
vectorized over blocks (`gguf_quant`). `gguf_convert.gguf_to_hf(file, dtype)` turns a
llama / qwen2 file into a Hugging Face style `config.json` dict and state dict.

Orientation: GGUF lists a tensor's dims innermost first (`ne[0]` is the contiguous one), so
the torch shape is the reversed dims, and quantization blocks run along the last torch dim.
Every user-caused failure (missing, foreign, truncated or unsupported file) is a one-line
`ModelLoadError`.
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # torch is imported where tensors are made: reading metadata needs none
    import torch

from spruce.runtime.errors import ModelLoadError
from spruce.runtime.models.loading.gguf_quant import GGML_TYPES, SUPPORTED_TYPES, GGMLType

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# ---------------------------------------------------------------------------------------
# Header
# ---------------------------------------------------------------------------------------

_STRING, _ARRAY = 8, 9
_VALUE_DTYPES = {  # GGUF metadata value type -> little-endian numpy dtype
    0: np.dtype("<u1"), 1: np.dtype("<i1"), 2: np.dtype("<u2"), 3: np.dtype("<i2"),
    4: np.dtype("<u4"), 5: np.dtype("<i4"), 6: np.dtype("<f4"), 7: np.dtype("?"),
    10: np.dtype("<u8"), 11: np.dtype("<i8"), 12: np.dtype("<f8"),
}  # fmt: skip
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


class _HeaderReader:
    """Sequential, bounds-checked reads over the mapped file: running past the end is a
    truncated file, never a struct / numpy error."""

    __slots__ = ("buf", "pos", "path")

    def __init__(self, buf: memoryview, path: str) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def truncated(self) -> ModelLoadError:
        return ModelLoadError(
            f"{self.path}: truncated GGUF file (the header runs past the end of the file at "
            f"{len(self.buf)} bytes); download or convert it again"
        )

    def take(self, size: int) -> memoryview:
        end = self.pos + size
        if end > len(self.buf):
            raise self.truncated()
        view, self.pos = self.buf[self.pos : end], end
        return view

    def u32(self) -> int:
        return _U32.unpack(self.take(4))[0]

    def u64(self) -> int:
        return _U64.unpack(self.take(8))[0]

    def string(self) -> str:
        return _decode(self.take(self.u64()))

    def strings(self, count: int) -> list[str]:
        # The hot loop of a header (tokens and merges: ~100k strings), kept to local names.
        buf, pos, size, unpack, out = self.buf, self.pos, len(self.buf), _U64.unpack_from, []
        for _ in range(count):
            if pos + 8 > size:
                raise self.truncated()
            end = pos + 8 + unpack(buf, pos)[0]
            if end > size:
                raise self.truncated()
            out.append(str(buf[pos + 8 : end], "utf-8", "surrogateescape"))
            pos = end
        self.pos = pos
        return out

    def numbers(self, dtype: np.dtype, count: int) -> np.ndarray:
        if count > len(self.buf):  # guards the multiplication below against absurd counts
            raise self.truncated()
        return np.frombuffer(self.take(count * dtype.itemsize), dtype)

    def value(self, value_type: int, key: str) -> Any:
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            return self.array(self.u32(), self.u64(), key)
        return self.numbers(_value_dtype(value_type, key, self.path), 1)[0].item()

    def array(self, item_type: int, count: int, key: str) -> list[Any]:
        if item_type == _STRING:
            return self.strings(count)
        if item_type == _ARRAY:
            return [self.value(_ARRAY, key) for _ in range(count)]
        return self.numbers(_value_dtype(item_type, key, self.path), count).tolist()


def _decode(raw: memoryview) -> str:
    # GGUF strings are UTF-8; stray invalid bytes (some old vocabularies) survive as lone
    # surrogates, recoverable with .encode("utf-8", "surrogateescape").
    return str(raw, "utf-8", "surrogateescape")


def _value_dtype(value_type: int, key: str, path: str) -> np.dtype:
    if value_type not in _VALUE_DTYPES:
        raise ModelLoadError(
            f"{path}: metadata key {key!r} has unknown value type {value_type}; "
            "the file is corrupt or from a newer GGUF revision"
        )
    return _VALUE_DTYPES[value_type]


# ---------------------------------------------------------------------------------------
# Tensor types and dequantization
# ---------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------
# The file
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order: GGUF's dims reversed
    ggml_type: GGMLType
    offset: int  # absolute byte offset of the data in the file
    nbytes: int


@dataclass(eq=False)
class GGUFFile:
    """A parsed GGUF header plus the memory-mapped tensor data.

    `metadata` maps each key to a Python value (arrays as lists, strings decoded as UTF-8);
    `tensors` maps each tensor name to its `TensorInfo`, in file order;
    `tensor(name, dtype)` returns a fresh dequantized tensor in the torch / HF orientation.
    """

    path: str
    version: int
    metadata: dict[str, Any] = field(repr=False)
    tensors: dict[str, TensorInfo] = field(repr=False)
    data: np.ndarray = field(repr=False)  # the whole file, memory-mapped read-only

    @property
    def tensor_names(self) -> list[str]:
        return list(self.tensors)

    def blocks(self, name: str) -> torch.Tensor:
        """A 2-D tensor's stored bytes, copied, as uint8 [rows, bytes per row]: its blocks."""
        import torch

        info = self.tensors[name]
        data = np.array(self.data[info.offset : info.offset + info.nbytes])
        return torch.from_numpy(data.reshape(info.shape[0], -1))

    def tensor(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tensor dequantized to `dtype` (default float32), in torch orientation."""
        import torch

        info = self.tensors.get(name)
        if info is None:
            raise ModelLoadError(f"{self.path}: no tensor named {name!r} in the GGUF file")
        kind = info.ggml_type
        if kind.dequantize is None:
            raise ModelLoadError(
                f"{self.path}: tensor {name!r} has type {kind.name}, which Spruce cannot read "
                f"(supported: {', '.join(SUPPORTED_TYPES)}); use a file quantized to one of those"
            )
        blocks = self.data[info.offset : info.offset + info.nbytes].view(kind.block)
        values = kind.dequantize(np.asarray(blocks))
        if isinstance(values, np.ndarray):
            values = torch.from_numpy(values)
        return values.reshape(info.shape).to(dtype or torch.float32)


def read_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Parses a GGUF v2/v3 file's header and maps its data; reads no tensor yet."""
    path = os.fspath(path)
    data = _map_file(path)
    reader = _HeaderReader(memoryview(data), path)
    version = _read_preamble(reader)
    tensor_count, kv_count = reader.u64(), reader.u64()
    metadata = {}
    for _ in range(kv_count):
        key = reader.string()
        metadata[key] = reader.value(reader.u32(), key)
    raw_infos = [_read_tensor_info(reader) for _ in range(tensor_count)]
    alignment = _alignment(metadata, path)
    data_start = -(-reader.pos // alignment) * alignment
    tensors = {name: _tensor_info(path, name, *rest, data_start) for name, *rest in raw_infos}
    _check_data_fits(path, tensors, len(data))
    return GGUFFile(path, version, metadata, tensors, data)


def _map_file(path: str) -> np.ndarray:
    try:
        size = os.path.getsize(path)
        if size < 24:  # magic + version + two counts
            raise ModelLoadError(
                f"{path}: not a GGUF file or truncated ({size} bytes); download it again"
            )
        return np.memmap(path, dtype=np.uint8, mode="r")
    except FileNotFoundError:
        raise ModelLoadError(f"GGUF file not found: {path}") from None
    except OSError as error:
        raise ModelLoadError(f"cannot read GGUF file {path}: {error.strerror or error}") from None


def _read_preamble(reader: _HeaderReader) -> int:
    magic = bytes(reader.take(4))
    if magic != GGUF_MAGIC:
        raise ModelLoadError(
            f"{reader.path}: not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r})"
        )
    version = reader.u32()
    if version not in SUPPORTED_VERSIONS:
        big_endian = version & 0xFFFF == 0 and version >> 24 in SUPPORTED_VERSIONS
        why = "big-endian GGUF files are" if big_endian else f"GGUF version {version} is"
        versions = ", ".join(map(str, SUPPORTED_VERSIONS))
        raise ModelLoadError(
            f"{reader.path}: {why} not supported (supported: little-endian versions {versions}); "
            "convert the model with a current llama.cpp"
        )
    return version


def _read_tensor_info(reader: _HeaderReader) -> tuple[str, list[int], int, int]:
    name = reader.string()
    dims = reader.numbers(_VALUE_DTYPES[10], reader.u32()).tolist()
    return name, dims, reader.u32(), reader.u64()


def _alignment(metadata: dict[str, Any], path: str) -> int:
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ModelLoadError(f"{path}: general.alignment = {alignment!r} is not a power of two")
    return alignment


def _tensor_info(
    path: str, name: str, dims: list[int], type_id: int, offset: int, data_start: int
) -> TensorInfo:
    kind = GGML_TYPES.get(type_id)
    if kind is None:
        raise ModelLoadError(
            f"{path}: tensor {name!r} has unknown ggml type id {type_id} "
            f"(supported: {', '.join(SUPPORTED_TYPES)})"
        )
    if dims and dims[0] % kind.block_size:
        raise ModelLoadError(
            f"{path}: tensor {name!r} ({kind.name}) has a row of {dims[0]} values, "
            f"not a multiple of its block size {kind.block_size}; the file is corrupt"
        )
    nbytes = math.prod(dims) // kind.block_size * kind.block_bytes
    return TensorInfo(name, tuple(reversed(dims)), kind, data_start + offset, nbytes)


def _check_data_fits(path: str, tensors: dict[str, TensorInfo], file_size: int) -> None:
    last = max(tensors.values(), key=lambda t: t.offset + t.nbytes, default=None)
    if last is not None and last.offset + last.nbytes > file_size:
        raise ModelLoadError(
            f"{path}: truncated GGUF file (tensor {last.name!r} ends at byte "
            f"{last.offset + last.nbytes}, the file has {file_size}); download or convert it again"
        )
