"""Every supported family equals transformers on tiny random models (fp32): logits for one
prompt, a batch of different lengths, an extend after a cached prefix and 20 decode steps,
under the C kernels, the torch per-layer operators and the triton backend (interpreter);
greedy tokens through the Engine equal `generate`."""

from __future__ import annotations

import os

import pytest
import torch
import transformers
from support import write_tiny_model

from spruce.runtime import Engine
from spruce.runtime.executor.kernels import cpu_layer_ops, cpu_library
from spruce.runtime.executor.model_runner import ForwardItem, ModelRunner
from spruce.runtime.models.loading.loader import load_model

ATOL = 5e-5
WINDOW = 8  # smaller than every prompt below, so windows slide
LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.75,  # Phi-4-mini rotates 3/4 of each head
    "short_factor": [1.0, 1.1, 1.3, 1.7, 2.3, 3.0],
    "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0],
    "original_max_position_embeddings": 256,
}
FAMILIES = {
    "mistral-sliding": ("mistral", dict(sliding_window=WINDOW)),
    "qwen3": ("qwen3", {}),
    "qwen3-yarn": (  # Qwen3's documented long-context setting, scaled down
        "qwen3",
        dict(
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 32,
                "rope_theta": 10000.0,
            }
        ),
    ),
    "qwen3-moe": (
        "qwen3_moe",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        ),
    ),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
    "gemma2": (
        "gemma2",
        dict(
            sliding_window=WINDOW,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0,
        ),
    ),
    "gemma3": (
        "gemma3",
        dict(
            sliding_window=WINDOW,
            query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
            },
        ),
    ),
    "phi3-longrope": (  # Phi-3-mini-4k slides a window over every layer
        "phi3",
        dict(rope_parameters=LONGROPE, original_max_position_embeddings=256, sliding_window=WINDOW),
    ),
    "smollm3": ("smollm3", dict(no_rope_layers=[1, 0], num_hidden_layers=2)),
}
HF_CLASSES = {
    "mistral": transformers.MistralForCausalLM,
    "qwen3": transformers.Qwen3ForCausalLM,
    "qwen3_moe": transformers.Qwen3MoeForCausalLM,
    "mixtral": transformers.MixtralForCausalLM,
    "gemma2": transformers.Gemma2ForCausalLM,
    "gemma3": transformers.Gemma3ForCausalLM,
    "phi3": transformers.Phi3ForCausalLM,
    "smollm3": transformers.SmolLM3ForCausalLM,
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    arch, overrides = FAMILIES[request.param]
    folder = write_tiny_model(tmp_path_factory.mktemp(request.param), arch, seed=7, **overrides)
    hf = HF_CLASSES[arch].from_pretrained(folder, attn_implementation="eager").eval()
    return request.param, folder, load_model(str(folder)), hf


def make_runner(loaded, backend="native"):
    return ModelRunner(
        loaded, num_slots=1024, max_requests=8, max_context_len=256, attention_backend=backend
    )


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def prompt(seed: int, length: int, vocab: int = 384) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (length,), generator=g).tolist()


def item(runner, ids, prefix_len=0, row=None, all_logits=True):
    row = runner.req_to_token.alloc_row() if row is None else row
    return ForwardItem(row, prefix_len, ids, runner.pool.alloc(len(ids)), all_logits)


def test_prompt_batch_and_extend_equal_transformers(family):
    _, _, loaded, hf = family
    runner = make_runner(loaded)
    prompts = [prompt(s, n) for s, n in [(1, 5), (2, 31), (3, 1), (4, 17)]]
    out = runner.forward([item(runner, p) for p in prompts])
    for i, p in enumerate(prompts):
        got = out.logits[out.offsets[i] : out.offsets[i + 1]]
        torch.testing.assert_close(got, hf_logits(hf, p), atol=ATOL, rtol=0)
    ids = prompt(5, 40)
    first = item(runner, ids[:20], all_logits=False)
    runner.forward([first])
    logits = runner.forward([item(runner, ids[20:], prefix_len=20, row=first.row)]).logits
    torch.testing.assert_close(logits, hf_logits(hf, ids)[20:], atol=ATOL, rtol=0)


