"""What the scheduler hands the model runner, and what comes back: one record per
scheduled request (`Scheduled`), which carries that request's result once the step ran
(`Sampled`). Code walks the records; nothing is kept in step by index."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from spruce.runtime.core.request import PromptLogprob, Req, TokenLogprobs


@dataclass(slots=True)
class Sampled:
    """One scheduled request's result of a step: the sampled token (None when it did not
    sample this step), its logprobs when asked, the prompt logprobs computed this step, and
    the error of a request whose own row failed (it is aborted alone)."""

    token_id: int | None = None
    logprobs: TokenLogprobs | None = None
    # a drafting request's verified tokens: the accepted drafts then the sampled token
    # (token_id is their first), with their logprobs when asked
    tokens: list[int] | None = None
    token_logprobs: list[TokenLogprobs | None] | None = None
    prompt_logprobs: list[PromptLogprob] | None = None
    error: str | None = None


@dataclass(slots=True)
class Scheduled:
    """A request that advances this step by `num_tokens` tokens, whose K/V go into `slots`
    (new KV slots, one per token). `draft`: drafted tokens computed after its last token
    (the last `len(draft)` of `num_tokens`; speculative.py). `steps`: greedy decode steps
    it runs this step (more than one: each chosen token is the next step's input, all in
    one call; `num_tokens` == steps). `result` is filled by the step that ran it."""

    req: Req
    num_tokens: int
    slots: torch.Tensor
    draft: list[int] = field(default_factory=list)
    steps: int = 1
    result: Sampled | None = None

    @property
    def ahead(self) -> int:
        """Positions computed past the request's own tokens: its drafts, or the tokens its
        further decode steps chose."""
        return len(self.draft) + self.steps - 1

    @property
    def samples(self) -> bool:
        """True when the advance reaches the end of the request's tokens and it still wants
        a token: its next token is sampled after this step."""
        req = self.req
        own = self.num_tokens - self.ahead
        return req.computed_len + own == req.total_len and req.wants_sample


@dataclass(slots=True)
class ScheduleOutput:
    """The requests that advance this step, in batch order (the order of the model's rows)."""

    scheduled: list[Scheduled] = field(default_factory=list)

    def add(
        self,
        req: Req,
        num_tokens: int,
        slots: torch.Tensor,
        draft: list[int] | None = None,
        steps: int = 1,
    ) -> None:
        assert slots.numel() == num_tokens > 0
        self.scheduled.append(Scheduled(req, num_tokens, slots, draft or [], steps))

    @property
    def steps(self) -> int:
        """Greedy decode steps each request runs (more than one: a multi-step decode batch,
        every request a decode of `steps` tokens)."""
        return self.scheduled[0].steps if self.scheduled else 1

    def remove(self, req: Req) -> torch.Tensor | None:
        """Takes a request out again (retraction); returns its new slots to free, or None
        when it is not in this step."""
        for i, item in enumerate(self.scheduled):
            if item.req is req:
                return self.scheduled.pop(i).slots
        return None

    @property
    def reqs(self) -> list[Req]:
        return [item.req for item in self.scheduled]

    @property
    def num_tokens(self) -> int:
        return sum(item.num_tokens for item in self.scheduled)

    def __len__(self) -> int:
        return len(self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)
