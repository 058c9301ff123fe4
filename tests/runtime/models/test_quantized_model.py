"""Models with quantized weights (--quantization): the modules kept quantized, memory near
the GGUF size, logits near the float model's; the bundled Q4_1 model against its own
dequantized float32 twin over real text (its decode path on every ISA variant), and its
greedy answer (slow)."""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
import torch
from support import bundled_gguf_path

from spruce.runtime.errors import ModelLoadError
from spruce.runtime.executor.kernels import cpu_quant_ops
from spruce.runtime.executor.model_runner import ForwardItem, ModelRunner
from spruce.runtime.models.layers import QuantizedEmbedding, QuantizedLinear
from spruce.runtime.models.loading.gguf_quant import GGML_TYPES
from spruce.runtime.models.loading.loader import load_model, model_bytes
from spruce.runtime.models.loading.quantize import QUANTIZATIONS

pytestmark = pytest.mark.skipif(not cpu_quant_ops.available(), reason="no C compiler")

TEXT = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. "
    "It is named after the engineer Gustave Eiffel, whose company designed and built the tower "
    'from 1887 to 1889. Locally nicknamed "La dame de fer" (French for "Iron Lady"), it was '
    "constructed as the centrepiece of the 1889 World's Fair, and to crown the centennial "
    "anniversary of the French Revolution. Although initially criticised by some of France's "
    "leading artists and intellectuals for its design, it has since become a global cultural "
    "icon of France and one of the most recognisable structures in the world. The tower "
    "received 5,889,000 visitors in 2022. The Eiffel Tower is the most visited monument with "
    "an entrance fee in the world. The tower is 330 metres tall, about the same height as an "
    "81-storey building, and the tallest structure in Paris. Its base is square, measuring "
    "125 metres on each side. During its construction, the Eiffel Tower surpassed the "
    "Washington Monument to become the tallest human-made structure in the world, a title it "
    "held for 41 years until the Chrysler Building in New York City was finished in 1930."
)


