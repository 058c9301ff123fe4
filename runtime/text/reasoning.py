"""Reasoning output: the block a reasoning model writes before its answer (`<think>...
</think>` for Qwen3, DeepSeek-R1, GLM-4.5, MiniMax-M2, Kimi-K2; `[THINK]...[/THINK]` for
Magistral; `◁think▷...◁/think▷` for Kimi-VL; gpt-oss's harmony analysis channel), split from
it (whole or while streaming), the constraint (a regex, or a Lark grammar for constraints that are not
regular) that lets such a model think freely before a constrained answer, and the thinking
budget's markers (`budget_fields`: the runtime closes the block itself once it is spent).

A format is chosen by name (`REASONING_FORMATS`, the server's --reasoning-parser, plugins
by --reasoning-parser-plugin) or found in a chat template that writes its markers
(`detect_reasoning`). Whether the output starts inside the block is decided from the
rendered prompt: a prompt that ends in an open `<think>` (DeepSeek-R1's template always,
Qwen3 thinking variants) leaves the model thinking; Qwen3's `enable_thinking: false` closes
the block in the prompt, so the output is all answer.
"""

from __future__ import annotations

import importlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

from spruce.constrained.core.patterns import escape_literal
from spruce.runtime.text import harmony
from spruce.runtime.text.stop import stop_prefix_len
from spruce.runtime.text.tokenizer import split_specials

