"""Reasoning output: the `<think>...</think>` block some models (Qwen3, DeepSeek-R1) write
before their answer, split from it (whole or while streaming), and the constraint (a regex,
or a Lark grammar for constraints that are not regular) that lets such a model think freely
before a constrained answer.

A format is chosen by name (`REASONING_FORMATS`, the server's --reasoning-parser) or found
in a chat template that writes the tags (`detect_reasoning`). Whether the output starts
inside the block is decided from the rendered prompt: a prompt that ends in an open
`<think>` (DeepSeek-R1's template always, Qwen3 thinking variants) leaves the model
thinking; Qwen3's `enable_thinking: false` closes the block in the prompt, so the output is
all answer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from spruce.constrained.core.patterns import escape_literal
from spruce.runtime.text.stop import stop_prefix_len

THINK_SEPARATOR = r"[ \t\r\n]{0,4}"  # between `</think>` and a constrained answer


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    """`starts_open`: the output is reasoning from its first token even when the prompt does
    not end with the opening tag (DeepSeek-R1 models often omit it)."""

    name: str
    open_tag: str = "<think>"
    close_tag: str = "</think>"
    starts_open: bool = False

    def starts_inside(self, prompt: str) -> bool:
        """Whether output after `prompt` begins inside the reasoning block."""
        if self.starts_open:
            return True
        tail = prompt.rstrip()
        return tail.endswith(self.open_tag)

    def closed_in_prompt(self, prompt: str) -> bool:
        """Whether the prompt ends with a closed block (Qwen3's `enable_thinking: false`):
        the model answers without thinking."""
        return not self.starts_open and prompt.rstrip().endswith(self.close_tag)

    def split(self, text: str, inside: bool) -> tuple[str | None, str]:
        """(reasoning or None when there is no block, content) of a finished output."""
        return self._visible(text, inside, final=True)

    def stream(self, inside: bool) -> ReasoningStream:
        return ReasoningStream(self, inside)

    def constraint_regex(self, answer_regex: str, inside: bool) -> str:
        """A regex for reasoning text (anything but the closing tag) then the constrained
        answer; the block is optional when the output does not start inside it."""
        block = (
            f"{text_without_regex(self.close_tag)}{escape_literal(self.close_tag)}{THINK_SEPARATOR}"
        )
        if inside or self.starts_open:
            return f"(?:{escape_literal(self.open_tag)})?{block}(?:{answer_regex})"
        return f"(?:{escape_literal(self.open_tag)}{block})?(?:{answer_regex})"

    def constraint_lark(self, answer: str, inside: bool) -> str:
        """A Lark grammar (llguidance's dialect) for reasoning text then the constrained
        answer, for constraints that are not regular: the reasoning is one lazy lexeme that
        ends at the first closing tag, then up to 4 whitespace characters, then `answer`, a
        Lark expression (`backends.llguidance_text.nested_lark`: `%json {...}` or `%lark {...}`). The
        block is optional when the output does not start inside it."""
        block = "think SEPARATOR?"
        start = f"OPEN? {block} answer" if inside or self.starts_open else f"(OPEN {block})? answer"
        return (
            f"start: {start}\n"
            f"OPEN: {json.dumps(self.open_tag)}\n"
            "SEPARATOR: /[ \\t\\r\\n]{1,4}/\n"
            f"think[lazy]: /(?s:.*){lark_regex_literal(self.close_tag)}/\n"
            f"answer: {answer}\n"
        )

    def _visible(self, text: str, inside: bool, final: bool) -> tuple[str | None, str]:
        """What can be shown of `text` so far; each part only grows as text is added."""
        inside = inside or self.starts_open
        body = text
        if not inside:
            head = text.lstrip()
            if not final and self.open_tag.startswith(head):
                return None, ""  # maybe the start of the opening tag: wait
            if not head.startswith(self.open_tag):
                return None, text
            body = head[len(self.open_tag) :]
        elif not final and self.open_tag.startswith(body.lstrip()):
            return "", ""  # maybe the opening tag again (some models repeat it): wait
        elif body.lstrip().startswith(self.open_tag):
            body = body.lstrip()[len(self.open_tag) :]
        end = body.find(self.close_tag)
        if end < 0:
            reasoning = body.lstrip()
            if not final:
                reasoning = reasoning[
                    : len(reasoning) - stop_prefix_len(reasoning, (self.close_tag,))
                ]
            return reasoning.rstrip(), ""
        return body[:end].strip(), body[end + len(self.close_tag) :].lstrip()


class ReasoningStream:
    """Splits streamed text: `feed(delta)` -> (reasoning delta, content delta), holding back
    what may be the start of a tag; `finish()` gives what is left. The deltas add up to
    `ReasoningFormat.split` of the whole text."""

    def __init__(self, fmt: ReasoningFormat, inside: bool) -> None:
        self.fmt = fmt
        self.inside = inside
        self.text = ""
        self.sent_reasoning = 0
        self.sent_content = 0

    def feed(self, delta: str) -> tuple[str, str]:
        self.text += delta
        return self._new(final=False)

    def finish(self) -> tuple[str, str]:
        return self._new(final=True)

    def _new(self, final: bool) -> tuple[str, str]:
        reasoning, content = self.fmt._visible(self.text, self.inside, final)
        reasoning = reasoning or ""
        out = reasoning[self.sent_reasoning :], content[self.sent_content :]
        self.sent_reasoning, self.sent_content = len(reasoning), len(content)
        return out


REASONING_FORMATS = {
    "qwen3": ReasoningFormat("qwen3"),
    "deepseek-r1": ReasoningFormat("deepseek-r1", starts_open=True),
}
AUTO, NONE = "auto", "none"


def reasoning_format(name: str, chat_template: str | None) -> ReasoningFormat | None:
    """The format named by --reasoning-parser: "none", "auto" (from the chat template) or
    one of REASONING_FORMATS; an unknown name is a ValueError listing the known ones."""
    if name == NONE:
        return None
    if name == AUTO:
        return detect_reasoning(chat_template)
    if name not in REASONING_FORMATS:
        known = ", ".join([AUTO, NONE, *REASONING_FORMATS])
        raise ValueError(f"unknown reasoning parser {name!r}; known: {known}")
    return REASONING_FORMATS[name]


def detect_reasoning(chat_template: str | None) -> ReasoningFormat | None:
    """A template that writes both tags: its model thinks in them. The Qwen3 format covers
    DeepSeek-R1's template too (its prompt ends in an open `<think>`)."""
    template = chat_template or ""
    fmt = REASONING_FORMATS["qwen3"]
    return fmt if fmt.open_tag in template and fmt.close_tag in template else None


def text_without_regex(word: str) -> str:
    """A regex for any text (newlines included) that does not contain `word`; `word`'s first
    character must not occur again in it (true of closing tags like `</think>`)."""
    first, rest = word[0], word[1:]
    assert first not in rest, word
    c = escape_literal(first)

    def other(*chars: str) -> str:
        return "[^" + "".join(_class_char(ch) for ch in chars) + "]"

    partials = "|".join(
        escape_literal(rest[:k]) for k in range(1, len(rest))
    )  # matched after `first`
    partial = f"(?:{partials})?" if partials else ""
    fails = "|".join(escape_literal(rest[:k]) + other(first, rest[k]) for k in range(len(rest)))
    loop = f"(?:{partial}{c})*"
    tail = f"(?:{c}{loop}{partial})?"
    return f"(?:{other(first)}|{c}{loop}(?:{fails}))*{tail}"


def lark_regex_literal(text: str) -> str:
    """`text` as a literal inside a Lark `/regex/` (Rust regex syntax: only its meta
    characters are escaped, since `\\<` means a word start there)."""
    return "".join("\\" + ch if ch in _RUST_REGEX_META else ch for ch in text)


_RUST_REGEX_META = set("\\.+*?()|[]{}^$#&-~/")


def _class_char(ch: str) -> str:
    return "\\" + ch if ch in "\\]^-[" else ch
