"""`Req`: the one object that flows through the runtime, from admission to finish.

Progress is counted, not named: the request's tokens are prompt + output, of which the
first `computed_len` have their K/V in the pool. A step advances it by some tokens; when
all are computed the next token is sampled. "Prefill" (several tokens left to compute) and
"decode" (exactly one) are derived from the counts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from spruce.runtime.core.options import RequestOptions
from spruce.runtime.core.sampling_params import SamplingParams

if TYPE_CHECKING:  # annotations only: the request module stays light
    from concurrent.futures import Future

    import torch

    from spruce.constrained.automaton.cursor import CursorBase
    from spruce.constrained.spec import ConstraintSpec
    from spruce.radix.radix_cache import RadixNode
    from spruce.runtime.scheduler.speculative import SpecState
    from spruce.runtime.scheduler.thinking import ThinkingBudget


@dataclass(frozen=True, slots=True)
class FinishReason:
    type: str  # "stop" | "length" | "abort"
    matched: int | str | None = None  # the stop token id or stop string
    message: str | None = None  # why an abort happened

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type, "matched": self.matched}
        if self.message is not None:
            out["message"] = self.message
        return out


@dataclass(slots=True)
class LogprobResult:
    """Accumulated logprobs: lists of (logprob, token_id); top lists per position."""

    input_token_logprobs: list[tuple[float | None, int]] = field(default_factory=list)
    output_token_logprobs: list[tuple[float, int]] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[float, int]] | None] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)


@dataclass(slots=True)
class TokenLogprobs:
    """A sampled token's logprob and the top-k alternatives."""

    logprob: float
    top: list[tuple[float, int]]


# One prompt position's logprob (None for the very first token), its token id, and the top-k
# alternatives as (logprob, token id).
PromptLogprob = tuple[float | None, int, list[tuple[float, int]]]


@dataclass(slots=True, eq=False)
class Req:
    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams
    options: RequestOptions = field(default_factory=RequestOptions)
    client: str = ""  # who sent it (the front end's client key): prefill is shared per client
    output_ids: list[int] = field(default_factory=list)
    # KV progress
    computed_len: int = 0  # tokens of prompt + output whose K/V are in the pool
    cache_owned_len: int = 0  # leading positions whose slots belong to the prefix cache
    cached_tokens: int | None = None  # prompt tokens found in the cache at first admission
    row: int | None = None  # row in the request-to-token table while admitted
    last_node: RadixNode | None = None  # locked prefix-cache node while admitted (None: no cache)
    admit_order: int = 0
    # constrained decoding
    constraint: ConstraintSpec | None = None  # validated at the front door
    grammar_future: Future | None = None  # its compile in flight (it waits in the grammar queue)
    cursor: CursorBase | None = None  # the request's grammar cursor (any backend's), once compiled
    jump_forward_tokens: int = 0  # output tokens appended by jump-forward, not decoded
    rewritten_from: int | None = None  # first output id jump-forward re-tokenized since the
    # last report (core.update.Reporter turns it into the update's rollback count)
    spec: SpecState | None = None  # its speculative decoding record, once it drafted
    thinking: ThinkingBudget | None = None  # its thinking budget's state (scheduler/thinking.py)
    # embedding requests: how the prompt's final hidden states are pooled (last | mean |
    # cls; None: not one), the pooled vector so far, and the positions it has taken in
    pooling: str | None = None
    pooled: torch.Tensor | None = None
    pooled_upto: int = 0
    # results
    finish_reason: FinishReason | None = None
    error: Exception | None = None  # why the runtime refused it after admission (e.g. compile)
    logprobs: LogprobResult | None = None
    created_at: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finished_at: float | None = None

    def __post_init__(self) -> None:
        if self.options.return_logprob and self.logprobs is None:
            self.logprobs = LogprobResult()

    @property
    def total_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def remaining(self) -> int:
        """Tokens whose K/V still have to be computed (1 while decoding)."""
        return self.total_len - self.computed_len

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def wants_sample(self) -> bool:
        return self.sampling.max_new_tokens > len(self.output_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        """prompt + output ids [start, end) without building the whole list."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        if start >= n:
            return self.output_ids[start - n : end - n]
        return self.prompt_ids[start:] + self.output_ids[: end - n]

    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def finish(self, reason: FinishReason) -> None:
        if self.finish_reason is None:
            self.finish_reason = reason
            self.finished_at = time.perf_counter()

    @property
    def prompt_logprob_start(self) -> int | None:
        """First prompt position whose logprob is wanted, or None."""
        start = self.options.logprob_start_len
        if not self.options.return_logprob or start < 0:
            return None
        return min(start, len(self.prompt_ids))
