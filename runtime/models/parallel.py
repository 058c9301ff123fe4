"""Tensor-parallel layers and the slice of each weight a rank holds.

A model for tp rank r of N is the plain decoder built from `shard_config` (the rank's
query heads, KV heads and intermediate columns), so the column-parallel projections
(fused q/k/v split by heads, fused gate/up split on each half) are ordinary `Linear`s over
the rank's rows and need no communication. `parallelize` then swaps in the modules that
do: o_proj and down_proj are row-parallel (partial sums, all-reduced); the embedding holds
a vocabulary slice (masked lookup, all-reduced) and the LM head (or the tied embedding
used as one) computes the slice's logits, all-gathered. KV heads are replicated when the
model has fewer of them than ranks. `weight_slice` says which rows or columns of each
Hugging Face weight a rank reads, so loaders read only those (loading/sharded.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from spruce.runtime.errors import ModelLoadError
from spruce.runtime.executor.distributed import TPGroup, all_gather_last, all_reduce
from spruce.runtime.models.config import ModelConfig
from spruce.runtime.models.layers import Embedding, Linear


def shard_config(config: ModelConfig, world: int) -> ModelConfig:
    """The shape one of `world` ranks builds; one clear line when the model does not split."""
    h, kv, inter = config.num_heads, config.num_kv_heads, config.intermediate_size
    problem = None
    if config.moe is not None:
        problem = "mixture-of-experts models are not split yet"
    elif h % world:
        problem = f"its {h} query heads do not divide by {world}"
    elif kv % world and world % kv:
        problem = f"its {kv} KV heads neither divide by {world} nor divide {world} (replicated)"
    elif inter % world:
        problem = f"its intermediate size {inter} does not divide by {world}"
    if problem:
        raise ModelLoadError(f"--tp {world} does not fit {config.architecture}: {problem}")
    heads, kv_heads = h // world, max(kv // world, 1)
    return replace(config, num_heads=heads, num_kv_heads=kv_heads, intermediate_size=inter // world)


def vocab_slice(vocab: int, rank: int, world: int) -> tuple[int, int, int]:
    """(first id, end id, rows) of a rank's vocabulary slice; every rank holds `rows`
    rows (the last one padded with zero rows), so the logits gather in equal parts."""
    rows = -(-vocab // world)
    first = min(rank * rows, vocab)
    return first, min(first + rows, vocab), rows


@dataclass(frozen=True)
class Slice:
    """Row (dim 0) or column (dim 1) ranges of a weight, concatenated; `rows`: pad dim 0
    with zeros to this many rows."""

    dim: int
    ranges: tuple[tuple[int, int], ...]
    rows: int | None = None


_PROJ = re.compile(
    r"\.(q_proj|k_proj|v_proj|qkv_proj|o_proj|gate_proj|up_proj|gate_up_proj|down_proj)\.(weight|bias)$"
)
_VOCAB = re.compile(r"(^|\.)(embed_tokens|lm_head)\.weight$")


def weight_slice(name: str, config: ModelConfig, rank: int, world: int) -> Slice | None:
    """Which part of the Hugging Face weight `name` rank `rank` of `world` holds (None:
    all of it: norms, q/k norms). `config` is the whole model's."""
    if _VOCAB.search(name):
        first, end, rows = vocab_slice(config.vocab_size, rank, world)
        return Slice(0, ((first, end),), rows)
    match = _PROJ.search(name)
    if match is None:
        return None
    proj, d = match.group(1), config.head_dim
    q = _part(config.num_heads * d, rank, world)
    kv_heads = max(config.num_kv_heads // world, 1)
    kv_first = (rank * config.num_kv_heads // world) * d
    kv = (kv_first, kv_first + kv_heads * d)
    inter = _part(config.intermediate_size, rank, world)
    q_size, kv_size = config.num_heads * d, config.num_kv_heads * d
    i_size = config.intermediate_size
    return {
        "q_proj": Slice(0, (q,)),
        "k_proj": Slice(0, (kv,)),
        "v_proj": Slice(0, (kv,)),
        "qkv_proj": Slice(0, (q, _shift(kv, q_size), _shift(kv, q_size + kv_size))),
        "o_proj": Slice(1, (q,)),
        "gate_proj": Slice(0, (inter,)),
        "up_proj": Slice(0, (inter,)),
        "gate_up_proj": Slice(0, (inter, _shift(inter, i_size))),
        "down_proj": Slice(1, (inter,)),
    }[proj]


def _part(size: int, rank: int, world: int) -> tuple[int, int]:
    n = size // world
    return rank * n, (rank + 1) * n


def _shift(r: tuple[int, int], by: int) -> tuple[int, int]:
    return r[0] + by, r[1] + by


def take_slice(tensor: torch.Tensor, part: Slice) -> torch.Tensor:
    """The slice of a whole tensor (GGUF files, already in memory)."""
    pieces = [tensor.narrow(part.dim, a, b - a) for a, b in part.ranges]
    return pad_rows(torch.cat(pieces, dim=part.dim), part.rows)


def pad_rows(tensor: torch.Tensor, rows: int | None) -> torch.Tensor:
    if rows is None or tensor.shape[0] == rows:
        return tensor.contiguous()
    pad = tensor.new_zeros((rows - tensor.shape[0], *tensor.shape[1:]))
    return torch.cat([tensor, pad])


class RowParallelLinear(Linear):
    """A linear layer over this rank's input columns: partial sums, all-reduced."""

    def __init__(self, in_features: int, out_features: int, tp: TPGroup) -> None:
        super().__init__(in_features, out_features, bias=False)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(super().forward(x), self.tp)


class VocabParallelEmbedding(Embedding):
    """This rank's rows of the embedding table: ids outside them give zeros, and the ranks'
    lookups are summed. As the tied LM head: this slice's logits, all-gathered."""

    def __init__(self, vocab: int, hidden: int, tp: TPGroup) -> None:
        first, end, rows = vocab_slice(vocab, tp.rank, tp.world)
        super().__init__(rows, hidden)
        self.first, self.end, self.vocab, self.tp = first, end, vocab, tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        outside = (input_ids < self.first) | (input_ids >= self.end)
        local = torch.where(outside, 0, input_ids - self.first)
        x = F.embedding(local, self.weight).masked_fill_(outside.unsqueeze(-1), 0)
        return all_reduce(x, self.tp)

    def as_linear(self, x: torch.Tensor) -> torch.Tensor:
        return all_gather_last(super().as_linear(x), self.tp)[..., : self.vocab]


class ParallelLMHead(Linear):
    """The LM head's rows of this rank's vocabulary slice; logits all-gathered."""

    def __init__(self, hidden: int, vocab: int, tp: TPGroup) -> None:
        super().__init__(hidden, vocab_slice(vocab, tp.rank, tp.world)[2], bias=False)
        self.vocab, self.tp = vocab, tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_gather_last(super().forward(x), self.tp)[..., : self.vocab]


def parallelize(model: nn.Module, tp: TPGroup) -> None:
    """Swaps the modules that communicate into a decoder built from `shard_config`
    (before its weights are placed: call it on the meta device)."""
    config = model.config
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.o_proj = RowParallelLinear(attn.o_proj.in_features, config.hidden_size, tp)
        mlp.down_proj = RowParallelLinear(mlp.down_proj.in_features, config.hidden_size, tp)
    model.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
    if model.lm_head is not None:
        model.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size, tp)
