"""The offline Engine: generate in-process, single requests or batches, optionally streamed.

    from spruce.runtime import Engine
    with Engine() as engine:                       # the bundled SmolLM2-135M-Instruct
        out = engine.generate("The capital of France is", {"max_new_tokens": 16, "temperature": 0})
        print(out["text"], out["meta_info"]["finish_reason"])

`Engine(tp_size=2)` splits every layer over two processes (this one is rank 0; the other
is started here and stopped by `shutdown()`; see executor/distributed.py).
`Engine(dp_size=2)` runs two EngineCores, each with its own KV pool and radix cache, over
one copy of the weights, stepped in turn in this process; each prompt goes to the core the
router picks (scheduler/router.py; cache-aware unless `router=` says otherwise). On a CPU
the point is the cache (what a server's replicas would hit), not speed: the cores share
the same cores.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import fields, replace
from typing import TYPE_CHECKING, Any

from spruce.runtime.config import EngineConfig, use_omp_wait_policy
from spruce.runtime.core.options import SERVER_ONLY, RequestOptions
from spruce.runtime.core.request import Req
from spruce.runtime.core.sampling_params import SamplingParams
from spruce.runtime.core.update import Reporter, finish_vector
from spruce.runtime.core.validation import Draft, validate_call
from spruce.runtime.errors import FieldNames, InvalidRequestError
from spruce.runtime.limits import RequestLimits
from spruce.runtime.scheduler.router import make_router
from spruce.runtime.text.detokenizer import RequestOutput

if TYPE_CHECKING:
    from spruce.runtime.models.loading.loader import LoadedModel


class Engine:
    def __init__(
        self,
        model_path: str | None = None,
        loaded: LoadedModel | None = None,
        request_limits: RequestLimits | dict | None = None,
        dp_size: int = 1,
        router: Any = None,
        **options: Any,
    ) -> None:
        """`options` are EngineConfig's (see `spruce serve --help`); `loaded`, an already
        loaded model (e.g. another engine's `engine.core.loaded`), shares its weights;
        `request_limits`, what one call may ask for (a RequestLimits or a dict of its fields,
        the `spruce serve` flags of the same names; default: RequestLimits()); `dp_size`,
        the number of EngineCores, and `router`, what picks one per prompt: a policy name
        of scheduler/router.py ("cache-aware", the default, or "round-robin") or an object
        with route(ids, loads) -> core index and forget(index)."""
        self.request_limits = request_limits_from(request_limits)
        self.config = EngineConfig.from_options(model_path=model_path, **options)
        check_data_parallel(dp_size, router, self.config)
        use_omp_wait_policy()  # before torch is imported, if it was not yet
        from spruce.runtime.engine.core import EngineCore  # torch and the model code

        if self.config.log_level:
            logging.getLogger("spruce").setLevel(self.config.log_level.upper())
        self.core = EngineCore(self.config, loaded)
        more = [EngineCore(self.config, self.core.loaded) for _ in range(dp_size - 1)]
        self.cores = [self.core, *more]  # dp_size > 1: one copy of the weights
        self.router = router_for(router, dp_size) if dp_size > 1 else None
        self._core_of: dict[str, int] = {}  # rid -> index of its core
        self._in_flight = [0] * dp_size  # the router's loads
        self.tokenizer = self.core.tokenizer
        # Calls in flight (e.g. interleaved streams) share the core: a step's news for one
        # call's requests waits here for that call, whichever call ran the step.
        self._live: set[str] = set()
        self._news: dict[str, None] = {}  # rids with news not yet taken (ordered)

    # -- public API ---------------------------------------------------------------------------

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | SamplingParams | list | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        **options: Any,
    ):
        """Returns one result dict (a list for list input), or an iterator of chunks when
        `stream=True`. `options`: RequestOptions' fields (return_logprob, logprob_start_len,
        top_logprobs_num, stream) but the server's own (SERVER_ONLY). Every request is
        validated before any runs (`validate_call`): one bad request raises
        InvalidRequestError and nothing is computed. A request the runtime fails later (its
        constraint does not compile, a failure of its own in a step) fails this call only:
        its error is raised (ConstraintError, scheduler.faults.RequestFault), or when
        streamed, its last chunk has finish_reason {"type": "abort", "message": ...}. Other
        requests, of this call or others, go on."""
        given = RequestOptions.from_keywords(options, "Engine.generate", SERVER_ONLY)
        draft = Draft(prompt, input_ids, sampling_params, options=given)
        limits = replace(self.core.limits, request=self.request_limits)
        call = validate_call(draft, limits, FieldNames({"text": "prompt"}), self.tokenizer.encode)
        valid, single, stream = call.requests, call.single, given.stream
        reqs = [self._add(v) for v in valid]
        outputs = [RequestOutput(self.tokenizer, v, r.rid) for v, r in zip(valid, reqs)]
        self._live.update(r.rid for r in reqs)  # now: a stream's body starts only when iterated
        if stream:
            return self._stream(reqs, outputs)
        results = self._run(reqs, outputs)
        return results[0] if single else results

    def encode(
        self,
        prompt: str | list[str] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        dimensions: int | None = None,
        normalize: bool = True,
    ) -> list[float] | list[list[float]]:
        """Each prompt's embedding: the model's final hidden states pooled (`--pooling`:
        the model folder's sentence-transformers pooling, else the last token), its first
        `dimensions` entries, scaled to unit length unless `normalize=False`. One vector for
        one prompt, a list for a list. The prompts share the prefix cache as generate's do."""
        draft = Draft(prompt, input_ids, {"max_new_tokens": 0}, embed=True, dimensions=dimensions)
        limits = replace(self.core.limits, request=self.request_limits)
        call = validate_call(draft, limits, FieldNames({"text": "prompt"}), self.tokenizer.encode)
        reqs = [self._add(v) for v in call.requests]
        outputs = [RequestOutput(self.tokenizer, v, r.rid) for v, r in zip(call.requests, reqs)]
        self._live.update(r.rid for r in reqs)
        self._run(reqs, outputs)
        vectors = [finish_vector(o.embedding, dimensions, normalize) for o in outputs]
        return vectors[0] if call.single else vectors

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt
        )

    def flush_cache(self) -> None:
        for i, core in enumerate(self.cores):
            core.flush_cache()
            if self.router is not None:
                self.router.forget(i)

    def stats(self) -> dict:
        """The core's stats; with dp_size > 1, the cores' counters summed, and each core's
        own under "replicas"."""
        if len(self.cores) == 1:
            return self.core.stats()
        each = [core.stats() for core in self.cores]
        total = {k: sum(s[k] for s in each) for k in each[0] if k != "time"}
        return {**total, "time": each[0]["time"], "dp_size": len(each), "replicas": each}

    def shutdown(self) -> None:
        for core in self.cores:
            core.close()
        self.core, self.cores = None, []

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # -- internals -----------------------------------------------------------------------------

    def _add(self, valid) -> Req:
        """Queues a request on its core (the router's pick with dp_size > 1)."""
        ids, loads = list(valid.input_ids), list(self._in_flight)
        i = 0 if self.router is None else self.router.route(ids, loads)
        req = self.cores[i].add_request(valid)
        self._core_of[req.rid] = i
        self._in_flight[i] += 1
        return req

    def _step(self) -> list[Req]:
        if len(self.cores) == 1:
            return self.core.step()
        return [req for core in self.cores if core.has_work() for req in core.step()]

    def _has_work(self) -> bool:
        return any(core.has_work() for core in self.cores)

    def _run(self, reqs: list[Req], outputs: list[RequestOutput]) -> list[dict]:
        """Each request's result, once all finished; its output is built from its one
        update (as the server's front end builds it)."""
        pending = {r.rid: r for r in reqs}
        try:
            while pending:
                for req in self._news_for(pending):
                    if req.finished:
                        del pending[req.rid]
        finally:
            self._forget(reqs)
        failed = next((r.error for r in reqs if r.error is not None), None)
        if failed is not None:  # e.g. a constraint that failed to compile
            raise failed
        for req, output in zip(reqs, outputs):
            output.apply(Reporter(req).update())
        return [_result(output) for output in outputs]

    def _stream(self, reqs: list[Req], outputs: list[RequestOutput]) -> Iterator[dict]:
        """Chunks: {"index", "text" (new text), "output_ids" (new ids), "finished", "meta_info"}."""
        reporters = {r.rid: (i, Reporter(r), outputs[i]) for i, r in enumerate(reqs)}
        pending = {r.rid: r for r in reqs}
        try:
            while pending:
                for req in self._news_for(pending):
                    if req.finished:  # as sent: other calls may step while we yield
                        del pending[req.rid]
                    index, reporter, output = reporters[req.rid]
                    yield _chunk(index, output, reporter.update())
        finally:
            for rid in pending:  # a consumer that stops early aborts what is left
                self.cores[self._core_of[rid]].abort(rid, "the stream was closed")
            while pending and self._has_work():
                for req in self._news_for(pending):
                    if req.finished:
                        del pending[req.rid]
            self._forget(reqs)

    def _news_for(self, mine: dict[str, Req]) -> list[Req]:
        """This call's requests with news (new tokens or finished), in step order: news a
        step of another call left for it, else the news of a step run now."""
        news = [rid for rid in self._news if rid in mine]
        if not news:
            changed = [r.rid for r in self._step() if r.rid in self._live]
            self._news.update(dict.fromkeys(changed))
            news = [rid for rid in self._news if rid in mine]
        for rid in news:
            del self._news[rid]
        return [mine[rid] for rid in news]

    def _forget(self, reqs: list[Req]) -> None:
        for req in reqs:
            self._live.discard(req.rid)
            self._news.pop(req.rid, None)
            core = self._core_of.pop(req.rid, None)
            if core is not None:
                self._in_flight[core] -= 1


