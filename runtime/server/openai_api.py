"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions.

Requests are pydantic models in strict mode (a string where a number belongs is a 400, not
silently converted). Sampling maps onto the one `SamplingParams`: OpenAI's names
(max_tokens, stop, temperature...) and, as extensions, any SamplingParams field by its own
name (top_k, min_p, regex, json_schema, ignore_eos...). `response_format` and tool calls
become SamplingParams.json_schema, enforced by the constrained decoder.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator, Literal

import jinja2
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from spruce.runtime.errors import InvalidRequestError
from spruce.runtime.sampling_params import SamplingParams
from spruce.runtime.server import tool_calls
from spruce.runtime.server.http_app import (
    SSE_DONE,
    ApiError,
    ServerState,
    all_results,
    error_object,
    json_response,
    server_of,
    sse,
    stream_response,
    validation_message,
)
from spruce.runtime.inputs import sampling_from
from spruce.runtime.server.request_manager import Call, Event, Prepared

router = APIRouter(prefix="/v1")

MAX_N = 128
MAX_TOP_LOGPROBS = 20
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# Accepted and ignored: they change nothing in how this server generates.
IGNORED_FIELDS = {"user", "metadata", "store", "service_tier", "parallel_tool_calls", "logit_bias", "best_of"}
SAMPLING_EXTENSIONS = set(SamplingParams.field_names()) - {"max_new_tokens"}


# -- request models -------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(_Strict):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingRequest(BaseModel):
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

    def extensions(self) -> dict[str, Any]:
        """The extra fields that are SamplingParams fields; anything unknown is a 400."""
        extra = dict(self.model_extra or {})
        if extra.get("logit_bias"):
            raise ApiError(400, "logit_bias is not supported", param="logit_bias")
        if extra.get("best_of") not in (None, self.n):
            raise ApiError(400, "best_of is not supported (use n)", param="best_of")
        unknown = sorted(set(extra) - SAMPLING_EXTENSIONS - IGNORED_FIELDS)
        if unknown:
            raise ApiError(
                400,
                f"unknown field(s) {unknown}; besides OpenAI's fields this server accepts the sampling "
                f"parameters {', '.join(sorted(SAMPLING_EXTENSIONS))}",
                param=unknown[0],
            )
        return {k: v for k, v in extra.items() if k in SAMPLING_EXTENSIONS}


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None


class ContentPart(_Strict):
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


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True


def parse(model: type[BaseModel], body: bytes) -> Any:
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        loc = ".".join(str(x) for x in errors[0].get("loc", ())) or None
        raise ApiError(400, validation_message(errors), param=loc) from None


# -- routes ---------------------------------------------------------------------------------


@router.get("/models")
async def models(request: Request) -> Response:
    server = server_of(request)
    card = {
        "id": server.model.name,
        "object": "model",
        "created": int(server.started),
        "owned_by": "spruce",
        "root": server.model.path,
        "max_model_len": server.model.context_length,
    }
    return json_response({"object": "list", "data": [card]})


@router.post("/completions")
async def completions(request: Request) -> Response:
    server = server_of(request)
    req: CompletionRequest = parse(CompletionRequest, await request.body())
    _check_model(server, req.model)
    if req.suffix:
        raise ApiError(400, "suffix is not supported", param="suffix")
    top = _completion_top_logprobs(req.logprobs)
    prompts = _completion_prompts(req.prompt, server)
    items = []
    for ids in prompts:
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
        base = _sampling(req, max_tokens, len(ids), server)
        items += _choices(server, ids, base, req.n, req.logprobs is not None, top, echo=req.echo)
    call = server.manager.submit(items, req.stream)
    view = CompletionView(server, req, prompts, top)
    if req.stream:
        return await stream_response(request, call, view.stream(call))
    return json_response(view.response(await _results(request, call)))


@router.post("/chat/completions")
async def chat_completions(request: Request) -> Response:
    server = server_of(request)
    req: ChatRequest = parse(ChatRequest, await request.body())
    _check_model(server, req.model)
    top = _chat_top_logprobs(req)
    tools = ToolPlan.of(req)
    ids = _chat_prompt_ids(req, tools, server)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if max_tokens is None:  # OpenAI's chat default: whatever the context leaves
        max_tokens = max(server.model.context_length - len(ids), 0)
    base = _sampling(req, max_tokens, len(ids), server, tools.schema)
    items = _choices(server, ids, base, req.n, req.logprobs, top)
    call = server.manager.submit(items, req.stream)
    view = ChatView(server, req, len(ids), tools)
    if req.stream:
        return await stream_response(request, call, view.stream(call))
    return json_response(view.response(await _results(request, call)))


