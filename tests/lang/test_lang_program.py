"""The interpreter on an in-test fake backend: variables, defaults, roles, select, fork,
run_batch, streaming, errors."""

from __future__ import annotations

import asyncio
import threading

import pytest
from test_lang_fakes import CHATML, FakeBackend

import spruce.lang as sl
from spruce.lang.chat import ChatTemplate


@pytest.fixture
def backend():
    return FakeBackend()


@sl.function
def qa(s, question):
    s += "Q: " + question + "\nA:"
    s += sl.gen("answer", max_tokens=3)


def test_gen_stores_variables_and_text(backend):
    state = qa.run(question="Why?", backend=backend)
    assert state.ok and state.error() is None
    assert state["answer"] == state.get_var("answer") and len(state["answer"].split()) == 3
    assert state.text() == "Q: Why?\nA:" + state["answer"]
    assert state.get_meta_info("answer")["completion_tokens"] == 3
    (request,) = backend.requests
    assert request.text == "Q: Why?\nA:"


def test_run_defaults_fill_the_gens_unset_fields(backend):
    @sl.function
    def prog(s):
        s += "x" + sl.gen("a", max_tokens=2) + sl.gen("b", temperature=0.7)

    prog.run(backend=backend, temperature=0, max_new_tokens=5, stop=["\n"], top_p=0.9)
    a, b = (r.sampling_params for r in backend.requests)
    assert a == {"max_new_tokens": 2, "temperature": 0, "top_p": 0.9, "stop": ("\n",)}
    assert b == {"max_new_tokens": 5, "temperature": 0.7, "top_p": 0.9, "stop": ("\n",)}


def test_run_rejects_an_unknown_keyword(backend):
    with pytest.raises(TypeError, match="unexpected keyword argument 'temp'"):
        qa.run(question="x", temp=0, backend=backend)


def test_set_var_and_ret_value(backend):
    @sl.function
    def prog(s, x):
        s.set_var("double", x * 2)
        s += "v=" + str(s["double"])
        return s["double"] + 1

    state = prog.run(4, backend=backend)
    assert state.ret_value == 9 and state["double"] == 8 and state.text() == "v=8"
    assert "double" in state and "nothing" not in state


# -- roles ------------------------------------------------------------------------------------


@sl.function
def chat(s, question):
    s += sl.system("Be brief.")
    s += sl.user(question)
    s += sl.assistant(sl.gen("answer", max_tokens=2))
    with s.user():
        s += "And "
        s += "more?"
    s += sl.assistant_begin()
    s += sl.gen("more", max_tokens=2)
    s += sl.assistant_end()


def test_roles_become_messages_rendered_by_the_models_template(backend):
    state = chat.run(question="Hi?", backend=backend)
    messages = state.messages()
    assert messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi?"},
        {"role": "assistant", "content": state["answer"]},
        {"role": "user", "content": "And more?"},
        {"role": "assistant", "content": state["more"]},
    ]
    template = ChatTemplate(CHATML)
    assert state.text() == template.render(messages, add_generation_prompt=False)
    # a gen after assistant_begin sees the template's rendering with the generation prompt
    first, second = (r.text for r in backend.requests)
    assert first == template.render(messages[:2], add_generation_prompt=True)
    assert second == template.render(messages[:4], add_generation_prompt=True)


