"""The offline Engine on a tiny fp32 model: batching, chunking, retraction, sampling,
stop handling, logprobs and bad input."""

from __future__ import annotations

import pytest
import torch
import transformers
from support import add_request

from spruce.runtime import Engine, InvalidRequestError, SamplingParams
from spruce.runtime.core.request import Req
from spruce.runtime.errors import SpruceError
from spruce.runtime.executor.sampler import Sampler

GREEDY = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}


def make_engine(folder, **options) -> Engine:
    # a float32 cache, so tokens and logprobs can be compared with transformers'
    options = {"kv_memory_gb": 0.02, "num_threads": 1, "kv_cache_dtype": "float32", **options}
    return Engine(str(folder), **options)


def prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 40) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(3, 384, (k,), generator=g).tolist() for k in lengths]


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return make_engine(tiny_llama_dir)


@pytest.fixture(scope="module")
def hf(tiny_llama_dir):
    return transformers.LlamaForCausalLM.from_pretrained(tiny_llama_dir).eval()


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None)
    return out[0, len(ids) :].tolist()


def ids_of(results) -> list[list[int]]:
    return [r["output_ids"] for r in results]


# -- batching ---------------------------------------------------------------------------


def test_batch_invariance_and_transformers_equality(engine, hf):
    batch = prompts(8, seed=1)
    together = ids_of(engine.generate(input_ids=batch, sampling_params=GREEDY))
    alone = [engine.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in batch]
    assert together == alone
    assert together == [hf_greedy(hf, p, 16) for p in batch]


def test_cpu_default_cache_is_float16_and_batch_invariant(tiny_llama_dir):
    engine = Engine(str(tiny_llama_dir), kv_memory_gb=0.02, num_threads=1)
    assert engine.core.runner.pool.shape.dtype == torch.float16
    batch = prompts(8, seed=1)
    together = ids_of(engine.generate(input_ids=batch, sampling_params=GREEDY))
    assert together == [
        engine.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in batch
    ]
    engine.shutdown()


def test_int8_cache_is_batch_invariant_and_cpu_only(tiny_llama_dir):
    """--kv-cache-dtype int8: prefill writes through the pool (torch), decode through the C
    kernel; both quantize alike, so a request's tokens do not depend on its batch."""
    engine = Engine(str(tiny_llama_dir), kv_memory_gb=0.02, num_threads=1, kv_cache_dtype="int8")
    pool = engine.core.runner.pool
    assert pool.shape.dtype == torch.int8 and pool.scales(0) is not None
    batch = prompts(8, seed=1)
    together = ids_of(engine.generate(input_ids=batch, sampling_params=GREEDY))
    assert together == [
        engine.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in batch
    ]
    with pytest.raises(SpruceError, match="CPU only"):
        engine.core._kv_dtype("cuda")
    engine.shutdown()


def test_requests_join_while_others_decode(engine):
    first, second = prompts(2, seed=2)
    expected = [
        engine.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in (first, second)
    ]
    core = engine.core
    a = add_request(core, first, GREEDY)
    while len(a.output_ids) < 4:  # one step may decode several tokens (decode_steps)
        core.step()
    assert not a.finished
    b = add_request(core, second, GREEDY)
    while not (a.finished and b.finished):
        core.step()
    assert [a.output_ids, b.output_ids] == expected


def test_stream_yields_before_long_request_finishes(engine):
    short, long = prompts(2, seed=3)
    params = [{**GREEDY, "max_new_tokens": 3}, {**GREEDY, "max_new_tokens": 30}]
    chunks = list(engine.generate(input_ids=[short, long], sampling_params=params, stream=True))
    finished_order = [c["index"] for c in chunks if c["finished"]]
    assert finished_order == [0, 1]
    first_long_finish = next(i for i, c in enumerate(chunks) if c["index"] == 1 and c["finished"])
    assert any(c["index"] == 0 for c in chunks[:first_long_finish])
    streamed = [t for c in chunks if c["index"] == 1 for t in c["output_ids"]]
    assert streamed == engine.generate(input_ids=long, sampling_params=params[1])["output_ids"]


