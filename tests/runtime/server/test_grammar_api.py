"""Context-free grammars and structural tags from every HTTP entry point: the request
fields (SamplingParams' ebnf / lark / structural_tag, vLLM's structured_outputs and guided_*,
response_format, custom tools), their errors (400 naming the field, with line and column),
the reasoning-block wrapping as a Lark grammar, and real generations on the tiny model
(and the bundled SmolLM2, slow) whose output is checked with Python."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import llguidance
import pytest
from test_server import AUTH, start_server, stop_server

from spruce.constrained.backends.llguidance_text import nested_lark
from spruce.constrained.convert import Conversion
from spruce.runtime.core.options import RequestOptions
from spruce.runtime.core.sampling_params import SamplingParams
from spruce.runtime.core.validation import ModelLimits, validate_request
from spruce.runtime.errors import ConstraintError, InvalidRequestError
from spruce.runtime.limits import RequestLimits
from spruce.runtime.server.http.common import ApiError
from spruce.runtime.server.openai.chat_prompt import ChatPrompt
from spruce.runtime.server.openai.custom_tools import CustomCallStream
from spruce.runtime.server.openai.mapping import request_error, sampling_params
from spruce.runtime.server.openai.schemas import ChatRequest, CompletionRequest
from spruce.runtime.server.openai.vllm_fields import grammar_field
from spruce.runtime.text.reasoning import REASONING_FORMATS

GBNF = 'root ::= "Hello" | "Hi"'
GREETINGS = {"Hello", "Hi"}
LARK = 'start: NUMBER ("+" NUMBER)*\nNUMBER: /[1-9][0-9]?/'
SUM = re.compile(r"[1-9][0-9]?(\+[1-9][0-9]?)*")
BAD_LARK = 'start: "a" | ('  # line 1, column 15: the ( is never closed
BAD_GBNF = 'root ::= "a"\nnext ::= ( "b"'


def in_sum_language(text: str) -> bool:
    """A sum, or one cut by the token limit after a '+' (random logits may go on adding)."""
    text = text if SUM.fullmatch(text) else text + "1"
    return SUM.fullmatch(text) is not None and eval(text) > 0  # the sum parses as Python too


def chat_body(model: str, **extra) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "Greet me."}],
        "max_tokens": 12,
        **extra,
    }


# -- request fields -----------------------------------------------------------------------------


def test_sampling_params_hold_grammars_and_structural_tags():
    tag = {"type": "structural_tag", "format": {"type": "const_string", "value": "hi"}}
    params = SamplingParams.from_dict({"structural_tag": tag})
    assert json.loads(params.structural_tag) == tag and params.has_constraint
    assert SamplingParams(ebnf=GBNF).constraint_names == ["ebnf"]
    with pytest.raises(InvalidRequestError, match="give at most one constraint; got regex, lark"):
        SamplingParams(regex="a", lark=LARK).validate()
    with pytest.raises(
        InvalidRequestError, match=r"ebnf has 21 characters; at most 20 \(--max-constraint-chars\)"
    ):
        SamplingParams(ebnf=GBNF[:21]).validate(limits=RequestLimits(max_constraint_chars=20))
    with pytest.raises(InvalidRequestError, match="lark must be a string"):
        SamplingParams(lark=["start: x"]).validate()


@pytest.mark.parametrize(
    "field, grammar, where",
    [("lark", BAD_LARK, "line 1, column 15"), ("ebnf", BAD_GBNF, "line 2, column")],
)
def test_a_grammar_syntax_error_names_the_field_line_and_column(field, grammar, where):
    with pytest.raises(ConstraintError) as error:
        validate_request(
            [1, 2], SamplingParams(**{field: grammar}), RequestOptions(), ModelLimits(100, 1000)
        )
    assert str(error.value).startswith(f"{field}: {where}"), str(error.value)


def test_lark_is_told_from_gbnf_as_vllm_does():
    assert (
        grammar_field(LARK) == "lark"
        and grammar_field('%llguidance {}\nstart: x\nx: "a"') == "lark"
    )
    assert grammar_field(GBNF) == "ebnf" and grammar_field('root ::= "a"\n') == "ebnf"


def _chat(**extra) -> ChatRequest:
    return ChatRequest.model_validate(chat_body("m", **extra))


@pytest.mark.parametrize(
    "extra, expected",
    [
        ({"structured_outputs": {"grammar": GBNF}}, {"ebnf": GBNF}),
        ({"structured_outputs": {"grammar": LARK}}, {"lark": LARK}),
        ({"guided_grammar": LARK}, {"lark": LARK}),
        ({"guided_grammar": GBNF}, {"ebnf": GBNF}),
        ({"structured_outputs": {"regex": "[a-z]+"}}, {"regex": "[a-z]+"}),
        ({"guided_regex": "[a-z]+"}, {"regex": "[a-z]+"}),
        ({"structured_outputs": {"choice": ["a", "b"]}}, {"choices": ("a", "b")}),
        ({"guided_choice": ["a", "b"]}, {"choices": ("a", "b")}),
        ({"structured_outputs": {"json": {"type": "integer"}}}, {"json_schema": '{"type": "integer"}'}),
        ({"guided_json": {"type": "integer"}}, {"json_schema": '{"type": "integer"}'}),
        ({"structured_outputs": {"json_object": True}}, {"json_schema": '{"type": "object"}'}),
        ({"ebnf": GBNF}, {"ebnf": GBNF}),  # SGLang's extension field
        ({"response_format": {"type": "structural_tag", "structures": [], "triggers": ["<f>"]}},
         {"structural_tag": '{"type": "structural_tag", "structures": [], "triggers": ["<f>"]}'}),
    ],
)  # fmt: skip
def test_vllm_and_sglang_fields_become_one_constraint(extra, expected):
    params = sampling_params(_chat(**extra), 12)
    assert {name: getattr(params, name) for name in params.constraint_names} == expected


def test_completions_take_the_same_fields():
    req = CompletionRequest.model_validate(
        {"model": "m", "prompt": "x", "structured_outputs": {"grammar": GBNF}}
    )
    assert sampling_params(req, 4).ebnf == GBNF


@pytest.mark.parametrize(
    "extra, names",
    [
        (
            {"structured_outputs": {"grammar": GBNF}, "guided_regex": "a"},
            "guided_regex, structured_outputs.grammar",
        ),
        (
            {"structured_outputs": {"grammar": GBNF, "regex": "a"}},
            "structured_outputs.regex, structured_outputs.grammar",
        ),
        ({"ebnf": GBNF, "response_format": {"type": "json_object"}}, "ebnf, response_format"),
    ],
)
def test_two_constraints_at_once_are_a_400_naming_both(extra, names):
    with pytest.raises(ApiError) as error:
        sampling_params(_chat(**extra), 12)
    assert (
        error.value.status == 400
        and error.value.message == f"give at most one constraint; got {names}"
    )


def test_a_grammar_error_is_renamed_to_the_field_the_request_used():
    req = _chat(structured_outputs={"grammar": BAD_LARK})
    error = request_error(ConstraintError("lark: line 1, column 15: Expected token"), req)
    assert error.param == "structured_outputs.grammar"
    assert error.message == "structured_outputs.grammar: line 1, column 15: Expected token"


# -- custom tools -------------------------------------------------------------------------------


def test_a_custom_tool_call_streams_as_one_call():
    stream = CustomCallStream("math")
    first = stream.feed("1+")[1]
    assert first[0]["type"] == "custom" and first[0]["custom"] == {"name": "math", "input": "1+"}
    assert stream.feed("2") == ("", [{"index": 0, "custom": {"input": "2"}}])
    assert stream.finish() == ("", []) and stream.has_calls and not stream.failed


# -- reasoning, then a constraint that is not regular -------------------------------------------


class _Bytes:
    """A byte-level vocabulary for llguidance's own matcher (256 bytes and an end token)."""

    eos_token_id, bos_token_id = 256, None
    tokens = [bytes([i]) for i in range(256)] + [b"<end>"]

    def __call__(self, text):
        return list(text if isinstance(text, bytes) else text.encode())


