"""The native generate call, shared by HTTP `/generate` and the ZeroMQ socket: tokenization
and validation in the front end (`core.validation`), so bad input never reaches the
scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from spruce.runtime.core.options import RequestOptions
from spruce.runtime.core.validation import (
    Draft,
    ModelLimits,
    ValidCall,
    ValidRequest,
    validate_call,
)
from spruce.runtime.errors import FieldNames, InvalidRequestError
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

    def check(self, draft: Draft, names: FieldNames) -> ValidCall:
        """Tokenizes and validates a call, here and now (`validate_call`)."""
        return validate_call(draft, self.limits, names, self.tokenizer.encode)

    async def validate(self, draft: Draft, names: FieldNames) -> ValidCall:
        """`check` of a call, on a thread of the front end's bounded pools (work_pool.py)
        when it is constrained or has long prompt texts: tokenizing a long text takes a while
        (without the GIL, Tokenizer.encode; a text too long for the context is refused before,
        validation.check_prompt_size), and a JSON schema converts in a worker process
        (stopped at the grammar timeout) that the thread waits for; the event loop keeps
        serving every other client meanwhile and never runs a conversion itself."""
        if draft.has_constraint():
            return await self.pools.convert.run(self.check, draft, names)
        if draft.prompt_chars() > LONG_TEXT_CHARS:
            return await self.pools.tokenize.run(self.check, draft, names)
        return self.check(draft, names)


NATIVE_NAMES = FieldNames()  # /generate and ZeroMQ take the canonical names


async def prepare_generate(
    msg: GenerateMsg, model: ModelContext
) -> tuple[list[ValidRequest], bool]:
    """A native generate call (HTTP /generate or ZeroMQ) validated: (the ValidRequests, n
    per prompt, prompt-major; whether it is answered by one result rather than a list).
    SGLang's `n` is taken out of sampling_params; the rest are the message's own fields."""
    sampling, n = parallel_samples(msg.sampling_params)
    draft = Draft(msg.text, msg.input_ids, sampling, n, msg.options())
    call = await model.validate(draft, NATIVE_NAMES)
    return call.requests, call.single


def parallel_samples(sampling: Any) -> tuple[Any, Any]:
    """SGLang's `n` in sampling_params: (the sampling_params without it, n). The n requests
    of a prompt go out together; the scheduler admits the first alone and the others next
    step (in-batch prefix sharing), so they find the prompt in the radix cache."""
    dicts = sampling if isinstance(sampling, list) else [sampling]
    counts = [d.get("n", 1) if isinstance(d, dict) else 1 for d in dicts]
    if any(c != counts[0] for c in counts):
        raise InvalidRequestError(
            f"n must be the same in every sampling_params of a batch; got {counts[:8]}",
            field="n",
        )
    stripped = [
        {k: v for k, v in d.items() if k != "n"} if isinstance(d, dict) else d for d in dicts
    ]
    n = counts[0] if counts else 1  # an empty list: validate_call says what is wrong
    return (stripped if isinstance(sampling, list) else stripped[0]), n


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
