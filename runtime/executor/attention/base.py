"""The attention-backend interface and the one context object of a forward pass."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch

from spruce.runtime.executor.kv_pool import KVPool, ReqToTokenTable


@dataclass(slots=True)
class ForwardContext:
    """Attention metadata of one forward pass, built by the model runner.

    The batch holds B requests; request b adds `extend_lens[b]` new tokens after
    `prefix_lens[b]` tokens already in the KV pool (a decode step is extend length 1).
    New tokens of all requests are packed in order, so request b's tokens are rows
    `extend_start_loc[b] ..` of the activations. Device tensors are int64; the `*_cpu`
    lists are the same numbers on the host, so backends decide shapes without a sync.
    """

    positions: torch.Tensor  # [N] position of each new token
    out_slots: torch.Tensor  # [N] KV slot each new token is written to
    req_pool_indices: torch.Tensor  # [B] row of each request in req_to_token
    prefix_lens: torch.Tensor  # [B]
    extend_lens: torch.Tensor  # [B]
    prefix_lens_cpu: list[int]
    extend_lens_cpu: list[int]
    backend_state: Any = field(default=None)  # what the backend's prepare() computed
    # rows whose final hidden states (after the last norm) the caller wants (embeddings);
    # the model sets `hidden` to them, [len(hidden_rows), hidden_size]
    hidden_rows: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    # several items share a request's row (speculative drafts, one token each): a token's
    # K/V must be in the pool before the rows after it attend (no fused store-and-attend)
    shared_rows: bool = False

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.numel())

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.extend_lens_cpu)

    @property
    def extend_start_loc_cpu(self) -> list[int]:
        starts, total = [], 0
        for n in self.extend_lens_cpu:
            starts.append(total)
            total += n
        return starts


@dataclass(frozen=True, slots=True)
class AttentionOptions:
    """The model's attention variants; a backend implements each or refuses it at creation.

    `layer_windows[layer]` = W: that layer's query at position p reads only the keys at
    positions p - W + 1 .. p (sliding window); None (or an empty tuple) = every key.
    `logit_softcap` = c: scores become c * tanh(scores / c) before the softmax."""

    scale: float | None = None  # None: head_dim ** -0.5
    layer_windows: tuple[int | None, ...] = ()
    logit_softcap: float | None = None

    def window(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None


class AttentionBackend(ABC):
    """Writes each layer's new K/V into the pool, then attends over the cached prefix plus
    the new tokens (causal among the new tokens). One instance serves every layer.

    Rules: `prepare(ctx)` is called once per forward pass before any layer runs and may
    store precomputed indices in `ctx.backend_state`; `forward` must not change `ctx`.
    """

    def __init__(
        self,
        pool: KVPool,
        req_to_token: ReqToTokenTable,
        num_heads: int,
        head_dim: int,
        options: AttentionOptions | None = None,
    ) -> None:
        self.pool = pool
        self.req_to_token = req_to_token
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.options = options or AttentionOptions()
        self.scale = self.options.scale or head_dim**-0.5

    @abstractmethod
    def prepare(self, ctx: ForwardContext) -> None: ...

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, ctx: ForwardContext
    ) -> torch.Tensor:
        """q [N, heads, head_dim], k/v [N, kv_heads, head_dim] -> o [N, heads, head_dim]."""
