"""The native generate call, shared by HTTP `/generate` and the ZeroMQ socket: validation
and tokenization in the front end (bad input never reaches the scheduler)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

from spruce.runtime.errors import InvalidRequestError
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
        }

    def prepare(
        self, prompt: str | list[int], sampling: SamplingParams, return_logprob: bool = False,
        logprob_start_len: int = -1, top_logprobs_num: int = 0,
    ) -> Prepared:  # fmt: skip
        """Tokenizes and validates one request; InvalidRequestError says what to change."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        check_token_ids(ids, self.vocab_size)
        try:
            sampling.validate(len(ids), self.context_length)
        except TypeError as e:  # e.g. stop given as a number
            raise InvalidRequestError(f"bad sampling_params: {e}") from None
        check_logprob_options(return_logprob, logprob_start_len, top_logprobs_num)
        return Prepared(ids, sampling, return_logprob, logprob_start_len, top_logprobs_num)


def prepare_generate(msg: GenerateMsg, model: ModelContext) -> tuple[list[Prepared], bool]:
    """(one Prepared per prompt, whether the call was a single prompt)."""
    prompts, single = batch_inputs(msg.text, msg.input_ids)
    params = sampling_list(msg.sampling_params, len(prompts))
    if not isinstance(msg.stream, bool):
        raise InvalidRequestError("stream must be true or false")
    return [
        model.prepare(p, sp, msg.return_logprob, msg.logprob_start_len, msg.top_logprobs_num)
        for p, sp in zip(prompts, params)
    ], single


def batch_inputs(text: Any, input_ids: Any) -> tuple[list, bool]:
    if (text is None) == (input_ids is None):
        raise InvalidRequestError("give exactly one of text or input_ids")
    if text is not None:
        if isinstance(text, str):
            return [text], True
        if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            return list(text), False
        raise InvalidRequestError("text must be a string or a non-empty list of strings")
    if isinstance(input_ids, list) and input_ids and all(isinstance(x, list) for x in input_ids):
        return input_ids, False
    if isinstance(input_ids, list):
        return [input_ids], True
    raise InvalidRequestError("input_ids must be a list of token ids or a list of such lists")


def sampling_list(params: Any, n: int) -> list[SamplingParams]:
    if isinstance(params, list):
        if len(params) != n:
            raise InvalidRequestError(f"{len(params)} sampling_params for {n} prompts")
        return [sampling_from(p) for p in params]
    return [sampling_from(params)] * n


def sampling_from(params: Any) -> SamplingParams:
    if params is not None and not isinstance(params, dict):
        raise InvalidRequestError("sampling_params must be a JSON object")
    for name in ("stop", "stop_token_ids", "choices"):  # validate() assumes they are lists
        value = (params or {}).get(name)
        if value is not None and not isinstance(value, (list, str if name == "stop" else list)):
            raise InvalidRequestError(f"{name} must be a list" + (" or a string" if name == "stop" else ""))
    try:
        return SamplingParams.from_dict(params)
    except TypeError as e:
        raise InvalidRequestError(f"bad sampling_params: {e}") from None


def check_token_ids(ids: Any, vocab_size: int) -> None:
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in ids):
        raise InvalidRequestError(f"input_ids must be token ids in [0, {vocab_size})")


def check_logprob_options(return_logprob: Any, logprob_start_len: Any, top_logprobs_num: Any) -> None:
    if not isinstance(return_logprob, bool):
        raise InvalidRequestError("return_logprob must be true or false")
    if not _is_int(logprob_start_len) or logprob_start_len < -1:
        raise InvalidRequestError("logprob_start_len must be -1 (output only) or a prompt position")
    if not _is_int(top_logprobs_num) or top_logprobs_num < 0:
        raise InvalidRequestError("top_logprobs_num must be an integer >= 0")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
