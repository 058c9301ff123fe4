"""The native generate call, shared by HTTP `/generate` and the ZeroMQ socket: tokenization
and validation in the front end (`core.validation`), so bad input never reaches the
scheduler."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from spruce.runtime.core.options import RequestOptions
from spruce.runtime.core.sampling_params import SamplingParams
from spruce.runtime.core.validation import (
    ModelLimits,
    ValidRequest,
    batch_inputs,
    check_options,
    sampling_list,
    validate_request,
)  # fmt: skip
from spruce.runtime.limits import RequestLimits
from spruce.runtime.protocol.dsl import GenerateMsg
from spruce.runtime.server.request_manager import Event, RequestManager, SchedulerUnavailable
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

    def prepare(self, prompt: str | list[int], sampling: SamplingParams, options: RequestOptions) -> ValidRequest:
        """Tokenizes and validates one request; InvalidRequestError says what to change."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        return validate_request(ids, sampling, options, self.limits)

    async def prepare_all(
        self, requests: list[tuple[str | list[int], SamplingParams]], options: RequestOptions
    ) -> list[ValidRequest]:
        """`prepare` for each (prompt, sampling). A constrained call, or one with long prompt
        texts, is prepared on a worker thread: converting a large JSON schema to its regex or
        tokenizing megabytes of text takes a while, and the event loop keeps serving every
        other client meanwhile."""

        def work() -> list[ValidRequest]:
            return [self.prepare(prompt, sampling, options) for prompt, sampling in requests]

        text_chars = sum(len(prompt) for prompt, _ in requests if isinstance(prompt, str))
        if text_chars > LONG_TEXT_CHARS or any(sampling.has_constraint for _, sampling in requests):
            return await asyncio.to_thread(work)
        return work()


async def prepare_generate(msg: GenerateMsg, model: ModelContext) -> tuple[list[ValidRequest], bool]:
    """(one ValidRequest per prompt, whether the call was a single prompt)."""
    limits = model.limits.request
    prompts, single = batch_inputs(msg.text, msg.input_ids, text_name="text", limits=limits)
    params = sampling_list(msg.sampling_params, len(prompts))
    options = request_options(msg, limits)
    return await model.prepare_all(list(zip(prompts, params)), options), single


def request_options(msg: GenerateMsg, limits: RequestLimits) -> RequestOptions:
    options = RequestOptions(
        return_logprob=msg.return_logprob, logprob_start_len=msg.logprob_start_len,
        top_logprobs_num=msg.top_logprobs_num, stream=msg.stream, timeout_s=msg.timeout_s,
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
