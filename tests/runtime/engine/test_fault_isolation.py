"""Fault isolation on the tiny model: a forward pass that raises is rolled back and retried
(same tokens as a clean run, no leaked slot); a request whose own row fails is aborted alone;
the same through the real server, next to a streaming client."""

from __future__ import annotations

import sys
import textwrap
import threading
from pathlib import Path

import httpx
import pytest
import torch
from support import stream_ids

from spruce.constrained import ConstraintSpec, make_spec
from spruce.runtime import Engine
from spruce.runtime.core.options import RequestOptions
from spruce.runtime.core.request import Req
from spruce.runtime.core.sampling_params import SamplingParams
from spruce.runtime.core.validation import ValidRequest
from spruce.runtime.engine import core as core_module
from spruce.runtime.executor.sampler import Sampler
from spruce.runtime.scheduler.faults import MAX_FAILURES_ALONE, RequestFault

GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}


def make_engine(folder, **options) -> Engine:
    options = {"kv_memory_gb": 0.02, "num_threads": 1, "chunked_prefill_size": 64, **options}
    return Engine(str(folder), **options)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 40, (n,), generator=g).tolist()
    return [torch.randint(3, 384, (k,), generator=g).tolist() for k in lengths]


def output_ids(results) -> list[list[int]]:
    return [r["output_ids"] for r in results]


def assert_idle_and_exact(engine: Engine) -> None:
    """No request left, pool accounting exact, and no slot held once the cache is flushed."""
    engine.core.check_integrity()
    engine.flush_cache()
    assert engine.stats()["kv_slots_used"] == 0


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return make_engine(tiny_llama_dir)


@pytest.fixture(scope="module")
def batch() -> list[list[int]]:
    return prompts(16, seed=3)


@pytest.fixture(scope="module")
def clean(engine, batch) -> list[list[int]]:
    out = output_ids(engine.generate(input_ids=batch, sampling_params=GREEDY))
    assert_idle_and_exact(engine)
    return out


def fail_forward_on_call(engine: Engine, monkeypatch, calls: set[int]) -> dict:
    """Makes the model runner's forward raise on the given call numbers (1-based)."""
    forward = engine.core.runner.forward
    count = {"n": 0, "failed": 0}

    def flaky(items):
        count["n"] += 1
        if count["n"] in calls:
            count["failed"] += 1
            raise RuntimeError("injected forward failure")
        return forward(items)

    monkeypatch.setattr(engine.core.runner, "forward", flaky)
    return count


# -- a whole forward pass fails ---------------------------------------------------------------------


def test_a_forward_pass_raising_once_mid_batch_changes_no_output(engine, batch, clean, monkeypatch):
    failed_before = engine.core.scheduler.stats.failed_steps
    count = fail_forward_on_call(engine, monkeypatch, {4})  # prefill chunks and decodes in flight
    results = engine.generate(input_ids=batch, sampling_params=GREEDY)
    assert count["failed"] == 1
    assert output_ids(results) == clean
    assert all(r["meta_info"]["finish_reason"]["type"] == "length" for r in results)
    assert engine.stats()["failed_steps_total"] == failed_before + 1
    assert_idle_and_exact(engine)


def test_a_request_that_breaks_every_pass_is_aborted_and_the_others_finish(
    engine, batch, clean, monkeypatch
):
    poison = [7, 7, 7, 7, 7, 7, 7, 7, 7, 7]
    forward = engine.core.runner.forward

    def breaks_on_poison(items):
        if any(item.new_ids[:10] == poison for item in items):
            raise RuntimeError("this batch holds the poison prompt")
        return forward(items)

    monkeypatch.setattr(engine.core.runner, "forward", breaks_on_poison)
    core = engine.core
    bad = core.add_request(ValidRequest(poison, SamplingParams(**GREEDY), RequestOptions(), None))
    good = [
        core.add_request(ValidRequest(p, SamplingParams(**GREEDY), RequestOptions(), None))
        for p in batch[:4]
    ]
    failed_before = core.scheduler.stats.failed_steps
    while core.has_work():
        core.step()
    assert bad.finish_reason.type == "abort" and isinstance(bad.error, RequestFault)
    assert "poison" in bad.finish_reason.message
    assert core.scheduler.stats.failed_steps - failed_before == 1 + MAX_FAILURES_ALONE
    assert [r.output_ids for r in good] == clean[:4]
    assert_idle_and_exact(engine)


