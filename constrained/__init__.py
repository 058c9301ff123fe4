"""spruce.constrained: regex / JSON-schema constraints as lazily determinized byte automata,
packed token bitmasks and a compressed FSM (jump-forward).

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
    "allocate_bitmask": "bitmask", "apply_bitmask": "bitmask", "unpack_bitmask": "bitmask",
    "GrammarCompiler": "compiler", "GrammarCursor": "cursor", "CompiledGrammar": "grammar",
    "JumpForward": "jump_forward",
    "ConstraintSpec": "spec", "make_spec": "spec", "ConstraintError": "errors",
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
