"""A GGUF file in Hugging Face terms: `gguf_to_hf(file, dtype)` -> (config.json dict, state
dict with HF parameter names and layouts), for the llama.cpp architectures Spruce runs
(gguf_families.py says what differs per architecture)."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

from spruce.runtime.errors import ModelLoadError
from spruce.runtime.models.loading.gguf import GGUFFile
from spruce.runtime.models.loading.gguf_families import (
    GGUFArchitecture,
    architecture,
    longrope_scaling,
)

# ---------------------------------------------------------------------------------------
# Hugging Face view: config.json dict + state dict
# ---------------------------------------------------------------------------------------


_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_ROPE_FREQS = "rope_freqs.weight"
_LONGROPE = ("rope_factors_short.weight", "rope_factors_long.weight")
_FOLDED = {_ROPE_FREQS, *_LONGROPE}  # tensors that become config, not weights
_REQUIRED = object()


def gguf_to_hf(
    f: GGUFFile, dtype: torch.dtype, keep_quantized: bool = False
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A Hugging Face `config.json` dict and a state dict (HF names, HF row order, `dtype`).

    llama files get their Q/K rows un-permuted back to HF's rotate-half layout;
    `lm_head.weight` is present only when the file has `output.weight` (else tied).
    With `keep_quantized`, quantized 2-D tensors come as `QuantizedTensor`s: as stored
    where the kernels compute on their type, else requantized to Q8_0."""
    arch_name = f.metadata.get("general.architecture")
    arch = architecture(arch_name, f.path)
    config = _hf_config(f, arch_name, arch, dtype)
    read = _quantized_reader(f, dtype) if keep_quantized else (lambda name: f.tensor(name, dtype))
    return config, _hf_state_dict(f, config, arch, read)


def _quantized_reader(f: GGUFFile, dtype: torch.dtype) -> Callable[[str], Any]:
    from spruce.runtime.models.loading.quantize import QUANT_TYPES, QuantizedTensor, quantize

    def read(name: str) -> torch.Tensor | QuantizedTensor:
        info = f.tensors[name]
        if len(info.shape) != 2 or info.ggml_type.block_size == 1:
            return f.tensor(name, dtype)  # float tensors, and stacked experts, stay float
        qtype = info.ggml_type.name.lower()
        if qtype not in QUANT_TYPES:  # no kernel for it (Q5_0, Q2_K, ...)
            return quantize(f.tensor(name), "q8_0")
        return QuantizedTensor(qtype, info.shape, f.blocks(name))

    return read