def check_data_parallel(dp_size: int, router: Any, config: EngineConfig) -> None:
    if not isinstance(dp_size, int) or dp_size < 1:
        raise InvalidRequestError(f"dp_size must be an integer >= 1, not {dp_size!r}")
    if router is not None and not isinstance(router, str) and not hasattr(router, "route"):
        raise InvalidRequestError(
            "router must be a policy name or have route(ids, loads) and forget(i)"
        )
    if dp_size > 1 and config.parallel.tp_size > 1:
        raise InvalidRequestError("the offline Engine runs dp_size > 1 or tp_size > 1, not both")


def router_for(router: Any, dp_size: int) -> Any:
    """The router object: `router` itself, or the one its policy name makes (default cache-aware)."""
    if router is None or isinstance(router, str):
        try:
            return make_router(router or "cache-aware", dp_size)
        except ValueError as e:
            raise InvalidRequestError(str(e)) from None
    return router


def request_limits_from(value: RequestLimits | dict | None) -> RequestLimits:
    if value is None or isinstance(value, RequestLimits):
        return value or RequestLimits()
    if not isinstance(value, dict):
        raise InvalidRequestError("request_limits must be a RequestLimits or a dict of its fields")
    known = {f.name for f in fields(RequestLimits)}
    unknown = sorted(set(value) - known)
    if unknown:
        known_list = ", ".join(sorted(known))
        raise InvalidRequestError(f"request_limits: unknown {unknown}; known: {known_list}")
    return RequestLimits(**value)


def _result(output: RequestOutput) -> dict:
    return {
        "text": output.text.text,
        "output_ids": list(output.ids),
        "meta_info": output.meta_info(),
    }


def _chunk(index: int, output: RequestOutput, update) -> dict:
    delta = output.apply(update)
    meta = output.meta_info() if update.finished is not None else output.chunk_meta(update)
    return {
        "index": index, "text": delta, "output_ids": output.text.new_output_ids(),
        "finished": update.finished is not None, "meta_info": meta,
    }  # fmt: skip
