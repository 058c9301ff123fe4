"""GGUF files of the newer families (qwen3, qwen3moe, gemma2, gemma3, phi3, llama with
experts) load into the same model as their Hugging Face folder: the tiny HF weights are
written to GGUF the way llama.cpp's converter writes them (tensor names from the `gguf`
package's own name map, Q/K permuted for llama, Gemma norms as 1 + w, experts stacked per
projection, Phi-3 LongRoPE factors as tensors), and the logits must be equal."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from support import write_tiny_model
from test_families import FAMILIES, stacked_layout
from test_gguf import model_metadata, write_gguf

from spruce.runtime.errors import ModelLoadError
from spruce.runtime.executor.model_runner import ForwardItem, ModelRunner
from spruce.runtime.models.loading.loader import load_model

V = gguf.GGUFValueType
ARCH_ENUM = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}
GEMMA_SCALAR = {"query_pre_attn_scalar": 16}  # head_dim: what llama.cpp assumes below 27B
CASES = {  # family -> (llama.cpp architecture, HF config overrides)
    "qwen3": ("qwen3", {}),
    "qwen3-moe": ("qwen3moe", {"mlp_only_layers": []}),
    "mixtral": ("llama", {}),
    "gemma2": ("gemma2", GEMMA_SCALAR),
    "gemma3": ("gemma3", GEMMA_SCALAR),
    "phi3-longrope": ("phi3", {}),
}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    head_pairs = w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
    return head_pairs.swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(arch: str, state: dict[str, torch.Tensor], config: dict) -> dict:
    names = gguf.get_tensor_name_map(ARCH_ENUM[arch], config["num_hidden_layers"])
    out = {}
    for name, tensor in state.items():
        base = name.removesuffix(".weight")
        if base.endswith("experts.gate_up_proj"):  # transformers stacks gate and up together
            gate, up = tensor.chunk(2, dim=1)
            out[names.get_name(base.replace("gate_up_proj", "gate_proj")) + ".weight"] = gate
            out[names.get_name(base.replace("gate_up_proj", "up_proj")) + ".weight"] = up
            continue
        gguf_name = names.get_name(base)
        assert gguf_name is not None, f"no llama.cpp name for {name}"
        if arch == "llama" and gguf_name.endswith(("attn_q", "attn_k")):
            heads = config[
                "num_attention_heads" if gguf_name.endswith("q") else "num_key_value_heads"
            ]
            tensor = torch.from_numpy(llama_cpp_permute(tensor.numpy(), heads))
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            tensor = tensor + 1
        out[gguf_name + ".weight"] = tensor
    return {name: (np.ascontiguousarray(t.float().numpy()), None) for name, t in out.items()}


def metadata(arch: str, config: dict) -> dict:
    u32, f32 = V.UINT32, V.FLOAT32
    rope = config.get("rope_parameters", {})
    meta = {
        "block_count": (config["num_hidden_layers"], u32),
        "context_length": (config["max_position_embeddings"], u32),
        "embedding_length": (config["hidden_size"], u32),
        "feed_forward_length": (config["intermediate_size"], u32),
        "attention.head_count": (config["num_attention_heads"], u32),
        "attention.head_count_kv": (config["num_key_value_heads"], u32),
        "attention.key_length": (config["head_dim"], u32),
        "attention.layer_norm_rms_epsilon": (config["rms_norm_eps"], f32),
        "rope.freq_base": (rope.get("rope_theta", 10000.0), f32),
    }
    if config.get("num_local_experts"):
        meta["expert_count"] = (config["num_local_experts"], u32)
        meta["expert_used_count"] = (config["num_experts_per_tok"], u32)
        if config.get("moe_intermediate_size"):
            meta["expert_feed_forward_length"] = (config["moe_intermediate_size"], u32)
    if arch.startswith("gemma"):
        meta["attention.sliding_window"] = (config["sliding_window"], u32)
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if config.get(key):
                meta[key] = (config[key], f32)
    if arch == "gemma3":
        full, local = rope["full_attention"], rope["sliding_attention"]
        meta["rope.freq_base"] = (full["rope_theta"], f32)
        meta["rope.freq_base_swa"] = (local["rope_theta"], f32)
        meta["rope.scaling.type"] = ("linear", V.STRING)
        meta["rope.scaling.factor"] = (full["factor"], f32)
        meta["attention.sliding_window_pattern"] = (2, u32)
    if arch == "phi3":
        meta["attention.sliding_window"] = (config["sliding_window"], u32)
        meta["rope.dimension_count"] = (
            int(config["head_dim"] * rope["partial_rotary_factor"]),
            u32,
        )
        meta["rope.scaling.original_context_length"] = (
            rope["original_max_position_embeddings"],
            u32,
        )
    return {f"{arch}.{key}": (value, kind, None) for key, (value, kind) in meta.items()}


def write_family_gguf(tmp_path, family: str) -> tuple:
    import json

    arch, overrides = CASES[family]
    hf_arch, family_overrides = FAMILIES[family]
    folder = write_tiny_model(tmp_path / "hf", hf_arch, seed=11, **(family_overrides | overrides))
    config = json.loads((folder / "config.json").read_text())
    tensors = gguf_tensors(
        arch, stacked_layout(load_file(str(folder / "model.safetensors"))), config
    )
    if arch == "phi3":
        rope = config["rope_parameters"]
        for kind in ("short", "long"):
            tensors[f"rope_factors_{kind}.weight"] = (
                np.array(rope[f"{kind}_factor"], dtype=np.float32),
                None,
            )
    merges = {"tokenizer.ggml.merges": (["a b"], V.ARRAY, V.STRING)}
    meta = {k: v for k, v in model_metadata(arch, **merges).items() if not k.startswith(f"{arch}.")}
    meta |= metadata(arch, config)
    return write_gguf(tmp_path / f"{family}.gguf", arch, tensors, meta), folder


def logits_of(loaded, ids):
    runner = ModelRunner(loaded, num_slots=256, max_requests=2, max_context_len=128)
    item = ForwardItem(
        runner.req_to_token.alloc_row(), 0, ids, runner.pool.alloc(len(ids)), all_logits=True
    )
    return runner.forward([item]).logits


@pytest.mark.parametrize("family", sorted(CASES))
def test_gguf_equals_hf_folder(tmp_path, family):
    path, folder = write_family_gguf(tmp_path, family)
    from_gguf, from_hf = load_model(str(path)), load_model(str(folder))
    assert from_gguf.config.architecture == from_hf.config.architecture
    assert from_gguf.config.layer_windows == from_hf.config.layer_windows
    ids = [3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 2, 4, 6]  # longer than the windows
    torch.testing.assert_close(
        logits_of(from_gguf, ids), logits_of(from_hf, ids), atol=1e-5, rtol=0
    )


def test_unknown_gguf_architecture_names_the_supported_ones(tmp_path):
    tensors = {"token_embd.weight": (np.zeros((40, 64), dtype=np.float32), None)}
    path = write_gguf(
        tmp_path / "x.gguf", "mamba", tensors, {"mamba.block_count": (2, V.UINT32, None)}
    )
    supported = "llama, qwen2, qwen3, qwen3moe, gemma2, gemma3, phi3"
    match = rf"GGUF architecture 'mamba' is not supported \(supported: {supported}\)"
    with pytest.raises(ModelLoadError, match=match):
        load_model(str(path))
