"""The automaton in C (automaton.c via native.py) against the Python path it replaces: the same
transitions, accepting states, forced bytes and token masks along random walks (state ids
may differ between the paths, so each pair of states reached by the same bytes is
checked to correspond one to one); the per-mask state bound and the memory budget on both
paths; and the fallback to Python when the library cannot be built."""

from __future__ import annotations

import logging
import random
import threading

import numpy as np
import pytest

from spruce.constrained import make_spec
from spruce.constrained.automaton import native
from spruce.constrained.automaton.byte_dfa import DEAD, ByteDFA, NativeByteDFA
from spruce.constrained.automaton.byte_nfa import build_nfa
from spruce.constrained.automaton.token_trie import TokenTrie
from spruce.constrained.automaton.vocab import TokenVocabulary
from spruce.constrained.core.errors import ConstraintError
from spruce.constrained.core.memory import GrammarTooLarge, MaskTooExpensive, MemoryBudget
from spruce.constrained.core.patterns import DTYPE_REGEXES

requires_native = pytest.mark.skipif(
    native.library() is None, reason="no C compiler: the Python path only"
)
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"enum": ["a", "b\u00e9", "c d"]}},
    },
    "required": ["name", "age"],
}


def _python_dfa(nfa, budget=None) -> ByteDFA:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPRUCE_AUTOMATON", "python")
        dfa = ByteDFA(nfa, budget)
    assert type(dfa) is ByteDFA
    return dfa


def _random_regex(rng: random.Random, depth: int = 0) -> str:
    """A regex over a, b, c and '.', of concatenations, alternations and repeats."""
    if depth > 3 or rng.random() < 0.3:
        return rng.choice(["a", "b", "c", "[ab]", "[^a]", ".", "é", "(?:ab|ba)"])
    kind = rng.choice(["cat", "cat", "alt", "star", "plus", "opt", "count"])
    if kind == "cat":
        return _random_regex(rng, depth + 1) + _random_regex(rng, depth + 1)
    if kind == "alt":
        return f"(?:{_random_regex(rng, depth + 1)}|{_random_regex(rng, depth + 1)})"
    suffix = {
        "star": "*",
        "plus": "+",
        "opt": "?",
        "count": f"{{{rng.randint(0, 2)},{rng.randint(2, 4)}}}",
    }[kind]
    return f"(?:{_random_regex(rng, depth + 1)}){suffix}"


def _small_vocab() -> list[bytes]:
    rng = random.Random(7)
    alphabet = [b"a", b"b", b"c", b"d", "é".encode(), b"\xc3", b"\xa9"]
    tokens = [b""] + [
        b"".join(rng.choice(alphabet) for _ in range(rng.randint(1, 5))) for _ in range(400)
    ]
    return tokens + [b"ab" * 12, b"a" * 30, b"c" * 40]  # deep, thin branches


def _compare_walks(nfa, trie: TokenTrie, seed: int, walks: int = 3, steps: int = 25) -> None:
    """Walks both DFAs on the same random live bytes, comparing every state reached."""
    fast, slow = NativeByteDFA(nfa), _python_dfa(nfa)
    pairs: dict[int, int] = {}
    rng = random.Random(seed)
    for _ in range(walks):
        state_c, state_py = fast.initial, slow.initial
        for _ in range(steps):
            _compare_state(fast, slow, trie, state_c, state_py, pairs)
            live = [b for b in range(256) if slow.step(state_py, b) != DEAD]
            if not live:
                break
            byte = rng.choice(live)
            state_c, state_py = fast.step(state_c, byte), slow.step(state_py, byte)
        data = bytes(rng.choice(range(256)) for _ in range(6))  # walk() agrees on any bytes
        assert (fast.walk(state_c, data) == DEAD) == (slow.walk(state_py, data) == DEAD)


