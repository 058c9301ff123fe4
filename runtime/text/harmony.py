"""gpt-oss's harmony format, read from the model's output: a sequence of messages, each a
header (`<|start|>assistant`, `<|channel|>NAME`, maybe a recipient ` to=functions.f` and a
content type ` <|constrain|>json`) then `<|message|>`, the body, and `<|end|>` (`<|return|>`
or `<|call|>` end the turn; the runtime trims them as stop tokens). The chat template's
generation prompt ends in `<|start|>assistant`, so the first header starts without it:

    <|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...
    <|channel|>commentary to=functions.f <|constrain|>json<|message|>{...}<|call|>

The analysis channel is reasoning, the final channel the answer, a message with a recipient
a tool call (`tool_format_harmony`). Text that is not in a message (a model that skipped the
headers) is kept as it is: malformed output reads as content, never as an error.
"""

from __future__ import annotations

from dataclasses import dataclass

from spruce.runtime.text.stop import stop_prefix_len

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
END, RETURN, CALL, CONSTRAIN = "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"
ENDS = (END, RETURN, CALL)
ANALYSIS = CHANNEL + "analysis" + MESSAGE  # opens a reasoning message
NEXT = END + START + "assistant"  # closes one message and starts the next
FINAL = CHANNEL + "final" + MESSAGE  # heads the answer
HEADS = (START, CHANNEL)  # where a message may start inside the output
FIRST_HEADS = (*HEADS, " to=", "to=")  # right after the prompt's `<|start|>assistant`


@dataclass(slots=True)
class Message:
    """One message so far: `header` None for text outside any message; `body` its text so
    far; `raw` the whole message as written (header, body and end marker so far)."""

    header: str | None
    body: str
    raw: str
    closed: bool = False

    @property
    def channel(self) -> str | None:
        if self.header is None or CHANNEL not in self.header:
            return None
        rest = self.header.split(CHANNEL, 1)[1]
        return rest.split(" ", 1)[0].split("<|", 1)[0].strip()

    @property
    def recipient(self) -> str | None:
        """`functions.f` of ` to=functions.f` (before or after the channel), else None."""
        if self.header is None or " to=" not in " " + self.header:
            return None
        rest = (" " + self.header).split(" to=", 1)[1]
        return rest.split(" ", 1)[0].split("<|", 1)[0].strip() or None


def messages(text: str, inside: bool, final: bool) -> list[Message]:
    """The messages of `text` (output after the prompt; `inside`: the prompt ended in an open
    analysis message). While the text is still arriving (`final` False) what may be the start
    of a marker is held back: each message's body and raw text only grow as text is added."""
    out: list[Message] = []
    i = 0
    if inside:
        i = _body(text, 0, 0, CHANNEL + "analysis", final, out)
    while i is not None and i < len(text):
        heads = FIRST_HEADS if i == 0 else HEADS
        if not text.startswith(heads, i):
            i = _outside(text, i, final, heads, out)
            continue
        opened = text.find(MESSAGE, i)
        if opened < 0:  # the header is still arriving; a final one never closed: plain text
            if final:
                out.append(Message(None, text[i:], text[i:]))
            break
        i = _body(text, i, opened + len(MESSAGE), text[i:opened], final, out)
    return out


def _body(text: str, start: int, body: int, header: str, final: bool, out: list) -> int | None:
    """Appends the message whose body starts at `body`; returns where the next begins (None
    while this one is still arriving)."""
    ends = [(text.find(m, body), m) for m in (*ENDS, START)]
    found = [(at, m) for at, m in ends if at >= 0]
    if not found:
        held = 0 if final else stop_prefix_len(text, (*ENDS, START))
        end = len(text) - held
        out.append(Message(header, text[body:end], text[start:end], final))
        return None
    at, marker = min(found)
    after = at if marker == START else at + len(marker)
    out.append(Message(header, text[body:at], text[start:after], True))
    return after


def _outside(text: str, i: int, final: bool, heads: tuple[str, ...], out: list) -> int | None:
    """Text outside any message, up to the next message start (held back while it may be
    the start of one)."""
    nxt = [at for at in (text.find(h, i + 1) for h in HEADS) if at >= 0]
    end = min(nxt) if nxt else len(text)
    if not nxt and not final:
        end -= stop_prefix_len(text[i:], heads if i == 0 else HEADS)
    if end > i:
        out.append(Message(None, text[i:end], text[i:end], bool(nxt) or final))
    return end if nxt else None
