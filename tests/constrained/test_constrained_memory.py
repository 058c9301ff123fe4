"""Memory and work bounds of the constrained package: caches keyed by request data hold their
byte bound, build workers are replaced, a grammar's bytes are counted as requests walk it
and a walk past its budget (or a mask past its work bound) is refused with a clear error."""

from __future__ import annotations

import gc
import random
import tracemalloc

import pytest

from spruce.constrained import ConstraintError, GrammarCompiler, build_worker, make_spec
from spruce.constrained.automaton.byte_dfa import ByteDFA
from spruce.constrained.automaton.byte_nfa import (
    _class_template,
    _ranges_of,
    _utf8_sequences,
    build_nfa,
    parse_regex,
)
from spruce.constrained.automaton.grammar import CompiledGrammar
from spruce.constrained.automaton.limits import regex_size
from spruce.constrained.automaton.vocab import TokenVocabulary
from spruce.constrained.build_worker import BuildRequest, WorkerPool
from spruce.constrained.core.memory import BoundedCache, GrammarTooLarge, MaskTooExpensive

CLASS_CACHES = (_ranges_of, _class_template, _utf8_sequences)
GROWING = "(a|b)*a(a|b){24}"  # 2^25 DFA states: each new byte read tends to make a new one


def giant_class(seed: int, size: int) -> str:
    """A class of `size` code points none of which touch (no range merges)."""
    start = 0x100 + 2 * size * seed
    return (
        "["
        + "".join(chr(c) for c in range(start, start + 2 * size, 2) if not 0xD800 <= c <= 0xDFFF)
        + "]"
    )


def test_a_bounded_cache_drops_the_least_recently_used_beyond_its_bytes():
    cache = BoundedCache(1000)
    for key in "abcd":
        cache.put(key, key.upper(), 240)
    cache.get("a")  # now the most recent
    cache.put("e", "E", 240)
    assert cache.nbytes <= 1000 and cache.get("b") is None and cache.get("a") == "A"
    cache.put("huge", "H", 251)  # over a quarter of the bound: not kept
    assert cache.get("huge") is None


def test_class_caches_hold_their_byte_bound_over_many_giant_classes(monkeypatch):
    bound = 2 * 2**20
    for cached in CLASS_CACHES:
        cached.cache_clear()
        monkeypatch.setattr(cached.cache, "max_bytes", bound)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for seed in range(24):  # unbounded, the three caches kept ~1 MB for each of these
            build_nfa(giant_class(seed, 1500))
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    for cached in CLASS_CACHES:
        assert 0 < cached.cache.nbytes <= bound
    assert held < 2 * len(CLASS_CACHES) * bound
    assert len(_ranges_of.cache) < 24


def test_a_class_cache_entry_is_not_undercounted():
    """The size estimate is at least half of what tracemalloc sees the entry hold."""
    _ranges_of.cache_clear()
    regex = giant_class(99, 3000)
    items = tuple(parse_regex(regex)[0][1])
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        _ranges_of(items)
        gc.collect()
        real = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    counted = _ranges_of.cache.nbytes
    assert counted >= real / 2, (counted, real)


def test_a_giant_class_repeated_is_built_once_per_build():
    regex = "(?:" + giant_class(7, 20_000) + "){3}"  # too large for the shared caches
    nfa = build_nfa(regex)
    dfa = ByteDFA(nfa)
    first = chr(0x100 + 2 * 20_000 * 7)
    assert dfa.is_accepting(dfa.walk(dfa.initial, (first * 3).encode()))
    assert dfa.walk(dfa.initial, (first + chr(ord(first) + 1)).encode()) == -1  # a gap of the class


def test_regex_size_keeps_its_byte_bound(monkeypatch):
    regex_size.cache_clear()
    monkeypatch.setattr(regex_size.cache, "max_bytes", 2**20)
    for seed in range(40):
        regex_size("x" * 100_000 + str(seed))  # ~100 KB each
    assert regex_size.cache.nbytes <= 2**20 and 0 < len(regex_size.cache) < 40


# -- build workers ------------------------------------------------------------------------------


def _pid(pool: WorkerPool) -> int | None:
    return pool._idle[0].proc.pid if pool._idle else None


def _build_and_check(pool: WorkerPool, regex: str, text: str) -> None:
    nfa = pool.run(BuildRequest(regex), 60)
    dfa = ByteDFA(nfa)
    assert dfa.is_accepting(dfa.walk(dfa.initial, text.encode()))


def test_a_worker_is_replaced_after_its_job_count(monkeypatch):
    monkeypatch.setattr(build_worker, "MAX_JOBS_PER_WORKER", 2)
    pool = WorkerPool(1024, 1)
    try:
        _build_and_check(pool, "a[0-9]{2}", "a12")
        first = _pid(pool)
        assert first is not None
        _build_and_check(pool, "b[0-9]{2}", "b34")  # its second job: not kept
        assert _pid(pool) is None
        _build_and_check(pool, "c[0-9]{2}", "c56")  # a fresh worker builds correctly
        assert _pid(pool) not in (None, first)
    finally:
        pool.close()


