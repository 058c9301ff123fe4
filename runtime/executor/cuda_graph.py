"""CUDA graphs for decode steps: one captured forward pass per batch size in a fixed set;
a decode batch is padded to the next captured size and replayed.

Inputs live in static buffers that the graphs read; padding rows write their K/V to the
reserved padding slot 0 and attend over one token of a spare table row, so they are
harmless. Only backends whose decode path never synchronises with the host can be captured
(triton); `--disable-cuda-graph` turns the whole thing off.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

from spruce.runtime.executor.attention.base import ForwardContext

logger = logging.getLogger("spruce")
CAPTURE_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)


class CudaGraphRunner:
    def __init__(self, model, backend, req_to_token, max_batch: int, padding_row: int) -> None:
        self.model, self.backend, self.table = model, backend, req_to_token.table
        self.sizes = [s for s in CAPTURE_SIZES if s <= max_batch] or [1]
        self.max_batch = self.sizes[-1]
        self.padding_row = padding_row
        device = self.table.device
        n = self.max_batch
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.out_slots = torch.zeros(n, dtype=torch.int64, device=device)
        self.rows = torch.full((n,), padding_row, dtype=torch.int64, device=device)
        self.ones = torch.ones(n, dtype=torch.int64, device=device)  # decode extend lengths
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self._capture_all()

    def _context(self, size: int) -> ForwardContext:
        return ForwardContext(
            positions=self.positions[:size],
            out_slots=self.out_slots[:size],
            req_pool_indices=self.rows[:size],
            prefix_lens=self.positions[:size],  # a decode token's position = its prefix length
            # every tensor a graph reads must outlive it: a tensor made here and freed after
            # the capture left its replays reading whatever reused that memory
            extend_lens=self.ones[:size],
            prefix_lens_cpu=[0] * size,
            extend_lens_cpu=[1] * size,
        )

    @torch.inference_mode()
    def _capture_all(self) -> None:
        start = time.perf_counter()
        self.table[self.padding_row, 0] = 0
        for size in reversed(self.sizes):
            ctx = self._context(size)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up: compile kernels, settle the allocator
                    self.model(self.input_ids[:size], ctx, self.backend, None)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[size] = self.model(self.input_ids[:size], ctx, self.backend, None)
            self.graphs[size] = graph
        logger.info(
            "captured CUDA graphs for decode batch sizes %s in %.1f s",
            self.sizes,
            time.perf_counter() - start,
        )

    def can_run(self, batch_size: int) -> bool:
        return batch_size <= self.max_batch

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        out_slots: torch.Tensor,
        rows: torch.Tensor,
    ) -> torch.Tensor:
        """Logits [batch, vocab] of one decode step (inputs already on the device)."""
        batch = input_ids.numel()
        size = self.sizes[bisect.bisect_left(self.sizes, batch)]
        self.input_ids[:batch].copy_(input_ids)
        self.positions[:batch].copy_(positions)
        self.out_slots[:batch].copy_(out_slots)
        self.rows[:batch].copy_(rows)
        if size > batch:  # padding: token 0 at position 0 of the spare row, K/V into slot 0
            self.input_ids[batch:size].zero_()
            self.positions[batch:size].zero_()
            self.out_slots[batch:size].zero_()
            self.rows[batch:size].fill_(self.padding_row)
        self.graphs[size].replay()
        return self.outputs[size][:batch]
