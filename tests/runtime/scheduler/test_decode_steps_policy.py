"""When the scheduler runs several greedy decode steps in one step (`decode_steps`): only for
plain argmax requests decoding alone, once a decode step was timed, within a time bound,
max_new_tokens and the context; and how their tokens are applied: one by one, stops acting
after each, the slots past the end freed."""

from __future__ import annotations

import pytest
from scheduler_fakes import EOS, make_req, make_scheduler, next_token, step

from spruce.runtime.scheduler.output import Sampled
from spruce.runtime.scheduler.scheduler import STEPS_SECONDS


def decoding(scheduler, *reqs):
    """Adds the requests and steps until each decodes (its prompt computed)."""
    for req in reqs:
        scheduler.add(req)
    while scheduler.waiting or any(r.remaining > 1 for r in scheduler.running):
        step(scheduler)
    scheduler.step_seconds, scheduler.step_batch = 0.001, len(reqs)  # a step was timed: 1 ms


def test_plain_greedy_decodes_run_up_to_decode_steps_at_once():
    scheduler = make_scheduler(decode_steps=6)
    decoding(scheduler, make_req(5, max_new_tokens=40), make_req(8, max_new_tokens=40))
    out = scheduler.schedule()
    assert out.steps == 6 and [item.num_tokens for item in out.scheduled] == [6, 6]
    assert all(item.slots.numel() == 6 and item.ahead == 5 for item in out.scheduled)


def test_one_step_until_a_step_of_as_many_requests_was_timed_and_when_off():
    scheduler = make_scheduler()
    decoding(scheduler, make_req(5, max_new_tokens=40), make_req(6, max_new_tokens=40))
    scheduler.step_batch = 1  # timed with fewer requests: its pace may not hold
    assert scheduler.schedule().steps == 1
    scheduler = make_scheduler()
    decoding(scheduler, make_req(5, max_new_tokens=40))
    scheduler.step_seconds = None
    assert scheduler.schedule().steps == 1
    off = make_scheduler(decode_steps=1)
    decoding(off, make_req(5, max_new_tokens=40))
    assert off.schedule().steps == 1


def test_steps_fit_the_time_bound_and_the_shortest_request():
    scheduler = make_scheduler(decode_steps=8)
    decoding(scheduler, make_req(5, max_new_tokens=40))
    scheduler.step_seconds = STEPS_SECONDS / 3
    assert scheduler.schedule().steps == 3
    scheduler = make_scheduler(decode_steps=8)
    short = make_req(6, max_new_tokens=4)
    decoding(scheduler, make_req(5, max_new_tokens=40), short)
    left = short.sampling.max_new_tokens - len(short.output_ids)
    assert scheduler.schedule().steps == left < 8


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 0.7},
        {"frequency_penalty": 0.5},
        {"logit_bias": {7: 3.0}},
        {"min_new_tokens": 20},
    ],
)
def test_one_step_where_a_request_does_more_than_argmax(sampling):
    scheduler = make_scheduler()
    other = make_req(6, max_new_tokens=40)
    other.sampling = type(other.sampling)(max_new_tokens=40, **{"temperature": 0, **sampling})
    decoding(scheduler, make_req(5, max_new_tokens=40), other)
    assert scheduler.schedule().steps == 1


def test_one_step_while_a_request_waits():
    scheduler = make_scheduler()
    running = make_req(5, max_new_tokens=40)
    decoding(scheduler, running)
    scheduler.add(make_req(7, max_new_tokens=4))
    out = scheduler.schedule()
    assert out.steps == 1 and len(out) == 2  # the decode and the new prompt together


def multi_step_sample(out, eos_at: int | None = None) -> None:
    """The fake model's tokens for each request's steps (as one step at a time would give);
    EOS at step `eos_at` of the first request."""
    for n, item in enumerate(out.scheduled):
        total = item.req.total_len
        tokens = [100 + (total + j) % 50 for j in range(item.steps)]
        if n == 0 and eos_at is not None:
            tokens[eos_at] = EOS
        item.result = Sampled(token_id=tokens[0], tokens=tokens)


def test_tokens_apply_one_by_one_and_unused_slots_go_back():
    scheduler = make_scheduler(decode_steps=5)
    a, b = make_req(5, max_new_tokens=40), make_req(9, max_new_tokens=40)
    decoding(scheduler, a, b)
    before = (len(a.output_ids), len(b.output_ids))
    out = scheduler.schedule()
    for item in out.scheduled:
        scheduler.cache.table.write(item.req.row, item.req.computed_len, item.slots)
    multi_step_sample(out, eos_at=2)
    scheduler.update(out)
    assert a.finished and a.output_ids[-1] == EOS and len(a.output_ids) == before[0] + 3
    assert len(b.output_ids) == before[1] + 5 and b.computed_len == b.total_len - 1
    scheduler.check_integrity()  # a's two slots past EOS were freed


def test_outputs_equal_one_step_at_a_time():
    """The fake model over a whole run: the same outputs with decode steps as without."""

    seen = []

    def run(decode_steps: int) -> list[list[int]]:
        scheduler = make_scheduler(decode_steps=decode_steps)
        reqs = [make_req(4 + i, max_new_tokens=5 + 7 * i) for i in range(4)]
        for req in reqs:
            scheduler.add(req)
        while scheduler.has_work():
            out = scheduler.schedule()
            seen.append(out.steps)
            scheduler.pop_finished_outside_step()
            for item in out.scheduled:
                scheduler.cache.table.write(item.req.row, item.req.computed_len, item.slots)
            if out.steps > 1:
                multi_step_sample(out)
            else:
                for item in out.scheduled:
                    token = next_token(item.req) if item.samples else None
                    item.result = Sampled(token_id=token)
            scheduler.update(out)
            scheduler.check_integrity()
            scheduler.step_seconds, scheduler.step_batch = 0.001, len(reqs)
        return [r.output_ids for r in reqs]

    assert run(8) == run(1)
    assert max(seen) > 1
