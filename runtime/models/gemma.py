"""Gemma 2 and Gemma 3 (text): embeddings scaled by sqrt(hidden), RMSNorm as x * (1 + w)
(the 1 is added to the weights at load, so the shared norm runs unchanged), GeLU-tanh MLP
(from `hidden_activation`), norms before and after both attention and MLP, attention
and final logit soft-capping, query scale 1 / sqrt(query_pre_attn_scalar), and sliding-
window layers alternating with global ones (the attention backend takes both from the
model's `attention_options`). Gemma 3 adds q/k norms and a local rope base for its
sliding layers (`ModelConfig.local_rope`)."""

from __future__ import annotations

import torch

from spruce.runtime.models.config import ModelConfig
from spruce.runtime.models.layers import (
    Attention,
    DecoderLayer,
    DecoderModel,
    QKNormAttention,
    RMSNorm,
)


class SandwichDecoderLayer(DecoderLayer):
    def __init__(self, config: ModelConfig, attention: Attention, mlp) -> None:
        super().__init__(config, attention, mlp)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, residual, positions, backend, ctx):
        """(this layer's normed MLP output, the residual stream before it)."""
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, positions, backend, ctx)
        h, _ = self.post_attention_layernorm(h)
        h, residual = self.pre_feedforward_layernorm(h, residual)
        h, _ = self.post_feedforward_layernorm(self.mlp(h))
        return h, residual


class Gemma2ForCausalLM(DecoderModel):
    layer_cls = SandwichDecoderLayer

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)

    def cap_logits(self, logits: torch.Tensor) -> torch.Tensor:
        cap = self.config.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def load_hf_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        shifted = {k: (v + 1 if k.endswith("norm.weight") else v) for k, v in state_dict.items()}
        super().load_hf_weights(shifted)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    attention_cls = QKNormAttention
