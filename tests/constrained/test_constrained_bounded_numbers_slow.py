"""SGLang's structural-tag test on the bundled model, greedy: a schema with an integer
`population` inside a structural tag (both forms), and as a tool call's arguments
(tool_choice "auto" with a strict function, "required"), through the constraints the server
builds. Unbounded, the model wrote `"population": 8581222238222332238...` (or invented
properties) to its token limit; bounded and closed as a `json_schema` constraint is, each
output parses as JSON of the schema. One engine, one batch."""

from __future__ import annotations

import json

import pytest
from support import bundled_gguf_path

from spruce.constrained.convert import Conversion
from spruce.constrained.report import validate_output
from spruce.runtime.server.openai.tool_parsers import TOOL_CALL_FORMATS
from spruce.runtime.server.openai.tool_stream import final_calls
from spruce.runtime.server.openai.tool_tags import strict_auto_tag

pytestmark = pytest.mark.slow

CAPITAL = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "population": {"type": "integer"}},
    "required": ["name", "population"],
}
FUNCTION = {"name": "get_capital_info", "description": "Get the name and population of a capital city",
            "parameters": CAPITAL, "strict": True}  # fmt: skip
BEGIN, END = "<function=get_capital_info>", "</function>"
OLD_FORM = {"type": "structural_tag", "triggers": ["<function="],
            "structures": [{"begin": BEGIN, "schema": CAPITAL, "end": END}]}  # fmt: skip
FORMAT_FORM = {"type": "structural_tag", "format": {
    "type": "triggered_tags", "triggers": ["<function="], "at_least_one": True, "stop_after_first": True,
    "tags": [{"begin": BEGIN, "content": {"type": "json_schema", "json_schema": CAPITAL}, "end": END}]}}  # fmt: skip
ASK = {"role": "user", "content": "Introduce the capital of France."}


def tagged_system() -> list[dict]:
    """The tag's format, shown once (as SGLang's test prompt does): the model writes it."""
    system = (
        "To describe a capital city, call the function 'get_capital_info' with its name and "
        f"population, replying only in this format:\n{BEGIN}{{parameters}}{END}"
    )
    example = f'{BEGIN}{{"name": "Rome", "population": 2800000}}{END}'
    return [{"role": "system", "content": system},
            {"role": "user", "content": "Introduce the capital of Italy."}, {"role": "assistant", "content": example}]  # fmt: skip


def tools_system(fmt) -> list[dict]:
    """The tools and the format's instructions (as the server's prompt for a template that
    renders no tools), and one call shown."""
    system = (
        f"Tools:\n{json.dumps([{'type': 'function', 'function': FUNCTION}])}\n\n{fmt.instructions}"
    )
    call = '<tool_call>\n{"name": "get_capital_info", "arguments": {"name": "Rome", "population": 2800000}}\n</tool_call>'
    return [{"role": "system", "content": system},
            {"role": "user", "content": "Introduce the capital of Italy."}, {"role": "assistant", "content": call}]  # fmt: skip


@pytest.fixture(scope="module")
def outputs() -> dict[str, str]:
    """Each case's output text, generated in one batch."""
    if bundled_gguf_path() is None:
        pytest.skip("the bundled model is not installed")
    from spruce.runtime import Engine

    json_format, hermes = TOOL_CALL_FORMATS["json"], TOOL_CALL_FORMATS["hermes"]
    cases = {
        "old form": (tagged_system(), {"structural_tag": json.dumps(OLD_FORM)}),
        "format form": ([], {"structural_tag": json.dumps(FORMAT_FORM)}),
        "auto": (tools_system(json_format), strict_auto_tag(json_format, [FUNCTION], False)),
        "required regex": (
            tools_system(hermes),
            hermes.constraint([FUNCTION], False, False, Conversion()),
        ),
        "required json_schema": (
            tools_system(json_format),
            json_format.constraint([FUNCTION], False, False, Conversion()),
        ),
    }
    engine = Engine(num_threads=2, kv_memory_gb=0.5)
    try:
        prompts = [engine.apply_chat_template([*shown, ASK]) for shown, _ in cases.values()]
        params = [{**constraint, "temperature": 0, "max_new_tokens": 64} for _, constraint in cases.values()]  # fmt: skip
        outs = engine.generate(prompts, params)
    finally:
        engine.shutdown()
    return {name: out["text"] for name, out in zip(cases, outs)}


def assert_capital(arguments: str) -> None:
    assert validate_output(CAPITAL, arguments) == {"valid": True, "error": None}, arguments
    assert len(str(abs(json.loads(arguments)["population"]))) <= 16


@pytest.mark.parametrize("form", ["old form", "format form"])
def test_a_structural_tag_holds_json_of_its_schema(outputs, form):
    text = outputs[form]
    assert BEGIN in text and END in text, text
    assert_capital(text.split(BEGIN, 1)[1].split(END, 1)[0])


@pytest.mark.parametrize("case", ["auto", "required regex", "required json_schema"])
def test_a_tool_call_holds_json_of_its_parameters(outputs, case):
    fmt = TOOL_CALL_FORMATS["hermes" if case == "required regex" else "json"]
    _, calls = final_calls(fmt, outputs[case], {FUNCTION["name"]})
    assert [c["function"]["name"] for c in calls] == [FUNCTION["name"]], outputs[case]
    assert_capital(calls[0]["function"]["arguments"])
