"""The native generate call, shared by HTTP `/generate` and the ZeroMQ socket: tokenization
and validation in the front end (`core.validation`), so bad input never reaches the
scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from spruce.runtime.core.options import RequestOptions
from spruce.runtime.core.sampling_params import SamplingParams
from spruce.runtime.core.validation import (
    ModelLimits,
    ValidRequest,
    batch_inputs,
    check_batch_size,
    check_options,
    check_response_size,
    sampling_list,
    validate_request,
)  # fmt: skip
from spruce.runtime.errors import InvalidRequestError
from spruce.runtime.limits import RequestLimits
from spruce.runtime.protocol.dsl import GenerateMsg
from spruce.runtime.server.request_manager import Event, RequestManager, SchedulerUnavailable
from spruce.runtime.server.work_pool import FrontPools
from spruce.runtime.text.tokenizer import Tokenizer

LONG_TEXT_CHARS = 32_768  # prompt text beyond which tokenizing is done off the event loop


@dataclass(frozen=True)
class ModelContext:
    """What the front end knows of the model (its limits come from the scheduler's Ready
    handshake; the tokenizer is loaded by the front end itself)."""

    tokenizer: Tokenizer
    name: str
    path: str
    limits: ModelLimits
    pools: FrontPools = field(
        default_factory=FrontPools, compare=False, repr=False
    )  # off-loop work

    @property
    def context_length(self) -> int:
        return self.limits.context_length

    @cached_property
    def token_bytes(self) -> list[bytes]:
        """The raw bytes of every token (computed on first use: for logprobs)."""
        return self.tokenizer.token_bytes()

    def info(self) -> dict[str, Any]:
        return {
            "model": self.name,  # not the path: that is /server_info's (behind the API key)
            "context_length": self.limits.context_length,
            "vocab_size": self.limits.vocab_size,
            "chat_template": self.tokenizer.chat_template,
            "eos_token_ids": sorted(self.tokenizer.eos_token_ids),
            "bos_token_id": self.tokenizer.bos_token_id,
            "bos_token": self.tokenizer.bos_token,  # text, for templates that use {{ bos_token }}
            "eos_token": self.tokenizer.eos_token,
        }

    def prepare(
        self, prompt: str | list[int], sampling: SamplingParams, options: RequestOptions
    ) -> ValidRequest:
        """Tokenizes and validates one request; InvalidRequestError says what to change."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        return validate_request(ids, sampling, options, self.limits)

    def _tokenized(
        self, requests: list[tuple[str | list[int], SamplingParams]]
    ) -> list[tuple[list[int], SamplingParams]]:
        """Each request's prompt as token ids; a call's n samples share one prompt object,
        tokenized once."""
        ids_of: dict[int, list[int]] = {}
        for prompt, _ in requests:
            if id(prompt) not in ids_of:
                ids_of[id(prompt)] = (
                    self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
                )
        return [(ids_of[id(prompt)], sampling) for prompt, sampling in requests]

    async def prepare_all(
        self, requests: list[tuple[str | list[int], SamplingParams]], options: RequestOptions
    ) -> list[ValidRequest]:
        """`prepare` for each (prompt, sampling). A constrained call, or one with long prompt
        texts, is prepared on a thread of the front end's bounded pools (work_pool.py): tokenizing megabytes of text takes a while, and
        a JSON schema converts in a worker process (stopped at the grammar timeout) that the
        thread waits for; the event loop keeps serving every other client meanwhile."""

        def work() -> list[ValidRequest]:
            check_options(options, self.limits.request)
            tokenized = self._tokenized(requests)
            check_response_size(tokenized, options, self.limits.request)
            return [self.prepare(ids, sampling, options) for ids, sampling in tokenized]

        if any(sampling.has_constraint for _, sampling in requests):
            return await self.pools.convert.run(work)
        if sum(len(prompt) for prompt, _ in requests if isinstance(prompt, str)) > LONG_TEXT_CHARS:
            return await self.pools.tokenize.run(work)
        return work()


