"""The C decode-attention kernel equals a torch reference (gather + softmax), on every
float-kernel variant this CPU runs (the `cpu_isa` fixture)."""

from __future__ import annotations

import pytest
import torch

from spruce.runtime.executor.kernels.cpu_attention import CpuDecodeAttention
from spruce.runtime.executor.kernels.cpu_library import c_compiler
from spruce.runtime.executor.kv_pool import dequantize_int8, quantize_int8

CACHE_DTYPES = [torch.float32, torch.float16, torch.int8]


def to_cache(k, v, dtype):
    """(k_cache, v_cache, scales, k_read, v_read): float K/V [S, KH, D] in a pool's dtype,
    the int8 pool's scales (else None), and the float values the kernel should read."""
    if dtype != torch.int8:
        k, v = k.to(dtype), v.to(dtype)
        return k, v, None, k.float(), v.float()
    (kq, ks), (vq, vs) = quantize_int8(k), quantize_int8(v)
    return (
        kq,
        vq,
        (ks, vs),
        dequantize_int8(kq, ks, torch.float32),
        dequantize_int8(vq, vs, torch.float32),
    )


def reference(q, k_cache, v_cache, table, rows, seq_lens, scale, window=None):
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[1]
    for b in range(q.shape[0]):
        first = 0 if window is None else max(0, int(seq_lens[b]) - window)
        slots = table[rows[b], first : seq_lens[b]].long()
        k = k_cache[slots].repeat_interleave(group, dim=1)  # [L, H, D]
        v = v_cache[slots].repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[b], k) * scale
        out[b] = torch.einsum("hl,lhd->hd", scores.softmax(-1), v)
    return out


def built_kernel() -> CpuDecodeAttention:
    """The kernel; where a C compiler exists, a failed build is a failure, not a skip."""
    if c_compiler() is None:
        pytest.skip("no C compiler here")
    kernel = CpuDecodeAttention()
    assert kernel.available, "the C kernel failed to build (see the logged compiler error)"
    return kernel


@pytest.fixture
def kernel(cpu_isa) -> CpuDecodeAttention:
    """The kernel on each variant of the float kernels this CPU runs (portable, avx2, avx512)."""
    return built_kernel()


