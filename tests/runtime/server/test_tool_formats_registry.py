"""Which tool-call format a server uses: `auto` picks each family's format from its chat
template's markers (the more specific where Hermes's `<tool_call>` also appears),
--tool-call-parser-plugin registers a format of one's own, and a server whose template is
Qwen3-Coder's writes a required call in that format that validates against its schema."""

from __future__ import annotations

import json
import textwrap

import httpx
import jsonschema
import pytest
from test_chat_server import USER, streamed
from test_server import API_KEY, AUTH, start_server, stop_server

from spruce.runtime.config import ServerOptions
from spruce.runtime.server import launch
from spruce.runtime.server.openai import tool_parsers
from spruce.runtime.server.openai.tool_parsers import (
    detect_tool_call_format,
    register_plugin,
    tool_call_format,
)


def ds(word: str) -> str:
    return "<\uff5ctool\u2581" + word.replace("_", "\u2581") + "\uff5c>"


# Minimal snippets of each family's chat template (the parts that write tool calls).
TEMPLATES = {
    "hermes": "{{ '<tool_call>\\n' + (tool_call | tojson) + '\\n</tool_call>' }}{{ tools }}",
    "qwen3_coder": "{{- '<tools>' }}{{- '\\n<tool_call>\\n<function=' + tool_call.name + '>\\n' }}"
    "{{- '<parameter=' + args_name + '>\\n' }}",
    "glm45": "<tool_call>{{ tc.name }}\n{% for k, v in _args.items() %}<arg_key>{{ k }}</arg_key>"
    "\n<arg_value>{{ v }}</arg_value>\n{% endfor %}</tool_call>",
    "minimax_m2": '<minimax:tool_call>\n<invoke name="{{ tool_call.name }}">\n</minimax:tool_call>',
    "deepseek_v3": "{{'"
    + ds("calls_begin")
    + ds("call_begin")
    + "' + tool['type'] + '"
    + ds("sep")
    + "' + tool['function']['name'] + '\\n' + '```json' + '\\n' + args + '\\n' + "
    "'```' + '" + ds("call_end") + "'}}",
    "deepseek_v31": "{{'" + ds("calls_begin") + ds("call_begin") + "' + tool['function']['name']"
    " + '" + ds("sep") + "' + tool['function']['arguments'] + '" + ds("call_end") + "'}}",
    "kimi_k2": "{%- if message['tool_calls'] -%}<|tool_calls_section_begin|>{%- for tool_call in "
    "message['tool_calls'] -%}<|tool_call_begin|>{{ tool_call['id'] }}"
    "<|tool_call_argument_begin|>{{ args }}<|tool_call_end|>{%- endfor -%}",
    "mistral": "{{ '[TOOL_CALLS]' }}",
}


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_auto_picks_each_family_from_its_template(name):
    assert detect_tool_call_format(TEMPLATES[name]).name == name
    assert tool_call_format("auto", TEMPLATES[name]).name == name
    assert tool_call_format(name, None).name == name


def test_unknown_names_list_every_format():
    with pytest.raises(ValueError, match="qwen3_coder, glm45, minimax_m2, deepseek_v3"):
        tool_call_format("xml", None)


PLUGIN = '''
from spruce.runtime.server.openai.tool_parsers import HermesFormat


class AngleFormat(HermesFormat):
    """Hermes calls between other tags."""

    name = "angle"
    markers = ("<<call>>",)
    open_tag, close_tag = "<<call>>", "<</call>>"
    instructions = "Call as <<call>>{...}<</call>>."


class NotAFormat:
    name = "nope"
'''


@pytest.fixture()
def plugin_module(tmp_path, monkeypatch):
    (tmp_path / "spruce_test_plugin.py").write_text(textwrap.dedent(PLUGIN))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(tool_parsers, "TOOL_CALL_FORMATS", dict(tool_parsers.TOOL_CALL_FORMATS))
    return "spruce_test_plugin"


def test_a_plugin_format_is_registered_under_its_name(plugin_module):
    fmt = register_plugin(f"{plugin_module}:AngleFormat")
    assert tool_call_format("angle", None) is fmt
    assert detect_tool_call_format("{{ '<<call>>' }}") is fmt
    scan = fmt.scan('Hi <<call>>{"name": "f", "arguments": {"x": 1}}<</call>>', True)
    assert scan.content == "Hi" and [(c.name, c.arguments) for c in scan.calls] == [
        ("f", '{"x": 1}')
    ]


@pytest.mark.parametrize(
    "spec, message",
    [
        ("spruce_test_plugin", "expected module:Class"),
        ("spruce_test_plugin:Missing", "has no attribute"),
        ("no_such_module_here:X", "No module named"),
        ("spruce_test_plugin:NotAFormat", "not a ToolCallFormat subclass"),
    ],
)
def test_a_bad_plugin_says_why(plugin_module, spec, message):
    with pytest.raises(ValueError, match=message):
        register_plugin(spec)


def test_the_server_registers_the_plugin_before_it_checks_the_parser(plugin_module):
    class Tokenizer:
        chat_template = "{{ messages }}"

    options = ServerOptions(
        tool_call_parser="angle", tool_call_parser_plugin=f"{plugin_module}:AngleFormat"
    )
    launch._set_chat_formats(Tokenizer(), options)
    assert tool_parsers.TOOL_CALL_FORMATS["angle"].name == "angle"
    with pytest.raises(launch.StartupError, match="not a ToolCallFormat"):
        bad = ServerOptions(tool_call_parser_plugin=f"{plugin_module}:NotAFormat")
        launch._set_chat_formats(Tokenizer(), bad)


# -- a server with a Qwen3-Coder-style template ---------------------------------------------

CODER_TEMPLATE = """\
{%- if tools %}{{- '<|im_start|>system\\n<tools>' }}{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\nCall as <tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call><|im_end|>\\n' }}{%- endif %}
{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""
PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
        "metric": {"type": "boolean"},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}}]


@pytest.fixture(scope="module")
def coder_server(tiny_llama_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("coder-server")
    (folder / "coder.jinja").write_text(CODER_TEMPLATE)
    srv = start_server(tiny_llama_dir, folder / "server.log", "--api-key", API_KEY,
                       "--chat-template", str(folder / "coder.jinja"), "--served-model-name", "m")  # fmt: skip
    yield srv
    assert stop_server(srv) == 0, srv.log()


def test_required_call_in_the_qwen3_coder_format(coder_server):
    body = {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False,
            "max_tokens": 400}  # fmt: skip
    with httpx.Client(base_url=coder_server.url, headers=AUTH, timeout=120) as http:
        r = http.post(
            "/v1/chat/completions", json={"model": "m", "messages": USER, "temperature": 0, **body}
        )
        _, content, calls, reason = streamed(http, **body)
    assert r.status_code == 200, r.text
    assert "tool-call format qwen3_coder" in coder_server.log()
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    assert choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMS)
    assert reason == "tool_calls" and content == "" and list(calls) == [0]
    assert calls[0]["name"] == "get_weather"
    assert json.loads(calls[0]["arguments"]) == json.loads(call["function"]["arguments"])
