"""The chat prompt: messages rendered with the model's chat template (with the request's
`chat_template_kwargs`), what `tool_choice` asks for in the model's tool-call format
(ToolPlan), and whether the answer comes after a reasoning block (ChatPrompt)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import jinja2
import orjson

from spruce.constrained.backends.llguidance_text import nested_lark
from spruce.constrained.convert import Conversion
from spruce.constrained.core.errors import ConstraintError
from spruce.constrained.report import schema_report
from spruce.constrained.spec import ConstraintSpec
from spruce.runtime.config import ServerOptions
from spruce.runtime.core.sampling_params import CONSTRAINT_FIELDS, SamplingParams
from spruce.runtime.core.validation import (
    check_prompt_bytes,
    check_prompt_size,
    constraint_spec,
)
from spruce.runtime.core.values import utf8_length
from spruce.runtime.errors import InvalidRequestError, constraint_error
from spruce.runtime.limits import RequestLimits
from spruce.runtime.server.http.common import ApiError, ServerState
from spruce.runtime.server.openai import tool_calls
from spruce.runtime.server.openai.custom_tools import (
    CustomCallStream,
    custom_call,
    custom_constraint,
)
from spruce.runtime.server.openai.schemas import (
    ChatMessage,
    ChatRequest,
    ContentPart,
    MessageToolCall,
    NamedCustomToolChoice,
    NamedToolChoice,
)
from spruce.runtime.server.openai.sglang_fields import check_continue_final, continued
from spruce.runtime.server.openai.thinking_fields import template_thinking
from spruce.runtime.server.openai.tool_parsers import (
    TOOL_CALL_FORMATS,
    ToolCallFormat,
    tool_call_format,
)
from spruce.runtime.server.openai.tool_stream import ToolCallStream, final_calls
from spruce.runtime.server.openai.tool_tags import strict_auto_tag
from spruce.runtime.text.reasoning import ReasoningFormat, reasoning_format
from spruce.runtime.text.reasoning import register_plugin as register_reasoning
from spruce.runtime.text.tokenizer import TEMPLATE_ARGUMENTS


@lru_cache(maxsize=8)
def chat_formats(reasoning_parser: str, tool_call_parser: str, template: str | None) -> tuple[ReasoningFormat | None, ToolCallFormat]:  # fmt: skip
    """The server's --reasoning-parser and --tool-call-parser ("auto": from the chat
    template); ValueError for an unknown name (checked at start-up)."""
    return reasoning_format(reasoning_parser, template), tool_call_format(
        tool_call_parser, template
    )


def startup_formats(
    options: ServerOptions, template: str | None
) -> tuple[ReasoningFormat | None, ToolCallFormat]:
    """At start-up: --reasoning-parser-plugin registered, then the formats (`chat_formats`)."""
    if options.reasoning_parser_plugin:
        register_reasoning(options.reasoning_parser_plugin)
    return chat_formats(options.reasoning_parser, options.tool_call_parser, template)


def server_formats(server: ServerState) -> tuple[ReasoningFormat | None, ToolCallFormat]:
    options, template = server.options, server.model.tokenizer.chat_template
    return chat_formats(options.reasoning_parser, options.tool_call_parser, template)


class ToolPlan:
    """What tool_choice asks for: no tools, parse free text ("auto"), or calls the decoder
    is constrained to write in the model's tool-call format ("required", a named function)."""

    def __init__(
        self, tools: list[dict], choice: str, fmt: ToolCallFormat, constraint: dict | None,
        custom: str | None = None,
    ) -> None:  # fmt: skip
        self.tools = tools  # the function tools (custom tools are not shown to the template)
        self.choice = choice  # "none" | "auto" | "required" | "named" | "custom"
        self.format = fmt.bind([t["function"] for t in tools])  # values typed by the schemas
        self.constraint = constraint  # {"regex": ...}, {"json_schema": ...} or {"lark": ...}
        self.names = {t["function"]["name"] for t in tools}
        self.custom = custom  # the custom tool tool_choice names: the answer is its input

    @classmethod
    def of(
        cls,
        req: ChatRequest,
        fmt: ToolCallFormat | None = None,
        conversion: Conversion | None = None,
        limits: RequestLimits | None = None,
    ) -> ToolPlan:
        """The plan; required / named calls convert their schemas with `conversion` (the
        server's whitespace and deadline; default Conversion()). The tools are checked
        against `limits` (default RequestLimits()) before anything else reads them."""
        conversion = conversion or Conversion()
        fmt = fmt or TOOL_CALL_FORMATS["json"]
        given = checked_tools(req, limits or RequestLimits())
        tools = [t for t in given if t["type"] == "function"]
        choice = req.tool_choice
        if choice is not None and not given and choice != "none":
            raise ApiError(400, "tool_choice needs tools", param="tool_choice")
        if isinstance(choice, NamedCustomToolChoice):
            customs = {t["custom"]["name"]: t["custom"] for t in given if t["type"] == "custom"}
            return cls(
                tools,
                "custom",
                fmt,
                _custom_constraint(customs, choice.custom.name, conversion),
                choice.custom.name,
            )
        if choice == "required" and not tools:
            raise ApiError(
                400,
                'tool_choice "required" needs function tools (name a custom tool instead)',
                param="tool_choice",
            )
        if not tools or choice == "none":
            return cls(tools, "none", fmt, None)
        functions = [t["function"] for t in tools]
        if isinstance(choice, NamedToolChoice):
            functions = [f for f in functions if f["name"] == choice.function.name]
            if not functions:
                message = f"tool_choice names {choice.function.name!r}, which is not in tools"
                raise ApiError(400, message, param="tool_choice")
            return cls(tools, "named", fmt, _constraint(fmt, functions, True, False, conversion))
        if choice == "required":
            return cls(
                tools,
                "required",
                fmt,
                _constraint(fmt, functions, False, req.parallel_tool_calls, conversion),
            )
        return cls(tools, "auto", fmt, _strict_auto(fmt, functions, req.parallel_tool_calls))

    @property
    def constrained(self) -> bool:
        return self.constraint is not None

    @property
    def schema(self) -> dict | None:
        return (self.constraint or {}).get("json_schema")

    @property
    def parses_calls(self) -> bool:
        return self.choice != "none"

    def calls_from(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, tool calls) of a finished answer."""
        if self.custom is not None:
            return None, [custom_call(self.custom, text)]
        return final_calls(self.format, text, self.names) if self.parses_calls else (text, [])

    def stream(self) -> ToolCallStream | CustomCallStream | None:
        if self.custom is not None:
            return CustomCallStream(self.custom)
        return ToolCallStream(self.format, self.names) if self.parses_calls else None


def tool_plan(req: ChatRequest, server: ServerState) -> ToolPlan:
    """The request's ToolPlan in the server's tool-call format, with its limits."""
    limits = server.model.limits
    return ToolPlan.of(req, server_formats(server)[1], limits.conversion, limits.request)


LEGACY_TOOL_FIELDS = ("functions", "function_call")  # OpenAI's older names for tools


def checked_tools(req: ChatRequest, limits: RequestLimits) -> list[dict]:
    """The request's tools as dicts, once their count (--max-tools) and their bytes as JSON,
    schemas included (--max-tools-bytes), are within the limits: a long list costs its
    rendering into the prompt, its format's binding and its constraint, all before the
    prompt's length is known. OpenAI's legacy `functions` is refused here too."""
    legacy = [name for name in LEGACY_TOOL_FIELDS if name in (req.model_extra or {})]
    if legacy:
        message = f"{legacy[0]} (OpenAI's legacy form of tools) is not supported; send tools"
        raise ApiError(400, message, param=legacy[0])
    tools = req.tools or []
    if len(tools) > limits.max_tools:
        message = f"tools has {len(tools)} entries; at most {limits.max_tools} (--max-tools)"
        raise ApiError(400, message, param="tools")
    given = [t.model_dump(exclude_none=True) for t in tools]
    size = len(orjson.dumps(given)) if given else 0
    if size > limits.max_tools_bytes:
        message = (f"tools has {size} bytes as JSON, schemas included; at most "
                   f"{limits.max_tools_bytes} (--max-tools-bytes)")  # fmt: skip
        raise ApiError(400, message, param="tools")
    return given


def _constraint(
    fmt: ToolCallFormat, functions: list[dict], single: bool, parallel: bool, conversion: Conversion
) -> dict:
    try:
        return fmt.constraint(functions, single, parallel, conversion)
    except (ConstraintError, ValueError) as e:
        raise ApiError(
            400, f"cannot constrain tool calls in the {fmt.name} format: {e}", param="tools"
        ) from None


def _custom_constraint(customs: dict[str, dict], name: str, conversion: Conversion) -> dict | None:
    """The constraint of the named custom tool's input, checked (a bad grammar is a 400)."""
    if name not in customs:
        raise ApiError(
            400,
            f"tool_choice names the custom tool {name!r}, which is not in tools",
            param="tool_choice",
        )
    constraint = custom_constraint(customs[name])
    try:
        if constraint is not None:
            conversion.spec(**constraint)
    except ConstraintError as e:
        raise ApiError(400, f"tools: custom tool {name!r}: {e}", param="tools") from None
    return constraint


