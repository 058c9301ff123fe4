"""Speculative decoding through `spruce serve --speculative-algorithm ngram` on the tiny
model: /generate, the OpenAI routes (the real openai client) and the DSL get the same
greedy outputs with drafts as with `speculative: false`, meta_info and /metrics count the
drafts."""

from __future__ import annotations

import re

import httpx
import openai
import pytest
from test_server import API_KEY, AUTH, start_server, stop_server

import spruce.lang as sl

# a repeating prompt: the greedy continuation of the tiny random model repeats too
TEXT = "alpha beta gamma delta alpha beta gamma delta alpha beta gamma delta alpha beta"


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("spec-server") / "server.log"
    srv = start_server(
        tiny_llama_dir, log, "--api-key", API_KEY, "--speculative-algorithm", "ngram",
        "--speculative-row-cost", "0", timeout=180.0,
    )  # fmt: skip
    yield srv
    assert stop_server(srv) == 0, srv.log()


@pytest.fixture()
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as c:
        yield c


def generate(http, **sampling) -> dict:
    params = {"temperature": 0, "max_new_tokens": 48, "ignore_eos": True, **sampling}
    r = http.post("/generate", json={"text": TEXT, "sampling_params": params})
    assert r.status_code == 200, r.text
    return r.json()


def test_native_generate_drafts_and_keeps_the_output(http):
    on, off = generate(http), generate(http, speculative=False)
    assert on["output_ids"] == off["output_ids"]
    assert on["meta_info"]["spec_accepted_tokens"] > 0
    assert "spec_draft_tokens" not in off["meta_info"]
    metrics = http.get("/metrics").text
    accepted = re.search(r"^spruce_spec_accepted_tokens_total (\S+)$", metrics, re.M)
    assert accepted and float(accepted.group(1)) >= on["meta_info"]["spec_accepted_tokens"]


def test_openai_client_with_and_without_drafts(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
    model = client.models.list().data[0].id
    ask = dict(
        model=model, prompt=TEXT, max_tokens=40, temperature=0, extra_body={"ignore_eos": True}
    )
    on = client.completions.create(**ask)
    off = client.completions.create(
        **{**ask, "extra_body": {"ignore_eos": True, "speculative": False}}
    )
    assert on.choices[0].text == off.choices[0].text
    bad = client.completions.with_raw_response
    with pytest.raises(openai.BadRequestError, match="speculative"):
        bad.create(**{**ask, "extra_body": {"speculative": "maybe"}})


@sl.function
def copy_twice(s, text, speculative):
    s += text
    s += sl.gen("first", max_tokens=24, temperature=0, ignore_eos=True, speculative=speculative)


def test_the_dsl_passes_the_option_through(server):
    endpoint = sl.RuntimeEndpoint(server.zmq_url, api_key=API_KEY)
    try:
        on = copy_twice.run(text=TEXT, speculative=True, backend=endpoint)
        off = copy_twice.run(text=TEXT, speculative=False, backend=endpoint)
        assert on["first"] == off["first"] and on["first"]
        assert on.get_meta_info("first")["spec_accepted_tokens"] > 0
    finally:
        endpoint.close()
