"""Cursor semantics, tokens spanning match positions, bitmask packing / application, the
compiler's cache, build workers (processes) and their deadline, memory cap and byte budget."""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import numpy as np
import pytest
import torch
from test_constrained_helpers import build_merge_tokenizer, generate, tiny_compiler  # noqa: F401

from spruce.constrained import (
    ConstraintError,
    ConstraintSpec,
    GrammarCompiler,
    allocate_bitmask,
    apply_bitmask,
    make_spec,
    unpack_bitmask,
)
from spruce.constrained.core.bitmask import pack_token_ids
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
    grammar = tiny_compiler.compile(
        make_spec(json_schema={"type": "array", "items": {"type": "number"}})
    )
    gen = generate(grammar, tiny_tokenizer, seed=3)
    cursor = grammar.cursor()
    for token_id in gen.ids[:12]:
        allowed = _allowed(cursor, tiny_compiler.vocab_size)
        for candidate in range(tiny_compiler.vocab_size):
            assert (candidate in allowed) == cursor.copy().accept_token(candidate), candidate
        assert cursor.accept_token(token_id)


# -- tokens spanning a match position (raw outlines-core 0.2 refuses them: it reports matches
# one byte late, so "xc" after nothing is refused for `(x|cafe)+`) ----------------------------


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
        assert (_allowed(probe, tiny_compiler.vocab_size), probe.jump_forward_text()) == snapshots[
            -n
        ]
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


def test_fill_bitmask_matches_the_tokens_that_can_continue(tiny_compiler, tiny_tokenizer):
    """Against a brute force over the vocabulary: a token is allowed when its text keeps the
    output a prefix of some match (any continuation of [a-c]+x? after "a": [a-c]*x?)."""
    grammar = tiny_compiler.compile(make_spec(regex="[a-c]+x?"))
    cursor = grammar.cursor()
    cursor.accept_token(_ids(tiny_tokenizer, "a")[0])
    vocab = tiny_compiler.vocab
    expected = {
        i for i, data in enumerate(vocab.token_bytes) if data and re.fullmatch(b"[a-c]*x?", data)
    } | set(vocab.eos_token_ids)
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
        release.wait(60)
        return build(spec, *args)

    compiler._build = slow_build
    spec = make_spec(regex="worker[a-z]{2}")
    first, second = compiler.submit(spec), compiler.submit(spec)
    assert not first.done()  # submit never waits for the build
    release.set()
    assert first.result(60) is second.result(60)
    assert len(threads) == 1 and threads[0].startswith("spruce-grammar")
    compiler.close()


class FakeClock:
    """The compiler's clock, moved by the test: deadlines pass when the test says."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def wait_until(condition, what: str) -> None:
    """Waits for another thread's progress (a guard against a hang, not a timing check)."""
    for _ in range(6000):
        if condition():
            return
        time.sleep(0.01)
    raise AssertionError(f"never happened: {what}")


def test_a_queued_build_counts_its_wait_against_its_deadline(tiny_tokenizer):
    """Two gated builds hold both build threads; a third waits behind them. Its deadline
    counts from its submission: past it, it fails without ever starting, and the spec
    asked again builds afresh."""
    clock = FakeClock()
    compiler = GrammarCompiler(tiny_tokenizer, timeout_s=30, clock=clock)
    gate, started = threading.Event(), []
    compile_ = compiler._compile

    def gated(spec, job):
        started.append(spec.regex)
        gate.wait(60)
        return compile_(spec, job)

    compiler._compile = gated
    busy = [compiler.submit(make_spec(regex=f"busy{i}[a-z]")) for i in range(2)]
    wait_until(lambda: len(started) == 2, "both build threads busy")
    queued_spec = make_spec(regex="queued[a-z]")
    queued = compiler.submit(queued_spec)
    clock.advance(31)  # its wait alone passes its deadline
    with pytest.raises(ConstraintError, match="not compiled within 30 s"):
        queued.result(60)
    assert all(isinstance(f.exception(60), ConstraintError) for f in busy)  # theirs passed too
    gate.set()
    assert compiler.compile(queued_spec).regex == queued_spec.regex  # a fresh build, in time
    assert started.count(queued_spec.regex) == 1  # the overdue one never started
    compiler.close()