def test_a_template_with_a_default_system_prompt():
    smol_like = (
        "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
        "{{ '<|im_start|>system\nDefault<|im_end|>\n' }}{% endif %}"
        "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    backend = FakeBackend(chat_template=smol_like)

    @sl.function
    def prog(s):
        with s.user():
            s += "Hello"
            s += sl.gen("echo", max_tokens=1)
        s += sl.assistant(sl.gen("reply", max_tokens=1))

    state = prog.run(backend=backend)
    assert (
        backend.requests[0].text == "<|im_start|>system\nDefault<|im_end|>\n<|im_start|>user\nHello"
    )
    assert state.text() == ChatTemplate(smol_like).render(
        state.messages(), add_generation_prompt=False
    )


def test_role_misuse_is_an_error(backend):
    @sl.function
    def prog(s):
        s += sl.user_begin()
        s += sl.assistant_end()

    state = prog.run(backend=backend)
    assert isinstance(state.error(), sl.ProgramError) and "cannot end a assistant block" in str(
        state.error()
    )


def test_roles_need_a_chat_template():
    state = chat.run(question="x", backend=FakeBackend(chat_template=None))
    assert "no chat template" in str(state.error())


# -- select ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "method",
    [sl.token_length_normalized, sl.greedy_token_selection, sl.unconditional_likelihood_normalized],
)
def test_select_scores_match_a_direct_computation(backend, method):
    @sl.function
    def prog(s):
        s += "The answer is "
        s += sl.select("pick", choices=["yes", "no way", "maybe"], choices_method=method)

    state = prog.run(backend=backend)
    meta = state.get_meta_info("pick")
    prefix_ids = backend.tokenizer.encode("The answer is ")
    expected_rows = []
    for choice in ["yes", "no way", "maybe"]:
        full = backend.token_logprobs("The answer is " + choice)
        expected_rows.append(full[len(prefix_ids) - 1 :])  # " yes" replaces the trailing " "
    assert meta["input_token_logprobs"] == expected_rows
    means = [sum(lp for lp, _ in row) / len(row) for row in expected_rows]
    assert meta["normalized_prompt_logprobs"] == pytest.approx(means)
    if method is sl.unconditional_likelihood_normalized:
        uncond = [
            backend.token_logprobs(backend.tokenizer.decode([t for _, t in row]))
            for row in expected_rows
        ]
        expected = [
            sum(c[0] - (u[0] or 0.0) for c, u in zip(row, urow)) / len(row)
            for row, urow in zip(expected_rows, uncond)
        ]
        assert meta["scores"] == pytest.approx(expected)
    elif method is sl.token_length_normalized:
        assert meta["scores"] == pytest.approx(means)
    decision = state["pick"]
    assert decision in ("yes", "no way", "maybe") and state.text() == "The answer is " + decision
    if method is not sl.greedy_token_selection:
        assert (
            decision == ["yes", "no way", "maybe"][max(range(3), key=lambda i: meta["scores"][i])]
        )


def test_select_with_temperature_samples_a_choice(backend):
    @sl.function
    def prog(s):
        s += "Pick:" + sl.select("c", [" a", " b"], temperature=1.0)

    assert prog.run(backend=backend)["c"] in (" a", " b")


# -- fork --------------------------------------------------------------------------------------


@sl.function
def branches(s):
    s += "Shared prompt with some words. "
    forks = s.fork(3)
    for i, f in enumerate(forks):
        f += f"Branch {i}:" + sl.gen("idea", max_tokens=2)
    forks.join()
    s += "Done."


def test_fork_commits_the_prefix_then_runs_children_in_parallel():
    backend = FakeBackend(delay=0.2)
    state = branches.run(backend=backend)
    commit = backend.requests[0]
    assert (
        commit.sampling_params == {"max_new_tokens": 0}
        and commit.text == "Shared prompt with some words. "
    )
    assert backend.max_in_flight == 3  # the three children's gens overlapped
    ideas = state["idea"]
    assert isinstance(ideas, list) and len(ideas) == 3 and all(isinstance(x, str) for x in ideas)
    for meta in state.get_meta_info("idea"):
        assert meta["cached_tokens"] >= len(backend.tokenizer.encode(commit.text)) - 1
    assert state.text() == "Shared prompt with some words. Done."


def test_fork_group_appends_to_all_and_concatenates(backend):
    @sl.function
    def prog(s):
        s += "Start."
        forks = s.fork(2)
        forks += lambda i: f" [{i}]"
        forks += [" x", " y"]
        forks.join("concate_and_append")

    assert prog.run(backend=backend).text() == "Start. [0] x [1] y"


# -- run_batch ---------------------------------------------------------------------------------


FEW_SHOT = "".join(f"Q: question number {i}?\nA: answer {i}.\n" for i in range(5))


@sl.function
def few_shot(s, question):
    if question == "boom":
        raise ValueError("this program fails")
    s += FEW_SHOT + "Q: " + question + "\nA:"
    s += sl.gen("answer", max_tokens=2)


