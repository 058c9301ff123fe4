"""OpenAI requests -> validated requests: sampling maps onto the one `SamplingParams`
(OpenAI's names, and any SamplingParams field by its own name as an extension);
`response_format`, vLLM's structured-output fields and tool calls become its one
constraint, enforced by the constrained decoder; a call's prompts, n and options map onto
a `Draft` that the one validator checks (core.validation via ModelContext.validate), with
OpenAI's spelling of the fields for its messages and `param`."""

from __future__ import annotations

from typing import Any

from spruce.constrained.spec import too_many_constraints
from spruce.runtime.core.options import RequestOptions
from spruce.runtime.core.sampling_params import CONSTRAINT_FIELDS, SamplingParams
from spruce.runtime.core.validation import Draft, ValidCall, ValidRequest, sampling_from
from spruce.runtime.errors import ConstraintError, FieldNames, InvalidRequestError
from spruce.runtime.server.http.common import ApiError, ServerState
from spruce.runtime.server.openai.schemas import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    ChatRequest,
    CompletionRequest,
    ResponseFormat,
    SamplingRequest,
)  # fmt: skip
from spruce.runtime.server.openai.tool_tags import ANY_OBJECT
from spruce.runtime.server.openai.vllm_fields import vllm_constraints

# The canonical fields as OpenAI's two routes spell them (others keep their names).
COMPLETION_NAMES = FieldNames({
    "max_new_tokens": "max_tokens", "top_logprobs_num": "logprobs", "return_logprob": "logprobs",
    "logprob_start_len": "echo", "text": "prompt", "input_ids": "prompt",
})  # fmt: skip
CHAT_NAMES = FieldNames({
    "max_new_tokens": "max_tokens", "top_logprobs_num": "top_logprobs", "return_logprob": "logprobs",
    "text": "messages", "input_ids": "messages", "prompt": "messages",
})  # fmt: skip


def names_of(req: SamplingRequest) -> FieldNames:
    """How this request spells the fields (a chat request's max_completion_tokens, if given)."""
    if not isinstance(req, ChatRequest):
        return COMPLETION_NAMES
    if req.max_completion_tokens is None:
        return CHAT_NAMES
    return FieldNames({**CHAT_NAMES.spelling, "max_new_tokens": "max_completion_tokens"})


def check_model(server: ServerState, name: str) -> None:
    if name not in (server.model.name, server.model.path):
        raise ApiError(
            404, f"the model {name!r} does not exist; this server serves {server.model.name!r}",
            param="model", code="model_not_found",
        )  # fmt: skip


def sampling_params(
    req: SamplingRequest, max_new_tokens: int, tool_constraint: dict | None = None
) -> SamplingParams:
    """The request's SamplingParams (checked with the rest of the request by `choices`)."""
    fields = req.extensions()
    fields["max_new_tokens"] = max_new_tokens
    for name in ("temperature", "top_p", "seed", "frequency_penalty", "presence_penalty"):
        if getattr(req, name) is not None:
            fields[name] = getattr(req, name)
    if req.stop is not None:
        fields["stop"] = req.stop
    add_constraint(fields, req, tool_constraint)
    try:
        return sampling_from(fields, names_of(req))
    except InvalidRequestError as e:
        raise request_error(e, req) from None


def add_constraint(fields: dict, req: SamplingRequest, tool_constraint: dict | None) -> None:
    """The request's one output constraint into `fields`; more than one is a 400.
    tool_constraint: {"regex": ...}, {"json_schema": ...} or {"lark": ...} (see ToolPlan)."""
    sources = constraint_sources(fields, req, tool_constraint)
    if len(sources) > 1:
        names = [name for name, _ in sources]
        raise ApiError(400, too_many_constraints(names), param=names[1])
    for _, constraint in sources:
        fields.update(constraint)


