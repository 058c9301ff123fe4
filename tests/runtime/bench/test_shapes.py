"""Random-weight GGUF files of real shapes (bench/shapes.py): the 1B and 8B plans hold the
real models' parameter counts and a Q4_K_M-like type mix (nothing is written for them);
the tiny shape, in every format, is written once into the cache, loads in Spruce with its
padded vocabulary and gives finite logits; `spruce bench shapes` prints the path."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from support import bundled_gguf_path

from spruce.runtime.bench import shapes
from spruce.runtime.bench.shapes import QUANTS, SHAPES, model_file, tensor_plan
from spruce.runtime.cli import main
from spruce.runtime.executor.model_runner import ForwardItem, ModelRunner
from spruce.runtime.models.loading.gguf import read_gguf
from spruce.runtime.models.loading.loader import load_model

# the tokenizer comes from the bundled model
needs_bundled = pytest.mark.skipif(
    bundled_gguf_path() is None, reason="the bundled model is not installed"
)


def logits_of(loaded, ids: list[int]) -> torch.Tensor:
    runner = ModelRunner(loaded, num_slots=64, max_requests=2, max_context_len=64)
    item = ForwardItem(
        runner.req_to_token.alloc_row(), 0, ids, runner.pool.alloc(len(ids)), all_logits=True
    )
    return runner.forward([item]).logits


def parameters(shape: str) -> int:
    return sum(math.prod(dims) for _, dims, _ in tensor_plan(SHAPES[shape], "Q4_0"))


def test_plans_have_the_real_models_parameter_counts():
    assert parameters("1b") == 1_235_814_400  # Llama-3.2-1B
    assert parameters("8b") == 8_030_261_248  # Llama-3.1-8B


def test_q4_k_is_laid_out_like_q4_k_m():
    types = {name: kind for name, _, kind in tensor_plan(SHAPES["8b"], "Q4_K")}
    assert types["output.weight"] == "Q6_K" and types["token_embd.weight"] == "Q4_K"
    assert types["blk.0.attn_norm.weight"] == "F32" and types["output_norm.weight"] == "F32"
    more_bits = [i for i in range(32) if types[f"blk.{i}.ffn_down.weight"] == "Q6_K"]
    assert more_bits == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    assert all(
        types[f"blk.{i}.attn_v.weight"] == types[f"blk.{i}.ffn_down.weight"] for i in range(32)
    )
    assert {
        types[f"blk.{i}.{role}.weight"] for i in range(32) for role in ("attn_q", "ffn_up")
    } == {"Q4_K"}
    tied = {name: kind for name, _, kind in tensor_plan(SHAPES["1b"], "Q4_K")}
    assert tied["token_embd.weight"] == "Q6_K" and "output.weight" not in tied
    pure = {kind for _, dims, kind in tensor_plan(SHAPES["1b"], "Q8_0") if len(dims) == 2}
    assert pure == {"Q8_0"}


@pytest.mark.slow
@needs_bundled
@pytest.mark.parametrize("quant", [q for q in QUANTS if q != "F32"])
def test_tiny_file_is_written_once_and_loads_with_finite_logits(tmp_path, monkeypatch, quant):
    monkeypatch.setenv("SPRUCE_CACHE_DIR", str(tmp_path))
    path = model_file("tiny", quant)
    assert path.startswith(str(tmp_path / "models")) and path.endswith(f"tiny-{quant}-v1.gguf")
    assert [p.name for p in (tmp_path / "models").iterdir()] == [path.rsplit("/", 1)[1]]
    stamp = (tmp_path / "models" / path.rsplit("/", 1)[1]).stat().st_mtime_ns
    assert model_file("tiny", quant) == path  # found, not written again
    assert (tmp_path / "models" / path.rsplit("/", 1)[1]).stat().st_mtime_ns == stamp

    f = read_gguf(path)
    tiny = SHAPES["tiny"]
    tokens, types = f.metadata["tokenizer.ggml.tokens"], f.metadata["tokenizer.ggml.token_type"]
    assert len(tokens) == len(types) == tiny.vocab and len(set(tokens)) == tiny.vocab
    assert list(types[-256:]) == [shapes.UNUSED_TOKEN] * 256
    for name, dims, kind in tensor_plan(tiny, quant):
        assert f.tensors[name].ggml_type.name == kind and f.tensors[name].shape == dims
    assert np.all(f.tensor("blk.0.ffn_norm.weight").numpy() == 1.0)
    weights = f.tensor("blk.1.ffn_up.weight")
    assert abs(float(weights.std()) - shapes.STD) < 0.1 * shapes.STD

    loaded = load_model(path)
    assert loaded.config.vocab_size == tiny.vocab and loaded.tokenizer.vocab_size == tiny.vocab
    logits = logits_of(loaded, [1, 200, 3000, tiny.vocab - 1])
    assert logits.shape == (4, tiny.vocab) and torch.isfinite(logits).all()
    assert float(logits.std()) > 0


@pytest.mark.slow
@needs_bundled
def test_cli_prints_the_path_and_a_failed_write_leaves_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPRUCE_CACHE_DIR", str(tmp_path))

    def broken(name, quant, path):
        path.write_bytes(b"GGUF half")
        raise OSError("disk full")

    real = shapes.write_model
    monkeypatch.setattr(shapes, "write_model", broken)
    with pytest.raises(OSError, match="disk full"):
        model_file("tiny", "Q8_0")
    assert list((tmp_path / "models").iterdir()) == []
    monkeypatch.setattr(shapes, "write_model", real)
    assert main(["bench", "shapes", "--model-shape", "tiny", "--quant", "q8_0"]) == 0
    printed = capsys.readouterr()  # the path alone on stdout, for $(spruce bench shapes ...)
    assert printed.err.startswith("wrote ") and printed.out == model_file("tiny", "Q8_0") + "\n"
