"""Triton attention backend (GPU; under TRITON_INTERPRET=1 it also runs on the CPU).

All-decode batches use the flash-decoding kernel; any batch with a longer extend uses the
extend kernel for every request (a decode token is an extend of length 1). Both read K/V
through the request-to-token table after this layer's new K/V are written; sliding windows
and logit soft-capping are passed to the kernels per layer. Nothing here
synchronises with the device, so a decode step can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spruce.runtime.executor.attention.base import AttentionBackend, ForwardContext


@dataclass(slots=True)
class _TritonState:
    is_decode: bool
    seq_lens: torch.Tensor
    extend_start_loc: torch.Tensor | None
    max_extend_len: int


class TritonAttentionBackend(AttentionBackend):
    def __init__(self, pool, req_to_token, num_heads: int, head_dim: int, options=None) -> None:
        super().__init__(pool, req_to_token, num_heads, head_dim, options)
        self.softcap = self.options.logit_softcap
        from spruce.runtime.executor.kernels import triton_attention

        self.kernels = triton_attention

    def prepare(self, ctx: ForwardContext) -> None:
        seq_lens = ctx.prefix_lens + ctx.extend_lens
        if ctx.is_decode:
            ctx.backend_state = _TritonState(True, seq_lens, None, 1)
            return
        starts = torch.cumsum(ctx.extend_lens, 0) - ctx.extend_lens
        ctx.backend_state = _TritonState(False, seq_lens, starts, max(ctx.extend_lens_cpu))

    def forward(self, q, k, v, layer, ctx):
        self.pool.write(layer, ctx.out_slots, k, v)
        state: _TritonState = ctx.backend_state
        o = torch.empty_like(q)
        k_cache, v_cache, table = self.pool.k[layer], self.pool.v[layer], self.req_to_token.table
        if state.is_decode:
            self.kernels.decode_attention(
                q, k_cache, v_cache, o, table, ctx.req_pool_indices, state.seq_lens, self.scale,
                window=self.options.window(layer), softcap=self.softcap,
            )  # fmt: skip
        else:
            self.kernels.extend_attention(
                q, o, k_cache, v_cache, table, ctx.req_pool_indices, ctx.prefix_lens, ctx.extend_lens,
                state.extend_start_loc, self.scale, max_extend_len=state.max_extend_len,
                window=self.options.window(layer), softcap=self.softcap,
            )  # fmt: skip
        return o
