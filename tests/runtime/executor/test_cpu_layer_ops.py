"""The C per-layer operations equal transformers' torch formulas, on every instruction-set
variant this CPU runs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from spruce.runtime.executor.kernels import cpu_layer_ops


@pytest.fixture(autouse=True)
def built(cpu_isa):
    """Every test on each variant (`cpu_isa`); the kernels usable on it."""
    assert cpu_layer_ops.usable(torch.zeros(1)), (
        "the C kernels failed to build (see the logged compiler error)"
    )


def hf_rms_norm(x, weight, eps):
    variance = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + eps))


# rows x dim: a decode batch, a dim that is not a multiple of 16, and a prefill large
# enough to run on several threads
SHAPES = [(64, 576), (3, 100), (700, 576)]


@pytest.mark.parametrize("rows,dim", SHAPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(rows, dim, with_residual):
    g = torch.Generator().manual_seed(rows)
    x, weight = torch.randn(rows, dim, generator=g) * 3, torch.randn(dim, generator=g)
    residual = torch.randn(rows, dim, generator=g) if with_residual else None
    stream = x + residual if with_residual else x
    want = hf_rms_norm(stream, weight, 1e-5)
    got, got_stream = cpu_layer_ops.rms_norm(
        x, weight, 1e-5, None if residual is None else residual.clone()
    )
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    assert torch.equal(got_stream, stream)


@pytest.mark.parametrize("rows,inter", [(64, 1536), (5, 40), (200, 1536)])
def test_silu_mul(rows, inter):
    g = torch.Generator().manual_seed(inter)
    gate_up = torch.randn(rows, 2 * inter, generator=g) * 6
    gate_up[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -0.0])  # saturated and zero inputs
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(
        cpu_layer_ops.silu_mul(gate_up), F.silu(gate) * up, atol=1e-6, rtol=1e-5
    )


@pytest.mark.parametrize("rows", [7, 3000])
def test_rotary_in_place_on_strided_rows(rows):
    heads, kv_heads, dim = 9, 3, 64
    g = torch.Generator().manual_seed(rows)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=g)
    angles = torch.randn(4096, dim // 2, generator=g)
    cos, sin = angles.cos(), angles.sin()
    positions = torch.randint(0, 4096, (rows,), generator=g)
    qk = qkv[:, : (heads + kv_heads) * dim].reshape(rows, heads + kv_heads, dim)
    c, s = cos[positions][:, None, :], sin[positions][:, None, :]
    x1, x2 = qk[..., : dim // 2], qk[..., dim // 2 :]
    want = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    v_before = qkv[:, (heads + kv_heads) * dim :].clone()
    cpu_layer_ops.rotary_(qkv, heads + kv_heads, dim, positions, cos, sin)
    assert torch.equal(qkv[:, : (heads + kv_heads) * dim].view(rows, heads + kv_heads, dim), want)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim :], v_before)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (7, 33)])
def test_linear_few_rows(rows, n, k):
    """Up to 4 rows go through the C kernel (5 through torch); with and without a bias."""
    g = torch.Generator().manual_seed(n + k + rows)
    x, w, b = (
        torch.randn(rows, k, generator=g),
        torch.randn(n, k, generator=g),
        torch.randn(n, generator=g),
    )
    for bias in (None, b):
        torch.testing.assert_close(
            cpu_layer_ops.linear(x, w, bias), F.linear(x, w, bias), atol=1e-4, rtol=1e-5
        )


@pytest.mark.parametrize("rows,n", [(1, 49152), (3, 17), (64, 5000)])
def test_argmax_rows_is_torchs(rows, n):
    """torch.argmax's choice on every row: ties go to the first, a NaN wins (the first of
    several), +inf wins, a row all -inf gives 0; and the value at that id. 64 x 5000 runs on
    several threads."""
    g = torch.Generator().manual_seed(rows * n)
    x = torch.randint(-3, 4, (rows, n), generator=g).float()  # many ties
    x[0, n // 2] = 10.0
    x[0, n - 1] = 10.0  # a tie with a later id
    if rows > 1:
        x[1, min(5, n - 1)] = float("nan")
        x[1, n - 1] = float("nan")
        x[1, 0] = float("inf")
        x[2] = float("-inf")
    if rows > 3:
        x[3, n - 1] = float("inf")
        x[4, :10] = float("nan")
    ids, values = cpu_layer_ops.argmax_rows(x)
    want = x.argmax(dim=-1)
    assert torch.equal(ids, want)
    assert torch.equal(values.isnan(), x.gather(1, want[:, None])[:, 0].isnan())
    finite = ~values.isnan()
    assert torch.equal(values[finite], x.gather(1, want[:, None])[:, 0][finite])
