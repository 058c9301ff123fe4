"""Shared helpers for the spruce.constrained tests (imported by the other test_constrained_*
modules; no tests here): random-logit generation under a cursor, and a tiny tokenizer with
hand-picked merges for the outlines-core traps."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import jsonschema
import pytest
import torch
from support import DATA_DIR

from spruce.constrained import GrammarCompiler, allocate_bitmask, apply_bitmask

SCHEMA_DIR = DATA_DIR / "schemas"  # a copy of the shared schemas
SHARED_SCHEMAS = sorted(SCHEMA_DIR.glob("*.json"))


@dataclass
class Generation:
    ids: list[int]
    text: str
    steps: int  # sampling steps (jump-forward insertions not counted)
    stop: str  # "eos", "terminated" or "limit"
    jumps: list = field(default_factory=list)


def generate(
    grammar, tokenizer, seed: int, jump_forward: bool = False, max_steps: int = 4000
) -> Generation:
    """Samples under the grammar's mask from random logits until the automaton stops it."""
    vocab_size = grammar.vocab.vocab_size
    eos = grammar.vocab.eos_token_ids
    rng = torch.Generator().manual_seed(seed)
    bitmask = allocate_bitmask(1, vocab_size)
    cursor, ids, steps, jumps = grammar.cursor(), [], 0, []
    stop = "limit"
    while steps < max_steps:
        if cursor.is_terminated():
            stop = "terminated"
            break
        if jump_forward:
            jump = cursor.jump_forward(ids, tokenizer)
            if jump is not None:
                ids = ids[: len(ids) - jump.rollback] + jump.new_ids
                jumps.append(jump)
                continue
        logits = torch.randn(1, vocab_size, generator=rng)
        cursor.fill_bitmask(bitmask, 0)
        apply_bitmask(logits, bitmask)
        token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=rng))
        steps += 1
        assert cursor.accept_token(token), f"masked sampling chose a refused token {token}"
        if token in eos:
            stop = "eos"
            break
        ids.append(token)
    assert stop != "eos" or cursor.can_end()
    return Generation(ids, tokenizer.decode(ids), steps, stop, jumps)


def assert_valid_json(text: str, schema: dict) -> None:
    try:
        instance = json.loads(text)
    except json.JSONDecodeError as e:
        raise AssertionError(f"not JSON ({e}): {text!r}") from None
    jsonschema.validate(instance, schema, format_checker=jsonschema.FormatChecker())


def assert_stopped_by_automaton(gen: Generation) -> None:
    assert gen.stop in ("eos", "terminated"), (
        f"hit the step limit after {gen.steps} steps: {gen.text[:200]!r}"
    )


@pytest.fixture(scope="session")
def tiny_compiler(tiny_tokenizer) -> GrammarCompiler:
    compiler = GrammarCompiler(tiny_tokenizer)
    yield compiler
    compiler.close()


def build_merge_tokenizer(merges: list[tuple[str, str]]):
    """Byte-level BPE: EOS '<|end|>' (id 0), the 256 byte tokens, then one token per merge."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as Backend

    from spruce.runtime.text.tokenizer import Tokenizer

    vocab = {"<|end|>": 0}
    for char in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[char] = len(vocab)
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    backend = Backend(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken("<|end|>", special=True)])
    return Tokenizer(backend, bos_token_id=None, eos_token_ids=[0])