def _strict_auto(fmt: ToolCallFormat, functions: list[dict], parallel: bool) -> dict | None:
    """ "auto" with a `strict` function: {"structural_tag": ...} (free text, exact calls)."""
    try:
        return strict_auto_tag(fmt, functions, parallel)
    except ValueError as e:
        raise ApiError(
            400, f"cannot constrain tool calls in the {fmt.name} format: {e}", param="tools"
        ) from None


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """The rendered prompt; `reasoning`: the model's reasoning format (None: no reasoning
    parsed), `thinking`: whether the output starts inside its reasoning block."""

    text: str
    ids: list[int]
    reasoning: ReasoningFormat | None
    thinking: bool
    specials: Mapping[str, int] = field(default_factory=dict)  # special tokens: text -> id

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning_content, the answer) of a finished output."""
        return (None, text) if self.reasoning is None else self.reasoning.split(text, self.thinking)

    def constrain(
        self, sampling: SamplingParams, conversion: Conversion
    ) -> tuple[SamplingParams, ConstraintSpec | None]:
        """A constrained answer after a reasoning block: the constraint becomes a regex (a
        Lark grammar where it is not regular, or compiled by llguidance) that lets the
        reasoning through first (any text but the closing tag), then the answer. Returns the
        sampling and the answer's own spec (None when nothing was wrapped), by which the
        answer is checked once finished (`answer_report`). A bad constraint raises the
        runtime's ConstraintError naming its field."""
        if self.reasoning is None or not sampling.has_constraint:
            return sampling, None
        try:
            spec = constraint_spec(sampling, conversion, check=True)  # its grammar is embedded
        except ConstraintError as e:
            raise constraint_error(e, sampling.constraint_names[0]) from None
        cleared = dict.fromkeys(CONSTRAINT_FIELDS)
        if spec.regex and spec.backend != "llguidance":
            regex = self.reasoning.constraint_regex(spec.regex, self.thinking)
            return sampling.replace(**{**cleared, "regex": regex}), spec
        lark = self.reasoning.constraint_lark(
            nested_lark(spec.grammar), self.thinking, self.specials
        )
        return sampling.replace(**{**cleared, "lark": lark}), spec


