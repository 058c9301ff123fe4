"""Grammar backends: what compiles a constraint spec, behind one protocol (llguidance.py,
outlines.py here; the spruce automaton is automaton/grammar.py + automaton/cursor.py).

    spruce      the byte automaton of this package (regex, choices, dtypes; JSON schemas
                through the converter, recursion unrolled): cached per-state masks.
    llguidance  PyPI `llguidance` (Rust, Earley parser + lazy lexer): context-free grammars
                (Lark, GBNF), JSON schemas with recursion, structural tags, special tokens.
    outlines    PyPI `outlines-core` (a token-level index of a regex): regex, JSON schema;
                for users coming from SGLang's classic backend.

A backend's compiled grammar is shared by the requests with the same spec and has `spec`,
`vocab` (TokenVocabulary), `nbytes`, `exhausted`, `work` (mask work done so far: the
scheduler's per-step budget counts it) and `cursor()`; its cursor has the methods of
automaton/cursor.GrammarCursor (accept_token, fill_bitmask, prepare_mask, can_end, is_terminated,
rollback, copy, num_accepted, forced_bytes, accepts; jump-forward comes from CursorBase).

`--grammar-backend auto` picks per kind, by the figures in docs/grammar-bench.md: the first
backend of AUTO[kind] that takes the constraint (a JSON schema: llguidance, in lenient mode
leaving out what it cannot enforce; the spruce converter where llguidance refuses it).
"""

from __future__ import annotations

from importlib import import_module

from spruce.constrained.core.errors import ConstraintError

BACKENDS = ("spruce", "llguidance", "outlines")
BACKEND_CHOICES = ("auto", *BACKENDS)
GRAMMAR_KINDS = ("ebnf", "lark", "structural_tag")  # context-free: llguidance only
KINDS = {
    "spruce": ("regex", "json_schema"),
    "llguidance": ("regex", "json_schema", *GRAMMAR_KINDS),
    "outlines": ("regex", "json_schema"),
}
# What auto tries, in order, per kind (a backend that refuses the constraint passes it on).
AUTO = {
    "regex": ("spruce",),
    "json_schema": ("llguidance", "spruce"),
    **{kind: ("llguidance",) for kind in GRAMMAR_KINDS},
}
_MODULES = {
    "llguidance": "spruce.constrained.backends.llguidance",
    "outlines": "spruce.constrained.backends.outlines",
}


def candidates(kind: str, backend: str) -> tuple[str, ...]:
    """The backends to try for a constraint of `kind`, in order; ConstraintError when the
    named backend cannot take that kind."""
    if backend not in BACKEND_CHOICES:
        raise ConstraintError(
            f"grammar backend must be one of {', '.join(BACKEND_CHOICES)}; got {backend!r}"
        )
    if backend == "auto":
        return AUTO[kind]
    if kind not in KINDS[backend]:
        able = [name for name in BACKENDS if kind in KINDS[name]]
        raise ConstraintError(
            f"the {backend} grammar backend cannot take a {kind} constraint (use {' or '.join(able)}, or auto)"
        )
    return (backend,)


def module(backend: str):
    """The module of a backend other than spruce (imported on first use)."""
    return import_module(_MODULES[backend])