BYTES = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()))


def accepts(lark: str, text: str) -> bool:
    matcher = llguidance.LLMatcher(BYTES, lark)
    assert not matcher.is_error(), matcher.get_error()
    return matcher.consume_tokens(list(text.encode())) and matcher.is_accepting()


@pytest.mark.parametrize("inside", [True, False])
def test_reasoning_before_a_grammar_is_one_lazy_lexeme(inside):
    fmt = REASONING_FORMATS["qwen3"]
    grammar = fmt.constraint_lark(
        nested_lark(llguidance.LLMatcher.grammar_from_lark('start: "Hello" | "Hi" | "}"')), inside
    )
    assert accepts(grammar, "<think>a < b, so...</think>\n\nHello")
    assert accepts(grammar, "<think></think>}")
    assert not accepts(grammar, "<think>x</think> Hey")  # the answer is still constrained
    assert not accepts(
        grammar, "<think>x</think>y</think>Hi"
    )  # the reasoning ends at the first tag
    assert (
        accepts(grammar, "hmm</think>Hi") == inside
    )  # inside the block: the opening tag is optional
    assert accepts(grammar, "Hi") != inside  # outside: the block is


@pytest.mark.parametrize(
    "field, grammar", [("ebnf", GBNF), ("structured_outputs", {"grammar": LARK})]
)
def test_a_chat_constraint_after_reasoning_becomes_one_lark_grammar(field, grammar):
    prompt = ChatPrompt(
        "...<|im_start|>assistant\n", [1], REASONING_FORMATS["qwen3"], thinking=False
    )
    wrapped, answer_spec = prompt.constrain(
        sampling_params(_chat(**{field: grammar}), 12), Conversion()
    )
    assert wrapped.constraint_names == ["lark"] and answer_spec.kind == field.replace(
        "structured_outputs", "lark"
    )
    spec = Conversion().spec(lark=wrapped.lark)
    assert spec.backend == "llguidance"
    answer = "Hi" if field == "ebnf" else "1+22"
    assert accepts(wrapped.lark, f"<think>so: </thin</think>\n{answer}") and accepts(
        wrapped.lark, answer
    )
    assert not accepts(wrapped.lark, "<think>x</think>Hey")


