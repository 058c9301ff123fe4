"""Anthropic Messages request bodies as strict pydantic models (like openai/schemas.py): an
unknown field is a 400 that names it. Fields that change nothing here (`cache_control`,
`citations`, `metadata`, `service_tier`) are accepted and ignored."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from spruce.runtime.server.openai.schemas import StrictModel


class TextBlock(StrictModel):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None
    citations: list[dict[str, Any]] | None = None


class ImageBlock(BaseModel):
    """Images and documents are parsed only to be refused with a 400 naming the block."""

    model_config = ConfigDict(extra="allow")
    type: Literal["image", "document"]


class ToolUseBlock(StrictModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(StrictModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Annotated[TextBlock | ImageBlock, Field(discriminator="type")]] = ""
    is_error: bool = False
    cache_control: dict[str, Any] | None = None


class ThinkingBlock(StrictModel):
    """An earlier answer's thinking, passed back: it reaches the template as the
    assistant's reasoning_content. The signature is not checked (this server signs nothing)."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(StrictModel):
    type: Literal["redacted_thinking"]
    data: str


Block = Annotated[
    TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]


class Message(StrictModel):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(StrictModel):
    """A client tool (Anthropic's server tools, with other types, are not served here)."""

    type: Literal["custom"] | None = None
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any]
    strict: bool | None = None
    cache_control: dict[str, Any] | None = None


class ToolChoice(StrictModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Thinking(StrictModel):
    """Extended thinking on or off: the template's `enable_thinking` (as Qwen3's and
    others' read it); `budget_tokens` is the thinking budget the runtime enforces (the chat
    path's thinking_token_budget)."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None
    display: Literal["summarized", "omitted"] | None = None


class JsonOutputFormat(StrictModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(StrictModel):
    format: JsonOutputFormat | None = None
    effort: str | None = None  # accepted; nothing to trade here


class CountTokensRequest(StrictModel):
    """The prompt of a message: what /v1/messages/count_tokens counts."""

    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    output_format: JsonOutputFormat | None = None  # the structured-outputs beta's name


class MessagesRequest(CountTokensRequest):
    max_tokens: int  # required, as Anthropic requires it
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
