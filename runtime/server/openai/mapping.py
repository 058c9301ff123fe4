"""OpenAI requests -> validated requests: sampling maps onto the one `SamplingParams`
(OpenAI's names, and any SamplingParams field by its own name as an extension);
`response_format` and tool calls become its json_schema, enforced by the constrained
decoder; every choice is validated once (core.validation via ModelContext.prepare)."""

from __future__ import annotations

from typing import Any

from spruce.runtime.core.options import RequestOptions
from spruce.runtime.core.sampling_params import SamplingParams
from spruce.runtime.core.validation import ValidRequest, check_batch_size, sampling_from
from spruce.runtime.errors import InvalidRequestError
from spruce.runtime.server.http.common import ApiError, ServerState
from spruce.runtime.server.openai.tool_parsers import ANY_OBJECT
from spruce.runtime.server.openai.schemas import (
    MAX_TOP_LOGPROBS,
    ChatRequest,
    ResponseFormat,
    SamplingRequest,
)  # fmt: skip


def check_model(server: ServerState, name: str) -> None:
    if name not in (server.model.name, server.model.path):
        raise ApiError(
            404, f"the model {name!r} does not exist; this server serves {server.model.name!r}",
            param="model", code="model_not_found",
        )  # fmt: skip


def sampling_params(req: SamplingRequest, max_new_tokens: int, tool_constraint: dict | None = None) -> SamplingParams:
    """The request's SamplingParams (checked with the rest of the request by `choices`)."""
    fields = req.extensions()
    fields["max_new_tokens"] = max_new_tokens
    for name in ("temperature", "top_p", "seed", "frequency_penalty", "presence_penalty"):
        if getattr(req, name) is not None:
            fields[name] = getattr(req, name)
    if req.stop is not None:
        fields["stop"] = req.stop
    add_constraint(fields, req.response_format, tool_constraint)
    try:
        return sampling_from(fields)
    except InvalidRequestError as e:
        raise ApiError(400, openai_names(str(e))) from None


def add_constraint(fields: dict, fmt: ResponseFormat | None, tool_constraint: dict | None) -> None:
    """tool_constraint: {"regex": ...} or {"json_schema": ...} (see ToolPlan)."""
    given = [k for k in ("regex", "json_schema", "choices") if fields.get(k) is not None]
    if fmt is not None and fmt.type != "text":
        given.append("response_format")
        if fmt.type == "json_object":
            fields["json_schema"] = ANY_OBJECT
        elif fmt.json_schema is None or fmt.json_schema.schema_ is None:
            message = 'response_format json_schema needs {"json_schema": {"schema": {...}}}'
            raise ApiError(400, message, param="response_format")
        else:
            fields["json_schema"] = fmt.json_schema.schema_
    if tool_constraint is not None:
        given.append("tool_choice")
        fields.update(tool_constraint)
    if len(given) > 1:
        raise ApiError(400, f"give at most one output constraint; got {', '.join(given)}")


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
    seeded = [base if base.seed is None or i == 0 else base.replace(seed=base.seed + i) for i in range(req.n)]
    try:
        return await server.model.prepare_all([(ids, sampling) for sampling in seeded], options)
    except InvalidRequestError as e:
        raise ApiError(400, openai_names(str(e))) from None


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
        raise ApiError(400, f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}", param="top_logprobs")
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