def constraint_sources(
    fields: dict, req: SamplingRequest, tool_constraint: dict | None = None
) -> list[tuple[str, dict]]:
    """Each output constraint the request gives: (the name the request gave it by,
    {SamplingParams field: value}). The guided_* fields are taken out of `fields`."""
    sources = [
        (name, {name: fields[name]}) for name in CONSTRAINT_FIELDS if fields.get(name) is not None
    ]
    sources += vllm_constraints(fields, req.structured_outputs)
    fmt = req.response_format
    if fmt is not None and fmt.type != "text":
        sources.append(("response_format", format_constraint(fmt)))
    if tool_constraint is not None:
        sources.append(("tool_choice", tool_constraint))
    return sources


def format_constraint(fmt: ResponseFormat) -> dict:
    if fmt.type == "json_object":
        return {"json_schema": ANY_OBJECT}
    if fmt.type == "structural_tag":
        return {"structural_tag": fmt.structural_tag()}
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        message = 'response_format json_schema needs {"json_schema": {"schema": {...}}}'
        raise ApiError(400, message, param="response_format")
    return {"json_schema": fmt.json_schema.schema_}


def request_error(e: InvalidRequestError, req: SamplingRequest) -> ApiError:
    """A 400 for a request the runtime refused; its message names the field as OpenAI does
    already (`names_of`), and so does `param`. A bad constraint names the field the request
    gave it by (`structured_outputs.grammar: 1(7): ...`, param too)."""
    message, names = str(e), names_of(req)
    sources = constraint_sources(req.extensions(), req) if isinstance(e, ConstraintError) else []
    if len(sources) != 1:
        return ApiError(400, message, param=None if e.field is None else names(e.field))
    name, given = sources[0]
    field = next(iter(given))
    if (
        message.startswith((f"{field}:", f"{field}.")) and name != field
    ):  # `structural_tag.format...` too
        message = name + message[len(field) :]
    return ApiError(400, message, param=name)


async def completion_requests(
    server: ServerState, req: CompletionRequest
) -> tuple[list[ValidRequest], list[list[int]]]:
    """(the validated requests: n per prompt, prompt-major; each prompt's token ids)."""
    max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    logprobs = req.logprobs is not None
    options = RequestOptions(
        return_logprob=logprobs, logprob_start_len=0 if req.echo and logprobs else -1,
        top_logprobs_num=req.logprobs or 0, stream=req.stream, timeout_s=req.timeout_s,
    )  # fmt: skip
    text, ids = prompt_fields(req.prompt)
    draft = Draft(text, ids, sampling_params(req, max_tokens), req.n, options)
    call = await validated(server, draft, req)
    return call.requests, [r.input_ids for r in call.requests[:: req.n]]


def prompt_fields(prompt: Any) -> tuple[Any, Any]:
    """OpenAI's prompt (a string, strings, token ids or lists of them) as (text, input_ids)."""
    if isinstance(prompt, str) or all(isinstance(p, str) for p in prompt):
        return prompt, None
    return None, prompt


async def chat_requests(
    server: ServerState, ids: list[int], base: SamplingParams, req: ChatRequest, top: int
) -> list[ValidRequest]:
    """The `n` validated requests of a rendered chat prompt (seeds s, s + 1, ... when a
    seed s is given)."""
    options = RequestOptions(
        return_logprob=req.logprobs, top_logprobs_num=top, stream=req.stream,
        timeout_s=req.timeout_s,
    )  # fmt: skip
    call = await validated(
        server, Draft(input_ids=ids, sampling=base, n=req.n, options=options), req
    )
    return call.requests


async def validated(server: ServerState, draft: Draft, req: SamplingRequest) -> ValidCall:
    """The call checked by the one validator, its errors as OpenAI 400s (`request_error`)."""
    try:
        return await server.model.validate(draft, names_of(req))
    except InvalidRequestError as e:
        raise request_error(e, req) from None


def chat_top_logprobs(req: ChatRequest) -> int:
    """top_logprobs, which needs logprobs: true (its range: the validator's)."""
    if req.top_logprobs is None:
        return 0
    if not req.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    return req.top_logprobs