def test_run_batch_hints_the_common_prefix_and_keeps_failures_apart(backend):
    questions = [f"what is {i}" for i in range(49)] + ["boom"]
    states = few_shot.run_batch(
        [{"question": q} for q in questions], backend=backend, num_threads=8
    )
    assert len(states) == 50
    hint = backend.requests[0]
    # the common prefix, cut before its last space (the next word's token starts there)
    assert hint.sampling_params == {"max_new_tokens": 0} and hint.text == FEW_SHOT + "Q: what is"
    assert all(s.ok for s in states[:-1]) and all(s["answer"] for s in states[:-1])
    assert isinstance(states[-1].error(), ValueError) and not states[-1].ok
    assert [
        s.text().split("\nA:")[-2][-len(q) :] for s, q in zip(states[:3], questions)
    ] == questions[:3]


def test_run_batch_progress_bar_and_defaults(backend, capsys):
    states = qa.run_batch(
        [{"question": "a"}, {"question": "b"}], backend=backend, progress_bar=True, temperature=0
    )
    assert all(s.ok for s in states)
    gens = [r for r in backend.requests if r.sampling_params["max_new_tokens"]]
    assert len(gens) == 2 and all(r.sampling_params.get("temperature") == 0 for r in gens)


# -- streaming ---------------------------------------------------------------------------------


class GatedBackend(FakeBackend):
    """Streams a request's first token, then holds the rest until `release` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def generate_stream(self, msg):
        for i, chunk in enumerate(super().generate_stream(msg)):
            if i == 1:
                assert self.release.wait(60)
            yield chunk


def test_streaming_gives_the_same_text_as_not_streaming(backend):
    expected = qa.run(question="Stream?", backend=backend)
    gated = GatedBackend()
    state = qa.run(question="Stream?", backend=gated, stream=True)
    chunks = state.text_iter()
    first = next(chunks)  # arrives while the backend holds the rest of the answer
    assert expected.text().startswith(first) and first != expected.text()
    gated.release.set()
    assert first + "".join(chunks) == state.text() == expected.text()
    assert (
        "".join(qa.run(question="Stream?", backend=backend, stream=True).text_iter("answer"))
        == expected["answer"]
    )
    assert all(r.stream for r in backend.requests[1:])


def test_reading_a_streaming_state_waits_for_what_it_reads():
    backend = FakeBackend(delay=0.2)
    state = qa.run(question="Slow?", backend=backend, stream=True)
    assert state["answer"]  # waits for the variable, not only for what is queued so far
    assert state.text() == "Q: Slow?\nA:" + state["answer"]


def test_async_streaming(backend):
    async def collect():
        state = qa.run(question="Async?", backend=backend, stream=True)
        return [c async for c in state.text_async_iter()], state

    chunks, state = asyncio.run(collect())
    assert "".join(chunks) == state.text()


# -- errors ------------------------------------------------------------------------------------


def test_a_refused_request_keeps_the_runtimes_message(backend):
    @sl.function
    def prog(s):
        s += "Number: " + sl.gen("n", regex="([0-9]+")
        s += "never"

    state = prog.run(backend=backend)
    error = state.error()
    assert isinstance(error, sl.RuntimeRequestError) and "invalid regex" in error.message
    with pytest.raises(sl.RuntimeRequestError, match="invalid regex"):
        state["n"]
    assert state.text() == "Number: "


def test_an_exception_in_the_program_propagates_from_run(backend):
    with pytest.raises(ValueError, match="this program fails"):
        few_shot.run(question="boom", backend=backend)


def test_reading_a_missing_variable_names_the_known_ones(backend):
    state = qa.run(question="x", backend=backend)
    with pytest.raises(KeyError, match="answer"):
        state["missing"]


def test_states_end_their_threads(backend):
    before = threading.active_count()
    for _ in range(5):
        branches.run(backend=backend)
    assert threading.active_count() <= before + 1


def test_default_backend_and_flush_cache(backend):
    from spruce.lang import program

    saved = program._default_backend
    try:
        sl.set_default_backend(backend)
        assert qa.run(question="default").ok
        sl.flush_cache()
        assert backend.flushed == 1
    finally:
        program._default_backend = saved
