"""When a request stops: EOS, stop token ids, stop strings, max_new_tokens, its grammar."""

from __future__ import annotations

from spruce.constrained.core import linear_regex
from spruce.runtime.core.request import FinishReason, Req
from spruce.runtime.text.tokenizer import Tokenizer


def find_stop(text: str, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """Earliest occurrence of any stop string in text: (index, the stop string)."""
    best = None
    for stop in stops:
        i = text.find(stop)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, stop)
    return best


STOP_REGEX_TAIL_TOKENS = 256  # a stop_regex match must lie within the output's last tokens


def find_regex_stop(
    text: str, patterns: tuple[str, ...], start: int = 0
) -> tuple[int, int, str] | None:
    """Earliest match of any stop regex in text[start:]: (match start, match end, pattern).
    Matched in linear time (RE2, see constrained/core/linear_regex.py): this runs after every token."""
    best = None
    for pattern in patterns:
        span = linear_regex.search(pattern, text, start)
        if span is not None and (best is None or span[0] < best[0]):
            best = (*span, pattern)
    return best


def stop_prefix_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest tail of text that is a proper prefix of a stop string: text a
    stream must hold back because the next token may complete the stop string."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest


class StopChecker:
    def __init__(self, tokenizer: Tokenizer, eos_token_ids: frozenset[int]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids

    def check(self, req: Req, num_new: int) -> FinishReason | None:
        """Checks the request after `num_new` tokens were appended to its output."""
        params = req.sampling
        if len(req.output_ids) >= params.min_new_tokens:
            matched = self._stop_token(req)
            if matched is None:
                matched = self._stop_string(req, num_new)
            if matched is None:
                matched = self._stop_regex(req, num_new)
            if matched is not None:
                return FinishReason("stop", matched)
        if req.cursor is not None and req.cursor.is_terminated():
            return FinishReason("stop", None)
        if len(req.output_ids) >= params.max_new_tokens:
            return FinishReason("length")
        return None

    def _stop_token(self, req: Req) -> int | None:
        last = req.output_ids[-1]
        if last in req.sampling.stop_token_ids:
            return last
        if not req.sampling.ignore_eos and last in self.eos_token_ids:
            return last
        return None

    def _stop_string(self, req: Req, num_new: int) -> str | None:
        if not req.sampling.stop:
            return None
        # A stop string ending in the new tokens starts at most len(stop) characters
        # earlier; every token adds at least one byte, so this window covers it.
        window = num_new + max(len(s.encode()) for s in req.sampling.stop) + 1
        tail = self.tokenizer.decode(req.output_ids[-window:], req.sampling.skip_special_tokens)
        found = find_stop(tail, req.sampling.stop)
        return found[1] if found else None

    def _stop_regex(self, req: Req, num_new: int) -> str | None:
        """The pattern of the first stop_regex that matches the decoded tail. When the output
        is longer than the tail, the search starts at the tail's second character, so `^`
        does not match in the middle of the output."""
        patterns = req.sampling.stop_regex
        if not patterns:
            return None
        window = num_new + STOP_REGEX_TAIL_TOKENS
        tail = self.tokenizer.decode(req.output_ids[-window:], req.sampling.skip_special_tokens)
        found = find_regex_stop(tail, patterns, 1 if len(req.output_ids) > window else 0)
        return found[2] if found else None