def test_a_regular_chat_constraint_after_reasoning_stays_a_regex():
    prompt = ChatPrompt("...", [1], REASONING_FORMATS["qwen3"], thinking=True)
    wrapped, _ = prompt.constrain(
        sampling_params(_chat(guided_regex="[0-9]+"), 12), Conversion(backend="spruce")
    )
    assert wrapped.constraint_names == ["regex"] and re.fullmatch(wrapped.regex, "hmm</think> 42")


def test_reasoning_before_a_json_schema_in_llguidance_form():
    schema_grammar = llguidance.LLMatcher.grammar_from_json_schema({"type": "integer"})
    grammar = REASONING_FORMATS["deepseek-r1"].constraint_lark(nested_lark(schema_grammar), False)
    assert accepts(grammar, "2 + 2 is 4.</think>\n4") and not accepts(
        grammar, "2 + 2 is 4.</think>four"
    )


# -- end to end on the tiny model ---------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("grammar-server") / "server.log"
    srv = start_server(tiny_llama_dir, log_path, "--api-key", "test-key")
    yield srv
    assert stop_server(srv) == 0, srv.log()


@pytest.fixture(scope="module")
def model_name(tiny_llama_dir) -> str:
    return Path(tiny_llama_dir).name


@pytest.fixture()
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as c:
        yield c


SAMPLED = {"temperature": 1.0, "seed": 7}


@pytest.mark.parametrize(
    "field, grammar, check",
    [("ebnf", GBNF, GREETINGS.__contains__), ("lark", LARK, in_sum_language)],
)
def test_generate_follows_the_grammar(http, field, grammar, check):
    params = {field: grammar, "max_new_tokens": 16, **SAMPLED}
    r = http.post("/generate", json={"text": ["Greet:", "Sum:", "x"], "sampling_params": params})
    assert r.status_code == 200, r.text
    for result in r.json():
        assert check(result["text"]), result["text"]


@pytest.mark.parametrize("field", ["structured_outputs", "guided_grammar"])
@pytest.mark.parametrize(
    "grammar, check", [(GBNF, GREETINGS.__contains__), (LARK, in_sum_language)]
)
def test_chat_follows_the_grammar(http, model_name, field, grammar, check):
    extra = (
        {"structured_outputs": {"grammar": grammar}}
        if field == "structured_outputs"
        else {field: grammar}
    )
    r = http.post(
        "/v1/chat/completions", json=chat_body(model_name, n=3, max_tokens=24, **extra, **SAMPLED)
    )
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        assert check(choice["message"]["content"]), choice["message"]


def test_completions_follow_the_grammar(http, model_name):
    body = {
        "model": model_name,
        "prompt": "Hi",
        "max_tokens": 16,
        "n": 3,
        "guided_grammar": LARK,
        **SAMPLED,
    }
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert all(in_sum_language(c["text"]) for c in r.json()["choices"]), r.json()


