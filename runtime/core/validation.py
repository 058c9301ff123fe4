"""The one validation boundary. Every API (HTTP /generate and ZeroMQ, the OpenAI routes,
the offline Engine; the DSL through the first two) maps its call onto a `Draft` in the
canonical names and calls `validate_call` once, with its own `FieldNames`: every check is
here (prompts, n, batch size, options, response size, sampling, the one constraint), and
each message names the field as that API spells it. The scheduler trusts what it gets
(asserts only); the limits are `RequestLimits` (runtime/limits.py).

    draft = Draft(text=["a", "b"], sampling={"max_new_tokens": 8}, n=2)
    call = validate_call(draft, model_limits, FieldNames({"text": "prompt"}), tokenizer.encode)
    call.requests   # 4 ValidRequests: n per prompt, prompt-major
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from spruce.constrained.convert import Conversion
from spruce.constrained.core import errors as constrained_errors
from spruce.constrained.spec import ConstraintSpec
from spruce.runtime.core.options import RequestOptions
from spruce.runtime.core.sampling_params import CANONICAL, CONSTRAINT_FIELDS, SamplingParams
from spruce.runtime.core.values import TokenBound, is_int, is_number, utf8_length
from spruce.runtime.errors import (
    ConstraintError,
    FieldNames,
    InvalidRequestError,
    constraint_error,
)
from spruce.runtime.limits import INT64_MAX, RequestLimits

# --max-prompt-bytes' default, per token of the model's context (English text runs ~4 a token)
PROMPT_BYTES_PER_TOKEN = 32


@dataclass(frozen=True, slots=True)
class ModelLimits:
    """What validation needs to know of the model and the server's grammar settings."""

    vocab_size: int
    context_length: int
    request: RequestLimits = field(default_factory=RequestLimits)  # what one call may ask for
    conversion: Conversion = field(
        default_factory=Conversion
    )  # JSON whitespace; a schema's deadline
    hidden_size: int = 0  # the model's: the length of an embedding (0: unknown)
    token_bound: TokenBound | None = None  # the tokenizer's (None: no bound known)

    @property
    def max_prompt_bytes(self) -> int:
        """Bytes of one prompt's text (--max-prompt-bytes; by default 32 a context token)."""
        given = self.request.max_prompt_bytes
        return PROMPT_BYTES_PER_TOKEN * self.context_length if given is None else given


@dataclass(frozen=True, slots=True)
class ValidRequest:
    """A request that passed every check: token ids, sampling, options, and its constraint
    already converted to a regex (None when unconstrained)."""

    input_ids: list[int]
    sampling: SamplingParams
    options: RequestOptions
    constraint: ConstraintSpec | None
    embed: bool = False  # return the prompt's pooled final hidden state (generates nothing)


@dataclass(frozen=True, slots=True)
class Draft:
    """A generate call as an API gave it, in the canonical names, not yet checked: `text`
    (a string or a list of them) or `input_ids` (ids or a list of id lists), exactly one;
    `sampling`: one dict / SamplingParams for every prompt, or a list of one per prompt;
    `n`: samples per prompt; `options`: the call's RequestOptions; `embed`: an embedding
    call (each prompt's pooled hidden state; its sampling generates nothing)."""

    text: Any = None
    input_ids: Any = None
    sampling: Any = None
    n: Any = 1
    options: RequestOptions = field(default_factory=RequestOptions)
    embed: bool = False
    dimensions: Any = None  # an embedding call's: its vectors' first entries only

    def prompt_chars(self) -> int:
        """Characters of the prompt texts (0 for token ids): how long tokenizing takes."""
        texts = [self.text] if isinstance(self.text, str) else self.text
        return sum(len(t) for t in texts if isinstance(t, str)) if isinstance(texts, list) else 0

    def has_constraint(self) -> bool:
        """Whether a sampling entry sets a constraint (its conversion may take a while)."""
        entries = self.sampling if isinstance(self.sampling, list) else [self.sampling]
        return any(_sets_constraint(entry) for entry in entries)