def test_chunked_prefill_matches_unchunked(tiny_llama_dir, engine):
    long_prompts = prompts(3, seed=4, lo=50, hi=90)
    chunked = make_engine(tiny_llama_dir, chunked_prefill_size=16)
    got = ids_of(chunked.generate(input_ids=long_prompts, sampling_params=GREEDY))
    assert got == ids_of(engine.generate(input_ids=long_prompts, sampling_params=GREEDY))


@pytest.mark.parametrize("disable_radix_cache", [False, True])
def test_retraction_keeps_outputs_and_frees_every_slot(tiny_llama_dir, engine, disable_radix_cache):
    batch = prompts(16, seed=5, lo=20, hi=60)
    params = {**GREEDY, "max_new_tokens": 40}
    expected = ids_of(engine.generate(input_ids=batch, sampling_params=params))
    # ~4 requests' worth of slots, no reserve at admission: decoding must retract
    small = make_engine(
        tiny_llama_dir,
        kv_memory_gb=400 * 512 / 2**30,
        context_length=200,
        decode_reserve_ratio=0.0,
        disable_radix_cache=disable_radix_cache,
    )
    got = ids_of(small.generate(input_ids=batch, sampling_params=params))
    assert got == expected
    assert small.stats()["retractions_total"] > 0
    small.core.cache_manager.check_integrity([])
    small.flush_cache()
    assert small.stats()["kv_slots_free"] == small.stats()["kv_slots_total"]


# -- sampling ---------------------------------------------------------------------------


def test_top_k_1_equals_greedy(engine):
    p = prompts(1, seed=6)[0]
    greedy = engine.generate(input_ids=p, sampling_params=GREEDY)["output_ids"]
    top1 = engine.generate(input_ids=p, sampling_params={**GREEDY, "temperature": 0.9, "top_k": 1})
    assert top1["output_ids"] == greedy


def test_same_seed_same_output_in_any_batch(engine):
    batch = prompts(4, seed=7)
    seeded = {"temperature": 1.0, "max_new_tokens": 16, "seed": 1234, "ignore_eos": True}
    alone = engine.generate(input_ids=batch[0], sampling_params=seeded)["output_ids"]
    others = [{**seeded, "seed": None, "top_p": 0.9}] * 3
    together = engine.generate(input_ids=batch, sampling_params=[seeded, *others])
    assert together[0]["output_ids"] == alone
    other_seed = engine.generate(input_ids=batch[0], sampling_params={**seeded, "seed": 99})
    assert other_seed["output_ids"] != alone


def test_sampling_respects_top_p_support(engine):
    # with top_p tiny only the most likely token survives: equals greedy
    p = prompts(1, seed=8)[0]
    greedy = engine.generate(input_ids=p, sampling_params=GREEDY)["output_ids"]
    nucleus = engine.generate(
        input_ids=p, sampling_params={**GREEDY, "temperature": 1.0, "top_p": 1e-6}
    )
    assert nucleus["output_ids"] == greedy


def test_penalties_match_direct_computation():
    sampler = Sampler(vocab_size=10, eos_token_ids=frozenset({2}), device=torch.device("cpu"))
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.3, repetition_penalty=1.5)
    req = Req("r", prompt_ids=[7], sampling=params, output_ids=[1, 1, 4])
    logits = torch.tensor([[0.5, 2.0, 1.0, -1.0, -2.0, 0.1, 0.2, 3.0, -0.5, 0.0]])
    got = sampler.process_logits(logits.clone(), [req])
    expected = logits.clone()
    counts = {1: 2, 4: 1}
    for tok, c in counts.items():
        expected[0, tok] -= 0.5 * c + 0.3
    for tok in (1, 4, 7):  # repetition penalty over prompt + output
        v = expected[0, tok]
        expected[0, tok] = v / 1.5 if v > 0 else v * 1.5
    torch.testing.assert_close(got, expected)


def test_min_new_tokens_suppresses_stop_tokens(engine):
    p = prompts(1, seed=9)[0]
    first = engine.generate(input_ids=p, sampling_params=GREEDY)["output_ids"][0]
    stopped = engine.generate(input_ids=p, sampling_params={**GREEDY, "stop_token_ids": [first]})
    assert stopped["output_ids"] == [first]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": first}
    held = engine.generate(
        input_ids=p, sampling_params={**GREEDY, "stop_token_ids": [first], "min_new_tokens": 5}
    )
    assert len(held["output_ids"]) >= 5 and first not in held["output_ids"][:5]


