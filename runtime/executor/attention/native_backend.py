"""The native attention backend: C kernels on the CPU, torch operators on any device
(registered as "native"; "torch", its former name, is an alias).

Decode requests (one new token) are attended together. On a CPU with float32 or float16
K/V they go through a small C kernel that reads the pool in place and, in an all-decode
batch, also stores the new K/V (executor/kernels/cpu_attention.py); otherwise their
context slots are gathered into a padded [B, L] index matrix once per forward pass (shared
by every layer) and run through one scaled_dot_product_attention call with a padding mask.
Extend requests are attended one by one; a request with no cached prefix uses its fresh K/V
directly. On a CPU in float32 (no soft-capping) they go through a C kernel (causal, GQA and
windows; executor/kernels/cpu_prefill_attention.c) instead of scaled_dot_product_attention.

Sliding windows: each distinct window of the model gets its own masks, built once per
forward pass in `prepare`; the C kernel takes the window as an argument. Logit soft-capping
(Gemma 2) runs the scores through explicit torch operators (SDPA cannot cap them), on
every path, so the C decode kernel is not used for such models.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from spruce.runtime.executor.attention.base import AttentionBackend, ForwardContext
from spruce.runtime.executor.kernels.cpu_attention import prefill_attention


@dataclass(slots=True)
class _DecodeGroup:
    rows: torch.Tensor  # [Bd] rows of q that are decode tokens
    table_rows: torch.Tensor  # [Bd] their rows in the request-to-token table
    seq_lens: torch.Tensor  # [Bd] context lengths including the new token
    slots: torch.Tensor | None = None  # [Bd, L] context slots padded with slot 0 (torch path)
    masks: dict | None = None  # window -> [Bd, 1, 1, L] True = attend, or None (no padding)


@dataclass(slots=True)
class _Extend:
    start: int
    length: int
    prefix_len: int
    slots: torch.Tensor  # [prefix + length] slots
    masks: dict  # window -> [length, prefix + length] mask, or None for plain causal


def _extend_mask(prefix: int, length: int, window: int | None, device) -> torch.Tensor | None:
    """[length, prefix + length] True = attend: causal with the prefix as offset, within the
    window; None when that is plain causal attention over the new tokens (is_causal)."""
    total = prefix + length
    slides = window is not None and total > window
    if prefix == 0 and not slides:
        return None
    q_pos = torch.arange(length, device=device)[:, None] + prefix
    key_pos = torch.arange(total, device=device)[None, :]
    mask = key_pos <= q_pos
    return mask & (key_pos > q_pos - window) if slides else mask


@dataclass(slots=True)
class _NativeState:
    decode: _DecodeGroup | None
    extends: list[_Extend]
    all_decode: bool


class NativeAttentionBackend(AttentionBackend):
    def __init__(self, pool, req_to_token, num_heads: int, head_dim: int, options=None) -> None:
        super().__init__(pool, req_to_token, num_heads, head_dim, options)
        self.softcap = self.options.logit_softcap
        self.windows = [self.options.window(layer) for layer in range(pool.shape.num_layers)]
        self.distinct_windows = sorted(set(self.windows), key=lambda w: -1 if w is None else w)
        self.cpu_kernel = None
        from spruce.runtime.executor.kernels.cpu_attention import KERNELS, CpuDecodeAttention

        on_cpu = pool.device.type == "cpu" and self.softcap is None
        if on_cpu and pool.shape.dtype in KERNELS:
            kernel = CpuDecodeAttention()
            self.cpu_kernel = kernel if kernel.available else None
        self.cpu_prefill = (
            on_cpu  # extends in float32 through the C prefill kernel when it is built
        )

    def prepare(self, ctx: ForwardContext) -> None:
        starts = ctx.extend_start_loc_cpu
        decode_ids = [b for b, n in enumerate(ctx.extend_lens_cpu) if n == 1]
        extends = [
            self._extend(ctx, b, starts[b]) for b, n in enumerate(ctx.extend_lens_cpu) if n != 1
        ]
        decode = self._decode_group(ctx, decode_ids, starts) if decode_ids else None
        ctx.backend_state = _NativeState(decode, extends, all_decode=not extends)

    def _decode_group(self, ctx: ForwardContext, ids: list[int], starts: list[int]) -> _DecodeGroup:
        device = ctx.positions.device
        seq_lens = [ctx.prefix_lens_cpu[b] + 1 for b in ids]
        table_rows = (
            ctx.req_pool_indices[ids] if len(ids) != ctx.batch_size else ctx.req_pool_indices
        )
        rows, lens = torch.tensor([[starts[b] for b in ids], seq_lens], device=device).unbind()
        group = _DecodeGroup(rows, table_rows, lens)
        if self.cpu_kernel is None:
            self._pad_slots(group, seq_lens)
        return group

    def _pad_slots(self, group: _DecodeGroup, seq_lens: list[int]) -> None:
        max_len = max(seq_lens)
        slots = self.req_to_token.table[group.table_rows, :max_len].to(torch.int64)
        key_pos = torch.arange(max_len, device=slots.device)[None, :]
        keep = key_pos < group.seq_lens[:, None]
        if min(seq_lens) != max_len:
            slots = slots.masked_fill(~keep, 0)
        group.masks = {}
        for w in self.distinct_windows:
            mask = keep if w is None else keep & (key_pos >= group.seq_lens[:, None] - w)
            needed = min(seq_lens) != max_len or (w is not None and max_len > w)
            group.masks[w] = mask[:, None, None, :] if needed else None
        group.slots = slots

    def _extend(self, ctx: ForwardContext, b: int, start: int) -> _Extend:
        prefix, length = ctx.prefix_lens_cpu[b], ctx.extend_lens_cpu[b]
        device = ctx.positions.device
        masks = {w: _extend_mask(prefix, length, w, device) for w in self.distinct_windows}
        row = int(ctx.req_pool_indices[b])
        slots = self.req_to_token.table[row, : prefix + length].to(torch.int64)
        return _Extend(start, length, prefix, slots, masks)

    def forward(self, q, k, v, layer, ctx):
        state: _NativeState = ctx.backend_state
        window = self.windows[layer]
        fused = state.all_decode and self.cpu_kernel is not None
        if fused:  # the kernel stores the new K/V itself
            return self._attend_decode(q, layer, window, state.decode, new_kv=(k, v, ctx.out_slots))
        self.pool.write(layer, ctx.out_slots, k, v)
        if state.all_decode:
            return self._attend_decode(q, layer, window, state.decode)
        o = torch.empty_like(q)
        if state.decode is not None:
            o[state.decode.rows] = self._attend_decode(
                q[state.decode.rows], layer, window, state.decode
            )
        for ext in state.extends:
            span = slice(ext.start, ext.start + ext.length)
            o[span] = self._attend_extend(q[span], k[span], v[span], layer, window, ext)
        return o

    def _attend_decode(
        self, q, layer: int, window, group: _DecodeGroup, new_kv=None
    ) -> torch.Tensor:
        if self.cpu_kernel is not None:
            k_cache, v_cache, scales = (
                self.pool.k[layer],
                self.pool.v[layer],
                self.pool.scales(layer),
            )
            table = self.req_to_token.table
            return self.cpu_kernel(
                q,
                k_cache,
                v_cache,
                table,
                group.table_rows,
                group.seq_lens,
                self.scale,
                new_kv,
                window,
                scales,
            )
        k, v = self.pool.read(layer, group.slots, q.dtype)  # [B, L, KH, D]
        o = self._attention(
            q[:, :, None, :], k.transpose(1, 2), v.transpose(1, 2), group.masks[window], False
        )
        return o[:, :, 0, :]

    def _attend_extend(self, q, k, v, layer: int, window, ext: _Extend) -> torch.Tensor:
        if ext.prefix_len or not self._stores_exactly(q.dtype):
            # the K/V as the pool holds them, as every later step reads them: a prompt's
            # rows come out the same whether its prefix was cached or computed with it
            k, v = self.pool.read(layer, ext.slots, q.dtype)
        if self.cpu_prefill and q.dtype == torch.float32:
            o = prefill_attention(q, k, v, ext.prefix_len, self.scale, window)
            if o is not None:
                return o
        mask = ext.masks[window]
        o = self._attention(
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            mask,
            mask is None,
        )
        return o[0].transpose(0, 1)

    def _stores_exactly(self, dtype: torch.dtype) -> bool:
        """Whether the pool gives back K/V of `dtype` exactly as computed."""
        return not self.pool.quantized and self.pool.shape.dtype == dtype

    def _attention(self, q, k, v, mask, is_causal: bool) -> torch.Tensor:
        """q [B, H, Lq, D], k/v [B, KH, Lk, D]; mask True = attend."""
        if self.softcap is None:
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=is_causal, scale=self.scale, enable_gqa=True
            )
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1).float(), v.repeat_interleave(group, dim=1).float()
        scores = (
            torch.tanh(q.float() @ k.transpose(-1, -2) * (self.scale / self.softcap)) * self.softcap
        )
        if is_causal:
            lq, lk = scores.shape[-2:]
            mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return (scores.softmax(-1) @ v).to(q.dtype)
