"""spruce.constrained: regex / JSON-schema constraints on outlines-core, packed token
bitmasks and a compressed FSM (jump-forward).

    spec = make_spec(json_schema=MyModel)          # validated, hashable
    grammar = compiler.compile(spec)               # or compiler.submit(spec) -> Future
    cursor = grammar.cursor()                      # one per request
    cursor.fill_bitmask(bitmask, row); apply_bitmask(logits, bitmask, rows)
    cursor.accept_token(token_id); cursor.jump_forward(output_ids, tokenizer)
"""

from spruce.constrained.bitmask import allocate_bitmask, apply_bitmask, unpack_bitmask
from spruce.constrained.compiler import GrammarCompiler
from spruce.constrained.cursor import GrammarCursor
from spruce.constrained.grammar import CompiledGrammar
from spruce.constrained.jump_forward import CharAutomaton, JumpForward
from spruce.constrained.spec import ConstraintSpec, make_spec

__all__ = [
    "CharAutomaton",
    "CompiledGrammar",
    "ConstraintSpec",
    "GrammarCompiler",
    "GrammarCursor",
    "JumpForward",
    "allocate_bitmask",
    "apply_bitmask",
    "make_spec",
    "unpack_bitmask",
]
