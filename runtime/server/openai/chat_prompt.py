"""The chat prompt: messages rendered with the model's chat template, and what
`tool_choice` asks for (ToolPlan)."""

from __future__ import annotations

from typing import Any

import jinja2

from spruce.runtime.server.http.common import ApiError, ServerState
from spruce.runtime.server.openai import tool_calls
from spruce.runtime.server.openai.schemas import ChatMessage, ChatRequest, ContentPart, MessageToolCall, NamedToolChoice

class ToolPlan:
    """What tool_choice asks for: no tools, parse free text ("auto"), or constrained calls."""

    def __init__(self, tools: list[dict], choice: str, schema: dict | None, single: bool) -> None:
        self.tools = tools
        self.choice = choice  # "none" | "auto" | "required" | "named"
        self.schema = schema
        self.single = single  # a named function: the output is one object, not an array
        self.names = {t["function"]["name"] for t in tools}

    @classmethod
    def of(cls, req: ChatRequest) -> "ToolPlan":
        tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
        choice = req.tool_choice
        if choice is not None and not tools and choice != "none":
            raise ApiError(400, "tool_choice needs tools", param="tool_choice")
        if not tools or choice == "none":
            return cls(tools, "none", None, False)
        functions = [t["function"] for t in tools]
        if isinstance(choice, NamedToolChoice):
            match = [f for f in functions if f["name"] == choice.function.name]
            if not match:
                message = f"tool_choice names {choice.function.name!r}, which is not in tools"
                raise ApiError(400, message, param="tool_choice")
            return cls(tools, "named", tool_calls.call_schema(match[0]), True)
        if choice == "required":
            return cls(tools, "required", tool_calls.required_schema(functions, req.parallel_tool_calls), False)
        return cls(tools, "auto", None, False)

    @property
    def constrained(self) -> bool:
        return self.schema is not None

    def calls_from(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, tool calls) of a finished output."""
        if self.constrained:
            calls = tool_calls.from_constrained(text, self.names)
            return (None, calls) if calls else (text, [])
        if self.choice == "auto":
            return tool_calls.parse_auto(text, self.names)
        return text, []


def chat_prompt_ids(req: ChatRequest, tools: ToolPlan, server: ServerState) -> list[int]:
    tokenizer = server.model.tokenizer
    messages = [_template_message(m) for m in req.messages]
    template_tools = tools.tools if tools.choice != "none" else None
    if template_tools and "tools" not in (tokenizer.chat_template or ""):
        messages = _with_tools_prompt(messages, template_tools)
        template_tools = None
    try:
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=template_tools)
    except ValueError as e:  # no chat template
        raise ApiError(400, f"{e} (use /v1/completions)") from None
    except jinja2.TemplateError as e:
        raise ApiError(400, f"the chat template refused the messages: {e}", param="messages") from None
    return tokenizer.encode(prompt)


def _template_message(m: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": _text_of(m.content)}
    if m.name is not None:
        out["name"] = m.name
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        out["tool_calls"] = [_template_tool_call(c) for c in m.tool_calls]
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
    return {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}}


def _with_tools_prompt(messages: list[dict], tools: list[dict]) -> list[dict]:
    prompt = tool_calls.tools_system_prompt(tools)
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": messages[0]["content"] + "\n\n" + prompt}, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]
