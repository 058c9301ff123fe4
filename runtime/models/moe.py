"""Sparse mixture-of-experts decoders: Mixtral and Qwen3-MoE.

Routing: softmax over the router logits (float32), the top k experts per token, their
weights renormalised to sum to one when the config says so (always for Mixtral). The
forward groups the (token, expert) pairs by expert (a stable sort, then one segment per
expert) and runs one batched matmul pair per active expert, then scatters the weighted
outputs back with one index_add: no Python loop over tokens. The segment sizes are read on
the host, so a step is not CUDA-graph capturable (`capturable = False`); a fused MoE kernel
may replace this later.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from spruce.runtime.executor.kernels import cpu_layer_ops
from spruce.runtime.models.config import ModelConfig
from spruce.runtime.models.layers import MLPS, DecoderModel, Linear, QKNormAttention


class Experts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate_up = F.linear(x, self.gate_up_proj[e])
        if cpu_layer_ops.usable(gate_up):
            return F.linear(cpu_layer_ops.silu_mul(gate_up), self.down_proj[e])
        gate, up = gate_up.chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down_proj[e])


class SparseMoE(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        moe = config.moe
        self.top_k, self.normalize, self.num_experts = (
            moe.experts_per_token,
            moe.normalize_top_k,
            moe.num_experts,
        )
        self.gate = Linear(config.hidden_size, moe.num_experts, bias=False)
        self.experts = Experts(moe.num_experts, config.hidden_size, moe.intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)  # [N, k]
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert
        tokens = order // self.top_k
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        grouped = x[tokens]
        out = torch.empty_like(grouped)
        start = 0
        for e, n in enumerate(counts):
            if n:
                out[start : start + n] = self.experts.expert(e, grouped[start : start + n])
                start += n
        out = out * weights.flatten()[order, None].to(x.dtype)
        return torch.zeros_like(x).index_add_(0, tokens, out)


class MoeDecoderModel(DecoderModel):
    capturable = False

    def make_mlp(self, config: ModelConfig, layer: int) -> nn.Module:
        if layer in config.moe.dense_layers:
            return MLPS[config.hidden_act](config, config.intermediate_size)
        return SparseMoE(config)


class MixtralForCausalLM(MoeDecoderModel):
    pass


class Qwen3MoeForCausalLM(MoeDecoderModel):
    attention_cls = QKNormAttention
