"""Context-free grammars from the DSL (`sl.gen(ebnf=...)`, `sl.gen(lark=...)`) over both
transports (ZeroMQ and HTTP) on the tiny model, and from `Engine.generate` on the bundled
SmolLM2 (slow). Outputs are checked with Python, not with a matcher of ours."""

from __future__ import annotations

import importlib.util
import re

import pytest

import spruce.lang as sl

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("spruce.runtime.server.launch") is None,
    reason="spruce serve is not available",
)
GBNF = 'root ::= "Hello" | "Hi"'
LARK = 'start: NUMBER ("+" NUMBER)*\nNUMBER: /[1-9][0-9]?/'
SUM = re.compile(r"[1-9][0-9]?(\+[1-9][0-9]?)*")


@sl.function
def greet_and_add(s):
    s += "Greet me: " + sl.gen("greeting", ebnf=GBNF, max_tokens=8, temperature=1.0)
    s += "\nNow a sum: " + sl.gen("sum", lark=LARK, max_tokens=12, temperature=1.0)


def test_gen_follows_an_ebnf_and_a_lark_grammar(endpoint):
    states = greet_and_add.run_batch([{}] * 4, backend=endpoint)
    for state in states:
        assert state.ok, state.error()
        assert state["greeting"] in ("Hello", "Hi")
        total = (
            state["sum"] if SUM.fullmatch(state["sum"]) else state["sum"] + "1"
        )  # cut by max_tokens
        assert SUM.fullmatch(total) and eval(total) > 0, state["sum"]
        assert state.text() == f"Greet me: {state['greeting']}\nNow a sum: {state['sum']}"


def test_a_grammar_syntax_error_is_a_400_with_the_field_line_and_column(endpoint):
    @sl.function
    def bad(s):
        s += "x" + sl.gen("y", lark='start: "a" | (', max_tokens=2)

    error = bad.run(backend=endpoint).error()
    assert isinstance(error, sl.RuntimeRequestError) and error.status == 400
    assert "lark: line 1, column 15" in error.message


def test_two_constraints_in_one_gen_are_refused():
    with pytest.raises(Exception, match="at most one constraint"):
        greet_and_add_bad = sl.gen("x", ebnf=GBNF, dtype=int)  # noqa: F841


# -- the bundled model, through Engine.generate (slow) -----------------------------------------


@pytest.mark.slow
def test_engine_generate_follows_grammars_on_the_bundled_model():
    from support import bundled_gguf_path

    from spruce.runtime import Engine

    if bundled_gguf_path() is None:
        pytest.skip("the bundled model is not installed")
    engine = Engine(num_threads=1, kv_memory_gb=0.25)
    prompt = engine.apply_chat_template([{"role": "user", "content": "Say hello."}])
    greetings = engine.generate(
        [prompt] * 2, {"ebnf": GBNF, "temperature": 0.7, "seed": 1, "max_new_tokens": 8}
    )
    assert [r["text"] in ("Hello", "Hi") for r in greetings] == [True, True], greetings
    prompt = engine.apply_chat_template(
        [{"role": "user", "content": "Write a sum of small numbers."}]
    )
    sums = engine.generate(
        [prompt] * 2, {"lark": LARK, "temperature": 0.7, "seed": 2, "max_new_tokens": 16}
    )
    for result in sums:
        text = result["text"]
        assert SUM.fullmatch(text) or (result["meta_info"]["finish_reason"]["type"] == "length"
                                       and SUM.fullmatch(text.rstrip("+"))), text  # fmt: skip
