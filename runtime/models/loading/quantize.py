"""Quantized weights in memory: `QuantizedTensor` (a 2-D weight kept in one of llama.cpp's
block formats) and the quantizers that make one from float weights, with llama.cpp's
reference rounding (quantize_row_q8_0_ref and friends), vectorized over blocks.

`--quantization` (ModelOptions.quantization) picks the format: `none` keeps float weights,
`q8_0` / `q4_0` / `q4_1` quantize every linear layer (and the embedding table) to that
format at load, `auto` keeps a GGUF file's own format where a kernel computes on it
(those three and the K formats Q4_K / Q5_K / Q6_K, which have kernels but no quantizer
here) and uses Q8_0 for its other quantized types (float tensors and Hugging Face
checkpoints stay float under `auto`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from spruce.runtime.errors import ModelLoadError
from spruce.runtime.executor.kernels.cpu_quant_ops import QUANT_TYPES, dequantize, row_bytes
from spruce.runtime.models.loading.gguf_quant import GGML_TYPES

QUANTIZATIONS = ("auto", "none", "q8_0", "q4_0", "q4_1")  # the formats quantize() makes


@dataclass(frozen=True)
class QuantizedTensor:
    """A [n, k] weight as n rows of k / 32 blocks of `qtype`: `blocks` uint8 [n, row_bytes]."""

    qtype: str
    shape: tuple[int, int]
    blocks: torch.Tensor

    def __post_init__(self) -> None:
        n, k = self.shape
        assert self.blocks.dtype == torch.uint8 and tuple(self.blocks.shape) == (
            n,
            row_bytes(self.qtype, k),
        )

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.qtype, self.blocks.contiguous(), self.shape[1])

    def with_blocks(self, blocks: torch.Tensor) -> QuantizedTensor:
        """The same type with rows rearranged (row permutations, concatenation)."""
        return QuantizedTensor(self.qtype, (blocks.shape[0], self.shape[1]), blocks.contiguous())


def check_quantization(name: str) -> str:
    if name not in QUANTIZATIONS:
        raise ModelLoadError(
            f"unknown quantization {name!r} (supported: {', '.join(QUANTIZATIONS)})"
        )
    return name


def quantize(weight: torch.Tensor, qtype: str) -> QuantizedTensor:
    """A float [n, k] weight (k a multiple of 32) in `qtype` blocks."""
    n, k = weight.shape
    if k % 32:
        raise ModelLoadError(
            f"cannot quantize a weight with rows of {k} values to {qtype} (blocks of 32)"
        )
    values = weight.detach().to(torch.float32).numpy().reshape(-1, 32)
    blocks = _QUANTIZERS[qtype](values)
    raw = torch.from_numpy(blocks.view(np.uint8).reshape(n, -1).copy())
    return QuantizedTensor(qtype, (n, k), raw)


def _empty_blocks(qtype: str, count: int) -> np.ndarray:
    return np.zeros(count, dtype=GGML_TYPES[QUANT_TYPES[qtype].ggml_id].block)


def _inverse(d: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """(blocks, 32) values 0..15 -> (blocks, 16) bytes: value i low, value i + 16 high."""
    return (q[:, :16] | (q[:, 16:] << 4)).astype(np.uint8)


def _quantize_q8_0(x: np.ndarray) -> np.ndarray:
    d = np.abs(x).max(axis=1) / np.float32(127)
    out = _empty_blocks("q8_0", len(x))
    out["d"] = d
    out["qs"] = np.round(x * _inverse(d)[:, None]).astype(np.int8)
    return out


def _quantize_q4_0(x: np.ndarray) -> np.ndarray:
    extreme = x[np.arange(len(x)), np.abs(x).argmax(axis=1)]  # the value of largest magnitude
    d = extreme / np.float32(-8)
    q = np.minimum(15, (x * _inverse(d)[:, None] + np.float32(8.5)).astype(np.int8))
    out = _empty_blocks("q4_0", len(x))
    out["d"], out["qs"] = d, _pack_nibbles(q.astype(np.uint8))
    return out


def _quantize_q4_1(x: np.ndarray) -> np.ndarray:
    low, high = x.min(axis=1), x.max(axis=1)
    d = (high - low) / np.float32(15)
    q = np.minimum(
        15, ((x - low[:, None]) * _inverse(d)[:, None] + np.float32(0.5)).astype(np.int8)
    )
    out = _empty_blocks("q4_1", len(x))
    out["d"], out["m"], out["qs"] = d, low, _pack_nibbles(q.astype(np.uint8))
    return out


_QUANTIZERS = {"q8_0": _quantize_q8_0, "q4_0": _quantize_q4_0, "q4_1": _quantize_q4_1}
