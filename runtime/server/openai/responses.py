"""OpenAI's Responses API (`POST /v1/responses`) as one mapping layer onto the chat path:
the body (strict models, as `schemas`) becomes a ChatRequest — `instructions` a system
message, `input` items chat messages (function_call items an assistant message's
tool_calls, function_call_output items tool results), flat function tools chat tools,
`text.format` the response_format — which `submit_chat` renders, validates and submits;
`responses_stream.ResponsesView` answers from its events. Stateless: nothing is stored,
so `previous_response_id` is a 400 and `store` changes nothing."""

from __future__ import annotations

import re
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, Field, ValidationError

from spruce.runtime.server.http.common import (
    ApiError,
    first_param,
    json_response,
    server_of,
    stream_response,
    validation_message,
)  # fmt: skip
from spruce.runtime.server.openai.responses_stream import (
    ENCRYPTED_REASONING,
    ResponsesView,
    reasoning_of,
)
from spruce.runtime.server.openai.routes import chat_results, submit_chat
from spruce.runtime.server.openai.schemas import ChatRequest, StrictModel, parse

router = APIRouter(prefix="/v1")

# The chat fields the chat path names in its errors, as this API spells them.
RESPONSES_NAMES = {
    "max_tokens": "max_output_tokens", "response_format": "text.format", "messages": "input",
}  # fmt: skip


class FunctionTool(StrictModel):
    """A function tool in the Responses' flat shape; `strict` defaults to true there."""

    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = True


class FunctionChoice(StrictModel):
    type: Literal["function"]
    name: str


class TextFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(StrictModel):
    format: TextFormat = TextFormat(type="text")


class ReasoningConfig(StrictModel):
    """`effort`: the chat path's reasoning_effort (the template reads it, or it sets a
    thinking budget); `max_tokens`: its thinking_token_budget."""

    effort: str | None = None
    max_tokens: int | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesRequest(StrictModel):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["auto", "none", "required"] | FunctionChoice | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    metadata: dict[str, str] | None = None
    parallel_tool_calls: bool = True
    store: bool | None = None  # accepted: nothing is ever stored
    previous_response_id: str | None = None
    stream: bool = False
    user: str | None = None
    truncation: Literal["disabled"] | None = None
    include: list[str] | None = None  # checked by `check_include`
    # Spruce's, as on the chat route: template variables (e.g. {"enable_thinking": true})
    # and the request's deadline
    chat_template_kwargs: dict[str, Any] | None = None
    timeout_s: float | None = None


# -- input items ---------------------------------------------------------------------------


