"""The scheduler: pure bookkeeping with two calls, `schedule()` and `update(...)`.

Continuous batching: requests join and leave the running set between steps; one step
mixes decode tokens and prefill chunks under a token budget (or runs prefill alone with
`prefill_first`). Memory comes from the KV pool via the cache manager; when decoding runs
out of slots even after eviction, the most recently admitted requests are retracted to the
waiting queue with their progress (their tokens stay in the prefix cache).

Failures: `step_failed(out, error)` rolls back a step whose forward pass raised, and the
requests of that step then run alone until each has succeeded once or failed twice alone
(faults.py); `update` aborts a request whose own row or output processing failed, alone.
`check_integrity()` verifies the KV accounting after any of these.

Grammar masks are made before a step within a per-step budget of new DFA states
(grammar_queue.prepare_masks): a request whose next mask is not ready sits the step out,
never sampled without it, while the others run.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from spruce.constrained.core import errors as constrained_errors
from spruce.runtime.config import ConstraintOptions, SchedulerOptions
from spruce.runtime.core.request import FinishReason, PromptLogprob, Req, TokenLogprobs
from spruce.runtime.errors import ConstraintError, constraint_error
from spruce.runtime.executor.sampler import plain_argmax
from spruce.runtime.scheduler.cache import CacheManager
from spruce.runtime.scheduler.decode import DecodeManager
from spruce.runtime.scheduler.faults import FaultTracker, RequestFault
from spruce.runtime.scheduler.grammar_queue import GrammarQueue, prepare_masks, refused_token
from spruce.runtime.scheduler.output import Sampled, Scheduled, ScheduleOutput
from spruce.runtime.scheduler.pace import StepPace
from spruce.runtime.scheduler.prefill import PrefillManager, fair_split
from spruce.runtime.scheduler.speculative import Speculator
from spruce.runtime.text.stop import StopChecker

logger = logging.getLogger("spruce.scheduler")
STEPS_SECONDS = 0.05  # a multi-step decode batch runs about this long at most


@dataclass(slots=True)
class SchedulerStats:
    """Cumulative counters (rates derived from them aggregate correctly over any window)."""

    requests_finished: int = 0
    generated_tokens: int = 0
    retractions: int = 0
    steps: int = 0
    failed_steps: int = 0
    request_faults: int = 0  # requests aborted for a failure of their own


class Scheduler:
    def __init__(
        self,
        options: SchedulerOptions,
        cache: CacheManager,
        stops: StopChecker,
        constraint_options: ConstraintOptions | None = None,
        on_release=None,
        speculator: Speculator | None = None,
    ) -> None:
        self.options = options
        self.constraint_options = constraint_options or ConstraintOptions()
        self.cache = cache
        self.stops = stops
        self.prefill = PrefillManager(options, cache)
        self.decode = DecodeManager(cache)
        self.grammars = GrammarQueue()
        self.faults = FaultTracker()
        self.running: list[Req] = []
        self.stats = SchedulerStats()
        self._finished_outside_step: list[Req] = []
        self._aborts: dict[str, str] = {}
        self.on_release = on_release  # optional callback(req) when a request leaves (sampler state)
        self.speculator = speculator  # drafts for decoding requests (None: no speculation)
        # greedy decode steps a batch of decodes may run in one step (the engine sets 1
        # where its runner gains nothing); the last decode step's seconds per forward pass
        # and its batch size (set by the engine)
        self.decode_steps = options.decode_steps
        self.step_seconds: float | None = None
        self.step_batch = 0
        self.pace = StepPace()  # measured step costs: a mixed step's prefill budget (pace.py)

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
        return bool(
            self.running
            or self.waiting
            or self.grammars
            or self._finished_outside_step
            or self._aborts
        )

    def pop_finished_outside_step(self) -> list[Req]:
        out, self._finished_outside_step = self._finished_outside_step, []
        return out

    # -- schedule -----------------------------------------------------------------------

    def schedule(self) -> ScheduleOutput:
        self._apply_aborts()
        self._admit_compiled()
        if self.faults:
            out = self._schedule_suspect()
            if out:
                self.stats.steps += 1
                return out
        out = ScheduleOutput()
        held = self._prepare_masks()  # requests whose next mask is not made yet sit this step out
        decoding = [r for r in self.running if r.remaining == 1 and id(r) not in held]
        continuing = [r for r in self.running if r.remaining > 1 and id(r) not in held]
        if decoding and not (self.options.prefill_first and (continuing or self.waiting)):
            others = bool(continuing or held or self.waiting)
            drafts = self.speculator.drafts(decoding, not others) if self.speculator else None
            alone = not (drafts or others)
            steps = self._decode_steps(decoding) if alone else 1
            for req in self.decode.schedule(out, decoding, self.running, drafts, steps):
                self._retract(req)
            continuing = [r for r in continuing if r in self.running]
        if not (out and self._decodes_turn()):
            self._schedule_prefill(out, continuing)
        if not out and self.running and not held:  # every running request is starved of KV slots
            self._retract(max(self.running, key=lambda r: r.admit_order))
        self.stats.steps += bool(out)
        return out

    def _schedule_prefill(self, out: ScheduleOutput, continuing: list[Req]) -> None:
        """Adds prompt chunks to `out`: as many tokens as keep the step under --max-step-ms
        at the measured pace (pace.py), shared fairly between clients (prefill.py)."""
        budget = self.pace.prefill_budget(
            self.options.max_step_ms / 1000, self.options.chunked_prefill_size
        )
        shares = fair_split(self.prefill.demands(continuing), budget)
        self.prefill.continue_running(out, continuing, shares)
        self.running.extend(self.prefill.admit(out, self.running, shares))

    def _decodes_turn(self) -> bool:
        """After a step with prefill beside other clients' decodes, those decodes get their
        share of the time alone (pace.py)."""
        return self.options.max_step_ms > 0 and self.pace.decode_owed > 0

    def record_step(self, out: ScheduleOutput, seconds: float) -> None:
        """The engine's report of a step that ran: its seconds per forward pass."""
        prefill, prefilled, decoded = 0, set(), set()
        for item in out.scheduled:
            if item.num_tokens > 1 + item.ahead:
                prefill += item.num_tokens
                prefilled.add(item.req.client)
            else:
                decoded.add(item.req.client)
        self.pace.record(seconds, prefill, (len(prefilled), len(decoded - prefilled)), out.steps)

    def _decode_steps(self, decoding: list[Req]) -> int:
        """How many greedy decode steps a batch of decodes alone runs in one step: up to
        `decode_steps`, as many as fit STEPS_SECONDS at the last decode step's pace (a
        request that arrives meanwhile waits for them; one step until a step of at least
        this many requests was timed), none past a request's max_new_tokens or the context;
        1 unless every request picks its tokens by plain argmax with nothing to do between
        them (Sampler.plain_argmax, and no thinking budget)."""
        if self.decode_steps <= 1 or self.step_seconds is None or len(decoding) > self.step_batch:
            return 1
        if not all(plain_argmax(r) and r.thinking is None for r in decoding):
            return 1
        width = self.cache.table.table.shape[1]
        room = min(
            min(r.sampling.max_new_tokens - len(r.output_ids), width - r.total_len + 1)
            for r in decoding
        )
        paced = int(STEPS_SECONDS / max(self.step_seconds, 1e-6))
        return max(1, min(self.decode_steps, paced, room))

    def _schedule_suspect(self) -> ScheduleOutput:
        """After a failed forward pass: the next suspect alone (nothing else runs while
        suspects remain, so a failure names its request). Empty when it gets no slots."""
        out = ScheduleOutput()
        req = self.faults.next_suspect(self.running)
        if req is None:
            return out
        n = min(req.remaining, self.options.chunked_prefill_size)
        slots = self.cache.alloc(n)
        if slots is not None:
            out.add(req, n, slots)
        return out

    def _retract(self, req: Req) -> None:
        self.running.remove(req)
        self.cache.release(req)
        if self.speculator is not None:
            self.speculator.forget(req)
        req.computed_len = 0
        self.prefill.waiting.insert(0, req)
        self.stats.retractions += 1

    def _prepare_masks(self) -> set[int]:
        """Makes the masks running requests sample with next, within a per-step budget
        (grammar_queue.prepare_masks): the ids of those that wait a step; the ones that
        failed (a mask or grammar past its bound) are aborted."""
        held, failed = prepare_masks(self.running)
        for req in failed:
            self._finish_outside_step(req, FinishReason("abort", message=str(req.error)))
        return {id(r) for r in held}

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

    def update(self, out: ScheduleOutput) -> list[Req]:
        """Applies a step's results (each `Scheduled.result`); returns the requests with
        news (new tokens or finished). A request whose row failed (`Sampled.error`), or
        whose output processing raises, is aborted alone; the others are updated as usual."""
        self.faults.step_succeeded(out.reqs)
        changed = []
        for item in out.scheduled:
            req, result = item.req, item.result
            assert result is not None, "update() of a step that did not run"
            error = result.error
            if item.ahead and error is None:
                error = self._update_drafted(item)
            elif item.ahead:  # its row failed: its last token is computed, the rest go
                req.computed_len += 1
                self._drop_draft_slots(item, 1)
            else:
                req.computed_len += item.num_tokens  # the forward pass wrote these K/V
                if error is None:
                    error = self._update_one(req, item.num_tokens, result)
            if error is not None:
                self.fail_request(req, error)
            if result.token_id is not None or req.finished:
                changed.append(req)
        return changed

    def _update_one(self, req: Req, num_tokens: int, result: Sampled) -> str | None:
        """One request's part of update(); the error message if it raised."""
        try:
            self._record_prompt_logprobs(req, result.prompt_logprobs)
            if num_tokens > 1:
                # a prompt chunk or jump-forward text: share it now, not when the request ends
                self.cache.cache_partial(req)
            if result.token_id is not None:
                self._append(req, result.token_id, result.logprobs)
            elif req.remaining == 0:  # max_new_tokens == 0: the prompt is now cached
                self._finish(req, FinishReason("length"))
        except constrained_errors.ConstraintError as e:  # its grammar outgrew a budget
            req.error = constraint_error(e)
            return str(e)
        except Exception:  # its own stop strings, cursor, detokenization
            logger.exception("processing the output of request %s failed", req.rid)
            return "processing this request's output failed (see the server log)"
        return None

    def _update_drafted(self, item: Scheduled) -> str | None:
        """A drafting (or multi-step) request's part of update(): its last token and the
        accepted drafts (the tokens its steps chose) become computed one by one as the
        tokens are appended (stop strings, the grammar, jump-forward and the thinking budget
        act after each as in plain decoding); appending stops where the request finishes or
        its output stops following them, and the slots past what is computed are freed at
        once."""
        req, result = item.req, item.result
        start, counted = req.computed_len, 0
        tokens, logprobs = result.tokens, result.token_logprobs
        rewritten = req.rewritten_from
        try:
            for i, token in enumerate(tokens):
                counted += 1  # the last token (i == 0) or the draft token i - 1 is computed
                req.computed_len = start + counted
                expected = len(req.output_ids) + 1
                self._append(req, token, logprobs[i] if logprobs else None)
                moved = len(req.output_ids) != expected or req.rewritten_from != rewritten
                if req.finished or moved:
                    break
        except constrained_errors.ConstraintError as e:
            req.error = constraint_error(e)
            return str(e)
        except Exception:
            logger.exception("processing the output of request %s failed", req.rid)
            return "processing this request's output failed (see the server log)"
        finally:
            self._drop_draft_slots(item, counted)
            if self.speculator is not None and item.draft:
                self.speculator.record(req, len(item.draft), len(tokens) - 1)
        return None

    def _drop_draft_slots(self, item: Scheduled, counted: int) -> None:
        """Frees the step's slots past the first `counted` (those became computed)."""
        if counted < item.num_tokens:
            self.cache.free_slots(item.slots[counted:])
            item.slots = item.slots[:counted]

    # -- failures -------------------------------------------------------------------------

    def fail_request(self, req: Req, message: str) -> None:
        """Aborts one request for a failure of its own: a RequestFault (500 for a client),
        or the ConstraintError already in `req.error` (its grammar outgrew a budget while it
        ran: 400, and the error's message)."""
        if req.finished:
            return
        if isinstance(req.error, ConstraintError):
            message = str(req.error)
        else:
            req.error = RequestFault(message)
            self.stats.request_faults += 1
        self._finish(req, FinishReason("abort", message=message))

    def step_failed(self, out: ScheduleOutput, error: BaseException) -> list[Req]:
        """Rolls back a step whose forward pass (or batched sampling) raised before
        `update()`: its new slots are freed and its table positions reset, `computed_len`
        is unchanged (requests admitted by the step stay admitted, with their cached
        prefix). The requests become suspects (see faults.py); returns the ones aborted."""
        self.stats.failed_steps += 1
        for item in out.scheduled:
            self.cache.undo_step(item.req, item.slots)
        aborted = self.faults.step_failed(out.reqs)
        for req in aborted:
            self.fail_request(
                req, f"the forward pass failed each time this request ran alone: {error!r}"
            )
        return aborted

    def check_integrity(self) -> None:
        """Debug check after failures: KV accounting is exact, admitted requests hold
        distinct rows, queued ones hold none."""
        rows = [r.row for r in self.running]
        assert None not in rows and len(set(rows)) == len(rows), (
            "running requests share or lack rows"
        )
        assert all(r.row is None for r in [*self.waiting, *self.grammars.pending]), (
            "a queued request holds a row"
        )
        self.cache.check_integrity(self.running)
        if self.speculator is not None:
            self.speculator.drafter.check_integrity()

    def _append(self, req: Req, token: int, logprobs: TokenLogprobs | None) -> None:
        if req.first_token_at is None:
            req.first_token_at = time.perf_counter()
        req.output_ids.append(token)
        self.stats.generated_tokens += 1
        if logprobs is not None:
            req.logprobs.output_token_logprobs.append((logprobs.logprob, token))
            req.logprobs.output_top_logprobs.append(logprobs.top)
        if req.cursor is not None and not req.cursor.accept_token(token):  # EOS ends the cursor
            req.error = refused_token(req, token)  # the client's constraint: a 400
            self._finish(req, FinishReason("abort", message=str(req.error)))
            return
        reason = self.stops.check(req, 1)
        if reason is None and req.thinking is not None:
            reason = self._close_thinking(req)
        if (
            reason is None
            and req.cursor is not None
            and not self.constraint_options.disable_jump_forward
        ):
            reason = self._jump_forward(req)
        if reason is not None:
            self._finish(req, reason)

    def _close_thinking(self, req: Req) -> FinishReason | None:
        """Writes the reasoning block's end marker when the request's thinking budget is
        spent (thinking.py); its ids go through the grammar cursor as sampled ones do."""
        room = max(req.sampling.max_new_tokens - len(req.output_ids), 0)
        spellings = [ids[:room] for ids in req.thinking.forced(req.output_ids)]
        ids = next((ids for ids in spellings if ids and _allows(req, ids)), None)
        if ids is None:
            return None  # nothing due, or not yet (a character left open): after the next token
        for token in ids:
            if req.cursor is not None:
                req.cursor.accept_token(token)
            req.output_ids.append(token)
        req.thinking.done = True
        return self.stops.check(req, len(ids))

    def _jump_forward(self, req: Req) -> FinishReason | None:
        """Appends the text the grammar forces now, re-tokenized canonically; the new tokens
        are computed in one extend pass next step instead of one decode step each."""
        jump = req.cursor.jump_forward(
            req.output_ids, self.stops.tokenizer, self.constraint_options.jump_forward_min_chars
        )
        if jump is None:
            return None
        kept = req.output_ids[: len(req.output_ids) - jump.rollback]
        room = req.sampling.max_new_tokens - len(kept)
        new_ids = jump.new_ids[:room]
        if len(new_ids) < len(jump.new_ids):
            req.cursor.rollback(len(jump.new_ids) - len(new_ids))
        if jump.rollback:
            start = len(kept) if req.rewritten_from is None else req.rewritten_from
            req.rewritten_from = min(start, len(kept))
        req.output_ids = kept + new_ids
        self.cache.rollback(req, min(req.computed_len, len(req.prompt_ids) + len(kept)))
        req.jump_forward_tokens += len(new_ids)
        return self.stops.check(req, len(new_ids)) if new_ids else None

    def _record_prompt_logprobs(self, req: Req, entries: list[PromptLogprob] | None) -> None:
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
        if self.speculator is not None:
            self.speculator.forget(req)
        self.stats.requests_finished += 1
        if self.on_release is not None:
            self.on_release(req)


def _allows(req: Req, ids: list[int]) -> bool:
    return req.cursor is None or req.cursor.accepts(0, ids)
