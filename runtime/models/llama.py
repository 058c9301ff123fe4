"""Llama-family decoder (Llama 2/3, SmolLM2/3, Mistral, Qwen2, Phi-3): the shared decoder
as it is. Differences among these families are configuration only: q/k/v bias (Qwen2),
sliding windows (Mistral), fused checkpoint weights and LongRoPE (Phi-3), layers without
rotary (SmolLM3)."""

from __future__ import annotations

from spruce.runtime.models.layers import DecoderModel


class LlamaForCausalLM(DecoderModel):
    pass