def test_a_worker_past_its_memory_mark_is_replaced(monkeypatch):
    monkeypatch.setattr(build_worker, "RECYCLE_SHARE_OF_CAP", 1e-6)  # any process passes it
    pool = WorkerPool(1024, 1)
    try:
        _build_and_check(pool, "a[0-9]{2}", "a12")
        if build_worker.address_space_mb(pool._idle[0].proc.pid if pool._idle else 1) is None:
            pytest.skip("no /proc here: only the job count recycles workers")
        assert _pid(pool) is None
    finally:
        pool.close()


# -- a grammar's memory --------------------------------------------------------------------------


def _token(tokenizer, text: str) -> int:
    (token,) = tokenizer.encode(text, add_special_tokens=False)
    return token


def _walk(grammar, tokenizer, count: int, seed: int = 0):
    """A cursor over `count` random a/b tokens, each state's mask asked for (as decoding does)."""
    ids, rng, cursor = (
        [_token(tokenizer, "a"), _token(tokenizer, "b")],
        random.Random(seed),
        grammar.cursor(),
    )
    for _ in range(count):
        assert cursor.accept_token(rng.choice(ids))
        grammar.mask(cursor.state)
    return cursor


def test_the_counted_bytes_grow_as_a_request_walks_new_states(tiny_tokenizer):
    compiler = GrammarCompiler(tiny_tokenizer)
    try:
        spec = make_spec(regex=GROWING)
        grammar = compiler.compile(spec)
        start, states = compiler.cached_bytes, grammar.dfa.num_states
        assert start == grammar.nbytes > grammar.dfa.table.nbytes
        _walk(grammar, tiny_tokenizer, 200)
        assert grammar.dfa.num_states > states + 100
        grown = grammar.dfa.num_states - states
        assert (
            compiler.cached_bytes == grammar.nbytes > start + 200 * grown
        )  # rows, state sets, masks
    finally:
        compiler.close()


def test_a_walk_past_the_grammar_budget_is_refused_and_the_cache_drops_the_grammar(tiny_tokenizer):
    compiler = GrammarCompiler(tiny_tokenizer, grammar_bytes=400_000)
    try:
        spec = make_spec(regex=GROWING)
        grammar = compiler.compile(spec)
        with pytest.raises(GrammarTooLarge, match="memory budget of 0.4 MB"):
            _walk(grammar, tiny_tokenizer, 5000)
        assert grammar.exhausted and grammar.nbytes <= 400_000
        small = compiler.compile(make_spec(regex="[ab]{3}"))  # others compile and stay cached
        assert compiler.cached(spec) is None and compiler.cached(small.spec) is small
        cursor = grammar.cursor()  # the states it has stay usable
        assert cursor.accept_token(_token(tiny_tokenizer, "a"))
    finally:
        compiler.close()


def test_a_grammar_whose_nfa_passes_its_budget_fails_to_compile(tiny_tokenizer):
    compiler = GrammarCompiler(tiny_tokenizer, grammar_bytes=100_000)
    try:
        with pytest.raises(ConstraintError, match="memory budget"):
            compiler.compile(make_spec(regex="[a-z]{2000}"))
    finally:
        compiler.close()


def test_the_mask_work_bound_refuses_an_expensive_state(tiny_tokenizer):
    vocab = TokenVocabulary(tiny_tokenizer)
    spec = make_spec(regex=".*a.{24}")
    grammar = CompiledGrammar(spec, build_nfa(spec.regex), vocab)
    grammar.mask_new_states = 8
    cursor = grammar.cursor()
    assert cursor.accept_token(_token(tiny_tokenizer, "a"))  # every byte now starts a new state
    before = grammar.dfa.num_states
    with pytest.raises(MaskTooExpensive, match="too costly"):
        grammar.mask(cursor.state)
    assert grammar.dfa.num_states <= before + 8 + 256  # stopped within one row of the bound
    assert not grammar.has_mask(cursor.state)
    grammar.mask_new_states = 100_000  # with room, the same state's mask is made
    assert grammar.mask(cursor.state).any()


def test_all_live_grammars_share_one_budget_and_give_their_bytes_back(tiny_tokenizer):
    """Grammars evicted while requests hold them still count; a collected one gives its
    bytes back; the walk that would pass the shared budget is refused."""
    compiler = GrammarCompiler(tiny_tokenizer, cache_size=1, grammar_bytes=10**9)
    try:
        first = compiler.compile(make_spec(regex=GROWING))
        cursor = _walk(first, tiny_tokenizer, 100)  # a request holds it
        second = compiler.compile(make_spec(regex=GROWING + "x"))  # evicts `first` from the cache
        assert compiler.cached(first.spec) is None
        assert compiler.live.used == first.nbytes + second.nbytes
        compiler.live.max_bytes = compiler.live.used + 20_000
        with pytest.raises(GrammarTooLarge, match="constraints in use"):
            _walk(second, tiny_tokenizer, 2000, seed=1)
        assert not second.exhausted and compiler.live.used <= compiler.live.max_bytes
        held = first.nbytes
        del first, cursor
        gc.collect()
        assert compiler.live.used == second.nbytes and held > 0
    finally:
        compiler.close()
