"""ggml tensor types: block layouts (numpy structured dtypes mirroring llama.cpp's C
structs) and vectorized dequantizers, blocks -> values."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # torch is imported where tensors are made
    import torch

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
GGML_TYPES: dict[int, GGMLType] = {
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
SUPPORTED_TYPES = tuple(t.name for t in GGML_TYPES.values() if t.dequantize is not None)
assert all(t.block is None or t.block.itemsize == t.block_bytes for t in GGML_TYPES.values())
