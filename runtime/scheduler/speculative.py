"""Speculative decoding: drafts for decoding requests, and when not to draft.

A decoding request computes its last token plus up to k drafted tokens in one forward pass
(as decode rows of its own row); the engine then samples each position in turn with the request's own
state advanced over the drafts before it, and keeps drafts while the sampled token equals
the draft (engine/verify.py). That is sequential sampling, so greedy output is identical
token for token and sampled output keeps its distribution; the drafter only decides how
many forward passes it takes.

Drafter: prompt lookup (`NgramDrafter`): the longest suffix of the request's tokens
(between the min and max window) that occurred before in its prompt or output proposes the
tokens that followed its latest earlier occurrence. No extra model, no extra memory; it
pays where outputs copy their prompt (extraction, code edits, quotes). A drafter has two
calls, `propose_many(reqs, lengths) -> token ids per request` (one call a step, so a
drafter with a model batches its passes) and `forget(req)`, and a debug `check_integrity()`; a draft model
(engine/draft_model.py) is one, EAGLE-style heads or MTP would be others.

Knowing when not to: each extra row costs a share of a step (`row_cost`: measured as steps
run, step_costs.py; large on a CPU, where the integer GEMV is bound by its arithmetic, small
on a GPU), and the plain path it competes with may run several greedy steps a call. Each
request keeps an estimate of how often its draft tokens are accepted (`SpecState`, started
from the estimate over all requests); a draft is as long as maximizes expected tokens per
unit of step time for the batch at hand (`best_length`), and a step drafts only where that
beats the plain step (`_pays`). A request whose drafts do not pay even alone pauses (each
pause twice the last), then probes with one drafted token; while nobody drafts the step is
a plain one, multi-step decode included. No request drafts in a step
with more than `speculative_max_batch_size` decoding requests. Drafts are also cut where
they cannot be verified within the step's bounds (`cut_for_grammar`: the first token the
grammar refuses, or whose next mask is not made yet) and where the request must stop anyway
(max_new_tokens, the context). Where the drafter has nothing for a constrained request,
the text its grammar forces is the draft (jump-forward's text, when jump-forward is off or
the text is below its minimum length).
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass

from spruce.runtime.config import SpeculativeOptions
from spruce.runtime.core.request import Req
from spruce.runtime.scheduler.step_costs import StepCosts

PAUSE_STEPS = 32  # steps a request waits once drafting stopped paying, before it probes again
MAX_PAUSE_STEPS = 1024  # each pause of a request doubles the next, up to this
DECAY = 0.8  # weight of the past in a request's acceptance estimate
OVERALL_DECAY = 0.9  # the same for the estimate over all requests
PRIOR = (0.7, 1.0)  # (accepted, tried) the estimate over all requests starts from
PRIOR_WEIGHT = 2.0  # tries a request's fresh estimate (the overall one) counts for
EXPLORE_EVERY, EXPLORE_STEPS = 32, 4  # plain steps in a row, while plain steps are not timed


@dataclass(slots=True)
class SpecState:
    """One request's drafting record: totals (meta_info) and the estimate of how likely
    its next draft token is accepted (`rate`: accepted / tried draft tokens, decayed, where
    a draft is tried up to its first rejected token)."""

    drafted: int = 0
    accepted: int = 0
    hits: float = PRIOR[0]
    tries: float = PRIOR[1]
    paused_until: int = 0  # the speculator's step count it may draft again at
    pause_steps: int = PAUSE_STEPS  # the next pause's length
    probing: bool = False  # after a pause: one single-token draft before the estimate decides

    @property
    def rate(self) -> float:
        return self.hits / self.tries

    def record(self, drafted: int, accepted: int, decay: float = DECAY) -> None:
        self.drafted += drafted
        self.accepted += accepted
        self.hits = decay * self.hits + accepted
        self.tries = decay * self.tries + accepted + (accepted < drafted)
        self.probing = False

    def pause(self, step: int, prior: float) -> None:
        """Drafting stopped paying: wait (each pause twice the one before), then probe with
        one drafted token, the estimate restarted from `prior` (the overall rate)."""
        self.paused_until = step + self.pause_steps
        self.pause_steps = min(2 * self.pause_steps, MAX_PAUSE_STEPS)
        self.hits, self.tries = prior * PRIOR_WEIGHT, PRIOR_WEIGHT
        self.probing = True


def expected_tokens(rate: float, k: int) -> float:
    """Tokens a step yields for a request drafting k (each accepted with probability
    `rate`, until the first rejection), its own sampled token included."""
    return k + 1 if rate >= 1 else (1 - rate ** (k + 1)) / (1 - rate)


def best_length(
    rate: float, row_cost: float, batch: int, most: int, plain: float | None = None
) -> int:
    """How many tokens to draft (0: none) when each is accepted with probability `rate`
    (until the first rejection), a step of R rows costs 1 + row_cost * (R - 1) times a
    one-row step, a plain step of the batch costs `plain` (default: its rows' cost; less
    where multi-step decode runs) and `batch` requests decode (each assumed to draft as
    many): the length that most raises expected tokens per unit of step time, if any does."""
    plain = 1 + row_cost * (batch - 1) if plain is None else plain
    best, best_gain = 0, 1.0
    for k in range(1, most + 1):
        gain = expected_tokens(rate, k) * plain / (1 + row_cost * (batch * (k + 1) - 1))
        if gain > best_gain:
            best, best_gain = k, gain
    return best


class NgramDrafter:
    """Prompt lookup over the request's own tokens, searched as bytes (C speed)."""

    def __init__(self, min_window: int, max_window: int) -> None:
        self.min_window, self.max_window = min_window, max_window

    def propose_many(self, reqs: list[Req], lengths: list[int]) -> list[list[int]]:
        return [self.propose(req, n) if n > 0 else [] for req, n in zip(reqs, lengths)]

    def forget(self, req: Req) -> None:
        """Nothing to free: the drafts come from the request's own tokens."""

    def check_integrity(self) -> None:
        """Nothing held."""

    def propose(self, req: Req, k: int) -> list[int]:
        tokens = array("i", req.prompt_ids)
        tokens.extend(req.output_ids)
        data, n = tokens.tobytes(), len(tokens)
        for window in range(min(self.max_window, n - 1), self.min_window - 1, -1):
            start = _latest_earlier(data, tokens[n - window :].tobytes(), n - window)
            if start is not None:
                follow = start + window
                return tokens[follow : follow + k].tolist()
        return []


