"""SGLang's request fields against a real server on the tiny model: /generate's sampling_params
(n, stop_regex, no_stop_trim, logit_bias, custom_params) and return_text_in_logprobs, and the
OpenAI routes' extension fields as SGLang clients send them (`extra_body`). Each field is
shown to change the output as documented; bad values are a 400 naming the field."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from test_server import API_KEY, AUTH, sse_events, start_server, stop_server, zmq_call

MAX_N = 4


@pytest.fixture(scope="module")
def sglang_server(tiny_llama_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("sglang-fields") / "server.log"
    srv = start_server(
        tiny_llama_dir, log, "--api-key", API_KEY, "--max-n", str(MAX_N), timeout=180.0
    )
    yield srv
    assert stop_server(srv) == 0, srv.log()


@pytest.fixture()
def http(sglang_server):
    with httpx.Client(base_url=sglang_server.url, headers=AUTH, timeout=120) as c:
        yield c


@pytest.fixture()
def client(sglang_server) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=sglang_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120
    )


def generate(http, text="The quick brown fox", **sampling) -> dict | list:
    body = {"text": text, "sampling_params": {"temperature": 0, "max_new_tokens": 12, **sampling}}
    r = http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def refused(http, body: dict, field: str, path="/generate") -> str:
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    assert field in r.text, r.text
    return r.text


# -- /generate ------------------------------------------------------------------------------


def test_logit_bias_changes_the_greedy_token(http):
    first = generate(http, max_new_tokens=1)["output_ids"][0]
    banned = generate(http, max_new_tokens=1, logit_bias={str(first): -100})["output_ids"][0]
    assert banned != first
    forced = generate(http, max_new_tokens=3, logit_bias={"42": 100})
    assert forced["output_ids"] == [42, 42, 42]
    clipped = generate(
        http, max_new_tokens=1, logit_bias={str(first): -1e9, "42": 1e9}
    )  # clipped to ±100
    assert clipped["output_ids"] == [42]


def test_n_samples_share_the_prompt_in_the_cache(http):
    prompt = "n samples of one prompt share its KV " * 3
    out = generate(http, prompt, n=3, temperature=1.0, seed=7, max_new_tokens=6)
    assert isinstance(out, list) and len(out) == 3
    assert all(o["meta_info"]["prompt_tokens"] == out[0]["meta_info"]["prompt_tokens"] for o in out)
    assert all(o["meta_info"]["cached_tokens"] > 0 for o in out[1:]), [o["meta_info"] for o in out]
    assert len({tuple(o["output_ids"]) for o in out}) > 1  # seeds 7, 8, 9: different samples


def test_n_with_a_batch_is_prompt_major(http):
    prompts = ["short one", "a somewhat longer second prompt"]
    out = generate(http, prompts, n=2, max_new_tokens=3)
    lengths = [o["meta_info"]["prompt_tokens"] for o in out]
    assert len(out) == 4 and lengths[0] == lengths[1] < lengths[2] == lengths[3]
    assert out[0]["output_ids"] == out[1]["output_ids"]  # greedy: the same sample twice


def test_n_streams_each_sample_by_index(http):
    body = {
        "text": "stream two",
        "sampling_params": {"n": 2, "temperature": 0, "max_new_tokens": 5},
    }
    whole = http.post("/generate", json=body).json()
    with http.stream("POST", "/generate", json={**body, "stream": True}) as r:
        events = [e for e in sse_events(r) if e != "[DONE]"]
    texts = {0: "", 1: ""}
    for e in events:
        texts[e["index"]] += e["text"]
    assert [texts[0], texts[1]] == [w["text"] for w in whole]


def test_stop_regex_stops_at_the_first_match_and_trims_it(http):
    free = generate(http, max_new_tokens=16)
    text = free["text"]
    char = next(c for c in text[2:] if c.isalnum())
    pattern = f"[{re.escape(char)}]"
    at = text.find(char)
    stopped = generate(http, max_new_tokens=16, stop_regex=pattern)
    assert stopped["text"] == text[:at]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
    assert len(stopped["output_ids"]) < len(free["output_ids"])
    kept = generate(http, max_new_tokens=16, stop_regex=[pattern], no_stop_trim=True)
    assert kept["text"] == text[: at + 1]


def test_no_stop_trim_keeps_a_stop_string(http):
    text = generate(http, max_new_tokens=16)["text"]
    stop = text[3:5]
    at = text.find(stop)
    assert generate(http, max_new_tokens=16, stop=stop)["text"] == text[:at]
    assert (
        generate(http, max_new_tokens=16, stop=stop, no_stop_trim=True)["text"]
        == text[: at + len(stop)]
    )


def test_return_text_in_logprobs(http, tiny_tokenizer):
    body = {
        "text": "The quick brown fox", "sampling_params": {"temperature": 0, "max_new_tokens": 4},
        "return_logprob": True, "top_logprobs_num": 2, "return_text_in_logprobs": True,
    }  # fmt: skip
    meta = http.post("/generate", json=body).json()["meta_info"]
    for _logprob, token, text in meta["output_token_logprobs"]:
        assert text == tiny_tokenizer.decode([token])
    assert all(len(entry) == 3 for top in meta["output_top_logprobs"] for entry in top)
    plain = http.post("/generate", json={**body, "return_text_in_logprobs": False}).json()[
        "meta_info"
    ]
    assert all(len(entry) == 2 for entry in plain["output_token_logprobs"])


def test_return_text_in_logprobs_over_zeromq(sglang_server, tiny_tokenizer):
    import zmq

    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 30000)
    sock.connect(sglang_server.zmq_url)
    try:
        msg = {
            "type": "generate", "rid": "t", "text": "hello", "return_logprob": True,
            "return_text_in_logprobs": True, "sampling_params": {"temperature": 0, "max_new_tokens": 3},
        }  # fmt: skip
        final = zmq_call(sock, msg)[-1]
    finally:
        sock.close()
        context.term()
    assert [len(e) for e in final["meta_info"]["output_token_logprobs"]] == [3, 3, 3]


def test_custom_params_are_ignored_with_a_note(http):
    plain = generate(http, max_new_tokens=4)
    noted = generate(http, max_new_tokens=4, custom_params={"token_id": 5})
    assert noted["output_ids"] == plain["output_ids"]
    assert "custom_params" in noted["meta_info"]["ignored"]


@pytest.mark.parametrize(
    ("sampling", "field"),
    [
        ({"n": MAX_N + 1}, "n"),
        ({"n": 0}, "n"),
        ({"stop_regex": "(unclosed"}, "stop_regex"),
        ({"stop_regex": "x*"}, "stop_regex"),
        ({"logit_bias": {"999999": 1}}, "logit_bias"),
        ({"logit_bias": {"a": 1}}, "logit_bias"),
        ({"no_stop_trim": "yes"}, "no_stop_trim"),
        ({"custom_params": [1]}, "custom_params"),
        ({"not_a_field": 1}, "not_a_field"),
    ],
)
def test_bad_sampling_params_name_the_field(http, sampling, field):
    refused(http, {"text": "hi", "sampling_params": sampling}, field)


def test_n_differs_across_a_batch(http):
    body = {"text": ["a", "b"], "sampling_params": [{"n": 2}, {"n": 3}]}
    refused(http, body, "n must be the same")


# -- OpenAI routes: SGLang's extension fields --------------------------------------------------


def test_completions_accept_sglang_extensions(client):
    model = client.models.list().data[0].id
    extra = {
        "top_k": 5, "min_p": 0.1, "min_tokens": 2, "repetition_penalty": 1.1, "stop_token_ids": [3],
        "ignore_eos": True, "skip_special_tokens": False, "no_stop_trim": True, "rid": "my-request",
    }  # fmt: skip
    out = client.completions.create(
        model=model, prompt="hello", max_tokens=4, temperature=0, extra_body=extra
    )
    assert out.usage.completion_tokens >= 2
    regex = client.completions.create(
        model=model, prompt="hello", max_tokens=8, temperature=0, extra_body={"regex": "(yes|no)"}
    )
    assert regex.choices[0].text in ("yes", "no")


def test_completions_logit_bias_is_honoured(client):
    model = client.models.list().data[0].id
    out = client.completions.create(
        model=model, prompt="hello", max_tokens=3, temperature=0, logit_bias={"42": 100}
    )
    plain = client.completions.create(model=model, prompt="hello", max_tokens=3, temperature=0)
    assert out.choices[0].text != plain.choices[0].text
    with_bias = client.completions.create(
        model=model, prompt="hello", max_tokens=1, temperature=0, logprobs=1, logit_bias={"42": 100}
    )
    assert with_bias.usage.completion_tokens == 1


def test_min_tokens_alias_sets_min_new_tokens(client):
    model = client.models.list().data[0].id
    out = client.completions.create(
        model=model, prompt="hello", max_tokens=8, temperature=0, logit_bias={"42": 100},
        extra_body={"min_tokens": 3, "stop_token_ids": [42]},
    )  # fmt: skip
    assert out.usage.completion_tokens == 4  # 42 is held back for 3 tokens, then it stops


def test_include_stop_str_in_output_keeps_the_stop_string(client):
    """vLLM's name for no_stop_trim."""
    model = client.models.list().data[0].id
    plain = client.completions.create(model=model, prompt="hello", max_tokens=6, temperature=0)
    assert len(plain.choices[0].text) >= 4, plain  # six byte-level tokens
    stop = plain.choices[0].text[2:4]
    args = {"model": model, "prompt": "hello", "max_tokens": 6, "temperature": 0, "stop": [stop]}
    trimmed = client.completions.create(**args).choices[0].text
    kept = client.completions.create(**args, extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == trimmed + stop


def test_openai_bad_extensions(http):
    model = http.get("/v1/models").json()["data"][0]["id"]
    base = {"model": model, "prompt": "hi", "max_tokens": 2}
    refused(http, {**base, "suffix": "tail"}, "suffix", "/v1/completions")
    refused(http, {**base, "no_such_field": 1}, "no_such_field", "/v1/completions")
    refused(http, {**base, "logit_bias": {"999999": 5}}, "logit_bias", "/v1/completions")
    refused(http, {**base, "min_tokens": 1, "min_new_tokens": 1}, "min_tokens", "/v1/completions")
    both = {**base, "include_stop_str_in_output": True, "no_stop_trim": True}
    refused(http, both, "include_stop_str_in_output", "/v1/completions")


def test_chat_continue_final_message(http):
    model = http.get("/v1/models").json()["data"][0]["id"]
    messages = [
        {"role": "user", "content": "Say hi"},
        {"role": "assistant", "content": "Hello the"},
    ]
    body = {
        "model": model, "messages": messages, "max_tokens": 3, "temperature": 0,
        "continue_final_message": True, "chat_template_kwargs": {}, "separate_reasoning": False,
    }  # fmt: skip
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    prompt = r.json()["usage"]["prompt_tokens"]
    r2 = http.post("/v1/chat/completions", json={**body, "continue_final_message": False})
    assert r2.status_code == 200, r2.text
    assert prompt != r2.json()["usage"]["prompt_tokens"]  # no end of turn, no new assistant header
    bad = {**body, "messages": messages[:1]}
    refused(http, bad, "continue_final_message", "/v1/chat/completions")


# -- OpenAI routes: vLLM's structured-output fields, end to end --------------------------------

SCHEMA = {
    "type": "object", "properties": {"a": {"enum": [1, 2]}, "b": {"type": "boolean"}},
    "required": ["a", "b"], "additionalProperties": False,
}  # fmt: skip


def _valid_json(text: str) -> bool:
    jsonschema.validate(json.loads(text), SCHEMA)
    return True


# (the extra fields, a judge of the output that is not ours: re, jsonschema, membership)
VLLM_CASES = [
    ({"structured_outputs": {"json": SCHEMA}}, _valid_json),
    ({"guided_json": SCHEMA}, _valid_json),
    ({"structured_outputs": {"regex": "[a-c]{3}"}}, lambda t: re.fullmatch("[a-c]{3}", t)),
    ({"guided_regex": "[a-c]{3}"}, lambda t: re.fullmatch("[a-c]{3}", t)),
    ({"structured_outputs": {"choice": ["red", "green"]}}, lambda t: t in ("red", "green")),
    ({"guided_choice": ["red", "green"]}, lambda t: t in ("red", "green")),
    ({"structured_outputs": {"grammar": 'root ::= "x" [0-9] [0-9]'}}, lambda t: re.fullmatch(r"x\d\d", t)),
    ({"guided_grammar": 'start: "y" /[0-9]{2}/'}, lambda t: re.fullmatch(r"y\d\d", t)),
]  # fmt: skip


@pytest.mark.parametrize(
    "extra, judge", VLLM_CASES, ids=lambda c: next(iter(c)) if isinstance(c, dict) else ""
)
def test_vllm_structured_output_fields_constrain_the_output(client, extra, judge):
    model = client.models.list().data[0].id
    out = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "answer"}], max_tokens=40,
        temperature=0, extra_body=extra,
    )  # fmt: skip
    text = out.choices[0].message.content
    assert out.choices[0].finish_reason == "stop" and judge(text), text