def answer_report(spec: ConstraintSpec | None, answer: str) -> dict[str, Any]:
    """Extension field `json_schema` of an answer whose JSON schema was wrapped after a
    reasoning block (the runtime saw a regex): as the runtime reports a schema's output."""
    report = schema_report(spec, answer)
    return {} if report is None else {"json_schema": report}


def chat_prompt(req: ChatRequest, tools: ToolPlan, server: ServerState) -> ChatPrompt:
    """The prompt rendered and tokenized; its messages' text is checked against
    --max-prompt-bytes before it is rendered, and the rendered text as any prompt text is
    (`check_prompt_size`) before it is tokenized."""
    limits = server.model.limits
    with _as_messages_error():
        check_prompt_bytes(sum(map(message_bytes, req.messages)), limits, "messages")
    text = render(req, tools, server)
    with _as_messages_error():
        name = "messages (rendered by the chat template, with the tools)"
        check_prompt_size(text, limits, name if tools.tools else "messages (rendered)")
    reasoning = server_formats(server)[0]
    if reasoning is not None and reasoning.closed_in_prompt(text):
        reasoning = None  # no reasoning to separate, none to allow before a constrained answer
    if reasoning is not None and tools.constrained and tools.custom is None:
        reasoning = reasoning.for_calls()  # the constrained answer is calls (harmony: no final)
    thinking = reasoning is not None and reasoning.starts_inside(text)
    tokenizer = server.model.tokenizer
    return ChatPrompt(text, tokenizer.encode(text), reasoning, thinking, tokenizer.special_tokens)


