"""The decoder every supported family is built from, in torch.

`DecoderModel` is the Llama-shaped decoder (Llama 2/3, SmolLM2/3, Mistral, Qwen2, Phi-3):
Q/K/V and gate/up projections fused into one matmul each, attention through the configured
backend (which reads and writes the token-granular KV pool), the residual stream added
inside each norm (norm(x + residual) returns the new residual too). A family changes it by
class attributes and small overrides (`attention_cls`, `layer_cls`, `make_mlp`, `embed`,
`cap_logits`), never by flags tested in the per-layer loop. On the CPU in float32, the
residual add + norm, SiLU * up and rotary run as C kernels (executor/kernels/cpu_layer_ops.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from spruce.runtime.executor.attention.base import (
    AttentionBackend,
    AttentionOptions,
    ForwardContext,
)
from spruce.runtime.executor.kernels import cpu_layer_ops, cpu_quant_ops
from spruce.runtime.models.config import ModelConfig
from spruce.runtime.models.decode_plan import PlainKinds
from spruce.runtime.models.decode_plan import build as build_decode_plan
from spruce.runtime.models.loading.quantize import QuantizedTensor
from spruce.runtime.models.rope import RopeConfig, check_rope, rope_tables, rotary_dim
from spruce.runtime.models.weights import load_hf_state_dict


class Linear(nn.Linear):
    """nn.Linear whose batch-1 decode (a few rows) on the CPU streams the weights in C."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_layer_ops.linear(x, self.weight, self.bias)


class Embedding(nn.Embedding):
    def as_linear(self, x: torch.Tensor) -> torch.Tensor:
        """x @ table.T: the output projection of a model with tied embeddings."""
        return cpu_layer_ops.linear(x, self.weight)


class QuantizedLinear(nn.Module):
    """A linear layer on weights kept in a llama.cpp block format (CPU only): decode rows
    meet the weights in integer dot products (executor/kernels/cpu_quant_ops.py)."""

    def __init__(
        self, qtype: str, in_features: int, out_features: int, bias: nn.Parameter | None
    ) -> None:
        super().__init__()
        self.qtype, self.in_features, self.out_features = qtype, in_features, out_features
        row_bytes = cpu_quant_ops.row_bytes(qtype, in_features)
        self.register_buffer("blocks", torch.empty(out_features, row_bytes, dtype=torch.uint8))
        self.bias = bias

    def load_quantized(self, weight: QuantizedTensor) -> None:
        if (weight.qtype, weight.shape) != (self.qtype, (self.out_features, self.in_features)):
            raise ValueError(
                f"quantized weight {weight.qtype} {weight.shape} does not fit "
                f"{self.qtype} {(self.out_features, self.in_features)}"
            )
        self.blocks = weight.blocks.contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = cpu_quant_ops.linear(
            x.float().reshape(-1, self.in_features), self.qtype, self.blocks, self.bias
        )
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


class QuantizedEmbedding(QuantizedLinear):
    """An embedding table kept quantized: rows are dequantized as they are looked up, and
    the table serves as the output projection of tied models."""

    def __init__(
        self, qtype: str, num_embeddings: int, embedding_dim: int, dtype: torch.dtype
    ) -> None:
        super().__init__(qtype, embedding_dim, num_embeddings, None)
        self.dtype = dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        flat = input_ids.dim() == 1  # a step's ids: no reshape or conversion calls
        ids = input_ids if flat else input_ids.reshape(-1)
        rows = cpu_quant_ops.dequantize(self.qtype, self.blocks, self.in_features, ids)
        rows = rows if rows.dtype == self.dtype else rows.to(self.dtype)
        return rows if flat else rows.reshape(*input_ids.shape, self.in_features)

    def as_linear(self, x: torch.Tensor) -> torch.Tensor:
        return QuantizedLinear.forward(self, x)


