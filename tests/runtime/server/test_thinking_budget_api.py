"""The thinking budget and reasoning_effort through the HTTP APIs, on the tiny random model
with a Qwen3-style template (its generation prompt ends in an open `<think>`, and it prints
reasoning_effort) and a server default budget with a message (--reasoning-budget,
--reasoning-budget-message). The block is counted in the output's own tokens (logprobs):
at most the budget, then the message and `</think>`, then an answer that validates."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest
from test_server import API_KEY, AUTH, start_server, stop_server

from spruce.runtime.config import ServerOptions
from spruce.runtime.server.http.common import ApiError
from spruce.runtime.server.openai.schemas import ChatRequest
from spruce.runtime.server.openai.thinking_fields import template_thinking, thinking_budget

TEMPLATE = """\
{%- if reasoning_effort is defined %}{{- '<|im_start|>system\\nReasoning: ' + reasoning_effort + '<|im_end|>\\n' }}{%- endif %}
{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}
{%- else %}{{- '<think>\\n' }}{%- endif %}{%- endif %}
"""
SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}},
    "required": ["n"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}
USER = [{"role": "user", "content": "Pick a number."}]
MESSAGE, DEFAULT = " Enough.", 5  # the server's --reasoning-budget-message and --reasoning-budget


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("budget-server")
    (folder / "thinking.jinja").write_text(TEMPLATE)
    srv = start_server(tiny_llama_dir, folder / "server.log", "--api-key", API_KEY,
                       "--chat-template", str(folder / "thinking.jinja"), "--served-model-name", "m",
                       "--reasoning-budget", str(DEFAULT), "--reasoning-budget-message", MESSAGE)  # fmt: skip
    yield srv
    assert stop_server(srv) == 0, srv.log()


@pytest.fixture()
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as c:
        yield c


def chat(http, **body) -> dict:
    body = {"model": "m", "messages": USER, "temperature": 0, "logprobs": True, **body}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def within_budget(choice: dict, budget: int) -> bool:
    """The model's own tokens in the block (the fewest leading output tokens, by logprobs,
    whose text is the reasoning without the message the runtime wrote) are at most the
    budget, or past it only to finish a UTF-8 character the budget's last token left open
    (the runtime writes the end marker between whole characters)."""
    reasoning = choice["message"]["reasoning_content"]
    assert reasoning.endswith(MESSAGE.strip()), reasoning
    own, text, entries = (
        reasoning[: -len(MESSAGE.strip())].strip(),
        b"",
        choice["logprobs"]["content"],
    )
    for k, entry in enumerate(entries, 1):
        text += bytes(entry["bytes"])
        if text.decode(errors="replace").strip() == own:
            past = [bytes(e["bytes"]) for e in entries[budget:k]]
            return 0 < k and all(len(b) == 1 and 0x80 <= b[0] < 0xC0 for b in past)
    raise AssertionError(f"{own!r} is not the output's start")


@pytest.mark.parametrize("field", ["thinking_token_budget", "max_thinking_tokens"])
def test_a_request_budget_ends_the_block_before_a_valid_answer(http, field):
    choice = chat(http, max_tokens=60, response_format=FORMAT, **{field: 8})
    message = choice["message"]
    assert within_budget(choice, 8)
    jsonschema.validate(json.loads(message["content"]), SCHEMA)
    assert choice["finish_reason"] == "stop"


def test_the_server_default_budget_applies_and_streams_alike(http):
    choice = chat(http, max_tokens=60, response_format=FORMAT)
    assert within_budget(choice, DEFAULT)
    jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
    body = {"model": "m", "messages": USER, "temperature": 0, "max_tokens": 60,
            "response_format": FORMAT, "stream": True}  # fmt: skip
    reasoning, content = "", ""
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"]
                reasoning += delta.get("reasoning_content") or ""
                content += delta.get("content") or ""
    assert (reasoning, content) == (
        choice["message"]["reasoning_content"],
        choice["message"]["content"],
    )


def test_minus_one_is_unlimited_and_thinking_off_ignores_the_budget(http):
    unlimited = chat(http, max_tokens=24, thinking_token_budget=-1)["message"]
    assert MESSAGE.strip() not in (unlimited.get("reasoning_content") or "")
    assert not unlimited["content"]  # the block took every token
    off = chat(http, max_tokens=12, thinking_token_budget=3,
               chat_template_kwargs={"enable_thinking": False})["message"]  # fmt: skip
    assert "reasoning_content" not in off and MESSAGE.strip() not in off["content"]


def test_reasoning_effort_reaches_the_template(http):
    r = [
        http.post("/v1/chat/completions", json={"model": "m", "messages": USER, "max_tokens": 1,
                                                 **({"reasoning_effort": e} if e else {})})
        for e in (None, "low", "none")
    ]  # fmt: skip
    assert all(x.status_code == 200 for x in r), [x.text for x in r]
    tokens = [x.json()["usage"]["prompt_tokens"] for x in r]
    assert tokens[1] > tokens[0]  # "Reasoning: low" in the prompt
    assert tokens[2] > tokens[1]  # "none": and the block closed in the prompt
    assert "reasoning_content" not in r[2].json()["choices"][0]["message"]
    bad = http.post("/v1/chat/completions", json={"model": "m", "messages": USER,
                                                  "reasoning_effort": "extreme"})  # fmt: skip
    assert bad.status_code == 400 and "reasoning_effort" in bad.text


def test_anthropic_budget_tokens_are_enforced(server, http):
    """The chat path's answer under the same budget (the same prompt, greedy)."""
    same = chat(http, max_tokens=60, response_format=FORMAT, thinking_token_budget=6)
    assert within_budget(same, 6)
    client = anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=120)
    message = client.messages.create(
        model="m", max_tokens=60, messages=USER, thinking={"type": "enabled", "budget_tokens": 6},
        extra_body={"temperature": 0, "output_config": {"format": {"type": "json_schema",
                                                                   "schema": SCHEMA}}},
    )  # fmt: skip
    thinking, text = message.content[0], message.content[-1]
    assert thinking.type == "thinking"
    assert thinking.thinking == same["message"]["reasoning_content"]
    assert text.type == "text" and text.text == same["message"]["content"]
    jsonschema.validate(json.loads(text.text), SCHEMA)


