"""The reasoning formats of each family on golden transcripts in the family's own markers:
the whole split and the streamed one (char by char, random chunks) agree; malformed output
reads as content; `auto` finds each family from its template's markers; the thinking
budget's markers; the plugin hook."""

from __future__ import annotations

import random
import re

import pytest

from spruce.constrained.backends.llguidance_text import nested_lark
from spruce.constrained.spec import make_spec
from spruce.runtime.cli import build_parser, server_options
from spruce.runtime.text import reasoning
from spruce.runtime.text.reasoning import (
    REASONING_FORMATS,
    detect_reasoning,
    lark_literal,
    reasoning_format,
    register_plugin,
    thinking_off,
)

ANALYSIS = "<|channel|>analysis<|message|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>"

# (format, output after the prompt, inside, reasoning, content)
GOLDEN = [
    ("qwen3", "<think>\nThe user says hi.\n</think>\n\nHello!", False, "The user says hi.", "Hello!"),
    ("kimi", "◁think▷The user greets me.◁/think▷Hello there.", False, "The user greets me.",
     "Hello there."),
    ("glm45", "\n<think>Plan: answer with the capital.</think>\nParis is the capital.", False,
     "Plan: answer with the capital.", "Paris is the capital."),
    ("glm45", "Paris.", False, None, "Paris."),  # thinking off: no block
    ("minimax", "The user asks for 2+2.\n</think>\n\n4", False, "The user asks for 2+2.", "4"),
    ("minimax", "<think>\nStill 2 < 3</think>Yes.", False, "Still 2 < 3", "Yes."),
    ("kimi_k2", "<think>Look it up.</think>Sure.", False, "Look it up.", "Sure."),
    ("kimi_k2", "Need the tool.<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0", True,
     "Need the tool.", "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0"),
    ("mistral", "[THINK]Convert miles: 26.2 * 1.609.[/THINK]42.2 km", False,
     "Convert miles: 26.2 * 1.609.", "42.2 km"),
    ("gpt-oss", f"{ANALYSIS}User wants the capital of France.<|end|>{FINAL}Paris.", False,
     "User wants the capital of France.", "Paris."),
    ("gpt-oss", f"Need 2 < 3 <|end|>{FINAL}True", True, "Need 2 < 3 ", "True"),
    ("gpt-oss", f"{FINAL[len('<|start|>assistant') :]}No thinking.", False, None, "No thinking."),
]  # fmt: skip
# Malformed output: never an exception; what is not a block is content.
MALFORMED = [
    ("kimi", "no markers at all", None, "no markers at all"),
    ("mistral", "[THINK]never closed", "never closed", ""),
    ("glm45", "text <think>late</think> block", None, "text <think>late</think> block"),
    ("gpt-oss", "Plain text, no headers.", None, "Plain text, no headers."),
    ("gpt-oss", "<|channel|>analysis but no message marker", None,
     "<|channel|>analysis but no message marker"),
    ("gpt-oss", f"{ANALYSIS}cut off", "cut off", ""),
    ("gpt-oss", f"{ANALYSIS}a<|end|> stray text", "a", " stray text"),
]  # fmt: skip


def streamed(fmt, text: str, inside: bool, sizes) -> tuple[str, str]:
    stream = fmt.stream(inside)
    pieces, i = [], 0
    for size in sizes:
        pieces.append(stream.feed(text[i : i + size]))
        i += size
    pieces.append(stream.finish())
    return "".join(r for r, _ in pieces), "".join(c for _, c in pieces)


def chunkings(text: str):
    yield [1] * len(text)
    rng = random.Random(len(text))
    for _ in range(20):
        sizes, left = [], len(text)
        while left:
            sizes.append(min(left, rng.randint(1, 9)))
            left -= sizes[-1]
        yield sizes


@pytest.mark.parametrize(("name", "text", "inside", "thought", "answer"), GOLDEN)
def test_golden_split_whole_and_streamed(name, text, inside, thought, answer):
    fmt = REASONING_FORMATS[name]
    assert fmt.split(text, inside) == (thought, answer)
    for sizes in chunkings(text):
        assert streamed(fmt, text, inside, sizes) == (thought or "", answer), sizes