def test_guided_decoding_backend_picks_the_requests_grammar_backend(client, http):
    """vLLM's guided_decoding_backend is the request's grammar_backend: its values reach the
    conversion (the spruce backend takes no Lark grammar: a 400 says so), a backend this
    server lacks is a 400 naming the field."""
    model = client.models.list().data[0].id
    chat = {"model": model, "messages": [{"role": "user", "content": "x"}], "max_tokens": 8}
    for backend in ("guidance", "outlines", "auto"):
        out = client.chat.completions.create(
            **chat, temperature=0,
            extra_body={"guided_regex": "[a-c]{3}", "guided_decoding_backend": backend},
        )  # fmt: skip
        assert re.fullmatch("[a-c]{3}", out.choices[0].message.content), backend
    lark = {**chat, "guided_grammar": 'start: "y" /[0-9]{2}/'}
    assert "spruce grammar backend" in refused(
        http, {**lark, "grammar_backend": "spruce"}, "lark", "/v1/chat/completions"
    )
    refused(
        http,
        {**chat, "guided_decoding_backend": "xgrammar"},
        "guided_decoding_backend",
        "/v1/chat/completions",
    )
    native = generate(http, regex="[a-c]{3}", grammar_backend="outlines", max_new_tokens=8)
    assert re.fullmatch("[a-c]{3}", native["text"])
    refused(http, gen_body(grammar_backend="xgrammar"), "grammar_backend")


def gen_body(**sampling) -> dict:
    return {"text": "hi", "sampling_params": {"max_new_tokens": 4, **sampling}}
