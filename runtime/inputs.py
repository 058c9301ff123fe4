"""Checks of a generate call's inputs, shared by the offline Engine and the server's front
end: one prompt or a batch, sampling params per prompt, token ids and logprob options."""

from __future__ import annotations

from typing import Any

from spruce.runtime.errors import InvalidRequestError
from spruce.runtime.sampling_params import SamplingParams


def batch_inputs(text: Any, input_ids: Any, text_name: str = "prompt") -> tuple[list, bool]:
    """(the prompts, each a string or a list of ids; whether a single prompt was given)."""
    if (text is None) == (input_ids is None):
        raise InvalidRequestError(f"give exactly one of {text_name} or input_ids")
    if text is not None:
        if isinstance(text, str):
            return [text], True
        if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            return list(text), False
        raise InvalidRequestError(f"{text_name} must be a string or a non-empty list of strings")
    if isinstance(input_ids, list) and input_ids and all(isinstance(x, list) for x in input_ids):
        return [list(x) for x in input_ids], False
    if isinstance(input_ids, list):
        return [input_ids], True
    raise InvalidRequestError("input_ids must be a list of token ids or a list of such lists")


def sampling_list(params: Any, n: int) -> list[SamplingParams]:
    """One SamplingParams per prompt: one dict / SamplingParams for all, or a list of n."""
    if isinstance(params, list):
        if len(params) != n:
            raise InvalidRequestError(f"{len(params)} sampling_params for {n} prompts")
        return [sampling_from(p) for p in params]
    return [sampling_from(params)] * n


def sampling_from(params: Any) -> SamplingParams:
    if isinstance(params, SamplingParams):
        return params
    if params is not None and not isinstance(params, dict):
        raise InvalidRequestError("sampling_params must be a JSON object (a dict) or a SamplingParams")
    return SamplingParams.from_dict(params)


def check_request(
    ids: list[int],
    sampling: SamplingParams,
    vocab_size: int,
    context_len: int,
    return_logprob: Any = False,
    logprob_start_len: Any = -1,
    top_logprobs_num: Any = 0,
) -> None:
    """Everything about one request that can be checked before it is queued."""
    if not all(_is_int(t) and 0 <= t < vocab_size for t in ids):
        raise InvalidRequestError(f"input_ids must be token ids in [0, {vocab_size})")
    sampling.validate(len(ids), context_len)
    if not isinstance(return_logprob, bool):
        raise InvalidRequestError("return_logprob must be true or false")
    if not _is_int(logprob_start_len) or logprob_start_len < -1:
        raise InvalidRequestError("logprob_start_len must be -1 (output only) or a prompt position")
    if not _is_int(top_logprobs_num) or top_logprobs_num < 0:
        raise InvalidRequestError("top_logprobs_num must be an integer >= 0")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