def test_a_named_custom_tool_is_called_in_its_grammar(http, model_name):
    pair = 'start: NUMBER "+" NUMBER\nNUMBER: /[1-9][0-9]?/'  # ends within max_tokens
    tool = {"type": "custom", "custom": {"name": "add", "description": "Adds numbers.", "format": {
        "type": "grammar", "grammar": {"syntax": "lark", "definition": pair}}}}  # fmt: skip
    body = chat_body(
        model_name,
        tools=[tool],
        tool_choice={"type": "custom", "custom": {"name": "add"}},
        **SAMPLED,
    )
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    [call] = choice["message"]["tool_calls"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert (
        call["type"] == "custom"
        and call["custom"]["name"] == "add"
        and in_sum_language(call["custom"]["input"])
    )
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as streamed:
        events = [
            json.loads(line[6:]) for line in streamed.iter_lines() if line.startswith("data: {")
        ]
    deltas = [tc for e in events for tc in e["choices"][0]["delta"].get("tool_calls", [])]
    assert deltas[0]["custom"]["name"] == "add"
    assert in_sum_language("".join(d["custom"]["input"] for d in deltas))


@pytest.mark.parametrize(
    "path, extra, param, where",
    [
        ("/generate", {"sampling_params": {"lark": BAD_LARK}}, None, "lark: line 1, column 15"),
        ("/generate", {"sampling_params": {"ebnf": BAD_GBNF}}, None, "ebnf: line 2, column"),
        ("/v1/chat/completions", {"structured_outputs": {"grammar": BAD_LARK}}, "structured_outputs.grammar",
         "structured_outputs.grammar: line 1, column 15"),
        ("/v1/chat/completions", {"guided_grammar": BAD_GBNF}, "guided_grammar", "guided_grammar: line 2, column"),
        ("/v1/completions", {"lark": BAD_LARK}, "lark", "lark: line 1, column 15"),
        ("/v1/chat/completions", {"tools": [{"type": "custom", "custom": {"name": "t", "format": {
            "type": "grammar", "grammar": {"syntax": "lark", "definition": BAD_LARK}}}}],
            "tool_choice": {"type": "custom", "custom": {"name": "t"}}}, "tools", "tools: custom tool 't': lark: line 1"),
    ],
)  # fmt: skip
def test_syntax_errors_are_400s_with_the_field_line_and_column(
    http, model_name, path, extra, param, where
):
    if path == "/generate":
        body = {"text": "x", **extra}
    elif path == "/v1/completions":
        body = {"model": model_name, "prompt": "x", "max_tokens": 2, **extra}
    else:
        body = chat_body(model_name, **extra)
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"] if "error" in r.json() else r.json()
    message = error.get("message", "")
    assert message.startswith((where, f"prompt 0: {where}")), message
    if param is not None:
        assert error["param"] == param


def test_two_constraints_at_once_are_a_400_on_every_route(http, model_name):
    r = http.post("/generate", json={"text": "x", "sampling_params": {"ebnf": GBNF, "lark": LARK}})
    assert r.status_code == 400 and "at most one constraint" in r.text
    r = http.post("/v1/chat/completions", json=chat_body(model_name, ebnf=GBNF, guided_regex="a"))
    assert r.status_code == 400 and "got ebnf, guided_regex" in r.json()["error"]["message"]


TAG_TREE = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
    {"type": "const_string", "value": "Answer: "}, {"type": "regex", "pattern": "[0-9]{2}"}]}}  # fmt: skip
TAG_LIST = {"type": "structural_tag", "triggers": ["<n>"],
            "structures": [{"begin": "<n>", "schema": {"type": "integer", "minimum": 0, "maximum": 99}, "end": "</n>"}]}  # fmt: skip


def test_structural_tags_from_generate_and_response_format(http, model_name):
    r = http.post(
        "/generate",
        json={
            "text": "x",
            "sampling_params": {"structural_tag": TAG_TREE, "max_new_tokens": 12, **SAMPLED},
        },
    )
    assert r.status_code == 200 and re.fullmatch("Answer: [0-9]{2}", r.json()["text"]), r.text
    body = chat_body(model_name, response_format=TAG_TREE, **SAMPLED)
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200 and re.fullmatch(
        "Answer: [0-9]{2}", r.json()["choices"][0]["message"]["content"]
    ), r.text
    body = chat_body(model_name, response_format=TAG_LIST, max_tokens=40, n=3, **SAMPLED)
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    for choice in r.json()[
        "choices"
    ]:  # free text; each <n> is followed by an integer in range, then </n>
        text = choice["message"]["content"]
        for region in text.split("<n>")[1:]:
            number, closed, _ = region.partition("</n>")
            assert (closed and 0 <= json.loads(number) <= 99) or choice[
                "finish_reason"
            ] == "length", text


def test_a_bad_structural_tag_is_a_400_naming_response_format(http, model_name):
    bad = {"type": "structural_tag", "format": {"type": "regex"}}
    r = http.post("/v1/chat/completions", json=chat_body(model_name, response_format=bad))
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
    assert r.json()["error"]["message"] == "response_format.format.pattern must be a string", r.text
