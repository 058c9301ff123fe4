"""Speculative decoding (prompt lookup) in the Engine on the tiny random model: outputs are
identical to decoding without it, token for token (greedy, and seeded sampling, which
verification draws exactly as plain decoding does), under constraints, stop strings,
logprobs, a warm prefix cache and retraction; the KV accounting stays exact."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from support import write_tiny_model
from test_engine import make_engine, prompts

from spruce.runtime.core.options import RequestOptions
from spruce.runtime.core.sampling_params import SamplingParams
from spruce.runtime.core.validation import ValidRequest
from spruce.runtime.errors import SpruceError

GREEDY = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
ALWAYS = {"speculative_row_cost": 0.0}  # rows are free: every request drafts what it can


def repeating_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a short random span: the drafter finds matches at once."""
    return [p * 3 for p in prompts(n, seed=seed, lo=3, hi=10)]


@pytest.fixture(scope="module")
def plain(tiny_llama_dir):
    return make_engine(tiny_llama_dir, kv_memory_gb=0.05, grammar_backend="spruce")


@pytest.fixture(scope="module")
def spec(tiny_llama_dir):
    return make_engine(
        tiny_llama_dir, kv_memory_gb=0.05, grammar_backend="spruce",
        speculative_algorithm="ngram", speculative_num_draft_tokens=5, **ALWAYS,
    )  # fmt: skip


def run_both(plain, spec, params, ps, **options):
    a = plain.generate(input_ids=ps, sampling_params=params, **options)
    b = spec.generate(input_ids=ps, sampling_params=params, **options)
    spec.core.check_integrity()
    return a, b


def test_greedy_outputs_are_identical_and_drafts_are_accepted(plain, spec):
    before = spec.core.stats()
    a, b = run_both(plain, spec, GREEDY, repeating_prompts(8))
    assert [x["output_ids"] for x in a] == [y["output_ids"] for y in b]
    after = spec.core.stats()
    drafted = after["spec_draft_tokens_total"] - before["spec_draft_tokens_total"]
    accepted = after["spec_accepted_tokens_total"] - before["spec_accepted_tokens_total"]
    assert drafted > 0 and 0 < accepted <= drafted
    assert sum(y["meta_info"].get("spec_accepted_tokens", 0) for y in b) == accepted
    # fewer forward passes than tokens: accepted drafts came free
    assert after["steps_total"] - before["steps_total"] < sum(len(y["output_ids"]) for y in b)


@pytest.mark.parametrize("seed", [0, 1])
def test_seeded_sampling_is_identical(plain, spec, seed):
    params = {"temperature": 0.8, "top_p": 0.95, "max_new_tokens": 40, "ignore_eos": True,
              "seed": seed}  # fmt: skip
    a, b = run_both(plain, spec, params, repeating_prompts(4, seed=seed))
    assert [x["output_ids"] for x in a] == [y["output_ids"] for y in b]


def test_stops_lengths_and_penalties_are_identical(plain, spec):
    ps = repeating_prompts(6, seed=3)
    text = plain.generate(input_ids=ps[0], sampling_params=GREEDY)["text"]
    cases = [
        {**GREEDY, "stop": [text[5:8]]},
        {**GREEDY, "stop_token_ids": [plain.generate(input_ids=ps[1], sampling_params=GREEDY)["output_ids"][9]]},
        {**GREEDY, "max_new_tokens": 7},
        {**GREEDY, "min_new_tokens": 12, "ignore_eos": False},
        {**GREEDY, "frequency_penalty": 0.5, "repetition_penalty": 1.2},
    ]  # fmt: skip
    for params in cases:
        a, b = run_both(plain, spec, params, ps)
        assert [(x["output_ids"], x["meta_info"]["finish_reason"]) for x in a] == [
            (y["output_ids"], y["meta_info"]["finish_reason"]) for y in b
        ], params


