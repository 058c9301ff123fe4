"""Cursor semantics, the outlines-core traps, bitmask packing / application, the compiler's
cache, build workers (processes) and their deadline, memory cap and byte budget."""

from __future__ import annotations

import random
import re
import string
import threading
import time

import numpy as np
import outlines_core
import pytest
import torch
from test_constrained_helpers import build_merge_tokenizer, generate, tiny_compiler  # noqa: F401

from spruce.constrained import (
    ConstraintSpec,
    GrammarCompiler,
    allocate_bitmask,
    apply_bitmask,
    make_spec,
    unpack_bitmask,
)
from spruce.constrained import compiler as compiler_module
from spruce.constrained.bitmask import pack_token_ids
from spruce.constrained.patterns import index_regex
from spruce.constrained import ConstraintError
from spruce.runtime.text.tokenizer import Tokenizer


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _allowed(cursor, vocab_size: int) -> set[int]:
    bitmask = allocate_bitmask(1, vocab_size)
    cursor.fill_bitmask(bitmask, 0)
    return set(torch.nonzero(unpack_bitmask(bitmask, vocab_size)[0]).flatten().tolist())


@pytest.fixture(scope="module")
def cafe_tokenizer():
    return build_merge_tokenizer([("x", "c"), ("a", "f"), ("af", "e")])


# -- EOS ----------------------------------------------------------------------------------


def test_outlines_refuses_to_advance_on_eos_at_a_final_state(tiny_compiler, tiny_tokenizer):
    """The trap: Index.get_next_state(final, eos) is None and Guide.advance(eos) raises."""
    vocab = tiny_compiler.vocab
    index = outlines_core.Index("ab", vocab.vocabulary)
    state = index.get_initial_state()
    for token_id in _ids(tiny_tokenizer, "ab"):
        state = index.get_next_state(state, token_id)
    assert index.is_final_state(state) and index.get_next_state(state, vocab.outlines_eos) is None
    guide = outlines_core.Guide(index)
    for token_id in _ids(tiny_tokenizer, "ab"):
        guide.advance(token_id, return_tokens=False)
    with pytest.raises(ValueError):
        guide.advance(vocab.outlines_eos, return_tokens=False)


def test_eos_finishes_the_cursor_only_in_accepting_states(tiny_compiler, tiny_tokenizer):
    eos = next(iter(tiny_tokenizer.eos_token_ids))
    cursor = tiny_compiler.compile(make_spec(regex="ab(cd)?")).cursor()
    assert not cursor.accept_token(eos) and not cursor.can_end()
    for token_id in _ids(tiny_tokenizer, "ab"):
        assert cursor.accept_token(token_id)
    assert cursor.can_end() and not cursor.is_terminated()
    assert eos in _allowed(cursor, tiny_compiler.vocab_size)
    assert cursor.accept_token(eos)
    assert cursor.is_terminated() and cursor.can_end()
    assert not cursor.accept_token(_ids(tiny_tokenizer, "c")[0]) and not cursor.accept_token(eos)
    assert _allowed(cursor, tiny_compiler.vocab_size) == {eos}
    cursor.rollback(1)  # EOS is an accepted token like any other
    assert not cursor.is_terminated() and cursor.accept_token(_ids(tiny_tokenizer, "c")[0])
    assert eos not in _allowed(cursor, tiny_compiler.vocab_size)


def test_terminated_when_only_eos_can_follow(tiny_compiler, tiny_tokenizer):
    cursor = tiny_compiler.compile(make_spec(choices=["yes", "no"])).cursor()
    for token_id in _ids(tiny_tokenizer, "no"):
        assert not cursor.is_terminated()
        cursor.accept_token(token_id)
    assert cursor.is_terminated() and cursor.can_end()


def test_every_eos_id_is_allowed_and_special_tokens_never(tiny_llama_dir, tiny_tokenizer):
    two_eos = Tokenizer(tiny_tokenizer.backend, bos_token_id=None, eos_token_ids=[2, 0])
    compiler = GrammarCompiler(two_eos, vocab_size=400)  # logits wider than the tokenizer
    cursor = compiler.compile(make_spec(regex="[^a]*")).cursor()
    allowed = _allowed(cursor, 400)
    assert {0, 2} <= allowed and 1 not in allowed  # <|im_start|> is special
    assert not allowed & set(range(384, 400))
    assert cursor.accept_token(0) and cursor.is_terminated()
    compiler.close()


