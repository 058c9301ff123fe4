"""The quantized-weight kernels against a NumPy reference of the same block arithmetic:
activations quantized exactly alike, integer dot products exact, scales applied within
float32 rounding; on random blocks, odd shapes, and every instruction set this CPU runs.
The reference decodes the blocks itself (the K formats' packed scales and bits included),
independently of the C kernels and of the GGUF dequantizers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from spruce.runtime.executor.kernels import cpu_quant_ops as ops
from spruce.runtime.models.loading.gguf_quant import GGML_TYPES
from spruce.runtime.models.loading.quantize import quantize

pytestmark = pytest.mark.skipif(not ops.available(), reason="no C compiler")

QTYPES = list(ops.QUANT_TYPES)
K_TYPES = [q for q in QTYPES if ops.QUANT_TYPES[q].block_size == 256]


def layout(qtype: str) -> np.dtype:
    return GGML_TYPES[ops.QUANT_TYPES[qtype].ggml_id].block


def random_blocks(qtype: str, n: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    """n rows of random blocks: every byte pattern for the values (and the K formats'
    packed scales), finite fp16 scales."""
    kind = layout(qtype)
    count = n * k // ops.QUANT_TYPES[qtype].block_size
    blocks = np.frombuffer(rng.integers(0, 256, count * kind.itemsize, dtype=np.uint8), kind).copy()
    blocks["d"] = (rng.standard_normal(len(blocks)) * 0.02).astype(np.float16)
    for offset in {"m", "dmin"} & set(kind.names):
        blocks[offset] = (rng.standard_normal(len(blocks)) * 0.1).astype(np.float16)
    return torch.from_numpy(blocks.view(np.uint8).reshape(n, -1).copy())


def reference_activations(x: np.ndarray):
    blocks = x.reshape(x.shape[0], -1, 32)
    d = np.abs(blocks).max(axis=2) / np.float32(32767)
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, 1), np.float32(0)).astype(np.float32)
    q = np.rint(blocks * inv[:, :, None]).astype(np.int16)
    return q.reshape(x.shape), d, q.astype(np.int64).sum(axis=2).astype(np.float32)


def k4_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[..., 12] bytes -> 8 six-bit scales, 8 six-bit mins (llama.cpp's get_scale_min_k4)."""
    q = packed.astype(np.int64)
    scales, mins = [], []
    for j in range(8):
        if j < 4:
            scales.append(q[..., j] & 63), mins.append(q[..., j + 4] & 63)
        else:
            scales.append((q[..., j + 4] & 0xF) | ((q[..., j - 4] >> 6) << 4))
            mins.append((q[..., j + 4] >> 4) | ((q[..., j] >> 6) << 4))
    return np.stack(scales, -1), np.stack(mins, -1)


