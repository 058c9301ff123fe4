"""Model registry: Hugging Face architecture name -> model class."""

from __future__ import annotations

from torch import nn

from spruce.runtime.errors import ModelLoadError
from spruce.runtime.models.config import ModelConfig
from spruce.runtime.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from spruce.runtime.models.llama import LlamaForCausalLM
from spruce.runtime.models.moe import MixtralForCausalLM, MoeDecoderModel, Qwen3MoeForCausalLM
from spruce.runtime.models.qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,  # sliding window from ModelConfig.layer_windows
    "Qwen2ForCausalLM": LlamaForCausalLM,  # q/k/v bias comes from ModelConfig.qkv_bias
    "Phi3ForCausalLM": LlamaForCausalLM,  # fused checkpoint weights, LongRoPE (models/rope.py)
    "SmolLM3ForCausalLM": LlamaForCausalLM,  # no-rope layers from ModelConfig.rope_layers
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
}


def model_class(config: ModelConfig) -> type[nn.Module]:
    try:
        cls = MODEL_REGISTRY[config.architecture]
    except KeyError:
        known = ", ".join(sorted(MODEL_REGISTRY))
        raise ModelLoadError(
            f"unknown architecture {config.architecture!r} (supported: {known})"
        ) from None
    if (config.moe is not None) != issubclass(cls, MoeDecoderModel):
        has = "has" if config.moe is not None else "lacks"
        raise ModelLoadError(
            f"{config.architecture}: config.json {has} experts (num_local_experts / num_experts)"
        )
    return cls