class MessageItem(StrictModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[dict[str, Any]]
    id: str | None = None
    status: str | None = None
    phase: str | None = None


class FunctionCallItem(StrictModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(StrictModel):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[dict[str, Any]]
    id: str | None = None
    status: str | None = None


class ReasoningItem(StrictModel):
    """An earlier answer's reasoning, sent back: its text (or the text its
    `encrypted_content` carries, from this server) becomes the next assistant message's
    reasoning_content (templates may show it)."""

    type: Literal["reasoning"]
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None
    id: str | None = None
    status: str | None = None


ITEM_TYPES: dict[str, type[BaseModel]] = {
    "message": MessageItem, "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem, "reasoning": ReasoningItem,
}  # fmt: skip
TEXT_PARTS = {"input_text", "output_text", "summary_text", "reasoning_text"}


def checked(model: type[BaseModel], value: dict[str, Any], where: str) -> Any:
    """`value` as `model`; its errors a 400 named from `where` (e.g. "input.2")."""
    try:
        return model.model_validate(value)
    except ValidationError as e:
        errors = [{**err, "loc": (where, *err.get("loc", ()))} for err in e.errors()]
        loc = ".".join(str(x) for x in errors[0]["loc"])
        raise ApiError(400, validation_message(errors), param=loc) from None


def input_item(value: dict[str, Any], i: int) -> Any:
    kind = value.get("type", "message")
    if kind not in ITEM_TYPES:
        message = (f"input.{i}: items of type {kind!r} are not supported (this server takes "
                   f"{', '.join(ITEM_TYPES)} items and stores no responses)")  # fmt: skip
        raise ApiError(400, message, param=f"input.{i}.type")
    return checked(ITEM_TYPES[kind], value, f"input.{i}")


def text_of(content: str | list[dict[str, Any]], where: str) -> str:
    """The text of a content: a string or text parts (images and files are a 400)."""
    if isinstance(content, str):
        return content
    parts = []
    for j, part in enumerate(content):
        if part.get("type") not in TEXT_PARTS or not isinstance(part.get("text"), str):
            message = f"{where}.{j}: content parts of type {part.get('type')!r} are not supported (text only)"
            raise ApiError(400, message, param=f"{where}.{j}.type")
        parts.append(part["text"])
    return "".join(parts)


def chat_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """`instructions` and `input` as chat messages: consecutive function_call items join
    one assistant message (after its text, if the item before was one)."""
    messages: list[dict[str, Any]] = []
    if req.instructions is not None:
        messages.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        return [*messages, {"role": "user", "content": req.input}]
    reasoning = None
    for i, value in enumerate(req.input):
        item = input_item(value, i)
        if isinstance(item, ReasoningItem):
            reasoning = text_of(item.content or item.summary, f"input.{i}.summary")
            reasoning = reasoning or reasoning_of(item.encrypted_content)
            continue
        if isinstance(item, FunctionCallOutputItem):
            output = text_of(item.output, f"input.{i}.output")
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
            continue
        message = _assistant_turn(messages, item, i)
        if reasoning is not None and message["role"] == "assistant":
            message["reasoning_content"], reasoning = reasoning, None
    return messages


def _assistant_turn(messages: list[dict], item: MessageItem | FunctionCallItem, i: int) -> dict:
    """The message `item` makes or joins (a call joins the assistant message before it)."""
    if isinstance(item, MessageItem):
        messages.append({"role": item.role, "content": text_of(item.content, f"input.{i}.content")})
        return messages[-1]
    last = messages[-1] if messages else None
    if last is None or last["role"] != "assistant":
        last = {"role": "assistant", "content": None}
        messages.append(last)
    call = {"id": item.call_id, "type": "function",
            "function": {"name": item.name, "arguments": item.arguments}}  # fmt: skip
    last.setdefault("tool_calls", []).append(call)
    return last


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Flat function tools as chat tools; any other tool type is a 400 naming it."""
    if tools is None:
        return None
    out = []
    for i, value in enumerate(tools):
        if value.get("type") != "function":
            message = (f"tools.{i}: tools of type {value.get('type')!r} are not supported "
                       "(this server runs function tools)")  # fmt: skip
            raise ApiError(400, message, param=f"tools.{i}.type")
        tool = checked(FunctionTool, value, f"tools.{i}")
        out.append(
            {"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
        )
    return out


def chat_format(text: TextConfig | None) -> dict[str, Any] | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema_ is None:
        raise ApiError(400, 'text.format json_schema needs "schema"', param="text.format.schema")
    schema = fmt.model_dump(
        include={"name", "description", "schema_", "strict"}, by_alias=True, exclude_none=True
    )
    return {"type": "json_schema", "json_schema": schema}


# OpenAI's `include` values: ones whose items this server never writes (built-in tools,
# images) change nothing; logprobs are not offered here.
INCLUDES = {
    ENCRYPTED_REASONING, "file_search_call.results", "web_search_call.results",
    "web_search_call.action.sources", "message.input_image.image_url",
    "computer_call_output.output.image_url", "code_interpreter_call.outputs",
}  # fmt: skip


def check_include(req: ResponsesRequest) -> None:
    for i, value in enumerate(req.include or []):
        if value not in INCLUDES:
            known = ", ".join(sorted(INCLUDES))
            raise ApiError(400, f"include: {value!r} is not supported here; supported: {known}",
                           param=f"include.{i}")  # fmt: skip


def chat_request(req: ResponsesRequest) -> ChatRequest:
    """The ChatRequest this request asks for (checked there, as any chat request)."""
    check_include(req)
    if req.previous_response_id is not None:
        message = ("previous_response_id is not supported: this server stores no responses "
                   "(send the conversation in input)")  # fmt: skip
        raise ApiError(400, message, param="previous_response_id")
    choice = req.tool_choice
    if isinstance(choice, FunctionChoice):
        choice = {"type": "function", "function": {"name": choice.name}}
    fields = {
        "model": req.model, "messages": chat_messages(req), "tools": chat_tools(req.tools),
        "tool_choice": choice, "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": chat_format(req.text), "max_tokens": req.max_output_tokens,
        "temperature": req.temperature, "top_p": req.top_p, "stream": req.stream,
        "chat_template_kwargs": req.chat_template_kwargs, "timeout_s": req.timeout_s,
        "reasoning_effort": req.reasoning and req.reasoning.effort,
        "thinking_token_budget": req.reasoning and req.reasoning.max_tokens,
    }  # fmt: skip
    try:
        return ChatRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as e:
        error = ApiError(400, validation_message(e.errors()), first_param(e.errors()))
        raise renamed(error) from None


def renamed(e: ApiError) -> ApiError:
    """A chat path error with the fields named as this API names them ("messages" only
    where it leads the message: it is a word too)."""
    message = re.sub(
        r"\b(max_tokens|response_format)\b", lambda m: RESPONSES_NAMES[m[1]], e.message
    )
    if message.startswith("messages"):
        message = "input" + message[len("messages") :]
    head, dot, rest = (e.param or "").partition(".")
    param = RESPONSES_NAMES[head] + dot + rest if head in RESPONSES_NAMES else e.param
    return ApiError(e.status, message, param, e.code)


@router.post("/responses")
async def responses(request: Request) -> Response:
    server = server_of(request)
    req: ResponsesRequest = parse(ResponsesRequest, await request.body())
    try:
        call, chat = await submit_chat(request, server, chat_request(req))
    except ApiError as e:
        raise renamed(e) from None
    view = ResponsesView(server, req, chat.prompt, chat.tools)
    if req.stream:
        return await stream_response(request, call, view.stream(call))
    return json_response(view.response(await chat_results(request, call)))
