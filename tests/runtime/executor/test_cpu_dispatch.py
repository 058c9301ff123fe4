"""Run-time CPU dispatch of the C kernels: one build for every CPU of the architecture
(nothing compiled for the build machine's own instruction set), each float kernel in one
variant per instruction set, the best one this CPU runs bound at load, and every variant
this CPU runs equal to the portable one and to torch."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from spruce.runtime.executor.kernels import cpu_layer_ops, cpu_library, cpu_quant_ops
from spruce.runtime.executor.kernels.cpu_attention import CpuDecodeAttention

pytestmark = pytest.mark.skipif(cpu_library.c_compiler() is None, reason="no C compiler here")


def test_build_flags_name_no_machine():
    """Every object is compiled for a named instruction set (or the baseline), none for
    -march=native (only -mtune, which picks no instructions); the float sources once per
    variant, under their own symbol suffix."""
    commands = cpu_library.compile_commands("cc", cpu_library.cache_dir())
    natives = {arg for command in commands for arg in command if "native" in arg}
    assert natives <= {"-mtune=native"}
    per_isa = [c for c in commands if any(a.startswith("-DSPRUCE_ISA=") for a in c)]
    assert len(per_isa) == len(cpu_library.ISA_FLAGS) * len(cpu_library.PER_ISA_SOURCES)
    assert len(commands) == len(per_isa) + len(cpu_library.ONCE_SOURCES)


def test_best_variant_bound_at_load_and_forced_by_the_environment():
    isas = cpu_library.available_isas()
    assert isas[0] == "portable"
    assert cpu_library.current_isa() in isas
    code = "from spruce.runtime.executor.kernels import cpu_library as c; print(c.current_isa())"
    for wanted, expected in (("portable", "portable"), ("no-such-isa", isas[-1]), ("", isas[-1])):
        env = {**os.environ, "SPRUCE_CPU_ISA": wanted}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        assert out.stdout.strip() == expected, out.stderr


def test_use_isa_rebinds_every_float_kernel(cpu_isa):
    lib = cpu_library.load_library()
    for name in cpu_library.PER_ISA_KERNELS:
        bound, variant = getattr(lib, name), getattr(lib, f"{name}_{cpu_isa}")
        assert ctypes_address(bound) == ctypes_address(variant)
    assert cpu_library.current_isa() == cpu_isa


def ctypes_address(fn) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


def run_layer_ops(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x, residual, weight = (
        torch.randn(5, 100, generator=g),
        torch.randn(5, 100, generator=g),
        torch.randn(100, generator=g),
    )
    gate_up = torch.randn(3, 2 * 40, generator=g) * 6
    qkv = torch.randn(4, 3 * 64, generator=g)
    angles = torch.randn(16, 32, generator=g)
    w, b = torch.randn(37, 70, generator=g), torch.randn(37, generator=g)
    normed, stream = cpu_layer_ops.rms_norm(x, weight, 1e-5, residual.clone())
    rotated = qkv.clone()
    cpu_layer_ops.rotary_(rotated, 2, 64, torch.tensor([0, 5, 15, 3]), angles.cos(), angles.sin())
    outputs = [
        normed,
        stream,
        cpu_layer_ops.silu_mul(gate_up),
        rotated,
        cpu_layer_ops.linear(x[:3, :70], w, b),
    ]
    wanted = [
        weight
        * ((x + residual) * torch.rsqrt((x + residual).pow(2).mean(-1, keepdim=True) + 1e-5)),
        x + residual,
        F.silu(gate_up[:, :40]) * gate_up[:, 40:],
        None,
        F.linear(x[:3, :70], w, b),
    ]
    for got, want in zip(outputs, wanted):
        if want is not None:
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    return outputs


def run_attention(seed: int, cache_dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    heads, kv_heads, dim, slots = 9, 3, 64, 300
    k_cache = torch.randn(slots, kv_heads, dim, generator=g).to(cache_dtype)
    v_cache = torch.randn(slots, kv_heads, dim, generator=g).to(cache_dtype)
    table = torch.randperm(slots, generator=g)[:200].int().reshape(2, 100)
    q = torch.randn(2, heads, dim, generator=g)
    rows, seq_lens = torch.tensor([1, 0]), torch.tensor([37, 100])
    out = CpuDecodeAttention()(q, k_cache, v_cache, table, rows, seq_lens, dim**-0.5)
    k, v = k_cache.float().repeat_interleave(3, dim=1), v_cache.float().repeat_interleave(3, dim=1)
    for b in range(2):
        slot = table[rows[b], : seq_lens[b]].long()
        scores = torch.einsum("hd,lhd->hl", q[b], k[slot]) * dim**-0.5
        want = torch.einsum("hl,lhd->hd", scores.softmax(-1), v[slot])
        torch.testing.assert_close(out[b], want, atol=1e-5, rtol=1e-5)
    return out


def test_every_variant_equals_torch_and_the_portable_one(cpu_isa):
    """Each kernel on variant `cpu_isa` equals torch's formula and, within float rounding
    (vector widths change summation orders), the portable variant's result."""
    ours = run_layer_ops(1) + [run_attention(2, torch.float32), run_attention(3, torch.float16)]
    cpu_library.use_isa("portable")
    portable = run_layer_ops(1) + [run_attention(2, torch.float32), run_attention(3, torch.float16)]
    for got, want in zip(ours, portable):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_quantized_kernels_follow_the_bound_variant(cpu_isa):
    """The integer kernels' default is the best this CPU runs up to the bound float variant
    (portable: scalar, avx2: AVX2, avx512: AVX512-VNNI where the CPU has it), so forcing a
    variant (use_isa, SPRUCE_CPU_ISA) forces the quantized path too."""
    cap = cpu_library.FLOAT_ISAS.index(cpu_isa)
    expected = cpu_quant_ops.ISAS[min(cap, len(cpu_quant_ops.available_isas()) - 1)]
    assert cpu_quant_ops.best_isa() == expected
    g = torch.Generator().manual_seed(8)
    blocks = torch.randint(0, 256, (16, 96 // 32 * 20), dtype=torch.uint8, generator=g)
    halves = blocks.view(torch.float16)  # q4_1 blocks of 20 bytes: fp16 scale and minimum first
    halves[:, 0::10], halves[:, 1::10] = 0.01, -0.05
    x = torch.randn(3, 96, generator=g)
    forced = cpu_quant_ops.integer_linear(x, "q4_1", blocks, isa=expected)
    assert torch.equal(cpu_quant_ops.linear(x, "q4_1", blocks), forced)