def render(req: ChatRequest, tools: ToolPlan, server: ServerState) -> str:
    tokenizer = server.model.tokenizer
    messages = [_template_message(m) for m in req.messages]
    template_tools = tools.tools if tools.choice != "none" else None
    if template_tools and "tools" not in (tokenizer.chat_template or ""):
        messages = _with_tools_prompt(
            messages, tool_calls.tools_system_prompt(template_tools, tools.format.instructions)
        )
        template_tools = None
    extra = {**template_thinking(req, server.options, tokenizer.chat_template),
             **template_kwargs(req.chat_template_kwargs)}  # fmt: skip
    check_continue_final(req.messages, req.continue_final_message)
    try:
        text = tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=not req.continue_final_message,
            tools=template_tools,
            **extra,
        )
    except ValueError as e:  # no chat template
        raise ApiError(400, f"{e} (use /v1/completions)") from None
    except jinja2.TemplateError as e:
        raise ApiError(
            400, f"the chat template refused the messages: {e}", param="messages"
        ) from None
    return continued(text, messages[-1]["content"] or "") if req.continue_final_message else text


def template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """chat_template_kwargs reach the template as variables, except the ones the server sets."""
    taken = sorted(set(kwargs or {}) & TEMPLATE_ARGUMENTS)
    if taken:
        message = f"chat_template_kwargs cannot set {', '.join(taken)} (the server sets them)"
        raise ApiError(400, message, param="chat_template_kwargs")
    return dict(kwargs or {})


@contextmanager
def _as_messages_error() -> Iterator[None]:
    """A prompt size error as the chat path's 400 about `messages`."""
    try:
        yield
    except InvalidRequestError as e:
        raise ApiError(400, str(e), param="messages") from None


def message_bytes(m: ChatMessage) -> int:
    """The bytes of a message's text: content, reasoning, tool calls' arguments."""
    content = m.content if isinstance(m.content, list) else [m.content]
    texts = [c if isinstance(c, str) else getattr(c, "text", None) for c in content]
    texts += [m.reasoning_content]
    texts += [c.function.arguments for c in m.tool_calls or ()]
    return sum(utf8_length(t) for t in texts if isinstance(t, str))


def _template_message(m: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {
        "role": "system" if m.role == "developer" else m.role,
        "content": _text_of(m.content),
    }
    if m.name is not None:
        out["name"] = m.name
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        out["tool_calls"] = [_template_tool_call(c) for c in m.tool_calls]
    if m.reasoning_content is not None:
        out["reasoning_content"] = m.reasoning_content
    return out


def _text_of(content: str | list[ContentPart] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.type != "text" or part.text is None:
            message = f"content parts of type {part.type!r} are not supported (text only)"
            raise ApiError(400, message, param="messages")
        parts.append(part.text)
    return "".join(parts)


def _template_tool_call(call: MessageToolCall) -> dict[str, Any]:
    """Templates expect arguments as a mapping; OpenAI sends a JSON string."""
    arguments = call.function.arguments
    if isinstance(arguments, str):
        arguments = tool_calls.loads_json(arguments) if arguments.strip() else {}
        arguments = arguments if isinstance(arguments, dict) else call.function.arguments
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.function.name, "arguments": arguments},
    }


def _with_tools_prompt(messages: list[dict], prompt: str) -> list[dict]:
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": messages[0]["content"] + "\n\n" + prompt}, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]
