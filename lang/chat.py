"""Role blocks rendered by the model's own chat template (served by the runtime in
model_info), so any model with a template works and no template is hard-coded here.

A program's text is raw text plus, from the first role block on, the template's rendering of
the messages so far (a *chat segment*). While a block is open the text ends with:
  - assistant: the rendering of the closed messages with add_generation_prompt=True, then
    the block's content so far: a gen() there sees exactly what the template gives a model
    that is asked to answer;
  - other roles: the rendering of the messages plus this one, cut where its content goes.
When a block closes, the segment becomes the rendering of the closed messages. Raw text
appended outside any block after a segment ends it; a later block starts a new segment.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import jinja2

from spruce.lang.errors import ProgramError

# Stands for an open message's content, to find where the template puts the content.
_CONTENT_MARK = "\x00spruce-content\x00"


class ChatTemplate:
    """The model's Jinja chat template (rendered with the runtime's sandboxed settings)."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        # The runtime's compiled-template cache and sandbox: one set of Jinja settings.
        from spruce.runtime.text.tokenizer import compile_chat_template

        self.source = source
        self._template = compile_chat_template(source)
        self.bos_token = bos_token
        self.eos_token = eos_token

    @classmethod
    def from_model_info(cls, info: dict[str, Any]) -> ChatTemplate | None:
        source = info.get("chat_template")
        if not source:
            return None
        return cls(source, info.get("bos_token") or "", info.get("eos_token") or "")

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except jinja2.TemplateError as e:
            roles = [m["role"] for m in messages]
            raise ProgramError(
                f"the model's chat template refused the messages (roles {roles}): {e}"
            ) from None

    def open_text(self, messages: list[dict[str, str]], role: str) -> str:
        """The text up to where an open `role` message's content goes, after `messages`."""
        if role == "assistant":
            return self.render(messages, add_generation_prompt=True)
        full = self.render(
            [*messages, {"role": role, "content": _CONTENT_MARK}], add_generation_prompt=False
        )
        cut = full.find(_CONTENT_MARK)
        return full[:cut] if cut >= 0 else self.render(messages, add_generation_prompt=False)


@dataclass
class Conversation:
    """The role bookkeeping of one program state. Each method takes the state's text and
    returns its new text."""

    messages: list[dict[str, str]] = field(default_factory=list)  # every closed message
    segment: list[dict[str, str]] = field(default_factory=list)  # closed messages of this segment
    segment_start: int | None = None  # where the segment's rendering starts in the text
    open_role: str | None = None
    open_content: str = ""

    def begin(self, text: str, role: str, template: ChatTemplate | None) -> str:
        if template is None:
            raise ProgramError(
                "this model has no chat template, and role blocks (sl.system / sl.user / "
                "sl.assistant) are rendered by it; append plain text instead"
            )
        if self.open_role is not None:
            raise ProgramError(
                f"cannot begin a {role} block inside the open {self.open_role} block; end it first"
            )
        if self.segment_start is None:
            self.segment_start, self.segment = len(text), []
        self.open_role, self.open_content = role, ""
        return text[: self.segment_start] + template.open_text(self.segment, role)

    def end(self, text: str, role: str, template: ChatTemplate | None) -> str:
        if self.open_role != role:
            now = f"the open block is {self.open_role}" if self.open_role else "no block is open"
            raise ProgramError(f"cannot end a {role} block: {now}")
        message = {"role": role, "content": self.open_content}
        self.segment.append(message)
        self.messages.append(message)
        self.open_role, self.open_content = None, ""
        assert template is not None and self.segment_start is not None
        return text[: self.segment_start] + template.render(
            self.segment, add_generation_prompt=False
        )

    def add_text(self, value: str) -> None:
        if self.open_role is not None:
            self.open_content += value
        elif self.segment_start is not None:
            self.segment_start = None  # raw text after the chat: the next block starts anew

    def copy(self) -> Conversation:
        return copy.deepcopy(self)
