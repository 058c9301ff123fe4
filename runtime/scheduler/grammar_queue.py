"""The grammar queue: constrained requests wait here while their grammar compiles (in a
worker process, under a deadline: constrained/build_worker.py), so compilation never blocks
the scheduler loop; a failed or overdue build fails its own requests only.

Masks: a running request's next token mask is made before its step (`prepare_masks`), all
of them within MASK_STEP_NEW_STATES new DFA states a step (the spruce automaton; an
llguidance mask is computed whole, within llguidance's fuel limits). A request whose mask
needs more sits the step out (its walk's work is kept and resumed next step) while the
others run, so one costly mask (a state of `.*a.{24}` makes thousands) never stalls the
batch; a mask past its own bound, or a grammar past its memory budget, fails its request
only."""

from __future__ import annotations

from spruce.constrained.core.errors import ConstraintError
from spruce.runtime.core.request import Req
from spruce.runtime.errors import ConstraintError as RuntimeConstraintError
from spruce.runtime.errors import constraint_error

# ~16 ms of automaton mask work a step at 86 us a state on the Python path (SmolLM2's
# vocabulary; about 1 us in C): no step spends more than 20 ms on masks. llguidance's masks are bounded by its own fuel (~15 ms).
MASK_STEP_NEW_STATES = 192


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
                req.error = constraint_error(e, constraint_field(req))
                failed.append(req)
        self.pending = still
        return ready, failed


def prepare_masks(running: list[Req], budget: int | None = None) -> tuple[list[Req], list[Req]]:
    """Makes the masks the running constrained requests need next, with at most `budget`
    (MASK_STEP_NEW_STATES) new DFA states in all: (requests to hold this step, their mask
    not ready; requests that failed, with `req.error` set). The first request needing work
    always gets the whole budget, so every mask progresses."""
    budget = MASK_STEP_NEW_STATES if budget is None else budget
    held, failed = [], []
    for req in running:
        if req.cursor is None:
            continue
        grammar = req.cursor.grammar
        before = grammar.work
        try:
            ready = req.cursor.prepare_mask(max(budget, 0))
        except ConstraintError as e:
            req.error = constraint_error(e, constraint_field(req))
            failed.append(req)
            continue
        budget -= grammar.work - before
        if not ready:
            held.append(req)
    return held, failed


def refused_token(req: Req, token: int) -> RuntimeConstraintError:
    """The error of a request whose grammar refused the token it sampled: the client's
    constraint (llguidance's mask can allow a token its matcher then refuses past a lexer
    or parser limit), so a 400-class error naming the field, never a server fault."""
    reason = req.cursor.failure() if req.cursor is not None else None
    message = reason or f"the grammar refused token {token}, which its mask allowed"
    return constraint_error(ConstraintError(message), constraint_field(req))


def constraint_field(req: Req) -> str | None:
    """The request's constraint field (regex, json_schema, lark, ...)."""
    names = req.sampling.constraint_names
    return names[0] if names else None
