"""SamplingParams: the one definition of how a request samples and stops.

Reused by the offline Engine, the HTTP / ZeroMQ front ends and the DSL. `validate()` gives
a clear `InvalidRequestError` for every value a user can get wrong.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from spruce.constrained.backends import BACKEND_CHOICES
from spruce.constrained.core import linear_regex
from spruce.constrained.core.linear_regex import UnsupportedRegex
from spruce.constrained.spec import too_many_constraints
from spruce.runtime.core.values import is_int, is_int64, is_number
from spruce.runtime.errors import ConstraintError, FieldNames, InvalidRequestError
from spruce.runtime.limits import INT64_MAX, RequestLimits

MIN_TEMPERATURE = 1e-5  # below, logits / temperature overflow to inf (and sampling to NaN)
MIN_REPETITION_PENALTY = 1e-5  # the same division
# The constraint fields: a request sets at most one. All but choices are text.
CONSTRAINT_FIELDS = ("regex", "json_schema", "choices", "ebnf", "lark", "structural_tag")
TEXT_CONSTRAINTS = tuple(name for name in CONSTRAINT_FIELDS if name != "choices")
CANONICAL = FieldNames()  # messages name the fields as SamplingParams does


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    # Python regexes searched in the output's decoded tail (the last STOP_REGEX_TAIL_TOKENS
    # tokens); the first match stops the request, as a stop string does.
    stop_regex: tuple[str, ...] = ()
    no_stop_trim: bool = (
        False  # keep the matched stop string / regex match / stop token in the text
    )
    ignore_eos: bool = False
    seed: int | None = None
    skip_special_tokens: bool = True
    # (token id, bias) pairs added to the logits (OpenAI's logit_bias; clipped to [-100, 100]);
    # a {token id: bias} dict (JSON keys may be strings) is accepted.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # SGLang's parameters for custom logit processors: accepted and ignored (meta_info says so).
    custom_params: dict[str, Any] | None = None
    # Constraints (spruce.constrained); at most one of them.
    regex: str | None = None
    json_schema: str | None = None
    # Compiled into a regex by the front end / DSL; kept so requests stay self-describing.
    choices: tuple[str, ...] | None = None
    # Context-free grammars: GBNF / EBNF (llama.cpp's and XGrammar's dialect, SGLang's `ebnf`;
    # root rule `root`) or Lark (llguidance's dialect; start rule `start`).
    ebnf: str | None = None
    lark: str | None = None
    # A structural tag (XGrammar's `format` tree or the older `structures` + `triggers`), as
    # JSON text; a dict is dumped to JSON as json_schema is.
    structural_tag: str | None = None
    # json_schema keywords the grammar cannot enforce: "strict" refuses them, "lenient" leaves
    # them out and reports them in meta_info; None: the server's default (lenient).
    schema_mode: str | None = None
    # The grammar backend of this request's constraint (auto, spruce, llguidance, outlines);
    # None: the server's --grammar-backend (vLLM's guided_decoding_backend maps here).
    grammar_backend: str | None = None
    # Thinking budget: at most `thinking_budget` output tokens inside the reasoning block,
    # then the runtime writes `thinking_close` itself (the family's end marker, after an
    # optional message) and the answer, constrained or not, starts. The block is open from
    # the first output token when `thinking_open` is None, else from where the output
    # writes `thinking_open`. Both are matched and written as their token ids.
    thinking_budget: int | None = None
    thinking_open: str | None = None
    thinking_close: str = "</think>"
    # False: this request never drafts, even where the server speculates (scheduler/speculative.py)
    speculative: bool = True

    def __post_init__(self) -> None:
        # JSON-friendly input -> field types, however the object was built
        for name, value in _normalized(
            {f.name: getattr(self, f.name) for f in fields(self)}
        ).items():
            object.__setattr__(self, name, value)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> SamplingParams:
        """Builds from JSON-like input; an unknown field is an error that lists the known ones."""
        data = dict(data or {})
        unknown = sorted(set(data) - set(cls.field_names()))
        if unknown:
            raise InvalidRequestError(
                f"unknown sampling parameter(s) {unknown}; known: {', '.join(cls.field_names())}",
                field="sampling_params",
            )
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def replace(self, **changes: Any) -> SamplingParams:
        return replace(self, **changes)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return bool(
            self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0
        )

    @property
    def has_constraint(self) -> bool:
        return bool(self.constraint_names)

    @property
    def constraint_names(self) -> list[str]:
        """The constraint fields that are set (a valid request has at most one)."""
        return [name for name in CONSTRAINT_FIELDS if getattr(self, name) is not None]

    def validate(
        self,
        prompt_len: int | None = None,
        context_len: int | None = None,
        limits: RequestLimits | None = None,
        names: FieldNames = CANONICAL,
    ) -> None:
        """Raises InvalidRequestError for any value the runtime refuses, naming the field as
        `names` spells it (and carrying its canonical name); sizes are checked against
        `limits` (default: RequestLimits())."""
        limits = limits or RequestLimits()
        self._check_counts(names)
        self._check_floats(names)
        self._check_flags(names)
        self._check_stops(limits, names)
        self._check_stop_regex(limits, names)
        self._check_logit_bias(limits, names)
        self._check_constraint(limits, names)
        self._check_thinking(limits, names)
        cap = limits.max_new_tokens_limit
        _check(cap is None or self.max_new_tokens <= cap, names, "max_new_tokens",
               f"must be at most {cap} on this server")  # fmt: skip
        if prompt_len is not None and context_len is not None:
            self.validate_length(prompt_len, context_len, names)

    def _check_counts(self, names: FieldNames) -> None:
        new, least = self.max_new_tokens, self.min_new_tokens
        _check(is_int64(new) and new >= 0, names, "max_new_tokens", "must be an integer >= 0")
        _check(is_int64(least) and least >= 0, names, "min_new_tokens", "must be an integer >= 0")
        _check(least <= new, names, "min_new_tokens",
               f"must not exceed {names('max_new_tokens')}")  # fmt: skip
        _check(is_int64(self.top_k) and (self.top_k == -1 or self.top_k >= 1), names, "top_k",
               "must be -1 (off) or >= 1")  # fmt: skip
        _check(self.seed is None or (is_int(self.seed) and 0 <= self.seed <= INT64_MAX), names,
               "seed", f"must be an integer in [0, {INT64_MAX}]")  # fmt: skip

    def _check_floats(self, names: FieldNames) -> None:
        temperature = self.temperature
        _check(is_number(temperature) and temperature >= 0, names, "temperature",
               "must be >= 0 (0 means greedy) and finite")  # fmt: skip
        _check(temperature == 0 or temperature >= MIN_TEMPERATURE, names, "temperature",
               f"must be 0 (greedy) or >= {MIN_TEMPERATURE:g}: a smaller one overflows the logits")  # fmt: skip
        _check(is_number(self.top_p) and 0 < self.top_p <= 1, names, "top_p", "must be in (0, 1]")
        _check(is_number(self.min_p) and 0 <= self.min_p <= 1, names, "min_p", "must be in [0, 1]")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            _check(is_number(value) and -2 <= value <= 2, names, name, "must be in [-2, 2]")
        penalty = self.repetition_penalty
        _check(is_number(penalty) and MIN_REPETITION_PENALTY <= penalty <= 2, names,
               "repetition_penalty", f"must be in [{MIN_REPETITION_PENALTY:g}, 2]")  # fmt: skip

    def _check_flags(self, names: FieldNames) -> None:
        for name in ("ignore_eos", "skip_special_tokens", "no_stop_trim", "speculative"):
            _check(isinstance(getattr(self, name), bool), names, name, "must be true or false")
        _check(self.custom_params is None or isinstance(self.custom_params, dict), names,
               "custom_params",
               "must be a JSON object (it is ignored: Spruce runs no custom logit processors)")  # fmt: skip

    def _check_stops(self, limits: RequestLimits, names: FieldNames) -> None:
        stop, ids = self.stop, self.stop_token_ids
        _check(isinstance(stop, tuple) and all(isinstance(s, str) and s for s in stop), names,
               "stop", "must be a string or a list of non-empty strings")  # fmt: skip
        _check(len(stop) <= limits.max_stop_strings, names, "stop",
               f"has {len(stop)} strings; at most {limits.max_stop_strings}")  # fmt: skip
        longest = max(map(len, stop), default=0)
        if longest > limits.max_stop_string_chars:
            raise InvalidRequestError(
                f"a {names('stop')} string has {longest} characters; at most "
                f"{limits.max_stop_string_chars}", field="stop",
            )  # fmt: skip
        _check(isinstance(ids, tuple) and all(is_int64(t) and t >= 0 for t in ids), names,
               "stop_token_ids", "must be a list of token ids (ints >= 0)")  # fmt: skip
        _check(len(ids) <= limits.max_stop_token_ids, names, "stop_token_ids",
               f"has {len(ids)} entries; at most {limits.max_stop_token_ids}")  # fmt: skip

    def _check_stop_regex(self, limits: RequestLimits, names: FieldNames) -> None:
        patterns, most = self.stop_regex, limits.max_stop_strings
        _check(isinstance(patterns, tuple) and all(isinstance(p, str) and p for p in patterns),
               names, "stop_regex",
               "must be a regex string or a list of non-empty regex strings")  # fmt: skip
        _check(len(patterns) <= most, names, "stop_regex",
               f"has {len(patterns)} patterns; at most {most} (--max-stop-strings)")  # fmt: skip
        for pattern in patterns:
            _check_size(names, "stop_regex", len(pattern), limits.max_stop_string_chars,
                        "--max-stop-string-chars")  # fmt: skip
            try:
                empty_match = linear_regex.search(pattern, "")
            except UnsupportedRegex as e:
                raise names.error("stop_regex", f"{pattern[:80]!r}: {e.reason}") from None
            _check(empty_match is None, names, "stop_regex",
                   f"{pattern!r} matches the empty string (it would stop at once)")  # fmt: skip

    def _check_logit_bias(self, limits: RequestLimits, names: FieldNames) -> None:
        bias = self.logit_bias
        _check(
            isinstance(bias, tuple)
            and all(isinstance(p, tuple) and len(p) == 2 and is_int64(p[0]) and p[0] >= 0 and is_number(p[1])
                    for p in bias),
            names, "logit_bias", "must map token ids (integers >= 0) to finite numbers",
        )  # fmt: skip
        most = limits.max_logit_bias
        _check(len(bias) <= most, names, "logit_bias",
               f"has {len(bias)} entries; at most {most} (--max-logit-bias)")  # fmt: skip

    def _check_thinking(self, limits: RequestLimits, names: FieldNames) -> None:
        budget, most = self.thinking_budget, limits.max_stop_string_chars
        _check(budget is None or (is_int64(budget) and budget >= 1), names, "thinking_budget",
               "must be an integer >= 1")  # fmt: skip
        for name in ("thinking_open", "thinking_close"):
            value = getattr(self, name)
            _check((value is None and name == "thinking_open") or (isinstance(value, str) and value),
                   names, name, "must be a non-empty string")  # fmt: skip
            _check_size(names, name, len(value or ""), most, "--max-stop-string-chars")

    def _check_constraint(self, limits: RequestLimits, names: FieldNames) -> None:
        for name in TEXT_CONSTRAINTS:
            value = getattr(self, name)
            _check(value is None or isinstance(value, str), names, name, "must be a string")
            _check_size(names, name, len(value or ""), limits.max_constraint_chars)
        choices = self.choices
        _check(choices is None or (isinstance(choices, tuple) and all(isinstance(c, str) for c in choices)),
               names, "choices", "must be a list of strings")  # fmt: skip
        if choices is not None:
            _check(len(choices) <= limits.max_choices, names, "choices",
                   f"has {len(choices)} entries; at most {limits.max_choices}")  # fmt: skip
            _check_size(names, "choices", sum(map(len, choices)), limits.max_constraint_chars)
        _check(self.schema_mode in (None, "strict", "lenient"), names, "schema_mode",
               "must be 'strict' or 'lenient'")  # fmt: skip
        _check(self.grammar_backend is None or self.grammar_backend in BACKEND_CHOICES, names,
               "grammar_backend", f"must be one of {', '.join(BACKEND_CHOICES)}")  # fmt: skip
        given = self.constraint_names
        if len(given) > 1:
            message = too_many_constraints([names(name) for name in given])
            raise ConstraintError(message, field=given[1])

    def validate_length(
        self, prompt_len: int, context_len: int, names: FieldNames = CANONICAL
    ) -> None:
        """The prompt, and the prompt with max_new_tokens, against the model's context."""
        if prompt_len <= 0:
            raise InvalidRequestError("the prompt is empty", field="prompt")
        if prompt_len >= context_len:
            raise InvalidRequestError(
                f"the prompt has {prompt_len} tokens; the model's context is {context_len} tokens",
                field="prompt",
            )
        new = names("max_new_tokens")
        if prompt_len + self.max_new_tokens > context_len:
            raise InvalidRequestError(
                f"prompt ({prompt_len} tokens) + {new} ({self.max_new_tokens}) exceeds the context "
                f"length ({context_len}); lower {new} to at most {context_len - prompt_len}",
                field="max_new_tokens",
            )


