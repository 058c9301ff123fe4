"""The drafter and the speculation policy without a model: prompt lookup finds the latest
earlier occurrence of the longest suffix, draft lengths follow acceptance and row cost."""

from __future__ import annotations

from spruce.runtime.core.request import Req
from spruce.runtime.core.sampling_params import SamplingParams
from spruce.runtime.scheduler.speculative import (
    PRIOR,
    NgramDrafter,
    SpecState,
    best_length,
)


def req(prompt, output=()):
    return Req("r", list(prompt), SamplingParams(), output_ids=list(output))


def test_prompt_lookup_takes_the_latest_longest_match():
    drafter = NgramDrafter(2, 4)
    # suffix [7, 8] occurs twice before; the latest one is followed by 9, 10
    assert drafter.propose(req([7, 8, 1, 2, 7, 8, 9, 10, 3, 7, 8]), 2) == [9, 10]
    # a longer suffix wins over a later short one: [5, 7, 8] matched at the start
    assert drafter.propose(req([5, 7, 8, 4, 0, 7, 8, 6, 5, 7, 8]), 3) == [4, 0, 7]
    assert drafter.propose(req([1, 2, 3], [4, 5]), 4) == []  # nothing repeats
    assert drafter.propose(req([1, 2, 3, 1], [2]), 4) == [3, 1, 2]  # runs into the suffix


def test_matches_are_whole_tokens():
    """[1, 0] occurs in the bytes of [256, 0, 0] one byte in, never as whole tokens."""
    assert NgramDrafter(2, 2).propose(req([256, 0, 0, 5], [1, 0]), 3) == []
    assert NgramDrafter(2, 2).propose(req([256, 1, 0, 7, 5], [1, 0]), 3) == [7, 5, 1]


def test_draft_length_follows_acceptance_and_row_cost():
    assert best_length(0.95, 0.0, 1, 8) == 8  # free rows: draft all
    assert best_length(0.5, 0.6, 1, 8) == 0  # a CPU row costs more than it brings
    assert 1 <= best_length(0.95, 0.6, 1, 8) <= 5
    assert best_length(0.95, 0.6, 16, 8) == 0  # a batch's extra rows cost whole steps
    assert best_length(0.8, 0.05, 16, 8) >= 2  # a GPU's rows are nearly free


def test_acceptance_estimate_decays_and_pause_resets_it():
    state = SpecState()
    for _ in range(10):
        state.record(4, 0)
    assert state.rate < 0.1 and state.drafted == 40 and state.accepted == 0
    state.pause(step=3)
    assert state.paused_until > 3 and state.rate == PRIOR[0] / PRIOR[1]
    first = state.paused_until - 3
    state.pause(step=100)
    assert state.paused_until - 100 == 2 * first  # no token accepted between: a longer wait
    state.record(2, 1)
    state.pause(step=200)
    assert state.paused_until - 200 == first
    for _ in range(10):
        state.record(4, 4)
    assert state.rate > 0.95


def test_a_large_batch_skips_drafts_without_pausing_the_request():
    from spruce.runtime.config import SpeculativeOptions
    from spruce.runtime.scheduler.speculative import Speculator

    options = SpeculativeOptions(speculative_algorithm="ngram", speculative_row_cost=0.3)
    speculator = Speculator(options, 4096, "cpu")
    r = req([7, 8, 9, 7, 8, 9, 7, 8])
    r.spec = SpecState(hits=8.0, tries=10.0)  # drafts that pay alone, not next to 15 others
    assert speculator._length(r, batch=16) == 0 and r.spec.paused_until == 0
    assert speculator._length(r, batch=1) > 0
    r.spec = SpecState(hits=1.0, tries=10.0)  # drafts that never pay
    assert speculator._length(r, batch=1) == 0 and r.spec.paused_until > speculator.step