def test_stop_string_split_across_tokens_is_trimmed(engine):
    tok = engine.tokenizer
    for seed in range(10, 40):
        p = prompts(1, seed=seed)[0]
        out = engine.generate(input_ids=p, sampling_params={**GREEDY, "max_new_tokens": 24})
        pieces = [tok.decode([t]) for t in out["output_ids"]]
        for i in range(1, len(pieces) - 1):
            a, b = pieces[i], pieces[i + 1]
            if a.isprintable() and b.isprintable() and a.strip() and b.strip():
                stop = a[-1] + b[0]
                full = out["text"]
                res = engine.generate(
                    input_ids=p, sampling_params={**GREEDY, "max_new_tokens": 24, "stop": [stop]}
                )
                assert res["text"] == full[: full.index(stop)]
                assert res["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
                return
    pytest.fail("no printable token boundary found to test")


def test_stop_string_streaming_never_leaks(engine):
    p = prompts(1, seed=11)[0]
    full = engine.generate(input_ids=p, sampling_params={**GREEDY, "max_new_tokens": 24})["text"]
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    if not stop.strip():
        pytest.skip("degenerate text")
    chunks = engine.generate(
        input_ids=p, sampling_params={**GREEDY, "max_new_tokens": 24, "stop": stop}, stream=True
    )
    assert "".join(c["text"] for c in chunks) == full[: full.index(stop)]


# -- logprobs ---------------------------------------------------------------------------


def test_prompt_logprobs_equal_transformers(engine, hf):
    p = prompts(1, seed=12, lo=20, hi=21)[0]
    engine.generate(input_ids=p, sampling_params=GREEDY)  # cached first: must be recomputed
    out = engine.generate(
        input_ids=p,
        sampling_params={**GREEDY, "max_new_tokens": 2},
        return_logprob=True,
        logprob_start_len=0,
        top_logprobs_num=3,
    )
    info = out["meta_info"]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([p])).logits[0], -1)
    got = info["input_token_logprobs"]
    assert got[0] == [None, p[0]]
    expected = [float(ref[i - 1, p[i]]) for i in range(1, len(p))]
    torch.testing.assert_close(
        torch.tensor([g[0] for g in got[1:]]), torch.tensor(expected), atol=1e-4, rtol=0
    )
    assert [g[1] for g in got] == p
    top = info["input_top_logprobs"][1]
    assert [t[1] for t in top] == ref[0].topk(3).indices.tolist()
    first_out = info["output_token_logprobs"][0]
    assert first_out[1] == out["output_ids"][0]
    assert abs(first_out[0] - float(ref[-1, first_out[1]])) < 1e-4


def test_prompt_logprobs_from_a_start_position(engine):
    p = prompts(1, seed=13, lo=30, hi=31)[0]
    full = engine.generate(
        input_ids=p,
        sampling_params={**GREEDY, "max_new_tokens": 1},
        return_logprob=True,
        logprob_start_len=0,
    )
    part = engine.generate(
        input_ids=p,
        sampling_params={**GREEDY, "max_new_tokens": 1},
        return_logprob=True,
        logprob_start_len=10,
    )
    tail = full["meta_info"]["input_token_logprobs"][10:]
    got = part["meta_info"]["input_token_logprobs"]
    assert [g[1] for g in got] == [t[1] for t in tail]
    torch.testing.assert_close(
        torch.tensor([g[0] for g in got]), torch.tensor([t[0] for t in tail]), atol=1e-4, rtol=0
    )


def test_max_new_tokens_zero_caches_prompt(engine):
    p = prompts(1, seed=14, lo=30, hi=31)[0]
    out = engine.generate(input_ids=p, sampling_params={"max_new_tokens": 0})
    assert out["output_ids"] == [] and out["meta_info"]["finish_reason"]["type"] == "length"
    again = engine.generate(input_ids=p + [5, 6], sampling_params=GREEDY)
    assert again["meta_info"]["cached_tokens"] == len(p)


# -- bad input --------------------------------------------------------------------------