def _latest_earlier(data: bytes, pattern: bytes, before: int) -> int | None:
    """The token index of the latest occurrence of `pattern` that starts before token index
    `before` (the suffix itself starts there), aligned to whole tokens, or None."""
    end = (before - 1) * 4 + len(pattern)  # an occurrence starting at before - 1 ends here
    while end > 0:
        at = data.rfind(pattern, 0, end)
        if at < 0:
            return None
        if at % 4 == 0:
            return at // 4
        end = at + len(pattern) - 1
    return None


# One more row's cost as a share of a one-row decode step until this machine's is measured
# (step_costs.py). CPU (2-core AMD EPYC VM, AVX-512, the bundled SmolLM2 Q4_1, 2 threads,
# whole engine steps, medians of 10 interleaved runs): 1 row 8.95 ms, 2 rows 11.2, 3 12.9,
# 5 18.8: 0.22-0.27; on an AVX2 EPYC of the same class 0.55-0.6. A GPU's decode step is bound
# by reading the weights: extra rows nearly free.
ROW_COST_CPU = 0.3
ROW_COST_GPU = 0.05


class Speculator:
    """Decides each step which decoding requests draft, how much, and gets the drafts."""

    def __init__(
        self, options: SpeculativeOptions, context_len: int, device: str, drafter=None,
        tokenizer=None, clock: Callable[[], float] = time.perf_counter,
    ) -> None:  # fmt: skip
        """`drafter`: one with `propose_many(reqs, lengths)`, `forget(req)` and
        `check_integrity()` (default: prompt lookup); `tokenizer`: for drafts of the text a
        grammar forces; `clock`: times the steps (step_costs.py)."""
        self.options = options
        self.tokenizer = tokenizer
        self.context_len = context_len
        self.fixed_row_cost = options.speculative_row_cost  # None: measured
        self.default_row_cost = ROW_COST_GPU if device != "cpu" else ROW_COST_CPU
        self.costs = StepCosts(clock)
        self.drafter = drafter or NgramDrafter(
            options.speculative_ngram_min_match_window_size,
            options.speculative_ngram_max_match_window_size,
        )
        self.overall = SpecState()  # acceptance over all requests: a fresh estimate's start
        self.step = 0
        self.drafted = 0  # totals over all requests (metrics)
        self.accepted = 0

    def drafts(self, decoding: list[Req], alone: bool = True) -> dict[int, list[int]]:
        """{id(req): its draft} for the requests that draft this step. `alone`: no other
        request prefills or waits this step (the step's time is a decode step's)."""
        start = self.costs.clock()
        self.step += 1
        out = {}
        if len(decoding) <= self.options.speculative_max_batch_size:
            out = self._drafts(decoding)
        self.costs.begin(decoding, sum(map(len, out.values())), alone, start)
        return out

    def _drafts(self, decoding: list[Req]) -> dict[int, list[int]]:
        if self._explore_plain(len(decoding)):
            return {}
        lengths = [self._length(req, len(decoding)) for req in decoding]
        if not any(lengths):
            return {}
        proposed = self.drafter.propose_many(decoding, lengths)
        out = {}
        for req, n, draft in zip(decoding, lengths, proposed):
            if req.cursor is not None and n:
                draft = cut_for_grammar(req, draft or self._forced(req, n))
            if draft:
                out[id(req)] = draft
        return out if self._pays(decoding, out) else {}

    def _explore_plain(self, batch: int) -> bool:
        """While plain steps at this batch size are not timed, a few in a row now and then
        (multi-step decode runs from the second), so drafts are weighed against them."""
        if self.fixed_row_cost is not None or self.costs.knows_plain(batch):
            return False
        return self.step % EXPLORE_EVERY < EXPLORE_STEPS

    def record(self, req: Req, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted
        self.overall.record(drafted, accepted, OVERALL_DECAY)
        if req.spec is not None:
            req.spec.record(drafted, accepted)

    def _forced(self, req: Req, n: int) -> list[int]:
        """The text the grammar forces from here (jump-forward's, when it is off or the
        text is shorter than its minimum), tokenized, as a draft."""
        if self.tokenizer is None:
            return []
        text = req.cursor.jump_forward_text()
        return self.tokenizer.encode(text, add_special_tokens=False)[:n] if text else []

    def forget(self, req: Req) -> None:
        """The request left the running set: the drafter's state of it goes."""
        self.drafter.forget(req)

    def row_cost(self) -> float:
        """One more row's cost as a share of a one-row step: the configured one, else the
        measured one, else the device's default."""
        if self.fixed_row_cost is not None:
            return self.fixed_row_cost
        measured = self.costs.row_cost()
        return self.default_row_cost if measured is None else measured

    def plain_cost(self, batch: int) -> float:
        """A plain step's cost at `batch` requests in one-row steps (measured where the row
        cost is: multi-step decode makes it less than its rows' cost)."""
        measured = None if self.fixed_row_cost is not None else self.costs.plain_cost(batch)
        return 1 + self.row_cost() * (batch - 1) if measured is None else measured

    def _best(self, rate: float, batch: int) -> int:
        most = self.options.speculative_num_draft_tokens
        return best_length(rate, self.row_cost(), batch, most, self.plain_cost(batch))

    def _length(self, req: Req, batch: int) -> int:
        """How many tokens the request drafts this step (0: none)."""
        if not req.sampling.speculative or req.pooling is not None:
            return 0
        if req.spec is None:
            req.spec = SpecState(hits=self.overall.rate * PRIOR_WEIGHT, tries=PRIOR_WEIGHT)
        spec = req.spec
        if self.step < spec.paused_until:
            return 0
        if spec.probing:  # one token, where drafts could pay at all
            most = min(self._best(1.0, batch), 1)
        elif self._best(spec.rate, 1) == 0:
            spec.pause(self.step, self.overall.rate)  # its drafts do not pay even alone
            return 0
        else:
            most = self._best(spec.rate, batch)  # 0: not in this batch
            if most and self.fixed_row_cost is None and self.costs.row_cost() is None:
                most += self.step % 2  # lengths that vary, so what a row costs is measured
        # room: the sampled token plus the drafts must fit max_new_tokens and the context
        room = min(
            req.sampling.max_new_tokens - len(req.output_ids) - 1,
            self.context_len - req.total_len - 1,
        )
        return max(min(most, room), 0)

    def _pays(self, decoding: list[Req], drafts: dict[int, list[int]]) -> bool:
        """Whether the step with these drafts yields more expected tokens per unit of time
        than the plain step (which may be a multi-step decode); probes always run."""
        batch, rows, tokens, probing = len(decoding), 0, 0.0, False
        for req in decoding:
            k = len(drafts.get(id(req), ()))
            rows += k
            tokens += expected_tokens(req.spec.rate, k) if k else 1
            probing |= k > 0 and req.spec.probing
        cost = 1 + self.row_cost() * (batch + rows - 1)
        return probing or tokens / cost > batch / self.plain_cost(batch)


def cut_for_grammar(req: Req, draft: list[int]) -> list[int]:
    """The longest head of `draft` the grammar accepts and whose every next mask is already
    made (drafts never make masks: that work stays in the step's mask budget). The cursor
    is walked and rolled back."""
    cursor, pushed, kept = req.cursor, 0, 0
    for token in draft:
        if not cursor.accept_token(token):
            break
        pushed += 1
        if not _mask_ready(cursor):
            break  # the mask after this token is not made: it cannot be verified
        kept += 1
    cursor.rollback(pushed)
    return draft[:kept]


def _mask_ready(cursor) -> bool:
    try:
        return cursor.prepare_mask(0)
    except Exception:  # noqa: BLE001 (a mask past its bound: the step's own check reports it)
        return False