def test_responses_reasoning_effort_and_max_tokens(http):
    """reasoning.effort reaches the template, reasoning.max_tokens is the budget: the chat
    path's answer with reasoning_effort and thinking_token_budget."""
    same = chat(http, max_tokens=60, response_format=FORMAT, thinking_token_budget=4,
                reasoning_effort="low")  # fmt: skip
    assert within_budget(same, 4)
    body = {"model": "m", "input": "Pick a number.", "max_output_tokens": 60, "temperature": 0,
            "reasoning": {"effort": "low", "max_tokens": 4},
            "text": {"format": {"type": "json_schema", "name": "n", "schema": SCHEMA}}}  # fmt: skip
    r = http.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    out = r.json()["output"]
    reasoning = next(item for item in out if item["type"] == "reasoning")
    assert reasoning["summary"][0]["text"] == same["message"]["reasoning_content"]
    answer = next(item for item in out if item["type"] == "message")
    assert answer["content"][0]["text"] == same["message"]["content"]
    jsonschema.validate(json.loads(same["message"]["content"]), SCHEMA)


def request(**fields) -> ChatRequest:
    return ChatRequest(model="m", messages=USER, **fields)


def test_effort_maps_to_a_budget_where_the_template_ignores_it():
    options, plain = ServerOptions(), "{{ messages }}<think>"
    assert [thinking_budget(request(reasoning_effort=e), options, plain)
            for e in ("minimal", "low", "medium", "high")] == [128, 512, 2048, None]  # fmt: skip
    assert thinking_budget(request(reasoning_effort="low"), options, TEMPLATE) is None
    assert thinking_budget(request(reasoning_effort="low", thinking_token_budget=9), options,
                           plain) == 9  # fmt: skip
    assert thinking_budget(request(), ServerOptions(reasoning_budget=7), plain) == 7
    assert template_thinking(request(reasoning_effort="none"), options, TEMPLATE) == {
        "reasoning_effort": "none", "enable_thinking": False}  # fmt: skip
    assert template_thinking(request(thinking_token_budget=0), options, TEMPLATE) == {
        "enable_thinking": False}  # fmt: skip
    with pytest.raises(ApiError, match="not both"):
        thinking_budget(request(thinking_token_budget=1, max_thinking_tokens=2), options, plain)
    with pytest.raises(ApiError, match="-1"):
        thinking_budget(request(thinking_token_budget=-5), options, plain)


def test_the_budget_takes_the_prompts_reasoning_format():
    from spruce.runtime.core.sampling_params import SamplingParams
    from spruce.runtime.server.openai.chat_prompt import ChatPrompt, ToolPlan
    from spruce.runtime.server.openai.thinking_fields import with_thinking
    from spruce.runtime.server.openai.tool_parsers import TOOL_CALL_FORMATS
    from spruce.runtime.text.reasoning import REASONING_FORMATS

    options, tools = ServerOptions(reasoning_budget_message=" ok"), ToolPlan.of(request())
    harmony = ChatPrompt("", [], REASONING_FORMATS["gpt-oss"], False)
    out = with_thinking(SamplingParams(), request(thinking_token_budget=16), harmony, tools,
                        options, None)  # fmt: skip
    assert (out.thinking_budget, out.thinking_open, out.skip_special_tokens) == (
        16, "<|channel|>analysis<|message|>", False)  # fmt: skip
    assert out.thinking_close == " ok<|end|><|start|>assistant<|channel|>final<|message|>"
    # no reasoning format (or thinking off in the prompt): the budget is ignored
    plain = with_thinking(SamplingParams(), request(thinking_token_budget=16),
                          ChatPrompt("", [], None, False), tools, options, None)  # fmt: skip
    assert plain.thinking_budget is None and plain.skip_special_tokens
    # the request's own markers (SamplingParams' fields) are left as given
    own = request(thinking_budget=3, thinking_close="</t>")
    qwen3 = ChatPrompt("", [], REASONING_FORMATS["qwen3"], True)
    given = SamplingParams(thinking_budget=3, thinking_close="</t>")
    assert with_thinking(given, own, qwen3, tools, options, None) == given
    # a tool-call format whose markers are special tokens keeps them too
    calls = ToolPlan.of(request(tools=[{"type": "function", "function": {"name": "f"}}]),
                        TOOL_CALL_FORMATS["gpt-oss"])  # fmt: skip
    kept = with_thinking(SamplingParams(), request(), ChatPrompt("", [], None, False), calls,
                         options, None)  # fmt: skip
    assert not kept.skip_special_tokens