# -- one request's row fails ---------------------------------------------------------------------


def test_a_sampling_row_that_raises_aborts_that_request_alone(engine, batch, clean, monkeypatch):
    generator_of = Sampler._generator_of

    def broken_for_seed_13(self, req: Req):
        if req.sampling.seed == 13:
            raise RuntimeError("injected sampling failure")
        return generator_of(self, req)

    monkeypatch.setattr(Sampler, "_generator_of", broken_for_seed_13)
    core = engine.core
    good = [
        core.add_request(ValidRequest(p, SamplingParams(**GREEDY), RequestOptions(), None))
        for p in batch[:6]
    ]
    sampled = SamplingParams(temperature=0.8, seed=13, max_new_tokens=12)
    bad = core.add_request(ValidRequest(batch[6], sampled, RequestOptions(), None))
    while core.has_work():
        core.step()
    assert (
        bad.finish_reason.type == "abort"
        and bad.finish_reason.message == "sampling failed (see the server log)"
    )
    assert isinstance(bad.error, RequestFault)
    assert [r.output_ids for r in good] == clean[:6]
    assert_idle_and_exact(engine)


def test_the_failing_request_raises_from_its_own_generate_call_only(
    engine, batch, clean, monkeypatch
):
    generator_of = Sampler._generator_of

    def broken_for_seed_13(self, req: Req):
        if req.sampling.seed == 13:
            raise RuntimeError("injected sampling failure")
        return generator_of(self, req)

    monkeypatch.setattr(Sampler, "_generator_of", broken_for_seed_13)
    with pytest.raises(RequestFault, match=r"sampling failed \(see the server log\)"):
        engine.generate(
            input_ids=batch[:2], sampling_params=[GREEDY, {"temperature": 0.8, "seed": 13}]
        )
    assert output_ids(engine.generate(input_ids=batch[:3], sampling_params=GREEDY)) == clean[:3]
    assert_idle_and_exact(engine)


