"""The DSL's expressions: gen, select, roles, images; SGLang's names and argument orders."""

from __future__ import annotations

import inspect
from typing import Any

from spruce.constrained.spec import too_many_constraints
from spruce.lang.backend import Backend
from spruce.lang.choices import ChoicesMethod, token_length_normalized
from spruce.lang.errors import ProgramError, UnsupportedFeatureError
from spruce.lang.ir import (
    Gen,
    RoleBegin,
    RoleEnd,
    Select,
    Seq,
    dsl_keywords,
    split_params,
    to_node,
)  # fmt: skip
from spruce.lang.program import resolve_backend
from spruce.runtime.core.sampling_params import CONSTRAINT_FIELDS
from spruce.runtime.errors import ConstraintError
from spruce.runtime.limits import RequestLimits


def gen(name: str | None = None, max_tokens: int | None = None, **params: Any) -> Gen | Select:
    """Generates text into variable `name`. Keywords: every SamplingParams field (with
    SGLang's names max_tokens / min_tokens), return_logprob, logprob_start_len,
    top_logprobs_num, and one constraint: regex, json_schema (dict, JSON string or pydantic
    model class), ebnf (a GBNF grammar, root rule `root`), lark (llguidance's Lark, start
    rule `start`), structural_tag (dict or JSON text) or dtype (int, float, bool, str).
    None means "the run's default".

    As in SGLang: n=k draws k samples in one request (the variable is the list of k texts,
    its meta_info the list of their meta_infos; the first sample is appended to the text);
    choices=[...] (with choices_method=, temperature=) is a select.

    separate_reasoning=True (or "qwen3" / "deepseek-r1"): for reasoning models, the variable
    holds the answer after the `<think>...</think>` block and `<name>_reasoning_content` the
    reasoning (None when there was no block); the program text keeps the whole output."""
    n = params.pop("n", None)
    choices_method = params.pop("choices_method", None)
    if params.get("choices") is not None:
        return _gen_select(name, params, choices_method)
    if choices_method is not None:
        raise ProgramError(
            "gen(choices_method=...) needs choices=[...] (a gen with choices is a select)"
        )
    reasoning = _reasoning_format(params.pop("separate_reasoning", None))
    dtype = params.pop("dtype", None)
    sampling, options = split_params({"max_tokens": max_tokens, **params}, "gen")
    dtype_name = None
    if dtype is not None:
        given = [c for c in CONSTRAINT_FIELDS if c in sampling]
        if given:
            raise ConstraintError(too_many_constraints(["dtype", *given]))
        dtype_name, sampling["regex"] = _dtype_regex(dtype)
    return Gen(
        name,
        tuple(sampling.items()),
        tuple(options.items()),
        dtype_name,
        _sample_count(n),
        reasoning,
    )


def _reasoning_format(separate_reasoning: Any) -> str | None:
    """separate_reasoning=True (the `<think>` format) or a format name ("qwen3",
    "deepseek-r1"): the variable gets the answer, `<name>_reasoning_content` the reasoning."""
    from spruce.runtime.text.reasoning import REASONING_FORMATS

    if separate_reasoning in (None, False):
        return None
    name = "qwen3" if separate_reasoning is True else separate_reasoning
    if name not in REASONING_FORMATS:
        known = ", ".join(REASONING_FORMATS)
        raise ProgramError(
            f"gen(separate_reasoning=...) takes True or a format name ({known}); got {name!r}"
        )
    return name


def _gen_select(name: str | None, params: dict[str, Any], choices_method: Any) -> Select:
    """SGLang's gen(choices=...): a select; the sampling keywords other than temperature
    do not apply to scoring choices and are ignored, as there."""
    temperature = params.get("temperature")
    method = token_length_normalized if choices_method is None else choices_method
    return select(name, params["choices"], 0.0 if temperature is None else temperature, method)


def _sample_count(n: Any) -> int:
    """gen(n=...): at most RequestLimits' default max_n (a server's --max-n may differ: its
    validator has the last word)."""
    most = RequestLimits().max_n
    if n is None:
        return 1
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= most:
        raise ProgramError(f"gen(n=...) must be an integer from 1 to {most}; got {n!r}")
    return n


