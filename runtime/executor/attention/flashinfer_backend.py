"""FlashInfer attention backend (GPU): its wrappers' plan / run API over our slot pool.

The pool is a paged KV cache with page size 1: a token's slot is its page, so each
request's page list is its row of the request-to-token table. Decode uses the paged decode
wrapper; prefill without cached prefixes uses the ragged prefill wrapper over the new
tokens' own K/V, and prefill after cached prefixes the paged prefill wrapper (causal, the
new queries aligned to the end of their context). `prepare` plans once per forward pass;
every layer then only runs.
"""

from __future__ import annotations

import torch

from spruce.runtime.errors import SpruceError
from spruce.runtime.executor.attention.base import (
    AttentionBackend,
    AttentionOptions,
    ForwardContext,
)

WORKSPACE_BYTES = 256 * 2**20


class FlashInferAttentionBackend(AttentionBackend):
    def __init__(self, pool, req_to_token, num_heads: int, head_dim: int, options=None) -> None:
        super().__init__(pool, req_to_token, num_heads, head_dim, options)
        refuse_unsupported(self.options)
        import flashinfer

        device = pool.device
        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_tensor_cores=True
        )
        self.paged_prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        self.ragged_prefill = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD")
        self.kv_heads = pool.shape.kv_heads

    def prepare(self, ctx: ForwardContext) -> None:
        seq_lens = ctx.prefix_lens + ctx.extend_lens
        kv_indptr = _indptr(seq_lens)
        qo_indptr = _indptr(ctx.extend_lens)
        dtype = self.pool.shape.dtype
        common = (self.num_heads, self.kv_heads, self.head_dim)
        if ctx.is_decode:
            kv_indices = self._page_indices(ctx, seq_lens)
            last = torch.ones_like(seq_lens, dtype=torch.int32)
            self.decode.plan(
                kv_indptr, kv_indices, last, *common, 1, q_data_type=dtype, kv_data_type=dtype
            )
            ctx.backend_state = "decode"
        elif max(ctx.prefix_lens_cpu) == 0:
            self.ragged_prefill.plan(qo_indptr, qo_indptr, *common, causal=True, q_data_type=dtype)
            ctx.backend_state = "ragged"
        else:
            kv_indices = self._page_indices(ctx, seq_lens)
            last = torch.ones_like(seq_lens, dtype=torch.int32)
            self.paged_prefill.plan(
                qo_indptr, kv_indptr, kv_indices, last, *common, 1, causal=True, q_data_type=dtype
            )
            ctx.backend_state = "paged"

    def _page_indices(self, ctx: ForwardContext, seq_lens: torch.Tensor) -> torch.Tensor:
        longest = max(p + e for p, e in zip(ctx.prefix_lens_cpu, ctx.extend_lens_cpu))
        rows = self.req_to_token.table[ctx.req_pool_indices, :longest]
        keep = torch.arange(rows.shape[1], device=rows.device)[None, :] < seq_lens[:, None]
        return rows[keep].to(torch.int32)

    def forward(self, q, k, v, layer, ctx):
        self.pool.write(layer, ctx.out_slots, k, v)
        if ctx.backend_state == "ragged":
            return self.ragged_prefill.run(q, k, v)
        cache = (
            self.pool.k[layer][:, None],
            self.pool.v[layer][:, None],
        )  # [slots, page=1, heads, dim]
        wrapper = self.decode if ctx.backend_state == "decode" else self.paged_prefill
        return wrapper.run(q, cache)


def refuse_unsupported(options: AttentionOptions) -> None:
    """Sliding windows and soft-capping are not wired to FlashInfer's plans yet (untested
    without a GPU): such models are refused here rather than attended wrongly."""
    if any(w is not None for w in options.layer_windows) or options.logit_softcap is not None:
        raise SpruceError(
            "attention backend 'flashinfer' does not implement sliding-window attention or logit "
            "soft-capping yet; use --attention-backend triton for this model"
        )


def _indptr(lengths: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device=lengths.device)
    out[1:] = torch.cumsum(lengths, 0)
    return out