@dataclass(frozen=True, slots=True)
class ValidCall:
    """A call that passed every check: its requests (n per prompt, prompt-major, as SGLang
    orders them), and whether it was one prompt (not a list) with n = 1, answered by one
    result rather than a list."""

    requests: list[ValidRequest]
    single: bool


Tokenize = Callable[[str], list[int]]


def validate_call(
    draft: Draft,
    limits: ModelLimits,
    names: FieldNames = CANONICAL,
    tokenize: Tokenize | None = None,
) -> ValidCall:
    """Every check of one generate call; raises InvalidRequestError (ConstraintError for a
    bad constraint) naming the field as `names` spells it. Text prompts are tokenized with
    `tokenize` (each once: its n samples share the ids). The cheap checks of the whole call
    come first; then each request, its constraint converted (a JSON schema in a worker
    process stopped at the deadline)."""
    request = limits.request
    prompts, single = _prompts(draft.text, draft.input_ids, names)
    n = _samples(draft.n, request, names)
    check_batch_size(len(prompts) * n, request)
    params = sampling_list(draft.sampling, len(prompts), names)
    check_options(draft.options, request, names)
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            check_prompt_size(prompt, limits, names("text") + ("" if single else f"[{i}]"))
    ids = [_ids(prompt, tokenize) for prompt in prompts]
    pairs = [(i, _sample(p, j)) for i, p in zip(ids, params) for j in range(n)]
    check_response_size(pairs, draft.options, request, names)
    valid = [validate_request(i, p, draft.options, limits, names) for i, p in pairs]
    if draft.embed:
        _check_dimensions(draft.dimensions, limits.hidden_size, names)
        valid = [_embedding(v, names) for v in valid]
    return ValidCall(valid, single and n == 1)


def check_prompt_size(text: str, limits: ModelLimits, name: str, field: str = "text") -> None:
    """A prompt text refused before it is tokenized (InvalidRequestError naming `field`; the
    message calls the text `name`): past --max-prompt-bytes, or, by the tokenizer's bound,
    surely more tokens than the context holds (`validate_request` counts the real tokens).
    Tokenizing is the slow part of a long prompt, and its ids the big part."""
    check_prompt_bytes(utf8_length(text), limits, name, field)
    bound, context = limits.token_bound, limits.context_length
    least = 0 if bound is None else bound.least_tokens(text)
    if least >= context:
        raise InvalidRequestError(
            f"{name} has at least {least} tokens ({utf8_length(text)} bytes, at most "
            f"{bound.max_bytes} a token); the model's context is {context} tokens",
            field=field,
        )


def check_prompt_bytes(size: int, limits: ModelLimits, name: str, field: str = "text") -> None:
    """A prompt text of `size` bytes against --max-prompt-bytes (`check_prompt_size`)."""
    most = limits.max_prompt_bytes
    if size > most:
        why, context = "", limits.context_length
        if limits.request.max_prompt_bytes is None:
            why = f"; by default {PROMPT_BYTES_PER_TOKEN} a token of the model's context, {context}"
        raise InvalidRequestError(
            f"{name} has {size} bytes; at most {most} (--max-prompt-bytes{why})", field=field
        )


def _check_dimensions(dimensions: Any, hidden_size: int, names: FieldNames) -> None:
    most = hidden_size or INT64_MAX
    if dimensions is not None and not (is_int(dimensions) and 1 <= dimensions <= most):
        raise names.error(
            "dimensions", f"must be an integer from 1 to {most} (the model's embedding size)"
        )


def _embedding(valid: ValidRequest, names: FieldNames) -> ValidRequest:
    """The request as an embedding request: it computes its prompt and generates nothing."""
    if valid.sampling.max_new_tokens != 0 or valid.constraint is not None:
        raise names.error(
            "max_new_tokens", "must be 0 in an embedding request (it generates nothing)"
        )
    return replace(valid, embed=True)


