"""GGUF model files (llama.cpp's format), read without the `gguf` package.

`read_gguf(path)` parses the header (GGUF v2/v3, little-endian) eagerly and maps the tensor
data with `numpy.memmap`; `GGUFFile.tensor(name, dtype)` dequantizes one tensor on demand,
vectorized over blocks. `gguf_to_hf(file, dtype)` turns a llama / qwen2 file into a Hugging
Face style `config.json` dict and a state dict with HF parameter names and layouts.

Orientation: GGUF lists a tensor's dims innermost first (`ne[0]` is the contiguous one), so
the torch shape is the reversed dims, and quantization blocks run along the last torch dim.
Every user-caused failure (missing, foreign, truncated or unsupported file) is a one-line
`ModelLoadError`.
"""

from __future__ import annotations

import math
import os
import re
import struct
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

if TYPE_CHECKING:  # torch is imported where tensors are made: reading metadata needs none
    import torch

from spruce.runtime.errors import ModelLoadError

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

Dequantizer = Callable[[np.ndarray], "np.ndarray | torch.Tensor"]


@dataclass(frozen=True, slots=True)
class GGMLType:
    """One ggml tensor type: `block_size` values stored in `block_bytes` bytes. Types Spruce
    can read have `block` (the block layout as a numpy structured dtype, mirroring
    llama.cpp's C struct) and `dequantize` (blocks -> (n_blocks, block_size) values)."""

    name: str
    block_size: int
    block_bytes: int
    block: np.dtype | None = None
    dequantize: Dequantizer | None = None


def _f16(blocks: np.ndarray, field: str) -> np.ndarray:
    """A per-block fp16 scale as a float32 column, ready to broadcast over the block."""
    return blocks[field].astype(np.float32)[:, None]


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """(..., n) bytes -> (..., 2n) 4-bit values: all low nibbles, then all high nibbles."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1)


def _bits(mask: np.ndarray, count: int) -> np.ndarray:
    """(n,) uint32 -> (n, count) uint8: bit j of each mask in column j."""
    return ((mask[:, None] >> np.arange(count, dtype=np.uint32)) & 1).astype(np.uint8)


def _dequantize_q4_0(blocks: np.ndarray) -> np.ndarray:
    return _f16(blocks, "d") * (_nibbles(blocks["qs"]).astype(np.int8) - 8).astype(np.float32)


def _dequantize_q4_1(blocks: np.ndarray) -> np.ndarray:
    q = _nibbles(blocks["qs"]).astype(np.float32)
    return _f16(blocks, "d") * q + _f16(blocks, "m")


def _q5_values(blocks: np.ndarray) -> np.ndarray:
    return _nibbles(blocks["qs"]) | (_bits(blocks["qh"], 32) << 4)


def _dequantize_q5_0(blocks: np.ndarray) -> np.ndarray:
    return _f16(blocks, "d") * (_q5_values(blocks).astype(np.int8) - 16).astype(np.float32)


def _dequantize_q5_1(blocks: np.ndarray) -> np.ndarray:
    return _f16(blocks, "d") * _q5_values(blocks).astype(np.float32) + _f16(blocks, "m")


def _dequantize_q8_0(blocks: np.ndarray) -> np.ndarray:
    return blocks["qs"].astype(np.float32) * _f16(blocks, "d")


def _k_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: 12 bytes -> 8 six-bit scales and 8 six-bit mins (get_scale_min_k4)."""
    low, mid, high = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = np.concatenate([low & 0x3F, (high & 0x0F) | ((low >> 2) & 0x30)], axis=1)
    mins = np.concatenate([mid & 0x3F, (high >> 4) | ((mid >> 2) & 0x30)], axis=1)
    return scales.astype(np.float32), mins.astype(np.float32)


def _k_affine(blocks: np.ndarray, q: np.ndarray) -> np.ndarray:
    """8 sub-blocks of 32: value = d * scale * q - dmin * min."""
    scales, mins = _k_scales_mins(blocks["scales"])
    d = (_f16(blocks, "d") * scales)[:, :, None]
    dm = (_f16(blocks, "dmin") * mins)[:, :, None]
    return (d * q.astype(np.float32) - dm).reshape(len(blocks), 256)