async def _results(request: Request, call: Call) -> list[Event]:
    events, failed = await all_results(request, call)
    if failed is not None:
        raise ApiError(failed.status, _openai_names(failed.error))
    return events


# -- request -> Prepared -------------------------------------------------------------------------


def _check_model(server: ServerState, name: str) -> None:
    if name not in (server.model.name, server.model.path):
        raise ApiError(
            404, f"the model {name!r} does not exist; this server serves {server.model.name!r}",
            param="model", code="model_not_found",
        )  # fmt: skip


def _sampling(
    req: _SamplingRequest, max_new_tokens: int, prompt_len: int, server: ServerState, tool_schema: dict | None = None
) -> SamplingParams:
    fields = req.extensions()
    fields["max_new_tokens"] = max_new_tokens
    for name in ("temperature", "top_p", "seed", "frequency_penalty", "presence_penalty"):
        if getattr(req, name) is not None:
            fields[name] = getattr(req, name)
    if req.stop is not None:
        fields["stop"] = req.stop
    _add_constraint(fields, req.response_format, tool_schema)
    if not 1 <= req.n <= MAX_N:
        raise ApiError(400, f"n must be between 1 and {MAX_N}", param="n")
    try:
        sampling = sampling_from(fields)
        sampling.validate(prompt_len, server.model.context_length)
    except (InvalidRequestError, TypeError) as e:
        raise ApiError(400, _openai_names(str(e))) from None
    return sampling


def _add_constraint(fields: dict, fmt: ResponseFormat | None, tool_schema: dict | None) -> None:
    given = [k for k in ("regex", "json_schema", "choices") if fields.get(k) is not None]
    if fmt is not None and fmt.type != "text":
        given.append("response_format")
        if fmt.type == "json_object":
            fields["json_schema"] = tool_calls.ANY_OBJECT
        elif fmt.json_schema is None or fmt.json_schema.schema_ is None:
            message = 'response_format json_schema needs {"json_schema": {"schema": {...}}}'
            raise ApiError(400, message, param="response_format")
        else:
            fields["json_schema"] = fmt.json_schema.schema_
    if tool_schema is not None:
        given.append("tool_choice")
        fields["json_schema"] = tool_schema
    if len(given) > 1:
        raise ApiError(400, f"give at most one output constraint; got {', '.join(given)}")


def _choices(
    server: ServerState, ids: list[int], base: SamplingParams, n: int, logprobs: bool, top: int,
    echo: bool = False,
) -> list[Prepared]:  # fmt: skip
    out = []
    for i in range(n):
        sampling = base if base.seed is None or i == 0 else base.replace(seed=base.seed + i)
        start = 0 if echo and logprobs else -1
        try:
            out.append(server.model.prepare(ids, sampling, logprobs, start, top))
        except InvalidRequestError as e:
            raise ApiError(400, _openai_names(str(e))) from None
    return out


def _openai_names(message: str) -> str:
    return message.replace("max_new_tokens", "max_tokens")


def _completion_top_logprobs(logprobs: int | None) -> int:
    if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        raise ApiError(400, f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}", param="logprobs")
    return logprobs or 0


def _chat_top_logprobs(req: ChatRequest) -> int:
    if req.top_logprobs is None:
        return 0
    if not req.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
        raise ApiError(400, f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}", param="top_logprobs")
    return req.top_logprobs


def _completion_prompts(prompt: Any, server: ServerState) -> list[list[int]]:
    if isinstance(prompt, str):
        prompts: list = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts:
        raise ApiError(400, "prompt must not be empty", param="prompt")
    tokenizer = server.model.tokenizer
    return [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]


# -- chat prompt and tools -------------------------------------------------------------------------


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


def _chat_prompt_ids(req: ChatRequest, tools: ToolPlan, server: ServerState) -> list[int]:
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
        arguments = tool_calls._loads(arguments) if arguments.strip() else {}
        arguments = arguments if isinstance(arguments, dict) else call.function.arguments
    return {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}}


def _with_tools_prompt(messages: list[dict], tools: list[dict]) -> list[dict]:
    prompt = tool_calls.tools_system_prompt(tools)
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": messages[0]["content"] + "\n\n" + prompt}, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


# -- responses ---------------------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def finish_reason(meta: dict[str, Any]) -> str | None:
    reason = meta.get("finish_reason")
    return None if reason is None else reason["type"]