def _normalized(data: dict[str, Any]) -> dict[str, Any]:
    """JSON-friendly input -> field types: lists to tuples, a schema dict to its JSON text."""
    out = dict(data)
    for name in ("stop", "stop_regex"):
        if isinstance(out.get(name), str):
            out[name] = (out[name],)
    for name in ("stop", "stop_token_ids", "stop_regex", "choices"):
        if isinstance(out.get(name), list):
            out[name] = tuple(out[name])
    for name in ("stop", "stop_token_ids", "stop_regex", "logit_bias"):
        if name in out and out[name] is None:
            out[name] = ()
    if "logit_bias" in out:
        out["logit_bias"] = _bias_pairs(out["logit_bias"])
    for name in ("json_schema", "structural_tag"):
        value = out.get(name)
        if value is not None and not isinstance(value, str):
            out[name] = _json_text(name, value)
    return out


def _bias_pairs(bias: Any) -> Any:
    """{token id: bias} (JSON keys are strings) or [[id, bias], ...] -> ((id, bias), ...) sorted
    by id; anything else is left as it is, for validate() to name."""
    items = bias.items() if isinstance(bias, dict) else bias
    if not isinstance(items, (list, tuple)) and not isinstance(bias, dict):
        return bias
    pairs = []
    for item in items:
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            return bias
        token, value = item
        if isinstance(token, str) and token.strip().isdigit():
            token = int(token)
        pairs.append((token, value))
    if not all(is_int(t) for t, _ in pairs):
        return tuple(pairs)
    return tuple(sorted(pairs, key=lambda pair: pair[0]))


def _json_text(name: str, value: Any) -> str:
    """A json_schema (dict or pydantic model class) or structural_tag (dict) as JSON text."""
    if name == "json_schema" and isinstance(value, type) and hasattr(value, "model_json_schema"):
        value = value.model_json_schema()  # a pydantic model class
    try:
        return json.dumps(value)
    except (TypeError, ValueError, RecursionError) as e:
        shapes = (
            "a dict, a JSON string or a pydantic model"
            if name == "json_schema"
            else "a dict or a JSON string"
        )
        raise InvalidRequestError(f"{name} must be {shapes}: {e}", field=name) from None


def _check_size(
    names: FieldNames, name: str, size: int, limit: int, flag: str = "--max-constraint-chars"
) -> None:
    _check(size <= limit, names, name, f"has {size} characters; at most {limit} ({flag})")


def _check(ok: bool, names: FieldNames, name: str, rest: str) -> None:
    """Refuses unless `ok`: `<the field as the API spells it> <rest>`."""
    if not ok:
        raise names.error(name, rest)