def quantized_module(
    module: nn.Module, weight: QuantizedTensor, dtype: torch.dtype
) -> nn.Module | None:
    """The quantized replacement of a Linear or Embedding module for `weight` (None for
    other modules: their weights are dequantized)."""
    n, k = weight.shape
    if isinstance(module, nn.Embedding):
        return QuantizedEmbedding(weight.qtype, n, k, dtype)
    if isinstance(module, nn.Linear):
        return QuantizedLinear(weight.qtype, k, n, module.bias)
    return None


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
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
    """Rotate-half rotary embedding with a precomputed cos/sin table over positions (the
    first `rotary_dim` dims of each head when partial)."""

    def __init__(self, config: ModelConfig, rope: RopeConfig) -> None:
        super().__init__()
        check_rope(rope, config.head_dim)
        self.config, self.rope = config, rope
        self.dim = rotary_dim(rope, config.head_dim)
        self.cos = self.sin = None  # built by build(device) after the weights are placed

    def build(self, device: torch.device) -> None:
        # float32, the way transformers computes it; plain attributes, not buffers, so they
        # stay float32 when the model moves to bf16.
        self.cos, self.sin = rope_tables(
            self.rope, self.config.head_dim, self.config.max_position_embeddings, device
        )

    def forward(self, positions: torch.Tensor, qkv: torch.Tensor):
        """qkv [N, q_size + 2 * kv_size] -> q, k (rotated), v as [N, heads, head_dim] views."""
        c = self.config
        in_c = self.dim == c.head_dim and cpu_layer_ops.usable(qkv)
        if in_c:
            cpu_layer_ops.rotary_(
                qkv, c.num_heads + c.num_kv_heads, c.head_dim, positions, self.cos, self.sin
            )
        q, k, v = split_heads(c, qkv)
        if not in_c:
            q, k = self._rotate_torch(positions, q, k)
        return q, k, v

    def rotate(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """Rotates contiguous q [N, heads, D] and k [N, kv_heads, D]; returns them."""
        if self.dim == self.config.head_dim and cpu_layer_ops.usable(q):
            for x in (q, k):
                cpu_layer_ops.rotary_(
                    x.view(x.shape[0], -1), x.shape[1], x.shape[2], positions, self.cos, self.sin
                )
            return q, k
        return self._rotate_torch(positions, q, k)

    def _rotate_torch(self, positions, q, k):
        cos, sin = self.cos[positions][:, None, :], self.sin[positions][:, None, :]
        if self.dim == self.config.head_dim:
            return _rotate(q, cos, sin), _rotate(k, cos, sin)
        d = self.dim
        rotated = [torch.cat((_rotate(x[..., :d], cos, sin), x[..., d:]), dim=-1) for x in (q, k)]
        return rotated[0], rotated[1]


class NoRotary(Rotary):
    """A layer without position rotation (SmolLM3's no-rope layers)."""

    def build(self, device: torch.device) -> None:
        pass

    def forward(self, positions, qkv):
        return split_heads(self.config, qkv)

    def rotate(self, positions, q, k):
        return q, k


def split_heads(c: ModelConfig, qkv: torch.Tensor):
    q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)
    return (
        q.view(-1, c.num_heads, c.head_dim),
        k.view(-1, c.num_kv_heads, c.head_dim),
        v.view(-1, c.num_kv_heads, c.head_dim),
    )


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, rotary: Rotary) -> None:
        super().__init__()
        self.layer = layer
        self.config = config
        self.rotary = rotary  # shared by the layers of one rope kind; holds no weights
        self.qkv_proj = Linear(
            config.hidden_size, config.q_size + 2 * config.kv_size, bias=config.qkv_bias
        )
        self.o_proj = Linear(config.q_size, config.hidden_size, bias=False)

    def forward(self, x, positions, backend: AttentionBackend, ctx: ForwardContext):
        q, k, v = self.rotary(positions, self.qkv_proj(x))
        o = backend.forward(q, k, v, self.layer, ctx)
        return self.o_proj(o.reshape(-1, self.config.q_size))


class QKNormAttention(Attention):
    """RMSNorm over each head of q and k before the rotation (Qwen3, Gemma 3)."""

    def __init__(self, config: ModelConfig, layer: int, rotary: Rotary) -> None:
        super().__init__(config, layer, rotary)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def forward(self, x, positions, backend, ctx):
        q, k, v = split_heads(self.config, self.qkv_proj(x))
        q, k = self.rotary.rotate(positions, self.q_norm(q)[0], self.k_norm(k)[0])
        o = backend.forward(q, k, v, self.layer, ctx)
        return self.o_proj(o.reshape(-1, self.config.q_size))


