"""Triton kernels against plain-torch references.

Without CUDA the kernels run under the triton interpreter (TRITON_INTERPRET=1, set before
triton is imported), on small shapes. With CUDA the same tests run compiled on the GPU, and
the `gpu` tests add realistic sizes.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    if "triton" in sys.modules:  # its own jit helpers (tl.zeros, ...) are compiled-mode now
        pytest.skip(
            "triton was imported before TRITON_INTERPRET=1 was set; set it in conftest.py "
            "or run this file alone",
            allow_module_level=True,
        )
    os.environ["TRITON_INTERPRET"] = "1"  # read when a kernel is decorated
pytest.importorskip("triton")

from spruce.runtime.executor.kernels import triton_attention as attention  # noqa: E402
from spruce.runtime.executor.kernels import triton_bitmask as bitmask_kernels  # noqa: E402

DEVICE = "cuda" if HAS_CUDA else "cpu"
gpu = pytest.mark.gpu
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")

ATOL = {torch.float32: 1e-4 if HAS_CUDA else 2e-5, torch.float16: 4e-3, torch.bfloat16: 2.5e-2}


# ----------------------------------------------------------------------------- KV layout


class PagedKV:
    """A KV cache and request-to-token table in the runtime's layout, with shuffled slots.

    Every slot no request owns (the padding slot 0 included) holds NaN, and each table row
    points past its sequence at such slots: a kernel that reads outside a request's context
    poisons its output."""

    def __init__(self, seq_lens, kv_heads, head_dim, dtype, device=DEVICE, spare_rows=3, seed=0):
        gen = torch.Generator().manual_seed(seed)
        total = sum(seq_lens)
        num_slots = 1 + total + 64
        self.k_cache = torch.full((num_slots, kv_heads, head_dim), float("nan"), dtype=dtype)
        self.v_cache = torch.full((num_slots, kv_heads, head_dim), float("nan"), dtype=dtype)
        order = torch.randperm(num_slots - 1, generator=gen) + 1
        owned, unowned = order[:total], order[total:]
        self.k_cache[owned] = torch.randn(total, kv_heads, head_dim, generator=gen).to(dtype)
        self.v_cache[owned] = torch.randn(total, kv_heads, head_dim, generator=gen).to(dtype)
        max_context = max(seq_lens, default=0) + 8
        num_rows = len(seq_lens) + spare_rows
        pick = torch.randint(0, unowned.numel(), (num_rows, max_context), generator=gen)
        self.req_to_token = unowned[pick].to(torch.int32)
        rows = torch.randperm(num_rows, generator=gen)[: len(seq_lens)]
        starts = [0] + torch.tensor(seq_lens).cumsum(0).tolist()
        for b, row in enumerate(rows.tolist()):
            self.req_to_token[row, : seq_lens[b]] = owned[starts[b] : starts[b + 1]].to(torch.int32)
        self.req_pool_indices = rows.to(torch.int64)
        for name in ("k_cache", "v_cache", "req_to_token", "req_pool_indices"):
            setattr(self, name, getattr(self, name).to(device))

    def context(self, b: int, length: int):
        """K and V [length, kv_heads, head_dim] of request b's first `length` positions."""
        slots = self.req_to_token[self.req_pool_indices[b], :length].long()
        return self.k_cache[slots], self.v_cache[slots]


