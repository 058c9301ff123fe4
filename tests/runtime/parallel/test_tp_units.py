"""Tensor parallelism without processes: the step message, which slice of each weight a rank
holds (heads, replicated KV heads, padded vocabulary), sharded safetensors reads, rank
placement (torchrun, several machines) and the --tp flag."""

from __future__ import annotations

import glob
import json

import pytest
import torch
from safetensors.torch import load_file

from spruce.runtime.cli import build_parser, engine_options
from spruce.runtime.errors import ModelLoadError
from spruce.runtime.executor.distributed import (
    DistributedError,
    StepMessage,
    TPGroup,
    decode_step,
    encode_step,
    placement,
)
from spruce.runtime.models.config import ModelConfig, MoeConfig
from spruce.runtime.models.loading.loader import load_model
from spruce.runtime.models.loading.sharded import read_safetensors_slices
from spruce.runtime.models.parallel import shard_config, take_slice, vocab_slice, weight_slice


def config(**overrides) -> ModelConfig:
    shape = dict(
        architecture="LlamaForCausalLM", vocab_size=385, hidden_size=64, intermediate_size=128,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6,
        max_position_embeddings=256, tie_word_embeddings=False, qkv_bias=False,
    )  # fmt: skip
    return ModelConfig(**{**shape, **overrides})


def test_the_step_message_round_trips():
    items = [
        (3, 0, [5, 6, 7], torch.tensor([10, 11, 12]), True),
        (1, 40, [9], torch.tensor([99]), False),
    ]
    writes = [(1, 0, torch.arange(20, 60)), (4, 8, torch.tensor([7]))]
    body = encode_step(StepMessage(items, writes))
    assert body.dtype == torch.int64 and body.dim() == 1
    back = decode_step(body, len(items), len(writes))
    assert [(r, p, ids, s.tolist(), f) for r, p, ids, s, f in back.items] == [
        (r, p, ids, s.tolist(), f) for r, p, ids, s, f in items
    ]
    assert [(r, s, t.tolist()) for r, s, t in back.writes] == [
        (r, s, t.tolist()) for r, s, t in writes
    ]


def test_heads_and_columns_split_by_rank():
    c = config()
    q = [weight_slice("model.layers.0.self_attn.q_proj.weight", c, r, 2) for r in range(2)]
    assert [s.ranges for s in q] == [((0, 32),), ((32, 64),)] and q[0].dim == 0
    k = [weight_slice("model.layers.0.self_attn.k_proj.bias", c, r, 2).ranges for r in range(2)]
    assert k == [((0, 16),), ((16, 32),)]
    o = weight_slice("model.layers.1.self_attn.o_proj.weight", c, 1, 2)
    assert (o.dim, o.ranges) == (1, ((32, 64),))
    fused = weight_slice("model.layers.0.self_attn.qkv_proj.weight", c, 1, 2)
    assert fused.ranges == ((32, 64), (80, 96), (112, 128))  # q | k | v of rank 1
    gate_up = weight_slice("model.layers.0.mlp.gate_up_proj.weight", c, 0, 2)
    assert gate_up.ranges == ((0, 64), (128, 192))
    down = weight_slice("model.layers.0.mlp.down_proj.weight", c, 1, 2)
    assert (down.dim, down.ranges) == (1, ((64, 128),))
    assert weight_slice("model.layers.0.input_layernorm.weight", c, 0, 2) is None
    assert weight_slice("model.layers.0.self_attn.q_norm.weight", c, 0, 2) is None


def test_kv_heads_are_replicated_when_fewer_than_ranks():
    c = config(num_heads=8, head_dim=8)
    local = shard_config(c, 4)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (2, 1, 32)
    kv = [weight_slice("layers.0.self_attn.v_proj.weight", c, r, 4).ranges for r in range(4)]
    assert kv == [
        ((0, 8),),
        ((0, 8),),
        ((8, 16),),
        ((8, 16),),
    ]  # q heads 2r, 2r+1 use KV head r // 2