def _gen_signature() -> inspect.Signature:
    P = inspect.Parameter
    head = [
        P("name", P.POSITIONAL_OR_KEYWORD, default=None),
        P("max_tokens", P.POSITIONAL_OR_KEYWORD, default=None),
    ]
    extra = ("n", "dtype", "choices_method", "separate_reasoning")
    names = dict.fromkeys(k for k in (*dsl_keywords(), *extra) if k != "max_tokens")
    rest = [P(k, P.KEYWORD_ONLY, default=None) for k in names]
    return inspect.Signature(head + rest, return_annotation=Gen)


gen.__signature__ = _gen_signature()  # help(sl.gen) lists the keywords derived from SamplingParams


def gen_int(name: str | None = None, max_tokens: int | None = None, **params: Any) -> Gen:
    return gen(name, max_tokens, dtype=int, **params)


def gen_string(name: str | None = None, max_tokens: int | None = None, **params: Any) -> Gen:
    return gen(name, max_tokens, dtype=str, **params)


def select(
    name: str | None = None,
    choices: list[str] | None = None,
    temperature: float = 0.0,
    choices_method: ChoicesMethod = token_length_normalized,
) -> Select:
    """Picks one of `choices` (into variable `name`) by scoring each with the model's
    prompt logprobs; temperature > 0 samples by softmax(score / temperature)."""
    _check_choices(choices, "select")
    if not isinstance(temperature, (int, float)) or temperature < 0:
        raise ProgramError(f"select temperature must be >= 0; got {temperature!r}")
    if not callable(choices_method):
        raise ProgramError("choices_method must be sl.token_length_normalized, sl.greedy_token_selection, "
                           "sl.unconditional_likelihood_normalized or another ChoicesMethod")  # fmt: skip
    return Select(name, tuple(choices), float(temperature), choices_method)


# -- roles ------------------------------------------------------------------------------------


def system(expr: Any = None) -> Seq:
    return _role("system", expr)


def user(expr: Any = None) -> Seq:
    return _role("user", expr)


def assistant(expr: Any = None) -> Seq:
    return _role("assistant", expr)


def system_begin() -> RoleBegin:
    return RoleBegin("system")


def system_end() -> RoleEnd:
    return RoleEnd("system")


def user_begin() -> RoleBegin:
    return RoleBegin("user")


def user_end() -> RoleEnd:
    return RoleEnd("user")


def assistant_begin() -> RoleBegin:
    return RoleBegin("assistant")


def assistant_end() -> RoleEnd:
    return RoleEnd("assistant")


def _role(role: str, expr: Any) -> Seq:
    inner = () if expr is None else (to_node(expr),)
    return Seq((RoleBegin(role), *inner, RoleEnd(role)))


# -- the rest ---------------------------------------------------------------------------------


def image(*args: Any, **kwargs: Any):
    raise UnsupportedFeatureError(
        "sl.image: this model has no vision encoder; Spruce serves text-only models, so "
        "programs cannot include images"
    )


def video(*args: Any, **kwargs: Any):
    raise UnsupportedFeatureError(
        "sl.video: this model has no vision encoder; Spruce serves text-only models, so "
        "programs cannot include videos"
    )


def flush_cache(backend: Any = None) -> None:
    """Empties the runtime's prefix cache (the runtime refuses while it is busy)."""
    resolve_backend(backend).flush_cache()


def get_server_info(backend: Any = None) -> dict[str, Any]:
    """The server's configuration and statistics (a Runtime, or an http:// endpoint)."""
    if hasattr(backend, "get_server_info") and not isinstance(backend, Backend):
        return backend.get_server_info()  # a Runtime asks its server over HTTP
    return resolve_backend(backend).get_server_info()


def _dtype_regex(dtype: Any) -> tuple[str, str]:
    from spruce.constrained.core.patterns import DTYPE_REGEXES  # the runtime's one definition

    name = dtype.__name__ if isinstance(dtype, type) else dtype
    if name not in DTYPE_REGEXES:
        raise ConstraintError(f"unsupported dtype {dtype!r}; supported: {', '.join(DTYPE_REGEXES)}")
    return name, DTYPE_REGEXES[name]


def _check_choices(choices: Any, where: str) -> None:
    if isinstance(choices, str) or not isinstance(choices, (list, tuple)) or not choices:
        raise ProgramError(f"{where} needs choices: a non-empty list of strings; got {choices!r}")
    if not all(isinstance(c, str) and c for c in choices):
        raise ProgramError(f"{where} choices must be non-empty strings; got {list(choices)!r}")
