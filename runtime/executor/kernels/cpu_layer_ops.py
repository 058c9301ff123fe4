"""Per-layer decoder operations in C for float32 CPU tensors (runtime/kernels/cpu_layer_ops.c):
residual add + RMSNorm, SiLU(gate) * up, rotary embedding in place, linear layers for a
few rows (batch-1 decode), and each row's argmax for greedy sampling.

`usable(x)` says whether a tensor can take this path; the model falls back to torch ops
otherwise (other devices and dtypes, no C compiler).
"""

from __future__ import annotations

import torch

from spruce.runtime.executor.kernels.cpu_library import load_library


def usable(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype == torch.float32 and load_library() is not None


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual) * weight, x + residual); without a residual, (norm(x) * weight, x).
    The residual is updated in place."""
    x = x.contiguous()
    rows, dim = x.numel() // x.shape[-1], x.shape[-1]
    out = torch.empty_like(x)
    res_ptr = None
    if residual is not None:
        assert residual.is_contiguous() and residual.shape == x.shape
        res_ptr = residual.data_ptr()
    load_library().spruce_rms_norm(
        x.data_ptr(), res_ptr, weight.data_ptr(), out.data_ptr(), rows, dim, eps
    )
    return out, (x if residual is None else residual)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [rows, 2 * inter] -> silu(gate) * up [rows, inter]."""
    gate_up = gate_up.contiguous()
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, inter)
    load_library().spruce_silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, inter)
    return out


def rotary_(
    x: torch.Tensor,
    heads: int,
    head_dim: int,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> None:
    """Rotates, in place, the first `heads` head vectors of every row of x [N, >= heads *
    head_dim] (rows may be strided, columns contiguous); cos / sin [positions, head_dim / 2]."""
    assert x.stride(1) == 1 and cos.is_contiguous() and sin.is_contiguous()
    positions = positions.to(torch.int64).contiguous()
    load_library().spruce_rotary(
        x.data_ptr(),
        x.stride(0),
        x.shape[0],
        heads,
        head_dim,
        positions.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
    )


def argmax_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, n] -> (ids int64 [rows], values [rows]): torch.argmax(x, -1) (the first NaN
    of a row that has one, else the first of its largest values) and x at those ids."""
    x = x.contiguous()
    ids, values = torch.empty(x.shape[0], dtype=torch.int64), torch.empty(x.shape[0])
    load_library().spruce_argmax_rows(
        x.data_ptr(), x.shape[0], x.shape[1], ids.data_ptr(), values.data_ptr()
    )
    return ids, values


GEMV_MAX_ROWS = 4


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, k] @ weight.T (+ bias); a few rows (batch-1 decode) go through the C kernel,
    which streams the weights once, others through torch."""
    plain = (
        weight.dtype == torch.float32
        and weight.is_contiguous()
        and (bias is None or bias.is_contiguous())
    )
    if x.dim() != 2 or x.shape[0] > GEMV_MAX_ROWS or not plain or not usable(x):
        return torch.nn.functional.linear(x, weight, bias)
    x = x.contiguous()
    n, k = weight.shape
    y = torch.empty(x.shape[0], n)
    bias_ptr = None if bias is None else bias.data_ptr()
    load_library().spruce_gemv(
        x.data_ptr(), x.shape[0], k, weight.data_ptr(), bias_ptr, n, y.data_ptr()
    )
    return y
