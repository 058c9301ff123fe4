"""KV memory: a token-granular slot pool and the request-to-token table.

`KVPool` owns, per layer, K and V buffers of shape [num_slots, kv_heads, head_dim] and a
free list of slot indices. Slot 0 is reserved as a padding target (never handed out), so
a padded batch can always write somewhere harmless.

An int8 pool (`--kv-cache-dtype int8`, CPU) stores each (token, kv head) row of K and of V
as round(x / s) with its own float32 scale s = max |x| / 127 (k_scale, v_scale [num_slots,
kv_heads] per layer): 68 bytes per row of 64 values instead of 128 in float16, so the decode
attention, which reads every cached token each step, reads half the bytes.

`ReqToTokenTable` maps (request row, position) -> slot index; a request's row is held from
admission to finish.

Sliding-window layers (Mistral v0.1, Gemma, Phi-3-mini-4k) read only the last W slots of a
row: the attention backends start at position seq_len - W. The pool still keeps every
token's slot, for three reasons: one slot holds a token's K/V for all layers, and models
that mix windowed and global layers (Gemma) need every token in their global layers; a
prefix shared through the radix cache must stay whole, since a later request may match only
part of it and then attend from a point in its middle (and global layers read all of it);
and freeing the middle of a row would break the rule that a
row's first `prefix_len` slots are all live. Freeing the slots that left every window is
possible only for models whose layers all slide, for requests whose tokens are not shared
through the radix cache; it is not done yet.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spruce.runtime.errors import SpruceError


class OutOfSlotsError(SpruceError):
    """More KV slots were asked for than are free (the scheduler should have checked)."""


@dataclass(frozen=True, slots=True)
class KVShape:
    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_slot(self) -> int:
        """Bytes one token takes across all layers, K and V (with an int8 pool's scales)."""
        row = self.head_dim * _itemsize(self.dtype) + (4 if self.dtype == torch.int8 else 0)
        return 2 * self.num_layers * self.kv_heads * row


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (round(x / s) as int8, s float32 [...]) with s = max |x| / 127 per row
    (1 for a zero row); the C decode kernel stores new tokens the same way."""
    x = x.float()
    amax = x.abs().amax(-1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    return torch.round(x / scale[..., None]).to(torch.int8), scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale[..., None]).to(dtype)


class SlotAllocator:
    """Free slot indices 1..num_slots-1 (0 is the padding slot), kept as a stack in one
    preallocated tensor, so alloc and free cost O(n) in the slots they move.

    Fresh allocations come in ascending order, so a prompt usually lands in one
    contiguous run. A double free or an over-allocation is an error."""

    def __init__(self, num_slots: int) -> None:
        assert num_slots >= 2, "the pool needs at least one usable slot"
        self.num_slots = num_slots
        self._is_free = torch.ones(num_slots, dtype=torch.bool)
        self._is_free[0] = False
        self._stack = torch.empty(num_slots - 1, dtype=torch.int64)
        self.compact()

    @property
    def capacity(self) -> int:
        return self.num_slots - 1

    @property
    def num_free(self) -> int:
        return self._top

    def alloc(self, n: int) -> torch.Tensor:
        if n > self._top:
            raise OutOfSlotsError(f"asked for {n} KV slots, {self._top} free")
        out = self._stack[self._top - n : self._top].flip(0)
        self._top -= n
        self._is_free[out] = False
        return out

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel() == 0:
            return
        slots = slots.to(torch.int64).flatten()
        if bool(self._is_free[slots].any()) or bool((slots == 0).any()):
            raise AssertionError("KV slot freed twice (or the padding slot freed)")
        if slots.unique().numel() != slots.numel():
            raise AssertionError("the same KV slot appears twice in one free")
        self._is_free[slots] = True
        self._stack[self._top : self._top + slots.numel()] = slots.flip(0)
        self._top += slots.numel()

    def compact(self) -> None:
        """Re-sorts the free slots (cheap when idle) so later allocations are contiguous."""
        free = torch.nonzero(self._is_free).flatten()
        self._top = free.numel()
        self._stack[: self._top] = free.flip(0)

    def check_integrity(self, held: int) -> None:
        """`held` = slots owned by requests and caches; with the free ones they make the pool."""
        free = self._stack[: self._top]
        assert self._top == int(self._is_free.sum()) and bool(self._is_free[free].all())
        assert self._top + held == self.capacity, (
            f"slot leak: free {self._top} + held {held} != capacity {self.capacity}"
        )


class KVPool:
    """K and V buffers for every layer, indexed by slot, plus their allocator."""

    def __init__(self, shape: KVShape, num_slots: int, device: torch.device | str = "cpu") -> None:
        self.shape = shape
        self.num_slots = num_slots
        self.device = torch.device(device)
        dims = (num_slots, shape.kv_heads, shape.head_dim)
        self.k = [
            torch.zeros(dims, dtype=shape.dtype, device=self.device)
            for _ in range(shape.num_layers)
        ]
        self.v = [
            torch.zeros(dims, dtype=shape.dtype, device=self.device)
            for _ in range(shape.num_layers)
        ]
        self.quantized = shape.dtype == torch.int8
        scale_layers = shape.num_layers if self.quantized else 0  # float pools have no scales
        self.k_scale = [
            torch.ones(num_slots, shape.kv_heads, device=self.device) for _ in range(scale_layers)
        ]
        self.v_scale = [
            torch.ones(num_slots, shape.kv_heads, device=self.device) for _ in range(scale_layers)
        ]
        self.allocator = SlotAllocator(num_slots)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Stores new tokens' K/V [n, KH, D] (converted to the pool's dtype when it differs)."""
        if self.quantized:
            self.k[layer][slots], self.k_scale[layer][slots] = quantize_int8(k)
            self.v[layer][slots], self.v_scale[layer][slots] = quantize_int8(v)
            return
        self.k[layer][slots] = k.to(self.shape.dtype)
        self.v[layer][slots] = v.to(self.shape.dtype)

    def read(
        self, layer: int, slots: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The K/V of `slots` (any shape) as `dtype`: [*slots.shape, KH, D] each."""
        if self.quantized:
            k = dequantize_int8(self.k[layer][slots], self.k_scale[layer][slots], dtype)
            return k, dequantize_int8(self.v[layer][slots], self.v_scale[layer][slots], dtype)
        return self.k[layer][slots].to(dtype), self.v[layer][slots].to(dtype)

    def scales(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """An int8 pool's (k_scale, v_scale) [num_slots, KH] of a layer; None for float pools."""
        return (self.k_scale[layer], self.v_scale[layer]) if self.quantized else None

    # The allocator's API, re-exported so callers hold one object.
    def alloc(self, n: int) -> torch.Tensor:
        return self.allocator.alloc(n)

    def free(self, slots: torch.Tensor) -> None:
        self.allocator.free(slots)

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    @property
    def capacity(self) -> int:
        return self.allocator.capacity


class ReqToTokenTable:
    """[max_running_requests, max_context_len] int32 slot indices, one row per request."""

    def __init__(
        self, max_requests: int, max_context_len: int, device: torch.device | str = "cpu"
    ) -> None:
        self.table = torch.zeros((max_requests, max_context_len), dtype=torch.int32, device=device)
        self._free_rows = list(range(max_requests - 1, -1, -1))
        # tensor parallel rank 0: the writes since the last step, which the other ranks'
        # tables repeat (the model runner's own writes are not journaled: they follow from
        # the step itself). None: not recorded.
        self.journal: list[tuple[int, int, torch.Tensor]] | None = None

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def alloc_row(self) -> int:
        if not self._free_rows:
            raise OutOfSlotsError("no free request row (max_running_requests reached)")
        return self._free_rows.pop()

    def free_row(self, row: int) -> None:
        assert row not in self._free_rows, "request row freed twice"
        self._free_rows.append(row)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        self.table[row, start : start + slots.numel()] = slots.to(self.table.dtype)
        if self.journal is not None and slots.numel():
            self.journal.append((row, start, slots.to("cpu", torch.int64).clone()))

    def take_journal(self) -> list[tuple[int, int, torch.Tensor]]:
        writes, self.journal = self.journal or [], []
        return writes

    def read(self, row: int, end: int, start: int = 0) -> torch.Tensor:
        """Slots of positions [start, end) of a row, as int64 on the CPU (bookkeeping)."""
        return self.table[row, start:end].to("cpu", torch.int64)


def pool_slots_for_budget(shape: KVShape, budget_bytes: int, min_slots: int) -> int:
    """How many slots fit in `budget_bytes`; a clear error when fewer than `min_slots`."""
    slots = budget_bytes // shape.bytes_per_slot
    if slots < min_slots:
        need_mib = min_slots * shape.bytes_per_slot / 2**20
        raise SpruceError(
            f"the KV pool budget gives {slots} token slots but at least {min_slots} are needed "
            f"(one full context); raise --kv-memory-gb to at least {need_mib / 1024:.2f} GB"
        )
    return int(slots)