def validate_request(
    ids: list[int], sampling: SamplingParams, options: RequestOptions, limits: ModelLimits,
    names: FieldNames = CANONICAL,
) -> ValidRequest:  # fmt: skip
    """Everything about one request that can be checked before it is queued (a call's
    requests: `validate_call`)."""
    vocab = limits.vocab_size
    if not are_token_ids(ids, vocab):
        raise names.error("input_ids", f"must be token ids in [0, {vocab})")
    if not isinstance(sampling, SamplingParams):
        raise names.error("sampling_params", "must be a JSON object (a dict) or a SamplingParams")
    sampling.validate(len(ids), limits.context_length, limits.request, names)
    bad_stop = [t for t in sampling.stop_token_ids if t >= vocab]
    if bad_stop:
        raise names.error(
            "stop_token_ids", f"{bad_stop[:5]} are not token ids (vocabulary: {vocab})"
        )
    bad_bias = [t for t, _ in sampling.logit_bias if t >= vocab]
    if bad_bias:
        raise names.error(
            "logit_bias", f"keys {bad_bias[:5]} are not token ids (vocabulary: {vocab})"
        )
    check_options(options, limits.request, names)
    if options.logprob_start_len >= len(ids):
        raise names.error("logprob_start_len", f"must be -1 or a prompt position (< {len(ids)})")
    return ValidRequest(list(ids), sampling, options, _constraint(sampling, limits, names))


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


def check_options(
    options: RequestOptions, limits: RequestLimits | None = None, names: FieldNames = CANONICAL
) -> None:
    most = (limits or RequestLimits()).max_top_logprobs
    for flag in ("return_logprob", "return_text_in_logprobs", "stream"):
        if not isinstance(getattr(options, flag), bool):
            raise names.error(flag, "must be true or false")
    start = options.logprob_start_len
    if not is_int(start) or not -1 <= start <= INT64_MAX:
        raise names.error("logprob_start_len", "must be -1 (output only) or a prompt position")
    top = options.top_logprobs_num
    if not is_int(top) or not 0 <= top <= most:
        raise names.error("top_logprobs_num", f"must be an integer in [0, {most}]")
    timeout = options.timeout_s
    if timeout is not None and not (is_number(timeout) and timeout > 0):
        raise names.error(
            "timeout_s", "must be a number of seconds > 0 (or null: the server's default)"
        )


def check_batch_size(count: int, limits: RequestLimits) -> None:
    """A call's requests (prompts x n) against --max-batch-size."""
    most = limits.max_batch_size
    if count > most:
        raise InvalidRequestError(
            f"the call has {count} requests (prompts x n); at most {most} (--max-batch-size)",
            field="prompt",
        )


def check_response_size(
    requests: list[tuple[list[int], SamplingParams]], options: RequestOptions, limits: RequestLimits,
    names: FieldNames = CANONICAL,
) -> None:  # fmt: skip
    """The logprob entries a call may return (`logprob_entries`, summed over its prompts
    and n) against --max-logprob-entries: they multiply, so a small body can ask for GBs.
    Checked before the requests are validated one by one (n samples of a long prompt cost
    n validations); the options must be checked already (`check_options`)."""
    total = sum(logprob_entries(len(ids), sampling, options) for ids, sampling in requests)
    most = limits.max_logprob_entries
    if total > most:
        new, top = names("max_new_tokens"), names("top_logprobs_num")
        start, n = names("logprob_start_len"), names("n")
        raise InvalidRequestError(
            f"the call asks for {total} logprob entries ((prompt tokens from {start} + {new}) "
            f"x (1 + {top}), over every prompt and {n}); at most {most} (--max-logprob-entries): "
            f"lower {n}, {new} or {top}, or raise {start}"
        )  # fmt: skip


def logprob_entries(num_ids: int, sampling: SamplingParams, options: RequestOptions) -> int:
    """At most how many logprob entries one request returns (0 without return_logprob; a
    max_new_tokens that is not an int counts 0: validate_request refuses it)."""
    if not options.return_logprob:
        return 0
    start = options.logprob_start_len
    new = sampling.max_new_tokens if is_int(sampling.max_new_tokens) else 0
    positions = (num_ids - start if 0 <= start < num_ids else 0) + new
    return positions * (1 + options.top_logprobs_num)


