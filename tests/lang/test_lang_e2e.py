"""The DSL against a real `spruce serve` on the tiny random-weight model (one server for
the session, see conftest.py), on both transports: ZeroMQ and HTTP."""

from __future__ import annotations

import importlib.util
import json
import re

import pytest

import spruce.lang as sl
from spruce.lang.launcher import free_port
from spruce.runtime.protocol.dsl import GenerateMsg
from spruce.runtime.text.tokenizer import Tokenizer

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("spruce.runtime.server.launch") is None,
    reason="spruce serve is not available",
)
GREEDY = {"temperature": 0}


@pytest.fixture(scope="session")
def tokenizer(tiny_llama_dir):
    return Tokenizer.from_folder(str(tiny_llama_dir))


def prompt_logprobs(endpoint, text: str) -> list[list]:
    msg = GenerateMsg(sl.backend.new_rid(), text=text, sampling_params={"max_new_tokens": 0},
                      return_logprob=True, logprob_start_len=0)  # fmt: skip
    return endpoint.generate(msg).meta_info["input_token_logprobs"]


@sl.function
def qa(s, question):
    s += "Question: " + question + "\nAnswer:"
    s += sl.gen("answer", max_tokens=6)


def test_gen_stores_variables(endpoint):
    state = qa.run(question="What is 2 + 2?", backend=endpoint, **GREEDY)
    assert state.ok, state.error()
    meta = state.get_meta_info("answer")
    assert meta["prompt_tokens"] > 0 and meta["completion_tokens"] <= 6
    assert state.text() == "Question: What is 2 + 2?\nAnswer:" + state["answer"]
    again = qa.run(question="What is 2 + 2?", backend=endpoint, **GREEDY)
    assert again["answer"] == state["answer"]  # greedy is deterministic
    assert again.get_meta_info("answer")["cached_tokens"] > 0  # the radix cache kept the prompt


CHOICES = ["Paris", "London", "the quick brown fox"]
METHODS = [
    sl.token_length_normalized,
    sl.greedy_token_selection,
    sl.unconditional_likelihood_normalized,
]


@pytest.mark.parametrize("method", METHODS, ids=lambda m: type(m).__name__)
def test_select_scores_equal_a_direct_computation(endpoint, tokenizer, method):
    prefix = "The capital of France is "

    @sl.function
    def pick(s):
        s += prefix + sl.select("city", CHOICES, choices_method=method)

    state = pick.run(backend=endpoint)
    assert state.ok, state.error()
    assert state["city"] in CHOICES
    meta = state.get_meta_info("city")
    prefix_ids = tokenizer.encode(prefix)
    for choice, got in zip(CHOICES, meta["input_token_logprobs"]):
        full_ids = tokenizer.encode(prefix + choice)
        split = next(i for i, (a, b) in enumerate(zip(prefix_ids + [-1], full_ids)) if a != b)
        expected = prompt_logprobs(endpoint, prefix + choice)[split:]
        assert [t for _, t in got] == full_ids[split:] == [t for _, t in expected]
        assert [lp for lp, _ in got] == pytest.approx([lp for lp, _ in expected], abs=1e-3)
    rows = meta["input_token_logprobs"]
    means = [sum(lp for lp, _ in r) / len(r) for r in rows]
    assert meta["normalized_prompt_logprobs"] == pytest.approx(means)
    if method is sl.unconditional_likelihood_normalized:
        uncond = [_input_ids_logprobs(endpoint, [t for _, t in r]) for r in rows]
        expected = [
            sum(c[0] - (u[0] or 0) for c, u in zip(r, ur)) / len(r) for r, ur in zip(rows, uncond)
        ]
        assert meta["scores"] == pytest.approx(expected, abs=1e-3)
    elif method is sl.token_length_normalized:
        assert meta["scores"] == pytest.approx(means)
        assert state["city"] == CHOICES[means.index(max(means))]
    else:
        assert meta["greedy_logprob_matrix"][0][: len(rows[0])] == pytest.approx(
            [lp for lp, _ in rows[0]]
        )


def _input_ids_logprobs(endpoint, ids: list[int]) -> list[list]:
    msg = GenerateMsg(sl.backend.new_rid(), input_ids=ids, sampling_params={"max_new_tokens": 0},
                      return_logprob=True, logprob_start_len=0)  # fmt: skip
    return endpoint.generate(msg).meta_info["input_token_logprobs"]


