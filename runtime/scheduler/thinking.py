"""The thinking budget: a reasoning model may write at most `thinking_budget` tokens inside
its reasoning block; when they are spent the runtime writes the block's end marker itself
(`thinking_close`, optionally after a short message) and the answer starts, constrained or
not. Without it an unbounded block can eat `max_new_tokens` before a constrained answer
begins.

The markers are found in the output's text (the model may spell them in other tokens than
the canonical ones) and written as their canonical token ids; a marker the model has half
written when the budget runs out is completed, not repeated. The forced ids go through the request's grammar
cursor like sampled ones (a reasoning constraint allows the end marker), and are computed
in one extend pass next step, as jump-forward's are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from spruce.runtime.core.sampling_params import SamplingParams
from spruce.runtime.text.tokenizer import split_specials


@dataclass(slots=True)
class ThinkingBudget:
    """Where one request stands against its budget. `start`: the output index where the
    block's text begins (None while the block is not open yet)."""

    budget: int
    open_text: str | None
    close_text: str
    close_ids: tuple[int, ...]
    plain_ids: tuple[int, ...]  # the marker without special tokens (a grammar's spelling)
    start: int | None
    tokenizer: Any
    done: bool = False
    seen: int = 0  # output ids already looked at (jump-forward may append several at once)

    @classmethod
    def of(cls, sampling: SamplingParams, tokenizer) -> ThinkingBudget | None:
        """The budget state of a request (None when it has no budget)."""
        if sampling.thinking_budget is None:
            return None
        close = sampling.thinking_close
        ids = tuple(tokenizer.encode(close, add_special_tokens=False))
        opens = sampling.thinking_open
        start = None if opens else 0
        plain = plain_ids(tokenizer, close)
        return cls(sampling.thinking_budget, opens, close, ids, plain, start, tokenizer)

    def forced(self, output_ids: list[int]) -> list[list[int]]:
        """Called after each token appended to the output: when the budget is spent, the
        ids to write now (the rest of the end marker), in its canonical spelling and, when
        that holds special tokens, in ordinary tokens (grammars do not allow special tokens
        as text); else []. The caller writes the first its grammar accepts and sets `done`
        (it may wait a token: a grammar refuses the marker in the middle of a character the
        last token left open)."""
        if self.done:
            return []
        n, seen = len(output_ids), min(self.seen, len(output_ids))
        self.seen = n
        if self.start is None:
            self.start = self._marker_end(self.open_text, output_ids, seen, 0)
            if self.start is None:
                return []
        if self._marker_end(self.close_text, output_ids, max(seen, self.start), self.start):
            self.done = True  # the model closed the block itself
            return []
        if n - self.start < self.budget:
            return []
        spellings = dict.fromkeys((self.close_ids, self.plain_ids))
        return [list(ids[_partial_marker(output_ids, ids) :]) for ids in spellings]

    def _marker_end(self, marker: str, ids: list[int], seen: int, first: int) -> int | None:
        """The index after the token that completes the first `marker` written in ids[seen:]
        (text from index `first` on), or None: the tail decoded, as wide as a marker spans."""
        start = max(first, seen - len(marker.encode()))
        decode = lambda end: self.tokenizer.decode(ids[start:end], skip_special_tokens=False)  # noqa: E731
        if marker not in decode(len(ids)):
            return None
        return next(end for end in range(seen + 1, len(ids) + 1) if marker in decode(end))


def plain_ids(tokenizer, text: str) -> tuple[int, ...]:
    """`text` in ordinary tokens: each special token's text in it is split after its first
    character (so no special token matches it), the pieces encoded apart."""
    specials = tokenizer.special_tokens
    out: list[int] = []
    for piece in split_specials(text, specials):
        for part in (piece[:1], piece[1:]) if piece in specials else (piece,):
            out += tokenizer.encode(part, add_special_tokens=False) if part else []
    return tuple(out)


def _partial_marker(ids: list[int], marker: tuple[int, ...]) -> int:
    """How many leading ids of `marker` the output already ends with (a marker begun)."""
    for k in range(min(len(marker) - 1, len(ids)), 0, -1):
        if tuple(ids[-k:]) == marker[:k]:
            return k
    return 0