def _dequantize_q4_k(blocks: np.ndarray) -> np.ndarray:
    # 4 chunks of 32 bytes; each chunk's low nibbles are one sub-block, high nibbles the next.
    return _k_affine(blocks, _nibbles(blocks["qs"].reshape(-1, 4, 32)).reshape(-1, 8, 32))


def _dequantize_q5_k(blocks: np.ndarray) -> np.ndarray:
    low = _nibbles(blocks["qs"].reshape(-1, 4, 32)).reshape(-1, 8, 32)
    # bit s of qh[l] is the fifth bit of value l of sub-block s
    high = (blocks["qh"][:, None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1
    return _k_affine(blocks, low | (high << 4))


def _dequantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    # Two halves of 128 values: 64 ql bytes (low nibbles -> values 0..63, high -> 64..127)
    # and 32 qh bytes whose 2-bit fields at shifts 0, 2, 4, 6 cover values 0..31, 32..63, ...
    low = _nibbles(blocks["ql"].reshape(-1, 2, 64))
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]
    high = ((blocks["qh"].reshape(-1, 2, 1, 32) >> shifts) & 3).reshape(-1, 2, 128)
    q = ((low | (high << 4)).astype(np.int8) - 32).astype(np.float32).reshape(-1, 16, 16)
    d = _f16(blocks, "d") * blocks["scales"].astype(np.float32)
    return (d[:, :, None] * q).reshape(len(blocks), 256)


def _dequantize_q8_k(blocks: np.ndarray) -> np.ndarray:
    return blocks["d"][:, None] * blocks["qs"].astype(np.float32)


def _plain(blocks: np.ndarray) -> torch.Tensor:
    import torch

    return torch.from_numpy(np.array(blocks))  # a copy: the result must not pin the mapping


def _bf16(blocks: np.ndarray) -> torch.Tensor:
    import torch

    return torch.from_numpy(np.array(blocks.view(np.int16))).view(torch.bfloat16)


def _block(*fields: tuple) -> np.dtype:
    return np.dtype(list(fields))


_F16 = ("d", "<f2")
_TYPES: dict[int, GGMLType] = {
    0: GGMLType("F32", 1, 4, np.dtype("<f4"), _plain),
    1: GGMLType("F16", 1, 2, np.dtype("<f2"), _plain),
    2: GGMLType("Q4_0", 32, 18, _block(_F16, ("qs", "u1", 16)), _dequantize_q4_0),
    3: GGMLType("Q4_1", 32, 20, _block(_F16, ("m", "<f2"), ("qs", "u1", 16)), _dequantize_q4_1),
    6: GGMLType("Q5_0", 32, 22, _block(_F16, ("qh", "<u4"), ("qs", "u1", 16)), _dequantize_q5_0),
    7: GGMLType(
        "Q5_1", 32, 24,
        _block(_F16, ("m", "<f2"), ("qh", "<u4"), ("qs", "u1", 16)), _dequantize_q5_1,
    ),
    8: GGMLType("Q8_0", 32, 34, _block(_F16, ("qs", "i1", 32)), _dequantize_q8_0),
    9: GGMLType("Q8_1", 32, 40),
    10: GGMLType("Q2_K", 256, 84),
    11: GGMLType("Q3_K", 256, 110),
    12: GGMLType(
        "Q4_K", 256, 144,
        _block(_F16, ("dmin", "<f2"), ("scales", "u1", 12), ("qs", "u1", 128)), _dequantize_q4_k,
    ),
    13: GGMLType(
        "Q5_K", 256, 176,
        _block(_F16, ("dmin", "<f2"), ("scales", "u1", 12), ("qh", "u1", 32), ("qs", "u1", 128)),
        _dequantize_q5_k,
    ),
    14: GGMLType(
        "Q6_K", 256, 210,
        _block(("ql", "u1", 128), ("qh", "u1", 64), ("scales", "i1", 16), _F16), _dequantize_q6_k,
    ),
    15: GGMLType(
        "Q8_K", 256, 292,
        _block(("d", "<f4"), ("qs", "i1", 256), ("bsums", "<i2", 16)), _dequantize_q8_k,
    ),
    16: GGMLType("IQ2_XXS", 256, 66),
    17: GGMLType("IQ2_XS", 256, 74),
    18: GGMLType("IQ3_XXS", 256, 98),
    19: GGMLType("IQ1_S", 256, 50),
    20: GGMLType("IQ4_NL", 32, 18),
    21: GGMLType("IQ3_S", 256, 110),
    22: GGMLType("IQ2_S", 256, 82),
    23: GGMLType("IQ4_XS", 256, 136),
    24: GGMLType("I8", 1, 1),
    25: GGMLType("I16", 1, 2),
    26: GGMLType("I32", 1, 4),
    27: GGMLType("I64", 1, 8),
    28: GGMLType("F64", 1, 8),
    29: GGMLType("IQ1_M", 256, 56),
    30: GGMLType("BF16", 1, 2, np.dtype("<u2"), _bf16),
    34: GGMLType("TQ1_0", 256, 54),
    35: GGMLType("TQ2_0", 256, 66),
    39: GGMLType("MXFP4", 32, 17),
}  # fmt: skip
SUPPORTED_TYPES = tuple(t.name for t in _TYPES.values() if t.dequantize is not None)
assert all(t.block is None or t.block.itemsize == t.block_bytes for t in _TYPES.values())


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
    kind = _TYPES.get(type_id)
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


# ---------------------------------------------------------------------------------------
# Hugging Face view: config.json dict + state dict
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Architecture:
    hf_class: str
    model_type: str
    permuted_qk: bool  # llama.cpp's converter interleaves Q/K rows for rope (llama only)


ARCHITECTURES = {
    "llama": _Architecture("LlamaForCausalLM", "llama", permuted_qk=True),
    "qwen2": _Architecture("Qwen2ForCausalLM", "qwen2", permuted_qk=False),
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_ROPE_FREQS = "rope_freqs.weight"
_REQUIRED = object()


def gguf_to_hf(f: GGUFFile, dtype: torch.dtype) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A Hugging Face `config.json` dict and a state dict (HF names, HF row order, `dtype`).

    llama files get their Q/K rows un-permuted back to HF's rotate-half layout;
    `lm_head.weight` is present only when the file has `output.weight` (else tied)."""
    arch_name = f.metadata.get("general.architecture")
    arch = ARCHITECTURES.get(arch_name)
    if arch is None:
        raise ModelLoadError(
            f"{f.path}: GGUF architecture {arch_name!r} is not supported "
            f"(supported: {', '.join(ARCHITECTURES)})"
        )
    config = _hf_config(f, arch_name, arch, dtype)
    return config, _hf_state_dict(f, config, arch, dtype)


def _hf_config(f: GGUFFile, arch_name: str, arch: _Architecture, dtype: torch.dtype) -> dict:
    meta, prefix = f.metadata, arch_name + "."

    def get(key: str, default: Any = _REQUIRED) -> Any:
        if prefix + key in meta:
            return meta[prefix + key]
        if default is _REQUIRED:
            raise ModelLoadError(f"{f.path}: the GGUF metadata lacks {prefix + key!r}")
        return default

    hidden, heads = get("embedding_length"), get("attention.head_count")
    config = {
        "architectures": [arch.hf_class],
        "model_type": arch.model_type,
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "head_dim": get("attention.key_length", hidden // heads),
        "rms_norm_eps": _shortest(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": _shortest(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": get("context_length"),
        "vocab_size": _vocab_size(f, get),
        "tie_word_embeddings": "output.weight" not in f.tensors,
        "attention_bias": "blk.0.attn_q.bias" in f.tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    rope_scaling = _rope_scaling(f, get, config)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    return config


def _shortest(value: float) -> float:
    """A float32 metadata value as its shortest decimal (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))


def _vocab_size(f: GGUFFile, get: Callable[..., Any]) -> int:
    embed = f.tensors.get("token_embd.weight")
    if embed is not None:
        return embed.shape[0]
    return get("vocab_size", None) or len(f.metadata.get("tokenizer.ggml.tokens", ()))


def _rope_scaling(f: GGUFFile, get: Callable[..., Any], config: dict) -> dict | None:
    """HF `rope_scaling` from `{arch}.rope.scaling.*` (linear, yarn) or, for llama3-style
    scaling, from the `rope_freqs.weight` tensor llama.cpp writes instead of metadata."""
    kind = get("rope.scaling.type", "none")
    if kind == "linear":
        return {"rope_type": "linear", "factor": _shortest(get("rope.scaling.factor"))}
    if kind == "yarn":
        return {
            "rope_type": "yarn",
            "factor": _shortest(get("rope.scaling.factor")),
            "original_max_position_embeddings": get("rope.scaling.original_context_length"),
        }
    if kind != "none":
        raise ModelLoadError(f"{f.path}: rope scaling type {kind!r} is not supported")
    if _ROPE_FREQS not in f.tensors:
        return None
    factors = f.tensor(_ROPE_FREQS).double().numpy()
    return llama3_rope_scaling(factors, config["rope_theta"], config["head_dim"], f.path)


def llama3_rope_scaling(
    factors: np.ndarray, rope_theta: float, head_dim: int, path: str = "GGUF file"
) -> dict | None:
    """Recovers HF's llama3 `rope_scaling` from llama.cpp's per-frequency divisors.

    llama.cpp stores r_i = 1 (short wavelengths), `factor` (long ones) and, in between,
    1 / ((1 - s) / factor + s) with s = old_ctx / ((high - low) * wavelen) - low / (high - low).
    s is linear in 1 / wavelen, so a line fit gives its slope and intercept; any
    (low, high, old_ctx) with those two yields the same frequencies, so low is fixed to 1
    (Llama 3's own value, recovered exactly). The result is checked by recomputing r."""
    factor = float(factors.max())
    if factor <= 1.0:
        return None
    inv_wavelen = 1 / (2 * math.pi * rope_theta ** (np.arange(0, head_dim, 2) / head_dim))
    smooth = (1 / factors - 1 / factor) / (1 - 1 / factor)
    band = (smooth > 1e-4) & (smooth < 1 - 1e-4)
    scaling = None
    slope, intercept = np.polyfit(inv_wavelen[band], smooth[band], 1) if band.sum() >= 2 else (0, 0)
    if intercept < 0:  # low / (high - low) > 0
        high = round(1 - 1 / intercept, 4)
        scaling = {
            "rope_type": "llama3",
            "factor": _shortest(factor),
            "low_freq_factor": 1.0,
            "high_freq_factor": high,
            "original_max_position_embeddings": round(slope * (high - 1)),
        }
    if scaling is None or not np.allclose(llama3_factors(scaling, inv_wavelen), factors, rtol=1e-4):
        raise ModelLoadError(
            f"{path}: {_ROPE_FREQS} does not follow llama3 rope scaling; this rope variant "
            "is not supported"
        )
    return scaling


def llama3_factors(scaling: dict, inv_wavelen: np.ndarray) -> np.ndarray:
    """llama.cpp's rope_freqs values (per-frequency divisors) for a llama3 `rope_scaling`."""
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_ctx, factor = scaling["original_max_position_embeddings"], scaling["factor"]
    smooth = np.clip((old_ctx * inv_wavelen - low) / (high - low), 0.0, 1.0)
    return 1 / ((1 - smooth) / factor + smooth)


def _hf_state_dict(
    f: GGUFFile, config: dict, arch: _Architecture, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    state = {}
    for name in f.tensor_names:
        if name == _ROPE_FREQS:
            continue  # folded into config["rope_scaling"]
        hf_name, role = _hf_name(f.path, name)
        tensor = f.tensor(name, dtype)
        if arch.permuted_qk and role in heads:
            tensor = unpermute_qk(tensor, heads[role])
        state[hf_name] = tensor
    return state


def _hf_name(path: str, name: str) -> tuple[str, str]:
    """GGUF tensor name -> (HF parameter name, GGUF role such as 'attn_q')."""
    base, _, suffix = name.rpartition(".")
    if base in _GLOBAL_NAMES and suffix == "weight":
        return f"{_GLOBAL_NAMES[base]}.weight", base
    match = _LAYER_TENSOR.fullmatch(name)
    if match is None or match[2] not in _LAYER_NAMES:
        raise ModelLoadError(f"{path}: unexpected tensor {name!r} for a llama-family model")
    layer, role, suffix = match.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[role]}.{suffix}", role


def unpermute_qk(tensor: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undoes llama.cpp's Q/K row permutation: within each head, interleaved (pair) rows
    back to HF's rotate-half order (first halves, then second halves)."""
    rows = tensor.shape[0]
    return (
        tensor.reshape(n_head, rows // n_head // 2, 2, *tensor.shape[1:])
        .transpose(1, 2)
        .reshape(tensor.shape)
        .contiguous()
    )