@pytest.mark.parametrize("kernels", ["c", "torch-layer-ops", "no-c-library"])
def test_decode_steps_equal_transformers(family, kernels, monkeypatch):
    """The C kernels (attention with its window argument), the torch per-layer operators,
    and a machine without a C compiler (the native backend's torch attention: window masks)."""
    if kernels == "torch-layer-ops":
        monkeypatch.setattr(cpu_layer_ops, "usable", lambda x: False)
    if kernels == "no-c-library":
        monkeypatch.setattr(cpu_library, "_library", None)
        monkeypatch.setattr(cpu_library, "_tried", True)
    _, _, loaded, hf = family
    runner = make_runner(loaded)
    uses_c_attention = kernels != "no-c-library" and loaded.config.attn_logit_softcap is None
    assert (runner.backend.cpu_kernel is not None) == uses_c_attention
    seqs = [prompt(10 + i, n) for i, n in enumerate([3, 9, 14, 30])]
    items = [item(runner, s, all_logits=False) for s in seqs]
    last = runner.forward(items).logits.argmax(-1).tolist()
    for _ in range(20):
        step = []
        for i, s in enumerate(seqs):
            s.append(last[i])
            step.append(item(runner, [last[i]], prefix_len=len(s) - 1, row=items[i].row))
        out = runner.forward(step)
        for i, s in enumerate(seqs):
            torch.testing.assert_close(out.logits[i], hf_logits(hf, s)[-1], atol=ATOL, rtol=0)
        last = out.logits.argmax(-1).tolist()


def test_engine_greedy_equals_generate(family):
    _, _folder, loaded, hf = family
    engine = Engine(loaded=loaded, kv_memory_gb=0.02, num_threads=1, kv_cache_dtype="float32")
    batch = [prompt(20 + i, n) for i, n in enumerate([4, 13, 27])]
    greedy = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    got = [r["output_ids"] for r in engine.generate(input_ids=batch, sampling_params=greedy)]
    engine.shutdown()
    with torch.no_grad():
        for p, ids in zip(batch, got):
            ref = hf.generate(
                torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=None
            )
            assert ids == ref[0, len(p) :].tolist()


@pytest.mark.skipif(
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1", reason="CPU interpreter"
)
def test_triton_backend_equals_transformers(family):
    _, _, loaded, hf = family
    pytest.importorskip("triton")
    runner = make_runner(loaded, "triton")
    a, b = prompt(30, 19), prompt(31, 12)
    first = [item(runner, a), item(runner, b[:5])]
    runner.forward(first)
    mixed = [
        item(runner, b[5:], prefix_len=5, row=first[1].row),
        item(runner, [7], prefix_len=19, row=first[0].row),
    ]
    out = runner.forward(mixed)
    torch.testing.assert_close(out.logits[: len(b) - 5], hf_logits(hf, b)[5:], atol=1e-4, rtol=0)
    torch.testing.assert_close(out.logits[-1], hf_logits(hf, a + [7])[-1], atol=1e-4, rtol=0)
    step = [
        item(runner, [9], prefix_len=len(b), row=first[1].row),
        item(runner, [3], prefix_len=20, row=first[0].row),
    ]
    out = runner.forward(step)
    torch.testing.assert_close(out.logits[0], hf_logits(hf, b + [9])[-1], atol=1e-4, rtol=0)
    torch.testing.assert_close(out.logits[1], hf_logits(hf, a + [7, 3])[-1], atol=1e-4, rtol=0)


# -- checkpoint layouts and bad configs ---------------------------------------------------


