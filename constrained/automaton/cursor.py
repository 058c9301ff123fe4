"""Per-request matching state over a shared CompiledGrammar."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from spruce.constrained.core.bitmask import write_row
from spruce.constrained.core.jump_forward import JumpForward, retokenize_tail

if TYPE_CHECKING:
    from spruce.constrained.automaton.grammar import CompiledGrammar

FINISHED = -1  # state after EOS was accepted
RETOKENIZE_WINDOW = 3  # output tokens re-tokenized together with a forced text


class _Encoder(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


class CursorBase:
    """What every backend's cursor shares: jump-forward (the forced text re-tokenized
    canonically with the output's tail). A subclass keeps `grammar` (with `vocab`) and
    `_tokens` (the accepted ids), and gives `accept_token`, `rollback`, `forced_bytes` and
    `accepts(rollback, token_ids)`."""

    __slots__ = ()

    def failure(self) -> str | None:
        """Why the grammar took no more tokens, where its backend says (a limit it passed, as
        a plain sentence); None otherwise."""
        return None

    # -- jump-forward -----------------------------------------------------------------------

    def jump_forward_text(self) -> str:
        """The forced text from the current state, whole characters only ('' when none); its
        first character may complete one the last token left open."""
        return self._forced()[1]

    def jump_forward(
        self, output_ids: Sequence[int], tokenizer: _Encoder, min_forced_chars: int = 2
    ) -> JumpForward | None:
        """If the current state starts a forced text of at least `min_forced_chars`
        characters, appends it: the last few output tokens plus the forced text are
        re-tokenized canonically, the tokens that change are rolled back, and the cursor
        ends advanced over the new tokens. None (cursor unchanged) when there is nothing to
        force or the grammar refuses the re-tokenized tokens; plain decoding then continues.

        `output_ids` must end with the tokens this cursor accepted."""
        forced_bytes, forced = self._forced()
        if not forced_bytes or len(forced) < max(min_forced_chars, 1):
            return None
        tokens = self._tokens
        tail_len = min(len(tokens), len(output_ids), RETOKENIZE_WINDOW + 4)
        if list(output_ids[len(output_ids) - tail_len :]) != tokens[len(tokens) - tail_len :]:
            raise ValueError("output_ids do not end with the tokens this cursor accepted")
        plan = retokenize_tail(
            tokens[len(tokens) - tail_len :],
            forced_bytes,
            self.grammar.vocab.token_bytes,
            tokenizer,
            RETOKENIZE_WINDOW,
        )
        if plan is None or not self.accepts(plan[0], plan[1]):
            return None
        rollback, new_ids = plan
        self.rollback(rollback)
        for token_id in new_ids:
            accepted = self.accept_token(token_id)
            assert accepted, "checked by _accepts"
        return JumpForward(rollback=rollback, new_ids=new_ids, text=forced)

    def _forced(self) -> tuple[bytes, str]:
        """(the forced bytes cut after the last whole character, their text together with
        the open character they complete); (b"", "") when nothing is forced."""
        forced = self.forced_bytes()
        if not forced:
            return b"", ""
        tail = b"".join(self.grammar.vocab.token_bytes[t] for t in self._tokens[-4:])
        pending = tail[_utf8_cut(tail) :]
        data = pending + forced
        cut = _utf8_cut(data)
        try:
            text = data[:cut].decode("utf-8")
        except UnicodeDecodeError:
            return b"", ""
        return forced[: max(cut - len(pending), 0)], text


class GrammarCursor(CursorBase):
    """Where one request stands in a byte-automaton grammar (the spruce backend). Cheap: a list entry per accepted token.

    Keeps the grammar state after every accepted token (so `rollback` can undo any number
    of them). Not thread-safe: one request, one thread."""

    __slots__ = ("grammar", "_states", "_tokens")

    def __init__(self, grammar: CompiledGrammar) -> None:
        self.grammar = grammar
        self._states = [grammar.initial_state]
        self._tokens: list[int] = []

    # -- matching ---------------------------------------------------------------------------

    def accept_token(self, token_id: int) -> bool:
        """Advances over `token_id`; False (and no change) when it is not allowed. EOS is
        allowed only in accepting states and finishes the cursor (nothing follows it)."""
        state = self._states[-1]
        if state == FINISHED:
            return False
        if token_id in self.grammar.vocab.eos_token_ids:
            if not self.grammar.is_final(state):
                return False
            self._push(FINISHED, token_id)
            return True
        next_state = self.grammar.next_state(state, token_id)
        if next_state is None:
            return False
        self._push(next_state, token_id)
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes this cursor's allowed tokens into `bitmask[row]` (int32, packed; see
        bitmask.py). A finished cursor allows only EOS."""
        state = self._states[-1]
        write_row(
            bitmask,
            row,
            self.grammar.vocab.eos_mask if state == FINISHED else self.grammar.mask(state),
        )

    def prepare_mask(self, max_new_states: int) -> bool:
        """Makes the current state's mask ahead of `fill_bitmask`, with at most
        `max_new_states` new DFA states now; False when it needs more (its work is kept:
        call again). MaskTooExpensive past the grammar's per-mask bound (see grammar.py)."""
        state = self._states[-1]
        return state == FINISHED or self.grammar.prepare_mask(state, max_new_states)

    def can_end(self) -> bool:
        """The output so far matches the whole constraint: EOS is allowed (or was taken)."""
        state = self._states[-1]
        return state == FINISHED or self.grammar.is_final(state)

    def is_terminated(self) -> bool:
        """No token but EOS can follow (or EOS was taken): the request must stop now. If
        also not `can_end()`, the vocabulary cannot complete the constraint (a dead end).
        Bounded work (see CompiledGrammar.may_continue): where the state's mask would cost
        more, only a state no byte can follow counts as terminated."""
        state = self._states[-1]
        return state == FINISHED or not self.grammar.may_continue(state)

    def rollback(self, n: int) -> None:
        """Undoes the last `n` accepted tokens (EOS included)."""
        if not 0 <= n <= len(self._tokens):
            raise ValueError(f"cannot roll back {n} tokens; {len(self._tokens)} accepted")
        if n:
            del self._states[-n:], self._tokens[-n:]

    def copy(self) -> GrammarCursor:
        clone = GrammarCursor.__new__(GrammarCursor)
        clone.grammar = self.grammar
        clone._states = list(self._states)
        clone._tokens = list(self._tokens)
        return clone

    @property
    def num_accepted(self) -> int:
        return len(self._tokens)

    @property
    def state(self) -> int:
        """The grammar (DFA) state (FINISHED after EOS); for debugging and tests."""
        return self._states[-1]

    def forced_bytes(self) -> bytes:
        """The bytes every output from here continues with (see ByteDFA.forced_bytes)."""
        state = self._states[-1]
        return b"" if state == FINISHED else self.grammar.forced_bytes(state)

    def accepts(self, rollback: int, token_ids: list[int]) -> bool:
        state = self._states[len(self._states) - 1 - rollback]
        for token_id in token_ids:
            state = self.grammar.next_state(state, token_id)
            if state is None:
                return False
        return True

    def _push(self, state: int, token_id: int) -> None:
        self._states.append(state)
        self._tokens.append(token_id)


def _utf8_cut(data: bytes) -> int:
    """Where the trailing incomplete UTF-8 character of `data` starts (len(data): none)."""
    for i in range(len(data) - 1, max(len(data) - 4, -1), -1):
        lead = data[i]
        if lead & 0xC0 == 0x80:
            continue
        width = 1 if lead < 0x80 else 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4
        return i if i + width > len(data) else len(data)
    return len(data)