def matched_stop(meta: dict[str, Any]) -> Any:
    reason = meta.get("finish_reason")
    return None if reason is None else reason.get("matched")


class _View:
    """Shared pieces of the completions and chat response builders."""

    response_object: str  # the OpenAI "object" of a whole (non-streamed) response

    def __init__(self, server: ServerState, req: _SamplingRequest, prefix: str, prompt_lens: list[int]) -> None:
        self.req = req
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.tokens = TokenText(server.model)
        self.prompt_lens = prompt_lens
        self.done: dict[int, Event] = {}  # finished events by choice index (for stream usage)

    def envelope(self, choices: list[dict], object_name: str) -> dict[str, Any]:
        return {
            "id": self.id, "object": object_name, "created": self.created, "model": self.req.model,
            "choices": choices,
        }  # fmt: skip

    def usage(self) -> dict[str, Any]:
        """Prompt tokens count once per prompt (not per choice); cached: its first choice's."""
        metas = {i: e.result["meta_info"] for i, e in self.done.items()}
        n = self.req.n
        cached = sum(metas[p * n]["cached_tokens"] for p in range(len(self.prompt_lens)) if p * n in metas)
        completion = sum(m["completion_tokens"] for m in metas.values())
        return usage(sum(self.prompt_lens), completion, cached)

    def stream_end(self, object_name: str) -> list[bytes]:
        """The last events of a stream: the usage chunk when asked for, then [DONE]."""
        end = [SSE_DONE]
        if self.req.stream_options and self.req.stream_options.include_usage:
            end.insert(0, sse({**self.envelope([], object_name), "usage": self.usage()}))
        return end

    @staticmethod
    def stream_error(e: Event, nothing_sent: bool) -> bytes:
        """Before the first chunk an error is a proper HTTP status; after it, an error event."""
        if nothing_sent:
            raise ApiError(e.status, _openai_names(e.error))
        return sse_error(e)

    def finished(self, events: list[Event]) -> None:
        self.done.update((e.index, e) for e in events)

    def response(self, events: list[Event]) -> dict[str, Any]:
        """The non-streaming body: one choice per event (`_choice`) and the usage."""
        self.finished(events)
        body = self.envelope([self._choice(e) for e in events], self.response_object)
        body["usage"] = self.usage()
        return body


