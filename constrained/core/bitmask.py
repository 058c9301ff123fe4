"""Packed token bitmasks: int32 [batch, ceil(vocab / 32)], bit j (LSB first) of word w set
means token 32 * w + j is allowed. The same layout as runtime/kernels/triton_bitmask.py;
this torch version is the reference and the CPU path."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def num_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allocate_bitmask(
    batch_size: int, vocab_size: int, device: str | torch.device = "cpu"
) -> torch.Tensor:
    """A bitmask with every token allowed (rows that no cursor fills stay unconstrained)."""
    return torch.full((batch_size, num_words(vocab_size)), -1, dtype=torch.int32, device=device)


def pack_token_ids(token_ids: Sequence[int] | np.ndarray, vocab_size: int) -> torch.Tensor:
    """The packed int32 [ceil(vocab / 32)] row allowing exactly `token_ids`."""
    allowed = np.zeros(num_words(vocab_size) * 32, dtype=bool)
    allowed[np.asarray(token_ids, dtype=np.int64)] = True
    return pack_allowed(allowed)


def pack_allowed(allowed: np.ndarray) -> torch.Tensor:
    """The packed int32 row of a bool array (token id -> allowed), zero-padded to whole words."""
    padded = np.zeros(num_words(allowed.size) * 32, dtype=bool)
    padded[: allowed.size] = allowed
    packed = np.packbits(padded, bitorder="little").view("<i4")
    return torch.from_numpy(packed.astype(np.int32))


def write_row(bitmask: torch.Tensor, row: int, mask: torch.Tensor) -> None:
    """Copies one packed mask into `bitmask[row]`; words past the mask's are zeroed (a
    bitmask sized for a larger vocabulary). ValueError when the row is too narrow."""
    words, width = mask.shape[0], bitmask.shape[-1]
    if width == words:
        bitmask[row].copy_(mask)
        return
    if width < words:
        raise ValueError(f"bitmask rows have {width} words; this grammar needs {words}")
    bitmask[row, :words].copy_(mask)
    bitmask[row, words:] = 0


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [..., vocab_size]: True where the token is allowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.flatten(-2)[..., :vocab_size].bool()


def apply_bitmask(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    rows: Sequence[int] | torch.Tensor | None = None,
) -> None:
    """Sets logits[r, t] = -inf in place wherever bit t of bitmask[r] is clear.

    logits: float [B, V]; bitmask: int32 [B, W] with W >= ceil(V / 32), on logits' device.
    `rows` restricts the update to those rows (the constrained requests); other rows are
    not touched. Same contract as `apply_token_bitmask_inplace_triton`."""
    _check(logits, bitmask)
    vocab_size = logits.shape[1]
    if rows is None:
        logits.masked_fill_(unpack_bitmask(bitmask, vocab_size).logical_not_(), float("-inf"))
        return
    index = torch.as_tensor(rows, dtype=torch.long, device=logits.device)
    if index.numel() == 0:
        return
    allowed = unpack_bitmask(bitmask.index_select(0, index), vocab_size)
    masked = logits.index_select(0, index).masked_fill_(allowed.logical_not_(), float("-inf"))
    logits.index_copy_(0, index, masked)


def _check(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    if logits.dim() != 2 or bitmask.dim() != 2 or bitmask.shape[0] != logits.shape[0]:
        raise ValueError(
            f"expected logits [B, V] and bitmask [B, W]; "
            f"got {tuple(logits.shape)} and {tuple(bitmask.shape)}"
        )
    if bitmask.dtype != torch.int32 or bitmask.shape[1] < num_words(logits.shape[1]):
        raise ValueError(
            f"bitmask must be int32 with >= {num_words(logits.shape[1])} words per row; "
            f"got {bitmask.dtype} {tuple(bitmask.shape)}"
        )
    if bitmask.device != logits.device:
        raise ValueError(f"bitmask is on {bitmask.device} but logits on {logits.device}")