def test_mask_and_accept_token_agree(tiny_compiler, tiny_tokenizer):
    grammar = tiny_compiler.compile(make_spec(json_schema={"type": "array", "items": {"type": "number"}}))
    gen = generate(grammar, tiny_tokenizer, seed=3)
    cursor = grammar.cursor()
    for token_id in gen.ids[:12]:
        allowed = _allowed(cursor, tiny_compiler.vocab_size)
        for candidate in range(tiny_compiler.vocab_size):
            assert (candidate in allowed) == cursor.copy().accept_token(candidate), candidate
        assert cursor.accept_token(token_id)


# -- tokens spanning a match position (outlines-core reports matches one byte late) ---------


def test_raw_outlines_refuses_a_token_spanning_two_repetitions(cafe_tokenizer):
    xc, afe = _ids(cafe_tokenizer, "xcafe")
    assert cafe_tokenizer.decode([xc]) == "xc" and re.fullmatch("(x|cafe)+", "xcafe")
    compiler = GrammarCompiler(cafe_tokenizer)
    index = outlines_core.Index("(x|cafe)+", compiler.vocab.vocabulary)
    assert index.get_next_state(index.get_initial_state(), xc) is None
    compiler.close()


def test_cursor_accepts_tokens_spanning_repetitions(cafe_tokenizer):
    compiler = GrammarCompiler(cafe_tokenizer)
    for regex, text in [("(x|cafe)+", "xcafexcafe"), ("x(cafe)*", "xcafe"), ("1(\\.5)?", "1.5")]:
        cursor = compiler.compile(make_spec(regex=regex)).cursor()
        for token_id in _ids(cafe_tokenizer, text):
            assert cursor.accept_token(token_id), (regex, text, cafe_tokenizer.decode([token_id]))
        assert cursor.can_end()
    compiler.close()


def test_choices_sharing_a_prefix_are_all_reachable(tiny_compiler, tiny_tokenizer):
    grammar = tiny_compiler.compile(make_spec(choices=["a", "ab", "abc", ""]))
    seen = {generate(grammar, tiny_tokenizer, seed).text for seed in range(40)}
    assert seen == {"a", "ab", "abc", ""}


# -- rollback / copy ------------------------------------------------------------------------


