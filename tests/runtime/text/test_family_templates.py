"""The chat templates of today's tool-calling and reasoning families render as transformers
renders them: templates written in the style of each family's own (the constructs they use:
namespaces, `|items` over arguments, `is mapping`, string methods, `loop.previtem`, the
thinking and effort switches), with tools, tool calls, tool results and reasoning content on
assistant turns; then the format `auto` picks from each template is the family's."""

from __future__ import annotations

import pytest
from test_chat_templates import TOOLS, _both, tokenizers_pair  # noqa: F401 (a fixture)

from spruce.runtime.server.openai.tool_parsers import detect_tool_call_format
from spruce.runtime.text.reasoning import detect_reasoning

# DeepSeek writes its markers with full-width bars and lower blocks: "!" and "~" below
FULL_WIDTH = lambda text: text.replace("!", chr(0xFF5C)).replace("~", chr(0x2581))  # noqa: E731

HARMONY_STYLE = """\
{%- set effort = reasoning_effort if reasoning_effort is defined else 'medium' %}
{{- '<|start|>system<|message|>Reasoning: ' + effort + '\\n# Valid channels: analysis, commentary, final.<|end|>' }}
{%- if tools %}
{{- '<|start|>developer<|message|># Tools\\nnamespace functions {\\n' }}
{%- for t in tools %}{{- '// ' + t.function.description + '\\ntype ' + t.function.name + ' = (_: ' + (t.function.parameters | tojson) + ') => any;\\n' }}{%- endfor %}
{{- '} // namespace functions<|end|>' }}
{%- endif %}
{%- for m in messages if m.role != 'system' %}
{%- if m.role == 'user' %}{{- '<|start|>user<|message|>' + m.content + '<|end|>' }}
{%- elif m.role == 'assistant' %}
{%- if m.reasoning_content %}{{- '<|start|>assistant<|channel|>analysis<|message|>' + m.reasoning_content + '<|end|>' }}{%- endif %}
{%- for call in m.tool_calls or [] %}
{%- set args = call.function.arguments %}
{{- '<|start|>assistant<|channel|>commentary to=functions.' + call.function.name + ' <|constrain|>json<|message|>' + (args | tojson if args is mapping else args) + '<|call|>' }}
{%- endfor %}
{%- if m.content %}{{- '<|start|>assistant<|channel|>final<|message|>' + m.content + '<|end|>' }}{%- endif %}
{%- elif m.role == 'tool' %}
{%- set caller = loop.previtem.tool_calls[0].function.name if loop.previtem and loop.previtem.tool_calls else 'tool' %}
{{- '<|start|>functions.' + caller + ' to=assistant<|channel|>commentary<|message|>' + m.content + '<|end|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}
"""

