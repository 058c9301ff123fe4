"""The chat route with a chat template set by --chat-template (Qwen3-style: tools, `<think>`
blocks, enable_thinking), so the reasoning parser and the Hermes tool-call format are
chosen from it. The tiny model's output is random: the tests check what holds for any
output (the split matches the raw text; constrained calls parse and validate)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from test_server import API_KEY, AUTH, ServerProcess, start_server, stop_server

from spruce.runtime.text.reasoning import REASONING_FORMATS

TEMPLATE = """\
{%- if tools %}{{- '<|im_start|>system\\n<tools>' }}{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\nCall a tool as <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call><|im_end|>\\n' }}{%- endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and loop.first %}{{- raise_exception('the first message must not be the assistant') }}{%- endif %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}
{%- elif enable_thinking %}{{- '<think>\\n' }}{%- endif %}
{%- endif %}
"""
PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}}]
USER = [{"role": "user", "content": "Weather in Paris?"}]


def qwen3_style_server(model_dir, folder) -> ServerProcess:
    """`spruce serve` with the Qwen3-style template above, the API key and model name "m"
    (the chat-shaped API tests share it: chat, Responses, Anthropic Messages)."""
    (folder / "qwen3-style.jinja").write_text(TEMPLATE)
    extra = ("--api-key", API_KEY, "--chat-template", str(folder / "qwen3-style.jinja"),
             "--served-model-name", "m")  # fmt: skip
    return start_server(model_dir, folder / "server.log", *extra)


@pytest.fixture(scope="module")
def chat_server(tiny_llama_dir, tmp_path_factory):
    srv = qwen3_style_server(tiny_llama_dir, tmp_path_factory.mktemp("chat-server"))
    yield srv
    assert stop_server(srv) == 0, srv.log()


@pytest.fixture()
def http(chat_server):
    with httpx.Client(base_url=chat_server.url, headers=AUTH, timeout=120) as c:
        yield c


def chat(http, **body) -> dict:
    r = http.post(
        "/v1/chat/completions", json={"model": "m", "messages": USER, "temperature": 0, **body}
    )
    assert r.status_code == 200, r.text
    return r.json()


def streamed(http, **body) -> tuple[str, str, dict[int, dict], str]:
    """(reasoning, content, calls by index with joined arguments, finish reason) of a stream."""
    reasoning, content, calls, reason = "", "", {}, None
    body = {"model": "m", "messages": USER, "temperature": 0, "stream": True, **body}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            choice = json.loads(line[6:])["choices"][0]
            delta, reason = choice["delta"], choice["finish_reason"] or reason
            reasoning += delta.get("reasoning_content") or ""
            content += delta.get("content") or ""
            for piece in delta.get("tool_calls") or []:
                call = calls.setdefault(piece["index"], {"name": None, "arguments": ""})
                call["name"] = call["name"] or piece["function"].get("name")
                call["arguments"] += piece["function"].get("arguments") or ""
    return reasoning, content, calls, reason


def test_the_template_file_replaces_the_models(http):
    assert http.get("/model_info").json()["chat_template"] == TEMPLATE


def test_chat_template_kwargs_reach_the_template(http):
    off = chat(http, max_tokens=1, chat_template_kwargs={"enable_thinking": False})
    plain = chat(http, max_tokens=1)
    assert off["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"]


def test_reasoning_is_split_from_the_raw_text(http):
    """The prompt ends in an open `<think>`: the output is reasoning until `</think>`."""
    thinking = {"max_tokens": 12, "chat_template_kwargs": {"enable_thinking": True}}
    raw = chat(http, separate_reasoning=False, **thinking)["choices"][0]["message"]
    assert "reasoning_content" not in raw
    expected = REASONING_FORMATS["qwen3"].split(raw["content"], inside=True)
    message = chat(http, **thinking)["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == expected
    reasoning, content, _, _ = streamed(http, **thinking)
    assert (reasoning, content) == (expected[0], expected[1])


def test_required_call_in_the_hermes_format(http):
    body = {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 120,
            "chat_template_kwargs": {"enable_thinking": False}}  # fmt: skip
    choice = chat(http, **body)["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMS)
    _, content, calls, reason = streamed(http, **body)
    assert reason == "tool_calls" and content == "" and list(calls) == [0]
    assert calls[0]["name"] == "get_weather" and json.loads(calls[0]["arguments"]) == json.loads(
        call["function"]["arguments"]
    )


def test_a_constrained_answer_may_follow_reasoning(http):
    """response_format applies after the reasoning block: the answer validates whether or
    not the model thought first (cut by max_tokens: it was still thinking)."""
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}
    choice = chat(http, response_format=fmt, max_tokens=60)["choices"][0]
    message = choice["message"]
    if choice["finish_reason"] == "stop":
        jsonschema.validate(json.loads(message["content"]), schema)
        assert choice["json_schema"] == {"unenforced": [], "valid": True, "error": None}
    else:
        assert choice["finish_reason"] == "length" and message.get("reasoning_content") is not None


def test_bad_chat_input_is_a_400_naming_the_field(http):
    body = {"model": "m", "messages": USER, "max_tokens": 1}
    r = http.post("/v1/chat/completions", json={**body, "chat_template_kwargs": {"messages": []}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
    r = http.post("/v1/chat/completions", json={**body, "chat_template_kwargs": "no"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
    first_assistant = [{"role": "assistant", "content": "hi"}]
    r = http.post("/v1/chat/completions", json={**body, "messages": first_assistant})
    assert r.status_code == 400 and "must not be the assistant" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "messages"


def test_unknown_parser_names_stop_the_start(tiny_llama_dir, tmp_path):
    with pytest.raises(RuntimeError, match="unknown tool-call parser 'xml'; known: auto, hermes"):
        start_server(tiny_llama_dir, tmp_path / "log", "--tool-call-parser", "xml", timeout=60)