EMPTY: Mapping[str, int] = MappingProxyType({})
THINK_SEPARATOR = r"[ \t\r\n]{0,4}"  # between `</think>` and a constrained answer


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    """`starts_open`: the output is reasoning from its first token even when the prompt does
    not end with the opening tag (DeepSeek-R1 models often omit it). `markers`: what a chat
    template of the family writes (`detect_reasoning`; none: never detected). `special_tokens`:
    the tags are special tokens, so the output is decoded with special tokens kept."""

    name: str
    open_tag: str = "<think>"
    close_tag: str = "</think>"
    starts_open: bool = False
    markers: tuple[str, ...] = ()
    special_tokens: bool = False
    # markers that end the block without its closing tag and start the answer (Kimi-K2 may
    # go from thinking straight to its tool-call section)
    implicit_ends: tuple[str, ...] = ()

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

    def for_calls(self) -> ReasoningFormat:
        """The format when the constrained answer is tool calls in the model's own format
        (harmony writes those in another channel than the answer)."""
        return self

    def budget_fields(self, budget: int, inside: bool, message: str | None) -> dict[str, Any]:
        """SamplingParams' thinking fields for at most `budget` tokens of reasoning: the
        block starts at the first output token when the output starts inside it, else where
        the output opens it; once spent the runtime writes `message` (if any) then the end
        marker, after which the answer starts (as `constraint_regex` lets it)."""
        opens = None if inside or self.starts_open else self.open_tag
        return {"thinking_budget": budget, "thinking_open": opens,
                "thinking_close": (message or "") + self.close_tag}  # fmt: skip

    def constraint_regex(self, answer_regex: str, inside: bool) -> str:
        """A regex for reasoning text (anything but the closing tag) then the constrained
        answer; the block is optional when the output does not start inside it."""
        block = (
            f"{text_without_regex(self.close_tag)}{escape_literal(self.close_tag)}{THINK_SEPARATOR}"
        )
        if inside or self.starts_open:
            return f"(?:{escape_literal(self.open_tag)})?{block}(?:{answer_regex})"
        return f"(?:{escape_literal(self.open_tag)}{block})?(?:{answer_regex})"

    def constraint_lark(
        self, answer: str, inside: bool, specials: Mapping[str, int] = EMPTY
    ) -> str:
        """A Lark grammar (llguidance's dialect) for reasoning text then the constrained
        answer, for constraints that are not regular: the reasoning is one lazy lexeme that
        ends at the first closing tag, then up to 4 whitespace characters, then `answer`, a
        Lark expression (`backends.llguidance_text.nested_lark`: `%json {...}` or `%lark {...}`). The
        block is optional when the output does not start inside it. `specials`: the
        tokenizer's special tokens' texts; a tag that is one is matched as that token (the
        reasoning then ends at the token, which no text lexeme can take in)."""
        block = "think SEPARATOR?"
        start = f"OPEN? {block} answer" if inside or self.starts_open else f"(OPEN {block})? answer"
        opens, closes = (lark_literal(tag, specials) for tag in (self.open_tag, self.close_tag))
        tokens = opens != json.dumps(self.open_tag) or closes != json.dumps(self.close_tag)
        opening = "open" if tokens else "OPEN"  # a token reference makes it a rule
        think = f"think[lazy]: /(?s:.*){lark_regex_literal(self.close_tag)}/"
        if tokens:
            think = f"think: /(?s:.*)/ {closes}"
        return (
            f"start: {start.replace('OPEN', opening)}\n"
            f"{opening}: {opens}\n"
            "SEPARATOR: /[ \\t\\r\\n]{1,4}/\n"
            f"{think}\n"
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
        ends = (self.close_tag, *self.implicit_ends)
        found = [(body.find(m), m) for m in ends if m in body]
        if not found:
            reasoning = body.lstrip()
            if not final:
                reasoning = reasoning[: len(reasoning) - stop_prefix_len(reasoning, ends)]
            return reasoning.rstrip(), ""
        end, marker = min(found)
        answer = end + len(marker) if marker == self.close_tag else end  # an implicit end stays
        return body[:end].strip(), body[answer:].lstrip()


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


@dataclass(frozen=True, slots=True)
class HarmonyFormat(ReasoningFormat):
    """gpt-oss (harmony, see `text.harmony`): reasoning is the analysis channel's messages,
    content the final channel's text and the other messages (a tool call, a message with a
    recipient, stays whole for `tool_format_harmony`). The generation prompt ends in
    `<|start|>assistant`, so the output starts at a message header; `inside`: the prompt ends
    in an open analysis message. `answer_header` heads a constrained answer: the final
    channel, or nothing when the answer is tool calls (they write their own header)."""

    answer_header: str = harmony.FINAL

    def starts_inside(self, prompt: str) -> bool:
        return prompt.endswith(harmony.ANALYSIS)

    def closed_in_prompt(self, prompt: str) -> bool:
        return prompt.endswith(harmony.FINAL)

    def for_calls(self) -> ReasoningFormat:
        return replace(self, answer_header="")

    def budget_fields(self, budget: int, inside: bool, message: str | None) -> dict[str, Any]:
        close = (message or "") + harmony.NEXT + self.answer_header
        opens = None if inside else harmony.ANALYSIS
        return {"thinking_budget": budget, "thinking_open": opens, "thinking_close": close}

    def constraint_regex(self, answer_regex: str, inside: bool) -> str:
        """An analysis message (any text but `<|end|>`), then the answer's message."""
        block = f"{text_without_regex(harmony.END)}{escape_literal(harmony.NEXT)}"
        answer = f"{escape_literal(self.answer_header)}(?:{answer_regex})"
        if inside:
            return block + answer
        return f"(?:{escape_literal(harmony.ANALYSIS)}{block})?{answer}"

    def constraint_lark(
        self, answer: str, inside: bool, specials: Mapping[str, int] = EMPTY
    ) -> str:
        """An analysis message, then the answer's message; with harmony's markers among
        the tokenizer's special tokens they are matched as those tokens (rules, and the
        analysis text ends at the `<|end|>` token), else as text (terminals, and the text is
        one lazy lexeme up to `<|end|>`)."""
        special = harmony.END in specials
        name = str.lower if special else str.upper
        think = f"think[lazy]: /(?s:.*){lark_regex_literal(harmony.END)}/"
        if special:
            think = f"think: /(?s:.*)/ {lark_literal(harmony.END, specials)}"
        opens, after, head = name("open"), name("next"), name("head")
        heads = f" {head}" if self.answer_header else ""
        start = (
            f"think {after}{heads} answer" if inside else f"({opens} think {after})?{heads} answer"
        )
        lines = [
            f"start: {start}",
            f"{opens}: {lark_literal(harmony.ANALYSIS, specials)}",
            f"{after}: {lark_literal(harmony.START + 'assistant', specials)}",
            think,
            f"answer: {answer}",
        ]
        if self.answer_header:
            lines.insert(3, f"{head}: {lark_literal(self.answer_header, specials)}")
        return "\n".join(lines) + "\n"

    def _visible(self, text: str, inside: bool, final: bool) -> tuple[str | None, str]:
        reasoning: list[str] = []
        content: list[str] = []
        for m in harmony.messages(text, inside, final):
            if m.header is None:
                content.append(m.body)
            elif m.recipient is not None:
                content.append(m.raw)  # a tool call: whole, for the tool-call format
            elif m.channel == "analysis":
                reasoning.append(m.body)
            else:
                content.append(m.body)
        return ("\n".join(reasoning) if reasoning else None), "".join(content)


_THINK = ("<think>", "</think>")
REASONING_FORMATS: dict[str, ReasoningFormat] = {
    fmt.name: fmt
    for fmt in (
        ReasoningFormat("qwen3", markers=_THINK),
        ReasoningFormat("deepseek-r1", starts_open=True),  # auto: qwen3 reads its prompt
        ReasoningFormat("glm45", markers=(*_THINK, "[gMASK]")),
        ReasoningFormat("minimax", starts_open=True, markers=(*_THINK, "]~b]")),
        ReasoningFormat("kimi", "◁think▷", "◁/think▷", markers=("◁think▷", "◁/think▷")),
        ReasoningFormat("kimi_k2", markers=(*_THINK, "<|im_middle|>"), special_tokens=True,
                        implicit_ends=("<|tool_calls_section_begin|>",)),
        ReasoningFormat("mistral", "[THINK]", "[/THINK]", markers=("[THINK]", "[/THINK]"),
                        special_tokens=True),
        HarmonyFormat("gpt-oss", harmony.ANALYSIS, harmony.END, special_tokens=True,
                      markers=(harmony.CHANNEL, harmony.MESSAGE, "analysis")),
    )
}  # fmt: skip
AUTO, NONE = "auto", "none"
# Template variables that turn a family's thinking off (Qwen3, GLM: enable_thinking;
# DeepSeek-V3.1 and others: thinking), passed as false where the template reads them.
THINKING_SWITCHES = ("enable_thinking", "thinking")


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
    """The format all of whose markers the template writes; of several, the one with the
    most (GLM's and MiniMax's templates write `<think>` too, and their own role markers);
    the first registered of those. Qwen3's format covers DeepSeek-R1's template (its prompt
    ends in an open `<think>`)."""
    template = chat_template or ""
    found = [
        f for f in REASONING_FORMATS.values() if f.markers and all(m in template for m in f.markers)
    ]
    return max(found, key=lambda f: len(f.markers)) if found else None


def thinking_off(chat_template: str | None) -> dict[str, bool]:
    """The template variables that turn thinking off, as the template reads them."""
    template = chat_template or ""
    return {
        name: False
        for name in THINKING_SWITCHES
        if re.search(rf"(?<![\w.'\"]){name}(?![\w'\"(])", template)
    }


def register_plugin(spec: str) -> ReasoningFormat:
    """--reasoning-parser-plugin `module:Name`: a ReasoningFormat subclass (made with no
    arguments: its fields need defaults, `name` among them) or instance, registered under
    its `name` (replacing a built-in format of that name) so --reasoning-parser names it
    and "auto" finds it by its `markers`. A bad spec is a ValueError saying why."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"--reasoning-parser-plugin {spec!r}: expected module:Class")
    try:
        found = getattr(importlib.import_module(module_name), attribute)
        fmt = found() if isinstance(found, type) and issubclass(found, ReasoningFormat) else found
    except (ImportError, AttributeError, TypeError) as e:
        raise ValueError(f"--reasoning-parser-plugin {spec!r}: {e}") from None
    if not isinstance(fmt, ReasoningFormat):
        raise ValueError(f"--reasoning-parser-plugin {spec!r} is not a ReasoningFormat subclass")
    if not fmt.name or fmt.name in (AUTO, NONE):
        raise ValueError(f"--reasoning-parser-plugin {spec!r}: the format needs a `name`")
    REASONING_FORMATS[fmt.name] = fmt
    return fmt


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


def lark_literal(text: str, specials: Mapping[str, int] = EMPTY) -> str:
    """`text` as a Lark expression: quoted, each special token's text in it (`specials`:
    text -> id) written as a reference to that token by id (llguidance matches a special
    token only so)."""
    pieces = split_specials(text, specials) or [text]
    return " ".join(f"<[{specials[p]}]>" if p in specials else json.dumps(p) for p in pieces)


def lark_regex_literal(text: str) -> str:
    """`text` as a literal inside a Lark `/regex/` (Rust regex syntax: only its meta
    characters are escaped, since `\\<` means a word start there)."""
    return "".join("\\" + ch if ch in _RUST_REGEX_META else ch for ch in text)


_RUST_REGEX_META = set("\\.+*?()|[]{}^$#&-~/")


def _class_char(ch: str) -> str:
    return "\\" + ch if ch in "\\]^-[" else ch
