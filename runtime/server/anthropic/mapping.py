"""Anthropic Messages requests -> the OpenAI ChatRequest that the one chat path takes
(openai/routes.py submit_chat): system and messages with their text, tool_use,
tool_result and thinking blocks; tools and tool_choice; stop_sequences, sampling and the
JSON-schema output format. Nothing is validated here that the chat path validates."""

from __future__ import annotations

from typing import Any

from spruce.runtime.server.anthropic.schemas import (
    CountTokensRequest,
    Message,
    MessagesRequest,
    TextBlock,
    ToolResultBlock,
)
from spruce.runtime.server.http.common import ApiError
from spruce.runtime.server.openai.schemas import ChatRequest

TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
# The chat path's names for fields that Anthropic names otherwise (in messages and `param`).
FIELD_NAMES = {"stop": "stop_sequences", "response_format": "output_config.format"}


def chat_request(req: CountTokensRequest) -> ChatRequest:
    """The ChatRequest of a message (or of the prompt count_tokens counts: max_tokens 0)."""
    body: dict[str, Any] = {
        "model": req.model,
        "messages": system_messages(req.system) + chat_messages(req.messages),
        "separate_reasoning": True,  # the reasoning parser's block becomes a thinking block
    }
    if req.tools:
        body["tools"] = [tool(t) for t in req.tools]
    if req.tool_choice is not None:
        body.update(tool_choice(req.tool_choice))
    if req.thinking is not None:
        body["chat_template_kwargs"] = {"enable_thinking": req.thinking.type != "disabled"}
        if req.thinking.type != "disabled" and req.thinking.budget_tokens is not None:
            body["thinking_token_budget"] = req.thinking.budget_tokens  # enforced by the runtime
    fmt = req.output_format or (req.output_config and req.output_config.format)
    if fmt is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"schema": fmt.schema_}}
    if isinstance(req, MessagesRequest):
        body.update(sampling(req))
    return ChatRequest.model_validate(body)


def sampling(req: MessagesRequest) -> dict[str, Any]:
    body: dict[str, Any] = {"max_tokens": req.max_tokens, "stream": req.stream}
    for name in ("temperature", "top_p", "top_k"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if req.stop_sequences:
        body["stop"] = req.stop_sequences
    return body


def system_messages(system: str | list[TextBlock] | None) -> list[dict[str, Any]]:
    if system is None:
        return []
    text = system if isinstance(system, str) else "\n".join(b.text for b in system)
    return [{"role": "system", "content": text}]


def chat_messages(messages: list[Message]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
        else:
            check_blocks(m, f"messages.{i}.content")
            out += assistant_message(m) if m.role == "assistant" else user_messages(m)
    return out


def check_blocks(m: Message, where: str) -> None:
    """Images and documents are a 400 naming the block (the model reads text only)."""
    for j, block in enumerate(m.content):
        inner = block.content if isinstance(block, ToolResultBlock) else None
        for k, part in enumerate(inner if isinstance(inner, list) else [None]):
            kind = (part or block).type
            if kind in ("image", "document"):
                field = f"{where}.{j}" + (f".content.{k}" if part is not None else "")
                message = f"{field}: {kind} blocks are not supported (this model reads text only)"
                raise ApiError(400, message, param=field)
        if m.role == "assistant" and block.type == "tool_result":
            raise ApiError(400, f"{where}.{j}: tool_result blocks belong in user messages")
        if m.role == "user" and block.type in ("tool_use", "thinking", "redacted_thinking"):
            raise ApiError(400, f"{where}.{j}: {block.type} blocks belong in assistant messages")


def user_messages(m: Message) -> list[dict[str, Any]]:
    """Each tool_result becomes a tool message (in order); the text, one user message."""
    out: list[dict[str, Any]] = []
    for block in m.content:
        if block.type == "tool_result":
            out.append(
                {"role": "tool", "tool_call_id": block.tool_use_id, "content": result_text(block)}
            )
    text = "".join(b.text for b in m.content if b.type == "text")
    if text or not out:
        out.append({"role": "user", "content": text})
    return out


def result_text(block: ToolResultBlock) -> str:
    text = (
        block.content if isinstance(block.content, str) else "".join(b.text for b in block.content)
    )
    return f"Error: {text}" if block.is_error else text


def assistant_message(m: Message) -> list[dict[str, Any]]:
    message: dict[str, Any] = {
        "role": "assistant",
        "content": "".join(b.text for b in m.content if b.type == "text") or None,
    }
    calls = [
        {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}}
        for b in m.content
        if b.type == "tool_use"
    ]
    if calls:
        message["tool_calls"] = calls
    thinking = "".join(b.thinking for b in m.content if b.type == "thinking")
    if thinking:
        message["reasoning_content"] = thinking
    return [message]


def tool(t) -> dict[str, Any]:
    function = {"name": t.name, "parameters": t.input_schema}
    if t.description is not None:
        function["description"] = t.description
    if t.strict is not None:
        function["strict"] = t.strict
    return {"type": "function", "function": function}


def tool_choice(choice) -> dict[str, Any]:
    out: dict[str, Any] = {"parallel_tool_calls": not choice.disable_parallel_tool_use}
    if choice.type != "tool":
        return {**out, "tool_choice": TOOL_CHOICES[choice.type]}
    if not choice.name:
        raise ApiError(
            400, 'tool_choice {"type": "tool"} needs the tool\'s name', param="tool_choice"
        )
    return {**out, "tool_choice": {"type": "function", "function": {"name": choice.name}}}


def renamed(e: ApiError) -> ApiError:
    """An error of the chat path with the field named as Anthropic names it, in the message
    itself (Anthropic's error object has no `param`)."""
    if e.param is None:
        return e
    name = FIELD_NAMES.get(e.param, e.param)
    if e.message.startswith(e.param):
        message = name + e.message[len(e.param) :]
    else:
        message = f"{name}: {e.message}"
    return ApiError(e.status, message, name, e.code)
