"""What decode steps cost on this machine, measured as they run (for speculative decoding).

A step is timed from one schedule() to the next (the forward pass, sampling, the scheduler's
and the engine loop's own work: all a drafted row adds), and counts only where it was a step
of decodes alone and the same requests decode in the next one (nothing joined, left or was
prefilled in between). Two things are kept, each a moving average (so the numbers follow a
shared host's load) that stays as it is while no step of its kind runs:

- per row count (decoding requests plus drafted tokens), the seconds of a step of one forward
  pass (steps with drafts, plain one-pass steps); a least-squares line through them,
  `seconds = fixed + per_row * rows`, gives a row's cost as a share of a one-row step,
  `per_row / (fixed + per_row)`;
- per batch size, a plain step's seconds per token (multi-step decode included where it
  ran), so drafts are weighed against the plain path as it really runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from spruce.runtime.core.request import Req

NEW = 0.2  # weight of a new step in a moving average
MIN_STEPS = 3  # steps of a row count before its average counts


@dataclass(slots=True)
class _Step:
    start: float
    reqs: list[Req]
    tokens_before: int
    draft_rows: int


class StepCosts:
    """Times decode steps (`begin` once a step, with its decoding requests) and answers
    `row_cost()` and `plain_cost(batch)` in units of a one-row step (None: not measured)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.one_pass: dict[int, list[float]] = {}  # rows -> [seconds, steps timed]
        self.plain: dict[int, list[float]] = {}  # batch -> [seconds, tokens, steps timed]
        self._open: _Step | None = None
        self._fitted: tuple[float, float] | bool | None = False  # the line (False: not fitted)

    def begin(self, decoding: list[Req], draft_rows: int, alone: bool, start: float) -> None:
        """A step of `decoding` (with `draft_rows` drafted tokens) starts, scheduled at
        `start` (this clock): the previous step ends there. `alone`: no other request
        prefills or waits this step (only such steps are timed)."""
        last, self._open = self._open, None
        if last is not None and [id(r) for r in last.reqs] == [id(r) for r in decoding]:
            tokens = _output_tokens(decoding) - last.tokens_before
            if tokens > 0:
                self._add(len(decoding), last.draft_rows, tokens, start - last.start)
        if alone:
            self._open = _Step(start, decoding, _output_tokens(decoding), draft_rows)

    def _add(self, batch: int, draft_rows: int, tokens: int, seconds: float) -> None:
        if draft_rows or tokens == batch:  # one forward pass
            self._fitted = False
            _average(self.one_pass, batch + draft_rows, seconds)
        if not draft_rows:  # averaged per token: a multi-step call weighs as its tokens
            pace = self.plain.setdefault(batch, [seconds, tokens, 0])
            pace[0] += NEW * (seconds - pace[0])
            pace[1] += NEW * (tokens - pace[1])
            pace[2] += 1

    def _line(self) -> tuple[float, float] | None:
        """(seconds of a one-row step, seconds per further row), once two row counts are
        measured."""
        if self._fitted is False:
            self._fitted = self._fit()
        return self._fitted

    def _fit(self) -> tuple[float, float] | None:
        points = [(x, y) for x, (y, n) in self.one_pass.items() if n >= MIN_STEPS]
        if len(points) < 2:
            return None
        mx = sum(x for x, _ in points) / len(points)
        my = sum(y for _, y in points) / len(points)
        per_row = sum((x - mx) * (y - my) for x, y in points) / sum(
            (x - mx) ** 2 for x, _ in points
        )
        one_row = my - per_row * (mx - 1)
        return (one_row, max(per_row, 0.0)) if one_row > 0 else None

    def row_cost(self) -> float | None:
        """One more row's seconds as a share of a one-row step's."""
        line = self._line()
        return None if line is None else line[1] / line[0]

    def plain_cost(self, batch: int) -> float | None:
        """A plain step's cost at `batch` requests (a token each), in one-row steps."""
        line = self._line()
        if line is None or not self.knows_plain(batch):
            return None
        seconds, tokens, _ = self.plain[batch]
        return seconds / tokens * batch / line[0]

    def knows_plain(self, batch: int) -> bool:
        """Whether plain steps at `batch` requests were timed."""
        return batch in self.plain and self.plain[batch][2] >= MIN_STEPS


def _average(averages: dict[int, list[float]], key: int, value: float) -> None:
    entry = averages.setdefault(key, [value, 0])
    entry[0] += NEW * (value - entry[0])
    entry[1] += 1


def _output_tokens(reqs: list[Req]) -> int:
    return sum(len(r.output_ids) for r in reqs)
