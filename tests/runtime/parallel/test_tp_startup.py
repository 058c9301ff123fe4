"""Tensor-parallel engines that start and stop on their own: a tied-embedding model with
replicated KV heads (and shutdown() stops the other rank), the bundled GGUF over three
ranks; bad inputs: heads that do not split (one line), a rank that cannot connect (a clear
error within the timeout, no hang)."""

from __future__ import annotations

import pytest
from support import bundled_gguf_path, write_tiny_model
from test_tp_engine import GREEDY, OPTIONS, ids

from spruce.runtime import Engine
from spruce.runtime.config import EngineConfig
from spruce.runtime.engine.tp_worker import run_follower
from spruce.runtime.errors import ModelLoadError
from spruce.runtime.executor.distributed import DistributedError, Placement, free_port


def test_tied_embeddings_and_replicated_kv_heads_then_shutdown(tmp_path):
    folder = write_tiny_model(
        tmp_path / "tied", "llama", tie_word_embeddings=True, num_key_value_heads=1
    )
    prompts = [ids(50 + i, 6 + i) for i in range(4)]
    with Engine(str(folder), **OPTIONS) as reference:
        expected = [
            o["output_ids"] for o in reference.generate(input_ids=prompts, sampling_params=GREEDY)
        ]
    with Engine(str(folder), tp_size=2, **OPTIONS) as tp:
        assert tp.core.loaded.model.lm_head is None and tp.core.runner.pool.shape.kv_heads == 1
        got = [o["output_ids"] for o in tp.generate(input_ids=prompts, sampling_params=GREEDY)]
        followers = list(tp.core.followers)
    assert got == expected
    assert [proc.returncode for proc in followers] == [0]  # told to stop, exited cleanly


def test_heads_that_do_not_split_fail_with_one_line(tmp_path):
    folder = write_tiny_model(
        tmp_path / "nine",
        "llama",
        hidden_size=72,
        num_attention_heads=9,
        num_key_value_heads=2,
        head_dim=8,
    )
    with pytest.raises(ModelLoadError) as e:
        Engine(str(folder), tp_size=3, dist_timeout_s=20, **OPTIONS)
    assert "\n" not in str(e.value)
    assert "--tp 3 does not fit LlamaForCausalLM: its 2 KV heads" in str(e.value)


def test_a_missing_rank_fails_rank_0_within_the_timeout():
    with pytest.raises(DistributedError) as e:  # two nodes, and the second never comes
        Engine(
            tp_size=2,
            nnodes=2,
            dist_init_addr=f"127.0.0.1:{free_port()}",
            dist_timeout_s=2,
            **OPTIONS,
        )
    assert "rank 0 of 2 could not join" in str(e.value) and "within 2 s" in str(e.value)


def test_a_rank_with_a_wrong_address_fails_within_the_timeout(tiny_llama_dir):
    config = EngineConfig.from_options(
        model_path=str(tiny_llama_dir), tp_size=2, dist_timeout_s=2, **OPTIONS
    )
    addr = f"127.0.0.1:{free_port()}"  # nobody listens there
    with pytest.raises(DistributedError) as e:
        run_follower(config, Placement(1, 2, addr, ()))
    assert f"rank 1 of 2 could not join the others at {addr}" in str(e.value)
    with Engine(str(tiny_llama_dir), tp_size=2, **OPTIONS) as tp:  # a failed join leaves no trace
        assert len(tp.generate(input_ids=ids(7, 5), sampling_params=GREEDY)["output_ids"]) > 0


@pytest.mark.slow
def test_the_bundled_gguf_over_three_ranks():
    """SmolLM2-135M (9 query heads, 3 KV heads): a GGUF read whole and sliced per rank."""
    path = bundled_gguf_path()
    if path is None:
        pytest.skip("the bundled model is not installed")
    options = {**OPTIONS, "kv_memory_gb": 0.05, "context_length": 512, "quantization": "none"}
    prompt = "The capital of France is"
    with Engine(path, **options) as reference:
        expected = reference.generate(prompt, GREEDY)["output_ids"]
    with Engine(path, tp_size=3, **options) as tp:
        assert tp.generate(prompt, GREEDY)["output_ids"] == expected
    with pytest.raises(
        ModelLoadError, match="--tp 2 does not fit LlamaForCausalLM: its 9 query heads"
    ):
        Engine(path, tp_size=2, **options)