def test_logprobs_match(plain, spec):
    ps = repeating_prompts(3, seed=4)
    a, b = run_both(plain, spec, GREEDY, ps, return_logprob=True, top_logprobs_num=2)
    for x, y in zip(a, b):
        mx, my = x["meta_info"], y["meta_info"]
        assert [t for _, t, *_ in mx["output_token_logprobs"]] == [
            t for _, t, *_ in my["output_token_logprobs"]
        ]
        for (lx, *_), (ly, *_) in zip(mx["output_token_logprobs"], my["output_token_logprobs"]):
            assert abs(lx - ly) < 1e-3  # an extend pass sums in another order than a decode


SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "string", "maxLength": 12}, "b": {"type": "integer"}},
    "required": ["a", "b"],
}


@pytest.mark.parametrize(
    "backend, jump", [("spruce", True), ("spruce", False), ("llguidance", True)]
)
def test_constrained_outputs_are_identical_and_valid(tiny_llama_dir, plain, spec, backend, jump):
    ps = repeating_prompts(6, seed=5)
    params = {"temperature": 0, "max_new_tokens": 60, "json_schema": json.dumps(SCHEMA)}
    if backend != "spruce" or not jump:
        options = {
            "kv_memory_gb": 0.05,
            "grammar_backend": backend,
            "disable_jump_forward": not jump,
        }
        plain = make_engine(tiny_llama_dir, **options)
        spec = make_engine(tiny_llama_dir, **options, speculative_algorithm="ngram", **ALWAYS)
    a, b = run_both(plain, spec, params, ps)
    assert [x["output_ids"] for x in a] == [y["output_ids"] for y in b]
    for y in b:
        if y["meta_info"]["finish_reason"]["type"] == "stop":
            assert set(json.loads(y["text"])) == {"a", "b"}
    if not jump:  # the grammar's forced text (the keys) is drafted and accepted
        assert sum(y["meta_info"].get("spec_accepted_tokens", 0) for y in b) > 0


def test_warm_cache_and_request_opt_out(plain, spec):
    ps = repeating_prompts(4, seed=6)
    first = spec.generate(input_ids=ps, sampling_params=GREEDY)
    again = spec.generate(input_ids=ps, sampling_params=GREEDY)  # prefixes cached now
    assert [x["output_ids"] for x in first] == [y["output_ids"] for y in again]
    assert all(y["meta_info"]["cached_tokens"] > 0 for y in again)
    off = spec.generate(input_ids=ps, sampling_params={**GREEDY, "speculative": False})
    assert [x["output_ids"] for x in first] == [y["output_ids"] for y in off]
    assert not any("spec_draft_tokens" in y["meta_info"] for y in off)
    spec.core.check_integrity()


@pytest.mark.parametrize("disable_radix_cache", [False, True])
def test_retraction_keeps_outputs_and_frees_every_slot(tiny_llama_dir, plain, disable_radix_cache):
    batch = [p * 3 for p in prompts(16, seed=5, lo=8, hi=20)]
    params = {**GREEDY, "max_new_tokens": 40}
    expected = [x["output_ids"] for x in plain.generate(input_ids=batch, sampling_params=params)]
    # ~4 requests' worth of slots, no reserve at admission: decoding (with drafts) must retract
    small = make_engine(
        tiny_llama_dir, kv_memory_gb=400 * 512 / 2**30, context_length=200,
        decode_reserve_ratio=0.0, disable_radix_cache=disable_radix_cache,
        speculative_algorithm="ngram", **ALWAYS,
    )  # fmt: skip
    got = [y["output_ids"] for y in small.generate(input_ids=batch, sampling_params=params)]
    assert got == expected
    stats = small.stats()
    assert stats["retractions_total"] > 0 and stats["spec_accepted_tokens_total"] > 0
    small.core.cache_manager.check_integrity([])
    small.flush_cache()
    assert small.stats()["kv_slots_free"] == small.stats()["kv_slots_total"]


