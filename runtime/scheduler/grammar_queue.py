"""The grammar queue: constrained requests wait here while their grammar compiles (in a
worker process, under a deadline: constrained/build_worker.py), so compilation never blocks
the scheduler loop; a failed or overdue build fails its own requests only."""

from __future__ import annotations

from spruce.constrained.errors import ConstraintError
from spruce.runtime.errors import constraint_error
from spruce.runtime.core.request import Req


class GrammarQueue:
    def __init__(self) -> None:
        self.pending: list[Req] = []

    def add(self, req: Req) -> None:
        assert req.grammar_future is not None
        self.pending.append(req)

    def __len__(self) -> int:
        return len(self.pending)

    def poll(self) -> tuple[list[Req], list[Req]]:
        """(requests whose grammar is ready, now holding a cursor; requests whose compile
        failed, with `req.error` set)."""
        ready, failed, still = [], [], []
        for req in self.pending:
            future = req.grammar_future
            if not future.done():
                still.append(req)
                continue
            req.grammar_future = None
            try:
                req.cursor = future.result().cursor()
                ready.append(req)
            except ConstraintError as e:
                req.error = constraint_error(e)
                failed.append(req)
        self.pending = still
        return ready, failed