def weight_groups(qtype: str, blocks: torch.Tensor, k: int):
    """The weights as groups of 32: integer values q [n, k / 32, 32], a float64 scale per
    16 values [n, k / 32, 2] and an offset per group [n, k / 32]: w = scale * q + offset."""
    n = blocks.shape[0]
    b = blocks.numpy().reshape(-1).view(layout(qtype)).reshape(n, -1)
    d = b["d"].astype(np.float64)
    if qtype in ("q8_0", "q4_0", "q4_1"):
        q = (
            b["qs"].astype(np.int64)
            if qtype == "q8_0"
            else np.concatenate([b["qs"] & 15, b["qs"] >> 4], -1).astype(np.int64)
        )
        q = q - 8 if qtype == "q4_0" else q
        offset = b["m"].astype(np.float64) if qtype == "q4_1" else np.zeros_like(d)
        return q, np.stack([d, d], -1), offset
    if qtype == "q6_k":
        ql, qh = (
            b["ql"].astype(np.int64).reshape(n, -1, 2, 2, 32),
            b["qh"].astype(np.int64).reshape(n, -1, 2, 32),
        )
        parts = []  # per half: ql's low nibbles (two chunks), then its high nibbles
        for part in range(4):
            low = (ql[:, :, :, part % 2] >> (4 * (part // 2))) & 15
            parts.append(low | (((qh >> (2 * part)) & 3) << 4))
        q = np.stack(parts, 3).reshape(n, -1, 32) - 32
        scale = d[:, :, None] * b["scales"].astype(np.float64)  # [n, super-blocks, 16]
        return q, scale.reshape(n, -1, 2), np.zeros(q.shape[:2])
    qs = b["qs"].astype(np.int64).reshape(n, -1, 4, 32)
    q = np.stack([qs & 15, qs >> 4], 3).reshape(n, -1, 8, 32)
    if qtype == "q5_k":
        q = q | (((b["qh"].astype(np.int64)[:, :, None, :] >> np.arange(8)[:, None]) & 1) << 4)
    sc, mn = k4_scales_mins(b["scales"])
    scale = d[:, :, None] * sc
    offset = -(b["dmin"].astype(np.float64)[:, :, None] * mn)
    return q.reshape(n, -1, 32), np.repeat(scale.reshape(n, -1, 1), 2, -1), offset.reshape(n, -1)


def reference_linear(x: np.ndarray, qtype: str, blocks: torch.Tensor, k: int) -> np.ndarray:
    """Exact integer dots per 16 values (int64), then the scales in float64."""
    q, scale, offset = weight_groups(qtype, blocks, k)
    qx, dx, sx = reference_activations(x)
    qx = qx.reshape(x.shape[0], -1, 2, 16).astype(np.int64)
    dots = np.einsum("nbhi,rbhi->rnbh", q.reshape(*q.shape[:2], 2, 16), qx)  # exact
    dx64 = dx.astype(np.float64)[:, None, :]
    y = (dx64 * (scale[None] * dots).sum(-1)).sum(-1)
    return y + (offset[None] * dx64 * sx.astype(np.float64)[:, None, :]).sum(-1)


def test_reference_decodes_like_the_gguf_dequantizers():
    """The test's own block decoding equals the GGUF loader's, for every format."""
    rng = np.random.default_rng(4)
    for qtype in QTYPES:
        blocks = random_blocks(qtype, 3, 512, rng)
        q, scale, offset = weight_groups(qtype, blocks, 512)
        ours = scale.repeat(16, -1) * q + offset[..., None]
        kind = GGML_TYPES[ops.QUANT_TYPES[qtype].ggml_id]
        expected = kind.dequantize(blocks.numpy().reshape(-1).view(kind.block))
        assert np.allclose(ours.reshape(3, 512), expected.reshape(3, 512), rtol=1e-6, atol=1e-7), (
            qtype
        )


@pytest.fixture(params=ops.ISAS)
def isa(request) -> str:
    """Each variant of the integer kernels, passed to them explicitly; one this CPU lacks is
    a skip that says so."""
    if request.param not in ops.available_isas():
        pytest.skip(
            f"this CPU lacks the {request.param} integer kernels (runs {ops.available_isas()})"
        )
    return request.param


def test_activation_quantization_is_exact(isa):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 96)).astype(np.float32) * rng.uniform(0.1, 10, (3, 96)).astype(
        np.float32
    )
    x[1, 32:64] = 0.0  # an all-zero block: scale 0, values 0
    x[2, 64:96] = np.arange(32, dtype=np.float32) - np.float32(15.5)  # halves: ties to even
    x[2, 64] = 32767.0  # scale exactly 1
    qx, dx, sx = ops.quantize_activations(torch.from_numpy(x), isa)
    ref_q, ref_d, ref_s = reference_activations(x)
    assert np.array_equal(qx.numpy(), ref_q)
    assert np.array_equal(dx.numpy(), ref_d) and np.array_equal(sx.numpy(), ref_s)


SHAPES = [
    (1, 7, 32),
    (1, 37, 96),
    (1, 64, 576),
    (2, 33, 96),
    (3, 5, 224),
    (4, 64, 576),
    (6, 9, 64),
    (9, 3, 128),
]
K_SHAPES = [
    (1, 7, 256),
    (1, 37, 512),
    (2, 33, 512),
    (3, 5, 768),
    (4, 20, 1536),
    (6, 9, 256),
    (9, 3, 512),
]
CASES = [(q, *shape) for q in QTYPES for shape in (K_SHAPES if q in K_TYPES else SHAPES)]


@pytest.mark.parametrize("qtype,rows,n,k", CASES)
def test_integer_linear_matches_block_reference(isa, qtype, rows, n, k):
    rng = np.random.default_rng(rows * 1000 + n + k)
    blocks = random_blocks(qtype, n, k, rng)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    y = ops.integer_linear(torch.from_numpy(x), qtype, blocks, bias, isa=isa).numpy()
    expected = reference_linear(x, qtype, blocks, k) + bias.numpy()
    assert np.allclose(y, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max()), np.abs(
        y - expected
    ).max()


@pytest.mark.parametrize("n", [1, 15, 17, 48, 70, 1000])
def test_integer_linear_is_the_same_on_any_thread_count(isa, n):
    """The weight rows' tiles are shared out and taken back by threads as they finish (one
    tile, fewer tiles than threads, a last partial tile, many): every output row is computed,
    each by one sum in one order, so any thread count gives the one-thread result and the
    reference's."""
    rng = np.random.default_rng(n)
    blocks = random_blocks("q4_1", n, 96, rng)
    x = rng.standard_normal((1, 96)).astype(np.float32)
    bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    threads = torch.get_num_threads()
    try:
        results = []
        for count in (1, 2, 3, 4):
            torch.set_num_threads(count)
            results.append(ops.integer_linear(torch.from_numpy(x), "q4_1", blocks, bias, isa=isa))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(results[0], r) for r in results[1:])
    expected = reference_linear(x, "q4_1", blocks, 96) + bias.numpy()
    assert np.allclose(results[0].numpy(), expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


@pytest.mark.parametrize("qtype", QTYPES)
def test_batch_one_equals_a_row_of_a_batch(isa, qtype):
    """One activation row takes its own path (several weight rows at a time); its
    arithmetic is the many-row path's, so each row's result is identical."""
    rng = np.random.default_rng(5)
    k = 512 if qtype in K_TYPES else 96
    blocks = random_blocks(qtype, 45, k, rng)
    x = torch.from_numpy(rng.standard_normal((2, k)).astype(np.float32))
    one = ops.integer_linear(x[:1], qtype, blocks, isa=isa)
    two = ops.integer_linear(x, qtype, blocks, isa=isa)
    assert torch.equal(one[0], two[0])


@pytest.mark.parametrize("qtype", QTYPES)
def test_dequantize_matches_gguf_dequantizer(qtype):
    rng = np.random.default_rng(1)
    k = 768 if qtype in K_TYPES else 160
    blocks = random_blocks(qtype, 11, k, rng)
    kind = GGML_TYPES[ops.QUANT_TYPES[qtype].ggml_id]
    expected = kind.dequantize(blocks.numpy().reshape(-1).view(kind.block)).reshape(11, k)
    assert np.allclose(ops.dequantize(qtype, blocks, k).numpy(), expected, rtol=1e-6, atol=1e-6)
    ids = torch.tensor([4, 0, 10, 4])
    assert np.allclose(
        ops.dequantize(qtype, blocks, k, ids).numpy(), expected[[4, 0, 10, 4]], rtol=1e-6, atol=1e-6
    )


@pytest.mark.parametrize("qtype", QTYPES)
def test_many_rows_path_equals_its_kernels_reference(cpu_isa, qtype):
    """More rows than the integer GEMV takes: the integer GEMM (quantized activations, so
    the block reference) where this CPU has it, else the float GEMM (the dequantized
    matmul, within summation order)."""
    rng = np.random.default_rng(2)
    k = ops.QUANT_TYPES[qtype].block_size * 4
    blocks = random_blocks(qtype, 40, k, rng)
    rows = ops.integer_max_rows(qtype) + 5
    x = torch.from_numpy(rng.standard_normal((rows, k)).astype(np.float32))
    y = ops.linear(x, qtype, blocks)
    if ops.kernel(qtype, rows) == "igemm":
        expected = torch.from_numpy(reference_linear(x.numpy(), qtype, blocks, k)).float()
        assert torch.allclose(y, expected, rtol=1e-4, atol=1e-4 * expected.abs().max())
        return
    assert ops.kernel(qtype, rows) == "gemm"
    expected = x @ ops.dequantize(qtype, blocks, k).T
    atol = 1e-5 * expected.abs().max()  # summation orders differ
    assert torch.allclose(y, expected, rtol=1e-5, atol=atol)


def test_kernel_by_rows_isa_and_format():
    assert ops.kernel("q4_1", 1, "avx512vnni") == "integer"
    assert ops.kernel("q4_1", ops.INTEGER_MAX_ROWS["avx512vnni"] + 1, "avx512vnni") == "igemm"
    assert ops.kernel("q4_0", ops.INTEGER_MAX_ROWS["avx2"], "avx2") == "integer"
    assert ops.kernel("q4_0", ops.INTEGER_MAX_ROWS["avx2"] + 1, "avx2") == "igemm"
    assert ops.kernel("q8_0", 64, "avx2") == "igemm"
    assert ops.kernel("q4_1", ops.INTEGER_MAX_ROWS["scalar"] + 1, "scalar") == "gemm"
    assert ops.kernel("q4_k", ops.K_INTEGER_MAX_ROWS + 1, "avx512vnni") == "gemm"
    assert ops.kernel("q4_k", 64, "avx2") == "gemm"


IGEMM_TYPES = [q for q in QTYPES if q not in K_TYPES]
# rows: within one group of 16, exactly one, one past, several; n off the tile (8) and the
# panel (32); k of one block or many
IGEMM_SHAPES = [
    (1, 7, 32),
    (15, 37, 96),
    (16, 32, 64),
    (17, 100, 576),
    (33, 8, 1536),
    (64, 96, 576),
    (70, 41, 160),
]


@pytest.fixture(params=ops.IGEMM_ISAS)
def igemm_isa(request) -> str:
    """Each variant of the integer GEMM (AVX2, AVX-512 VNNI), passed to it explicitly; one
    this CPU lacks is a skip that says so."""
    if request.param not in ops.available_isas():
        pytest.skip(f"this CPU lacks {request.param} (runs {ops.available_isas()})")
    return request.param


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("qtype,rows,n,k", [(q, *s) for q in IGEMM_TYPES for s in IGEMM_SHAPES])
def test_integer_gemm_matches_block_reference(igemm_isa, qtype, rows, n, k, with_bias):
    """The integer GEMM makes the GEMV's exact integer dot per block; only the order of the
    float sums of scaled blocks differs, so it agrees with the block reference and with the
    GEMV within float32 rounding."""
    rng = np.random.default_rng(rows * 31 + n + k)
    blocks = random_blocks(qtype, n, k, rng)
    x = torch.from_numpy(rng.standard_normal((rows, k)).astype(np.float32))
    bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32)) if with_bias else None
    y = ops.integer_gemm_linear(x, qtype, blocks, bias, igemm_isa)
    assert y.shape == (rows, n) and y.dtype == torch.float32
    expected = reference_linear(x.numpy(), qtype, blocks, k) + (0 if bias is None else bias.numpy())
    scale = np.abs(expected).max()
    assert np.allclose(y.numpy(), expected, rtol=1e-5, atol=1e-5 * scale), np.abs(
        y - expected
    ).max()
    gemv = ops.integer_linear(x, qtype, blocks, bias, isa=igemm_isa)
    assert torch.allclose(y, gemv, rtol=1e-5, atol=1e-5 * scale)
    dequantized = x @ ops.dequantize(qtype, blocks, k).T + (0 if bias is None else bias)
    assert torch.allclose(y, dequantized, rtol=1e-3, atol=1e-3 * scale)  # activations' rounding


