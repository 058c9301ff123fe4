"""The drafter and the speculation policy without a model: prompt lookup finds the latest
earlier occurrence of the longest suffix, draft lengths follow acceptance and row cost, and
(a fake clock and drafter) drafting that does not pay at the measured costs stops within a
few steps and probes after growing pauses, while drafting that pays keeps running."""

from __future__ import annotations

import itertools

import pytest

from spruce.runtime.config import SpeculativeOptions
from spruce.runtime.core.request import Req
from spruce.runtime.core.sampling_params import SamplingParams
from spruce.runtime.scheduler.speculative import (
    PAUSE_STEPS,
    NgramDrafter,
    SpecState,
    Speculator,
    best_length,
)
from spruce.runtime.scheduler.step_costs import StepCosts


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


def test_acceptance_estimate_decays_and_pauses_double():
    state = SpecState(hits=1.4, tries=2.0)
    for _ in range(10):
        state.record(4, 0)
    assert state.rate < 0.1 and state.drafted == 40 and state.accepted == 0
    state.pause(step=3, prior=0.6)
    assert state.paused_until == 3 + PAUSE_STEPS and state.rate == 0.6 and state.probing
    state.record(1, 1)  # the probe
    assert not state.probing and state.rate > 0.6
    state.pause(step=100, prior=0.6)
    assert state.paused_until == 100 + 2 * PAUSE_STEPS  # each pause doubles the next
    for _ in range(10):
        state.record(4, 4)
    assert state.rate > 0.95


def test_a_large_batch_skips_drafts_without_pausing_the_request():
    options = SpeculativeOptions(speculative_algorithm="ngram", speculative_row_cost=0.3)
    speculator = Speculator(options, 4096, "cpu")
    r = req([7, 8, 9, 7, 8, 9, 7, 8])
    r.spec = SpecState(hits=8.0, tries=10.0)  # drafts that pay alone, not next to 15 others
    assert speculator._length(r, batch=16) == 0 and r.spec.paused_until == 0
    assert speculator._length(r, batch=1) > 0
    r.spec = SpecState(hits=1.0, tries=10.0)  # drafts that never pay
    assert speculator._length(r, batch=1) == 0 and r.spec.paused_until > speculator.step


# -- the switch: a fake clock and drafter, steps that cost what a cost model says --------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Drafter:
    """Drafts as many tokens as asked (token 0), always."""

    def propose_many(self, reqs, lengths):
        return [[0] * n for n in lengths]

    def forget(self, req):
        pass

    def check_integrity(self):
        pass


def speculator(clock, row_cost=None):
    options = SpeculativeOptions(speculative_algorithm="ngram", speculative_row_cost=row_cost)
    return Speculator(options, 10**6, "cpu", Drafter(), clock=clock)


def run_steps(spec, clock, reqs, steps, accepted, per_row=0.003, plain=(1, 1.0)):
    """Drives `steps` decode steps: a forward pass of R rows takes 0.006 + per_row * R
    seconds; a plain step runs plain[0] passes, each plain[1] of that (multi-step decode);
    `accepted(k)`: how many of a k-token draft are accepted. Returns each step's drafted
    tokens (all requests)."""
    drafted = []
    for _ in range(steps):
        drafts = spec.drafts(reqs)
        rows = len(reqs) + sum(map(len, drafts.values()))
        passes, share = (1, 1.0) if drafts else plain
        clock.now += (0.006 + per_row * rows) * passes * share
        for r in reqs:
            k = len(drafts.get(id(r), ()))
            n = accepted(k) if k else 0
            r.output_ids.extend([1] * (n + passes))
            if k:
                spec.record(r, k, n)
        drafted.append(sum(map(len, drafts.values())))
    return drafted


def every_other():
    """Every other draft accepted whole, the others not at all."""
    halves = itertools.cycle([0, 1])
    return lambda k: k * next(halves)


def long_req():
    return Req("r", [5, 6, 7], SamplingParams(max_new_tokens=100_000))


