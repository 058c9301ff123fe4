"""The native generate call, shared by HTTP `/generate` and the ZeroMQ socket: validation
and tokenization in the front end (bad input never reaches the scheduler)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

from spruce.runtime.errors import InvalidRequestError
from spruce.runtime.inputs import batch_inputs, check_request, sampling_list
from spruce.runtime.sampling_params import SamplingParams
from spruce.runtime.server.protocol import GenerateMsg
from spruce.runtime.server.request_manager import Prepared
from spruce.runtime.tokenizer import Tokenizer


@dataclass(frozen=True)
class ModelContext:
    """What the front end knows of the model (its context and vocab come from the
    scheduler's Ready handshake; the tokenizer is loaded by the front end itself)."""

    tokenizer: Tokenizer
    name: str
    path: str
    context_length: int
    vocab_size: int

    @cached_property
    def token_bytes(self) -> list[bytes]:
        """The raw bytes of every token (computed on first use: for logprobs)."""
        return self.tokenizer.token_bytes()

    def info(self) -> dict[str, Any]:
        return {
            "model": self.name,
            "model_path": self.path,
            "context_length": self.context_length,
            "vocab_size": self.vocab_size,
            "chat_template": self.tokenizer.chat_template,
            "eos_token_ids": sorted(self.tokenizer.eos_token_ids),
            "bos_token_id": self.tokenizer.bos_token_id,
            "bos_token": self.tokenizer.bos_token,  # text, for templates that use {{ bos_token }}
            "eos_token": self.tokenizer.eos_token,
        }

    def prepare(
        self, prompt: str | list[int], sampling: SamplingParams, return_logprob: bool = False,
        logprob_start_len: int = -1, top_logprobs_num: int = 0,
    ) -> Prepared:  # fmt: skip
        """Tokenizes and validates one request; InvalidRequestError says what to change."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        check_request(
            ids, sampling, self.vocab_size, self.context_length, return_logprob, logprob_start_len, top_logprobs_num
        )
        return Prepared(ids, sampling, return_logprob, logprob_start_len, top_logprobs_num)


def prepare_generate(msg: GenerateMsg, model: ModelContext) -> tuple[list[Prepared], bool]:
    """(one Prepared per prompt, whether the call was a single prompt)."""
    prompts, single = batch_inputs(msg.text, msg.input_ids, text_name="text")
    params = sampling_list(msg.sampling_params, len(prompts))
    if not isinstance(msg.stream, bool):
        raise InvalidRequestError("stream must be true or false")
    return [
        model.prepare(p, sp, msg.return_logprob, msg.logprob_start_len, msg.top_logprobs_num)
        for p, sp in zip(prompts, params)
    ], single
