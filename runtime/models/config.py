"""The model's shape, parsed once from a Hugging Face `config.json` dict (keys as
transformers names them, old and new spellings). A feature Spruce does not implement is
refused here with one line, so a model never loads into a different computation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from spruce.runtime.errors import ModelLoadError
from spruce.runtime.models.rope import RopeConfig, rope_config


@dataclass(frozen=True, slots=True)
class MoeConfig:
    """Top-k routed experts: softmax over `num_experts` router logits, keep the top
    `experts_per_token`, optionally renormalised to sum to one."""

    num_experts: int
    experts_per_token: int
    intermediate_size: int
    normalize_top_k: bool
    dense_layers: frozenset[int] = frozenset()  # layers with a plain MLP instead


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
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    rope: RopeConfig = RopeConfig()  # noqa: RUF009 - frozen; global layers (all unless local_rope)
    local_rope: RopeConfig | None = None  # sliding-window layers' rope (Gemma 3)
    rope_layers: tuple[bool, ...] = ()  # False: this layer has no rotary (SmolLM3); () = all
    layer_windows: tuple[int | None, ...] = ()  # sliding window per layer; () = all global
    attention_scale: float | None = None  # None: head_dim ** -0.5
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    hidden_act: str = "silu"
    moe: MoeConfig | None = None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def rope_theta(self) -> float:
        return self.rope.theta

    @property
    def rope_scaling(self):
        return self.rope.scaling

    def window(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> ModelConfig:
        config = _text_model(config)
        architecture = _architecture(config)
        try:
            num_heads = config["num_attention_heads"]
            hidden = config["hidden_size"]
            head_dim = config.get("head_dim") or hidden // num_heads
            layers = config["num_hidden_layers"]
            max_pos = config.get("max_position_embeddings", 2048)
            global_rope, local_rope = rope_config(config, head_dim, max_pos)
            return cls(
                architecture=architecture,
                vocab_size=config["vocab_size"],
                hidden_size=hidden,
                intermediate_size=config["intermediate_size"],
                num_layers=layers,
                num_heads=num_heads,
                num_kv_heads=config.get("num_key_value_heads") or num_heads,
                head_dim=head_dim,
                rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=max_pos,
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                qkv_bias=bool(config.get("attention_bias", architecture.startswith("Qwen2"))),
                rope=global_rope,
                local_rope=local_rope,
                rope_layers=_rope_layers(config, layers),
                layer_windows=_layer_windows(config, layers, max_pos),
                attention_scale=_attention_scale(config),
                attn_logit_softcap=config.get("attn_logit_softcapping"),
                final_logit_softcap=config.get("final_logit_softcapping"),
                hidden_act=_activation(config),
                moe=_moe(config, layers),
            )
        except KeyError as missing:
            raise ModelLoadError(f"config.json lacks the field {missing}") from None


_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
}


def _architecture(config: dict[str, Any]) -> str:
    archs = config.get("architectures") or []
    if archs:
        return archs[0]
    model_type = config.get("model_type", "")
    return _MODEL_TYPES.get(model_type, model_type or "<none>")


# Multimodal checkpoints served as text models: architecture -> (text architecture, the
# defaults transformers fills into its text_config, which config.json files omit).
_TEXT_MODELS = {
    "Gemma3ForConditionalGeneration": (
        "Gemma3ForCausalLM",
        {
            "model_type": "gemma3_text", "vocab_size": 262208, "num_attention_heads": 8,
            "num_key_value_heads": 4, "head_dim": 256, "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0,
            "rope_local_base_freq": 10000.0, "query_pre_attn_scalar": 256, "sliding_window": 4096,
            "sliding_window_pattern": 6, "max_position_embeddings": 131072,
            "hidden_activation": "gelu_pytorch_tanh",
        },
    ),
}  # fmt: skip


def _text_model(config: dict[str, Any]) -> dict[str, Any]:
    """The text part of a multimodal config (images are not served); others unchanged."""
    archs = config.get("architectures") or []
    if not archs or archs[0] not in _TEXT_MODELS:
        return config
    text_arch, defaults = _TEXT_MODELS[archs[0]]
    text = defaults | config.get("text_config", {}) | {"architectures": [text_arch]}
    if "tie_word_embeddings" in config:
        text["tie_word_embeddings"] = config["tie_word_embeddings"]
    return text


_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_tanh": "gelu_tanh",
}


def _activation(config: dict[str, Any]) -> str:
    name = config.get("hidden_activation") or config.get("hidden_act") or "silu"
    if name not in _ACTIVATIONS:
        raise ModelLoadError(
            f"activation {name!r} is not supported (supported: {', '.join(_ACTIVATIONS)})"
        )
    return _ACTIVATIONS[name]


def _attention_scale(config: dict[str, Any]) -> float | None:
    scalar = config.get("query_pre_attn_scalar")
    return None if scalar is None else float(scalar) ** -0.5


def _rope_layers(config: dict[str, Any], layers: int) -> tuple[bool, ...]:
    flags = config.get("no_rope_layers")  # SmolLM3: 1 = this layer uses rope, 0 = it does not
    if not flags:
        return ()
    if len(flags) != layers:
        raise ModelLoadError(f"no_rope_layers has {len(flags)} entries for {layers} layers")
    return tuple(bool(f) for f in flags)


# Older config.json files without `layer_types`: which layers slide, per model type.
_SLIDING_PATTERNS = {
    "gemma2": lambda i, c: i % 2 == 0,
    "gemma3_text": lambda i, c: (i + 1) % c.get("sliding_window_pattern", 6) != 0,
    "qwen2": lambda i, c: i >= c.get("max_window_layers", 0),
    "qwen3": lambda i, c: i >= c.get("max_window_layers", 0),
}


# Published configs whose window exceeds the context (Phi-3-mini-128k, Phi-3.5-mini: 262144
# vs 131072); elsewhere such a window is refused as a broken config.
_WINDOW_BEYOND_CONTEXT_OK = {"phi3"}


def _layer_windows(config: dict[str, Any], layers: int, max_pos: int) -> tuple[int | None, ...]:
    window = config.get("sliding_window")
    if window is None or config.get("use_sliding_window") is False:
        return ()
    types = config.get("layer_types")
    if types is not None:
        if len(types) != layers:
            raise ModelLoadError(f"layer_types has {len(types)} entries for {layers} layers")
        unknown = set(types) - {"sliding_attention", "full_attention"}
        if unknown:
            raise ModelLoadError(f"layer type {sorted(unknown)[0]!r} is not supported")
        sliding = [t == "sliding_attention" for t in types]
    else:
        pattern = _SLIDING_PATTERNS.get(config.get("model_type", ""), lambda i, c: True)
        sliding = [pattern(i, config) for i in range(layers)]
    if not any(sliding):
        return ()
    if (
        isinstance(window, int)
        and window > max_pos
        and config.get("model_type") in _WINDOW_BEYOND_CONTEXT_OK
    ):
        return ()  # it never slides: full attention, as transformers computes it
    if not isinstance(window, int) or window < 1 or window > max_pos:
        raise ModelLoadError(
            f"sliding_window {window!r} must be an integer in 1..max_position_embeddings ({max_pos})"
        )
    return tuple(window if s else None for s in sliding)


def _moe(config: dict[str, Any], layers: int) -> MoeConfig | None:
    experts = config.get("num_local_experts") or config.get("num_experts")
    if not experts:
        return None
    top_k = config.get("num_experts_per_tok", 2)
    if not 1 <= top_k <= experts:
        raise ModelLoadError(
            f"num_experts_per_tok {top_k} must be in 1..{experts} (the number of experts)"
        )
    if config.get("shared_expert_intermediate_size"):
        raise ModelLoadError("shared experts (shared_expert_intermediate_size) are not supported")
    step = config.get("decoder_sparse_step", 1) or 1
    dense = {i for i in range(layers) if (i + 1) % step != 0} | set(
        config.get("mlp_only_layers") or ()
    )
    return MoeConfig(
        num_experts=experts,
        experts_per_token=top_k,
        intermediate_size=config.get("moe_intermediate_size") or config["intermediate_size"],
        normalize_top_k=bool(config.get("norm_topk_prob", "num_local_experts" in config)),
        dense_layers=frozenset(dense),
    )
