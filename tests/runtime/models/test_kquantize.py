"""Our Q4_K / Q6_K quantizers (loading/quantize.py) against our two dequantizers (numpy's in
gguf_quant.py and the C kernels' cpu_quant_ops.dequantize): small error for 4 and 6 bits,
every byte field in range, and, where llama.cpp's llama-quantize is found, an error no
larger than llama.cpp's own on the same tensors."""

from __future__ import annotations

import os
import shutil
import subprocess

import numpy as np
import pytest
import torch

from spruce.runtime.errors import ModelLoadError
from spruce.runtime.executor.kernels import cpu_quant_ops
from spruce.runtime.executor.kernels.cpu_quant_ops import QUANT_TYPES
from spruce.runtime.models.loading.gguf_quant import GGML_TYPES, _k_scales_mins
from spruce.runtime.models.loading.quantize import quantize, quantize_rows

# relative RMS error bounds for normal data: llama.cpp's Q4_K reaches ~0.072, Q6_K ~0.018
BOUNDS = {"q4_k": 0.085, "q6_k": 0.022}
needs_kernels = pytest.mark.skipif(not cpu_quant_ops.available(), reason="no C kernels")


def blocks_of(raw: np.ndarray, qtype: str) -> np.ndarray:
    return raw.reshape(-1).view(GGML_TYPES[QUANT_TYPES[qtype].ggml_id].block)


def numpy_dequantize(raw: np.ndarray, qtype: str, shape: tuple[int, int]) -> np.ndarray:
    kind = GGML_TYPES[QUANT_TYPES[qtype].ggml_id]
    return np.asarray(kind.dequantize(blocks_of(raw, qtype))).reshape(shape)


def relative_rms(x: np.ndarray, y: np.ndarray) -> float:
    return float(np.sqrt(np.mean((x - y) ** 2) / np.mean(x**2)))


def weights(rows: int = 48, cols: int = 1024, seed: int = 0) -> np.ndarray:
    """Normal rows at several scales, one row with a far outlier, one all zeros, one constant
    and one all positive (a K block's min is then 0)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols), dtype=np.float32)
    x *= np.geomspace(1e-3, 10, rows, dtype=np.float32)[:, None]
    x[1, 7] = 500.0
    x[2] = 0.0
    x[3] = 0.25
    x[4] = np.abs(x[4]) + 1.0
    return x


@pytest.mark.parametrize("qtype", ["q4_k", "q6_k"])
@pytest.mark.parametrize("search", [True, False])
def test_error_is_small_and_both_dequantizers_agree(qtype, search):
    x = weights()
    raw = quantize_rows(x, qtype, search=search)
    assert raw.shape == (48, cpu_quant_ops.row_bytes(qtype, 1024)) and raw.dtype == np.uint8
    y = numpy_dequantize(raw, qtype, x.shape)
    normal = [i for i in range(5, 48)]  # the plain normal rows
    assert relative_rms(x[normal], y[normal]) < BOUNDS[qtype]
    for i in normal:  # every scale alike: each row's error relative to its own size
        assert relative_rms(x[i], y[i]) < 1.5 * BOUNDS[qtype]
    assert np.all(y[2] == 0)
    assert np.abs(y[3] - 0.25).max() < 0.25 * (0.02 if qtype == "q4_k" else 0.005)
    assert abs(y[1, 7] - 500.0) < 500.0 * 0.05  # the outlier keeps its size
    if cpu_quant_ops.available():
        c = cpu_quant_ops.dequantize(qtype, torch.from_numpy(raw), 1024).numpy()
        np.testing.assert_allclose(c, y, rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("qtype", ["q4_k", "q6_k"])
def test_the_search_helps_and_k_formats_beat_their_32_value_peers(qtype):
    x = np.random.default_rng(1).standard_normal((64, 2048), dtype=np.float32) * 0.02
    searched = relative_rms(x, numpy_dequantize(quantize_rows(x, qtype), qtype, x.shape))
    plain = relative_rms(x, numpy_dequantize(quantize_rows(x, qtype, search=False), qtype, x.shape))
    assert searched < plain
    peer = "q4_0" if qtype == "q4_k" else "q8_0"  # Q6_K: 6.6 bits against Q8_0's 8.5
    theirs = relative_rms(x, quantize(torch.from_numpy(x), peer).dequantize().numpy())
    assert searched < theirs if qtype == "q4_k" else searched < 5 * theirs


def test_q4_k_fields_are_in_range():
    x = weights()
    b = blocks_of(quantize_rows(x, "q4_k"), "q4_k")
    d, dmin = b["d"].astype(np.float32), b["dmin"].astype(np.float32)
    assert np.all(np.isfinite(d)) and np.all(d >= 0) and np.all(np.isfinite(dmin))
    assert np.all(dmin >= 0)
    scales, mins = _k_scales_mins(b["scales"])
    assert scales.max() == 63 and mins.max() == 63  # each block's largest uses all 6 bits
    assert scales.min() >= 0 and mins.min() >= 0
    # the low and high nibbles both carry values: 0 and 15 each occur
    assert {0, 15} <= set(np.unique(b["qs"] & 15)) and {0, 15} <= set(np.unique(b["qs"] >> 4))


def test_q6_k_fields_are_in_range():
    x = weights()
    b = blocks_of(quantize_rows(x, "q6_k"), "q6_k")
    d = b["d"].astype(np.float32)
    assert np.all(np.isfinite(d))
    live = np.any(b["scales"] != 0, axis=1)  # the zero row's blocks are all zeros
    assert np.all(
        np.abs(b["scales"][live].astype(np.int16)).max(axis=1) >= 127
    )  # the largest uses 8 bits
    assert np.all(b["ql"][~live] == 0) and np.all(b["qh"][~live] == 0)
    y = numpy_dequantize(b.view(np.uint8), "q6_k", x.shape)
    step = d.repeat(16) * b["scales"].reshape(-1).astype(np.float32)
    used = step != 0
    q = np.rint(y.reshape(-1, 16)[used] / step[used, None])
    assert q.min() >= -32 and q.max() <= 31  # 6-bit values after the offset


def test_quantize_keeps_the_tensor_shape_and_names_the_block_size():
    w = torch.randn(8, 512) * 0.02
    q = quantize(w, "q6_k")
    assert q.qtype == "q6_k" and q.shape == (8, 512) and q.blocks.shape == (8, 2 * 210)
    if cpu_quant_ops.available():
        assert relative_rms(w.numpy(), q.dequantize().numpy()) < BOUNDS["q6_k"]
    with pytest.raises(ModelLoadError, match="rows of 576 values to q4_k .blocks of 256"):
        quantize(torch.zeros(4, 576), "q4_k")


# -- against llama.cpp's llama-quantize on the same tensors --------------------------------

LLAMA_CPP_BIN = os.environ.get("LLAMA_CPP_BIN", "/tmp/lcpp/build/bin")


def llama_quantize() -> str | None:
    return shutil.which("llama-quantize", path=LLAMA_CPP_BIN + os.pathsep + os.environ["PATH"])


@pytest.mark.skipif(llama_quantize() is None, reason="llama.cpp's llama-quantize not found")
@pytest.mark.parametrize("qtype", ["q4_k", "q6_k"])
def test_error_no_larger_than_llama_cpp_on_the_same_tensors(tmp_path, qtype):
    """A tiny-shape F32 file quantized by llama-quantize (--pure: every matrix in the type)
    and the same float tensors by ours: the errors within 2% of each other, and most
    bytes identical (both follow llama.cpp's reference rounding)."""
    from spruce.runtime.bench.shapes import write_model
    from spruce.runtime.models.loading.gguf import read_gguf

    source, target = tmp_path / "f32.gguf", tmp_path / f"{qtype}.gguf"
    write_model("tiny", "F32", source)
    subprocess.run(
        [llama_quantize(), "--pure", str(source), str(target), qtype.upper()],
        check=True, capture_output=True,
    )  # fmt: skip
    floats, theirs = read_gguf(source), read_gguf(target)
    for name in ("blk.0.attn_q.weight", "blk.1.ffn_down.weight", "token_embd.weight"):
        x = floats.tensor(name, torch.float32).numpy()
        info = theirs.tensors[name]
        assert info.ggml_type.name == qtype.upper()
        their_raw = theirs.blocks(name).numpy().reshape(x.shape[0], -1)
        our_raw = quantize_rows(x, qtype)
        ours = relative_rms(x, numpy_dequantize(our_raw, qtype, x.shape))
        their = relative_rms(x, numpy_dequantize(their_raw, qtype, x.shape))
        assert ours < 1.02 * their, (name, ours, their)
        assert np.mean(our_raw == their_raw) > 0.95
