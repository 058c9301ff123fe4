"""Model registry: Hugging Face architecture name -> model class."""

from __future__ import annotations

from torch import nn

from spruce.runtime.errors import ModelLoadError
from spruce.runtime.models.config import ModelConfig
from spruce.runtime.models.llama import LlamaForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,  # q/k/v bias comes from ModelConfig.qkv_bias
}


def model_class(config: ModelConfig) -> type[nn.Module]:
    try:
        return MODEL_REGISTRY[config.architecture]
    except KeyError:
        known = ", ".join(sorted(MODEL_REGISTRY))
        raise ModelLoadError(f"unknown architecture {config.architecture!r} (supported: {known})") from None
