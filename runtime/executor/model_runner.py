"""Model runner: owns the model, the KV pool, the request-to-token table and the attention
backend; turns a batch description into tensors and runs one forward pass."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from spruce.runtime.executor.attention import create_backend
from spruce.runtime.executor.attention.base import ForwardContext
from spruce.runtime.executor.distributed import StepMessage, TPGroup, receive_step, send_step
from spruce.runtime.executor.kv_pool import KVPool, KVShape, ReqToTokenTable
from spruce.runtime.executor.sampler import Sampler


@dataclass(slots=True)
class ForwardItem:
    """One request's part of a forward pass.

    The request's row in the request-to-token table already holds the slots of its first
    `prefix_len` tokens; `new_slots` are where the K/V of `new_ids` go (allocated by the
    caller). `all_logits` asks for logits of every new position, not only the last.
    `hidden`: the final hidden states it wants (an embedding request): "last" (of its last
    new position), "first", "all" (of every new position), or "" (none)."""

    row: int
    prefix_len: int
    new_ids: list[int]
    new_slots: torch.Tensor
    all_logits: bool = False
    hidden: str = ""


def _step_item(item: ForwardItem, j: int, new_ids: list[int]) -> ForwardItem:
    """Step j of a multi-step decode item: `new_ids` at its position j, its slot j."""
    return ForwardItem(item.row, item.prefix_len + j, new_ids, item.new_slots[j : j + 1])


@dataclass(slots=True)
class ForwardOutput:
    logits: torch.Tensor  # [rows, vocab] float32
    offsets: list[int]  # item i's logits are rows offsets[i] .. offsets[i + 1]
    hidden: torch.Tensor | None = None  # [rows, hidden] float32, of the items that asked
    hidden_offsets: list[int] | None = None  # item i's are rows hidden_offsets[i] .. [i + 1]


class ModelRunner:
    def __init__(
        self,
        loaded: Any,  # a models.loading.LoadedModel: its .model and .config are used
        num_slots: int,
        max_requests: int,
        max_context_len: int,
        attention_backend: str = "torch",
        device: str = "cpu",
        cuda_graph: bool = False,
        kv_dtype: torch.dtype | None = None,
        tp: TPGroup | None = None,
    ) -> None:
        """`tp`: this rank's tensor-parallel group (the model holds this rank's slices);
        rank 0 sends each step to the others, which run `follow()`."""
        config = loaded.config
        self.model = loaded.model
        self.config = config
        self.tp = tp
        self.device = torch.device(device)
        dtype = kv_dtype or next(self.model.parameters()).dtype
        shape = KVShape(config.num_layers, config.num_kv_heads, config.head_dim, dtype)
        self.pool = KVPool(shape, num_slots, self.device)
        self.req_to_token = ReqToTokenTable(max_requests, max_context_len, self.device)
        self.backend = create_backend(
            attention_backend,
            self.pool,
            self.req_to_token,
            config.num_heads,
            config.head_dim,
            options=self.model.attention_options,
        )
        self.graphs = None
        if tp is not None and tp.is_leader:
            self.req_to_token.journal = []
        graphs_fit = (
            self.device.type == "cuda" and attention_backend == "triton" and self.model.capturable
        )
        if tp is None and cuda_graph and graphs_fit:
            from spruce.runtime.executor.cuda_graph import CudaGraphRunner

            padding_row = self.req_to_token.alloc_row()  # a spare row for padded graph batches
            self.graphs = CudaGraphRunner(
                self.model, self.backend, self.req_to_token, max_requests - 1, padding_row
            )

    @torch.inference_mode()
    def forward(self, items: list[ForwardItem]) -> ForwardOutput:
        if self.tp is not None and self.tp.is_leader:
            steps = [(i.row, i.prefix_len, i.new_ids, i.new_slots, i.all_logits) for i in items]
            send_step(self.tp, StepMessage(steps, self.req_to_token.take_journal()))
        ctx, input_ids = self._build(items)
        logits_rows, offsets = self._logits_rows(items)
        hidden_offsets = self._hidden_rows(items, ctx)
        if (
            self.graphs is not None
            and ctx.is_decode
            and logits_rows is None
            and hidden_offsets is None
            and self.graphs.can_run(len(items))
            and not ctx.shared_rows
        ):
            logits = self.graphs.run(input_ids, ctx.positions, ctx.out_slots, ctx.req_pool_indices)
        else:
            logits = self.model(input_ids, ctx, self.backend, logits_rows)
        hidden = None if ctx.hidden is None else ctx.hidden.float()
        logits = logits if logits.dtype == torch.float32 else logits.float()
        return ForwardOutput(logits, offsets, hidden, hidden_offsets)

    @torch.inference_mode()
    def decode_steps(
        self, items: list[ForwardItem], steps: int
    ) -> tuple[list[list[int]], list[list[float]]]:
        """Greedy decoding `steps` steps for decode items (one new id each) whose
        `new_slots` hold one slot per step: per item, the ids chosen at each step and their
        logits (one that is not finite: the row could not be sampled there). Exactly the
        tokens `steps` plain steps would sample by argmax: on the CPU in one call to the
        model's C decode plan where it serves the batch, else one forward pass a step."""
        decode_steps = getattr(self.model, "decode_steps", None)
        if self.tp is None and self.device.type == "cpu" and decode_steps is not None:
            ctx, input_ids = self._build([_step_item(it, 0, it.new_ids) for it in items])
            slots = torch.stack([it.new_slots for it in items])  # [rows, steps]
            ahead = ctx.positions[:, None] + torch.arange(steps)
            table = self.req_to_token.table
            table[ctx.req_pool_indices[:, None], ahead] = slots.to(table.dtype)
            chosen = decode_steps(input_ids, ctx, self.backend, slots)
            if chosen is not None:
                ids, best = chosen
                return ids.t().tolist(), best.t().tolist()
        return self._decode_steps_by_forward(items, steps)

    def _decode_steps_by_forward(self, items: list[ForwardItem], steps: int):
        """decode_steps as `steps` forward passes and argmax from Python."""
        ids, best, new_ids = [], [], [it.new_ids for it in items]
        for j in range(steps):
            step = [_step_item(it, j, new) for it, new in zip(items, new_ids)]
            chosen, logits = Sampler.argmax(self.forward(step).logits)
            ids.append(chosen.tolist())
            best.append(logits.tolist())
            new_ids = [[t] for t in ids[-1]]
        return [list(c) for c in zip(*ids)], [list(c) for c in zip(*best)]

    def _build(self, items: list[ForwardItem]) -> tuple[ForwardContext, torch.Tensor]:
        """The step's context and input ids. Its small tensors come from Python lists in as
        few torch calls as will do: at batch-1 decode each call runs from caches the weights
        have just swept, so it costs far more than it would warm."""
        prefix_cpu = [it.prefix_len for it in items]
        extend_cpu = [len(it.new_ids) for it in items]
        row_ids = [it.row for it in items]
        decode = all(n == 1 for n in extend_cpu)  # one token per request at its prefix length
        columns = [prefix_cpu, extend_cpu, row_ids]
        if decode:
            columns.append([it.new_ids[0] for it in items])
        prefix, extend, rows, *ids = torch.tensor(columns, dtype=torch.int64).unbind()
        if decode:
            positions, table_rows, input_ids = prefix, rows, ids[0]
        else:
            starts = torch.cumsum(extend, 0) - extend
            # position of token t of item b = prefix[b] + (t - starts[b]), without a Python loop
            positions = torch.arange(int(extend.sum())) + torch.repeat_interleave(
                prefix - starts, extend
            )
            table_rows = torch.repeat_interleave(rows, extend)
            input_ids = torch.tensor([t for it in items for t in it.new_ids], dtype=torch.int64)
        slots = [it.new_slots for it in items]
        out_slots = self._on_device(slots[0] if len(slots) == 1 else torch.cat(slots))
        positions, table_rows = self._on_device(positions), self._on_device(table_rows)
        # the new tokens' slots go into their rows of the request-to-token table, in one write
        self.req_to_token.table[table_rows, positions] = out_slots.to(self.req_to_token.table.dtype)
        ctx = ForwardContext(
            positions=positions,
            out_slots=out_slots,
            req_pool_indices=self._on_device(rows),
            prefix_lens=self._on_device(prefix),
            extend_lens=self._on_device(extend),
            prefix_lens_cpu=prefix_cpu,
            extend_lens_cpu=extend_cpu,
            shared_rows=len(set(row_ids)) < len(items),
        )
        return ctx, self._on_device(input_ids)

    def _on_device(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.device.type == "cpu" else t.to(self.device)

    def _logits_rows(self, items: list[ForwardItem]) -> tuple[torch.Tensor | None, list[int]]:
        rows, offsets, start = [], [0], 0
        for it in items:
            n = len(it.new_ids)
            rows.extend(range(start, start + n) if it.all_logits else [start + n - 1])
            offsets.append(len(rows))
            start += n
        if len(rows) == start:
            return None, offsets
        return torch.tensor(rows, device=self.device), offsets

    def _hidden_rows(self, items: list[ForwardItem], ctx: ForwardContext) -> list[int] | None:
        """Sets the rows whose hidden states the items want; their offsets (None: none)."""
        if not any(it.hidden for it in items):
            return None
        rows, offsets, start = [], [0], 0
        for it in items:
            n = len(it.new_ids)
            wanted = {"last": [start + n - 1], "first": [start], "all": range(start, start + n)}
            rows.extend(wanted.get(it.hidden, []))
            offsets.append(len(rows))
            start += n
        ctx.hidden_rows = torch.tensor(rows, device=self.device)
        return offsets

    def follow(self) -> None:
        """A tensor-parallel follower: runs rank 0's steps until it says stop."""
        while (msg := receive_step(self.tp)) is not None:
            for row, start, slots in msg.writes:
                self.req_to_token.write(row, start, slots)
            self.forward([ForwardItem(*item) for item in msg.items])
