"""Sampling a step's rows, drafts verified (speculative decoding; scheduler/speculative.py).

A drafting request's logits hold one row per computed position: row j predicts the token
after draft j - 1 (row 0: after its last token). Depth by depth, every request still
matching its draft samples its row j with its state advanced over the drafts before it
(output ids, for penalties and min_new_tokens; the grammar cursor, for the mask); a sampled
token equal to draft j keeps it and goes on to row j + 1, any other token ends the
request's verification. That is exactly the sequence plain decoding would sample (greedy:
token for token; sampled: the same draws from the same distributions), so n-gram drafts
need no probabilities of their own. The temporary state is undone before the scheduler
appends the tokens for real (scheduler.Scheduler._update_drafted).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from spruce.runtime.core.request import Req
from spruce.runtime.executor.sampler import SampleOutput
from spruce.runtime.scheduler.output import Scheduled

SampleRows = Callable[[torch.Tensor, list[Req]], SampleOutput]


@dataclass(slots=True)
class _Pending:
    """One row to sample: its step record, its logits row, and (drafting requests) how
    deep verification went, with the draft tokens pushed onto the request for it."""

    scheduled: Scheduled
    row: int
    depth: int = 0
    pushed: list[int] = field(default_factory=list)


def sample_rows(
    logits: torch.Tensor, rows: list[tuple[Scheduled, int]], sample: SampleRows
) -> None:
    """Samples each (scheduled, first logits row) and verifies drafts; sets the results."""
    every = [_Pending(s, row) for s, row in rows]
    pending = every
    try:
        while pending:
            pending = _depth(logits, pending, sample)
    finally:
        for p in every:
            _undo(p)


def _depth(logits: torch.Tensor, pending: list[_Pending], sample: SampleRows) -> list[_Pending]:
    """Samples one row of each pending request; those that matched their draft go on."""
    index = [p.row + p.depth for p in pending]
    whole = index == list(range(logits.shape[0]))  # a decode batch: no gather (a 12 MB copy)
    out = sample(logits if whole else logits[index], [p.scheduled.req for p in pending])
    still = []
    for j, p in enumerate(pending):
        result, draft = p.scheduled.result, p.scheduled.draft
        if j in out.errors:
            if p.depth == 0:
                result.error = out.errors[j]
            continue  # a failed deeper row: keep what was verified before it
        token, logprobs = out.ids[j], out.logprobs[j]
        if p.depth == 0:
            result.token_id, result.logprobs = token, logprobs
            if draft:
                result.tokens, result.token_logprobs = [], []
        if not draft:
            continue
        result.tokens.append(token)
        result.token_logprobs.append(logprobs)
        if p.depth < len(draft) and token == draft[p.depth] and _push(p, token):
            p.depth += 1
            still.append(p)
    return still


def _push(p: _Pending, token: int) -> bool:
    """Advances the request's state over an accepted draft token, for the next row."""
    req = p.scheduled.req
    if req.cursor is not None and not req.cursor.accept_token(token):
        return False
    req.output_ids.append(token)
    p.pushed.append(token)
    return True


def _undo(p: _Pending) -> None:
    """Takes the pushed draft tokens off the request again (output ids and cursor)."""
    if not p.pushed:
        return
    req = p.scheduled.req
    del req.output_ids[len(req.output_ids) - len(p.pushed) :]
    if req.cursor is not None:
        req.cursor.rollback(len(p.pushed))
