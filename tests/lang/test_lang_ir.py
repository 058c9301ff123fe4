"""The DSL's expressions and IR: gen keywords derived from SamplingParams, trace()."""

from __future__ import annotations

import dataclasses
import json

import pydantic
import pytest

import spruce.lang as sl
from spruce.lang.ir import Arg, Fork, Gen, Join, RoleBegin, RoleEnd, Select, Text, Var, dsl_keywords
from spruce.runtime.core.sampling_params import SamplingParams
from spruce.runtime.errors import ConstraintError


class Person(pydantic.BaseModel):
    name: str
    age: int


def test_gen_keywords_follow_sampling_params():
    keywords = set(dsl_keywords())
    renamed = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}
    assert {renamed.get(f, f) for f in SamplingParams.field_names()} <= keywords
    assert {"return_logprob", "logprob_start_len", "top_logprobs_num"} <= keywords


def test_gen_keeps_only_given_fields_in_sampling_params_names():
    node = sl.gen("x", 16, stop="\n", temperature=0, return_logprob=True)
    assert node == Gen(
        "x",
        (("max_new_tokens", 16), ("temperature", 0), ("stop", ("\n",))),
        (("return_logprob", True),),
    )
    assert sl.gen("x", temperature=0, max_tokens=16, stop=["\n"], return_logprob=True) == node
    assert sl.gen().sampling == ()


def test_gen_unknown_keyword_lists_the_known_ones():
    with pytest.raises(TypeError, match="unexpected keyword argument 'temprature'.*temperature"):
        sl.gen("x", temprature=0.5)


def test_gen_json_schema_from_pydantic_dict_or_text():
    from_model = sl.gen("p", json_schema=Person).sampling_params["json_schema"]
    assert json.loads(from_model) == Person.model_json_schema()
    assert json.loads(
        sl.gen("p", json_schema={"type": "integer"}).sampling_params["json_schema"]
    ) == {"type": "integer"}
    assert (
        sl.gen("p", json_schema='{"type": "string"}').sampling_params["json_schema"]
        == '{"type": "string"}'
    )


def test_gen_dtype_becomes_a_regex():
    import re

    node = sl.gen_int("n")
    assert node.dtype == "int" and re.fullmatch(node.sampling_params["regex"], "-42")
    assert sl.gen("b", dtype=bool).dtype == "bool"
    assert sl.gen_string("s").dtype == "str"
    with pytest.raises(ConstraintError, match="at most one constraint"):
        sl.gen("n", dtype=int, regex="[0-9]+")
    with pytest.raises(ConstraintError, match="unsupported dtype"):
        sl.gen("n", dtype=list)


def test_choices_are_checked():
    picked = sl.gen("c", choices=["a", "b"], choices_method=sl.greedy_token_selection, max_tokens=4)
    assert picked == Select(
        "c", ("a", "b"), 0.0, sl.greedy_token_selection
    )  # SGLang: gen with choices selects
    assert sl.gen("c", choices=["a"]) == sl.select("c", ["a"])
    with pytest.raises(sl.ProgramError, match="choices_method=...\\) needs choices"):
        sl.gen("c", choices_method=sl.greedy_token_selection)
    with pytest.raises(sl.ProgramError, match="non-empty list"):
        sl.select("c", choices=[])
    with pytest.raises(sl.ProgramError, match="non-empty list"):
        sl.gen("c", choices="ab")


def test_expressions_concatenate_flat():
    seq = "Q: " + sl.gen("a") + "\n" + sl.select("b", ["x", "y"])
    assert [type(n) for n in seq.nodes] == [Text, Gen, Text, Select]


def test_image_says_there_is_no_vision_encoder():
    with pytest.raises(sl.UnsupportedFeatureError, match="no vision encoder"):
        sl.image("cat.png")


@sl.function
def chat_program(s, question, n_ideas=2):
    s += sl.system("Be brief.")
    with s.user():
        s += question
    s += sl.assistant_begin()
    s += sl.gen("answer", max_tokens=8, stop="\n")
    s += sl.assistant_end()
    s += "Choice: " + sl.select("pick", ["a", "b"], choices_method=sl.greedy_token_selection)
    forks = s.fork(n_ideas)
    for i, f in enumerate(forks):
        f += f"Idea {i}: " + sl.gen("idea", max_tokens=4)
    forks.join()
    s += "Summary of " + s["answer"]


def test_trace_gives_the_ir_without_a_backend():
    nodes = chat_program.trace()
    assert nodes[:9] == [
        RoleBegin("system"), Text("Be brief."), RoleEnd("system"),
        RoleBegin("user"), Arg("question"), RoleEnd("user"),
        RoleBegin("assistant"), Gen("answer", (("max_new_tokens", 8), ("stop", ("\n",)))), RoleEnd("assistant"),
    ]  # fmt: skip
    assert nodes[9:11] == [
        Text("Choice: "),
        Select("pick", ("a", "b"), 0.0, sl.greedy_token_selection),
    ]
    fork = nodes[11]
    assert isinstance(fork, Fork) and fork.size == 2
    assert fork.branches == (
        (Text("Idea 0: "), Gen("idea", (("max_new_tokens", 4),))),
        (Text("Idea 1: "), Gen("idea", (("max_new_tokens", 4),))),
    )
    assert nodes[12:] == [Join("gather_variable"), Text("Summary of "), Var("answer")]


def test_trace_nodes_are_immutable_and_hashable():
    nodes = chat_program.trace(question="Why?")
    assert nodes[4] == Text("Why?")
    with pytest.raises(dataclasses.FrozenInstanceError):
        nodes[0].role = "user"
    assert len(set(nodes)) > 1  # hashable


def test_run_needs_a_backend():
    from spruce.lang import program

    saved = program._default_backend
    program._default_backend = None
    try:
        with pytest.raises(sl.ProgramError, match="no backend"):
            chat_program.run(question="x")
    finally:
        program._default_backend = saved


def test_an_http_address_selects_the_http_transport():
    from spruce.lang.launcher import free_port

    address = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(
        sl.RuntimeUnavailableError, match=f"no Spruce runtime answered at {address}"
    ):
        sl.RuntimeEndpoint(address, api_key="secret")