def test_an_abort_while_drafting_frees_its_slots(spec):
    core, ps = spec.core, repeating_prompts(3, seed=8)
    sampling = SamplingParams(**{**GREEDY, "max_new_tokens": 200})
    reqs = [core.add_request(ValidRequest(p, sampling, RequestOptions(), None)) for p in ps]
    while not any(r.spec is not None and r.spec.drafted for r in reqs):
        core.step()
    for r in reqs:
        core.abort(r.rid)
    while core.has_work():
        core.step()
    assert all(r.finish_reason.type == "abort" for r in reqs)
    core.check_integrity()
    spec.flush_cache()
    assert spec.stats()["kv_slots_free"] == spec.stats()["kv_slots_total"]


# -- a draft model ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def other_tiny_dir(tmp_path_factory):
    """Another random tiny model with the same tokenizer (a draft that is often wrong)."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny-draft"), "llama", seed=1)


@pytest.mark.parametrize("draft", ["same", "other"])
def test_a_draft_model_keeps_outputs_identical(tiny_llama_dir, other_tiny_dir, plain, draft):
    path = tiny_llama_dir if draft == "same" else other_tiny_dir
    spec = make_engine(
        tiny_llama_dir, kv_memory_gb=0.05, speculative_algorithm="draft",
        speculative_draft_model_path=str(path), **ALWAYS,
    )  # fmt: skip
    ps = prompts(6, seed=9)
    cases = [GREEDY, {**GREEDY, "temperature": 0.9, "seed": 3}, {**GREEDY, "stop": ["a"]}]
    for params in cases:
        a, b = run_both(plain, spec, params, ps)
        assert [x["output_ids"] for x in a] == [y["output_ids"] for y in b], params
    stats = spec.stats()
    drafted, accepted = stats["spec_draft_tokens_total"], stats["spec_accepted_tokens_total"]
    if draft == "same":  # the target itself: every greedy draft is accepted
        greedy = spec.generate(input_ids=ps, sampling_params=GREEDY)
        metas = [y["meta_info"] for y in greedy]
        assert all(m["spec_accepted_tokens"] == m["spec_draft_tokens"] > 0 for m in metas)
    else:
        assert 0 <= accepted < drafted
    drafter = spec.core.scheduler.speculator.drafter
    assert drafter.held_slots == 0 and not drafter.state  # every request's draft state went


def test_a_draft_model_with_another_tokenizer_is_refused(tiny_llama_dir, tmp_path):
    other = write_tiny_model(tmp_path / "other-vocab", "llama")
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    a, b = (next(t for t, i in vocab.items() if i == n) for n in (300, 301))
    vocab[a], vocab[b] = 301, 300  # two tokens numbered the other way round
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(SpruceError, match="another tokenizer"):
        make_engine(
            tiny_llama_dir, speculative_algorithm="draft", speculative_draft_model_path=str(other)
        )


def test_the_grammars_forced_text_is_drafted(tiny_llama_dir):
    """Jump-forward off: the text the regex forces is drafted (no repeats to look up)."""
    options = {"kv_memory_gb": 0.05, "grammar_backend": "spruce", "disable_jump_forward": True}
    plain = make_engine(tiny_llama_dir, **options)
    spec = make_engine(tiny_llama_dir, **options, speculative_algorithm="ngram", **ALWAYS)
    params = {"temperature": 0, "max_new_tokens": 60,
              "regex": r"Answer: the quick brown fox jumps over the lazy dog\. [0-9]{2}"}  # fmt: skip
    ps = prompts(3, seed=11)
    a, b = run_both(plain, spec, params, ps)
    assert [x["output_ids"] for x in a] == [y["output_ids"] for y in b]
    assert all(y["text"].startswith("Answer: the quick brown fox") for y in b)
    assert sum(y["meta_info"].get("spec_accepted_tokens", 0) for y in b) > 10


def test_sampled_outputs_keep_the_target_distribution(tiny_llama_dir, plain):
    """Unseeded sampling (the shared generator, so spec and plain draw differently): the
    joint distribution of the first three tokens, top_k=2 so it has at most 8 outcomes, is
    the same with drafts as without (a chi-square test of homogeneity; the engines' seeds
    are fixed, so the test is deterministic)."""
    spec = make_engine(tiny_llama_dir, kv_memory_gb=0.05, speculative_algorithm="ngram",
                       speculative_max_batch_size=256, speculative_ngram_min_match_window_size=1,
                       **ALWAYS)  # fmt: skip
    start = repeating_prompts(1, seed=12)[0]  # then the model's own greedy loop: drafts hit
    prompt = start + plain.generate(input_ids=start, sampling_params=GREEDY)["output_ids"]
    params = {"temperature": 1.0, "top_k": 2, "max_new_tokens": 5, "ignore_eos": True}
    before = spec.stats()["spec_accepted_tokens_total"]
    counts = []
    for engine in (plain, spec):
        outs = [o for _ in range(2) for o in engine.generate(input_ids=[prompt] * 200, sampling_params=params)]  # fmt: skip
        counts.append(Counter(tuple(o["output_ids"][:3]) for o in outs))
    assert spec.stats()["spec_accepted_tokens_total"] > before + 50  # drafts were verified
    cells = sorted(set(counts[0]) | set(counts[1]))
    assert len(cells) >= 4
    chi2 = 0.0
    for cell in cells:
        a, b = counts[0][cell], counts[1][cell]
        expected = (a + b) / 2
        chi2 += (a - expected) ** 2 / expected + (b - expected) ** 2 / expected
    # the 0.999 quantile of chi-square with (cells - 1) <= 7 degrees of freedom is <= 24.3
    assert chi2 < 24.3, (chi2, counts)


def test_two_threads_keep_outputs_identical(tiny_llama_dir, plain):
    """Drafts are decode rows of one request, spread over threads by the attention kernel:
    each row must see the K/V the rows before it stored (a float16 cache, the C decode path)."""
    options = {"kv_memory_gb": 0.05, "num_threads": 2, "kv_cache_dtype": "float16"}
    two = make_engine(tiny_llama_dir, **options)
    spec = make_engine(tiny_llama_dir, **options, speculative_algorithm="ngram",
                       speculative_num_draft_tokens=6, **ALWAYS)  # fmt: skip
    ps = repeating_prompts(8, seed=13)
    params = {**GREEDY, "max_new_tokens": 64}
    for _ in range(3):
        a, b = run_both(two, spec, params, ps)
        assert [x["output_ids"] for x in a] == [y["output_ids"] for y in b]
    assert spec.stats()["spec_accepted_tokens_total"] > 100


@pytest.mark.slow
def test_bundled_model_outputs_are_identical_on_its_decode_plan():
    """The quantized model's C decode path with drafts (rows sharing a request, K/V written
    before the kernel attends), two threads: greedy outputs equal plain decoding's."""
    from support import bundled_gguf_path

    from spruce.runtime import Engine

    if bundled_gguf_path() is None:
        pytest.skip("the bundled model is not installed")
    plain = Engine(num_threads=2, kv_memory_gb=0.2)
    spec = Engine(loaded=plain.core.loaded, num_threads=2, kv_memory_gb=0.2,
                  speculative_algorithm="ngram", **ALWAYS)  # fmt: skip
    text = "Invoice INV-4821 went to Harriet Kowalski of Larkspur for 3,412.50 EUR."
    ask = f"{text}\nRepeat the invoice line exactly, twice."
    prompt = plain.apply_chat_template([{"role": "user", "content": ask}])
    params = {"temperature": 0, "max_new_tokens": 64}
    ids = plain.tokenizer.encode(prompt, add_special_tokens=False)
    a, b = run_both(plain, spec, params, [ids, ids[:-1]])
    assert [x["output_ids"] for x in a] == [y["output_ids"] for y in b]
    assert sum(y["meta_info"].get("spec_accepted_tokens", 0) for y in b) > 10