def attend(q, k, v, sm_scale, mask=None, softcap=None):
    """q [M, H, D], k/v [L, KVH, D], mask [M, L] True = visible -> [M, H, D] in fp32."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("mhd,lhd->hml", q.float(), k) * sm_scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hml,lhd->mhd", scores.softmax(-1), v)


def reference_decode(q, kv: PagedKV, seq_lens, sm_scale):
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for b, length in enumerate(seq_lens):
        if length:
            out[b] = attend(q[b : b + 1], *kv.context(b, length), sm_scale)[0]
    return out


def reference_extend(q, kv: PagedKV, prefix_lens, extend_lens, sm_scale):
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    start = 0
    for b, (prefix, new) in enumerate(zip(prefix_lens, extend_lens)):
        positions = torch.arange(prefix, prefix + new, device=q.device)
        mask = torch.arange(prefix + new, device=q.device)[None, :] <= positions[:, None]
        rows = slice(start, start + new)
        out[rows] = attend(q[rows], *kv.context(b, prefix + new), sm_scale, mask)
        start += new
    return out


def packed_q(num_tokens, num_heads, kv_heads, head_dim, dtype, seed=1):
    """q as the q part of a fused qkv projection: strided rows, contiguous head_dim."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(num_tokens, num_heads + 2 * kv_heads, head_dim, generator=gen).to(dtype)
    return qkv.to(DEVICE)[:, :num_heads]


def lens_tensor(values):
    return torch.tensor(values, dtype=torch.int64, device=DEVICE)


def run_decode(seq_lens, kv_heads, group, head_dim, dtype, num_kv_splits, **hints):
    kv = PagedKV(seq_lens, kv_heads, head_dim, dtype)
    q = packed_q(len(seq_lens), kv_heads * group, kv_heads, head_dim, dtype)
    o = torch.full(q.shape, float("nan"), dtype=dtype, device=DEVICE)
    scale = head_dim**-0.5
    attention.decode_attention(
        q,
        kv.k_cache,
        kv.v_cache,
        o,
        kv.req_to_token,
        kv.req_pool_indices,
        lens_tensor(seq_lens),
        scale,
        num_kv_splits=num_kv_splits,
        **hints,
    )
    return o, reference_decode(q, kv, seq_lens, scale)


def run_extend(prefix_lens, extend_lens, kv_heads, group, head_dim, dtype, **hints):
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    kv = PagedKV(seq_lens, kv_heads, head_dim, dtype)
    q = packed_q(sum(extend_lens), kv_heads * group, kv_heads, head_dim, dtype)
    o = torch.full(q.shape, float("nan"), dtype=dtype, device=DEVICE)
    starts = [0] + torch.tensor(extend_lens).cumsum(0).tolist()[:-1]
    scale = head_dim**-0.5
    attention.extend_attention(
        q,
        o,
        kv.k_cache,
        kv.v_cache,
        kv.req_to_token,
        kv.req_pool_indices,
        lens_tensor(prefix_lens),
        lens_tensor(extend_lens),
        lens_tensor(starts),
        scale,
        **hints,
    )
    return o, reference_extend(q, kv, prefix_lens, extend_lens, scale)


def assert_close(actual, expected, dtype):
    assert not actual.isnan().any(), "the kernel read outside the context or left rows unset"
    torch.testing.assert_close(actual.float(), expected, atol=ATOL[dtype], rtol=0)


# ----------------------------------------------------------------------------- variants


def visible(positions, length, window):
    """[M, L] mask: causal, and within the last `window` keys of each query."""
    keys = torch.arange(length, device=positions.device)[None, :]
    mask = keys <= positions[:, None]
    return mask if window is None else mask & (keys > positions[:, None] - window)


