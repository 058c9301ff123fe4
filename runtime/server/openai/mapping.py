"""OpenAI requests -> validated requests: sampling maps onto the one `SamplingParams`
(OpenAI's names, and any SamplingParams field by its own name as an extension);
`response_format`, vLLM's structured-output fields and tool calls become its one
constraint, enforced by the constrained decoder; every choice is validated once
(core.validation via ModelContext.prepare)."""

from __future__ import annotations

from typing import Any

from spruce.runtime.core.options import RequestOptions
from spruce.runtime.core.sampling_params import CONSTRAINT_FIELDS, SamplingParams
from spruce.runtime.core.validation import ValidRequest, check_batch_size, sampling_from
from spruce.runtime.errors import ConstraintError, InvalidRequestError
from spruce.runtime.server.http.common import ApiError, ServerState
from spruce.runtime.server.openai.schemas import (
    MAX_TOP_LOGPROBS,
    ChatRequest,
    ResponseFormat,
    SamplingRequest,
)  # fmt: skip
from spruce.runtime.server.openai.tool_tags import ANY_OBJECT
from spruce.runtime.server.openai.vllm_fields import vllm_constraints


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
        return sampling_from(fields)
    except InvalidRequestError as e:
        raise request_error(e, req) from None


def add_constraint(fields: dict, req: SamplingRequest, tool_constraint: dict | None) -> None:
    """The request's one output constraint into `fields`; more than one is a 400.
    tool_constraint: {"regex": ...}, {"json_schema": ...} or {"lark": ...} (see ToolPlan)."""
    sources = constraint_sources(fields, req, tool_constraint)
    if len(sources) > 1:
        names = [name for name, _ in sources]
        raise ApiError(
            400, f"give at most one output constraint; got {', '.join(names)}", param=names[1]
        )
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
    """A 400 for a request the runtime refused; a bad constraint names the field the
    request gave it by (`structured_outputs.grammar: 1(7): ...`, param too)."""
    message = openai_names(str(e))
    sources = constraint_sources(req.extensions(), req) if isinstance(e, ConstraintError) else []
    if len(sources) != 1:
        return ApiError(400, message)
    name, given = sources[0]
    field = next(iter(given))
    if (
        message.startswith((f"{field}:", f"{field}.")) and name != field
    ):  # `structural_tag.format...` too
        message = name + message[len(field) :]
    return ApiError(400, message, param=name)


async def choices(
    server: ServerState, ids: list[int], base: SamplingParams, req: SamplingRequest, logprobs: bool, top: int,
    echo: bool = False,
) -> list[ValidRequest]:  # fmt: skip
    """The `n` validated requests of one prompt (seeds n, n+1, ... when a seed is given)."""
    check_n(server, req.n)
    options = RequestOptions(
        return_logprob=logprobs, logprob_start_len=0 if echo and logprobs else -1, top_logprobs_num=top,
        stream=req.stream, timeout_s=req.timeout_s,
    )  # fmt: skip
    seeded = [
        base if base.seed is None or i == 0 else base.replace(seed=base.seed + i)
        for i in range(req.n)
    ]
    try:
        return await server.model.prepare_all([(ids, sampling) for sampling in seeded], options)
    except InvalidRequestError as e:
        raise request_error(e, req) from None


def check_n(server: ServerState, n: int) -> None:
    most = server.model.limits.request.max_n
    if not 1 <= n <= most:
        raise ApiError(400, f"n must be between 1 and {most}", param="n")


def openai_names(message: str) -> str:
    return message.replace("max_new_tokens", "max_tokens")


def completion_top_logprobs(logprobs: int | None) -> int:
    if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        raise ApiError(400, f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}", param="logprobs")
    return logprobs or 0


def chat_top_logprobs(req: ChatRequest) -> int:
    if req.top_logprobs is None:
        return 0
    if not req.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
        raise ApiError(
            400, f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}", param="top_logprobs"
        )
    return req.top_logprobs


def completion_prompts(prompt: Any, server: ServerState, n: int = 1) -> list[list[int]]:
    """The prompts' token ids; prompts x n must fit --max-batch-size."""
    if isinstance(prompt, str):
        prompts: list = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts:
        raise ApiError(400, "prompt must not be empty", param="prompt")
    check_n(server, n)
    try:
        check_batch_size(len(prompts) * n, server.model.limits.request)
    except InvalidRequestError as e:
        raise ApiError(400, str(e), param="prompt") from None
    tokenizer = server.model.tokenizer
    return [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
