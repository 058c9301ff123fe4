"""The per-step budget of new-state mask work: a request whose next mask needs more than
the step allows sits steps out (never sampled without its mask) while the others decode,
and its mask, resumed step after step, equals one made in one go."""

from __future__ import annotations

import torch
from scheduler_fakes import fake_forward, fake_sample, make_req, make_scheduler, step

from spruce.constrained import make_spec
from spruce.constrained.automaton.byte_nfa import build_nfa
from spruce.constrained.automaton.grammar import CompiledGrammar
from spruce.constrained.automaton.vocab import TokenVocabulary
from spruce.runtime.scheduler import grammar_queue

COSTLY = ".*a.{24}"  # after an "a", nearly every byte a mask's walk reads makes a new state


def costly_cursor(vocab: TokenVocabulary, tokenizer):
    spec = make_spec(regex=COSTLY)
    grammar = CompiledGrammar(spec, build_nfa(spec.regex), vocab)
    cursor = grammar.cursor()
    assert cursor.accept_token(tokenizer.encode("a", add_special_tokens=False)[0])
    return cursor


def test_a_request_whose_mask_is_not_ready_waits_while_the_others_decode(
    tiny_tokenizer, monkeypatch
):
    monkeypatch.setattr(grammar_queue, "MASK_STEP_NEW_STATES", 4)
    vocab = TokenVocabulary(tiny_tokenizer)
    scheduler = make_scheduler()
    costly, plain = make_req(5, max_new_tokens=40), make_req(6, max_new_tokens=40)
    for req in (costly, plain):
        scheduler.add(req)
    step(scheduler)  # both prompts
    costly.cursor = costly_cursor(vocab, tiny_tokenizer)
    grammar, state = costly.cursor.grammar, costly.cursor.state
    held_steps = 0
    while True:
        out = scheduler.schedule()
        if any(r is costly for r in out.reqs):  # its mask is made: it runs again
            break
        assert not grammar.has_mask(state) and any(
            r is plain for r in out.reqs
        )  # the batch goes on
        fake_forward(scheduler, out)
        fake_sample(out)
        scheduler.update(out)
        held_steps += 1
        assert held_steps < 10_000
    assert held_steps >= 2 and grammar.has_mask(state) and not costly.finished
    fresh = costly_cursor(vocab, tiny_tokenizer)
    fresh.grammar.warm(fresh.state)
    assert torch.equal(grammar.mask(state), fresh.grammar.mask(fresh.state))


def test_a_mask_past_its_own_bound_aborts_its_request_only(tiny_tokenizer):
    vocab = TokenVocabulary(tiny_tokenizer)
    scheduler = make_scheduler()
    costly, plain = make_req(5, max_new_tokens=8), make_req(6, max_new_tokens=8)
    for req in (costly, plain):
        scheduler.add(req)
    step(scheduler)
    costly.cursor = costly_cursor(vocab, tiny_tokenizer)
    costly.cursor.grammar.mask_new_states = 4
    out = scheduler.schedule()
    finished = scheduler.pop_finished_outside_step()
    assert finished == [costly] and costly.finish_reason.type == "abort"
    assert "too costly" in costly.finish_reason.message
    assert out.reqs == [plain]
    fake_forward(scheduler, out)
    fake_sample(out)
    scheduler.update(out)
    scheduler.check_integrity()


def test_the_stop_check_after_a_token_leaves_a_costly_mask_to_the_step_budget(tiny_tokenizer):
    """Checking whether a request must stop costs at most a quick bound of mask work."""
    from spruce.constrained.automaton.grammar import QUICK_MASK_NEW_STATES

    cursor = costly_cursor(TokenVocabulary(tiny_tokenizer), tiny_tokenizer)
    dfa = cursor.grammar.dfa
    before = dfa.num_states
    assert not cursor.is_terminated()
    assert not cursor.grammar.has_mask(cursor.state)
    assert dfa.num_states <= before + QUICK_MASK_NEW_STATES + 256  # within one row of the bound
