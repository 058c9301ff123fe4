"""The torch model equals transformers on the same weights (fp32, tight atol)."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from support import write_tiny_model

from spruce.runtime.errors import ModelLoadError
from spruce.runtime.executor.kernels import cpu_layer_ops, cpu_library
from spruce.runtime.executor.model_runner import ForwardItem, ModelRunner
from spruce.runtime.models.loading.loader import load_model

ATOL = 2e-5


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


@pytest.fixture(scope="module")
def tiny_llama3_tied_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama3")
    return write_tiny_model(
        folder, "llama", seed=3, tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE
    )


@pytest.fixture(scope="module", params=["llama", "qwen2", "llama3-tied"])
def pair(request, tiny_llama_dir, tiny_qwen2_dir, tiny_llama3_tied_dir):
    folder = {
        "llama": tiny_llama_dir,
        "qwen2": tiny_qwen2_dir,
        "llama3-tied": tiny_llama3_tied_dir,
    }[request.param]
    hf_class = (
        transformers.Qwen2ForCausalLM if request.param == "qwen2" else transformers.LlamaForCausalLM
    )
    hf = hf_class.from_pretrained(folder).eval()
    return load_model(str(folder)), hf


def make_runner(loaded, num_slots=2048):
    return ModelRunner(loaded, num_slots=num_slots, max_requests=8, max_context_len=512)


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def prompt(seed: int, length: int, vocab: int = 384) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (length,), generator=g).tolist()


def prefill(runner, ids, all_logits=True, prefix_len=0, row=None):
    row = runner.req_to_token.alloc_row() if row is None else row
    item = ForwardItem(row, prefix_len, ids, runner.pool.alloc(len(ids)), all_logits)
    return row, runner.forward([item]).logits


def test_llama3_rope_scaling_and_tied_embeddings(tiny_llama3_tied_dir):
    loaded = load_model(str(tiny_llama3_tied_dir))
    assert loaded.config.rope_scaling is not None and loaded.config.rope_scaling.factor == 8.0
    assert loaded.model.lm_head is None


def test_qwen2_has_qkv_bias(tiny_qwen2_dir):
    loaded = load_model(str(tiny_qwen2_dir))
    assert loaded.model.layers[0].self_attn.qkv_proj.bias is not None


def test_one_prompt(pair):
    loaded, hf = pair
    ids = prompt(0, 23)
    _, logits = prefill(make_runner(loaded), ids)
    torch.testing.assert_close(logits, hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_batch_of_different_lengths(pair):
    loaded, hf = pair
    runner = make_runner(loaded)
    prompts = [prompt(s, n) for s, n in [(1, 5), (2, 31), (3, 1), (4, 17)]]
    items = [
        ForwardItem(
            runner.req_to_token.alloc_row(), 0, p, runner.pool.alloc(len(p)), all_logits=True
        )
        for p in prompts
    ]
    out = runner.forward(items)
    for i, p in enumerate(prompts):
        got = out.logits[out.offsets[i] : out.offsets[i + 1]]
        torch.testing.assert_close(got, hf_logits(hf, p), atol=ATOL, rtol=0)


def test_extend_after_cached_prefix(pair):
    loaded, hf = pair
    runner = make_runner(loaded)
    ids = prompt(5, 40)
    row, _ = prefill(runner, ids[:20], all_logits=False)
    _, logits = prefill(runner, ids[20:], prefix_len=20, row=row)
    torch.testing.assert_close(logits, hf_logits(hf, ids)[20:], atol=ATOL, rtol=0)


def test_last_position_logits_only(pair):
    loaded, hf = pair
    ids = prompt(6, 12)
    _, logits = prefill(make_runner(loaded), ids, all_logits=False)
    assert logits.shape[0] == 1
    torch.testing.assert_close(logits[0], hf_logits(hf, ids)[-1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("kernels", ["c", "torch-layer-ops", "no-c-library"])
def test_decode_steps_match_transformers_greedy(pair, kernels, monkeypatch):
    """Every way of running a step: the C kernels (CPU, float32), the torch per-layer
    operators every other device and dtype uses, and a machine without a C compiler (torch
    attention too)."""
    if kernels == "torch-layer-ops":
        monkeypatch.setattr(cpu_layer_ops, "usable", lambda x: False)
    if kernels == "no-c-library":
        monkeypatch.setattr(cpu_library, "_library", None)
        monkeypatch.setattr(cpu_library, "_tried", True)
    loaded, hf = pair
    runner = make_runner(loaded)
    assert (runner.backend.cpu_kernel is None) == (kernels == "no-c-library")
    seqs = [prompt(10 + i, n) for i, n in enumerate([3, 9, 14, 30])]
    rows, last = [], []
    for s in seqs:
        row, logits = prefill(runner, s, all_logits=False)
        rows.append(row)
        last.append(int(logits[-1].argmax()))
    for _ in range(20):
        items = []
        for i, s in enumerate(seqs):
            s.append(last[i])
            items.append(ForwardItem(rows[i], len(s) - 1, [last[i]], runner.pool.alloc(1)))
        out = runner.forward(items)
        for i, s in enumerate(seqs):
            torch.testing.assert_close(out.logits[i], hf_logits(hf, s)[-1], atol=ATOL, rtol=0)
        last = out.logits.argmax(-1).tolist()
    with torch.no_grad():
        for s, nxt in zip(seqs, last):
            ref = hf.generate(torch.tensor([s[: len(s) - 20]]), max_new_tokens=21, do_sample=False)
            assert ref[0, -21:].tolist() == s[len(s) - 20 :] + [nxt]


def test_bfloat16_loads_and_runs(tiny_llama_dir):
    loaded = load_model(str(tiny_llama_dir), dtype="bfloat16")
    assert next(loaded.model.parameters()).dtype == torch.bfloat16
    _, logits = prefill(make_runner(loaded), prompt(7, 9))
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


# -- bad input: one-line errors naming the problem ---------------------------------------


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(str(tmp_path / "nope"))


def test_folder_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(str(tmp_path))


def test_unknown_architecture(tmp_path, tiny_llama_dir):
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    config["architectures"] = ["GPTNeoXForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ModelLoadError,
        match="unknown architecture 'GPTNeoXForCausalLM'.*supported: Gemma2ForCausalLM.*LlamaForCausalLM.*SmolLM3ForCausalLM",
    ):
        load_model(str(tmp_path))


def test_not_a_model_file(tmp_path):
    bad = tmp_path / "weights.txt"
    bad.write_text("hello")
    with pytest.raises(ModelLoadError, match="not a model"):
        load_model(str(bad))


def test_unknown_dtype(tiny_llama_dir):
    with pytest.raises(ModelLoadError, match="unknown dtype 'float8'"):
        load_model(str(tiny_llama_dir), dtype="float8")


def test_float16_kv_cache_stays_close(tiny_llama_dir):
    loaded = load_model(str(tiny_llama_dir))
    runs = []
    for kv_dtype in (torch.float32, torch.float16):
        runner = ModelRunner(
            loaded, num_slots=512, max_requests=4, max_context_len=128, kv_dtype=kv_dtype
        )
        assert runner.pool.k[0].dtype == kv_dtype
        ids = prompt(8, 20)
        row, logits = prefill(runner, ids)
        steps = [logits]
        for t in (5, 9, 11):  # decode steps read the half-precision cache
            item = ForwardItem(row, len(ids), [t], runner.pool.alloc(1))
            ids.append(t)
            steps.append(runner.forward([item]).logits)
        runs.append(torch.cat(steps))
    torch.testing.assert_close(runs[1], runs[0], atol=2e-2, rtol=0)
