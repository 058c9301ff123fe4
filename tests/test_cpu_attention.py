"""The C decode-attention kernel equals a torch reference (gather + softmax)."""

from __future__ import annotations

import pytest
import torch

from spruce.runtime.kernels.cpu_attention import CpuDecodeAttention


def reference(q, k_cache, v_cache, table, rows, seq_lens, scale):
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[1]
    for b in range(q.shape[0]):
        slots = table[rows[b], : seq_lens[b]].long()
        k = k_cache[slots].repeat_interleave(group, dim=1)  # [L, H, D]
        v = v_cache[slots].repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[b], k) * scale
        out[b] = torch.einsum("hl,lhd->hd", scores.softmax(-1), v)
    return out


@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 4, 16), (9, 3, 64), (8, 2, 128), (6, 3, 80), (16, 1, 96)])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_matches_reference(heads, kv_heads, dim, threads, cache_dtype):
    torch.set_num_threads(threads)
    kernel = CpuDecodeAttention()
    if not kernel.available:
        pytest.skip("no C compiler here")
    g = torch.Generator().manual_seed(heads * dim)
    slots_total, batch = 600, 5
    k_cache = torch.randn(slots_total, kv_heads, dim, generator=g)
    v_cache = torch.randn(slots_total, kv_heads, dim, generator=g)
    seq_lens = torch.tensor([1, 31, 32, 33, 170])
    table = torch.zeros(8, 200, dtype=torch.int32)
    rows = torch.tensor([6, 0, 3, 1, 5])
    for row in rows:  # shuffled slots, different for every request
        table[row] = (torch.randperm(slots_total - 1, generator=g)[:200] + 1).int()
    q = torch.randn(batch, heads, dim, generator=g)
    k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    got = kernel(q, k_cache, v_cache, table, rows, seq_lens, dim**-0.5)
    want = reference(q, k_cache.float(), v_cache.float(), table, rows, seq_lens, dim**-0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_rejects_unsupported_shape():
    kernel = CpuDecodeAttention()
    if not kernel.available:
        pytest.skip("no C compiler here")
    q = torch.zeros(1, 4, 40)
    cache = torch.zeros(4, 4, 40)
    with pytest.raises(ValueError, match="unsupported shape"):
        kernel(q, cache, cache, torch.zeros(1, 4, dtype=torch.int32), torch.tensor([0]), torch.tensor([1]), 1.0)
