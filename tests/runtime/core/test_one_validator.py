"""One validator (issue 31): every API maps its names onto a `Draft` and calls
`validate_call`; the messages name the fields as each API spells them (OpenAI's `param`
too), the limits are RequestLimits' and nothing else, and "at most one constraint" has one
message source."""

from __future__ import annotations

import asyncio
from dataclasses import fields
from pathlib import Path
from types import SimpleNamespace

import pytest

from spruce.constrained.core.errors import ConstraintError as LibraryConstraintError
from spruce.constrained.spec import make_spec, too_many_constraints
from spruce.runtime.core.options import RequestOptions
from spruce.runtime.core.sampling_params import SamplingParams
from spruce.runtime.core.validation import Draft, ModelLimits, validate_call
from spruce.runtime.errors import FieldNames, InvalidRequestError
from spruce.runtime.limits import RequestLimits
from spruce.runtime.protocol.dsl import GenerateMsg
from spruce.runtime.server.http.common import ApiError
from spruce.runtime.server.native import NATIVE_NAMES, ModelContext, prepare_generate
from spruce.runtime.server.openai.mapping import (
    chat_requests,
    completion_requests,
    sampling_params,
)
from spruce.runtime.server.openai.schemas import ChatRequest, CompletionRequest

ROOT = Path(__file__).resolve().parents[3]
ENGINE_NAMES = FieldNames({"text": "prompt"})  # as Engine.generate spells its prompt


def model_of(tokenizer, limits: RequestLimits | None = None) -> ModelContext:
    return ModelContext(tokenizer, "m", "/m", ModelLimits(384, 1024, limits or RequestLimits()))


def native(model: ModelContext, **fields) -> InvalidRequestError:
    """The error of a native call (HTTP /generate and ZeroMQ share it)."""
    msg = GenerateMsg(rid="r", **{"text": "hi", **fields})
    with pytest.raises(InvalidRequestError) as error:
        asyncio.run(prepare_generate(msg, model))
    return error.value


def completion(model: ModelContext, **fields) -> ApiError:
    req = CompletionRequest(model="m", **{"prompt": "hi", "max_tokens": 4, **fields})
    with pytest.raises(ApiError) as error:
        asyncio.run(completion_requests(SimpleNamespace(model=model), req))
    return error.value


def chat(model: ModelContext, top: int = 0, **fields) -> ApiError:
    req = ChatRequest(model="m", messages=[{"role": "user", "content": "hi"}], **fields)
    server = SimpleNamespace(model=model)
    with pytest.raises(ApiError) as error:
        tokens = req.max_tokens if req.max_completion_tokens is None else req.max_completion_tokens
        base = sampling_params(req, 4 if tokens is None else tokens)  # as routes.py picks it
        asyncio.run(chat_requests(server, [1, 2, 3], base, req, top))
    return error.value


# -- each API's spelling ----------------------------------------------------------------------


def test_the_same_bad_value_is_named_as_each_api_spells_it(tiny_tokenizer):
    model = model_of(tiny_tokenizer)
    error = native(model, sampling_params={"max_new_tokens": -1})
    assert str(error) == "max_new_tokens must be an integer >= 0"
    assert error.field == "max_new_tokens"
    for api in (completion(model, max_tokens=-1), chat(model, max_tokens=-1)):
        assert (api.status, api.message) == (400, "max_tokens must be an integer >= 0")
        assert api.param == "max_tokens"
    later = chat(model, max_completion_tokens=-1)
    assert later.message.startswith("max_completion_tokens must be")
    assert later.param == "max_completion_tokens"


def test_top_logprobs_n_and_prompts_in_each_spelling(tiny_tokenizer):
    model = model_of(tiny_tokenizer)
    assert str(native(model, top_logprobs_num=21)).startswith("top_logprobs_num must be")
    logprobs = completion(model, logprobs=21)
    assert logprobs.message.startswith("logprobs must be") and logprobs.param == "logprobs"
    top = chat(model, top=21, logprobs=True, top_logprobs=21)
    assert top.message.startswith("top_logprobs must be") and top.param == "top_logprobs"
    assert str(native(model, sampling_params={"n": 0})).startswith("n must be an integer")
    assert chat(model, n=0).param == "n"
    assert str(native(model, text=[])).startswith("text must be a string")
    empty = completion(model, prompt=[])
    assert empty.message.startswith("prompt must be a string") and empty.param == "prompt"
    long = chat(model, max_tokens=5000)
    assert "lower max_tokens to at most" in long.message and long.param == "max_tokens"


def test_the_engine_names_its_prompt_as_its_argument(tiny_tokenizer):
    limits = ModelLimits(384, 1024)
    with pytest.raises(InvalidRequestError, match="^prompt must be a string"):
        validate_call(Draft(text=5), limits, ENGINE_NAMES, tiny_tokenizer.encode)
    with pytest.raises(InvalidRequestError, match="^give exactly one of prompt or input_ids"):
        validate_call(Draft(), limits, ENGINE_NAMES, tiny_tokenizer.encode)