def test_rollback_restores_the_exact_state(tiny_compiler, tiny_tokenizer):
    grammar = tiny_compiler.compile(make_spec(json_schema={"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 5}, "n": {"type": "integer"}}, "required": ["name", "n"]}))  # fmt: skip
    ids = _ids(tiny_tokenizer, '{"name":"Al","n":12}')
    cursor, snapshots = grammar.cursor(), []
    for token_id in ids:
        snapshots.append((_allowed(cursor, tiny_compiler.vocab_size), cursor.jump_forward_text()))
        assert cursor.accept_token(token_id)
    assert cursor.can_end()
    for n in range(len(ids), 0, -1):
        probe = cursor.copy()
        probe.rollback(n)
        assert probe.num_accepted == len(ids) - n
        assert (_allowed(probe, tiny_compiler.vocab_size), probe.jump_forward_text()) == snapshots[-n]
    with pytest.raises(ValueError):
        cursor.rollback(len(ids) + 1)


def test_copy_is_independent(tiny_compiler, tiny_tokenizer):
    cursor = tiny_compiler.compile(make_spec(regex="[ab]{3}")).cursor()
    cursor.accept_token(_ids(tiny_tokenizer, "a")[0])
    clone = cursor.copy()
    clone.accept_token(_ids(tiny_tokenizer, "b")[0])
    assert (cursor.num_accepted, clone.num_accepted) == (1, 2)


# -- bitmask --------------------------------------------------------------------------------


def test_bit_order_is_lsb_first_per_int32_word():
    packed = pack_token_ids([0, 31, 33], vocab_size=70)
    assert packed.dtype == torch.int32 and packed.shape == (3,)
    assert packed.tolist() == [1 - 2**31, 2, 0]


def test_packing_matches_a_boolean_mask():
    rng = np.random.default_rng(0)
    for vocab_size in (1, 31, 32, 33, 384, 1000):
        allowed = rng.random(vocab_size) < 0.3
        packed = pack_token_ids(np.flatnonzero(allowed), vocab_size)
        assert torch.equal(unpack_bitmask(packed, vocab_size), torch.from_numpy(allowed))


def test_fill_bitmask_matches_the_index(tiny_compiler, tiny_tokenizer):
    grammar = tiny_compiler.compile(make_spec(regex="[a-c]+x?"))
    cursor = grammar.cursor()
    cursor.accept_token(_ids(tiny_tokenizer, "a")[0])
    state = cursor.state
    vocab = tiny_compiler.vocab
    expected = {t for t in grammar.index.get_allowed_tokens(state) if t < vocab.vocab_size} | set(vocab.eos_token_ids)
    bitmask = allocate_bitmask(3, vocab.vocab_size)
    cursor.fill_bitmask(bitmask, 1)
    bits = unpack_bitmask(bitmask, vocab.vocab_size)
    assert set(torch.nonzero(bits[1]).flatten().tolist()) == expected
    assert bits[0].all() and bits[2].all()  # other rows untouched


def test_apply_bitmask_touches_only_the_given_rows():
    torch.manual_seed(0)
    logits = torch.randn(4, 70)
    original = logits.clone()
    allowed = [torch.rand(70) < 0.5 for _ in range(4)]
    bitmask = torch.stack([pack_token_ids(torch.nonzero(a).flatten().numpy(), 70) for a in allowed])
    apply_bitmask(logits, bitmask, rows=[1, 3])
    for row in (0, 2):
        assert torch.equal(logits[row], original[row])
    for row in (1, 3):
        assert torch.equal(logits[row][allowed[row]], original[row][allowed[row]])
        assert torch.isneginf(logits[row][~allowed[row]]).all()
    full = original.clone()
    apply_bitmask(full, bitmask)
    assert torch.isneginf(full[0][~allowed[0]]).all()


def test_apply_bitmask_checks_its_inputs():
    logits = torch.zeros(2, 64)
    with pytest.raises(ValueError, match="int32"):
        apply_bitmask(logits, torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="words"):
        apply_bitmask(logits, torch.zeros(2, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="expected logits"):
        apply_bitmask(logits, torch.zeros(3, 2, dtype=torch.int32))


# -- compiler: cache, build threads and worker processes ---------------------------------------


def test_cache_hit_returns_the_same_object(tiny_compiler):
    spec = make_spec(regex="cached[0-9]")
    first = tiny_compiler.compile(spec)
    assert tiny_compiler.compile(make_spec(regex="cached[0-9]")) is first
    future = tiny_compiler.submit(spec)
    assert future.done() and future.result() is first


def test_lru_evicts_the_least_recently_used(tiny_tokenizer):
    compiler = GrammarCompiler(tiny_tokenizer, cache_size=2)
    a, b, c = (make_spec(regex=r) for r in ("a+", "b+", "c+"))
    grammar_a = compiler.compile(a)
    compiler.compile(b)
    compiler.compile(a)  # a is now the most recent
    compiler.compile(c)
    assert compiler.cached(b) is None and compiler.cached(a) is grammar_a
    compiler.close()


def test_submit_builds_on_a_worker_once_per_spec(tiny_tokenizer):
    compiler = GrammarCompiler(tiny_tokenizer)
    threads, release = [], threading.Event()
    build = compiler._build

    def slow_build(spec, *args):
        threads.append(threading.current_thread().name)
        release.wait(5)
        return build(spec, *args)

    compiler._build = slow_build
    spec = make_spec(regex="worker[a-z]{2}")
    first, second = compiler.submit(spec), compiler.submit(spec)
    assert not first.done()  # submit never waits for the build
    release.set()
    assert first.result(5) is second.result(5)
    assert len(threads) == 1 and threads[0].startswith("spruce-grammar")
    compiler.close()


def test_the_deadline_counts_from_the_build_start_not_the_queue(tiny_tokenizer):
    compiler = GrammarCompiler(tiny_tokenizer, timeout_s=2)
    build = compiler._build

    def slow_build(spec, started, ready):  # each build takes 1.2 s of its 2 s
        started.set()
        time.sleep(1.2)
        return build(spec, started, ready)

    compiler._build = slow_build
    specs = [make_spec(regex=f"queue{i}[a-z]") for i in range(4)]  # 2 build at once, 2 wait 1.2 s
    futures = [compiler.submit(spec) for spec in specs]
    assert all(f.result(10).regex == spec.regex for f, spec in zip(futures, specs))
    compiler.close()


@pytest.mark.parametrize("spec", [ConstraintSpec("regex", "[unclosed", "[unclosed"), ConstraintSpec("regex", "(a", "(a")])
def test_a_bad_spec_fails_its_future_with_constraint_error(tiny_compiler, spec):
    with pytest.raises(ConstraintError):
        tiny_compiler.submit(spec).result(10)


def test_a_build_past_its_deadline_is_stopped_and_fails_its_own_future_only(tiny_tokenizer):
    compiler = GrammarCompiler(tiny_tokenizer, timeout_s=2)
    compiler.compile(make_spec(regex="warm[0-9]"))  # the worker is up
    start = time.monotonic()
    pathological = compiler.submit(make_spec(regex="(a|b)*a(a|b){24}"))  # 2^24 DFA states
    others = [compiler.submit(make_spec(regex=f"other{i}[a-z]+")) for i in range(3)]
    assert all(f.result(10) is not None for f in others)  # built meanwhile, on the other worker
    assert time.monotonic() - start < 2
    with pytest.raises(ConstraintError, match="not compiled within 2 s"):
        pathological.result(10)
    assert time.monotonic() - start < 4
    assert compiler.cached(make_spec(regex="(a|b)*a(a|b){24}")) is None
    cursor = compiler.compile(make_spec(regex="after[0-9]")).cursor()  # a fresh worker
    assert cursor.accept_token(tiny_tokenizer.encode("after")[0])
    compiler.close()


def test_a_build_over_its_memory_cap_fails_with_a_clear_error(tiny_tokenizer):
    compiler = GrammarCompiler(tiny_tokenizer, timeout_s=60, memory_mb=200)
    with pytest.raises(ConstraintError, match="200 MB memory cap"):
        compiler.compile(make_spec(regex="(a|b)*a(a|b){24}"))
    assert compiler.compile(make_spec(regex="small[0-9]")) is not None  # the next worker is fine
    compiler.close()


def test_the_cache_is_bounded_in_bytes(tiny_tokenizer):
    probe = GrammarCompiler(tiny_tokenizer)
    probe.compile(make_spec(regex="[a-z]{40}"))
    one = probe.cached_bytes
    probe.close()
    assert one > 0
    compiler = GrammarCompiler(tiny_tokenizer, cache_bytes=int(2.5 * one))
    specs = [make_spec(regex=f"[a-z]{{40}}{c}") for c in "xyz"]
    for spec in specs:
        compiler.compile(spec)
    assert compiler.cached(specs[0]) is None and compiler.cached(specs[2]) is not None
    assert 0 < compiler.cached_bytes <= 2.5 * one
    compiler.close()


@pytest.mark.parametrize("max_transfer_bytes", [4 << 20, 0])  # sent back / built again here
def test_index_and_automaton_cross_the_process_boundary_intact(tiny_tokenizer, monkeypatch, max_transfer_bytes):
    """The grammar's index equals an index built here; the automaton still sees
    interegular's anything_else (a character outside the regex's alphabet)."""
    monkeypatch.setattr(compiler_module, "MAX_TRANSFER_BYTES", max_transfer_bytes)
    compiler = GrammarCompiler(tiny_tokenizer)
    grammar = compiler.compile(make_spec(regex='"[^"]{0,5}" ok'))
    local = outlines_core.Index(index_regex(grammar.regex), compiler.vocab.vocabulary)
    assert grammar.index.get_transitions() == local.get_transitions()
    automaton = grammar.char_automaton
    assert automaton.walk(automaton.initial, '"q') is not None  # q: only via anything_else
    assert automaton.forced_text(automaton.walk(automaton.initial, '"q"')) == " ok"
    compiler.close()


@pytest.mark.parametrize(
    "max_transfer_bytes, max_direct_bytes, progress_kind",
    [(4 << 20, 4 << 20, None), (0, 0, "index_built"), (0, 4 << 20, "index_estimated")],
)  # sent back / built in full as proof, then built here / estimated, then built here only
def test_the_worker_says_when_to_build_the_index_here(tiny_tokenizer, max_transfer_bytes, max_direct_bytes, progress_kind):
    """An index too large to send is announced before the automaton and the answer, so the
    parent's own build overlaps the worker's remaining work: at once when the sample's
    estimate is small enough, else after the worker's full build."""
    from spruce.constrained.build_worker import BuildRequest, WorkerPool

    compiler = GrammarCompiler(tiny_tokenizer)
    pool = WorkerPool((compiler.vocab.vocabulary, *compiler.vocab.sample), memory_mb=4096, size=1)
    regex = '"[^"]{0,5}" ok'
    request = BuildRequest(index_regex(regex), regex, 30, max_transfer_bytes, 30, max_direct_bytes)
    progress: list = []
    result = pool.run(request, 60, on_progress=progress.append)
    assert (result.index is None) == (progress_kind is not None)
    assert progress == ([(progress_kind, result.index_bytes)] if progress_kind else [])
    assert result.index_bytes > 0 and result.char_automaton is not None
    pool.close()
    compiler.close()



def test_an_index_goes_out_before_a_slow_automaton_which_joins_later(tiny_tokenizer, monkeypatch):
    """300 alternatives of 12 letters: the index takes a fraction of interegular's
    determinization. With no grace period, submit's grammar comes without jump-forward, its
    cursors work, and the automaton joins the same grammar when the build is over (as
    `compile`, which waits for it, shows)."""
    monkeypatch.setattr(compiler_module, "AUTOMATON_GRACE_S", 0.0)
    rng = random.Random(0)
    words = ["".join(rng.choices(string.ascii_lowercase, k=12)) for _ in range(300)]
    spec = make_spec(regex='"(' + "|".join(words) + ')" done')
    compiler = GrammarCompiler(tiny_tokenizer)
    grammar = compiler.submit(spec).result(30)
    assert grammar.char_automaton is None and compiler.cached(spec) is None  # still building
    cursor = grammar.cursor()
    for token_id in tiny_tokenizer.encode(f'"{words[7]}" done', add_special_tokens=False):
        assert cursor.accept_token(token_id)
    assert compiler.compile(spec) is grammar and grammar.char_automaton is not None
    assert compiler.cached(spec) is grammar
    late = grammar.cursor()
    assert late.jump_forward_text() == '"'  # the automaton serves the cursors made from now on
    compiler.close()


def test_a_worker_that_ends_after_its_answer_gets_no_further_job(tiny_tokenizer):
    """A worker whose automaton is still building after its answer ends itself; it says so in
    that answer, so the next job goes to a fresh worker instead of finding it gone."""
    from spruce.constrained.build_worker import BuildRequest, WorkerPool

    compiler = GrammarCompiler(tiny_tokenizer)
    pool = WorkerPool((compiler.vocab.vocabulary, *compiler.vocab.sample), memory_mb=4096, size=1)
    rng = random.Random(1)
    slow = '"(' + "|".join("".join(rng.choices(string.ascii_lowercase, k=12)) for _ in range(300)) + ')"'
    quick = '"[a-z]{1,4}"'
    first = pool.run(BuildRequest(index_regex(slow), slow, 0.0, 4 << 20, 30, automaton_grace_s=0.0), 60)
    assert first.char_automaton is None  # not waited for
    second = pool.run(BuildRequest(index_regex(quick), quick, 30, 4 << 20, 30), 60)
    assert second.index is not None and second.char_automaton is not None
    pool.close()
    compiler.close()
