"""The one validation boundary. Every front end (the offline Engine, HTTP, ZeroMQ) turns a
call into `ValidRequest`s here, once; the scheduler trusts what it gets (asserts only).

    prompts, single = batch_inputs(text, input_ids)          # one prompt or a batch
    params = sampling_list(sampling_params, len(prompts))    # SamplingParams per prompt
    valid = validate_request(ids, params[0], options, model_limits)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from spruce.constrained.backends import GRAMMAR_KINDS
from spruce.constrained.convert import Conversion
from spruce.constrained.core import errors as constrained_errors
from spruce.constrained.spec import ConstraintSpec
from spruce.runtime.core.options import RequestOptions
from spruce.runtime.core.sampling_params import SamplingParams
from spruce.runtime.core.values import is_int, is_number
from spruce.runtime.errors import ConstraintError, InvalidRequestError, constraint_error
from spruce.runtime.limits import INT64_MAX, RequestLimits


@dataclass(frozen=True, slots=True)
class ModelLimits:
    """What validation needs to know of the model and the server's grammar settings."""

    vocab_size: int
    context_length: int
    request: RequestLimits = field(default_factory=RequestLimits)  # what one call may ask for
    conversion: Conversion = field(
        default_factory=Conversion
    )  # JSON whitespace; a schema's deadline


@dataclass(frozen=True, slots=True)
class ValidRequest:
    """A request that passed every check: token ids, sampling, options, and its constraint
    already converted to a regex (None when unconstrained)."""

    input_ids: list[int]
    sampling: SamplingParams
    options: RequestOptions
    constraint: ConstraintSpec | None


def validate_request(
    ids: list[int], sampling: SamplingParams, options: RequestOptions, limits: ModelLimits
) -> ValidRequest:
    """Everything about one request that can be checked before it is queued; raises
    InvalidRequestError (ConstraintError for a bad constraint) saying what to change."""
    if not are_token_ids(ids, limits.vocab_size):
        raise InvalidRequestError(f"input_ids must be token ids in [0, {limits.vocab_size})")
    if not isinstance(sampling, SamplingParams):
        raise InvalidRequestError(
            "sampling_params must be a JSON object (a dict) or a SamplingParams"
        )
    sampling.validate(len(ids), limits.context_length, limits.request)
    bad_stop = [t for t in sampling.stop_token_ids if t >= limits.vocab_size]
    if bad_stop:
        raise InvalidRequestError(
            f"stop_token_ids {bad_stop[:5]} are not token ids (vocabulary: {limits.vocab_size})"
        )
    bad_bias = [t for t, _ in sampling.logit_bias if t >= limits.vocab_size]
    if bad_bias:
        raise InvalidRequestError(
            f"logit_bias keys {bad_bias[:5]} are not token ids (vocabulary: {limits.vocab_size})"
        )
    check_options(options, limits.request)
    if options.logprob_start_len >= len(ids):
        raise InvalidRequestError(
            f"logprob_start_len must be -1 or a prompt position (< {len(ids)})"
        )
    return ValidRequest(list(ids), sampling, options, _constraint(sampling, limits))


def are_token_ids(ids: Any, vocab_size: int) -> bool:
    """Whether `ids` is a list of ints in [0, vocab_size). Checked at C speed for plain ints
    (each of a call's n samples checks its prompt: 128 x 1,000 ids took 28 ms one by one)."""
    if not isinstance(ids, list):
        return False
    if not ids:
        return True
    if set(map(type, ids)) != {int} and not all(is_int(t) for t in ids):
        return False
    return 0 <= min(ids) and max(ids) < vocab_size


def check_options(options: RequestOptions, limits: RequestLimits | None = None) -> None:
    most = (limits or RequestLimits()).max_top_logprobs
    if not isinstance(options.return_logprob, bool):
        raise InvalidRequestError("return_logprob must be true or false")
    if not is_int(options.logprob_start_len) or not -1 <= options.logprob_start_len <= INT64_MAX:
        raise InvalidRequestError("logprob_start_len must be -1 (output only) or a prompt position")
    if not is_int(options.top_logprobs_num) or not 0 <= options.top_logprobs_num <= most:
        raise InvalidRequestError(f"top_logprobs_num must be an integer in [0, {most}]")
    if not isinstance(options.return_text_in_logprobs, bool):
        raise InvalidRequestError("return_text_in_logprobs must be true or false")
    if not isinstance(options.stream, bool):
        raise InvalidRequestError("stream must be true or false")
    timeout = options.timeout_s
    if timeout is not None and not (is_number(timeout) and timeout > 0):
        raise InvalidRequestError(
            "timeout_s must be a number of seconds > 0 (or null: the server's default)"
        )


