"""Fair scheduling without a model (issue 51): a step's prefill is sized from the measured
pace to fit --max-step-ms (never below the floor); beside other clients' decodes, steps
that carry prefill get their clients' share of the time; and one client's large batch
shares each step's prefill budget with the other clients' prompts. The step
seconds are given, never measured: nothing here depends on the machine's speed."""

from __future__ import annotations

from scheduler_fakes import make_req, make_scheduler, step

from spruce.runtime.scheduler.pace import PREFILL_FLOOR, StepPace
from spruce.runtime.scheduler.prefill import fair_split


def linear_cost(decode_s: float, token_s: float):
    """A fake machine: a step costs `decode_s` plus `token_s` per prefill token."""

    def seconds(out) -> float:
        prefill = sum(s.num_tokens for s in out.scheduled if s.num_tokens > 1)
        return decode_s + token_s * prefill

    return seconds


def prefill_tokens(out) -> int:
    return sum(s.num_tokens for s in out.scheduled if s.num_tokens > 1)


# -- the step's prefill, bounded by time while requests decode ---------------------------------


def test_a_mixed_steps_prefill_shrinks_to_fit_max_step_ms():
    scheduler = make_scheduler(num_slots=4096, chunked_prefill_size=200, max_step_ms=100)
    cost = linear_cost(decode_s=0.02, token_s=0.004)  # 100 ms: 20 prefill tokens beside a decode
    stream = make_req(8, max_new_tokens=400)
    scheduler.add(stream)
    for _ in range(3):
        step(scheduler, cost)  # its prompt, then decodes
    for i in range(3):
        scheduler.add(make_req([1000 * (i + 1) + t for t in range(240)], max_new_tokens=0))
    steps = [step(scheduler, cost) for _ in range(30)]
    assert all(any(s.req is stream for s in out.scheduled) for out in steps)
    mixed = [out for out in steps if prefill_tokens(out)]
    sizes = [prefill_tokens(out) for out in mixed]
    assert all(PREFILL_FLOOR <= size < 200 for size in sizes)  # never a whole chunk
    assert all(18 <= size <= 20 for size in sizes[10:])  # then each step fits 100 ms
    assert all(cost(out) <= 0.1 + 1e-9 for out in mixed)


def prefill_share(streams: int, heavy_clients: int) -> tuple[float, str]:
    """(the share of time steps with prefill took, their pattern: p prefill, d decodes
    alone) with `streams` streams beside `heavy_clients` clients' long prompts."""
    scheduler = make_scheduler(num_slots=8192, chunked_prefill_size=200, max_step_ms=100)
    cost = linear_cost(decode_s=0.02, token_s=0.004)
    for i in range(streams):
        scheduler.add(client_req(f"stream{i}", [10 + i] * 8, max_new_tokens=400))
    for _ in range(3):
        step(scheduler, cost)
    for i in range(3 * heavy_clients):
        prompt = [1000 * (i + 1) + t for t in range(240)]
        scheduler.add(client_req(f"heavy{i % heavy_clients}", prompt))
    steps = [step(scheduler, cost) for _ in range(120)]
    prefill_s = sum(cost(out) for out in steps if prefill_tokens(out))
    decode_s = sum(cost(out) for out in steps if not prefill_tokens(out))
    kinds = "".join("p" if prefill_tokens(out) else "d" for out in steps[10:])
    return prefill_s / (prefill_s + decode_s), kinds


def test_beside_another_clients_stream_a_prefill_step_is_followed_by_as_long_of_decodes():
    share, kinds = prefill_share(streams=1, heavy_clients=1)
    assert 0.4 <= share <= 0.6
    assert "pp" not in kinds and "ddddd" in kinds


def test_the_time_is_shared_by_clients_prefilling_and_decoding():
    one_of_three, _ = prefill_share(streams=2, heavy_clients=1)  # prefill owes 2 shares
    two_of_three, kinds = prefill_share(streams=1, heavy_clients=2)  # prefill owes half one
    assert 0.25 <= one_of_three <= 0.42 and 0.58 <= two_of_three <= 0.75
    assert "pp" not in kinds


def test_a_clients_own_decodes_do_not_hold_its_prefill_back():
    scheduler = make_scheduler(num_slots=8192, chunked_prefill_size=200, max_step_ms=100)
    cost = linear_cost(decode_s=0.02, token_s=0.004)
    scheduler.add(make_req(8, max_new_tokens=400))  # the same client ("") as the prompts
    for _ in range(3):
        step(scheduler, cost)
    for i in range(3):
        scheduler.add(make_req([1000 * (i + 1) + t for t in range(240)], max_new_tokens=0))
    steps = [step(scheduler, cost) for _ in range(20)]
    assert all(prefill_tokens(out) for out in steps)