@pytest.mark.parametrize(
    "spec",
    [make_spec(regex="stuck[0-9]"), make_spec(lark='start: "stuck" /[0-9]+/')],
    ids=["automaton", "llguidance"],
)
def test_a_build_past_its_deadline_is_stopped_and_fails_its_own_future_only(tiny_tokenizer, spec):
    """The build's worker is frozen (SIGSTOP): it never answers. The other builds go on
    on the other thread; at the deadline the frozen worker is killed and only its build's
    requests fail."""
    clock = FakeClock()
    compiler = GrammarCompiler(tiny_tokenizer, timeout_s=30, clock=clock)
    compiler.compile(make_spec(regex="warm[0-9]"))  # one worker up, idle
    (frozen,) = compiler._workers._idle
    os.kill(frozen.proc.pid, signal.SIGSTOP)
    stuck = compiler.submit(spec)
    wait_until(lambda: not compiler._workers._idle, "the build took the frozen worker")
    others = [compiler.submit(make_spec(regex=f"other{i}[a-z]+")) for i in range(3)]
    assert all(f.result(120) is not None for f in others)  # built meanwhile, on a fresh worker
    assert not stuck.done()
    clock.advance(31)
    with pytest.raises(ConstraintError, match="not compiled within 30 s"):
        stuck.result(60)
    assert frozen.proc.wait(60) == -signal.SIGKILL  # the work was stopped
    assert compiler.cached(spec) is None
    cursor = compiler.compile(make_spec(regex="after[0-9]")).cursor()
    assert cursor.accept_token(tiny_tokenizer.encode("after")[0])
    compiler.close()


@pytest.mark.parametrize(
    "spec", [ConstraintSpec("regex", "[unclosed", "[unclosed"), ConstraintSpec("regex", "(a", "(a")]
)
def test_a_bad_spec_fails_its_future_with_constraint_error(tiny_compiler, spec):
    with pytest.raises(ConstraintError):
        tiny_compiler.submit(spec).result(10)


HUGE = "(?:[ab]{1000}){1000}"  # a million positions: seconds and hundreds of MB to build


@pytest.fixture
def no_size_cap(monkeypatch):
    """Lets HUGE past the size check of make_spec, so the worker's guards are what stops it."""
    monkeypatch.setattr("spruce.constrained.spec.check_regex_size", lambda regex, tree=None: None)


def test_a_build_over_its_memory_cap_fails_with_a_clear_error(tiny_tokenizer, no_size_cap):
    compiler = GrammarCompiler(tiny_tokenizer, timeout_s=60, memory_mb=200)
    with pytest.raises(ConstraintError, match="memory cap"):
        compiler.compile(make_spec(regex=HUGE))
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


def test_the_nfa_crosses_the_process_boundary_intact(tiny_tokenizer):
    """The worker's NFA gives the same masks as one built here, and JSON-unsafe characters
    outside the regex's classes are still refused."""
    from spruce.constrained.automaton.byte_nfa import build_nfa
    from spruce.constrained.automaton.grammar import CompiledGrammar

    compiler = GrammarCompiler(tiny_tokenizer)
    spec = make_spec(regex='"[^"]{0,5}" ok')
    remote = compiler.compile(spec)
    local = CompiledGrammar(spec, build_nfa(spec.regex), compiler.vocab)
    a, b = remote.cursor(), local.cursor()
    for token_id in _ids(tiny_tokenizer, '"qé" ok'):
        assert torch.equal(remote.mask(a.state), local.mask(b.state))
        assert a.accept_token(token_id) and b.accept_token(token_id)
    assert a.can_end() and b.can_end()
    compiler.close()
