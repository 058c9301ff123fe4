"""Applies constrained requests' token masks to a batch of logits, in place.

One packed int32 bitmask [max_batch, ceil(vocab/32)] is allocated once (pinned on the host
when the model is on a GPU); each step the cursors of the constrained rows fill their rows
and the mask is applied to those rows only (torch on the CPU, the triton kernel on a GPU).

A cursor whose mask cannot be made (its grammar passed its memory budget, or the mask's
walk its work bound: a ConstraintError) gets `req.error` set and a row allowing nothing:
the sampler fails that row alone and the scheduler aborts the request with the error's
message; it is never sampled without its mask.
"""

from __future__ import annotations

import time

import torch

from spruce.constrained import ConstraintError, allocate_bitmask, apply_bitmask
from spruce.runtime.core.request import Req
from spruce.runtime.errors import constraint_error


class GrammarMask:
    def __init__(self, vocab_size: int, max_batch: int, device: torch.device) -> None:
        self.device = device
        self.host = allocate_bitmask(max_batch, vocab_size, "cpu")
        if device.type == "cuda":
            self.host = self.host.pin_memory()
            from spruce.runtime.executor.kernels.triton_bitmask import (
                apply_token_bitmask_inplace_triton,
            )

            self._apply = apply_token_bitmask_inplace_triton
        else:
            self._apply = apply_bitmask
        self.seconds = 0.0  # cumulative fill + apply time (benchmarks read it)
        self.calls = 0

    def __call__(self, logits: torch.Tensor, reqs: list[Req]) -> None:
        rows = [i for i, r in enumerate(reqs) if r.cursor is not None]
        if not rows:
            return
        start = time.perf_counter()
        if len(reqs) > self.host.shape[0]:  # a larger batch than planned: grow once
            self.host = allocate_bitmask(len(reqs), logits.shape[-1], "cpu")
        for i in rows:
            self._fill(reqs[i], i)
        bitmask = self.host[: len(reqs)].to(self.device, non_blocking=True)
        index = torch.tensor(rows, device=self.device)
        self._apply(logits, bitmask, index)
        self.seconds += time.perf_counter() - start
        self.calls += 1

    def _fill(self, req: Req, row: int) -> None:
        try:
            req.cursor.fill_bitmask(self.host, row)
        except ConstraintError as e:
            req.error = constraint_error(e)
            self.host[row].zero_()
