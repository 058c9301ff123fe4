"""Step failures: which requests a failed forward pass puts under suspicion, and when one
is aborted.

A failure that belongs to one request (its sampling row, grammar cursor, logprobs, stop
strings) aborts that request only. A whole forward pass that fails cannot name its culprit:
the step is rolled back and each of its requests becomes a *suspect*, run alone for one step.
A suspect whose step succeeds is cleared; one that fails `MAX_FAILURES_ALONE` times alone is
aborted. A transient failure costs one step per suspect; a request that breaks every pass
it is in is found and aborted while the others go on.
"""

from __future__ import annotations

from spruce.runtime.core.request import Req
from spruce.runtime.errors import SpruceError

MAX_FAILURES_ALONE = 2


class RequestFault(SpruceError):
    """An internal failure that belongs to one request: that request is aborted with this
    message (a 500 for a server client), the others are not affected."""


class FaultTracker:
    def __init__(self) -> None:
        self.suspects: dict[Req, int] = {}  # request -> failures while running alone (ordered)

    def __bool__(self) -> bool:
        return bool(self.suspects)

    def next_suspect(self, running: list[Req]) -> Req | None:
        """The first suspect still running (suspects that left the running set are cleared)."""
        alive = set(running)
        for req in [r for r in self.suspects if r not in alive]:
            del self.suspects[req]
        return next(iter(self.suspects), None)

    def step_failed(self, reqs: list[Req]) -> list[Req]:
        """Records a failed step; returns the requests to abort (failed alone too often)."""
        if len(reqs) > 1:
            for req in reqs:
                self.suspects.setdefault(req, 0)
            return []
        req = reqs[0]
        failures = self.suspects.get(req, 0) + 1
        if failures >= MAX_FAILURES_ALONE:
            self.suspects.pop(req, None)
            return [req]
        self.suspects[req] = failures
        return []

    def step_succeeded(self, reqs: list[Req]) -> None:
        if len(reqs) == 1:
            self.suspects.pop(reqs[0], None)