def test_interleaved_calls_each_get_their_own_output_and_only_theirs_fails(
    engine, batch, clean, monkeypatch
):
    generator_of = Sampler._generator_of

    def broken_for_seed_13(self, req: Req):
        if req.sampling.seed == 13:
            raise RuntimeError("injected sampling failure")
        return generator_of(self, req)

    monkeypatch.setattr(Sampler, "_generator_of", broken_for_seed_13)
    good = engine.generate(input_ids=batch[:2], sampling_params=GREEDY, stream=True)
    bad = engine.generate(
        input_ids=batch[2], sampling_params={"temperature": 0.8, "seed": 13}, stream=True
    )
    first = next(good)  # steps run by this call also carry the other call's news
    middle = engine.generate(input_ids=batch[3], sampling_params=GREEDY)  # a whole call in between
    bad_chunks = list(bad)
    good_chunks = [first, *good]
    assert middle["output_ids"] == clean[3]
    for i in range(2):
        assert [t for c in good_chunks if c["index"] == i for t in c["output_ids"]] == clean[i]
    assert (
        bad_chunks[-1]["finished"]
        and bad_chunks[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    )
    assert (
        bad_chunks[-1]["meta_info"]["finish_reason"]["message"]
        == "sampling failed (see the server log)"
    )
    assert not engine._live and not engine._news
    assert_idle_and_exact(engine)


def test_a_grammar_mask_that_raises_for_one_row_aborts_that_request_alone(
    engine, batch, clean, monkeypatch
):
    mask = engine.core.grammar_mask
    victim = {}

    def broken_for_victim(logits, reqs):
        if any(r is victim.get("req") for r in reqs):
            raise RuntimeError("injected cursor failure")
        return mask(logits, reqs)

    monkeypatch.setattr(engine.core, "grammar_mask", broken_for_victim)
    core = engine.core
    constraint = make_spec(regex="[a-z ]{1,20}")
    fine = core.add_request(
        ValidRequest(batch[0], SamplingParams(**GREEDY), RequestOptions(), constraint)
    )
    victim["req"] = core.add_request(
        ValidRequest(batch[1], SamplingParams(**GREEDY), RequestOptions(), constraint)
    )
    plain = core.add_request(
        ValidRequest(batch[2], SamplingParams(**GREEDY), RequestOptions(), None)
    )
    while core.has_work():
        core.step()
    assert victim["req"].finish_reason.type == "abort"
    assert victim["req"].finish_reason.message == "the grammar mask failed (see the server log)"
    assert fine.finish_reason.type in ("stop", "length") and fine.error is None
    assert plain.output_ids == clean[2]
    assert_idle_and_exact(engine)


def test_prompt_logprobs_that_raise_abort_that_request_alone(engine, batch, clean, monkeypatch):
    real = core_module.prompt_logprobs
    victim = {}

    def broken_for_victim(req, rows, first_pos):
        if req is victim.get("req"):
            raise RuntimeError("injected prompt-logprob failure")
        return real(req, rows, first_pos)

    monkeypatch.setattr(core_module, "prompt_logprobs", broken_for_victim)
    core = engine.core
    wants = RequestOptions(return_logprob=True, logprob_start_len=0)
    greedy = SamplingParams(**GREEDY)
    good = [core.add_request(ValidRequest(p, greedy, RequestOptions(), None)) for p in batch[:3]]
    scored = core.add_request(ValidRequest(batch[3], greedy, wants, None))
    bad = victim["req"] = core.add_request(ValidRequest(batch[4], greedy, wants, None))
    while core.has_work():
        core.step()
    assert bad.finish_reason.type == "abort"
    assert bad.finish_reason.message == "computing prompt logprobs failed (see the server log)"
    assert bad.output_ids == [] and isinstance(bad.error, RequestFault)
    assert [r.output_ids for r in good] == clean[:3] and scored.output_ids == clean[3]
    assert len(scored.logprobs.input_token_logprobs) == len(batch[3])
    assert_idle_and_exact(engine)


def test_a_grammar_build_past_its_deadline_fails_its_request_while_others_run(
    tiny_llama_dir, batch, clean
):
    """The build's deadline is read on a clock the test moves: the others finish while the
    build is in flight (not held up by it), then the deadline passes and only it fails."""
    engine = make_engine(tiny_llama_dir, grammar_timeout_s=2)
    core = engine.core
    engine.generate("warm up", {"max_new_tokens": 2, "regex": "[a-z]+"})  # a build worker is up
    clock = FakeClock()
    core.compiler.clock = core.compiler._deadlines.clock = clock
    huge = "(?:[ab]{1000}){1000}"  # a million NFA positions: seconds to build (past make_spec's size cap)
    exploding = ConstraintSpec("regex", huge, huge)
    stuck = core.add_request(
        ValidRequest(batch[0], SamplingParams(**GREEDY), RequestOptions(), exploding)
    )
    others = [
        core.add_request(ValidRequest(p, SamplingParams(**GREEDY), RequestOptions(), None))
        for p in batch[:4]
    ]
    while not all(r.finished for r in others):
        core.step()
    assert [r.output_ids for r in others] == clean[:4]
    assert not stuck.finished  # its build is still in flight on the unmoved clock
    clock.now += 3
    while core.has_work():
        core.step()
    assert (
        stuck.finish_reason.type == "abort"
        and "not compiled within 2 s" in stuck.finish_reason.message
    )
    assert_idle_and_exact(engine)
    engine.shutdown()


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_tiny_temperature_that_bypassed_validation_samples_by_argmax(engine, batch, clean):
    core = engine.core
    tiny = SamplingParams(**{**GREEDY, "temperature": 1e-40})
    req = core.add_request(ValidRequest(batch[0], tiny, RequestOptions(), None))
    while core.has_work():
        core.step()
    assert req.error is None and req.output_ids == clean[0]
    assert_idle_and_exact(engine)


def test_the_sampler_keeps_bad_rows_to_themselves():
    sampler = Sampler(vocab_size=8, eos_token_ids=frozenset({0}), device=torch.device("cpu"))
    reqs = [
        Req(f"r{i}", [1, 2], SamplingParams(temperature=t))
        for i, t in enumerate([0, 0.7, 0.7, 1e-30])
    ]
    logits = torch.randn(4, 8)
    logits[1, 3] = float("nan")  # NaN from the model
    logits[2] = float("-inf")  # every token masked
    logits[3, 5] = 50.0
    out = sampler.sample(logits.clone(), reqs)
    assert set(out.errors) == {1, 2} and out.ids[1] is None and out.ids[2] is None
    assert out.ids[0] == int(logits[0].argmax()) and out.ids[3] == 5


# -- through the real server ---------------------------------------------------------------------

POISON = [9, 9, 9, 9, 9, 9, 9, 9]
# Runs `spruce serve` with a model runner whose forward raises on any batch holding the
# poison prompt. The scheduler process is spawned: it re-runs this file as __mp_main__,
# so the patch applies there too.
FAULTY_SERVE = f"""
import sys
import os
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # tests share two cores among processes
from spruce.runtime.executor.model_runner import ModelRunner

forward = ModelRunner.forward

def poisoned_forward(self, items):
    if any(list(item.new_ids[:{len(POISON)}]) == {POISON} for item in items):
        raise RuntimeError("injected: this batch holds the poison prompt")
    return forward(self, items)

ModelRunner.forward = poisoned_forward

if __name__ == "__main__":
    from spruce.runtime.cli import main
    sys.exit(main())
"""


def start_faulty_server(model_dir: Path, tmp_path: Path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
    from test_server import start_server

    script = tmp_path / "faulty_serve.py"
    script.write_text(textwrap.dedent(FAULTY_SERVE))
    return start_server(model_dir, tmp_path / "server.log", script=script)


def kv_slots_used(client: httpx.Client) -> int:
    return client.get("/server_info").json()["scheduler"]["kv_slots_used"]


@pytest.mark.slow  # its own server: about a minute on a loaded 2-core machine
def test_a_request_that_breaks_the_step_fails_alone_next_to_a_stream(tiny_llama_dir, tmp_path):
    server = start_faulty_server(tiny_llama_dir, tmp_path)
    try:
        with httpx.Client(base_url=server.url, timeout=120) as client:
            body = {
                "input_ids": list(range(20, 40)),
                "sampling_params": {**GREEDY, "max_new_tokens": 400},
            }
            alone = stream_ids(client, body)
            client.post("/flush_cache")
            idle = kv_slots_used(client)
            started, streamed = threading.Event(), {}
            thread = threading.Thread(
                target=lambda: streamed.update(ids=stream_ids(client, body, started))
            )
            thread.start()
            assert started.wait(60)
            bad = client.post(
                "/generate", json={"input_ids": POISON + [5], "sampling_params": GREEDY}
            )
            thread.join(120)
            assert bad.status_code == 500 and "poison" in bad.text
            assert streamed["ids"] == alone and len(alone) == 400
            assert "forward pass over 2 request(s) failed" in server.log()  # they shared a step
            assert client.get("/health").status_code == 200
            client.post("/flush_cache")
            assert kv_slots_used(client) == idle == 0
    finally:
        from test_server import stop_server

        assert stop_server(server) == 0, server.log()