def test_integer_gemm_variants_make_the_same_sums():
    """The AVX2 and AVX-512 VNNI variants: the same exact integer sums, scaled alike."""
    if ops.available_isas()[-1] != "avx512vnni":
        pytest.skip(f"needs both variants (this CPU runs {ops.available_isas()})")
    rng = np.random.default_rng(9)
    blocks = random_blocks("q4_0", 70, 320, rng)
    x = torch.from_numpy(rng.standard_normal((33, 320)).astype(np.float32))
    avx2 = ops.integer_gemm_linear(x, "q4_0", blocks, isa="avx2")
    vnni = ops.integer_gemm_linear(x, "q4_0", blocks, isa="avx512vnni")
    assert torch.allclose(avx2, vnni, rtol=1e-6, atol=1e-6 * vnni.abs().max())


def test_integer_gemm_is_the_same_on_any_thread_count(igemm_isa):
    """Each output is one sum in one order, whichever thread makes it (weight panels split
    over threads, or panels and row groups when the panels are few)."""
    rng = np.random.default_rng(7)
    blocks = random_blocks("q4_1", 70, 256, rng)
    x = torch.from_numpy(rng.standard_normal((70, 256)).astype(np.float32))
    threads = torch.get_num_threads()
    try:
        results = []
        for count in (1, 2, 3, 4):
            torch.set_num_threads(count)
            results.append(ops.integer_gemm_linear(x, "q4_1", blocks, isa=igemm_isa))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(results[0], r) for r in results[1:])


