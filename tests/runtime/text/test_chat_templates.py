"""Chat templates render as transformers renders them: the same text from Spruce's
Tokenizer.apply_chat_template and transformers' for templates written like the real ones
(Qwen3 with tools and enable_thinking, Llama 3.1 with strftime_now, one that raises, one
with documents and the generation tag)."""

from __future__ import annotations

import jinja2
import pytest

from spruce.runtime.errors import ModelLoadError
from spruce.runtime.text.tokenizer import read_chat_template

QWEN3_STYLE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- "# Tools\\n\\nYou may call one or more functions.\\n\\n<tools>" }}
{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\\n</tools>\\n\\nFor each call, return <tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' }}
{%- if message.reasoning_content %}{{- '<think>\\n' + message.reasoning_content.strip('\\n') + '\\n</think>\\n\\n' }}{%- endif %}
{{- message.content or '' }}
{%- for call in message.tool_calls or [] %}
{{- '\\n<tool_call>\\n{"name": "' + call.function.name + '", "arguments": ' + (call.function.arguments | tojson) + '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}
"""

LLAMA31_STYLE = """\
{{- bos_token }}
{%- if not date_string is defined %}{%- set date_string = strftime_now("%d %b %Y") %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
{%- set system_message = messages[0]['content'] | trim %}{%- set messages = messages[1:] %}
{%- else %}{%- set system_message = "" %}{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\nToday Date: " + date_string + "\\n\\n" }}
{{- system_message }}{{- "<|eot_id|>" }}
{%- for message in messages %}
{%- if message.role not in ['user', 'assistant', 'ipython'] %}
{{- raise_exception("Unknown role: " + message.role) }}
{%- endif %}
{%- if tools is not none and loop.first %}
{{- '<|start_header_id|>user<|end_header_id|>\\n\\nRespond in the format {"name": function name, "parameters": dictionary}.\\n\\n' }}
{%- for t in tools %}{{- t | tojson(indent=4) }}{{- "\\n\\n" }}{%- endfor %}
{{- message.content | trim + '<|eot_id|>' }}
{%- else %}
{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}
"""

RAISING = """\
{%- for message in messages %}
{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
{%- endif %}
{{- '[' + message['role'] + '] ' + message['content'] + eos_token }}
{%- endfor %}
"""

DOCUMENTS = """\
{%- if documents %}{{- '<documents>' }}{%- for d in documents %}{{- '\\n' + d.title + ': ' + d.text }}{%- endfor %}{{- '\\n</documents>\\n' }}{%- endif %}
{%- for message in messages %}
{{- message.role + ': ' }}{% generation %}{{- message.content }}{% endgeneration %}{{- '\\n' }}
{%- endfor %}
{{- (tools or []) | tojson(separators=(',', ':'), sort_keys=True) }}
"""

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city, °C",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
]  # fmt: skip
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Zürich?"},
    {"role": "assistant", "content": "", "reasoning_content": "Call the tool.",
     "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]},
    {"role": "tool", "content": '{"temp": 21}'},
    {"role": "user", "content": "Thanks. And tomorrow?"},
]  # fmt: skip

CASES = [
    (
        "qwen3 with tools, thinking off",
        QWEN3_STYLE,
        CONVERSATION,
        {"tools": TOOLS, "enable_thinking": False},
    ),
    ("qwen3 with tools, thinking on", QWEN3_STYLE, CONVERSATION, {"tools": TOOLS}),
    ("qwen3 without tools", QWEN3_STYLE, CONVERSATION[:2], {}),
    ("llama 3.1 with tools", LLAMA31_STYLE, [CONVERSATION[0], CONVERSATION[1]], {"tools": TOOLS}),
    ("llama 3.1, given date", LLAMA31_STYLE, CONVERSATION[1:2], {"date_string": "01 Jan 2025"}),
    (
        "documents",
        DOCUMENTS,
        CONVERSATION[1:2],
        {"documents": [{"title": "a", "text": "x"}], "tools": TOOLS},
    ),
]


@pytest.fixture(scope="module")
def tokenizers_pair(tiny_llama_dir):
    """(Spruce's tokenizer, transformers' tokenizer) of the same tiny model."""
    from transformers import PreTrainedTokenizerFast

    from spruce.runtime.text.tokenizer import Tokenizer

    ours = Tokenizer.from_folder(str(tiny_llama_dir))
    theirs = PreTrainedTokenizerFast(
        tokenizer_file=str(tiny_llama_dir / "tokenizer.json"), eos_token="<|im_end|>"
    )
    return ours, theirs


def _both(pair, template: str, messages: list[dict], kwargs: dict) -> tuple[str, str]:
    ours, theirs = pair
    ours.chat_template = template
    mine = ours.apply_chat_template(messages, add_generation_prompt=True, **kwargs)
    reference = theirs.apply_chat_template(
        messages, chat_template=template, add_generation_prompt=True, tokenize=False, **kwargs
    )
    return mine, reference


@pytest.mark.parametrize("name, template, messages, kwargs", CASES, ids=[c[0] for c in CASES])
def test_renders_as_transformers(tokenizers_pair, name, template, messages, kwargs):
    mine, reference = _both(tokenizers_pair, template, messages, kwargs)
    assert mine == reference
    if "thinking off" in name:
        assert mine.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") and "<tools>" in mine


def test_strftime_now_is_today(tokenizers_pair):
    from datetime import datetime

    mine, reference = _both(tokenizers_pair, LLAMA31_STYLE, CONVERSATION[1:2], {})
    assert mine == reference and f"Today Date: {datetime.now().strftime('%d %b %Y')}" in mine


def test_raise_exception_is_a_template_error(tokenizers_pair):
    ours, theirs = tokenizers_pair
    ours.chat_template = RAISING
    bad = [{"role": "assistant", "content": "hi"}]
    with pytest.raises(jinja2.TemplateError, match="must alternate"):
        ours.apply_chat_template(bad)
    with pytest.raises(jinja2.TemplateError, match="must alternate"):
        theirs.apply_chat_template(bad, chat_template=RAISING, tokenize=False)
    good = [{"role": "user", "content": "hi"}]
    assert _both(tokenizers_pair, RAISING, good, {})[0] == "[user] hi<|im_end|>"
    ours.chat_template = LLAMA31_STYLE
    with pytest.raises(jinja2.TemplateError, match="Unknown role: tool"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])


def test_read_chat_template_file(tmp_path):
    jinja = tmp_path / "t.jinja"
    jinja.write_text(QWEN3_STYLE)
    assert read_chat_template(str(jinja)) == QWEN3_STYLE
    config = tmp_path / "tokenizer_config.json"
    config.write_text('{"chat_template": "{{ messages }}"}')
    assert read_chat_template(str(config)) == "{{ messages }}"
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% if %}")
    with pytest.raises(ModelLoadError, match="does not compile"):
        read_chat_template(str(broken))
    with pytest.raises(ModelLoadError, match="cannot read the chat template"):
        read_chat_template(str(tmp_path / "missing.jinja"))
