"""Qwen3: the Llama decoder with RMSNorm over each head of q and k (before rotary)."""

from __future__ import annotations

from spruce.runtime.models.layers import DecoderModel, QKNormAttention


class Qwen3ForCausalLM(DecoderModel):
    attention_cls = QKNormAttention