class MLP(nn.Module):
    """down(silu(gate) * up)."""

    def __init__(self, config: ModelConfig, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = Linear(config.hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if cpu_layer_ops.usable(gate_up):
            return self.down_proj(cpu_layer_ops.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class GeluTanhMLP(MLP):
    """down(gelu_tanh(gate) * up) (Gemma)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


MLPS = {"silu": MLP, "gelu_tanh": GeluTanhMLP}


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, attention: Attention, mlp: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = attention
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp

    def forward(self, x, residual, positions, backend, ctx):
        """(this layer's MLP output, the residual stream before it)."""
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, positions, backend, ctx)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class DecoderModel(nn.Module):
    """forward(input_ids [N], ctx, backend, logits_rows) -> logits [len(logits_rows), vocab].

    The model holds weights only; the attention backend (and its KV pool) is passed per
    call, so engines can share one model. `attention_options` is what the backend must
    implement for this model; `capturable` says whether a decode step may be captured in a
    CUDA graph (no host synchronisation inside)."""

    attention_cls: type[Attention] = Attention
    layer_cls: type[DecoderLayer] = DecoderLayer
    capturable = True

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.attention_options = AttentionOptions(
            config.attention_scale, config.layer_windows, config.attn_logit_softcap
        )
        self.rotaries = nn.ModuleDict(self._rotaries(config))
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            self.layer_cls(
                config, self.attention_cls(config, i, self._rotary_of(i)), self.make_mlp(config, i)
            )
            for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else Linear(config.hidden_size, config.vocab_size, bias=False)
        )

    @staticmethod
    def _rotaries(config: ModelConfig) -> dict[str, Rotary]:
        rotaries = {"global": Rotary(config, config.rope)}
        if config.local_rope is not None and config.layer_windows:
            rotaries["local"] = Rotary(config, config.local_rope)
        if config.rope_layers and not all(config.rope_layers):
            rotaries["none"] = NoRotary(config, config.rope)
        return rotaries

    def _rotary_of(self, layer: int) -> Rotary:
        c = self.config
        if c.rope_layers and not c.rope_layers[layer]:
            return self.rotaries["none"]
        if "local" in self.rotaries and c.window(layer) is not None:
            return self.rotaries["local"]
        return self.rotaries["global"]

    def make_mlp(self, config: ModelConfig, layer: int) -> nn.Module:
        return MLPS[config.hidden_act](config, config.intermediate_size)

    def build_rotary(self, device: torch.device) -> None:
        """Computes the rotary tables (not loaded) once the model is on its device."""
        for rotary in self.rotaries.values():
            rotary.build(device)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def cap_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def forward(
        self,
        input_ids: torch.Tensor,
        ctx: ForwardContext,
        backend: AttentionBackend,
        logits_rows: torch.Tensor | None,
    ) -> torch.Tensor:
        x, plan = self._begin(input_ids, ctx, backend)
        residual = None
        if plan is not None and plan.ends_with_head(ctx, logits_rows):
            return self.cap_logits(plan.logits(x, ctx, backend))
        if plan is not None:
            x, residual = plan.run(x, ctx, backend)
        for layer in self.layers if plan is None else ():
            x, residual = layer(x, residual, ctx.positions, backend, ctx)
        if ctx.hidden_rows is not None:  # embeddings: the final hidden states of these rows
            rows = ctx.hidden_rows
            ctx.hidden = self.norm(x[rows], residual[rows])[0]
        if logits_rows is not None:
            x, residual = x[logits_rows], residual[logits_rows]
        x, _ = self.norm(x, residual)
        head = self.embed_tokens.as_linear if self.lm_head is None else self.lm_head
        return self.cap_logits(head(x))

    def decode_steps(
        self,
        input_ids: torch.Tensor,
        ctx: ForwardContext,
        backend: AttentionBackend,
        slots: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Greedy decoding `slots.shape[1]` steps of a decode batch in one C call
        (DecodePlan.decode_steps: the chosen ids and their logits, [steps, rows]), or None
        where the plan does not serve the step (the caller steps through `forward`)."""
        embedding = self._embedding_table()
        if embedding is None:
            return None
        x, plan = self._begin(input_ids, ctx, backend)
        if plan is None or not plan.ends_with_head(ctx, None):
            return None
        return plan.decode_steps(x, ctx, backend, slots, embedding)

    def _begin(self, input_ids: torch.Tensor, ctx: ForwardContext, backend: AttentionBackend):
        """A pass's start: the backend prepared, the embeddings, the step's decode plan."""
        backend.prepare(ctx)
        x = self.embed(input_ids)
        return x, self._decode_plan(backend, ctx, x)

    def _embedding_table(self) -> tuple[int, int] | None:
        """(ggml type id, or -1 for float32 rows; pointer) of the embedding table, where the
        model's own lookup is the plain one and its logits are not capped; else None."""
        plain = type(self).embed is DecoderModel.embed
        if not plain or type(self).cap_logits is not DecoderModel.cap_logits:
            return None
        table = self.embed_tokens
        if type(table) is QuantizedEmbedding and table.dtype == torch.float32:
            return cpu_quant_ops.QUANT_TYPES[table.qtype].ggml_id, table.blocks.data_ptr()
        weight = table.weight if type(table) is Embedding else None
        if weight is not None and weight.dtype == torch.float32 and weight.is_contiguous():
            return -1, weight.data_ptr()
        return None

    def _decode_plan(self, backend: AttentionBackend, ctx: ForwardContext, x: torch.Tensor):
        """The C-only decode path for this step (models/decode_plan.py), or None."""
        plan = self.__dict__.get("_plan")
        if plan is None or (plan and not plan.holds_weights_of(self)):  # first step, new weights
            plan = self.__dict__["_plan"] = build_decode_plan(self, PLAIN_KINDS) or False
        return plan if plan and plan.applies(backend, ctx, x) else None

    def use_quantized_weights(
        self, weights: dict[str, QuantizedTensor], dtype: torch.dtype
    ) -> None:
        """Replaces (before the weights are loaded) each Linear / Embedding module whose
        weight `<module>.weight` is in `weights` by its quantized counterpart; `dtype` is
        the model's (embedding rows come out in it)."""
        for name, module in list(self.named_modules()):
            weight = weights.get(f"{name}.weight")
            replacement = None if weight is None else quantized_module(module, weight, dtype)
            if replacement is not None:
                parent, _, attr = name.rpartition(".")
                setattr(self.get_submodule(parent), attr, replacement)

    def load_hf_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Loads Hugging Face parameter names (split or fused q/k/v and gate/up, experts one
        by one or stacked); strict."""
        load_hf_state_dict(self, state_dict)


PLAIN_KINDS = PlainKinds(DecoderLayer, Attention, Rotary, MLP, RMSNorm, QuantizedLinear)
