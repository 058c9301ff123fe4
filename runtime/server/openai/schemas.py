"""The OpenAI request bodies as pydantic models in strict mode (a string where a number
belongs is a 400, not silently converted). Their limits are the server's RequestLimits,
checked by the one validator (core.validation)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from spruce.runtime.core.sampling_params import SamplingParams
from spruce.runtime.server.http.common import ApiError, validation_message
from spruce.runtime.server.openai.sglang_fields import ACCEPTED_FIELDS, SAMPLING_ALIASES, renamed
from spruce.runtime.server.openai.vllm_fields import BACKEND_FIELD, GUIDED_FIELDS, vllm_backend

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# Accepted and ignored: they change nothing in how this server generates.
IGNORED_FIELDS = {
    "user",
    "metadata",
    "store",
    "service_tier",
    "parallel_tool_calls",
    "best_of",
} | ACCEPTED_FIELDS
SAMPLING_EXTENSIONS = set(SamplingParams.field_names()) - {"max_new_tokens"}
KNOWN_EXTENSIONS = (
    SAMPLING_EXTENSIONS | set(SAMPLING_ALIASES) | set(GUIDED_FIELDS) | {BACKEND_FIELD}
)


class StrictModel(BaseModel):
    """A request body part: unknown fields and type coercions are 400s."""

    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(StrictModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(StrictModel):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictModel):
    """OpenAI's formats, and the structural tag (SGLang / vLLM / XGrammar) in either form:
    `format` (XGrammar's tree) or `structures` + `triggers` (the older list)."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    format: dict[str, Any] | None = None
    structures: list[dict[str, Any]] | None = None
    triggers: list[str] | None = None

    def structural_tag(self) -> dict[str, Any]:
        """The structural tag as the constraint takes it (the fields that were given)."""
        return self.model_dump(
            exclude_none=True, include={"type", "format", "structures", "triggers"}
        )


class StructuredOutputs(StrictModel):
    """vLLM's `structured_outputs` (one of json, regex, choice, grammar, json_object,
    structural_tag). `disable_fallback` is accepted: Spruce never falls back to another
    backend. `grammar` is EBNF (GBNF) unless it reads as Lark (see vllm_fields)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: dict[str, Any] | str | None = None
    disable_fallback: bool | None = None


class SamplingRequest(BaseModel):
    """Fields shared by completions and chat; unknown fields are checked in `extensions()`."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str
    max_tokens: int | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM's
    timeout_s: float | None = (
        None  # Spruce's: the request's deadline (default: --request-timeout-s)
    )

    def extensions(self) -> dict[str, Any]:
        """The extra fields that are SamplingParams fields; anything unknown is a 400."""
        extra = dict(self.model_extra or {})
        if extra.get("best_of") not in (None, self.n):
            raise ApiError(400, "best_of is not supported (use n)", param="best_of")
        unknown = sorted(set(extra) - KNOWN_EXTENSIONS - IGNORED_FIELDS)
        if unknown:
            raise ApiError(
                400,
                f"unknown field(s) {unknown}; besides OpenAI's fields this server accepts the sampling "
                f"parameters {', '.join(sorted(KNOWN_EXTENSIONS))}",
                param=unknown[0],
            )
        return vllm_backend(renamed({k: v for k, v in extra.items() if k in KNOWN_EXTENSIONS}))


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None


class ContentPart(StrictModel):
    type: str
    text: str | None = None


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    name: str
    arguments: str | dict[str, Any] = "{}"


class MessageToolCall(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    id: str | None = None
    type: str = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # an earlier answer's reasoning (templates may show it)


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class CustomGrammar(StrictModel):
    syntax: Literal["lark", "regex"]
    definition: str


class CustomFormat(StrictModel):
    """A custom tool's input: free text, or text in a grammar (OpenAI's Lark dialect is
    llguidance's)."""

    type: Literal["text", "grammar"]
    grammar: CustomGrammar | None = None

    @model_validator(mode="after")
    def _grammar_given(self) -> CustomFormat:
        if (self.type == "grammar") != (self.grammar is not None):
            raise ValueError(
                'a custom tool\'s format is {"type": "text"} or {"type": "grammar", "grammar": {...}}'
            )
        return self


class CustomToolDef(StrictModel):
    name: str = Field(min_length=1)
    description: str | None = None
    format: CustomFormat | None = None


class Tool(StrictModel):
    """A function tool, or a custom tool (its input is free text or text in a grammar)."""

    type: Literal["function", "custom"]
    function: FunctionDef | None = None
    custom: CustomToolDef | None = None

    @model_validator(mode="after")
    def _definition_given(self) -> Tool:
        if (self.function is None, self.custom is None) != (
            self.type != "function",
            self.type != "custom",
        ):
            raise ValueError(
                f'a tool of type {self.type!r} needs its definition under "{self.type}" (only)'
            )
        return self


class NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: NamedFunction


class NamedCustomToolChoice(StrictModel):
    type: Literal["custom"]
    custom: NamedFunction


class ChatRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: (
        Literal["none", "auto", "required"] | NamedToolChoice | NamedCustomToolChoice | None
    ) = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = (
        None  # more template variables, e.g. {"enable_thinking": false}
    )
    separate_reasoning: bool = (
        True  # False: the reasoning block stays in content (with --reasoning-parser)
    )
    continue_final_message: bool = (
        False  # SGLang's: continue the last (assistant) message, no new turn
    )
    # thinking (see thinking_fields): a budget of thinking tokens (vLLM's name, or the other
    # common one; -1: unlimited) and OpenAI's reasoning_effort, which the template reads
    thinking_token_budget: int | None = None
    max_thinking_tokens: int | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None


def parse(model: type[BaseModel], body: bytes) -> Any:
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        loc = ".".join(str(x) for x in errors[0].get("loc", ())) or None
        raise ApiError(400, validation_message(errors), param=loc) from None