@pytest.mark.parametrize("window, softcap", [(4, None), (20, 3.0), (None, 2.0)])
def test_sliding_window_and_softcap_match_reference(window, softcap):
    """Window 4 < the 16-query block: the block's last queries see no key of the first
    key block visited (the masked online softmax); window 20 spans several key blocks."""
    dtype, kv_heads, group, head_dim = torch.float32, 2, 2, 32
    prefix_lens, extend_lens = [0, 9, 30], [37, 20, 1]
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    kv = PagedKV(seq_lens, kv_heads, head_dim, dtype)
    q = packed_q(sum(extend_lens), kv_heads * group, kv_heads, head_dim, dtype)
    o = torch.full(q.shape, float("nan"), dtype=dtype, device=DEVICE)
    starts = [0] + torch.tensor(extend_lens).cumsum(0).tolist()[:-1]
    scale = head_dim**-0.5
    attention.extend_attention(
        q, o, kv.k_cache, kv.v_cache, kv.req_to_token, kv.req_pool_indices, lens_tensor(prefix_lens),
        lens_tensor(extend_lens), lens_tensor(starts), scale, window=window, softcap=softcap,
    )  # fmt: skip
    expected = torch.zeros(q.shape, dtype=torch.float32, device=DEVICE)
    for b, (prefix, new) in enumerate(zip(prefix_lens, extend_lens)):
        rows = slice(starts[b], starts[b] + new)
        mask = visible(torch.arange(prefix, prefix + new, device=DEVICE), prefix + new, window)
        expected[rows] = attend(q[rows], *kv.context(b, prefix + new), scale, mask, softcap)
    assert_close(o, expected, dtype)
    q = q[: len(seq_lens)]
    o = torch.full(q.shape, float("nan"), dtype=dtype, device=DEVICE)
    attention.decode_attention(
        q, kv.k_cache, kv.v_cache, o, kv.req_to_token, kv.req_pool_indices, lens_tensor(seq_lens), scale,
        num_kv_splits=2, window=window, softcap=softcap,
    )  # fmt: skip
    for b, length in enumerate(seq_lens):
        mask = visible(torch.tensor([length - 1], device=DEVICE), length, window)
        expected[b] = attend(q[b : b + 1], *kv.context(b, length), scale, mask, softcap)[0]
    assert_close(o, expected[: len(seq_lens)], dtype)


# ----------------------------------------------------------------------------- decode


@pytest.mark.parametrize(
    "group, head_dim, dtype, num_kv_splits",
    [
        (1, 64, torch.float32, 4),  # several splits; short sequences fit in one
        (2, 128, torch.bfloat16, 8),  # more splits than key blocks for most requests
        (3, 80, torch.float32, 1),  # one split: plain attention; padded head_dim
        (2, 96, torch.float16, 3),  # a split count that is not a power of two
    ],
)
def test_decode_matches_reference(group, head_dim, dtype, num_kv_splits):
    seq_lens = [1, 5, 16, 37, 70]
    o, expected = run_decode(seq_lens, 2, group, head_dim, dtype, num_kv_splits)
    assert_close(o, expected, dtype)


def test_decode_large_group_spans_several_head_blocks():
    o, expected = run_decode([3, 20], 2, 72, 64, torch.float32, 2)  # 64 heads per program
    assert_close(o, expected, torch.float32)


def test_decode_default_splits_and_hint():
    o, expected = run_decode([3, 50], 1, 2, 64, torch.float32, None, max_seq_len=50)
    assert_close(o, expected, torch.float32)


def test_decode_empty_sequence_gives_zeros():
    o, expected = run_decode([0, 9], 1, 1, 64, torch.float32, 2)
    assert_close(o, expected, torch.float32)
    assert (o[0] == 0).all()


# ----------------------------------------------------------------------------- extend


@pytest.mark.parametrize(
    "group, head_dim, dtype",
    [(1, 64, torch.float32), (2, 80, torch.bfloat16), (3, 128, torch.float32)],
)
def test_extend_matches_reference(group, head_dim, dtype):
    # prefix 0, extend 1, a prefix on a key-block boundary, several query blocks
    prefix_lens = [0, 0, 7, 16, 21]
    extend_lens = [1, 35, 1, 17, 12]
    o, expected = run_extend(prefix_lens, extend_lens, 2, group, head_dim, dtype)
    assert_close(o, expected, dtype)


def test_extend_with_grid_hint_larger_than_needed():
    o, expected = run_extend([4, 0], [3, 5], 1, 2, 64, torch.float32, max_extend_len=40)
    assert_close(o, expected, torch.float32)


# ----------------------------------------------------------------------------- bitmask


def reference_bitmask(logits, bitmask, indices=None):
    vocab = logits.shape[1]
    bits = (bitmask[:, :, None] >> torch.arange(32, device=bitmask.device)) & 1
    allowed = bits.flatten(1)[:, :vocab].bool()
    all_rows = torch.arange(logits.shape[0], device=logits.device)
    rows = all_rows if indices is None else indices.long()
    out = logits.clone()
    out[rows] = out[rows].masked_fill(~allowed[rows], float("-inf"))
    return out


