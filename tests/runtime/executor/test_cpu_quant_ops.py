"""The quantized-weight kernels against a NumPy reference of the same block arithmetic:
activations quantized exactly alike, integer dot products exact, scales applied within
float32 rounding; on random blocks, odd shapes, and every instruction set this CPU runs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from spruce.runtime.executor.kernels import cpu_quant_ops as ops
from spruce.runtime.models.loading.gguf_quant import GGML_TYPES
from spruce.runtime.models.loading.quantize import quantize

pytestmark = pytest.mark.skipif(not ops.available(), reason="no C compiler")

QTYPES = list(ops.QUANT_TYPES)


def random_blocks(qtype: str, n: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    """n rows of random blocks: every byte pattern for the values, finite fp16 scales."""
    layout = GGML_TYPES[ops.QUANT_TYPES[qtype].ggml_id].block
    blocks = np.frombuffer(rng.integers(0, 256, n * k // 32 * layout.itemsize, dtype=np.uint8), layout).copy()
    blocks["d"] = (rng.standard_normal(len(blocks)) * 0.02).astype(np.float16)
    if "m" in layout.names:
        blocks["m"] = (rng.standard_normal(len(blocks)) * 0.1).astype(np.float16)
    return torch.from_numpy(blocks.view(np.uint8).reshape(n, -1).copy())


def reference_activations(x: np.ndarray):
    blocks = x.reshape(x.shape[0], -1, 32)
    d = np.abs(blocks).max(axis=2) / np.float32(32767)
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, 1), np.float32(0)).astype(np.float32)
    q = np.rint(blocks * inv[:, :, None]).astype(np.int16)
    return q.reshape(x.shape), d, q.astype(np.int64).sum(axis=2).astype(np.float32)


def reference_linear(x: np.ndarray, qtype: str, blocks: torch.Tensor, k: int) -> np.ndarray:
    """Exact integer block dots (int64), then the scales in float64."""
    layout = GGML_TYPES[ops.QUANT_TYPES[qtype].ggml_id].block
    b = blocks.numpy().reshape(-1).view(layout).reshape(blocks.shape[0], k // 32)
    qx, dx, sx = reference_activations(x)
    qx = qx.reshape(x.shape[0], -1, 32).astype(np.int64)
    if qtype == "q8_0":
        qw = b["qs"].astype(np.int64)
    else:
        qw = np.concatenate([b["qs"] & 15, b["qs"] >> 4], axis=-1).astype(np.int64)
    dots = np.einsum("nbi,rbi->rnb", qw, qx)  # [rows, n, blocks], exact
    dw = b["d"].astype(np.float64)[None]
    scale = dw * dx.astype(np.float64)[:, None, :]
    sx64 = sx.astype(np.float64)[:, None, :]
    if qtype == "q4_0":
        dots = dots - 8 * sx.astype(np.int64)[:, None, :]
    y = (scale * dots).sum(axis=2)
    if qtype == "q4_1":
        y += (b["m"].astype(np.float64)[None] * dx.astype(np.float64)[:, None, :] * sx64).sum(axis=2)
    return y


def test_activation_quantization_is_exact():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 96)).astype(np.float32) * rng.uniform(0.1, 10, (3, 96)).astype(np.float32)
    x[1, 32:64] = 0.0  # an all-zero block: scale 0, values 0
    qx, dx, sx = ops.quantize_activations(torch.from_numpy(x))
    ref_q, ref_d, ref_s = reference_activations(x)
    assert np.array_equal(qx.numpy(), ref_q)
    assert np.array_equal(dx.numpy(), ref_d) and np.array_equal(sx.numpy(), ref_s)


@pytest.mark.parametrize("isa", ops.available_isas())
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("rows,n,k", [(1, 7, 32), (2, 33, 96), (3, 5, 224), (4, 64, 576), (6, 9, 64), (9, 3, 128)])
def test_integer_linear_matches_block_reference(isa, qtype, rows, n, k):
    rng = np.random.default_rng(rows * 1000 + n + k)
    blocks = random_blocks(qtype, n, k, rng)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    y = ops.integer_linear(torch.from_numpy(x), qtype, blocks, bias, isa=isa).numpy()
    expected = reference_linear(x, qtype, blocks, k) + bias.numpy()
    assert np.allclose(y, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max()), np.abs(y - expected).max()


@pytest.mark.parametrize("qtype", QTYPES)
def test_dequantize_matches_gguf_dequantizer(qtype):
    rng = np.random.default_rng(1)
    blocks = random_blocks(qtype, 11, 160, rng)
    kind = GGML_TYPES[ops.QUANT_TYPES[qtype].ggml_id]
    expected = kind.dequantize(blocks.numpy().reshape(-1).view(kind.block)).reshape(11, 160)
    assert np.allclose(ops.dequantize(qtype, blocks, 160).numpy(), expected, rtol=1e-6, atol=1e-6)
    ids = torch.tensor([4, 0, 10, 4])
    assert np.allclose(ops.dequantize(qtype, blocks, 160, ids).numpy(), expected[[4, 0, 10, 4]], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("qtype", QTYPES)
def test_many_rows_path_equals_dequantized_matmul(qtype):
    rng = np.random.default_rng(2)
    blocks = random_blocks(qtype, 40, 128, rng)
    x = torch.from_numpy(rng.standard_normal((ops.INTEGER_MAX_ROWS + 5, 128)).astype(np.float32))
    expected = x @ ops.dequantize(qtype, blocks, 128).T
    assert torch.allclose(ops.linear(x, qtype, blocks), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qtype,bound", [("q8_0", 0.5 / 127), ("q4_0", 1 / 8), ("q4_1", 0.5 / 15)])
def test_quantizers_round_trip_within_half_a_step(qtype, bound):
    """Every value comes back within half a quantization step of its block (plus the rounding
    of the step itself to float16, up to 127 * 2^-11 steps for Q8_0)."""
    rng = np.random.default_rng(3)
    w = torch.from_numpy(rng.standard_normal((6, 96)).astype(np.float32))
    q = quantize(w, qtype)
    err = (q.dequantize() - w).abs().reshape(-1, 32)
    blocks = w.reshape(-1, 32)
    span = blocks.abs().amax(1) if qtype != "q4_1" else blocks.amax(1) - blocks.amin(1)
    assert (err <= span[:, None] * bound * 1.15 + 1e-6).all()
