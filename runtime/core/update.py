"""What a request's caller is told as it runs: `ReqUpdate` records, built from the `Req` in
one place (`Reporter`) wherever the request runs (the scheduler process, the offline
Engine), and read by the caller's side (`text.output.RequestOutput`), which assembles the
text and meta_info from them. An update carries ids and counts only: no text, no dicts.

Jump-forward may re-tokenize output ids that were already reported: the next update's
`rollback` says how many of them to drop before `new_ids` are appended. That count is made
here, from what jump-forward recorded on the request (`Req.rewritten_from`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from spruce.constrained.spec import JSON_SCHEMA
from spruce.runtime.core.request import FinishReason, Req


@dataclass(slots=True)
class LogprobDelta:
    """The logprob entries new since the last update: [logprob, token id] per output
    position (and its top alternatives, with top_logprobs_num); the prompt's entries come
    once, in the first update that has any."""

    output: list[list]
    output_top: list[list[list] | None] | None = None
    prompt: list[list] | None = None
    prompt_top: list[list[list] | None] | None = None


@dataclass(slots=True)
class Finished:
    """How a request ended, sent once with its last ids. `unenforced`: for a JSON-schema
    constraint, the keywords its compiled grammar does not enforce (None otherwise); the
    caller's side validates the output against the schema."""

    reason: FinishReason
    jump_forward_tokens: int
    e2e_s: float  # admission -> finish
    first_token_s: float | None  # admission -> first token
    decode_s: float | None  # first token -> finish
    unenforced: list[str] | None = None
    embedding: list[float] | None = None  # an embedding request's pooled vector (unnormalized)
    spec_draft_tokens: int = 0  # speculative decoding: tokens drafted for it, and accepted
    spec_accepted_tokens: int = 0


@dataclass(slots=True)
class ReqUpdate:
    """News of one request: drop the last `rollback` output ids reported so far, append
    `new_ids`. `cached_tokens`: prompt tokens found in the prefix cache."""

    rid: str
    rollback: int
    new_ids: list[int]
    cached_tokens: int
    logprobs: LogprobDelta | None = None
    finished: Finished | None = None


class Reporter:
    """What was already reported of one request; `update()` makes the next ReqUpdate."""

    __slots__ = ("logprobs_sent", "prompt_logprobs_sent", "req", "sent")

    def __init__(self, req: Req) -> None:
        self.req = req
        self.sent = 0  # output ids reported
        self.logprobs_sent = 0
        self.prompt_logprobs_sent = False

    def update(self) -> ReqUpdate:
        req = self.req
        keep = self.sent
        if req.rewritten_from is not None:  # jump-forward re-tokenized reported ids
            keep = min(keep, req.rewritten_from)
            req.rewritten_from = None
        update = ReqUpdate(req.rid, self.sent - keep, req.output_ids[keep:], req.cached_tokens or 0)
        self.sent = len(req.output_ids)
        if req.logprobs is not None:
            update.logprobs = self._logprobs()
        if req.finished:
            update.finished = finished_of(req)
        return update

    def _logprobs(self) -> LogprobDelta:
        req, start = self.req, self.logprobs_sent
        lp, top = req.logprobs, req.options.top_logprobs_num > 0
        self.logprobs_sent = len(lp.output_token_logprobs)
        delta = LogprobDelta(
            [list(x) for x in lp.output_token_logprobs[start:]],
            [_pairs(t) for t in lp.output_top_logprobs[start:]] if top else None,
        )
        if not self.prompt_logprobs_sent and (
            lp.input_token_logprobs or req.output_ids or req.finished
        ):
            self.prompt_logprobs_sent = True
            delta.prompt = [list(x) for x in lp.input_token_logprobs]
            delta.prompt_top = [_pairs(t) for t in lp.input_top_logprobs] if top else None
        return delta


def finished_of(req: Req) -> Finished:
    first = req.first_token_at
    spec = req.cursor.grammar.spec if req.cursor is not None else None  # the compiled one
    unenforced = list(spec.unenforced) if spec is not None and spec.kind == JSON_SCHEMA else None
    return Finished(
        req.finish_reason, req.jump_forward_tokens, req.finished_at - req.created_at,
        None if first is None else first - req.created_at,
        None if first is None else req.finished_at - first, unenforced, _pooled_vector(req),
        *((req.spec.drafted, req.spec.accepted) if req.spec is not None else ()),
    )  # fmt: skip


def _pooled_vector(req: Req) -> list[float] | None:
    """An embedding request's vector once its prompt is computed (engine/pooling.py)."""
    if req.pooled is None or req.error is not None:
        return None
    vector = req.pooled / req.pooled_upto if req.pooling == "mean" else req.pooled
    return vector.tolist()


def finish_vector(
    vector: list[float], dimensions: int | None = None, normalize: bool = True
) -> list[float]:
    """An embedding as a caller gets it: its first `dimensions` entries (truncation, as
    OpenAI's `dimensions`), then scaled to unit length."""
    out = vector[:dimensions] if dimensions else list(vector)
    if not normalize:
        return out
    norm = math.sqrt(math.fsum(x * x for x in out)) or 1.0
    return [x / norm for x in out]


def _pairs(top):
    return None if top is None else [list(x) for x in top]