def test_drafts_never_accepted_stop_fast_and_probe_after_growing_pauses():
    clock = Clock()
    spec = speculator(clock)
    drafted = run_steps(spec, clock, [long_req()], 2000, accepted=lambda k: 0)
    first = next(i for i, n in enumerate(drafted) if n)  # after a few plain steps, timed
    assert first < 8 and sum(n > 0 for n in drafted[: first + PAUSE_STEPS]) <= 3
    probes = [i for i, n in enumerate(drafted) if n and i >= first + PAUSE_STEPS]
    assert probes and all(drafted[i] == 1 for i in probes)  # a probe drafts one token
    gaps = [b - a for a, b in itertools.pairwise(probes)]
    assert all(b > a for a, b in itertools.pairwise(gaps)) and len(probes) <= 7


def test_drafts_that_pay_keep_running():
    clock = Clock()
    spec = speculator(clock)
    drafted = run_steps(spec, clock, [long_req()], 500, accepted=lambda k: k)
    assert sum(n > 0 for n in drafted) >= 495
    assert abs(spec.costs.row_cost() - 0.003 / 0.009) < 1e-6  # measured, not the default


def test_the_measured_costs_decide_for_the_same_acceptance():
    """Every other draft accepted whole, the others not at all: worth drafting where rows
    are nearly free, not where a row costs most of a step, nor where the plain path runs
    four steps a call at half a step's cost each."""
    cases = {"free": (0.00005, (1, 1.0)), "dear": (0.03, (1, 1.0)), "multi": (0.0015, (4, 0.5))}
    runs = {}
    for name, (per_row, plain) in cases.items():
        clock = Clock()
        spec = speculator(clock)
        drafted = run_steps(spec, clock, [long_req()], 600, every_other(), per_row, plain)
        runs[name] = sum(n > 0 for n in drafted[100:])
    assert runs["free"] >= 490
    assert runs["dear"] <= 10 and runs["multi"] <= 10


def test_a_batch_drafts_only_where_its_step_pays():
    clock = Clock()
    spec = speculator(clock)
    reqs = [long_req() for _ in range(8)]
    drafted = run_steps(spec, clock, reqs, 400, every_other())
    assert sum(n > 0 for n in drafted[100:]) <= 20


def test_step_costs_fit_the_line_and_skip_steps_that_are_not_decode_alone():
    clock, costs = Clock(), StepCosts()
    costs.clock = clock
    reqs = [long_req()]
    for i in range(40):
        rows = i % 4  # drafts of 0-3 tokens
        costs.begin(reqs, rows, alone=i % 10 != 5, start=clock.now)
        clock.now += 0.008 + 0.002 * (1 + rows) + (1.0 if i % 10 == 5 else 0)
        reqs[0].output_ids.extend([1] * (1 + rows))
    assert abs(costs.row_cost() - 0.002 / 0.010) < 1e-6
    assert abs(costs.plain_cost(1) - 1.0) < 1e-6  # plain one-pass steps: one row's cost
    other = [long_req()]  # another request decodes: the step in flight is not counted
    costs.begin(other, 0, True, clock.now)
    clock.now += 5.0
    costs.begin(reqs, 0, True, clock.now)
    assert abs(costs.row_cost() - 0.2) < 1e-6


@pytest.mark.slow
def test_bundled_model_outputs_are_identical_under_the_measured_policy():
    """The default policy (costs measured, drafting switched off and probed): greedy outputs
    of a copying prompt and of plain chat equal plain decoding's, one at a time and batched."""
    from support import bundled_gguf_path

    from spruce.runtime import Engine

    if bundled_gguf_path() is None:
        pytest.skip("the bundled model is not installed")
    plain = Engine(num_threads=2, kv_memory_gb=0.2)
    spec = Engine(loaded=plain.core.loaded, num_threads=2, kv_memory_gb=0.2,
                  speculative_algorithm="ngram")  # fmt: skip
    asks = ["Invoice INV-4821 went to Harriet Kowalski of Larkspur.\nRepeat it exactly, twice.",
            "Why is the sky blue?", "Give three tips for sleeping better."]  # fmt: skip
    ids = [plain.tokenizer.encode(plain.apply_chat_template([{"role": "user", "content": a}]),
                                  add_special_tokens=False) for a in asks]  # fmt: skip
    params = {"temperature": 0, "max_new_tokens": 48}
    one = [spec.generate(input_ids=p, sampling_params=params)["output_ids"] for p in ids]
    both = [o["output_ids"] for o in spec.generate(input_ids=ids, sampling_params=params)]
    want = [o["output_ids"] for o in plain.generate(input_ids=ids, sampling_params=params)]
    assert one == want and both == want
    spec.core.check_integrity()