BAD_PARAMS = [
    ({"temperature": -1}, "temperature must be >= 0"),
    ({"top_p": 0}, r"top_p must be in \(0, 1\]"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ({"top_k": 0}, "top_k must be -1"),
    ({"min_p": 2}, "min_p must be in"),
    ({"max_new_tokens": -1}, "max_new_tokens must be an integer >= 0"),
    ({"min_new_tokens": 5, "max_new_tokens": 2}, "min_new_tokens must not exceed"),
    ({"frequency_penalty": 3}, "frequency_penalty must be in"),
    ({"repetition_penalty": 0}, "repetition_penalty must be in"),
    ({"stop": [""]}, "stop must be a string or a list of non-empty strings"),
    ({"stop": 5}, "stop must be a string or a list"),
    ({"stop_token_ids": "x"}, "stop_token_ids must be a list"),
    ({"ignore_eos": "yes"}, "ignore_eos must be true or false"),
    ({"temprature": 0.5}, "unknown sampling parameter"),
    ({"regex": "a", "json_schema": {}}, "at most one constraint"),
]


@pytest.mark.parametrize("params,message", BAD_PARAMS)
def test_bad_sampling_params_are_rejected(engine, params, message):
    with pytest.raises(InvalidRequestError, match=message):
        engine.generate(input_ids=[5, 6, 7], sampling_params=params)
    assert (
        engine.generate(input_ids=[5, 6, 7], sampling_params=GREEDY)["meta_info"][
            "completion_tokens"
        ]
        == 16
    )


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"input_ids": [5] * 1024}, "context is 1024 tokens"),
        (
            {"input_ids": [5] * 1000, "sampling_params": {"max_new_tokens": 100}},
            "exceeds the context length",
        ),
        ({"input_ids": []}, "empty"),
        ({"input_ids": [5, 999999]}, "token ids in"),
        ({"prompt": 5}, "prompt must be a string"),
        ({"prompt": "a", "input_ids": [1]}, "exactly one of prompt or input_ids"),
        ({"input_ids": [[5, 6], [7]], "sampling_params": [{}]}, "1 sampling_params for 2 prompts"),
    ],
)
def test_bad_requests_are_rejected_and_engine_keeps_serving(engine, kwargs, message):
    with pytest.raises(InvalidRequestError, match=message):
        engine.generate(**kwargs)
    assert (
        engine.generate(prompt="hello", sampling_params=GREEDY)["meta_info"]["completion_tokens"]
        == 16
    )


def test_unknown_engine_option(tiny_llama_dir):
    with pytest.raises(InvalidRequestError, match="unknown option 'max_batch'"):
        Engine(str(tiny_llama_dir), max_batch=3)


def test_request_limits_are_configurable(tiny_llama_dir):
    with Engine(
        str(tiny_llama_dir), request_limits={"max_stop_strings": 1, "max_batch_size": 2}
    ) as engine:
        with pytest.raises(InvalidRequestError, match="at most 1"):
            engine.generate("hi", {"stop": ["a", "b"], "max_new_tokens": 2})
        with pytest.raises(InvalidRequestError, match="max-batch-size"):
            engine.generate(["a", "b", "c"], {"max_new_tokens": 2})
        assert (
            engine.generate("hi", {"stop": ["a"], "max_new_tokens": 2})["meta_info"][
                "completion_tokens"
            ]
            <= 2
        )
    with pytest.raises(InvalidRequestError, match="unknown \\['max_stops'\\]"):
        Engine(str(tiny_llama_dir), request_limits={"max_stops": 1})


def test_text_prompt_and_chat_template(engine):
    text = engine.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    out = engine.generate(text, {**GREEDY, "max_new_tokens": 4})
    assert out["meta_info"]["prompt_tokens"] == len(engine.tokenizer.encode(text))
    assert isinstance(out["text"], str)


def test_long_chunked_prompts_in_a_small_pool_finish(tiny_llama_dir, engine):
    # two long prompts whose chunks together exceed the pool: admission must account for
    # the first prompt's remaining chunks, and a starved step retracts instead of hanging
    batch = prompts(2, seed=40, lo=150, hi=151)
    params = {**GREEDY, "max_new_tokens": 8}
    expected = ids_of(engine.generate(input_ids=batch, sampling_params=params))
    small = make_engine(
        tiny_llama_dir,
        kv_memory_gb=250 * 512 / 2**30,
        context_length=200,
        chunked_prefill_size=32,
        decode_reserve_ratio=0.0,
    )
    assert ids_of(small.generate(input_ids=batch, sampling_params=params)) == expected
