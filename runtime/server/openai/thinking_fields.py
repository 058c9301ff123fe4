"""A chat request's thinking controls, for every API that chats (chat completions, Responses,
Anthropic Messages map onto the ChatRequest):

- a thinking budget: `thinking_token_budget` (vLLM's name) or `max_thinking_tokens`, else
  the server's --reasoning-budget (-1: none), else `reasoning_effort`'s default below. It
  becomes SamplingParams.thinking_budget with the reasoning format's markers
  (`ReasoningFormat.budget_fields`): once the block holds that many tokens the runtime
  writes --reasoning-budget-message (if any) and the end marker, and the answer starts. It
  applies only when the server has a reasoning format and the prompt leaves the model
  thinking; 0 turns thinking off through the template's switch (as "none" does; a template
  without one gets a budget of 1).
- `reasoning_effort` ("none" | "minimal" | "low" | "medium" | "high") reaches the chat
  template as `reasoning_effort` (gpt-oss's reads it); where the template does not read it,
  it maps to a budget (EFFORT_BUDGETS). "none" turns thinking off where the template has a
  switch (`enable_thinking` / `thinking` false).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from spruce.runtime.core.sampling_params import SamplingParams
from spruce.runtime.server.http.common import ApiError
from spruce.runtime.text.reasoning import thinking_off

if TYPE_CHECKING:
    from spruce.runtime.config import ServerOptions
    from spruce.runtime.server.openai.chat_prompt import ChatPrompt, ToolPlan
    from spruce.runtime.server.openai.schemas import ChatRequest

# reasoning_effort -> thinking tokens when the template does not read reasoning_effort
# (None: unlimited; "none": thinking off)
EFFORT_BUDGETS: dict[str, int | None] = {"minimal": 128, "low": 512, "medium": 2048, "high": None}
BUDGET_FIELDS = ("thinking_token_budget", "max_thinking_tokens")


def request_budget(req: ChatRequest) -> int | None:
    """The request's own budget (-1: unlimited, overriding the server's), or None."""
    given = [(name, getattr(req, name)) for name in BUDGET_FIELDS if getattr(req, name) is not None]
    if len({value for _, value in given}) > 1:
        raise ApiError(400, "give thinking_token_budget or max_thinking_tokens, not both",
                       param=given[1][0])  # fmt: skip
    for name, value in given:
        if value < -1:
            raise ApiError(400, f"{name} must be -1 (unlimited) or more", param=name)
    return given[0][1] if given else (req.model_extra or {}).get("thinking_budget")


def thinking_budget(req: ChatRequest, options: ServerOptions, template: str | None) -> int | None:
    """The budget this request thinks under (None or -1: unlimited)."""
    budget = request_budget(req)
    if budget is None and options.reasoning_budget >= 0:
        budget = options.reasoning_budget
    effort = req.reasoning_effort
    if budget is None and effort is not None and "reasoning_effort" not in (template or ""):
        budget = EFFORT_BUDGETS.get(effort)
    return budget


def template_thinking(
    req: ChatRequest, options: ServerOptions, template: str | None
) -> dict[str, Any]:
    """Template variables: `reasoning_effort` as given, and thinking off (the template's
    switches false) for effort "none" or a budget of 0."""
    out: dict[str, Any] = {}
    if req.reasoning_effort is not None:
        out["reasoning_effort"] = req.reasoning_effort
    if req.reasoning_effort == "none" or thinking_budget(req, options, template) == 0:
        out.update(thinking_off(template))
    return out


def with_thinking(
    sampling: SamplingParams, req: ChatRequest, prompt: ChatPrompt, tools: ToolPlan,
    options: ServerOptions, template: str | None,
) -> SamplingParams:  # fmt: skip
    """`sampling` with the thinking budget in the prompt's reasoning format, and special
    tokens kept where the reasoning or tool-call format writes its markers as such (unless
    the request says otherwise)."""
    extra = req.model_extra or {}
    changes: dict[str, Any] = {}
    reasoning = prompt.reasoning
    special = (reasoning is not None and reasoning.special_tokens) or (
        tools.parses_calls and tools.format.special_tokens
    )
    if special and "skip_special_tokens" not in extra:
        changes["skip_special_tokens"] = False
    budget = thinking_budget(req, options, template)
    if reasoning is not None and not {"thinking_open", "thinking_close"} & set(extra):
        if budget is None or budget < 0:
            changes["thinking_budget"] = None
        else:
            message = options.reasoning_budget_message
            changes.update(reasoning.budget_fields(max(budget, 1), prompt.thinking, message))
    return sampling.replace(**changes) if changes else sampling