def test_the_vocabulary_splits_in_equal_padded_parts():
    assert [vocab_slice(385, r, 2) for r in range(2)] == [(0, 193, 193), (193, 385, 193)]
    table = torch.arange(385 * 2, dtype=torch.float32).view(385, 2)
    parts = [take_slice(table, weight_slice("lm_head.weight", config(), r, 2)) for r in range(2)]
    assert [p.shape[0] for p in parts] == [193, 193]
    assert torch.equal(parts[1][-1], torch.zeros(2))  # the padding row
    assert torch.equal(torch.cat(parts)[:385], table)


def test_heads_that_do_not_split_are_one_clear_line():
    with pytest.raises(ModelLoadError) as e:
        shard_config(config(num_heads=9, num_kv_heads=2, head_dim=8, hidden_size=72), 3)
    assert str(e.value) == (
        "--tp 3 does not fit LlamaForCausalLM: its 2 KV heads neither divide by 3 nor divide 3 (replicated)"
    )
    with pytest.raises(ModelLoadError, match="query heads do not divide by 3"):
        shard_config(config(), 3)
    moe = MoeConfig(num_experts=4, experts_per_token=2, intermediate_size=32, normalize_top_k=True)
    with pytest.raises(ModelLoadError, match="mixture-of-experts models are not split yet"):
        shard_config(config(architecture="MixtralForCausalLM", moe=moe), 2)


def test_safetensors_slices_are_the_whole_tensors_parts(tiny_llama_dir):
    files = sorted(glob.glob(str(tiny_llama_dir / "*.safetensors")))
    whole = {k: v for f in files for k, v in load_file(f).items()}
    c = ModelConfig.from_hf(json.loads((tiny_llama_dir / "config.json").read_text()))
    ranks = [read_safetensors_slices(files, c, r, 2) for r in range(2)]
    assert set(ranks[0]) == set(whole)
    for name, tensor in whole.items():
        part = weight_slice(name, c, 0, 2)
        if part is None:
            assert all(torch.equal(r[name], tensor) for r in ranks)
        else:
            assert all(
                torch.equal(r[name], take_slice(tensor, weight_slice(name, c, i, 2)))
                for i, r in enumerate(ranks)
            )
    q = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(torch.cat([r[q] for r in ranks]), whole[q])
    o = "model.layers.1.self_attn.o_proj.weight"
    assert torch.equal(torch.cat([r[o] for r in ranks], dim=1), whole[o])


def test_placement_of_ranks(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    one = placement(2)
    assert (one.rank, one.world, one.local_followers) == (0, 2, (1,))
    assert one.init_addr.startswith("127.0.0.1:")
    second = placement(4, nnodes=2, node_rank=1, init_addr="10.0.0.1:29500")
    assert (second.rank, second.local_followers, second.init_addr) == (2, (3,), "10.0.0.1:29500")
    with pytest.raises(DistributedError, match="needs --dist-init-addr"):
        placement(4, nnodes=2, node_rank=1)
    with pytest.raises(DistributedError, match="does not divide over --nnodes 3"):
        placement(4, nnodes=3, init_addr="h:1")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    under_torchrun = placement(2)
    assert (under_torchrun.rank, under_torchrun.init_addr, under_torchrun.local_followers) == (
        1,
        None,
        (),
    )
    with pytest.raises(DistributedError, match="WORLD_SIZE 2"):
        placement(4)


def test_the_tp_flags():
    args = build_parser().parse_args(
        ["serve", "--tp", "2", "--dist-init-addr", "h:1", "--dist-timeout-s", "5", "--nnodes", "1"]
    )
    assert {k: v for k, v in engine_options(args).items() if k != "model_path"} == {
        "tp_size": 2, "dist_init_addr": "h:1", "dist_timeout_s": 5.0, "nnodes": 1,
    }  # fmt: skip


def test_quantized_weights_with_tp_are_refused(tiny_llama_dir):
    rank0 = TPGroup(
        rank=0, world=2, group=None, device=torch.device("cpu")
    )  # no traffic: refused first
    with pytest.raises(ModelLoadError, match="--quantization q8_0 does not combine with --tp 2"):
        load_model(str(tiny_llama_dir), quantization="q8_0", tp=rank0)
