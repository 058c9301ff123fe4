"""The scheduler: pure bookkeeping with two calls, `schedule()` and `update(...)`.

Continuous batching: requests join and leave the running set between steps; one step
mixes decode tokens and prefill chunks under a token budget (or runs prefill alone with
`prefill_first`). Memory comes from the KV pool via the cache manager; when decoding runs
out of slots even after eviction, the most recently admitted requests are retracted to the
waiting queue with their progress (their tokens stay in the prefix cache).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from spruce.runtime.config import ConstraintOptions, SchedulerOptions
from spruce.runtime.core.request import FinishReason, Req
from spruce.runtime.scheduler.cache import CacheManager
from spruce.runtime.scheduler.decode import DecodeManager
from spruce.runtime.scheduler.grammar_queue import GrammarQueue
from spruce.runtime.scheduler.output import ScheduleOutput, StepResult
from spruce.runtime.scheduler.prefill import PrefillManager
from spruce.runtime.text.stop import StopChecker


@dataclass(slots=True)
class SchedulerStats:
    """Cumulative counters (rates derived from them aggregate correctly over any window)."""

    requests_finished: int = 0
    generated_tokens: int = 0
    retractions: int = 0
    steps: int = 0


class Scheduler:
    def __init__(
        self,
        options: SchedulerOptions,
        cache: CacheManager,
        stops: StopChecker,
        constraint_options: ConstraintOptions | None = None,
        on_release=None,
    ) -> None:
        self.options = options
        self.constraint_options = constraint_options or ConstraintOptions()
        self.cache = cache
        self.stops = stops
        self.prefill = PrefillManager(options, cache)
        self.decode = DecodeManager(cache)
        self.grammars = GrammarQueue()
        self.running: list[Req] = []
        self.stats = SchedulerStats()
        self._finished_outside_step: list[Req] = []
        self._aborts: dict[str, str] = {}
        self.on_release = on_release  # optional callback(req) when a request leaves (sampler state)

    # -- queue ------------------------------------------------------------------------

    @property
    def waiting(self) -> list[Req]:
        return self.prefill.waiting

    def add(self, req: Req) -> None:
        if req.grammar_future is not None:
            self.grammars.add(req)
        else:
            self.prefill.waiting.append(req)

    def abort(self, rid: str, message: str = "aborted by the client") -> None:
        """Takes effect at the next schedule(); the request finishes with type abort."""
        self._aborts[rid] = message

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self.grammars or self._finished_outside_step or self._aborts)

    def pop_finished_outside_step(self) -> list[Req]:
        out, self._finished_outside_step = self._finished_outside_step, []
        return out

    # -- schedule -----------------------------------------------------------------------

    def schedule(self) -> ScheduleOutput:
        self._apply_aborts()
        self._admit_compiled()
        out = ScheduleOutput()
        budget = self.options.chunked_prefill_size
        decoding = [r for r in self.running if r.remaining == 1]
        continuing = [r for r in self.running if r.remaining > 1]
        if decoding and not (self.options.prefill_first and (continuing or self.waiting)):
            for req in self.decode.schedule(out, decoding, self.running):
                self._retract(req)
            continuing = [r for r in continuing if r in self.running]
        budget = self.prefill.continue_running(out, continuing, budget)
        self.running.extend(self.prefill.admit(out, self.running, budget))
        if not out and self.running:  # every running request is starved of KV slots
            self._retract(max(self.running, key=lambda r: r.admit_order))
        self.stats.steps += bool(out)
        return out

    def _retract(self, req: Req) -> None:
        self.running.remove(req)
        self.cache.release(req)
        req.computed_len = 0
        self.prefill.waiting.insert(0, req)
        self.stats.retractions += 1

    def _admit_compiled(self) -> None:
        if not self.grammars:
            return
        ready, failed = self.grammars.poll()
        self.waiting.extend(ready)
        for req in failed:
            self._finish_outside_step(req, FinishReason("abort", message=str(req.error)))

    def _apply_aborts(self) -> None:
        if not self._aborts:
            return
        queued = [*self.grammars.pending, *self.waiting, *self.running]
        for req in [r for r in queued if r.rid in self._aborts]:
            self._finish_outside_step(req, FinishReason("abort", message=self._aborts[req.rid]))
        self._aborts.clear()

    def _finish_outside_step(self, req: Req, reason: FinishReason) -> None:
        """Finishes a request that is not part of a step (reported by the next step)."""
        self._finish(req, reason)
        self._finished_outside_step.append(req)

    # -- update -------------------------------------------------------------------------

    def update(self, out: ScheduleOutput, result: StepResult) -> list[Req]:
        """Applies a step's results; returns the requests with news (new tokens or finished)."""
        changed = []
        for i, req in enumerate(out.reqs):
            req.computed_len += out.extend_lens[i]
            self._record_prompt_logprobs(req, result.prompt_logprobs[i])
            token = result.next_token_ids[i]
            if out.extend_lens[i] > 1:
                # a prompt chunk or jump-forward text: share it now, not when the request ends
                self.cache.cache_partial(req)
            if token is not None:
                self._append(req, token, result.token_logprobs[i])
            elif req.remaining == 0:  # max_new_tokens == 0: the prompt is now cached
                self._finish(req, FinishReason("length"))
            if token is not None or req.finished:
                changed.append(req)
        return changed

    def _append(self, req: Req, token: int, logprobs) -> None:
        if req.first_token_at is None:
            req.first_token_at = time.perf_counter()
        req.output_ids.append(token)
        self.stats.generated_tokens += 1
        if logprobs is not None:
            req.logprobs.output_token_logprobs.append((logprobs.logprob, token))
            req.logprobs.output_top_logprobs.append(logprobs.top)
        if req.cursor is not None and not req.cursor.accept_token(token):  # EOS ends the cursor
            self._finish(req, FinishReason("abort", message="the grammar refused a sampled token"))
            return
        reason = self.stops.check(req, 1)
        if reason is None and req.cursor is not None and not self.constraint_options.disable_jump_forward:
            reason = self._jump_forward(req)
        if reason is not None:
            self._finish(req, reason)

    def _jump_forward(self, req: Req) -> FinishReason | None:
        """Appends the text the grammar forces now, re-tokenized canonically; the new tokens
        are computed in one extend pass next step instead of one decode step each."""
        jump = req.cursor.jump_forward(req.output_ids, self.stops.tokenizer, self.constraint_options.jump_forward_min_chars)
        if jump is None:
            return None
        kept = req.output_ids[: len(req.output_ids) - jump.rollback]
        room = req.sampling.max_new_tokens - len(kept)
        new_ids = jump.new_ids[:room]
        if len(new_ids) < len(jump.new_ids):
            req.cursor.rollback(len(jump.new_ids) - len(new_ids))
        req.output_ids = kept + new_ids
        self.cache.rollback(req, min(req.computed_len, len(req.prompt_ids) + len(kept)))
        req.jump_forward_tokens += len(new_ids)
        return self.stops.check(req, len(new_ids)) if new_ids else None

    def _record_prompt_logprobs(self, req: Req, entries) -> None:
        if not entries:
            return
        for logprob, token, top in entries:
            req.logprobs.input_token_logprobs.append((logprob, token))
            req.logprobs.input_top_logprobs.append(top if logprob is not None else None)

    def _finish(self, req: Req, reason: FinishReason) -> None:
        req.finish(reason)
        for queue in (self.running, self.waiting, self.grammars.pending):
            if req in queue:
                queue.remove(req)
        self.cache.release(req)
        self.stats.requests_finished += 1
        if self.on_release is not None:
            self.on_release(req)