def test_a_steps_prefill_never_goes_below_the_floor():
    scheduler = make_scheduler(num_slots=4096, chunked_prefill_size=512, max_step_ms=10)
    cost = linear_cost(decode_s=0.05, token_s=0.01)  # a decode alone is past 10 ms
    stream = make_req(8, max_new_tokens=200)
    scheduler.add(stream)
    step(scheduler, cost)
    big = make_req(200, max_new_tokens=0)
    scheduler.add(big)
    sizes = [prefill_tokens(step(scheduler, cost)) for _ in range(6)]
    assert all(size == PREFILL_FLOOR for size in sizes[2:])
    assert big.computed_len > 0 and stream.output_ids  # both progress


def test_without_decodes_the_step_is_bounded_too_and_max_step_ms_0_is_off():
    for max_step_ms, expected in ((100, 8), (0, 200)):
        scheduler = make_scheduler(
            num_slots=4096, chunked_prefill_size=200, max_step_ms=max_step_ms
        )
        scheduler.pace.record(0.02, 0)
        scheduler.pace.record(1.0, 100)  # 10 ms a token: 100 ms allow 8
        scheduler.add(make_req(240, max_new_tokens=0))
        assert prefill_tokens(scheduler.schedule()) == expected


def test_the_pace_follows_recent_steps_and_ignores_tiny_samples():
    pace = StepPace()
    pace.record(0.01, 0)
    pace.record(0.01 + 0.5, 100)  # 5 ms a token
    first = pace.prefill_budget(0.11, 1024)
    assert first == 20
    pace.record(5.0, 1)  # one prefill token says nothing of the cost per token
    assert pace.prefill_budget(0.11, 1024) == first
    for _ in range(20):
        pace.record(0.01 + 1.0, 100)  # the machine got slower: 10 ms a token
    assert pace.prefill_budget(0.11, 1024) == 10


# -- one client's batch does not take every step -----------------------------------------------


def test_fair_split_gives_small_demands_all_and_shares_the_rest():
    assert fair_split({"a": 5000, "b": 20}, 1024) == {"b": 20, "a": 1004}
    assert fair_split({"a": 5000, "b": 5000}, 1024) == {"a": 512, "b": 512}
    assert fair_split({"a": 100, "b": 5000, "c": 5000}, 300) == {"a": 100, "b": 100, "c": 100}
    assert fair_split({"": 3000}, 1024) == {"": 1024}


def client_req(client: str, prompt: int, max_new_tokens: int = 0):
    req = make_req(prompt, max_new_tokens=max_new_tokens)
    req.client = client
    return req


def test_admission_interleaves_two_clients_prompts():
    scheduler = make_scheduler(
        num_slots=8192, max_requests=16, chunked_prefill_size=128, schedule_policy="fcfs"
    )
    batch = [client_req("heavy", [1000 * (i + 1) + t for t in range(200)]) for i in range(10)]
    for req in batch:
        scheduler.add(req)
    step(scheduler)  # the heavy batch alone: the whole budget
    others = [client_req("light", [50 + i] * 60, max_new_tokens=4) for i in range(3)]
    for req in others:
        scheduler.add(req)  # queued behind nine of the batch's prompts
    out = step(scheduler)
    light = [s for s in out.scheduled if s.req.client == "light"]
    heavy = [s for s in out.scheduled if s.req.client == "heavy"]
    assert sum(s.num_tokens for s in light) == 64 and sum(s.num_tokens for s in heavy) == 64
    while any(r.remaining > 1 for r in others):
        out = step(scheduler)
        assert any(s.req.client == "heavy" for s in out.scheduled)  # the batch progresses too
    assert all(r.output_ids for r in others)
    assert sum(r.finished for r in batch) < 4  # the light prompts did not wait for the batch


def test_one_client_alone_gets_the_whole_budget():
    scheduler = make_scheduler(num_slots=8192, max_requests=16, chunked_prefill_size=128)
    for _ in range(4):
        scheduler.add(client_req("heavy", 200))
    assert step(scheduler).num_tokens == 128


def test_clients_share_the_time_bounded_budget():
    scheduler = make_scheduler(num_slots=8192, max_requests=16, chunked_prefill_size=200)
    scheduler.pace.record(0.02, 0)
    scheduler.pace.record(0.02 + 0.2, 100)  # 2 ms a prefill token: 250 ms allow 115
    scheduler.add(client_req("heavy", [1000 + t for t in range(240)]))
    scheduler.add(client_req("light", [50] * 8, max_new_tokens=4))
    out = scheduler.schedule()
    assert prefill_tokens(out) == 115  # the light prompt does not wait for a whole chunk
    assert {s.req.client: s.num_tokens for s in out.scheduled} == {"heavy": 107, "light": 8}