@pytest.mark.parametrize(("name", "text", "thought", "answer"), MALFORMED)
def test_malformed_output_reads_as_content(name, text, thought, answer):
    fmt = REASONING_FORMATS[name]
    assert fmt.split(text, False) == (thought, answer)
    for sizes in chunkings(text):
        assert streamed(fmt, text, False, sizes) == (thought or "", answer)


def test_harmony_keeps_a_tool_call_whole_in_content():
    """The analysis is reasoning; the call message stays as written (the tool-call format
    reads it); a preamble in the commentary channel is content."""
    fmt = REASONING_FORMATS["gpt-oss"]
    call = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json'
            '<|message|>{"city": "Paris"}')  # fmt: skip
    preamble = "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
    text = f"{ANALYSIS}Need the weather.<|end|>{preamble}{call}"
    assert fmt.split(text, False) == ("Need the weather.", "Checking." + call)
    for sizes in chunkings(text):
        assert streamed(fmt, text, False, sizes) == ("Need the weather.", "Checking." + call)


def test_harmony_prompt_states():
    fmt = REASONING_FORMATS["gpt-oss"]
    assert not fmt.starts_inside("<|start|>user<|message|>hi<|end|><|start|>assistant")
    assert fmt.starts_inside("<|start|>assistant" + ANALYSIS)
    assert fmt.closed_in_prompt("<|start|>assistant<|channel|>final<|message|>")
    glm = REASONING_FORMATS["glm45"]
    assert glm.closed_in_prompt("[gMASK]<sop><|user|>\nhi<|assistant|>\n<think></think>")


@pytest.mark.parametrize("name", ["qwen3", "kimi", "glm45", "minimax", "mistral", "gpt-oss"])
def test_constraint_regex_lets_each_family_think_then_answer(name):
    fmt = REASONING_FORMATS[name]
    answer = r'\{"n": [0-9]+\}'
    inside = name == "minimax"
    thought = {"gpt-oss": ANALYSIS + "a < b, 2<|start|>x<|end|>" + FINAL}.get(
        name, fmt.open_tag + "a < b " + fmt.close_tag + "\n"
    )
    pattern = re.compile(fmt.constraint_regex(answer, inside), re.DOTALL)
    text = thought + '{"n": 4}'
    assert pattern.fullmatch(text), text
    assert fmt.split(text, inside) != (None, text)
    assert not pattern.fullmatch(thought + "x")


@pytest.mark.parametrize("name", ["kimi", "kimi_k2", "glm45", "minimax", "mistral", "gpt-oss"])
def test_constraint_lark_compiles_for_each_family(name):
    """The grammar for answers that are not regular (llguidance), thinking inside or not."""
    answer = nested_lark(make_spec(json_schema={"type": "object"}).grammar)
    fmt = REASONING_FORMATS[name]
    names = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "[THINK]", "[/THINK]", "<think>",
             "</think>")  # fmt: skip
    specials = {text: 500 + i for i, text in enumerate(names)}
    for inside in (False, True):
        for variant in (fmt, fmt.for_calls()):
            make_spec(lark=variant.constraint_lark(answer, inside))
            with_tokens = variant.constraint_lark(answer, inside, specials)  # markers as tokens
            make_spec(lark=with_tokens)
            assert ('"<' not in with_tokens) and ('"[' not in with_tokens), with_tokens


def test_lark_literal_names_special_tokens():
    specials = {"<|start|>": 7, "<|end|>": 9}
    assert lark_literal("<|end|><|start|>assistant", specials) == '<[9]> <[7]> "assistant"'
    assert lark_literal("plain", specials) == '"plain"'


