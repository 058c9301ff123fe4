"""Applies a packed token bitmask to logits in place, on the GPU (or under the interpreter).

Layout (the same as the constrained-decoding mask everywhere in Spruce): `bitmask` is int32
[B, W] with W >= ceil(V / 32); bit j (LSB first) of word w set means token 32 * w + j is
allowed. Disallowed tokens get -inf. Each program expands a block of words into 32 tokens
each, and only stores the disallowed ones (logits are never read).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_WORDS_PER_PROGRAM_GPU = 128  # 4096 tokens per program
_WORDS_PER_PROGRAM_CPU = 8


@triton.jit
def _apply_bitmask_kernel(
    Logits,
    Bitmask,
    Indices,
    vocab_size,
    num_words,
    stride_logits,
    stride_bitmask,
    HAS_INDICES: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    row = tl.program_id(0)
    if HAS_INDICES:
        row = tl.load(Indices + row)
    row = row.to(tl.int64)
    offs_w = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    words = tl.load(Bitmask + row * stride_bitmask + offs_w, mask=offs_w < num_words, other=-1)
    offs_bit = tl.arange(0, 32)
    disallowed = ((words[:, None] >> offs_bit[None, :]) & 1) == 0
    tokens = offs_w[:, None] * 32 + offs_bit[None, :]
    neg_inf = tl.full([BLOCK_W, 32], float("-inf"), dtype=Logits.dtype.element_ty)
    store_mask = disallowed & (tokens < vocab_size)
    tl.store(Logits + row * stride_logits + tokens, neg_inf, mask=store_mask)


def apply_token_bitmask_inplace_triton(
    logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | None = None
) -> None:
    """Sets logits[r, t] = -inf wherever bit t of bitmask[r] is clear.

    logits: float [B, V] (the vocab axis contiguous); bitmask: int32 [B, W], W >= ceil(V / 32)
    (words past the vocabulary are ignored), on logits' device. Row r of the bitmask always
    applies to row r of the logits; `indices` (integer tensor, on the device) restricts the
    update to those rows, the others are left untouched.
    """
    if logits.dim() != 2 or bitmask.dim() != 2 or bitmask.shape[0] != logits.shape[0]:
        raise ValueError(
            "expected logits [B, V] and bitmask [B, W]; "
            f"got {tuple(logits.shape)} and {tuple(bitmask.shape)}"
        )
    batch, vocab_size = logits.shape
    num_words = triton.cdiv(vocab_size, 32)
    if bitmask.dtype != torch.int32 or bitmask.shape[1] < num_words:
        raise ValueError(
            f"bitmask must be int32 with >= {num_words} words per row for {vocab_size} tokens; "
            f"got {bitmask.dtype} {tuple(bitmask.shape)}"
        )
    if logits.stride(1) != 1 or bitmask.stride(1) != 1:
        raise ValueError("the vocab axis of logits and bitmask must be contiguous")
    if indices is not None and (indices.dim() != 1 or indices.is_floating_point()):
        raise ValueError("indices must be a 1-D integer tensor of row numbers")
    rows = batch if indices is None else indices.numel()
    if rows == 0 or vocab_size == 0:
        return
    block_w = _WORDS_PER_PROGRAM_GPU if logits.is_cuda else _WORDS_PER_PROGRAM_CPU
    grid = (rows, triton.cdiv(num_words, block_w))
    _apply_bitmask_kernel[grid](
        logits,
        bitmask,
        indices if indices is not None else bitmask,
        vocab_size,
        num_words,
        logits.stride(0),
        bitmask.stride(0),
        HAS_INDICES=indices is not None,
        BLOCK_W=block_w,
        num_warps=4,
    )