def test_integer_gemm_refuses_what_it_cannot_run():
    rng = np.random.default_rng(8)
    blocks = random_blocks("q4_k", 4, 256, rng)
    x = torch.zeros(20, 256)
    with pytest.raises(ValueError, match="AVX2 or AVX-512 VNNI and a 32-value format"):
        ops.integer_gemm_linear(x, "q4_k", blocks)
    q4 = random_blocks("q4_0", 4, 256, rng)
    with pytest.raises(ValueError, match="AVX2 or AVX-512 VNNI"):
        ops.integer_gemm_linear(x, "q4_0", q4, isa="scalar")


GEMM_SHAPES = [
    (1, 7, 32),
    (33, 37, 96),
    (7, 16, 64),
    (64, 48, 576),
    (13, 100, 1536),
    (513, 20, 160),
]
GEMM_K_SHAPES = [(1, 7, 256), (33, 37, 512), (64, 48, 768), (513, 20, 256)]
GEMM_CASES = [
    (q, *shape) for q in QTYPES for shape in (GEMM_K_SHAPES if q in K_TYPES else GEMM_SHAPES)
]


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("qtype,rows,n,k", GEMM_CASES)
def test_gemm_linear_equals_dequantized_matmul(cpu_isa, qtype, rows, n, k, with_bias):
    """Within float32 rounding of the sum of |x w| (the scale of each dot product's
    rounding error), on row counts off the microkernel's height, n off its width, k in
    one block or several."""
    rng = np.random.default_rng(rows * 7 + n + k)
    blocks = random_blocks(qtype, n, k, rng)
    x = torch.from_numpy(rng.standard_normal((rows, k)).astype(np.float32))
    bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32)) if with_bias else None
    w = ops.dequantize(qtype, blocks, k).double()
    expected = x.double() @ w.T + (0 if bias is None else bias.double())
    scale = x.double().abs() @ w.abs().T + (0 if bias is None else bias.double().abs())
    y = ops.gemm_linear(x, qtype, blocks, bias)
    assert y.shape == (rows, n) and y.dtype == torch.float32
    assert ((y.double() - expected).abs() <= 1e-5 * scale + 1e-30).all()


@pytest.mark.parametrize("qtype", ["q4_1", "q4_k"])
def test_gemm_linear_is_the_same_on_any_thread_count(cpu_isa, qtype):
    """Each output is one sum in one order, whichever thread makes it (weight groups split
    over threads, or groups and rows when the groups are few)."""
    rng = np.random.default_rng(6)
    k = 512
    blocks = random_blocks(qtype, 37, k, rng)
    x = torch.from_numpy(rng.standard_normal((70, k)).astype(np.float32))
    threads = torch.get_num_threads()
    try:
        results = []
        for count in (1, 2, 3, 4):
            torch.set_num_threads(count)
            results.append(ops.gemm_linear(x, qtype, blocks))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(results[0], r) for r in results[1:])


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