class CompletionView(_View):
    response_object = "text_completion"

    def __init__(self, server: ServerState, req: CompletionRequest, prompts: list[list[int]], top: int) -> None:
        super().__init__(server, req, "cmpl", [len(p) for p in prompts])
        self.top = top
        self.echo_texts = [server.model.tokenizer.decode(p) for p in prompts] if req.echo else None

    def _choice(self, e: Event) -> dict[str, Any]:
        meta = e.result["meta_info"]
        return {
            "index": e.index,
            "text": self._echo(e.index) + e.result["text"],
            "logprobs": self._logprobs(meta) if self.req.logprobs is not None else None,
            "finish_reason": finish_reason(meta),
            "matched_stop": matched_stop(meta),
        }

    def _echo(self, index: int) -> str:
        return "" if self.echo_texts is None else self.echo_texts[index // self.req.n]

    def _logprobs(self, meta: dict[str, Any], offset: int = 0) -> dict[str, Any]:
        entries = list(meta.get("output_token_logprobs") or [])
        tops = list(meta.get("output_top_logprobs") or [None] * len(entries))
        if self.req.echo and "input_token_logprobs" in meta:
            inputs = list(meta["input_token_logprobs"])
            entries = inputs + entries
            tops = list(meta.get("input_top_logprobs") or [None] * len(inputs)) + tops
        return self.tokens.completion_logprobs(entries, tops, offset)

    async def stream(self, call: Call) -> AsyncIterator[bytes]:
        offsets: dict[int, int] = {}
        async for e in call:
            if e.error is not None:
                yield self.stream_error(e, nothing_sent=not offsets and not self.done)
                continue
            text = e.text if e.index in offsets else self._echo(e.index) + e.text
            offset = offsets.get(e.index, 0)
            choice = {"index": e.index, "text": text, "logprobs": None, "finish_reason": finish_reason(e.meta_info)}
            if self.req.logprobs is not None:
                choice["logprobs"] = self._logprobs(e.meta_info, offset)
            offsets[e.index] = offset + len(text)
            yield sse(self.envelope([choice], "text_completion"))
            if e.finished:
                self.finished([e])
        for chunk in self.stream_end("text_completion"):
            yield chunk


class ChatView(_View):
    response_object = "chat.completion"

    def __init__(self, server: ServerState, req: ChatRequest, prompt_len: int, tools: ToolPlan) -> None:
        super().__init__(server, req, "chatcmpl", [prompt_len])
        self.tools = tools

    def _choice(self, e: Event) -> dict[str, Any]:
        meta = e.result["meta_info"]
        content, calls = self.tools.calls_from(e.result["text"])
        message: dict[str, Any] = {"role": "assistant", "content": content}
        reason = finish_reason(meta)
        if calls:
            message["tool_calls"] = calls
            reason = "tool_calls"
        return {
            "index": e.index,
            "message": message,
            "logprobs": self._logprobs(meta) if self.req.logprobs else None,
            "finish_reason": reason,
            "matched_stop": matched_stop(meta),
        }

    def _logprobs(self, meta: dict[str, Any]) -> dict[str, Any]:
        entries = meta.get("output_token_logprobs") or []
        tops = meta.get("output_top_logprobs") or [None] * len(entries)
        return {"content": self.tokens.chat_logprobs(entries, tops)}

    async def stream(self, call: Call) -> AsyncIterator[bytes]:
        started: set[int] = set()
        auto = {}
        if self.tools.choice == "auto":
            auto = {i: tool_calls.AutoToolStream(self.tools.names) for i in range(self.req.n)}
        async for e in call:
            if e.error is not None:
                yield self.stream_error(e, nothing_sent=not started)
                continue
            if e.index not in started:
                started.add(e.index)
                yield self._chunk(e.index, {"role": "assistant", "content": ""}, None)
            for chunk in self._event_chunks(e, auto.get(e.index)):
                yield chunk
            if e.finished:
                self.finished([e])
        for chunk in self.stream_end("chat.completion.chunk"):
            yield chunk

    def _event_chunks(self, e: Event, auto: tool_calls.AutoToolStream | None) -> list[bytes]:
        out = []
        if self.tools.constrained:
            text, logprobs = "", None  # the calls come whole, at the end
        else:
            text = auto.feed(e.text) if auto is not None else e.text
            logprobs = self._logprobs(e.meta_info) if self.req.logprobs else None
        if text or (logprobs and logprobs["content"]):
            out.append(self._chunk(e.index, {"content": text}, None, logprobs))
        if e.finished:
            out += self._final_chunks(e, auto)
        return out

    def _final_chunks(self, e: Event, auto: tool_calls.AutoToolStream | None) -> list[bytes]:
        reason = finish_reason(e.meta_info)
        rest, calls = "", []
        if auto is not None:
            rest, calls = auto.finish()
        elif self.tools.constrained:
            content, calls = self.tools.calls_from(e.result["text"])
            rest = content or ""
        out = []
        if rest:
            out.append(self._chunk(e.index, {"content": rest}, None))
        if calls:
            out.append(self._chunk(e.index, {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}, None))
            reason = "tool_calls"
        out.append(self._chunk(e.index, {}, reason))
        return out

    def _chunk(self, index: int, delta: dict, reason: str | None, logprobs: dict | None = None) -> bytes:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        return sse(self.envelope([choice], "chat.completion.chunk"))


def sse_error(e: Event) -> bytes:
    return sse({"error": error_object(e.status, _openai_names(e.error))})


class TokenText:
    """Token strings and bytes for the logprobs shapes: a token that is not whole UTF-8 by
    itself is written "bytes:\\xNN..." (as OpenAI does); `bytes` are always the raw bytes."""

    def __init__(self, model) -> None:
        self.model = model

    def _entry(self, token: int, logprob: float | None) -> dict[str, Any]:
        raw = self.model.token_bytes[token] if token < len(self.model.token_bytes) else b""
        return {"token": _token_string(raw), "logprob": logprob, "bytes": list(raw)}

    def chat_logprobs(self, entries: list, tops: list) -> list[dict[str, Any]]:
        return [
            {**self._entry(token, logprob), "top_logprobs": [self._entry(t, lp) for lp, t in (top or [])]}
            for (logprob, token), top in zip(entries, tops)
        ]

    def completion_logprobs(self, entries: list, tops: list, offset: int = 0) -> dict[str, Any]:
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        for (logprob, token), top in zip(entries, tops):
            text = self._entry(token, logprob)["token"]
            tokens.append(text)
            token_logprobs.append(logprob)
            top_logprobs.append({self._entry(t, lp)["token"]: lp for lp, t in top} if top else None)
            offsets.append(offset)
            offset += len(text)
        return {
            "tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets,
        }  # fmt: skip


def _token_string(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