@sl.function
def structured(s):
    s += "Phone: " + sl.gen("phone", regex=r"\d{3}-\d{4}", max_tokens=12) + "\n"
    s += "Person: " + sl.gen("person", json_schema=PERSON_SCHEMA, max_tokens=64) + "\n"
    s += "Age: " + sl.gen_int("age", max_tokens=6) + "\n"
    s += "Ok: " + sl.gen("ok", dtype=bool, max_tokens=3) + "\n"
    s += "Color: " + sl.gen("color", choices=["red", "green"], max_tokens=4)


PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


def test_constrained_gens_always_match(endpoint):
    import jsonschema

    for state in structured.run_batch([{}] * 3, backend=endpoint, temperature=1.0):
        assert state.ok, state.error()
        assert re.fullmatch(r"\d{3}-\d{4}", state["phone"])
        jsonschema.validate(json.loads(state["person"]), PERSON_SCHEMA)
        int(state["age"])
        assert state["ok"] in ("True", "False") and state["color"] in ("red", "green")


def test_a_rejected_constraint_carries_the_runtimes_message(endpoint):
    @sl.function
    def bad(s):
        s += "x" + sl.gen("y", regex="(unclosed", max_tokens=2)

    state = bad.run(backend=endpoint)
    error = state.error()
    assert isinstance(error, sl.RuntimeRequestError) and error.status == 400 and error.message


@sl.function
def tree(s):
    s += "Let us think about a long shared problem statement with many words in it. " * 3
    forks = s.fork(3)
    for i, f in enumerate(forks):
        f += f"Path {i}:" + sl.gen("thought", max_tokens=3)
    forks.join()


def test_fork_children_reuse_the_parents_prefix(endpoint):
    state = tree.run(backend=endpoint, **GREEDY)
    assert state.ok, state.error()
    (commit,) = state._executor.fork_commits
    for meta in state.get_meta_info("thought"):
        assert meta["cached_tokens"] >= commit["prompt_tokens"] - 1
    assert len(state["thought"]) == 3


def test_run_batch_of_fifty(endpoint):
    questions = [f"What is {i} plus {i}?" for i in range(50)]
    states = qa.run_batch(
        [{"question": q} for q in questions], backend=endpoint, max_new_tokens=4, **GREEDY
    )
    assert all(s.ok for s in states), [s.error() for s in states if not s.ok][:1]
    assert all(s.text().startswith("Question: " + q) for s, q in zip(states, questions))


def test_streaming_gives_the_same_text(endpoint):
    expected = qa.run(question="Stream this?", backend=endpoint, **GREEDY)
    state = qa.run(question="Stream this?", backend=endpoint, stream=True, **GREEDY)
    chunks = list(state.text_iter())
    assert "".join(chunks) == state.text() == expected.text()
    assert state["answer"] == expected["answer"]


@sl.function
def chat(s):
    s += sl.system("You answer in one word.")
    s += sl.user("Name a color.")
    s += sl.assistant(sl.gen("color", max_tokens=3))
    with s.user():
        s += "Another one?"
    s += sl.assistant_begin() + sl.gen("again", max_tokens=3) + sl.assistant_end()


def test_messages_have_the_roles_and_contents(endpoint):
    state = chat.run(backend=endpoint, **GREEDY)
    assert state.ok, state.error()
    assert state.messages() == [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": state["color"]},
        {"role": "user", "content": "Another one?"},
        {"role": "assistant", "content": state["again"]},
    ]
    template = endpoint.chat_template
    assert state.text() == template.render(state.messages(), add_generation_prompt=False)


@pytest.mark.parametrize("scheme", ["tcp", "http"])
def test_an_unreachable_endpoint_errors(scheme):
    with pytest.raises(
        sl.RuntimeUnavailableError, match="no Spruce runtime answered at .*127.0.0.1"
    ):
        sl.RuntimeEndpoint(f"{scheme}://127.0.0.1:{free_port()}")


def test_flush_cache(endpoint):
    sl.flush_cache(endpoint)
    state = qa.run(question="After a flush", backend=endpoint, **GREEDY)
    assert state.get_meta_info("answer")["cached_tokens"] == 0