# -- the limits are RequestLimits' ------------------------------------------------------------------

LOW = RequestLimits(max_n=2, max_batch_size=3, max_top_logprobs=5)


def test_a_lowered_limit_is_honoured_by_every_door(tiny_tokenizer, tiny_llama_dir):
    model = model_of(tiny_tokenizer, LOW)
    assert "from 1 to 2 (--max-n)" in str(native(model, sampling_params={"n": 3}))
    assert "from 1 to 2 (--max-n)" in completion(model, n=3).message
    assert "from 1 to 2 (--max-n)" in chat(model, n=3).message
    batch = "at most 3 (--max-batch-size)"
    assert batch in str(native(model, text=["a", "b"], sampling_params={"n": 2}))
    assert batch in completion(model, prompt=["a", "b"], n=2).message
    assert "[0, 5]" in str(native(model, top_logprobs_num=6))
    assert "[0, 5]" in completion(model, logprobs=6).message
    assert "[0, 5]" in chat(model, top=6, logprobs=True, top_logprobs=6).message

    from spruce.runtime import Engine

    with Engine(str(tiny_llama_dir), num_threads=1, kv_memory_gb=0.02, request_limits=LOW) as e:
        with pytest.raises(InvalidRequestError, match=r"\[0, 5\]"):
            e.generate("hi", return_logprob=True, top_logprobs_num=6)
        with pytest.raises(InvalidRequestError, match="at most 3"):
            e.generate(["a", "b", "c", "d"])


def test_no_second_copy_of_a_limit_or_of_the_option_list():
    import spruce.lang.ir as ir
    import spruce.runtime.executor.sampler as sampler
    import spruce.runtime.server.openai.mapping as mapping
    import spruce.runtime.server.openai.schemas as schemas
    from spruce.runtime.core import sampling_params as sp

    assert not hasattr(schemas, "MAX_TOP_LOGPROBS") and not hasattr(ir, "MAX_SAMPLES")
    assert not hasattr(mapping, "openai_names")  # no str.replace of field names
    assert sampler.MIN_TEMPERATURE is sp.MIN_TEMPERATURE
    options = {f.name: f.default for f in fields(RequestOptions)}
    message = {f.name: f.default for f in fields(GenerateMsg) if f.name in options}
    assert message == options  # the ZeroMQ / HTTP message carries RequestOptions' fields
    assert ir.REQUEST_OPTIONS == tuple(name for name in options if name != "stream")


def test_the_dsl_reads_its_n_limit_from_request_limits():
    import spruce.lang as sl
    from spruce.lang.errors import ProgramError

    most = RequestLimits().max_n
    assert sl.gen("x", n=most).n == most
    with pytest.raises(ProgramError, match=f"from 1 to {most}"):
        sl.gen("x", n=most + 1)


def test_engine_and_dsl_options_are_request_options_fields():
    with pytest.raises(TypeError, match="frob"):
        RequestOptions.from_keywords({"frob": 1}, "Engine.generate")
    with pytest.raises(TypeError, match="timeout_s"):
        RequestOptions.from_keywords({"timeout_s": 1.0}, "Engine.generate", ("timeout_s",))
    given = RequestOptions.from_keywords({"top_logprobs_num": 3}, "f")
    assert given == RequestOptions(top_logprobs_num=3)


# -- "at most one constraint": one message ---------------------------------------------------------


def test_at_most_one_constraint_has_one_message(tiny_tokenizer):
    import spruce.lang as sl

    with pytest.raises(InvalidRequestError) as runtime:
        SamplingParams(regex="a", lark="start: x").validate()
    assert str(runtime.value) == too_many_constraints(["regex", "lark"])
    with pytest.raises(LibraryConstraintError) as library:
        make_spec(regex="a", json_schema={})
    assert str(library.value) == too_many_constraints(["regex", "json_schema"])
    with pytest.raises(LibraryConstraintError) as dsl:
        sl.gen("x", dtype=int, regex="a")
    assert str(dsl.value) == too_many_constraints(["dtype", "regex"])
    openai = chat(model_of(tiny_tokenizer), regex="a", response_format={"type": "json_object"})
    assert openai.message == too_many_constraints(["regex", "response_format"])
    assert openai.param == "response_format"


def test_the_message_is_written_once_in_the_source():
    sources = [
        p for folder in ("runtime", "lang", "constrained") for p in (ROOT / folder).rglob("*.py")
    ]
    holding = [p.relative_to(ROOT) for p in sources if "give at most one" in p.read_text()]
    assert holding == [Path("constrained/spec.py")]


def test_native_names_are_the_canonical_ones():
    assert NATIVE_NAMES("max_new_tokens") == "max_new_tokens"
    error = FieldNames({"top_k": "k"}).error("top_k", "must be >= 1")
    assert (str(error), error.field) == ("k must be >= 1", "top_k")