def decode_logits(
    loaded, ids: list[int], chunk: int = 4, kv_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Logits of every position, fed a few tokens per step (the decode kernels' row counts;
    one: every step a decode step)."""
    size = len(ids) + 8
    runner = ModelRunner(
        loaded, num_slots=size, max_requests=2, max_context_len=size, kv_dtype=kv_dtype
    )
    row, out = runner.req_to_token.alloc_row(), []
    for start in range(0, len(ids), chunk):
        part = ids[start : start + chunk]
        item = ForwardItem(row, start, part, runner.pool.alloc(len(part)), all_logits=True)
        out.append(runner.forward([item]).logits)
    return torch.cat(out)


# Top-1 agreement over every position is a coin toss where the reference's two best logits
# nearly tie: another summation order (each ISA variant has its own) flips the argmax. The
# int8 cache against a float32 one flipped positions whose reference gap was up to 0.11
# nats, a different set on the portable, AVX2 and AVX-512 variants (top-1 0.971, 0.989,
# 0.978 over all positions; mean KL 6.1e-4 on each). So top-1 is compared only where the
# reference leads by CLEAR_MARGIN nats (its top token 1.65x as likely as the next, 4.5x the
# largest flipped gap; 70% of the bundled text's positions) and must agree at every one; the
# rest is bounded by KL, its mean and its 99th percentile.
CLEAR_MARGIN = 0.5


def assert_agrees(
    ours: torch.Tensor, reference: torch.Tensor, label: str, mean_kl: float, p99_kl: float
) -> None:
    """Every position where the reference's top-1 is clear has our top-1 (and there are
    such positions: at least a third); KL(reference || ours) within `mean_kl` on average
    and `p99_kl` at its 99th percentile."""
    top2 = reference.topk(2, -1).values
    clear = top2[:, 0] - top2[:, 1] > CLEAR_MARGIN
    same = ours.argmax(-1) == reference.argmax(-1)
    kl = kl_divergence(ours, reference)
    mean, p99 = kl.mean().item(), kl.quantile(0.99).item()
    print(f"{label}, {len(kl)} positions: top-1 {same.float().mean():.4f} overall, "
          f"{int(same[clear].sum())}/{int(clear.sum())} where clear; KL mean {mean:.2e}, p99 {p99:.2e}")  # fmt: skip
    assert clear.sum() >= len(clear) / 3, "too few clear positions to compare top-1"
    assert same[clear].all(), (
        f"top-1 differs at clear positions {clear.nonzero().flatten()[~same[clear]].tolist()}"
    )
    assert mean <= mean_kl and p99 <= p99_kl, (mean, p99)


def kl_divergence(ours: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """KL(reference || ours) at each position."""
    log_p, log_q = torch.log_softmax(reference.double(), -1), torch.log_softmax(ours.double(), -1)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


@pytest.mark.parametrize("qtype", QUANTIZATIONS[2:])
def test_hf_checkpoint_quantized_at_load(tiny_llama_dir, qtype):
    plain = load_model(str(tiny_llama_dir), quantization="auto")  # HF floats stay float under auto
    assert not any(isinstance(m, QuantizedLinear) for m in plain.model.modules())
    loaded = load_model(str(tiny_llama_dir), quantization=qtype)
    quantized = [m for m in loaded.model.modules() if isinstance(m, QuantizedLinear)]
    assert quantized and all(m.qtype == qtype for m in quantized)
    assert isinstance(loaded.model.embed_tokens, QuantizedEmbedding)
    assert model_bytes(loaded.model) < model_bytes(plain.model) / 3
    ids = list(range(3, 40))
    kl = kl_divergence(decode_logits(loaded, ids), decode_logits(plain, ids)).mean().item()
    print(f"tiny llama {qtype}: mean KL {kl:.5f}")
    assert kl < {"q8_0": 1e-3, "q4_0": 0.05, "q4_1": 0.05}[qtype]


K_ROLES = {  # GGUF role -> (rows, columns, ggml type): the K formats of a Q4_K_M-like file
    "attn_q": (256, 256, 12), "attn_k": (128, 256, 12), "attn_v": (128, 256, 12),
    "attn_output": (256, 256, 13), "ffn_gate": (512, 256, 12), "ffn_up": (512, 256, 12),
    "ffn_down": (256, 512, 14),
}  # fmt: skip


def random_k_blocks(ggml_id: int, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random blocks of a K format with small fp16 scales (weights of about +-0.1)."""
    kind = GGML_TYPES[ggml_id]
    raw = rng.integers(0, 256, rows * cols // 256 * kind.block_bytes, dtype=np.uint8)
    blocks = np.frombuffer(raw, kind.block).copy()
    blocks["d"] = rng.uniform(1e-4, 3e-4, len(blocks)) * (0.1 if ggml_id == 14 else 1)
    if "dmin" in kind.block.names:
        blocks["dmin"] = rng.uniform(1e-4, 3e-4, len(blocks))
    return blocks.view(np.uint8).reshape(rows, -1)


def write_k_quant_gguf(path, layers: int = 2) -> str:
    """A tiny llama GGUF (hidden 256, 4 heads of 64) whose linear layers are Q4_K / Q5_K / Q6_K."""
    rng, V = np.random.default_rng(0), gguf.GGUFValueType
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "a", "b", "ab"] + [
        f"t{i}" for i in range(58)
    ]
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in {
        "block_count": layers,
        "context_length": 256,
        "embedding_length": 256,
        "feed_forward_length": 512,
        "attention.head_count": 4,
        "attention.head_count_kv": 2,
    }.items():
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_array("tokenizer.ggml.tokens", tokens)
    writer.add_array("tokenizer.ggml.merges", ["a b"])
    writer.add_key_value(
        "tokenizer.ggml.token_type", [3, 3, 3] + [1] * 61, V.ARRAY, sub_type=V.INT32
    )
    writer.add_uint32("tokenizer.ggml.eos_token_id", 2)
    writer.add_tensor("token_embd.weight", rng.standard_normal((64, 256), dtype=np.float32) * 0.5)
    writer.add_tensor("output_norm.weight", np.ones(256, dtype=np.float32))
    for layer in range(layers):
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{layer}.{norm}.weight", np.ones(256, dtype=np.float32))
        for role, (rows, cols, ggml_id) in K_ROLES.items():
            blocks = random_k_blocks(ggml_id, rows, cols, rng)
            writer.add_tensor(
                f"blk.{layer}.{role}.weight", blocks, raw_dtype=gguf.GGMLQuantizationType(ggml_id)
            )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_auto_keeps_k_formats_and_agrees_with_their_float_twin(tmp_path):
    """Under `auto` a GGUF's Q4_K / Q5_K / Q6_K weights stay as stored (the resident model
    near the file's size) and compute close to the same weights dequantized to float32."""
    path = write_k_quant_gguf(tmp_path / "tiny-k.gguf")
    quantized, plain = load_model(path, quantization="auto"), load_model(path, quantization="none")
    kinds = {m.qtype for m in quantized.model.modules() if isinstance(m, QuantizedLinear)}
    assert kinds == {"q4_k", "q5_k", "q6_k"}
    assert model_bytes(quantized.model) < 1.2 * os.path.getsize(path)
    ids = list(range(3, 60))
    # only the 16-bit rounding of the activations differs (measured: KL mean 2e-10, p99 4e-9)
    assert_agrees(
        decode_logits(quantized, ids),
        decode_logits(plain, ids),
        "tiny K formats vs float32",
        1e-6,
        1e-5,
    )