@pytest.mark.parametrize(
    "heads,kv_heads,dim",
    [(4, 4, 16), (9, 3, 64), (8, 2, 128), (6, 3, 80), (16, 1, 96), (14, 2, 64), (28, 4, 128)],
)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_matches_reference(kernel, heads, kv_heads, dim, threads, cache_dtype):
    torch.set_num_threads(threads)
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
    k_cache, v_cache, scales, k_read, v_read = to_cache(k_cache, v_cache, cache_dtype)
    got = kernel(q, k_cache, v_cache, table, rows, seq_lens, dim**-0.5, scales=scales)
    want = reference(q, k_read, v_read, table, rows, seq_lens, dim**-0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_stores_new_tokens_then_attends(kernel, cache_dtype):
    """With new_kv, each request's new K/V lands in its slot (as the pool's dtype; int8
    exactly as the pool's own quantization) and is attended as the last token; q, k and v
    may be strided column blocks of one matrix."""
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, batch = 9, 3, 64, 4
    k_cache, v_cache, scales, _, _ = to_cache(
        torch.randn(300, kv_heads, dim, generator=g),
        torch.randn(300, kv_heads, dim, generator=g),
        cache_dtype,
    )
    seq_lens = torch.tensor([1, 17, 40, 5])
    table = (torch.randperm(299, generator=g)[:200] + 1).int().view(4, 50)
    rows = torch.tensor([2, 0, 3, 1])
    new_slots = table[rows, seq_lens - 1].long()
    qkv = torch.randn(batch, (heads + 2 * kv_heads) * dim, generator=g)
    q = qkv[:, : heads * dim].view(batch, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(batch, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim :].view(batch, kv_heads, dim)
    want = [t.clone() for t in (k_cache, v_cache, *(scales or ()))]
    if scales is None:
        want[0][new_slots], want[1][new_slots] = k.to(cache_dtype), v.to(cache_dtype)
    else:
        (want[0][new_slots], want[2][new_slots]), (want[1][new_slots], want[3][new_slots]) = map(
            quantize_int8, (k, v)
        )
    got = kernel(
        q,
        k_cache,
        v_cache,
        table,
        rows,
        seq_lens,
        dim**-0.5,
        new_kv=(k, v, new_slots),
        scales=scales,
    )
    assert all(torch.equal(a, b) for a, b in zip((k_cache, v_cache, *(scales or ())), want))
    k_read, v_read = (
        (want[0].float(), want[1].float())
        if scales is None
        else (
            dequantize_int8(want[0], want[2], torch.float32),
            dequantize_int8(want[1], want[3], torch.float32),
        )
    )
    want = reference(q, k_read, v_read, table, rows, seq_lens, dim**-0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_rejects_unsupported_shape():
    kernel = built_kernel()
    q = torch.zeros(1, 4, 40)
    cache = torch.zeros(4, 4, 40)
    with pytest.raises(ValueError, match="unsupported shape"):
        kernel(
            q,
            cache,
            cache,
            torch.zeros(1, 4, dtype=torch.int32),
            torch.tensor([0]),
            torch.tensor([1]),
            1.0,
        )


def test_bfloat16_activations_are_computed_in_float32(kernel):
    """A bfloat16 model on the CPU with a float16 cache: q/k/v are widened, the output
    comes back in bfloat16."""
    g = torch.Generator().manual_seed(1)
    k_cache = torch.randn(100, 3, 64, generator=g).half()
    v_cache = torch.randn(100, 3, 64, generator=g).half()
    table = torch.arange(100, dtype=torch.int32).view(2, 50)
    rows, seq_lens = torch.tensor([0, 1]), torch.tensor([20, 50])
    q = torch.randn(2, 9, 64, generator=g).bfloat16()
    k, v = (
        torch.randn(2, 3, 64, generator=g).bfloat16(),
        torch.randn(2, 3, 64, generator=g).bfloat16(),
    )
    slots = torch.tensor([19, 99])
    got = kernel(q, k_cache, v_cache, table, rows, seq_lens, 0.125, new_kv=(k, v, slots))
    assert got.dtype == torch.bfloat16
    assert torch.equal(k_cache[slots], k.half()) and torch.equal(v_cache[slots], v.half())
    want = reference(q.float(), k_cache.float(), v_cache.float(), table, rows, seq_lens, 0.125)
    torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("window", [1, 16, 40, 500])
def test_sliding_window_reads_the_last_tokens_only(kernel, window):
    """Window 1 (the token itself), inside a block, across blocks, beyond every sequence."""
    g = torch.Generator().manual_seed(window)
    k_cache, v_cache = torch.randn(400, 2, 64, generator=g), torch.randn(400, 2, 64, generator=g)
    table = (torch.randperm(399, generator=g)[:300] + 1).int().reshape(3, 100)
    rows, seq_lens = torch.tensor([2, 0, 1]), torch.tensor([1, 45, 100])
    q = torch.randn(3, 8, 64, generator=g)
    got = kernel(q, k_cache, v_cache, table, rows, seq_lens, 0.125, window=window)
    torch.testing.assert_close(
        got,
        reference(q, k_cache, v_cache, table, rows, seq_lens, 0.125, window),
        atol=1e-5,
        rtol=1e-5,
    )


# (heads, kv_heads, dim): the specialized shapes (group 1, 3, 4, 6, 7 at head_dim 64 and 128),
# run-time shapes (group 2, head_dim 16, 96), and groups above one pass's 16 heads
SHAPES = [(4, 4, 64), (9, 3, 64), (8, 2, 64), (14, 2, 64), (4, 4, 128), (12, 4, 128), (8, 2, 128)]
SHAPES += [
    (24, 4, 128),
    (28, 4, 128),
    (6, 3, 16),
    (4, 2, 96),
    (16, 1, 64),
    (20, 1, 64),
    (40, 2, 32),
]


@pytest.mark.parametrize("heads,kv_heads,dim", SHAPES)
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_every_variant_every_shape(kernel, heads, kv_heads, dim, cache_dtype):
    """Sequence lengths around the 16-token block (1, 15, 16, 17, 47) and longer, with a
    sliding window inside a block, across blocks and beyond the sequence."""
    g = torch.Generator().manual_seed(heads * 1000 + dim)
    slots_total = 800
    seq_lens = torch.tensor([1, 15, 16, 17, 47, 150])
    batch = len(seq_lens)
    k_cache, v_cache, scales, k_read, v_read = to_cache(
        torch.randn(slots_total, kv_heads, dim, generator=g),
        torch.randn(slots_total, kv_heads, dim, generator=g),
        cache_dtype,
    )
    table = torch.stack(
        [torch.randperm(slots_total, generator=g)[:160] for _ in range(batch)]
    ).int()
    rows = torch.randperm(batch, generator=g)
    q = torch.randn(batch, heads, dim, generator=g)
    for window in (None, 5, 20, 500):
        got = kernel(
            q, k_cache, v_cache, table, rows, seq_lens, dim**-0.5, window=window, scales=scales
        )
        want = reference(q, k_read, v_read, table, rows, seq_lens, dim**-0.5, window)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_rising_scores_rescale_exactly(kernel, cache_dtype):
    """Scores that climb block after block (and one outlier late) move the softmax's
    reference max many times: the rescaled accumulators still give the reference. 1200
    tokens take several L2-sized spans in every cache dtype (the softmax goes on across
    them)."""
    g = torch.Generator().manual_seed(7)
    heads, kv_heads, dim, length = 9, 3, 64, 1200
    q = torch.randn(2, heads, dim, generator=g)
    growth = torch.linspace(0.0, 6.0, length).view(length, 1, 1)  # scores up to ~6x, past the slack
    k_cache = torch.randn(length, kv_heads, dim, generator=g) * (1 + growth)
    k_cache[1000] *= 4
    k_cache, v_cache, scales, k_read, v_read = to_cache(
        k_cache, torch.randn(length, kv_heads, dim, generator=g), cache_dtype
    )
    table = torch.stack([torch.arange(length), torch.arange(length).flip(0)]).int()
    rows, seq_lens = torch.tensor([0, 1]), torch.tensor([length, 1190])
    got = kernel(q, k_cache, v_cache, table, rows, seq_lens, 1.0, scales=scales)
    want = reference(q, k_read, v_read, table, rows, seq_lens, 1.0)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (8, 2, 128), (16, 1, 64), (28, 4, 128)])
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_one_request_is_split_by_kv_heads_exactly(kernel, heads, kv_heads, dim, cache_dtype):
    """With fewer requests than threads each request's kv heads are work items of their own
    (their new K/V stored, their spans staged, their heads normalized by the thread that
    takes them): the output and the stored K/V are the one-thread call's bit for bit, and
    the reference's, with and without a window and across several L2 spans."""
    g = torch.Generator().manual_seed(heads + dim)
    k, v = torch.randn(1, kv_heads, dim, generator=g), torch.randn(1, kv_heads, dim, generator=g)
    q = torch.randn(1, heads, dim, generator=g)
    table = (torch.randperm(2999, generator=g)[:2500] + 1).int().view(1, 2500)
    rows = torch.tensor([0])
    for length, window in ((1, None), (37, None), (37, 20), (2500, None)):
        seq_lens = torch.tensor([length])
        slots = table[0, length - 1 : length].long()
        results = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            g.manual_seed(length)
            k_cache, v_cache, scales, _, _ = to_cache(
                torch.randn(3000, kv_heads, dim, generator=g),
                torch.randn(3000, kv_heads, dim, generator=g),
                cache_dtype,
            )
            got = kernel(q, k_cache, v_cache, table, rows, seq_lens, dim**-0.5, new_kv=(k, v, slots),
                         window=window, scales=scales)  # fmt: skip
            results.append((got, k_cache, v_cache, *(scales or ())))
        assert all(torch.equal(a, b) for a, b in zip(*results))
        _, k_cache, v_cache, *scales = results[1]
        k_read, v_read = (
            (k_cache.float(), v_cache.float())
            if not scales
            else (dequantize_int8(k_cache, scales[0], torch.float32),
                  dequantize_int8(v_cache, scales[1], torch.float32))
        )  # fmt: skip
        want = reference(q, k_read, v_read, table, rows, seq_lens, dim**-0.5, window)
        torch.testing.assert_close(results[1][0], want, atol=1e-5, rtol=1e-5)
