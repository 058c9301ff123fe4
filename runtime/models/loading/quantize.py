"""Quantized weights in memory: `QuantizedTensor` (a 2-D weight kept in one of llama.cpp's
block formats) and the quantizers that make one from float weights, with llama.cpp's
reference rounding (quantize_row_q8_0_ref and friends), vectorized over blocks.

`--quantization` (ModelOptions.quantization) picks the format: `none` keeps float weights,
`q8_0` / `q4_0` / `q4_1` quantize every linear layer (and the embedding table) to that
format at load, `auto` keeps a GGUF file's own format where a kernel computes on it
(those three and the K formats Q4_K / Q5_K / Q6_K) and uses Q8_0 for its other quantized
types (float tensors and Hugging Face checkpoints stay float under `auto`).

`quantize` also makes Q4_K and Q6_K (super-blocks of 256, llama.cpp's quantize_row_q4_K_ref
and quantize_row_q6_K_ref: each sub-block's scale searched over a few candidate steps, then
the scales themselves quantized); `--quantization` does not offer them, since a model whose
rows are not multiples of 256 values (the bundled one's 576) has no K layout.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from spruce.runtime.errors import ModelLoadError
from spruce.runtime.executor.kernels.cpu_quant_ops import QUANT_TYPES, dequantize, row_bytes
from spruce.runtime.models.loading.gguf_quant import GGML_TYPES

QUANTIZATIONS = ("auto", "none", "q8_0", "q4_0", "q4_1")  # --quantization's formats
CHUNK_VALUES = 1 << 18  # values quantized at a time: the temporaries stay a few MB


@dataclass(frozen=True)
class QuantizedTensor:
    """A [n, k] weight as n rows of k / block_size blocks of `qtype`: `blocks` uint8 [n, row_bytes]."""

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
    """A float [n, k] weight (k a multiple of the format's block size) in `qtype` blocks."""
    values = weight.detach().to(torch.float32).numpy()
    return QuantizedTensor(
        qtype, tuple(values.shape), torch.from_numpy(quantize_rows(values, qtype))
    )


def quantize_rows(values: np.ndarray, qtype: str, search: bool = True) -> np.ndarray:
    """float32 [n, k] -> uint8 [n, row_bytes(qtype, k)] blocks, a chunk of rows at a time.
    The K formats search each sub-block's scale as llama.cpp does; without `search`, one
    least-squares fit after min/max (Q4_K) or the max alone (Q6_K): several times faster."""
    n, k = values.shape
    size = QUANT_TYPES[qtype].block_size
    if k % size:
        raise ModelLoadError(
            f"cannot quantize a weight with rows of {k} values to {qtype} (blocks of {size})"
        )
    out = np.empty((n, row_bytes(qtype, k)), dtype=np.uint8)
    step = max(1, CHUNK_VALUES // k)
    quantizer = _QUANTIZERS[qtype]
    if size != 32:
        quantizer = functools.partial(quantizer, search=search)
    for start in range(0, n, step):
        chunk = np.asarray(values[start : start + step], dtype=np.float32).reshape(-1, size)
        out[start : start + step] = quantizer(chunk).view(np.uint8).reshape(-1, out.shape[1])
    return out


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


# -- K formats: super-blocks of 256 ------------------------------------------------------


def _dot(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise dot products of two (rows, n) arrays."""
    return np.einsum("ij,ij->i", a, b)


def _affine_fit(
    x: np.ndarray, w: np.ndarray, nmax: int, steps: int
) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's make_qkx2_quants over rows of x: the (scale, min) with x ~ scale * q - min,
    q in 0..nmax, of least w-weighted squared error among the min/max fit and `steps` + 1
    least-squares fits; as there, each fit rounds from the best min found so far."""
    high, offset = x.max(axis=1), np.minimum(x.min(axis=1), 0)
    sum_w, wx = w.sum(axis=1), w * x
    sum_x = wx.sum(axis=1)

    def levels(numerator: float) -> np.ndarray:
        iscale = np.float32(numerator) * _inverse(high - offset)
        return np.clip(np.rint(iscale[:, None] * (x - offset[:, None])), 0, nmax)

    def error(s: np.ndarray, m: np.ndarray, q: np.ndarray) -> np.ndarray:
        return _dot(w, np.square(s[:, None] * q + m[:, None] - x))

    scale = (high - offset) / np.float32(nmax)
    best = error(scale, offset, levels(nmax))
    for step in range(steps + 1):
        q = levels(nmax - 1 + 0.1 * step)
        wq = w * q
        sum_l, sum_l2, sum_xl = wq.sum(axis=1), _dot(wq, q), _dot(wq, x)
        det = sum_w * sum_l2 - sum_l * sum_l
        s = (sum_w * sum_xl - sum_x * sum_l) * _inverse(det)
        m = (sum_l2 * sum_x - sum_l * sum_xl) * _inverse(det)
        s = np.where(m > 0, sum_xl * _inverse(sum_l2), s)
        m = np.minimum(m, 0)
        trial = error(s, m, q)
        better = (det > 0) & (trial < best)
        scale, offset = np.where(better, s, scale), np.where(better, m, offset)
        best = np.where(better, trial, best)
    return scale, -offset


def _six_bits(values: np.ndarray, top: np.ndarray) -> np.ndarray:
    """Per-sub-block values in 0..63 relative to each super-block's largest."""
    return np.clip(np.rint(values * (63 * _inverse(top))[:, None]), 0, 63).astype(np.uint8)


def _quantize_q4_k(x: np.ndarray, search: bool) -> np.ndarray:
    nb = len(x)
    sub = x.reshape(nb * 8, 32)
    average = np.sqrt(np.square(sub).mean(axis=1))  # llama.cpp's weights: av_x + |x|
    fit = _affine_fit(sub, average[:, None] + np.abs(sub), 15, 20 if search else 0)
    scales, mins = (v.reshape(nb, 8) for v in fit)
    top_scale, top_min = scales.max(axis=1), mins.max(axis=1)
    ls, lm = _six_bits(scales, top_scale), _six_bits(mins, top_min)
    out = _empty_blocks("q4_k", nb)
    out["d"], out["dmin"] = top_scale / np.float32(63), top_min / np.float32(63)
    d = out["d"].astype(np.float32)[:, None] * ls
    dm = out["dmin"].astype(np.float32)[:, None] * lm
    q = np.clip(np.rint((x.reshape(nb, 8, 32) + dm[:, :, None]) * _inverse(d)[:, :, None]), 0, 15)
    q = q.astype(np.uint8).reshape(nb, 4, 2, 32)  # chunk c: sub-block 2c low, 2c + 1 high
    out["qs"] = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(nb, 128)
    out["scales"] = np.concatenate(
        [
            ls[:, :4] | (ls[:, 4:] >> 4) << 6,
            lm[:, :4] | (lm[:, 4:] >> 4) << 6,
            (ls[:, 4:] & 15) | (lm[:, 4:] & 15) << 4,
        ],
        axis=1,
    )
    return out


def _symmetric_fit(x: np.ndarray, nmax: int, search: bool) -> np.ndarray:
    """llama.cpp's make_qx_quants (rmse_type 1) over rows of x: the scale with
    x ~ scale * q, q in -nmax..nmax - 1, best of 19 candidates by x^2-weighted fit (the first alone without `search`)."""
    extreme = x[np.arange(len(x)), np.abs(x).argmax(axis=1)]
    inv_extreme, w = _inverse(extreme), np.square(x)
    scale, best = np.zeros(len(x), np.float32), np.zeros(len(x), np.float32)
    for step in [0, *range(-9, 0), *range(1, 10)] if search else [0]:
        q = np.clip(
            np.rint(-(nmax + np.float32(0.1) * step) * inv_extreme[:, None] * x), -nmax, nmax - 1
        )
        wq = w * q
        sum_lx, sum_l2 = _dot(wq, x), _dot(wq, q)
        better = (sum_l2 > 0) & ((step == 0) | (sum_lx * sum_lx > best * sum_l2))
        scale = np.where(better, sum_lx * _inverse(sum_l2), scale)
        best = np.where(better, scale * sum_lx, best)
    return scale


def _quantize_q6_k(x: np.ndarray, search: bool) -> np.ndarray:
    nb = len(x)
    scales = _symmetric_fit(x.reshape(nb * 16, 16), 32, search).reshape(nb, 16)
    top = scales[np.arange(nb), np.abs(scales).argmax(axis=1)]
    dead = np.abs(top) < 1e-15  # llama.cpp's GROUP_MAX_EPS: such a block is all zero bytes
    top[dead] = 0
    iscale = np.float32(-128) * _inverse(top)
    out = _empty_blocks("q6_k", nb)
    out["d"] = _inverse(iscale)
    out["scales"] = np.minimum(127, np.rint(iscale[:, None] * scales)).astype(np.int8)
    d = out["d"].astype(np.float32)[:, None] * out["scales"]
    q = np.clip(np.rint(x.reshape(nb, 16, 16) * _inverse(d)[:, :, None]), -32, 31) + 32
    q = np.where(dead[:, None, None], 0, q).astype(np.uint8).reshape(nb, 2, 4, 32)  # 2 x 4 x 32
    low, high = q & 15, q >> 4
    ql = np.concatenate(
        [low[:, :, 0] | low[:, :, 2] << 4, low[:, :, 1] | low[:, :, 3] << 4], axis=2
    )
    qh = high[:, :, 0] | high[:, :, 1] << 2 | high[:, :, 2] << 4 | high[:, :, 3] << 6
    out["ql"], out["qh"] = ql.reshape(nb, 128), qh.reshape(nb, 64)
    return out


_QUANTIZERS = {
    "q8_0": _quantize_q8_0,
    "q4_0": _quantize_q4_0,
    "q4_1": _quantize_q4_1,
    "q4_k": _quantize_q4_k,
    "q6_k": _quantize_q6_k,
}