async def prepare_generate(
    msg: GenerateMsg, model: ModelContext
) -> tuple[list[ValidRequest], bool]:
    """(the ValidRequests: n per prompt, prompt-major as SGLang orders them; whether the
    call was a single prompt with n = 1, answered by one result rather than a list)."""
    limits = model.limits.request
    prompts, single = batch_inputs(msg.text, msg.input_ids, text_name="text", limits=limits)
    sampling, n = parallel_samples(msg.sampling_params, limits)
    check_batch_size(len(prompts) * n, limits)
    params = sampling_list(sampling, len(prompts))
    options = request_options(msg, limits)
    requests = [(prompt, _sample(p, j)) for prompt, p in zip(prompts, params) for j in range(n)]
    return await model.prepare_all(requests, options), single and n == 1


def parallel_samples(sampling: Any, limits: RequestLimits) -> tuple[Any, int]:
    """SGLang's `n` in sampling_params: (the sampling_params without it, n). The n requests
    of a prompt go out together; the scheduler admits the first alone and the others next
    step (in-batch prefix sharing), so they find the prompt in the radix cache."""
    dicts = sampling if isinstance(sampling, list) else [sampling]
    counts = {d.get("n", 1) if isinstance(d, dict) else 1 for d in dicts}
    if len(counts) > 1:
        raise InvalidRequestError(
            f"n must be the same in every sampling_params of a batch; got {sorted(counts)}"
        )
    n = counts.pop() if counts else 1  # an empty list: sampling_list says what is wrong
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= limits.max_n:
        raise InvalidRequestError(
            f"n must be an integer from 1 to {limits.max_n} (--max-n); got {n!r}"
        )
    stripped = [
        {k: v for k, v in d.items() if k != "n"} if isinstance(d, dict) else d for d in dicts
    ]
    return (stripped if isinstance(sampling, list) else stripped[0]), n


def _sample(sampling: SamplingParams, j: int) -> SamplingParams:
    """Sample j of a prompt: with a seed, seed + j (the samples differ, each reproducible)."""
    return sampling if j == 0 or sampling.seed is None else sampling.replace(seed=sampling.seed + j)


def present_meta(
    meta: dict[str, Any], options: RequestOptions, model: ModelContext
) -> dict[str, Any]:
    """A result's meta_info as the caller asked for it: with return_text_in_logprobs, each
    logprob entry [logprob, token_id] (top entries too) gets the token's text as a third item."""
    if not options.return_text_in_logprobs:
        return meta
    out = dict(meta)
    for key in ("input_token_logprobs", "output_token_logprobs"):
        if out.get(key) is not None:
            out[key] = [_with_text(entry, model) for entry in out[key]]
    for key in ("input_top_logprobs", "output_top_logprobs"):
        if out.get(key) is not None:
            out[key] = [
                None if top is None else [_with_text(e, model) for e in top] for top in out[key]
            ]
    return out


def present_result(
    result: dict[str, Any], options: RequestOptions, model: ModelContext
) -> dict[str, Any]:
    return {**result, "meta_info": present_meta(result["meta_info"], options, model)}


def _with_text(entry: list, model: ModelContext) -> list:
    logprob, token = entry[0], entry[1]
    return [logprob, token, model.tokenizer.decode([token], False)]


def request_options(msg: GenerateMsg, limits: RequestLimits) -> RequestOptions:
    options = RequestOptions(
        return_logprob=msg.return_logprob, logprob_start_len=msg.logprob_start_len,
        top_logprobs_num=msg.top_logprobs_num, return_text_in_logprobs=msg.return_text_in_logprobs,
        stream=msg.stream, timeout_s=msg.timeout_s,
    )  # fmt: skip
    check_options(options, limits)
    return options


# -- shared by the HTTP and ZeroMQ front ends ------------------------------------------------

FLUSH_TIMEOUT_S = 30.0


def too_large(limit: int) -> str:
    return f"request larger than the server's limit of {limit} bytes (--max-request-bytes)"


def batch_error(events: list[Event], single: bool) -> tuple[int, str] | None:
    """(status, message) of a call's first failed request, naming its prompt in a batch."""
    failed = next((e for e in events if e.error is not None), None)
    if failed is None:
        return None
    where = "" if single else f"prompt {failed.index}: "
    return failed.status, where + failed.error


async def flush_cache(manager: RequestManager) -> tuple[int, str] | None:
    """Empties the prefix cache; (status, message) when refused (busy: 400) or the
    scheduler is unavailable (503)."""
    try:
        await manager.control("flush_cache", FLUSH_TIMEOUT_S)
    except ValueError as e:
        return 400, str(e)
    except SchedulerUnavailable as e:
        return 503, str(e)
    return None
