"""EngineCore: the model runner, scheduler and sampler behind one `step()`.

The offline Engine and the server's scheduler process both drive this class; only their
I/O differs. Requests arrive validated (`core.validation`, called by every front end).
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from concurrent.futures import FIRST_COMPLETED, wait
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from spruce.constrained import GrammarCompiler
from spruce.constrained.convert import Conversion
from spruce.radix import NoPrefixCache, RadixCache
from spruce.runtime.config import EngineConfig
from spruce.runtime.core.request import Req
from spruce.runtime.core.validation import ModelLimits, ValidRequest
from spruce.runtime.engine import tp_worker
from spruce.runtime.engine.draft_model import DraftModelDrafter
from spruce.runtime.engine.pooling import pool, pooled_rows, resolve_pooling
from spruce.runtime.engine.verify import sample_rows
from spruce.runtime.errors import InvalidRequestError, SpruceError
from spruce.runtime.executor.attention import resolve_backend
from spruce.runtime.executor.distributed import RankLost, close_group, start_keepalive
from spruce.runtime.executor.distributed import send_stop as send_stop_message
from spruce.runtime.executor.kv_pool import KVShape, pool_slots_for_budget
from spruce.runtime.executor.logits_mask import GrammarMask
from spruce.runtime.executor.model_runner import ForwardItem, ModelRunner
from spruce.runtime.executor.sampler import NO_TOKEN, Sampler, prompt_logprobs
from spruce.runtime.models.loading.loader import LoadedModel, load_model, parse_dtype
from spruce.runtime.scheduler.cache import CacheManager
from spruce.runtime.scheduler.output import Sampled, Scheduled, ScheduleOutput
from spruce.runtime.scheduler.scheduler import Scheduler
from spruce.runtime.scheduler.speculative import Speculator
from spruce.runtime.scheduler.thinking import ThinkingBudget
from spruce.runtime.text.stop import StopChecker

logger = logging.getLogger("spruce")
DEFAULT_CPU_KV_GB = 2.0


@dataclass(frozen=True, slots=True)
class StepInfo:
    seconds: float  # of one forward pass (a multi-step decode batch's share per step)
    batch_size: int
    num_tokens: int
    all_decode: bool
    steps: int = 1  # forward passes it ran (greedy decode steps: scheduler.decode_steps)


class EngineCore:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        device = config.resolved_device
        if device == "cpu":
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        self.tp, self.followers = None, []
        self.rank_lost: str | None = (
            None  # why the tensor-parallel group cannot compute, once it cannot
        )
        self.tp_stopped = False
        try:
            if config.parallel.tp_size > 1:
                self._start_tensor_parallel(loaded)
            self._build(config, device, loaded)
        except BaseException:
            self._stop_tensor_parallel(send_stop=hasattr(self, "runner"))  # followers follow
            raise
        if self.tp is not None:
            start_keepalive(self.tp, lambda: self.tp_stopped, self._lose_rank)

    def _start_tensor_parallel(self, loaded: LoadedModel | None) -> None:
        """This process becomes rank 0 and starts this machine's other ranks."""
        if loaded is not None:
            raise InvalidRequestError("a tensor-parallel engine loads its own slices: no loaded=")
        where = tp_worker.place(self.config)
        if where.rank != 0:
            raise InvalidRequestError(
                f"this process is tensor-parallel rank {where.rank}; only rank 0 runs the engine "
                "(`spruce serve` runs the other ranks as followers)"
            )
        self.followers = tp_worker.start_followers(self.config, where)
        self.tp = tp_worker.join(self.config, where)

    def _stop_tensor_parallel(self, send_stop: bool = True) -> None:
        if self.tp is not None:
            with self.tp.lock:
                self.tp_stopped = True  # no keepalive after the stop
                if send_stop and self.rank_lost is None:
                    send_stop_message(self.tp)
            close_group()
        tp_worker.stop_followers(self.followers)
        self.tp, self.followers = None, []

    def _build(self, config: EngineConfig, device: str, loaded: LoadedModel | None) -> None:
        m, dtype = config.model, config.resolved_dtype
        self.loaded = loaded or load_model(m.model_path, dtype, device, m.quantization, self.tp)
        self.tokenizer = self.loaded.tokenizer
        model_config = self.loaded.config
        self.context_len = min(
            model_config.max_position_embeddings, config.model.context_length or 1 << 30
        )
        kv_dtype = self._kv_dtype(device)
        self.runner = ModelRunner(
            self.loaded,
            num_slots=self._num_slots(device, kv_dtype),
            max_requests=config.scheduler.max_running_requests + 2,  # + CUDA graph padding row
            max_context_len=self.context_len,
            attention_backend=resolve_backend(config.model.attention_backend, device),
            device=device,
            cuda_graph=not config.model.disable_cuda_graph,
            kv_dtype=kv_dtype,
            tp=self.tp,
        )
        if self.tp is not None:
            tp_worker.share_pool_sizes(self.runner, self.tp)
        self.vocab_size = model_config.vocab_size
        self.pooling = resolve_pooling(config.model.pooling, self.loaded.path)
        pool = self.runner.pool
        prefix_cache = (
            NoPrefixCache(pool.allocator)
            if config.cache.disable_radix_cache
            else RadixCache(pool.allocator)
        )
        self.cache_manager = CacheManager(pool.allocator, self.runner.req_to_token, prefix_cache)
        eos = self.tokenizer.eos_token_ids
        stops = StopChecker(self.tokenizer, eos)
        self.sampler = Sampler(self.vocab_size, eos, self.runner.device, config.seed)
        release = lambda req: self.sampler.release(req.rid)  # noqa: E731  (per-request generators)
        speculator = None
        if config.speculative.speculative_algorithm != "none":
            speculator = Speculator(
                config.speculative, self.context_len, device, self._draft_model(device),
                self.tokenizer,
            )  # fmt: skip
        self.scheduler = Scheduler(
            config.scheduler, self.cache_manager, stops, config.constraint, release, speculator
        )
        if device != "cpu" or self.tp is not None:  # one forward pass a step there anyway
            self.scheduler.decode_steps = 1
        self.grammar_mask = GrammarMask(
            self.vocab_size, config.scheduler.max_running_requests, self.runner.device
        )
        c = config.constraint
        self.compiler = GrammarCompiler(
            self.tokenizer, self.vocab_size, cache_size=c.grammar_cache_size, timeout_s=c.grammar_timeout_s,
            cache_bytes=c.grammar_cache_mb * 2**20, memory_mb=c.grammar_memory_mb,
        )  # fmt: skip
        self.step_log: list[StepInfo] | None = None  # set to a list to record every step
        logger.info(
            "KV pool: %d token slots (%.2f GB)",
            pool.capacity,
            pool.capacity * pool.shape.bytes_per_slot / 1e9,
        )

    def _draft_model(self, device: str) -> DraftModelDrafter | None:
        """The draft model's drafter (--speculative-algorithm draft), its pool as large as
        the target's in slots."""
        path = self.config.speculative.speculative_draft_model_path
        if path is None:
            return None
        m = self.config.model
        loaded = load_model(path, self.config.resolved_dtype, device, m.quantization)
        options = {
            "num_slots": self.runner.pool.capacity + 1, "max_requests": self.runner.req_to_token.table.shape[0],
            "max_context_len": self.context_len, "device": device, "kv_dtype": self._kv_dtype(device),
            "attention_backend": resolve_backend(m.attention_backend, device),
        }  # fmt: skip
        return DraftModelDrafter(loaded, self.loaded, options)

    def _kv_dtype(self, device: str) -> torch.dtype:
        """auto: the model's dtype, except float16 for a float32 model on the CPU (as
        llama.cpp does): half the memory and half the decode attention's memory traffic,
        which bounds a large batch's step there. float32 keeps greedy tokens identical to
        transformers'. int8 (CPU only): a scale per token and kv head, half float16's bytes."""
        name = self.config.cache.kv_cache_dtype
        if name == "int8":
            if device != "cpu":
                raise SpruceError("--kv-cache-dtype int8 runs on the CPU only (its kernels are C)")
            return torch.int8
        if name != "auto":
            return parse_dtype(name)
        model_dtype = next(self.loaded.model.parameters()).dtype
        return torch.float16 if device == "cpu" and model_dtype == torch.float32 else model_dtype

    def _num_slots(self, device: str, kv_dtype: torch.dtype) -> int:
        c = self.loaded.config
        shape = KVShape(c.num_layers, c.num_kv_heads, c.head_dim, kv_dtype)
        budget_gb = self.config.cache.kv_memory_gb
        if budget_gb is None and device != "cpu":
            free, _ = torch.cuda.mem_get_info()
            budget_bytes = int(free * self.config.cache.gpu_memory_fraction)
        else:
            budget_bytes = int((budget_gb or DEFAULT_CPU_KV_GB) * 2**30)
        slots = pool_slots_for_budget(shape, budget_bytes, min_slots=self.context_len + 1)
        if budget_gb is None:  # never more than every running request at full context needs
            slots = min(slots, self.config.scheduler.max_running_requests * self.context_len + 1)
        return slots

    # -- requests -------------------------------------------------------------------------

    @property
    def limits(self) -> ModelLimits:
        """What the validation boundary needs to know of this model and configuration."""
        c = self.config.constraint
        conversion = Conversion(
            c.grammar_whitespace_pattern or "",
            c.grammar_timeout_s,
            c.grammar_memory_mb,
            c.grammar_backend,
        )
        hidden = self.loaded.config.hidden_size
        return ModelLimits(
            self.vocab_size, self.context_len, conversion=conversion, hidden_size=hidden,
            token_bound=self.tokenizer.token_bound,
        )  # fmt: skip

    def add_request(self, valid: ValidRequest, rid: str | None = None) -> Req:
        """Queues a validated request (see core.validation: the scheduler trusts it); a
        constrained one first waits for its grammar to compile."""
        req = Req(
            rid=rid or uuid.uuid4().hex, prompt_ids=list(valid.input_ids), sampling=valid.sampling,
            options=valid.options, constraint=valid.constraint,
            pooling=self.pooling if valid.embed else None,
            thinking=ThinkingBudget.of(valid.sampling, self.tokenizer),
        )  # fmt: skip
        if req.constraint is not None:
            req.grammar_future = self.compiler.submit(req.constraint)
        self.scheduler.add(req)
        return req

    def abort(self, rid: str, message: str = "aborted by the client") -> None:
        self.scheduler.abort(rid, message)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # -- tensor-parallel ranks ------------------------------------------------------------

    def check_ranks(self) -> None:
        """Raises RankLost once a tensor-parallel rank is gone: one of this machine's
        followers exited, or a keepalive or a step's collectives failed (any rank)."""
        if self.tp is None:
            return
        if self.rank_lost is None:
            exited = [p for p in self.followers if p.poll() is not None]
            if exited:
                self._lose_rank(
                    f"tensor-parallel rank {self.followers.index(exited[0]) + 1} exited"
                )
        if self.rank_lost is not None:
            raise RankLost(f"{self.rank_lost}; the server cannot compute until it is restarted")

    def _lose_rank(self, reason: str) -> None:
        if self.rank_lost is None:
            logger.error("%s; the tensor-parallel group cannot compute any more", reason)
            self.rank_lost = reason

    # -- the step -------------------------------------------------------------------------

    def step(self) -> list[Req]:
        """One scheduling step and forward pass; returns requests with new tokens or finished.

        Never raises for a failure that belongs to requests: one request's failing row
        aborts that request; a failing forward pass is rolled back and its requests retried
        (see scheduler/faults.py). What escapes is a bug in the bookkeeping itself."""
        start = time.perf_counter()
        self.check_ranks()
        out = self.scheduler.schedule()
        changed = self.scheduler.pop_finished_outside_step()
        if not out:
            self._wait_for_grammars()
            return changed
        try:
            self._run(out)
        except Exception as e:  # the pass as a whole: no request named yet
            if self.tp is not None:  # a broken group does not heal: no retry
                logger.exception("a tensor-parallel forward pass failed")
                self._lose_rank(
                    "a tensor-parallel step failed (a rank is gone or stopped answering)"
                )
                self.scheduler.step_failed(
                    out, e
                )  # rolls the step back; the caller fails what is left
                self.check_ranks()
            logger.exception(
                "a forward pass over %d request(s) failed; rolling the step back", len(out)
            )
            return changed + self.scheduler.step_failed(out, e)
        changed += self.scheduler.update(out)
        self._time_step(out, start)
        return changed

    def _time_step(self, out: ScheduleOutput, start: float) -> None:
        """The step's seconds per forward pass: the scheduler's measure of its pace (a
        mixed step's prefill budget, the next multi-step decode batch), and the step log's
        record."""
        seconds = (time.perf_counter() - start) / out.steps
        self.scheduler.record_step(out, seconds)
        all_decode = all(item.num_tokens == item.steps for item in out.scheduled)
        if all_decode:
            self.scheduler.step_seconds, self.scheduler.step_batch = seconds, len(out)
        if self.step_log is not None:
            self.step_log.append(StepInfo(seconds, len(out), out.num_tokens, all_decode, out.steps))

    @torch.inference_mode()  # the sampler changes the runner's (inference) logits in place
    def _run(self, out: ScheduleOutput) -> None:
        """Runs the step's forward pass and sampling; sets each scheduled request's `result`."""
        if out.steps > 1:
            return self._run_steps(out)
        groups = [self._forward_items(s) for s in out.scheduled]
        items = [item for group in groups for item in group]
        with (
            self.tp.lock if self.tp is not None else nullcontext()
        ):  # --tp: no keepalive amid the step's collectives
            forward = self.runner.forward(items)
        sampling: list[tuple[Scheduled, int]] = []  # who samples, from which logits row
        i = 0  # the group's first item
        for scheduled, group in zip(out.scheduled, groups):
            item, j = group[0], i + len(group)
            first, end = forward.offsets[i], forward.offsets[j]
            scheduled.result = Sampled()
            if item.hidden:
                h = forward.hidden_offsets
                pool(scheduled.req, item.prefix_len, forward.hidden[h[i] : h[j]])
            if item.all_logits:  # prompt logprobs first: the sampler changes the logits in place
                self._prompt_logprobs(scheduled, forward.logits[first:end])
            if scheduled.samples and scheduled.result.error is None:
                sampling.append((scheduled, end - 1 - len(scheduled.draft)))
            i = j
        if sampling:
            self._sample(forward.logits, sampling)

    def _run_steps(self, out: ScheduleOutput) -> None:
        """A batch of decodes over several greedy steps in one runner call: each request's
        result holds the tokens chosen up to the first step whose logits allow none (that
        step, when it is the first, is the request's row error, as in the sampler)."""
        items = []
        for s in out.scheduled:
            start = s.req.computed_len
            items.append(ForwardItem(s.req.row, start, s.req.token_ids(start, start + 1), s.slots))
        ids, best = self.runner.decode_steps(items, out.steps)
        for scheduled, chosen, logits in zip(out.scheduled, ids, best):
            n = next((j for j, v in enumerate(logits) if not math.isfinite(v)), len(logits))
            scheduled.result = Sampled(tokens=chosen[:n])
            if n:
                scheduled.result.token_id = chosen[0]
            else:
                scheduled.result.error = NO_TOKEN

    def _sample(self, logits: torch.Tensor, sampling: list[tuple[Scheduled, int]]) -> None:
        """Samples each request's next token from its logits row (a drafting request's
        drafts verified from the rows after it: verify.py); sets its result's tokens,
        logprobs and row error."""
        sample_rows(
            logits, sampling, lambda rows, reqs: self.sampler.sample(rows, reqs, self.grammar_mask)
        )

    def _prompt_logprobs(self, scheduled: Scheduled, rows: torch.Tensor) -> None:
        """Sets the request's prompt logprobs of this step, or its error (its row only)."""
        req, result = scheduled.req, scheduled.result
        try:
            result.prompt_logprobs = prompt_logprobs(req, rows, req.computed_len)
        except Exception:  # this request's row only
            logger.exception("prompt logprobs of request %s failed", req.rid)
            result.error = "computing prompt logprobs failed (see the server log)"

    def _wait_for_grammars(self) -> None:
        """Nothing to compute but grammars compiling: wait for one instead of spinning."""
        futures = [r.grammar_future for r in self.scheduler.grammars.pending]
        if futures:
            wait(futures, timeout=0.05, return_when=FIRST_COMPLETED)

    def _forward_items(self, scheduled: Scheduled) -> list[ForwardItem]:
        """The request's part of the forward pass: one item, or with drafts one item per
        token (its last, then each draft) at consecutive positions of its row, so a step of
        decodes and drafts stays a decode step: each row is computed as plain decoding
        computes that token, so verify.py samples from the same logits."""
        req, n, draft = scheduled.req, scheduled.num_tokens, scheduled.draft
        start = req.computed_len
        if draft:
            ids = [*req.token_ids(start, start + 1), *draft]
            slots = scheduled.slots.split(1)
            return [ForwardItem(req.row, start + j, [t], slots[j]) for j, t in enumerate(ids)]
        lp_start = req.prompt_logprob_start
        # prompt logprobs need every position from logprob_start_len - 1 to the prompt's end
        all_logits = lp_start is not None and start < len(req.prompt_ids) and start + n >= lp_start
        new_ids = req.token_ids(start, start + n)
        hidden = pooled_rows(req, start, n)
        return [ForwardItem(req.row, start, new_ids, scheduled.slots, all_logits, hidden)]

    # -- observability ------------------------------------------------------------------------

    def close(self) -> None:
        self.compiler.close()
        self._stop_tensor_parallel()

    def check_integrity(self) -> None:
        """Debug check (tests call it after failures): used KV slots == slots referenced by
        the prefix cache + those owned by running requests; rows held by running ones only."""
        self.scheduler.check_integrity()

    def flush_cache(self) -> None:
        if self.scheduler.running or self.scheduler.waiting:
            raise InvalidRequestError(
                "cannot flush the cache while requests are running or waiting; retry when idle"
            )
        self.cache_manager.prefix_cache.reset()
        self.runner.pool.allocator.compact()

    def stats(self) -> dict:
        size = self.cache_manager.prefix_cache.size_info()
        pool = self.runner.pool
        s, spec = self.scheduler.stats, self.scheduler.speculator
        return {
            "running_requests": len(self.scheduler.running),
            "waiting_requests": len(self.scheduler.waiting),
            "kv_slots_total": pool.capacity,
            "kv_slots_free": pool.num_free,
            "kv_slots_used": pool.capacity - pool.num_free,
            "cache_tokens": size.cached_tokens,
            "cache_evictable_tokens": size.evictable_tokens,
            "cache_locked_tokens": size.locked_tokens,
            "prompt_tokens_total": self.cache_manager.prompt_tokens,
            "cached_prompt_tokens_total": self.cache_manager.cached_prompt_tokens,
            "evicted_tokens_total": self.cache_manager.prefix_cache.evicted_tokens,
            "generated_tokens_total": s.generated_tokens,
            "requests_finished_total": s.requests_finished,
            "retractions_total": s.retractions,
            "steps_total": s.steps,
            "failed_steps_total": s.failed_steps,  # forward passes rolled back
            "request_faults_total": s.request_faults,  # requests aborted for a failure of their own
            "spec_draft_tokens_total": spec.drafted if spec else 0,  # speculative decoding
            "spec_accepted_tokens_total": spec.accepted if spec else 0,
            "grammar_cache_bytes": self.compiler.cached_bytes,  # counted: NFA, DFA rows, masks
            "time": time.time(),
        }
