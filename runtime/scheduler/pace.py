"""The pace of steps, measured: how long a step of decodes takes, and how much each prefill
token adds to it. The engine reports every step's seconds (`Scheduler.record_step`); the
scheduler sizes a step's prefill from them so the step stays under --max-step-ms (a
stream's gap between tokens is one step, and a request that arrives waits for at most one).

Both are running averages (EWMA) of recent steps, so they follow the machine's load and the
prompts' lengths (a later chunk of a long prompt attends to more positions and costs more).
A prefill token's cost is the step's seconds beyond a decode step's, over its prefill
tokens; a step with a fixed cost of its own shows as a dearer token, so the budget settles
where whole steps take --max-step-ms.

Beside decodes, time is shared between clients (`Req.client`): a step that carries prefill
for P clients and decodes for D others is followed by decode-only steps for D / P of its
time (`decode_owed`). A decode beside a prefill chunk waits for the chunk however small it
is, so without this a stream beside a long prefill runs at the prefill's pace; with it, one
stream beside one client's long prefill runs at about half its quiet pace and the prefill
at half its pace alone, while a burst of new prompts from many clients is not held back by
a few decodes.
"""

from __future__ import annotations

ALPHA = 0.3  # weight of the newest step in the averages
SAMPLE_MIN_TOKENS = 4  # fewer prefill tokens in a step than this say little of their cost
PREFILL_FLOOR = 4  # prefill tokens a step carries at least: prefill always progresses


class StepPace:
    def __init__(self) -> None:
        self.decode_seconds: float | None = None  # a step of decodes only (one forward pass)
        self.token_seconds: float | None = None  # what one prefill token adds to a step
        self.decode_owed = 0.0  # seconds of decode-only steps due before the next prefill

    def record(
        self,
        seconds: float,
        prefill_tokens: int,
        clients: tuple[int, int] = (0, 0),
        passes: int = 1,
    ) -> None:
        """One step: its seconds per forward pass, the prefill tokens it computed, the clients
        it (prefilled, only decoded) for, and its forward passes (a multi-step decode runs
        several)."""
        if prefill_tokens == 0:
            self.decode_seconds = _average(self.decode_seconds, seconds)
            self.decode_owed = max(0.0, self.decode_owed - seconds * passes)
            return
        if prefill_tokens >= SAMPLE_MIN_TOKENS:
            extra = max(seconds - (self.decode_seconds or 0.0), 1e-6)
            self.token_seconds = _average(self.token_seconds, extra / prefill_tokens)
        prefilled, decoded = clients
        self.decode_owed = seconds * decoded / max(prefilled, 1)

    def prefill_budget(self, max_step_s: float, chunk: int) -> int:
        """Prefill tokens a step may carry to stay under `max_step_s`: at least
        PREFILL_FLOOR, at most `chunk` (also while nothing has been measured yet)."""
        if max_step_s <= 0 or self.token_seconds is None:
            return chunk
        room = max_step_s - (self.decode_seconds or 0.0)
        return max(PREFILL_FLOOR, min(chunk, int(room / self.token_seconds)))


def _average(old: float | None, new: float) -> float:
    return new if old is None else (1 - ALPHA) * old + ALPHA * new