def random_bitmask(batch, vocab, words=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    words = words or -(-vocab // 32)
    raw = torch.randint(-(2**31), 2**31, (batch, words), generator=gen, dtype=torch.int64)
    return raw.to(torch.int32).to(DEVICE)


@pytest.mark.parametrize("vocab, dtype", [(100, torch.float32), (1000, torch.bfloat16)])
def test_bitmask_matches_reference(vocab, dtype):
    logits = torch.randn(3, vocab).to(dtype).to(DEVICE)
    bitmask = random_bitmask(3, vocab)
    expected = reference_bitmask(logits, bitmask)
    bitmask_kernels.apply_token_bitmask_inplace_triton(logits, bitmask)
    assert torch.equal(logits, expected)


def test_bitmask_index_subset_and_extra_words():
    logits = torch.randn(5, 77, device=DEVICE)
    bitmask = random_bitmask(5, 77, words=4)  # ceil(77 / 32) = 3; the 4th word is ignored
    indices = torch.tensor([3, 0], dtype=torch.int32, device=DEVICE)
    expected = reference_bitmask(logits, bitmask, indices)
    bitmask_kernels.apply_token_bitmask_inplace_triton(logits, bitmask, indices)
    assert torch.equal(logits, expected)


def test_bitmask_rejects_short_or_wrong_dtype_masks():
    logits = torch.zeros(2, 65, device=DEVICE)
    with pytest.raises(ValueError, match="3 words"):
        bitmask_kernels.apply_token_bitmask_inplace_triton(logits, random_bitmask(2, 64))
    with pytest.raises(ValueError, match="int32"):
        bitmask_kernels.apply_token_bitmask_inplace_triton(logits, random_bitmask(2, 65).long())


# ----------------------------------------------------------------------------- GPU sizes


@gpu
@requires_cuda
@pytest.mark.parametrize(
    "batch, max_len, group, dtype, num_kv_splits",
    [
        (16, 4096, 4, torch.bfloat16, None),  # default: 4 splits on 132 SMs
        (16, 4096, 1, torch.float16, 16),
        (16, 4096, 8, torch.float32, None),
        (8, 4096, 24, torch.bfloat16, 7),
        (2, 32768, 4, torch.bfloat16, None),  # long context: 32 splits
    ],
)
def test_decode_realistic_sizes(batch, max_len, group, dtype, num_kv_splits):
    gen = torch.Generator().manual_seed(3)
    seq_lens = torch.randint(1, max_len, (batch,), generator=gen).tolist()
    o, expected = run_decode(seq_lens, 8, group, 128, dtype, num_kv_splits)
    assert_close(o, expected, dtype)


@gpu
@requires_cuda
@pytest.mark.parametrize(
    "group, head_dim, dtype",
    [(4, 128, torch.bfloat16), (7, 64, torch.float16), (2, 80, torch.float32)],
)
def test_extend_realistic_sizes(group, head_dim, dtype):
    gen = torch.Generator().manual_seed(4)
    prefix_lens = torch.randint(0, 2048, (12,), generator=gen).tolist()
    extend_lens = torch.randint(1, 700, (12,), generator=gen).tolist()
    prefix_lens[0], extend_lens[1] = 0, 1
    o, expected = run_extend(prefix_lens, extend_lens, 4, group, head_dim, dtype)
    assert_close(o, expected, dtype)


@gpu
@requires_cuda
def test_bitmask_realistic_sizes():
    logits = torch.randn(64, 151_936, device=DEVICE, dtype=torch.bfloat16)
    bitmask = random_bitmask(64, 151_936)
    indices = torch.arange(0, 64, 3, device=DEVICE)
    expected = reference_bitmask(logits, bitmask, indices)
    bitmask_kernels.apply_token_bitmask_inplace_triton(logits, bitmask, indices)
    assert torch.equal(logits, expected)