def _compare_state(fast, slow, trie, state_c: int, state_py: int, pairs: dict[int, int]) -> None:
    assert pairs.setdefault(state_c, state_py) == state_py  # one to one
    assert fast.is_accepting(state_c) == slow.is_accepting(state_py)
    assert fast.forced_bytes(state_c) == slow.forced_bytes(state_py)
    for byte in range(256):
        next_c, next_py = fast.step(state_c, byte), slow.step(state_py, byte)
        assert (next_c == DEAD) == (next_py == DEAD), byte
        if next_c != DEAD:
            assert pairs.setdefault(next_c, next_py) == next_py
    assert np.array_equal(trie.allowed(fast, state_c), trie.allowed(slow, state_py))


@requires_native
def test_random_regexes_agree_with_the_python_path():
    rng, trie, compared = random.Random(3), TokenTrie(_small_vocab()), 0
    while compared < 40:
        regex = _random_regex(rng)
        try:
            nfa = build_nfa(regex)
        except ConstraintError:
            continue
        _compare_walks(nfa, trie, compared)
        compared += 1


@pytest.fixture(scope="module")
def bundled_vocab() -> TokenVocabulary:
    from spruce.runtime.models.loading.files import load_tokenizer

    return TokenVocabulary(load_tokenizer())


@requires_native
@pytest.mark.parametrize("name", sorted(DTYPE_REGEXES))
def test_the_dtype_regexes_agree_on_the_bundled_vocabulary(bundled_vocab, name):
    _compare_walks(build_nfa(DTYPE_REGEXES[name]), bundled_vocab.trie, 0, walks=2, steps=12)


@requires_native
def test_a_json_schema_agrees_on_the_bundled_vocabulary(bundled_vocab):
    regex = make_spec(json_schema=SCHEMA, backend="spruce").regex
    _compare_walks(build_nfa(regex), bundled_vocab.trie, 1, walks=3, steps=40)


@requires_native
def test_a_free_string_mask_agrees_on_the_bundled_vocabulary(bundled_vocab):
    nfa, trie = build_nfa(r'"[^"]*"'), bundled_vocab.trie
    fast, slow = NativeByteDFA(nfa), _python_dfa(nfa)
    mask = trie.allowed(fast, fast.step(fast.initial, ord('"')))
    assert mask.sum() > len(bundled_vocab.token_bytes) // 2
    assert np.array_equal(mask, trie.allowed(slow, slow.step(slow.initial, ord('"'))))


def _both_paths(nfa, budget_bytes=None) -> list[ByteDFA]:
    def budget():
        return None if budget_bytes is None else MemoryBudget(budget_bytes)

    dfas = [_python_dfa(nfa, budget())]
    if native.library() is not None:
        dfas.append(NativeByteDFA(nfa, budget()))
    return dfas


def test_a_mask_past_its_state_bound_stops_and_resumes():
    """`.*a.{24}` makes a new state at nearly every trie node: a bound of 20 new states stops
    the walk, the states made are kept, and repeated calls finish the same mask."""
    rng = random.Random(5)
    trie = TokenTrie(
        [b""] + [bytes(rng.choice(b"ab") for _ in range(rng.randint(1, 8))) for _ in range(3000)]
    )
    nfa = build_nfa(".*a.{24}")
    expected = trie.allowed(_python_dfa(nfa), 0)
    for dfa in _both_paths(nfa):
        stops = 0
        while True:
            before = dfa.num_states
            try:
                mask = trie.allowed(dfa, dfa.initial, max_new_states=20)
                break
            except MaskTooExpensive:
                stops += 1
                assert dfa.num_states > before  # kept for the next call
        assert stops > 2 and np.array_equal(mask, expected), type(dfa)


def test_a_walk_past_a_tiny_budget_is_refused_and_the_dfa_stays_usable():
    nfa = build_nfa("(a|b)*a(a|b){24}")
    rng = random.Random(9)
    for dfa in _both_paths(nfa, budget_bytes=300_000):
        known = dfa.walk(dfa.initial, b"ab")
        with pytest.raises(GrammarTooLarge):
            for _ in range(100_000):
                dfa.walk(dfa.initial, bytes(rng.choice(b"ab") for _ in range(30)))
        assert dfa.budget.exhausted and dfa.budget.used <= 300_000, type(dfa)
        assert dfa.walk(dfa.initial, b"ab") == known and not dfa.is_accepting(known)
        if isinstance(dfa, NativeByteDFA):  # every byte C holds is charged
            assert dfa._lib.spruce_dfa_allocated(dfa._ptr) <= dfa.budget.used


