"""CPU decode attention in C (runtime/kernels/cpu_decode_attention.c).

On CPUs the torch path must gather every request's K/V into a temporary before attending,
which costs more memory traffic than the attention itself; the C kernel reads the pool in
place, and can store the step's new K/V in the same call.
"""

from __future__ import annotations

import torch

from spruce.runtime.executor.kernels.cpu_library import load_library

# the kernel for each cache dtype
KERNELS = {
    torch.float32: "spruce_decode_attention_f32",
    torch.float16: "spruce_decode_attention_f16",
    torch.int8: "spruce_decode_attention_i8",
}


class CpuDecodeAttention:
    """(q, k_cache, v_cache, table, rows, seq_lens, scale, new_kv, window, scales) -> out [B, H, D].

    q [B, H, D] (rows may be strided; computed in float32, returned in q's dtype); the
    caches float32, float16 (half the memory traffic) or int8 with `scales` = (k_scale,
    v_scale), float32 [S, KH] (a quarter, plus the scales); all CPU tensors. `new_kv = (k,
    v, slots)`, when given, is each request's new K/V [B, KH, D] (rows may be strided),
    stored at `slots` before attending. `window` = W attends to each request's last W tokens
    only (a sliding-window layer); None, every token."""

    def __init__(self) -> None:
        self.lib = load_library()

    @property
    def available(self) -> bool:
        return self.lib is not None

    def __call__(
        self, q, k_cache, v_cache, table, rows, seq_lens, scale: float, new_kv=None, window: int | None = None,
        scales=None,
    ) -> torch.Tensor:  # fmt: skip
        assert table.dtype == torch.int32
        assert k_cache.dtype == v_cache.dtype and k_cache.dtype in KERNELS
        assert (scales is not None) == (k_cache.dtype == torch.int8)
        dtype, q = q.dtype, _rows_strided(q)
        rows, seq_lens = rows.to(torch.int64).contiguous(), seq_lens.to(torch.int64).contiguous()
        batch, heads, dim = q.shape
        out = torch.empty(batch, heads, dim)
        new = (None, None, 0, None)
        if new_kv is not None:
            k, v, slots = new_kv
            k, v = _rows_strided(k), _rows_strided(v)
            if k.stride(0) != v.stride(0):  # the kernel takes one row stride for both
                k, v = k.contiguous(), v.contiguous()
            assert k.shape[0] == v.shape[0] == batch
            slots = slots.to(torch.int64).contiguous()
            new = (k.data_ptr(), v.data_ptr(), k.stride(0), slots.data_ptr())
        fn = getattr(self.lib, KERNELS[k_cache.dtype])
        failed = fn(
            q.data_ptr(), q.stride(0), *new, k_cache.data_ptr(), v_cache.data_ptr(), *scale_pointers(scales),
            table.data_ptr(),
            table.stride(0), rows.data_ptr(), seq_lens.data_ptr(), out.data_ptr(),
            batch, heads, k_cache.shape[1], dim, scale, window or 0,
        )  # fmt: skip
        if failed:
            raise ValueError(
                f"CPU attention kernel: unsupported shape (heads {heads}, head_dim {dim})"
            )
        return out.to(dtype)


def scale_pointers(scales) -> tuple[int | None, int | None]:
    """The kernel's k_scale, v_scale arguments: an int8 pool's scales, else NULL."""
    return (scales[0].data_ptr(), scales[1].data_ptr()) if scales is not None else (None, None)


def _rows_strided(x: torch.Tensor) -> torch.Tensor:
    """x [B, heads, D] as float32 whose rows may be strided but each row's heads are contiguous."""
    if x.dtype != torch.float32:
        x = x.float()
    if x.stride(2) != 1 or x.stride(1) != x.shape[2]:
        x = x.contiguous()
    return x


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix: int,
    scale: float,
    window: int | None = None,
) -> torch.Tensor | None:
    """Causal attention of `length` new tokens (cpu_prefill_attention.c): q [length, H, D],
    k / v [prefix + length, KH, D] (the cached prefix's keys first), float32 CPU tensors whose
    rows may be strided; query i attends keys 0 .. prefix + i, or the last `window` of them.
    Returns out [length, H, D], or None when the kernels are not built here or the shape is
    not one they take (head_dim not a multiple of 16)."""
    lib = load_library()
    if lib is None or q.shape[-1] % 16 != 0:
        return None
    q, k, v = _rows_strided(q), _rows_strided(k), _rows_strided(v)
    if k.stride(0) != v.stride(0):  # the kernel takes one row stride for both
        k, v = k.contiguous(), v.contiguous()
    length, heads, dim = q.shape
    assert k.shape[0] == v.shape[0] == prefix + length and k.shape[2] == dim
    out = torch.empty(length, heads, dim)
    failed = lib.spruce_prefill_attention(
        q.data_ptr(), q.stride(0), k.data_ptr(), v.data_ptr(), k.stride(0), out.data_ptr(),
        length, prefix, heads, k.shape[1], dim, scale, window or 0,
    )  # fmt: skip
    if failed:
        raise MemoryError("no memory for the CPU prefill attention's work buffers")
    return out