def test_explicit_quantization_off_the_cpu_is_an_error(tiny_llama_dir):
    with pytest.raises(ModelLoadError, match="quantization"):
        load_model(str(tiny_llama_dir), device="meta", quantization="q8_0")
    with pytest.raises(ModelLoadError, match="unknown quantization"):
        load_model(str(tiny_llama_dir), quantization="q3_x")


needs_bundled = pytest.mark.skipif(
    bundled_gguf_path() is None, reason="bundled GGUF model not installed"
)


@pytest.fixture(scope="module")
def bundled_pair():
    return load_model(bundled_gguf_path(), quantization="auto"), load_model(
        bundled_gguf_path(), quantization="none"
    )


@pytest.mark.slow
@needs_bundled
def test_bundled_q4_1_model_agrees_with_its_float_twin(bundled_pair):
    """The integer kernels against the same weights dequantized to float32: only the 16-bit
    rounding of the activations differs (measured on every variant: KL mean 5.5e-8, p99
    3.7e-7)."""
    quantized, plain = bundled_pair
    assert {m.qtype for m in quantized.model.modules() if isinstance(m, QuantizedLinear)} == {
        "q4_1",
        "q8_0",
    }
    size, file_size = model_bytes(quantized.model), os.path.getsize(bundled_gguf_path())
    print(f"resident weights {size / 1e6:.1f} MB (GGUF file {file_size / 1e6:.1f} MB, float32 "
          f"{model_bytes(plain.model) / 1e6:.1f} MB)")  # fmt: skip
    assert size < 1.1 * file_size
    ids = quantized.tokenizer.encode(TEXT)[:300]
    label = "bundled Q4_1, integer kernels vs dequantized float32"
    assert_agrees(decode_logits(quantized, ids), decode_logits(plain, ids), label, 1e-6, 1e-5)


@pytest.mark.slow
@needs_bundled
def test_bundled_model_with_int8_kv_cache_agrees_with_float32_cache(bundled_pair):
    """--kv-cache-dtype int8 against a float32 cache, same Q4_1 weights, token by token
    (the C decode kernel reads every cached token through its scales). Measured over 274
    positions on portable, AVX2 and AVX-512: KL mean 6.1e-4, p99 4.0e-3 to 5.3e-3."""
    quantized, _ = bundled_pair
    ids = quantized.tokenizer.encode(TEXT)[:300]
    int8 = decode_logits(quantized, ids, chunk=1, kv_dtype=torch.int8)
    reference = decode_logits(quantized, ids, chunk=1, kv_dtype=torch.float32)
    assert_agrees(int8, reference, "bundled Q4_1, int8 KV cache vs float32", 2e-3, 0.02)


@pytest.fixture(scope="module")
def float_reference(bundled_pair):
    """The float32 twin's logits over the first 64 tokens, token by token, float32 cache
    (computed once, on the variant bound at start)."""
    _, plain = bundled_pair
    ids = plain.tokenizer.encode(TEXT)[:64]
    return ids, decode_logits(plain, ids, chunk=1, kv_dtype=torch.float32)


@pytest.mark.slow
@needs_bundled
def test_bundled_q4_1_model_on_every_variant(bundled_pair, float_reference, cpu_isa):
    """The whole quantized decode path on each ISA variant (integer kernels, the int8
    cache's attention, the layer operations, through the decode plan) against one float32
    reference, on a few tokens: a variant that only another machine would pick is checked
    here too. The int8 cache dominates the difference (bounds as above)."""
    quantized, _ = bundled_pair
    ids, reference = float_reference
    ours = decode_logits(quantized, ids, chunk=1, kv_dtype=torch.int8)
    assert_agrees(ours, reference, f"bundled Q4_1 + int8 cache on {cpu_isa} vs float32", 2e-3, 0.02)


@pytest.mark.slow
@needs_bundled
def test_bundled_q4_1_model_answers_the_readme_question(bundled_pair):
    """Greedy chat answer, a repeated prompt served from the radix cache with the same
    tokens, and constrained outputs equal to the float32 model's."""
    from spruce.runtime import Engine

    greedy = {"max_new_tokens": 16, "temperature": 0}
    constrained = [
        {**greedy, "choices": ["Berlin", "Paris", "Rome"]},
        {**greedy, "regex": r"(Paris|Berlin|Rome) is the capital of France\."},
    ]
    outputs = []
    for loaded in bundled_pair:
        with Engine(loaded=loaded, kv_memory_gb=0.5) as engine:
            prompt = engine.apply_chat_template(
                [{"role": "user", "content": "What is the capital of France?"}]
            )
            first = engine.generate(prompt, greedy)
            again = engine.generate(prompt, greedy)
            assert again["text"] == first["text"] and again["meta_info"]["cached_tokens"] > 0
            outputs.append(
                [first["text"], *(engine.generate(prompt, c)["text"] for c in constrained)]
            )
    print("quantized:", outputs[0], "float32:", outputs[1])
    assert "Paris" in outputs[0][0]
    assert outputs[0][1:] == outputs[1][1:]