def load_file_of(folder):
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def copy_folder(src, dst, config_changes=None, weights=None):
    """src's tokenizer and config (with `config_changes`) and `weights` (default: src's)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    dst.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, dst / name)
    config = json.loads((src / "config.json").read_text())
    config.update(config_changes or {})
    (dst / "config.json").write_text(json.dumps(config))
    state = load_file(str(src / "model.safetensors"))
    save_file(weights(state) if weights else state, str(dst / "model.safetensors"))
    return dst


def stacked_layout(state):
    """transformers saves experts one by one (Hub layout: Mixtral's block_sparse_moe.experts.{e}.w1,
    Qwen3-MoE's mlp.experts.{e}.gate_proj); transformers >= 5 holds them stacked in memory:
    mlp.experts.gate_up_proj [E, 2 * I, H] and mlp.experts.down_proj [E, H, I]."""
    import re

    out, experts = {}, {}
    pattern = re.compile(
        r"(.*)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight"
    )
    for name, tensor in state.items():
        match = pattern.fullmatch(name)
        if match is None:
            out[name.replace(".block_sparse_moe.", ".mlp.")] = tensor
            continue
        prefix, e, proj = match.groups()
        proj = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}.get(proj, proj)
        experts.setdefault(prefix, {}).setdefault(proj, {})[int(e)] = tensor
    for prefix, projs in experts.items():
        stack = {p: torch.stack([t for _, t in sorted(projs[p].items())]) for p in projs}
        out[f"{prefix}.mlp.experts.gate_up_proj"] = torch.cat(
            [stack["gate_proj"], stack["up_proj"]], dim=1
        )
        out[f"{prefix}.mlp.experts.down_proj"] = stack["down_proj"]
    return {k: v.contiguous() for k, v in out.items()}


def without_expert(state, layer=1, expert=2):
    return {
        k: v
        for k, v in state.items()
        if f"layers.{layer}.block_sparse_moe.experts.{expert}.w1." not in k
    }


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory):
    arch, overrides = FAMILIES["mixtral"]
    return write_tiny_model(tmp_path_factory.mktemp("mixtral"), arch, seed=7, **overrides)


def test_experts_stored_stacked_load_the_same(mixtral_dir, tmp_path):
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in load_file_of(
        mixtral_dir
    )  # Hub layout
    hub = copy_folder(mixtral_dir, tmp_path / "stacked", weights=stacked_layout)
    ids = prompt(40, 15)
    runners = [make_runner(load_model(str(f))) for f in (mixtral_dir, hub)]
    logits = [r.forward([item(r, ids)]).logits for r in runners]
    torch.testing.assert_close(logits[1], logits[0], atol=0, rtol=0)


def test_phi3_128k_window_beyond_the_context_means_full_attention():
    from spruce.runtime.models.config import ModelConfig

    config = {
        "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "vocab_size": 10, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "max_position_embeddings": 131072, "sliding_window": 262144,
    }  # fmt: skip
    assert ModelConfig.from_hf(config).layer_windows == ()


def test_bad_configs_are_refused_in_one_line(mixtral_dir, tmp_path):
    from spruce.runtime.errors import ModelLoadError

    cases = [
        (
            {"rope_parameters": {"rope_type": "dynamic", "factor": 4.0}},
            None,
            "rope scaling type 'dynamic' is not supported",
        ),
        (
            {"sliding_window": 4096},
            None,
            r"sliding_window 4096 must be an integer in 1..max_position_embeddings \(1024\)",
        ),
        ({}, without_expert, r"layers.1.mlp.experts lacks gate_proj of experts \[2\]"),
        (
            {"num_local_experts": 8},
            None,
            r"mlp.gate.weight: checkpoint shape \(4, 64\) != model \(8, 64\)",
        ),
        ({"num_experts_per_tok": 5}, None, "num_experts_per_tok 5 must be in 1..4"),
        ({"num_local_experts": None}, None, "lacks experts"),
        ({"hidden_act": "relu"}, None, "activation 'relu' is not supported"),
    ]
    for i, (changes, weights, message) in enumerate(cases):
        folder = copy_folder(mixtral_dir, tmp_path / str(i), changes, weights)
        with pytest.raises(ModelLoadError, match=message) as failure:
            load_model(str(folder))
        assert "\n" not in str(failure.value)


def test_gemma3_multimodal_checkpoint_serves_its_text_model(tmp_path):
    """Gemma 3 4B and up ship as Gemma3ForConditionalGeneration: the text model under
    language_model., image weights beside it, config defaults left to transformers."""
    from support import write_tokenizer_files

    write_tokenizer_files(tmp_path)
    text = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=384, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"],
        query_pre_attn_scalar=16, pad_token_id=None,
    )  # fmt: skip
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    config = transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=383,
        boi_token_index=381, eoi_token_index=382,
    )  # fmt: skip
    torch.manual_seed(3)
    hf = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    loaded = load_model(str(tmp_path))
    assert loaded.config.architecture == "Gemma3ForCausalLM" and loaded.config.layer_windows == (
        WINDOW,
        None,
    )
    runner = make_runner(loaded)
    ids = prompt(50, 21)
    got = runner.forward([item(runner, ids)]).logits
    torch.testing.assert_close(got, hf_logits(hf, ids), atol=ATOL, rtol=0)
