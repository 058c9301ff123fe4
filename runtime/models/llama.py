"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2) in torch.

Q/K/V and gate/up projections are fused into one matmul each. Attention goes through the
configured backend, which reads and writes the token-granular KV pool. The residual
stream is added inside each norm (norm(x + residual) returns the new residual too). On
the CPU in float32, the residual add + norm, SiLU * up and rotary run as C kernels
(runtime/kernels/cpu_layer_ops.py), one call each instead of several torch operators.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from spruce.runtime.executor.attention.base import AttentionBackend, ForwardContext
from spruce.runtime.executor.kernels import cpu_layer_ops
from spruce.runtime.models.config import ModelConfig, RopeScaling


class Linear(nn.Linear):
    """nn.Linear whose batch-1 decode (a few rows) on the CPU streams the weights in C."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_layer_ops.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual); without a residual, (norm(x), x)."""
        if cpu_layer_ops.usable(x):
            return cpu_layer_ops.rms_norm(x, self.weight, self.eps, residual)
        if residual is not None:
            x = x + residual
        return self._norm(x), x

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Rotary(nn.Module):
    """Rotate-half rotary embedding with a precomputed cos/sin table over positions."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.cos = self.sin = None  # built by build(device) after the weights are placed

    def build(self, device: torch.device) -> None:
        # float32 throughout, the way transformers computes it, so logits match closely;
        # plain attributes, not buffers, so they stay float32 when the model moves to bf16.
        c = self.config
        exponents = torch.arange(0, c.head_dim, 2, dtype=torch.int64, device=device).float() / c.head_dim
        inv_freq = 1.0 / (c.rope_theta**exponents)
        if c.rope_scaling is not None:
            inv_freq = _llama3_scaled(inv_freq, c.rope_scaling)
        positions = torch.arange(c.max_position_embeddings, dtype=torch.float32, device=device)
        freqs = torch.outer(positions, inv_freq)
        self.cos, self.sin = freqs.cos(), freqs.sin()

    def forward(self, positions: torch.Tensor, qkv: torch.Tensor):
        """qkv [N, q_size + 2 * kv_size] -> q, k (rotated), v as [N, heads, head_dim] views."""
        c = self.config
        in_c = cpu_layer_ops.usable(qkv)
        if in_c:
            cpu_layer_ops.rotary_(qkv, c.num_heads + c.num_kv_heads, c.head_dim, positions, self.cos, self.sin)
        q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        q = q.view(-1, c.num_heads, c.head_dim)
        k = k.view(-1, c.num_kv_heads, c.head_dim)
        v = v.view(-1, c.num_kv_heads, c.head_dim)
        if not in_c:
            cos, sin = self.cos[positions][:, None, :], self.sin[positions][:, None, :]
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        return q, k, v


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)


def _llama3_scaled(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.config = config
        self.qkv_proj = Linear(config.hidden_size, config.q_size + 2 * config.kv_size, bias=config.qkv_bias)
        self.o_proj = Linear(config.q_size, config.hidden_size, bias=False)

    def forward(self, x, positions, rotary: Rotary, backend: AttentionBackend, ctx: ForwardContext):
        q, k, v = rotary(positions, self.qkv_proj(x))
        o = backend.forward(q, k, v, self.layer, ctx)
        return self.o_proj(o.reshape(-1, self.config.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if cpu_layer_ops.usable(gate_up):
            return self.down_proj(cpu_layer_ops.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, residual, positions, rotary, backend, ctx):
        """(this layer's MLP output, the residual stream before it)."""
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, positions, rotary, backend, ctx)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    """forward(input_ids [N], ctx, backend, logits_rows) -> logits [len(logits_rows), vocab].

    The model holds weights only; the attention backend (and its KV pool) is passed per
    call, so engines can share one model."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = Rotary(config)
        self.lm_head = None if config.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        ctx: ForwardContext,
        backend: AttentionBackend,
        logits_rows: torch.Tensor | None,
    ) -> torch.Tensor:
        backend.prepare(ctx)
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(x, residual, ctx.positions, self.rotary, backend, ctx)
        if logits_rows is not None:
            x, residual = x[logits_rows], residual[logits_rows]
        x, _ = self.norm(x, residual)
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return cpu_layer_ops.linear(x, weight)

    def load_hf_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Loads Hugging Face parameter names, fusing q/k/v and gate/up; strict."""
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in _fused_hf_names(state_dict, self.config.num_layers):
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied checkpoints sometimes still store it
            if name not in params:
                raise KeyError(f"unexpected weight {name!r}")
            target = params[name]
            if target.shape != tensor.shape:
                raise ValueError(f"weight {name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(target.shape)}")
            with torch.no_grad():
                target.copy_(tensor)
            loaded.add(name)
        missing = set(params) - loaded
        if missing:
            raise KeyError(f"checkpoint lacks weights: {sorted(missing)[:5]}")


_SAME_NAME_IN_LAYER = ("mlp.down_proj", "self_attn.o_proj", "input_layernorm", "post_attention_layernorm")


def _fused_hf_names(sd: dict[str, torch.Tensor], num_layers: int):
    """Yields (our name, tensor), concatenating HF's separate projections."""
    yield "embed_tokens.weight", sd["model.embed_tokens.weight"]
    yield "norm.weight", sd["model.norm.weight"]
    if "lm_head.weight" in sd:
        yield "lm_head.weight", sd["lm_head.weight"]
    for i in range(num_layers):
        p = f"model.layers.{i}."
        for kind in ("weight", "bias"):
            parts = [sd.get(f"{p}self_attn.{x}_proj.{kind}") for x in "qkv"]
            if all(t is not None for t in parts):
                yield f"layers.{i}.self_attn.qkv_proj.{kind}", torch.cat(parts, dim=0)
        yield f"layers.{i}.mlp.gate_up_proj.weight", torch.cat(
            [sd[f"{p}mlp.gate_proj.weight"], sd[f"{p}mlp.up_proj.weight"]], dim=0
        )
        for name in _SAME_NAME_IN_LAYER:
            yield f"layers.{i}.{name}.weight", sd[f"{p}{name}.weight"]
