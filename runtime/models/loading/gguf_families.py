"""What each llama.cpp architecture means in Hugging Face terms: its HF class, tensor roles
that differ from llama's, and the config.json keys read from its metadata.

Conventions of llama.cpp's convert_hf_to_gguf.py undone here: llama (and Mixtral, a llama
file with experts) Q/K rows interleaved for rope; Gemma norm weights stored as 1 + w;
experts stacked per projection (`ffn_{gate,up,down}_exps`, [E, rows, cols]); Phi-3's
fused `attn_qkv` and `ffn_up` (gate and up); LongRoPE factors as `rope_factors_{short,long}`
tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from spruce.runtime.errors import ModelLoadError

Get = Callable[..., Any]


@dataclass(frozen=True, slots=True)
class GGUFArchitecture:
    hf_class: str
    model_type: str
    permuted_qk: bool = False  # llama.cpp's converter interleaves Q/K rows for rope (llama only)
    layer_names: dict[str, str] = field(default_factory=dict)  # roles that differ from llama's
    norm_shift: float = 0.0  # subtracted from every norm weight (Gemma stores 1 + w)
    config: Callable[[Get, dict], dict] | None = None  # extra config.json keys from metadata


def _experts(get: Get, config: dict) -> dict:
    count = get("expert_count", 0)
    if not count:
        return {}
    return {
        "num_local_experts": count,
        "num_experts_per_tok": get("expert_used_count"),
        "moe_intermediate_size": get("expert_feed_forward_length", config["intermediate_size"]),
        "norm_topk_prob": bool(get("expert_weights_norm", True)),
    }


def _llama(get: Get, config: dict) -> dict:
    extra = _experts(get, config)
    if extra:  # Mixtral: a llama file with experts
        extra |= {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral"}
        extra.pop("moe_intermediate_size")
    return extra


def _query_scalar(get: Get, config: dict, big_model_layers: int) -> float:
    """llama.cpp scales queries by 1 / sqrt(head_dim), except for the 27B models, which use
    hidden / heads (as their HF query_pre_attn_scalar); `attention.scale` overrides both."""
    scale = get("attention.scale", None)
    if scale:
        return 1.0 / scale**2
    if config["num_hidden_layers"] == big_model_layers:
        return config["hidden_size"] / config["num_attention_heads"]
    return config["head_dim"]


def _gemma(get: Get, config: dict, big_model_layers: int, sliding: Callable[[int], bool]) -> dict:
    layers = config["num_hidden_layers"]
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": _query_scalar(get, config, big_model_layers),
        "sliding_window": get("attention.sliding_window"),
        "layer_types": [
            "sliding_attention" if sliding(i) else "full_attention" for i in range(layers)
        ],
        "attn_logit_softcapping": get("attn_logit_softcapping", None),
        "final_logit_softcapping": get("final_logit_softcapping", None),
    }


def _gemma2(get: Get, config: dict) -> dict:
    return _gemma(get, config, 46, lambda i: i % 2 == 0)


def _gemma3(get: Get, config: dict) -> dict:
    pattern = get("attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):  # newer files: one flag per layer, True = sliding
        sliding = lambda i: bool(pattern[i])  # noqa: E731
    else:
        sliding = lambda i: (i + 1) % pattern != 0  # noqa: E731
    extra = _gemma(get, config, 62, sliding)
    extra["rope_local_base_freq"] = float(get("rope.freq_base_swa", 10000.0))
    return extra


def _phi3(get: Get, config: dict) -> dict:
    extra = {
        "partial_rotary_factor": get("rope.dimension_count", config["head_dim"])
        / config["head_dim"]
    }
    window = get("attention.sliding_window", None)
    if window:
        extra["sliding_window"] = window
    return extra


def longrope_scaling(short, long, get: Get) -> dict:
    """HF `rope_scaling` of a Phi-3 file from its rope_factors_{short,long} tensors."""
    scaling = {
        "rope_type": "longrope",
        "short_factor": [float(x) for x in short],
        "long_factor": [float(x) for x in long],
        "original_max_position_embeddings": get("rope.scaling.original_context_length"),
    }
    attention_factor = get("rope.scaling.attn_factor", None)
    if attention_factor is not None:
        scaling["attention_factor"] = float(attention_factor)
    return scaling


_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_SANDWICH = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_EXPERT_ROLES = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",  # merged into experts.gate_up_proj afterwards
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}

ARCHITECTURES = {
    "llama": GGUFArchitecture("LlamaForCausalLM", "llama", True, _EXPERT_ROLES, config=_llama),
    "qwen2": GGUFArchitecture("Qwen2ForCausalLM", "qwen2"),
    "qwen3": GGUFArchitecture("Qwen3ForCausalLM", "qwen3", layer_names=_QK_NORMS),
    "qwen3moe": GGUFArchitecture(
        "Qwen3MoeForCausalLM", "qwen3_moe", layer_names=_QK_NORMS | _EXPERT_ROLES, config=_experts
    ),
    "gemma2": GGUFArchitecture(
        "Gemma2ForCausalLM", "gemma2", layer_names=_SANDWICH, norm_shift=1.0, config=_gemma2
    ),
    "gemma3": GGUFArchitecture(
        "Gemma3ForCausalLM",
        "gemma3_text",
        layer_names=_SANDWICH | _QK_NORMS,
        norm_shift=1.0,
        config=_gemma3,
    ),
    "phi3": GGUFArchitecture(
        "Phi3ForCausalLM",
        "phi3",
        layer_names={"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
        config=_phi3,
    ),
}


def architecture(name: str | None, path: str) -> GGUFArchitecture:
    arch = ARCHITECTURES.get(name or "")
    if arch is None:
        raise ModelLoadError(
            f"{path}: GGUF architecture {name!r} is not supported (supported: {', '.join(ARCHITECTURES)})"
        )
    return arch