def _constraint(
    sampling: SamplingParams, limits: ModelLimits, names: FieldNames
) -> ConstraintSpec | None:
    """The constraint converted to its spec, once. A JSON schema converts in a worker
    process that is stopped at the deadline (`constrained.convert`). A grammar's error
    names its field (`ebnf: line 3, column 7: ...`)."""
    if not sampling.has_constraint:
        return None
    name = sampling.constraint_names[0]
    try:
        return constraint_spec(sampling, limits.conversion)
    except constrained_errors.ConstraintError as e:
        raise constraint_error(e, name) from None
    except RecursionError:  # a schema nested deeper than the JSON parser's recursion allows
        message = f"{names(name)} is nested too deeply; flatten it or use $defs"
        raise ConstraintError(message, field=name) from None


def constraint_spec(
    sampling: SamplingParams, conversion: Conversion, check: bool = False
) -> ConstraintSpec | None:
    """The spec of the one constraint `sampling` holds (ConstraintError if bad or several);
    `check`: its backend decided now (see make_spec). The request's grammar_backend, if it
    names one, replaces the server's."""
    if sampling.grammar_backend is not None:
        conversion = replace(conversion, backend=sampling.grammar_backend)
    return conversion.spec(
        sampling.regex, sampling.json_schema, sampling.choices, sampling.schema_mode or "lenient",
        ebnf=sampling.ebnf, lark=sampling.lark, structural_tag=sampling.structural_tag, check=check,
    )  # fmt: skip


def _prompts(text: Any, input_ids: Any, names: FieldNames) -> tuple[list, bool]:
    """(the prompts, each a string or a list of ids; whether a single prompt was given)."""
    if (text is None) == (input_ids is None):
        message = f"give exactly one of {names('text')} or {names('input_ids')}"
        raise InvalidRequestError(message, field="prompt")
    if text is not None:
        if isinstance(text, str):
            return [text], True
        if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            return list(text), False
        raise names.error("text", "must be a string or a non-empty list of strings")
    if isinstance(input_ids, list) and input_ids and all(isinstance(x, list) for x in input_ids):
        return [list(x) for x in input_ids], False
    if isinstance(input_ids, list):
        return [input_ids], True
    raise names.error("input_ids", "must be a list of token ids or a list of such lists")


def _samples(n: Any, limits: RequestLimits, names: FieldNames) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= limits.max_n:
        raise names.error("n", f"must be an integer from 1 to {limits.max_n} (--max-n); got {n!r}")
    return n


def _ids(prompt: str | list[int], tokenize: Tokenize | None) -> list[int]:
    if isinstance(prompt, str):
        assert tokenize is not None, "text prompts need a tokenizer"
        return tokenize(prompt)
    return prompt


def _sample(sampling: Any, j: int) -> Any:
    """Sample j of a prompt: with a seed, seed + j (the samples differ, each reproducible);
    a seed that is not an int is left for validate() to name."""
    if j == 0 or not isinstance(sampling, SamplingParams) or not is_int(sampling.seed):
        return sampling
    return sampling.replace(seed=sampling.seed + j)


def _sets_constraint(entry: Any) -> bool:
    if isinstance(entry, SamplingParams):
        return entry.has_constraint
    return isinstance(entry, dict) and any(entry.get(k) is not None for k in CONSTRAINT_FIELDS)


def sampling_list(params: Any, n: int, names: FieldNames = CANONICAL) -> list[SamplingParams]:
    """One SamplingParams per prompt: one dict / SamplingParams for all, or a list of n."""
    if isinstance(params, list):
        if len(params) != n:
            message = f"{len(params)} {names('sampling_params')} for {n} prompts"
            raise InvalidRequestError(message, field="sampling_params")
        return [sampling_from(p, names) for p in params]
    return [sampling_from(params, names)] * n


def sampling_from(params: Any, names: FieldNames = CANONICAL) -> SamplingParams:
    if isinstance(params, SamplingParams):
        return params
    if params is not None and not isinstance(params, dict):
        raise names.error("sampling_params", "must be a JSON object (a dict) or a SamplingParams")
    try:
        return SamplingParams.from_dict(params)
    except TypeError as e:  # a value of a type no field can hold
        message = f"bad {names('sampling_params')}: {e}"
        raise InvalidRequestError(message, field="sampling_params") from None