def _hf_config(f: GGUFFile, arch_name: str, arch: GGUFArchitecture, dtype: torch.dtype) -> dict:
    meta, prefix = f.metadata, arch_name + "."

    def get(key: str, default: Any = _REQUIRED) -> Any:
        if prefix + key in meta:
            return meta[prefix + key]
        if default is _REQUIRED:
            raise ModelLoadError(f"{f.path}: the GGUF metadata lacks {prefix + key!r}")
        return default

    hidden, heads = get("embedding_length"), get("attention.head_count")
    config = {
        "architectures": [arch.hf_class],
        "model_type": arch.model_type,
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "head_dim": get("attention.key_length", hidden // heads),
        "rms_norm_eps": _shortest(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": _shortest(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": get("context_length"),
        "vocab_size": _vocab_size(f, get),
        "tie_word_embeddings": "output.weight" not in f.tensors,
        "attention_bias": "blk.0.attn_q.bias" in f.tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    rope_scaling = _rope_scaling(f, get, config)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    if arch.config is not None:
        config.update(arch.config(get, config))
    return config


def _shortest(value: float) -> float:
    """A float32 metadata value as its shortest decimal (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))


def _vocab_size(f: GGUFFile, get: Callable[..., Any]) -> int:
    embed = f.tensors.get("token_embd.weight")
    if embed is not None:
        return embed.shape[0]
    return get("vocab_size", None) or len(f.metadata.get("tokenizer.ggml.tokens", ()))


def _rope_scaling(f: GGUFFile, get: Callable[..., Any], config: dict) -> dict | None:
    """HF `rope_scaling` from `{arch}.rope.scaling.*` (linear, yarn) or, for llama3-style
    scaling, from the `rope_freqs.weight` tensor llama.cpp writes instead of metadata."""
    if all(name in f.tensors for name in _LONGROPE):
        short, long = (f.tensor(name).double().tolist() for name in _LONGROPE)
        return longrope_scaling(short, long, get)
    kind = get("rope.scaling.type", "none")
    if kind == "linear":
        return {"rope_type": "linear", "factor": _shortest(get("rope.scaling.factor"))}
    if kind == "yarn":
        return {
            "rope_type": "yarn",
            "factor": _shortest(get("rope.scaling.factor")),
            "original_max_position_embeddings": get("rope.scaling.original_context_length"),
        }
    if kind != "none":
        raise ModelLoadError(f"{f.path}: rope scaling type {kind!r} is not supported")
    if _ROPE_FREQS not in f.tensors:
        return None
    factors = f.tensor(_ROPE_FREQS).double().numpy()
    return llama3_rope_scaling(factors, config["rope_theta"], config["head_dim"], f.path)


def llama3_rope_scaling(
    factors: np.ndarray, rope_theta: float, head_dim: int, path: str = "GGUF file"
) -> dict | None:
    """Recovers HF's llama3 `rope_scaling` from llama.cpp's per-frequency divisors.

    llama.cpp stores r_i = 1 (short wavelengths), `factor` (long ones) and, in between,
    1 / ((1 - s) / factor + s) with s = old_ctx / ((high - low) * wavelen) - low / (high - low).
    s is linear in 1 / wavelen, so a line fit gives its slope and intercept; any
    (low, high, old_ctx) with those two yields the same frequencies, so low is fixed to 1
    (Llama 3's own value, recovered exactly). The result is checked by recomputing r."""
    factor = float(factors.max())
    if factor <= 1.0:
        return None
    inv_wavelen = 1 / (2 * math.pi * rope_theta ** (np.arange(0, head_dim, 2) / head_dim))
    smooth = (1 / factors - 1 / factor) / (1 - 1 / factor)
    band = (smooth > 1e-4) & (smooth < 1 - 1e-4)
    scaling = None
    slope, intercept = np.polyfit(inv_wavelen[band], smooth[band], 1) if band.sum() >= 2 else (0, 0)
    if intercept < 0:  # low / (high - low) > 0
        high = round(1 - 1 / intercept, 4)
        scaling = {
            "rope_type": "llama3",
            "factor": _shortest(factor),
            "low_freq_factor": 1.0,
            "high_freq_factor": high,
            "original_max_position_embeddings": round(slope * (high - 1)),
        }
    if scaling is None or not np.allclose(llama3_factors(scaling, inv_wavelen), factors, rtol=1e-4):
        raise ModelLoadError(
            f"{path}: {_ROPE_FREQS} does not follow llama3 rope scaling; this rope variant "
            "is not supported"
        )
    return scaling


def llama3_factors(scaling: dict, inv_wavelen: np.ndarray) -> np.ndarray:
    """llama.cpp's rope_freqs values (per-frequency divisors) for a llama3 `rope_scaling`."""
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_ctx, factor = scaling["original_max_position_embeddings"], scaling["factor"]
    smooth = np.clip((old_ctx * inv_wavelen - low) / (high - low), 0.0, 1.0)
    return 1 / ((1 - smooth) / factor + smooth)


def _hf_state_dict(
    f: GGUFFile, config: dict, arch: GGUFArchitecture, read: Callable[[str], Any]
) -> dict[str, Any]:
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    names = _LAYER_NAMES | arch.layer_names
    state = {}
    for name in f.tensor_names:
        if name in _FOLDED:
            continue  # folded into config["rope_scaling"]
        hf_name, role = _hf_name(f.path, name, names, config["model_type"])
        tensor = read(name)
        if arch.permuted_qk and role in heads:
            tensor = (
                tensor.with_blocks(unpermute_qk(tensor.blocks, heads[role]))
                if hasattr(tensor, "qtype")  # a QuantizedTensor: its rows move as wholes
                else unpermute_qk(tensor, heads[role])
            )
        if arch.norm_shift and role.endswith("norm"):
            tensor = tensor - arch.norm_shift
        state[hf_name] = tensor
    _merge_experts(state)
    return state


def _merge_experts(state: dict[str, torch.Tensor]) -> None:
    """Stacked gate and up experts -> transformers' `experts.gate_up_proj` [E, 2 * I, H]."""
    import torch

    for gate_name in [n for n in state if n.endswith(".experts.gate_proj.weight")]:
        prefix = gate_name.removesuffix("gate_proj.weight")
        up = state.pop(prefix + "up_proj.weight", None)
        if up is None:
            raise ModelLoadError(f"GGUF file has {gate_name} but no matching up experts")
        state[prefix + "gate_up_proj"] = torch.cat([state.pop(gate_name), up], dim=1)
        state[prefix + "down_proj"] = state.pop(prefix + "down_proj.weight")


def _hf_name(path: str, name: str, layer_names: dict[str, str], model_type: str) -> tuple[str, str]:
    """GGUF tensor name -> (HF parameter name, GGUF role such as 'attn_q')."""
    base, _, suffix = name.rpartition(".")
    if base in _GLOBAL_NAMES and suffix == "weight":
        return f"{_GLOBAL_NAMES[base]}.weight", base
    match = _LAYER_TENSOR.fullmatch(name)
    if match is None or match[2] not in layer_names:
        raise ModelLoadError(f"{path}: unexpected tensor {name!r} for a {model_type} model")
    layer, role, suffix = match.groups()
    return f"model.layers.{layer}.{layer_names[role]}.{suffix}", role


def unpermute_qk(tensor: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undoes llama.cpp's Q/K row permutation: within each head, interleaved (pair) rows
    back to HF's rotate-half order (first halves, then second halves)."""
    rows = tensor.shape[0]
    return (
        tensor.reshape(n_head, rows // n_head // 2, 2, *tensor.shape[1:])
        .transpose(1, 2)
        .reshape(tensor.shape)
        .contiguous()
    )
