"""Triton attention over the token-granular KV pool (paged by `req_to_token`).

Both kernels read K/V from the per-layer caches [num_slots, kv_heads, head_dim] through the
request-to-token table; the caller has already written the new tokens' K/V. GQA: query head
h reads kv head h // (num_heads // kv_heads).

- `decode_attention`: one new token per request, flash-decoding. Stage 1 cuts each
  request's context into at most `num_kv_splits` chunks (whole key blocks) and computes, per
  (request, kv head, chunk), the normalised partial output and its log-sum-exp for all the
  query heads of that kv head at once, so each K/V block is loaded once per group. Stage 2
  merges the chunks.
- `extend_attention`: several new tokens per request, packed; causal with the cached prefix
  as offset. One program per (head, block of new tokens, request); key blocks after the
  block's last query are never visited, and key blocks every query of the block sees skip
  the causal mask.

Contract for callers (the triton attention backend):
- index tensors (`req_to_token`, `req_pool_indices`, lengths, start locations) are integer
  tensors (int32 or int64) on q's device; the last dimension of `req_to_token` is contiguous.
- the last dimension of q, o, k_cache and v_cache is contiguous; other strides are free.
- q, k_cache, v_cache share one dtype (fp16, bf16 or fp32); accumulation is fp32 and o
  keeps its own dtype. fp32 inputs use 3xTF32 dot products (about fp32 accuracy), not plain tf32.
- nothing here synchronises with the device, except `extend_attention` called without its
  `max_extend_len` hint (it then reads `extend_lens.max()`).

Variants (both kernels): `window` = W attends each query at position p to keys p - W + 1 ..
p only (sliding-window layers; the decode kernel splits only those W keys, the extend kernel
starts at the first key block a query of the block can see); `softcap` = c maps scores to
c * tanh(scores / c) before the softmax (Gemma 2). Both are compile-time switches, so the
plain kernels are unchanged.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634
_MAX_KV_SPLITS = 64
_NO_WINDOW = 1 << 30  # a window no sequence reaches


@dataclass(frozen=True, slots=True)
class _LaunchConfig:
    block_m: int  # queries per program (extend) / unused for decode
    block_n: int  # keys per loop step
    num_warps: int
    num_stages: int


def _extend_config(device: torch.device, head_dim: int, dtype: torch.dtype) -> _LaunchConfig:
    # Checked by compiling for sm_90 with ptxas (no spills, K/V loads pipelined); not yet
    # timed on a GPU.
    if device.type != "cuda":  # the interpreter: small blocks, so small tests cross blocks
        return _LaunchConfig(16, 16, 4, 1)
    if dtype == torch.float32:  # a debugging path: 3xTF32 dots need twice the registers
        return _LaunchConfig(64, 32, 4, 1)
    if torch.cuda.get_device_capability(device)[0] >= 9:  # Hopper: wgmma over 128 queries
        return _LaunchConfig(128 if head_dim <= 128 else 64, 64, 8, 2)
    return _LaunchConfig(64, 64, 4, 2)


def _decode_config(device: torch.device, dtype: torch.dtype, block_h: int) -> _LaunchConfig:
    if device.type != "cuda":
        return _LaunchConfig(0, 16, 4, 1)
    if dtype == torch.float32:
        return _LaunchConfig(0, 32, 4, 2)
    return _LaunchConfig(0, 64, 4 if block_h <= 16 else 8, 2)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _default_num_kv_splits(
    device: torch.device, programs_per_split: int, block_n: int, max_seq_len: int | None
) -> int:
    """Enough splits for stage 1 to fill every SM about twice, a power of two in [1, 64];
    with a `max_seq_len` hint, no more splits than key blocks in the longest sequence."""
    if device.type == "cuda":
        target = 2 * _sm_count(device.index if device.index is not None else 0)
    else:
        target = 2 * programs_per_split
    splits = triton.next_power_of_2(triton.cdiv(target, max(programs_per_split, 1)))
    if max_seq_len is not None:
        key_blocks = triton.cdiv(max_seq_len, block_n)
        splits = min(splits, triton.next_power_of_2(key_blocks))
    return max(1, min(splits, _MAX_KV_SPLITS))


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _dot(a, b, DOT_PRECISION: tl.constexpr, WIDEN_DOT: tl.constexpr):
    """tl.dot with fp32 accumulation. WIDEN_DOT (set on CPU, i.e. under the interpreter, whose
    tl.dot multiplies bf16 bit patterns as integers in triton 3.9) widens the operands to
    fp32 first: the same products, only summed in another order."""
    if WIDEN_DOT:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b, input_precision=DOT_PRECISION)
    return out


@triton.jit
def _load_kv(K, V, slots, kv_mask, offs_d, stride_kn, stride_vn):
    """One block of keys and values by slot; K / V already point at the kv head."""
    rows = slots.to(tl.int64)[:, None]  # slot * stride can exceed int32 on large pools
    k = tl.load(K + rows * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + rows * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0)
    return k, v


@triton.jit
def _softmax_update(acc, m_i, l_i, s, v, DOT_PRECISION: tl.constexpr, WIDEN_DOT: tl.constexpr):
    """Folds scores `s` (log2 domain, -inf = masked) and values `v` into the running state.
    Callers guarantee each row has a finite score in the first block it sees."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.math.exp2(s - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION, WIDEN_DOT)
    return acc, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _softmax_update_masked(
    acc, m_i, l_i, s, v, DOT_PRECISION: tl.constexpr, WIDEN_DOT: tl.constexpr
):
    """`_softmax_update` for blocks in which a row may see no key at all (sliding windows)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION, WIDEN_DOT)
    return acc, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _scaled(s, qk_scale, SOFTCAP: tl.constexpr):
    """Raw dot products -> scores in the log2 domain. With SOFTCAP = c the caller passes
    qk_scale = sm_scale / c, and the score is c * tanh(sm_scale * s / c) * log2(e)."""
    if SOFTCAP > 0:
        x = s * qk_scale
        out = (1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)) * (SOFTCAP * 1.4426950408889634)
    else:
        out = s * qk_scale
    return out


@triton.jit
def _split_len(seq_len, num_kv_splits, BLOCK_N: tl.constexpr):
    """Keys per split: an even share of the sequence rounded up to whole key blocks (>= 1)."""
    return tl.maximum(tl.cdiv(tl.cdiv(seq_len, num_kv_splits), BLOCK_N), 1) * BLOCK_N


@triton.jit
def _decode_split_kernel(
    Q, K, V, Mid_O, Mid_LSE, Req_to_token, Req_pool_indices, Seq_lens,
    qk_scale, num_kv_splits, group, head_dim, head_blocks, window,
    stride_qb, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_rt,
    stride_mb, stride_mh, stride_ms, stride_lb, stride_lh,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, WIDEN_DOT: tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    kv_head = tl.program_id(1) // head_blocks
    split = tl.program_id(2)
    offs_g = (tl.program_id(1) % head_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_g < group
    heads = kv_head * group + offs_g
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < head_dim

    seq_len = tl.load(Seq_lens + b).to(tl.int32)
    first = tl.maximum(seq_len - window, 0)  # 0 unless a sliding window cuts the context
    split_len = _split_len(seq_len - first, num_kv_splits, BLOCK_N)
    start = first + split * split_len
    end = tl.minimum(start + split_len, seq_len)
    if start < end:  # splits past the sequence write nothing; stage 2 skips them
        q_ptrs = Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
        q = tl.load(q_ptrs, mask=mask_h[:, None] & mask_d[None, :], other=0.0)
        row = tl.load(Req_pool_indices + b).to(tl.int64)
        K += kv_head * stride_kh
        V += kv_head * stride_vh
        acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        for n in range(start, end, BLOCK_N):
            offs_n = n + tl.arange(0, BLOCK_N)
            mask_n = offs_n < end
            slots = tl.load(Req_to_token + row * stride_rt + offs_n, mask=mask_n, other=0)
            kv_mask = mask_n[:, None] & mask_d[None, :]
            k, v = _load_kv(K, V, slots, kv_mask, offs_d, stride_kn, stride_vn)
            s = _scaled(_dot(q, tl.trans(k), DOT_PRECISION, WIDEN_DOT), qk_scale, SOFTCAP)
            s = tl.where(mask_n[None, :], s, float("-inf"))
            acc, m_i, l_i = _softmax_update(acc, m_i, l_i, s, v, DOT_PRECISION, WIDEN_DOT)
        mid = b * stride_mb + heads * stride_mh + split * stride_ms
        out_mask = mask_h[:, None] & mask_d[None, :]
        tl.store(Mid_O + mid[:, None] + offs_d[None, :], acc / l_i[:, None], mask=out_mask)
        lse_ptrs = Mid_LSE + b * stride_lb + heads * stride_lh + split
        tl.store(lse_ptrs, m_i + tl.math.log2(l_i), mask=mask_h)


@triton.jit
def _decode_merge_kernel(
    Mid_O, Mid_LSE, O, Seq_lens, num_kv_splits, head_dim, window,
    stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, stride_ob, stride_oh,
    BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(Seq_lens + b).to(tl.int32)
    seq_len = seq_len - tl.maximum(seq_len - window, 0)  # the keys actually read
    active = tl.cdiv(seq_len, _split_len(seq_len, num_kv_splits, BLOCK_N))
    offs_s = tl.arange(0, BLOCK_S)
    mask_s = offs_s < active
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < head_dim
    lse_ptrs = Mid_LSE + b * stride_lb + head * stride_lh + offs_s
    lse = tl.load(lse_ptrs, mask=mask_s, other=float("-inf"))
    mid_ptrs = Mid_O + b * stride_mb + head * stride_mh + offs_s[:, None] * stride_ms
    parts = tl.load(mid_ptrs + offs_d[None, :], mask=mask_s[:, None] & mask_d[None, :], other=0.0)
    lse_max = tl.maximum(tl.max(lse, 0), -3.0e38)  # finite even when no split is active
    weights = tl.where(mask_s, tl.math.exp2(lse - lse_max), 0.0)
    total = tl.sum(weights, 0)
    out = tl.sum(parts * weights[:, None], 0) / tl.where(total > 0, total, 1.0)  # 0 if empty
    tl.store(O + b * stride_ob + head * stride_oh + offs_d, out.to(O.dtype.element_ty), mask=mask_d)


@triton.jit
def _extend_kernel(
    Q, O, K, V, Req_to_token, Req_pool_indices, Prefix_lens, Extend_lens, Extend_start_loc,
    qk_scale, group, head_dim, window,
    stride_qn, stride_qh, stride_on, stride_oh, stride_kn, stride_kh, stride_vn, stride_vh,
    stride_rt,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, WIDEN_DOT: tl.constexpr, SOFTCAP: tl.constexpr,
    SLIDING: tl.constexpr,
):  # fmt: skip
    # Heads vary fastest so the heads of one kv group run together and share K/V in L2.
    head = tl.program_id(0)
    q_start = tl.program_id(1) * BLOCK_M
    b = tl.program_id(2)
    extend_len = tl.load(Extend_lens + b).to(tl.int32)
    if q_start < extend_len:  # the grid covers the longest request; shorter ones stop here
        prefix_len = tl.load(Prefix_lens + b).to(tl.int32)
        token0 = tl.load(Extend_start_loc + b).to(tl.int64)
        row = tl.load(Req_pool_indices + b).to(tl.int64)
        offs_m = q_start + tl.arange(0, BLOCK_M)
        mask_m = offs_m < extend_len
        pos_m = prefix_len + offs_m
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < head_dim
        q_ptrs = Q + (token0 + offs_m[:, None]) * stride_qn + head * stride_qh + offs_d[None, :]
        q = tl.load(q_ptrs, mask=mask_m[:, None] & mask_d[None, :], other=0.0)
        K += (head // group) * stride_kh
        V += (head // group) * stride_vh
        Req_to_token += row * stride_rt
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        # Keys 0 .. prefix_len + q_start are visible to every query of the block, so whole
        # key blocks in that range need no mask. The key blocks after it, up to the block's
        # last query, are masked causally. Key 0 is in the first block visited, so every
        # row's running max is finite from then on.
        kv_end = prefix_len + tl.minimum(q_start + BLOCK_M, extend_len)
        if SLIDING:  # from the first key block the block's first query sees, all masked
            lo = tl.maximum(prefix_len + q_start - window + 1, 0) // BLOCK_N * BLOCK_N
            for n in range(lo, kv_end, BLOCK_N):
                offs_n = n + tl.arange(0, BLOCK_N)
                mask_n = offs_n < kv_end
                slots = tl.load(Req_to_token + offs_n, mask=mask_n, other=0)
                kv_mask = mask_n[:, None] & mask_d[None, :]
                k, v = _load_kv(K, V, slots, kv_mask, offs_d, stride_kn, stride_vn)
                s = _scaled(_dot(q, tl.trans(k), DOT_PRECISION, WIDEN_DOT), qk_scale, SOFTCAP)
                key, query = offs_n[None, :], pos_m[:, None]
                visible = mask_n[None, :] & (key <= query) & (key > query - window)
                s = tl.where(visible, s, float("-inf"))
                acc, m_i, l_i = _softmax_update_masked(
                    acc, m_i, l_i, s, v, DOT_PRECISION, WIDEN_DOT
                )
        else:
            unmasked_end = (prefix_len + q_start + 1) // BLOCK_N * BLOCK_N
            for n in range(0, unmasked_end, BLOCK_N):
                slots = tl.load(Req_to_token + n + tl.arange(0, BLOCK_N))
                k, v = _load_kv(K, V, slots, mask_d[None, :], offs_d, stride_kn, stride_vn)
                s = _scaled(_dot(q, tl.trans(k), DOT_PRECISION, WIDEN_DOT), qk_scale, SOFTCAP)
                acc, m_i, l_i = _softmax_update(acc, m_i, l_i, s, v, DOT_PRECISION, WIDEN_DOT)
            for n in range(unmasked_end, kv_end, BLOCK_N):
                offs_n = n + tl.arange(0, BLOCK_N)
                mask_n = offs_n < kv_end
                slots = tl.load(Req_to_token + offs_n, mask=mask_n, other=0)
                kv_mask = mask_n[:, None] & mask_d[None, :]
                k, v = _load_kv(K, V, slots, kv_mask, offs_d, stride_kn, stride_vn)
                s = _scaled(_dot(q, tl.trans(k), DOT_PRECISION, WIDEN_DOT), qk_scale, SOFTCAP)
                visible = mask_n[None, :] & (offs_n[None, :] <= pos_m[:, None])
                s = tl.where(visible, s, float("-inf"))
                acc, m_i, l_i = _softmax_update(acc, m_i, l_i, s, v, DOT_PRECISION, WIDEN_DOT)
        o_ptrs = O + (token0 + offs_m[:, None]) * stride_on + head * stride_oh + offs_d[None, :]
        out = (acc / l_i[:, None]).to(O.dtype.element_ty)
        tl.store(o_ptrs, out, mask=mask_m[:, None] & mask_d[None, :])


# ----------------------------------------------------------------------------- launchers


def _dot_precision(dtype: torch.dtype) -> str:
    # Only fp32 inputs look at it: 3xTF32 is about as exact as fp32 and still on tensor cores.
    return "tf32x3" if dtype == torch.float32 else "tf32"


def _qk_scale(sm_scale: float, softcap: float | None) -> float:
    """The factor raw dot products are multiplied by in the kernels (see `_scaled`)."""
    return sm_scale / softcap if softcap else sm_scale * _LOG2E


def _check(q: torch.Tensor, o: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
    """Checks the shapes shared by both kernels; returns the GQA group size."""
    assert q.dim() == 3 and o.shape == q.shape, (q.shape, o.shape)
    assert k_cache.dim() == 3 and v_cache.shape == k_cache.shape, (k_cache.shape, v_cache.shape)
    assert q.shape[2] == k_cache.shape[2], "q and the KV cache disagree on head_dim"
    assert q.shape[1] % k_cache.shape[1] == 0, "num_heads must be a multiple of kv_heads"
    assert q.dtype == k_cache.dtype == v_cache.dtype, (q.dtype, k_cache.dtype, v_cache.dtype)
    for t in (q, o, k_cache, v_cache):
        assert t.stride(-1) == 1, "the head_dim axis must be contiguous"
    return q.shape[1] // k_cache.shape[1]


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    o: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    num_kv_splits: int | None = None,
    max_seq_len: int | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> None:
    """Attention of one new token per request over its whole context; writes `o`.

    q, o: [B, num_heads, head_dim]; request b is row `req_pool_indices[b]` of `req_to_token`
    and attends to positions 0 .. seq_lens[b] - 1 (its own token included; seq_lens[b] == 0
    gives zeros). `num_kv_splits` bounds the chunks a sequence is cut into (default:
    `_default_num_kv_splits`, from the batch shape only, so CUDA-graph safe). `max_seq_len`,
    an optional host-side bound on seq_lens, only caps that default (a graph captured with it
    is valid for shorter sequences only). `window` / `softcap`: see the module docstring.
    """
    group = _check(q, o, k_cache, v_cache)
    batch, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    if batch == 0:
        return
    block_h = min(max(16, triton.next_power_of_2(group)), 64)  # tl.dot needs >= 16 rows
    head_blocks = triton.cdiv(group, block_h)
    config = _decode_config(q.device, q.dtype, block_h)
    if num_kv_splits is None:
        programs = batch * kv_heads * head_blocks
        num_kv_splits = _default_num_kv_splits(q.device, programs, config.block_n, max_seq_len)
    assert 1 <= num_kv_splits <= _MAX_KV_SPLITS, f"num_kv_splits must be in [1, {_MAX_KV_SPLITS}]"
    mid_shape = (batch, num_heads, num_kv_splits)
    mid_o = torch.empty((*mid_shape, head_dim), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(mid_shape, dtype=torch.float32, device=q.device)
    block_d = triton.next_power_of_2(head_dim)
    _decode_split_kernel[(batch, kv_heads * head_blocks, num_kv_splits)](
        q, k_cache, v_cache, mid_o, mid_lse, req_to_token, req_pool_indices, seq_lens,
        _qk_scale(sm_scale, softcap), num_kv_splits, group, head_dim, head_blocks,
        window or _NO_WINDOW,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), req_to_token.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        BLOCK_H=block_h, BLOCK_N=config.block_n, BLOCK_D=block_d,
        DOT_PRECISION=_dot_precision(q.dtype), WIDEN_DOT=q.device.type != "cuda",
        SOFTCAP=softcap or 0.0,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    _decode_merge_kernel[(batch, num_heads)](
        mid_o, mid_lse, o, seq_lens, num_kv_splits, head_dim, window or _NO_WINDOW,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        o.stride(0), o.stride(1),
        BLOCK_N=config.block_n, BLOCK_S=triton.next_power_of_2(num_kv_splits), BLOCK_D=block_d,
        num_warps=4,
    )  # fmt: skip


def extend_attention(
    q: torch.Tensor,
    o: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    extend_start_loc: torch.Tensor,
    sm_scale: float,
    max_extend_len: int | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> None:
    """Causal attention of packed new tokens over their cached prefix and themselves;
    writes `o`.

    q, o: [N_total, num_heads, head_dim]; request b's new tokens are rows
    extend_start_loc[b] .. + extend_lens[b] at positions prefix_lens[b] .. and each attends to
    positions 0 .. its own, read from the cache via row `req_pool_indices[b]` of
    `req_to_token`. Rows of o that belong to no request are left untouched.
    `max_extend_len` (host int >= max(extend_lens)) sizes the grid; without it this reads
    `extend_lens.max()`, a device sync. `window` / `softcap`: see the module docstring.
    """
    group = _check(q, o, k_cache, v_cache)
    batch = extend_lens.shape[0]
    num_heads, head_dim = q.shape[1], q.shape[2]
    if max_extend_len is None:
        max_extend_len = int(extend_lens.max()) if batch else 0
    if batch == 0 or max_extend_len == 0:
        return
    config = _extend_config(q.device, head_dim, q.dtype)
    grid = (num_heads, triton.cdiv(max_extend_len, config.block_m), batch)
    _extend_kernel[grid](
        q, o, k_cache, v_cache, req_to_token, req_pool_indices, prefix_lens, extend_lens,
        extend_start_loc, _qk_scale(sm_scale, softcap), group, head_dim, window or _NO_WINDOW,
        q.stride(0), q.stride(1), o.stride(0), o.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), req_to_token.stride(0),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_D=triton.next_power_of_2(head_dim),
        DOT_PRECISION=_dot_precision(q.dtype), WIDEN_DOT=q.device.type != "cuda",
        SOFTCAP=softcap or 0.0, SLIDING=window is not None,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