def test_a_mask_walk_past_a_tiny_budget_is_refused_and_the_dfa_stays_usable():
    """The C walk's scratch and rows are charged as it goes (a call may stop at the limit
    several times, each time charging what it needs, until the budget refuses)."""
    rng = random.Random(2)
    trie = TokenTrie(
        [b""] + [bytes(rng.choice(b"ab") for _ in range(rng.randint(1, 12))) for _ in range(5000)]
    )
    for dfa in _both_paths(build_nfa(".*a.{24}"), budget_bytes=400_000):
        known = dfa.walk(dfa.initial, b"ba")
        with pytest.raises(GrammarTooLarge):
            trie.allowed(dfa, dfa.initial)
        assert dfa.budget.used <= 400_000 and dfa.num_states > 3, type(dfa)
        assert dfa.walk(dfa.initial, b"ba") == known != DEAD  # the states it has stay usable


def test_a_budget_too_small_for_the_automaton_refuses_it():
    nfa = build_nfa("[a-z]{40}")
    with pytest.raises(GrammarTooLarge):
        _python_dfa(nfa, MemoryBudget(10_000))
    if native.library() is not None:
        with pytest.raises(GrammarTooLarge):
            NativeByteDFA(nfa, MemoryBudget(10_000))


@requires_native
def test_a_state_the_native_dfa_does_not_have_is_refused():
    dfa, trie = NativeByteDFA(build_nfa("ab")), TokenTrie([b"a", b"b"])
    for call in [
        lambda: dfa.step(5, 97), lambda: dfa.walk(-3, b"a"), lambda: dfa.is_accepting(1),
        lambda: dfa.forced_bytes(9), lambda: dfa.ensure_rows([7]), lambda: dfa.table[4],
        lambda: trie.allowed(dfa, 3),
    ]:  # fmt: skip
        with pytest.raises(IndexError):
            call()
    assert dfa.walk(DEAD, b"a") == DEAD and dfa.forced_bytes(dfa.initial) == b"ab"


@requires_native
def test_threads_sharing_a_native_dfa_get_the_same_masks():
    trie, nfa = TokenTrie(_small_vocab()), build_nfa("(?:a|b|é)*c(?:[abc]){6}")
    dfa, expected = NativeByteDFA(nfa), trie.allowed(_python_dfa(nfa), 0)
    results = []

    def work():
        results.append(trie.allowed(dfa, dfa.initial))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 4 and all(np.array_equal(r, expected) for r in results)


@pytest.fixture
def fresh_library(monkeypatch, tmp_path):
    """native.py loading again, with its cache folder in tmp_path."""
    monkeypatch.setenv("SPRUCE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("SPRUCE_AUTOMATON", raising=False)
    native.reset()
    yield tmp_path
    native.reset()


def test_a_failed_build_falls_back_to_python(fresh_library, monkeypatch, caplog):
    monkeypatch.setenv("CC", "/bin/false")
    with caplog.at_level(logging.WARNING, logger="spruce"):
        assert native.library() is None and native.library() is None
        dfa = ByteDFA(build_nfa("ab+"))
    assert type(dfa) is ByteDFA and dfa.is_accepting(dfa.walk(dfa.initial, b"abb"))
    assert sum("using the Python path" in r.message for r in caplog.records) == 1


def test_the_python_path_is_selected_by_the_environment(monkeypatch):
    monkeypatch.setenv("SPRUCE_AUTOMATON", "python")
    assert native.library() is None and type(ByteDFA(build_nfa("a"))) is ByteDFA


@requires_native
def test_the_library_is_built_into_the_cache_folder(fresh_library):
    assert native.library() is not None
    built = list((fresh_library / "kernels").iterdir())
    assert [p.name for p in built] == [
        native.library_path(native.c_compiler()).name
    ]  # no temp folder left
    assert type(ByteDFA(build_nfa("a"))) is NativeByteDFA
