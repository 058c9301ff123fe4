"""Compressed FSM: jump-forward planning.

A grammar state's *forced bytes* are the chain of singular transitions of the byte DFA from
it: exactly one live outgoing byte, through states that are not accepting (an accepting
state allows EOS, so its continuation is a choice); see ByteDFA.forced_bytes. When a request
reaches such a state, the forced text is appended in one step: the tail of the output is
re-tokenized canonically together with it (tokens that change are rolled back) and the new
tokens are computed in one extend pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class JumpForward:
    """What the caller does: drop the last `rollback` output ids, append `new_ids`, compute
    them in one extend pass. The rolled-back tokens' bytes are a prefix of the new tokens'
    bytes, so text already streamed stays valid. `text` is the forced text (its first
    character may have been started by the last token)."""

    rollback: int
    new_ids: list[int]
    text: str


class _Encoder(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


def retokenize_tail(
    tail_ids: list[int],
    appended: bytes,
    token_bytes: list[bytes],
    tokenizer: _Encoder,
    window: int,
) -> tuple[int, list[int]] | None:
    """Re-tokenizes (the last `window` tokens of `tail_ids`) + `appended` canonically.

    The window grows backwards until it starts on a UTF-8 character boundary, so that
    `appended` may complete a character the last token left open. Returns (rollback,
    new_ids): how many trailing ids change and what replaces them; None when the text is not
    valid UTF-8 or the tokenizer does not reproduce its bytes."""
    k = min(window, len(tail_ids))
    while k < len(tail_ids) and _starts_mid_char(token_bytes[tail_ids[len(tail_ids) - k]]):
        k += 1
    tail = tail_ids[len(tail_ids) - k :]
    data = b"".join(token_bytes[i] for i in tail) + appended
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    ids = tokenizer.encode(text, add_special_tokens=False)
    if any(i >= len(token_bytes) for i in ids) or b"".join(token_bytes[i] for i in ids) != data:
        return None
    keep = 0
    while keep < min(len(tail), len(ids)) and tail[keep] == ids[keep]:
        keep += 1
    return len(tail) - keep, ids[keep:]


def _starts_mid_char(data: bytes) -> bool:
    return bool(data) and (data[0] & 0xC0) == 0x80
