"""spruce.constrained: output constraints (regex, choices, JSON schema, context-free
grammars, structural tags) compiled by a grammar backend into token masks, with
jump-forward over forced text.

    spec.py, convert.py    a constraint checked and converted once, at the front door
    compiler.py            the service: builds under a deadline in worker processes
                           (build_worker.py), one LRU of compiled grammars bounded in bytes
    report.py              a finished output checked against its JSON schema
    core/                  errors, memory budgets, bitmasks, linear-time regexes, jump-forward
    automaton/             the spruce backend: lazily determinized byte automata, cached masks
    schema/                the JSON-schema converter (schema -> regex) and its validator
    backends/              the registry (auto | spruce | llguidance | outlines), llguidance
                           (grammars, structural tags, JSON schemas), outlines-core

    spec = make_spec(json_schema=MyModel)          # validated, hashable
    grammar = compiler.compile(spec)               # or compiler.submit(spec) -> Future
    cursor = grammar.cursor()                      # one per request
    cursor.fill_bitmask(bitmask, row); apply_bitmask(logits, bitmask, rows)
    cursor.accept_token(token_id); cursor.jump_forward(output_ids, tokenizer)
"""

from importlib import import_module

# Public name -> submodule. Imported on first use, so light users (the DSL's dtype
# patterns) do not pull in torch and NumPy.
_EXPORTS = {
    "allocate_bitmask": "core.bitmask", "apply_bitmask": "core.bitmask", "unpack_bitmask": "core.bitmask",
    "GrammarCompiler": "compiler", "GrammarCursor": "automaton.cursor", "CompiledGrammar": "automaton.grammar",
    "JumpForward": "core.jump_forward",
    "ConstraintSpec": "spec", "make_spec": "spec", "ConstraintError": "core.errors",
}  # fmt: skip


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'spruce.constrained' has no attribute {name!r}")
    return getattr(import_module(f"spruce.constrained.{_EXPORTS[name]}"), name)


__all__ = [
    "CompiledGrammar",
    "ConstraintError",
    "ConstraintSpec",
    "GrammarCompiler",
    "GrammarCursor",
    "JumpForward",
    "allocate_bitmask",
    "apply_bitmask",
    "make_spec",
    "unpack_bitmask",
]
