"""SamplingParams: the one definition of how a request samples and stops.

Reused by the offline Engine, the HTTP / ZeroMQ front ends and the DSL. `validate()` gives
a clear `InvalidRequestError` for every value a user can get wrong.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from spruce.constrained.core import linear_regex
from spruce.constrained.core.linear_regex import UnsupportedRegex
from spruce.runtime.core.values import is_int, is_int64, is_number
from spruce.runtime.errors import InvalidRequestError
from spruce.runtime.limits import INT64_MAX, RequestLimits

MIN_TEMPERATURE = 1e-5  # below, logits / temperature overflow to inf (and sampling to NaN)
MIN_REPETITION_PENALTY = 1e-5  # the same division
# The constraint fields: a request sets at most one. All but choices are text.
CONSTRAINT_FIELDS = ("regex", "json_schema", "choices", "ebnf", "lark", "structural_tag")
TEXT_CONSTRAINTS = tuple(name for name in CONSTRAINT_FIELDS if name != "choices")


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
                f"unknown sampling parameter(s) {unknown}; known: {', '.join(cls.field_names())}"
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
    ) -> None:
        """Raises InvalidRequestError naming the field for any value the runtime refuses;
        sizes are checked against `limits` (default: RequestLimits())."""
        limits = limits or RequestLimits()
        self._check_counts()
        self._check_floats()
        self._check_flags()
        self._check_stops(limits)
        self._check_stop_regex(limits)
        self._check_logit_bias(limits)
        self._check_constraint(limits)
        cap = limits.max_new_tokens_limit
        _check(
            cap is None or self.max_new_tokens <= cap,
            f"max_new_tokens must be at most {cap} on this server",
        )
        if prompt_len is not None and context_len is not None:
            self.validate_length(prompt_len, context_len)

    def _check_counts(self) -> None:
        _check(
            is_int64(self.max_new_tokens) and self.max_new_tokens >= 0,
            "max_new_tokens must be an integer >= 0",
        )
        _check(
            is_int64(self.min_new_tokens) and self.min_new_tokens >= 0,
            "min_new_tokens must be an integer >= 0",
        )
        _check(
            self.min_new_tokens <= self.max_new_tokens,
            "min_new_tokens must not exceed max_new_tokens",
        )
        _check(
            is_int64(self.top_k) and (self.top_k == -1 or self.top_k >= 1),
            "top_k must be -1 (off) or >= 1",
        )
        _check(
            self.seed is None or (is_int(self.seed) and 0 <= self.seed <= INT64_MAX),
            f"seed must be an integer in [0, {INT64_MAX}]",
        )

    def _check_floats(self) -> None:
        temperature = self.temperature
        _check(
            is_number(temperature) and temperature >= 0,
            "temperature must be >= 0 (0 means greedy) and finite",
        )
        _check(
            temperature == 0 or temperature >= MIN_TEMPERATURE,
            f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE:g}: a smaller one overflows the logits",
        )
        _check(is_number(self.top_p) and 0 < self.top_p <= 1, "top_p must be in (0, 1]")
        _check(is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p must be in [0, 1]")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            _check(is_number(value) and -2 <= value <= 2, f"{name} must be in [-2, 2]")
        _check(
            is_number(self.repetition_penalty)
            and MIN_REPETITION_PENALTY <= self.repetition_penalty <= 2,
            f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, 2]",
        )

    def _check_flags(self) -> None:
        for name in ("ignore_eos", "skip_special_tokens", "no_stop_trim"):
            _check(isinstance(getattr(self, name), bool), f"{name} must be true or false")
        _check(
            self.custom_params is None or isinstance(self.custom_params, dict),
            "custom_params must be a JSON object (it is ignored: Spruce runs no custom logit processors)",
        )

    def _check_stops(self, limits: RequestLimits) -> None:
        stop, ids = self.stop, self.stop_token_ids
        _check(
            isinstance(stop, tuple) and all(isinstance(s, str) and s for s in stop),
            "stop must be a string or a list of non-empty strings",
        )
        _check(
            len(stop) <= limits.max_stop_strings,
            f"stop has {len(stop)} strings; at most {limits.max_stop_strings}",
        )
        longest = max(map(len, stop), default=0)
        _check(
            longest <= limits.max_stop_string_chars,
            f"a stop string has {longest} characters; at most {limits.max_stop_string_chars}",
        )
        _check(
            isinstance(ids, tuple) and all(is_int64(t) and t >= 0 for t in ids),
            "stop_token_ids must be a list of token ids (ints >= 0)",
        )
        _check(
            len(ids) <= limits.max_stop_token_ids,
            f"stop_token_ids has {len(ids)} entries; at most {limits.max_stop_token_ids}",
        )

    def _check_stop_regex(self, limits: RequestLimits) -> None:
        patterns = self.stop_regex
        _check(
            isinstance(patterns, tuple) and all(isinstance(p, str) and p for p in patterns),
            "stop_regex must be a regex string or a list of non-empty regex strings",
        )
        most = limits.max_stop_strings
        _check(
            len(patterns) <= most,
            f"stop_regex has {len(patterns)} patterns; at most {most} (--max-stop-strings)",
        )
        for pattern in patterns:
            _check_size(
                "stop_regex", len(pattern), limits.max_stop_string_chars, "--max-stop-string-chars"
            )
            try:
                empty_match = linear_regex.search(pattern, "")
            except UnsupportedRegex as e:
                raise InvalidRequestError(f"stop_regex {pattern[:80]!r}: {e.reason}") from None
            _check(
                empty_match is None,
                f"stop_regex {pattern!r} matches the empty string (it would stop at once)",
            )

    def _check_logit_bias(self, limits: RequestLimits) -> None:
        bias = self.logit_bias
        _check(
            isinstance(bias, tuple)
            and all(isinstance(p, tuple) and len(p) == 2 and is_int64(p[0]) and p[0] >= 0 and is_number(p[1])
                    for p in bias),
            "logit_bias must map token ids (integers >= 0) to finite numbers",
        )  # fmt: skip
        most = limits.max_logit_bias
        _check(
            len(bias) <= most,
            f"logit_bias has {len(bias)} entries; at most {most} (--max-logit-bias)",
        )

    def _check_constraint(self, limits: RequestLimits) -> None:
        for name in TEXT_CONSTRAINTS:
            value = getattr(self, name)
            _check(value is None or isinstance(value, str), f"{name} must be a string")
            _check_size(name, len(value or ""), limits.max_constraint_chars)
        choices = self.choices
        _check(
            choices is None
            or (isinstance(choices, tuple) and all(isinstance(c, str) for c in choices)),
            "choices must be a list of strings",
        )
        if choices is not None:
            _check(
                len(choices) <= limits.max_choices,
                f"choices has {len(choices)} entries; at most {limits.max_choices}",
            )
            _check_size("choices", sum(map(len, choices)), limits.max_constraint_chars)
        _check(
            self.schema_mode in (None, "strict", "lenient"),
            "schema_mode must be 'strict' or 'lenient'",
        )
        constraints = self.constraint_names
        _check(len(constraints) <= 1, f"give at most one constraint, got {constraints}")

    def validate_length(self, prompt_len: int, context_len: int) -> None:
        _check(prompt_len > 0, "the prompt is empty")
        _check(
            prompt_len < context_len,
            f"the prompt has {prompt_len} tokens; the model's context is {context_len} tokens",
        )
        _check(
            prompt_len + self.max_new_tokens <= context_len,
            f"prompt ({prompt_len} tokens) + max_new_tokens ({self.max_new_tokens}) exceeds the "
            f"context length ({context_len}); lower max_new_tokens to at most {context_len - prompt_len}",
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
        raise InvalidRequestError(f"{name} must be {shapes}: {e}") from None


def _check_size(name: str, size: int, limit: int, flag: str = "--max-constraint-chars") -> None:
    _check(size <= limit, f"{name} has {size} characters; at most {limit} ({flag})")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidRequestError(message)