def check_batch_size(count: int, limits: RequestLimits) -> None:
    """A call's requests (prompts x n) against --max-batch-size."""
    if count > limits.max_batch_size:
        raise InvalidRequestError(
            f"the call has {count} requests (prompts x n); at most {limits.max_batch_size} (--max-batch-size)"
        )


def check_response_size(
    requests: list[tuple[list[int], SamplingParams]], options: RequestOptions, limits: RequestLimits
) -> None:
    """The logprob entries a call may return (`logprob_entries`, summed over its prompts
    and n) against --max-logprob-entries: they multiply, so a small body can ask for GBs.
    Checked before the requests are validated one by one (n samples of a long prompt cost
    n validations); the options must be checked already (`check_options`)."""
    total = sum(logprob_entries(len(ids), sampling, options) for ids, sampling in requests)
    most = limits.max_logprob_entries
    if total > most:
        raise InvalidRequestError(
            f"the call asks for {total} logprob entries ((prompt tokens from logprob_start_len + max_new_tokens) "
            f"x (1 + top_logprobs_num), over every prompt and n); at most {most} (--max-logprob-entries): "
            "lower n, max_new_tokens or top_logprobs_num, or raise logprob_start_len"
        )


def logprob_entries(num_ids: int, sampling: SamplingParams, options: RequestOptions) -> int:
    """At most how many logprob entries one request returns (0 without return_logprob; a
    max_new_tokens that is not an int counts 0: validate_request refuses it)."""
    if not options.return_logprob:
        return 0
    start = options.logprob_start_len
    new = sampling.max_new_tokens if is_int(sampling.max_new_tokens) else 0
    positions = (num_ids - start if 0 <= start < num_ids else 0) + new
    return positions * (1 + options.top_logprobs_num)


def _constraint(sampling: SamplingParams, limits: ModelLimits) -> ConstraintSpec | None:
    """The constraint converted to its spec, once. A JSON schema converts in a worker
    process that is stopped at the deadline (`constrained.convert`). A grammar's error
    names its field (`ebnf: line 3, column 7: ...`)."""
    if not sampling.has_constraint:
        return None
    try:
        return constraint_spec(sampling, limits.conversion)
    except constrained_errors.ConstraintError as e:
        raise named_error(e, sampling.constraint_names[0]) from None
    except RecursionError:  # a schema nested deeper than the JSON parser's recursion allows
        raise ConstraintError("json_schema is nested too deeply; flatten it or use $defs") from None


def named_error(error: constrained_errors.ConstraintError, name: str) -> ConstraintError:
    """The runtime's ConstraintError, naming the grammar field it is about (`lark: line 1,
    column 15: ...`); regex / schema / choices messages name theirs already."""
    message = str(error)
    if name in GRAMMAR_KINDS and not message.startswith(name):
        return ConstraintError(f"{name}: {message}")
    return constraint_error(error)


def constraint_spec(
    sampling: SamplingParams, conversion: Conversion, check: bool = False
) -> ConstraintSpec | None:
    """The spec of the one constraint `sampling` holds (ConstraintError if bad or several);
    `check`: its backend decided now (see make_spec)."""
    return conversion.spec(
        sampling.regex, sampling.json_schema, sampling.choices, sampling.schema_mode or "lenient",
        ebnf=sampling.ebnf, lark=sampling.lark, structural_tag=sampling.structural_tag, check=check,
    )  # fmt: skip


def batch_inputs(
    text: Any, input_ids: Any, text_name: str = "prompt", limits: RequestLimits | None = None
) -> tuple[list, bool]:
    """(the prompts, each a string or a list of ids; whether a single prompt was given)."""
    prompts, single = _prompts(text, input_ids, text_name)
    check_batch_size(len(prompts), limits or RequestLimits())
    return prompts, single


def _prompts(text: Any, input_ids: Any, text_name: str) -> tuple[list, bool]:
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
        raise InvalidRequestError(
            "sampling_params must be a JSON object (a dict) or a SamplingParams"
        )
    try:
        return SamplingParams.from_dict(params)
    except TypeError as e:  # a value of a type no field can hold
        raise InvalidRequestError(f"bad sampling_params: {e}") from None