QWEN3_CODER_STYLE = """\
{%- if tools %}
{{- '<|im_start|>system\\nYou have access to the following functions:\\n\\n<tools>' }}
{%- for tool in tools %}
{{- '\\n<function>\\n<name>' + tool.function.name + '</name>\\n<parameters>' }}
{%- for name, spec in tool.function.parameters.properties | items %}
{{- '\\n<parameter>\\n<name>' + name + '</name>\\n<type>' + spec.type + '</type>\\n</parameter>' }}
{%- endfor %}
{{- '\\n</parameters>\\n</function>' }}
{%- endfor %}
{{- '\\n</tools>\\n\\nIf you choose to call a function, reply in the format <tool_call>\\n<function=example_function_name>\\n<parameter=example_parameter_1>\\nvalue_1\\n</parameter>\\n</function>\\n</tool_call><|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}
{{- '<|im_start|>assistant\\n' + (message.content or '') }}
{%- for tool_call in message.tool_calls %}
{{- '\\n<tool_call>\\n<function=' + tool_call.function.name + '>\\n' }}
{%- for key, value in tool_call.function.arguments | items %}
{{- '<parameter=' + key + '>\\n' + (value if value is string else value | tojson) + '\\n</parameter>\\n' }}
{%- endfor %}
{{- '</function>\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

GLM45_STYLE = """\
[gMASK]<sop>
{%- if tools %}<|system|>\\n# Tools\\n{% for tool in tools %}{{ tool | tojson(ensure_ascii=False) }}\\n{% endfor %}For each function call, output <tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}</arg_value></tool_call>{%- endif %}
{%- set ns = namespace(last_user=0) %}
{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}
{%- for m in messages %}
{%- if m.role == 'user' %}<|user|>\\n{{ m.content }}
{%- elif m.role == 'system' %}<|system|>\\n{{ m.content }}
{%- elif m.role == 'assistant' %}<|assistant|>
{%- if loop.index0 > ns.last_user and m.reasoning_content %}\\n<think>{{ m.reasoning_content.strip() }}</think>{%- else %}\\n<think></think>{%- endif %}
{%- if m.content %}\\n{{ m.content.strip() }}{%- endif %}
{%- for tc in m.tool_calls or [] %}\\n<tool_call>{{ tc.function.name }}
{%- for k, v in tc.function.arguments.items() %}\\n<arg_key>{{ k }}</arg_key>\\n<arg_value>{{ v | tojson(ensure_ascii=False) if v is not string else v }}</arg_value>{%- endfor %}</tool_call>
{%- endfor %}
{%- elif m.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|observation|>{%- endif %}\\n<tool_response>\\n{{ m.content }}\\n</tool_response>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|assistant|>{{- '\\n<think></think>' if enable_thinking is defined and not enable_thinking else '' }}{%- endif %}
"""

DEEPSEEK_V31_STYLE = FULL_WIDTH("""\
{%- set ns = namespace(system='', is_tool=false) %}
{%- for m in messages if m.role == 'system' %}{%- set ns.system = ns.system + m.content %}{%- endfor %}
{{- ns.system }}
{%- if tools %}{{- '\\n\\n## Tools\\n' }}{%- for t in tools %}{{- '\\n### ' + t.function.name + '\\nParameters: ' + (t.function.parameters | tojson) + '\\n' }}{%- endfor %}{%- endif %}
{%- for m in messages %}
{%- if m.role == 'user' %}{{- '<!User!>' + m.content }}{%- set ns.is_tool = false %}
{%- elif m.role == 'assistant' %}
{%- if ns.is_tool %}{{- '<!tool~outputs~end!>' }}{%- endif %}{%- set ns.is_tool = false %}
{{- '<!Assistant!></think>' + (m.content or '') }}
{%- if m.tool_calls %}{{- '<!tool~calls~begin!>' }}
{%- for tc in m.tool_calls %}{{- '<!tool~call~begin!>' + tc.function.name + '<!tool~sep!>' + (tc.function.arguments | tojson) + '<!tool~call~end!>' }}{%- endfor %}
{{- '<!tool~calls~end!>' }}{%- endif %}
{{- '<!end~of~sentence!>' }}
{%- elif m.role == 'tool' %}
{%- if not ns.is_tool %}{{- '<!tool~outputs~begin!>' }}{%- endif %}{%- set ns.is_tool = true %}
{{- '<!tool~output~begin!>' + m.content + '<!tool~output~end!>' }}
{%- endif %}
{%- endfor %}
{%- if ns.is_tool %}{{- '<!tool~outputs~end!>' }}{%- endif %}
{%- if add_generation_prompt %}{{- '<!Assistant!>' + ('<think>' if thinking is defined and thinking else '</think>') }}{%- endif %}
""")

TURNS = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Zürich and Oslo?"},
    {"role": "assistant", "content": "", "reasoning_content": "Two calls.",
     "tool_calls": [
         {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}},
         {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
    {"role": "tool", "content": '{"temp": 21}'},
    {"role": "tool", "content": '{"temp": 12}'},
    {"role": "assistant", "content": "21 and 12 °C.", "reasoning_content": "Both answered."},
    {"role": "user", "content": "Thanks. And tomorrow?"},
]  # fmt: skip

# (family, template, template variables, the tool-call format and reasoning format auto picks)
FAMILIES = [
    ("gpt-oss", HARMONY_STYLE, {"reasoning_effort": "low"}, "gpt-oss", "gpt-oss"),
    ("qwen3-coder", QWEN3_CODER_STYLE, {}, "qwen3_coder", None),
    ("glm-4.5, thinking off", GLM45_STYLE, {"enable_thinking": False}, "glm45", "glm45"),
    ("glm-4.5", GLM45_STYLE, {}, "glm45", "glm45"),
    ("deepseek-v3.1, thinking", DEEPSEEK_V31_STYLE, {"thinking": True}, "deepseek_v31", "qwen3"),
]


@pytest.mark.parametrize("family, template, kwargs, tools_format, reasoning", FAMILIES,
                         ids=[f[0] for f in FAMILIES])  # fmt: skip
def test_family_templates_render_as_transformers(
    tokenizers_pair, family, template, kwargs, tools_format, reasoning
):
    mine, reference = _both(tokenizers_pair, template, TURNS, {"tools": TOOLS, **kwargs})
    assert mine == reference
    assert "Zürich" in mine and "Oslo" in mine and '{"temp": 12}' in mine
    assert detect_tool_call_format(template).name == tools_format
    found = detect_reasoning(template)
    assert (found.name if found else None) == reasoning