def test_budget_fields_use_each_familys_markers():
    qwen3, harmony = REASONING_FORMATS["qwen3"], REASONING_FORMATS["gpt-oss"]
    assert qwen3.budget_fields(8, True, None) == {
        "thinking_budget": 8, "thinking_open": None, "thinking_close": "</think>"}  # fmt: skip
    assert qwen3.budget_fields(8, False, "Done.") == {
        "thinking_budget": 8, "thinking_open": "<think>", "thinking_close": "Done.</think>"}  # fmt: skip
    assert REASONING_FORMATS["minimax"].budget_fields(3, False, None)["thinking_open"] is None
    assert (
        REASONING_FORMATS["mistral"].budget_fields(3, False, None)["thinking_close"] == "[/THINK]"
    )
    fields = harmony.budget_fields(5, False, None)
    assert fields["thinking_open"] == ANALYSIS
    assert fields["thinking_close"] == "<|end|>" + FINAL
    # a constrained tool call writes its own header after the analysis
    assert harmony.for_calls().budget_fields(5, True, None)["thinking_close"] == (
        "<|end|><|start|>assistant"
    )
    assert REASONING_FORMATS["qwen3"].for_calls() is REASONING_FORMATS["qwen3"]


# Minimal snippets of each family's chat template (its markers only).
TEMPLATES = {
    "qwen3": "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}",
    "glm45": "[gMASK]<sop>{%- if add_generation_prompt -%}<|assistant|>"
    "{{- '\\n<think></think>' if enable_thinking is defined and not enable_thinking }}",
    "minimax": "]~!b[]~b]system\n{{ m.content }}[e~[\n]~b]ai\n<think>\n{{ r }}\n</think>",
    "kimi": "<|im_assistant|>assistant<|im_middle|>◁think▷{{ r }}◁/think▷",
    "kimi_k2": "<|im_assistant|>assistant<|im_middle|><think>{{ r }}</think>",
    "mistral": "[SYSTEM_PROMPT]Think in [THINK]...[/THINK] first.[/SYSTEM_PROMPT]",
    "gpt-oss": "{{- '<|start|>assistant<|channel|>analysis<|message|>' + message.thinking"
    " + '<|end|>' }}{{- '<|start|>assistant' }}",
}


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_auto_finds_each_family_from_its_template(name):
    assert detect_reasoning(TEMPLATES[name]).name == name
    assert reasoning_format("auto", TEMPLATES[name]).name == name


def test_auto_still_reads_deepseek_r1_as_qwen3_and_plain_templates_as_none():
    assert detect_reasoning("<\uff5cAssistant\uff5c><think>\\n{{ x }}</think>").name == "qwen3"
    assert detect_reasoning("{{ messages }}") is None


def test_thinking_switches_as_the_template_reads_them():
    assert thinking_off(TEMPLATES["qwen3"]) == {"enable_thinking": False}
    assert thinking_off("{% if thinking %}<think>{% else %}</think>{% endif %}") == {
        "thinking": False
    }
    assert thinking_off(TEMPLATES["gpt-oss"]) == {}  # message.thinking is no switch


PLUGIN = """
from dataclasses import dataclass

from spruce.runtime.text.reasoning import ReasoningFormat


@dataclass(frozen=True, slots=True)
class ReasonTags(ReasoningFormat):
    name: str = "reason-tags"
    open_tag: str = "<reason>"
    close_tag: str = "</reason>"
    markers: tuple = ("<reason>", "</reason>")
"""


def test_the_plugin_flag_registers_a_format(tmp_path, monkeypatch):
    (tmp_path / "my_reasoning.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(reasoning, "REASONING_FORMATS", dict(REASONING_FORMATS))
    from spruce.runtime.server.openai.chat_prompt import startup_formats

    args = build_parser().parse_args(
        [
            "serve",
            "--model",
            "m",
            "--reasoning-parser",
            "reason-tags",
            "--reasoning-parser-plugin",
            "my_reasoning:ReasonTags",
        ]
    )
    options = server_options(args)
    fmt, _ = startup_formats(options, None)
    assert fmt.name == "reason-tags"
    assert fmt.split("<reason>hmm</reason>ok", False) == ("hmm", "ok")
    assert detect_reasoning("{{ '<reason>' }}...{{ '</reason>' }}").name == "reason-tags"


@pytest.mark.parametrize(
    ("spec", "why"),
    [("no_colon", "expected module:Class"), ("no_such_module_xyz:A", "No module"),
     ("json:dumps", "not a ReasoningFormat")],
)  # fmt: skip
def test_a_bad_plugin_is_a_clear_error(spec, why, monkeypatch):
    monkeypatch.setattr(reasoning, "REASONING_FORMATS", dict(REASONING_FORMATS))
    with pytest.raises(ValueError, match=why):
        register_plugin(spec)
