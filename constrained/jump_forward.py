"""Compressed FSM: forced strings of the character-level automaton, and jump-forward planning.

The character automaton is interegular's DFA of the same regex the token index was built
from. A state's *forced string* is the chain of singular transitions from it: exactly one
live outgoing character, through states that are not accepting (an accepting state allows
EOS, so its continuation is a choice). When a request reaches such a state, the forced text
is appended in one step: the tail of the output is re-tokenized canonically together with it
(tokens that change are rolled back) and the new tokens are computed in one extend pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import interegular
from interegular.fsm import anything_else

MAX_FORCED_CHARS = 4096  # a forced chain is finite (states are live); this only bounds it


@dataclass(frozen=True, slots=True)
class JumpForward:
    """What the caller does: drop the last `rollback` output ids, append `new_ids`, compute
    them in one extend pass. The rolled-back tokens' bytes are a prefix of the new tokens'
    bytes, so text already streamed stays valid. `text` is the forced text (its first
    character may have been started by the last token)."""

    rollback: int
    new_ids: list[int]
    text: str


class CharAutomaton:
    """interegular's DFA of a regex, restricted to live states (those that can still reach an
    accepting state), with the forced string of every state precomputed. Immutable."""

    def __init__(self, regex: str) -> None:
        fsm = interegular.parse_pattern(regex).to_fsm()
        self.initial = fsm.initial
        self.finals = frozenset(fsm.finals)
        self._symbols = dict(fsm.alphabet.items())  # char (or anything_else) -> symbol
        self._else_symbol = self._symbols.get(anything_else)
        self._chars_of = {s: tuple(cs) for s, cs in fsm.alphabet.by_transition.items()}
        live = _live_states(fsm.map, self.finals)
        self.live = live
        self._map = {
            state: {sym: dst for sym, dst in edges.items() if dst in live}
            for state, edges in fsm.map.items()
            if state in live
        }
        self._forced_char = {s: self._singular(s) for s in self._map}
        self.forced = {s: self._forced_chain(s) for s in self._map}

    def step(self, state: int, char: str) -> int | None:
        symbol = self._symbols.get(char, self._else_symbol)
        return None if symbol is None else self._map.get(state, {}).get(symbol)

    def walk(self, state: int | None, text: str) -> int | None:
        for char in text:
            if state is None:
                return None
            state = self.step(state, char)
        return state

    def forced_text(self, state: int) -> str:
        return self.forced.get(state, "")

    def can_emit(self, chars: frozenset[str]) -> bool:
        """Whether some accepted string contains one of `chars` (checked on live edges)."""
        covered_by_else = any(c not in self._symbols for c in chars)
        for edges in self._map.values():
            for symbol in edges:
                members = self._chars_of[symbol]
                if any(c in chars for c in members if c is not anything_else):
                    return True
                if covered_by_else and anything_else in members:
                    return True
        return False

    def _singular(self, state: int) -> tuple[str, int] | None:
        if state in self.finals:
            return None
        edges = self._map[state]
        if len(edges) != 1:
            return None
        ((symbol, target),) = edges.items()
        members = self._chars_of[symbol]
        if len(members) != 1 or members[0] is anything_else:
            return None
        return members[0], target

    def _forced_chain(self, state: int) -> str:
        chars, seen = [], {state}
        step = self._forced_char[state]
        while step is not None and len(chars) < MAX_FORCED_CHARS:
            char, state = step
            chars.append(char)
            if state in seen:
                break
            seen.add(state)
            step = self._forced_char.get(state)
        return "".join(chars)


def _live_states(transitions: dict[int, dict[int, int]], finals: frozenset[int]) -> frozenset[int]:
    reverse: dict[int, list[int]] = {}
    for src, edges in transitions.items():
        for dst in edges.values():
            reverse.setdefault(dst, []).append(src)
    live, stack = set(finals), list(finals)
    while stack:
        for src in reverse.get(stack.pop(), ()):
            if src not in live:
                live.add(src)
                stack.append(src)
    return frozenset(live)


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
