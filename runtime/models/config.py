"""The model's shape, parsed once from a Hugging Face `config.json` dict."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from spruce.runtime.errors import ModelLoadError


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Llama 3 style frequency scaling (`rope_type: llama3`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    rope_scaling: RopeScaling | None = None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> "ModelConfig":
        architecture = _architecture(config)
        try:
            num_heads = config["num_attention_heads"]
            hidden = config["hidden_size"]
            return cls(
                architecture=architecture,
                vocab_size=config["vocab_size"],
                hidden_size=hidden,
                intermediate_size=config["intermediate_size"],
                num_layers=config["num_hidden_layers"],
                num_heads=num_heads,
                num_kv_heads=config.get("num_key_value_heads") or num_heads,
                head_dim=config.get("head_dim") or hidden // num_heads,
                rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                rope_theta=float(_rope_theta(config)),
                max_position_embeddings=config.get("max_position_embeddings", 2048),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                qkv_bias=bool(config.get("attention_bias", architecture.startswith("Qwen2"))),
                rope_scaling=_rope_scaling(config),
            )
        except KeyError as missing:
            raise ModelLoadError(f"config.json lacks the field {missing}") from None


def _architecture(config: dict[str, Any]) -> str:
    archs = config.get("architectures") or []
    if archs:
        return archs[0]
    model_type = config.get("model_type", "")
    return {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}.get(
        model_type, model_type or "<none>"
    )


def _rope_params(config: dict[str, Any]) -> dict[str, Any]:
    # transformers >= 5 writes `rope_parameters`; older folders use rope_theta + rope_scaling.
    return config.get("rope_parameters") or config.get("rope_scaling") or {}


def _rope_theta(config: dict[str, Any]) -> float:
    return config.get("rope_theta") or _rope_params(config).get("rope_theta") or 10000.0


def _rope_scaling(config: dict[str, Any]) -> RopeScaling | None:
    params = _rope_params(config)
    kind = params.get("rope_type") or params.get("type")
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise ModelLoadError(f"rope scaling type {kind!r} is not supported (supported: default, llama3)")
    return RopeScaling(
        factor=float(params["factor"]),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )
