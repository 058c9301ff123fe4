"""What the scheduler hands the model runner, and what comes back."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from spruce.runtime.core.request import Req, TokenLogprobs


@dataclass(slots=True)
class ScheduleOutput:
    """Which requests advance this step, by how many tokens, into which new KV slots.

    A request samples its next token after the step when the advance reaches the end of
    its tokens (`samples[i]`)."""

    reqs: list[Req] = field(default_factory=list)
    extend_lens: list[int] = field(default_factory=list)
    new_slots: list[torch.Tensor] = field(default_factory=list)

    def add(self, req: Req, num_tokens: int, slots: torch.Tensor) -> None:
        assert slots.numel() == num_tokens > 0
        self.reqs.append(req)
        self.extend_lens.append(num_tokens)
        self.new_slots.append(slots)

    def remove(self, req: Req) -> torch.Tensor:
        """Takes a request out again (retraction); returns its new slots to free."""
        i = self.reqs.index(req)
        self.reqs.pop(i)
        self.extend_lens.pop(i)
        return self.new_slots.pop(i)

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)

    @property
    def samples(self) -> list[bool]:
        return [
            r.computed_len + n == r.total_len and r.wants_sample
            for r, n in zip(self.reqs, self.extend_lens)
        ]

    def __bool__(self) -> bool:
        return bool(self.reqs)


@dataclass(slots=True)
class StepResult:
    """Aligned with ScheduleOutput.reqs: the sampled token (None when the request did not
    sample this step), its logprobs when asked, prompt logprobs computed this step, and the
    error of a request whose own row failed (it is aborted alone; None: no errors)."""

    next_token_ids: list[int | None]
    token_logprobs: list[TokenLogprobs | None]
    prompt_logprobs: list[list[tuple[float, int, list[tuple[float, int]]]] | None]
    errors: list[str | None] | None = None
