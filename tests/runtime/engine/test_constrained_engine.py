"""Constrained decoding inside the Engine on the tiny random model: the constraint alone
must make every output valid; jump-forward saves forward passes; bad constraints are
refused per request while the engine keeps serving."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from support import DATA_DIR
from test_engine import GREEDY, make_engine, prompts

from spruce.runtime import ConstraintError

SCHEMAS = sorted((DATA_DIR / "schemas").glob("*.json"))  # the shared schemas
OWN_SCHEMAS = {
    "flags": {
        "type": "object",
        "properties": {"on": {"type": "boolean"}, "n": {"type": "null"}},
        "required": ["on", "n"],
    },
    "matrix": {
        "type": "array",
        "items": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
        "maxItems": 3,
    },
    "nested": {
        "type": "object",
        "properties": {
            "a": {
                "type": "object",
                "properties": {"b": {"type": "string", "enum": ["x", "y z"]}},
                "required": ["b"],
            }
        },
        "required": ["a"],
    },
}
SAMPLED = {"temperature": 1.0, "max_new_tokens": 600}


# The spruce backend: its converter bounds numbers and strings, so random logits end (under
# llguidance a number's digits go on as long as random logits pick them: see the last test).
@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return make_engine(tiny_llama_dir, kv_memory_gb=0.05, grammar_backend="spruce")


@pytest.fixture(scope="module")
def engine_no_jump(tiny_llama_dir):
    return make_engine(
        tiny_llama_dir, kv_memory_gb=0.05, disable_jump_forward=True, grammar_backend="spruce"
    )


def load_schemas() -> dict[str, dict]:
    found = {p.stem: json.loads(p.read_text()) for p in SCHEMAS}
    assert len(found) >= 11, "the shared schemas were not found"
    return {**found, **OWN_SCHEMAS}


ALL_SCHEMAS = load_schemas()


def check_valid(out: dict, schema: dict) -> None:
    assert out["meta_info"]["finish_reason"]["type"] == "stop", out["meta_info"]["finish_reason"]
    jsonschema.validate(json.loads(out["text"]), schema, format_checker=jsonschema.FormatChecker())


@pytest.mark.parametrize("name", sorted(ALL_SCHEMAS))
def test_every_schema_validates_under_random_logits(engine, name):
    schema = ALL_SCHEMAS[name]
    params = [{**SAMPLED, "json_schema": schema, "seed": seed} for seed in range(3)]
    for out in engine.generate(["Fill in:"] * 3, params):
        check_valid(out, schema)


@pytest.mark.parametrize(
    "regex",
    [
        r"[a-c]{2,5}",
        r"(cat|dog|bird)s?",
        r"\d{3}-\d{4}",
        r"(x|cafe)+",
        r"[A-Z][a-z]{0,6}( [A-Z][a-z]{0,6}){0,2}",
        r"-?(0|[1-9][0-9]{0,5})(\.[0-9]{1,3})?",
    ],
)
def test_regex_outputs_full_match(engine, regex):
    params = [{**SAMPLED, "max_new_tokens": 40, "regex": regex, "seed": s} for s in range(4)]
    for out in engine.generate(["x"] * 4, params):
        assert re.fullmatch(regex, out["text"]), out["text"]


def test_choices_and_pydantic(engine):
    from pydantic import BaseModel

    class City(BaseModel):
        name: str
        population: int

    out = engine.generate("x", {**SAMPLED, "choices": ["Paris", "Berlin", "Rome"], "seed": 1})
    assert out["text"] in {"Paris", "Berlin", "Rome"}
    from spruce.runtime import SamplingParams

    city = engine.generate(
        "x", SamplingParams(temperature=1.0, max_new_tokens=200, json_schema=City, seed=2)
    )
    City.model_validate_json(city["text"])


def test_unconstrained_request_unchanged_in_a_mixed_batch(engine):
    p = prompts(1, seed=30)[0]
    alone = engine.generate(input_ids=p, sampling_params=GREEDY)["output_ids"]
    batch = engine.generate(
        input_ids=[p, p[:5], p[:9]],
        sampling_params=[
            GREEDY,
            {**SAMPLED, "regex": "[0-9]{4}"},
            {**SAMPLED, "json_schema": OWN_SCHEMAS["flags"]},
        ],
    )
    assert batch[0]["output_ids"] == alone
    assert re.fullmatch("[0-9]{4}", batch[1]["text"])


def count_steps(engine, schema: dict, seeds: int = 3) -> tuple[int, list[dict]]:
    engine.core.step_log = []
    outs = engine.generate(
        ["Fill in:"] * seeds, [{**SAMPLED, "json_schema": schema, "seed": s} for s in range(seeds)]
    )
    steps = len(engine.core.step_log)
    engine.core.step_log = None
    return steps, outs


def test_jump_forward_cuts_forward_passes(engine, engine_no_jump):
    schema = ALL_SCHEMAS["order"]
    with_jump, outs = count_steps(engine, schema)
    without, plain = count_steps(engine_no_jump, schema)
    for out in outs + plain:
        check_valid(out, schema)
    assert sum(o["meta_info"]["jump_forward_tokens"] for o in outs) > 0
    assert all(o["meta_info"]["jump_forward_tokens"] == 0 for o in plain)
    assert with_jump < without


def test_jump_forward_respects_max_new_tokens(engine):
    out = engine.generate(
        "x",
        {"temperature": 1.0, "max_new_tokens": 3, "json_schema": ALL_SCHEMAS["order"], "seed": 0},
    )
    assert out["meta_info"]["completion_tokens"] <= 3
    assert out["meta_info"]["finish_reason"]["type"] == "length"


BAD_CONSTRAINTS = [
    ({"regex": "(unclosed"}, "invalid regex"),
    ({"json_schema": "{not json"}, "not valid JSON"),
    (
        {
            "json_schema": {"type": "object", "not": {"properties": {"a": {"pattern": "x"}}}},
            "schema_mode": "strict",
        },
        "not",
    ),
    ({"choices": []}, "non-empty list"),
]


@pytest.mark.parametrize("params,message", BAD_CONSTRAINTS)
def test_bad_constraints_are_refused_and_engine_keeps_serving(engine, params, message):
    with pytest.raises(ConstraintError, match=message):
        engine.generate("x", {**SAMPLED, **params})
    good = engine.generate("x", {**SAMPLED, "regex": "[ab]{3}", "seed": 3})
    assert re.fullmatch("[ab]{3}", good["text"])


def test_compile_timeout_aborts_only_that_request(tiny_llama_dir):
    # the spruce backend: its build is a worker's round trip (an llguidance build, bounded by
    # its own limits, can finish within the microsecond)
    engine = make_engine(tiny_llama_dir, grammar_timeout_s=1e-6, grammar_backend="spruce")
    slow = {
        **SAMPLED,
        "json_schema": {
            "type": "object",
            "properties": {f"k{i}": {"type": "string", "maxLength": 40} for i in range(6)},
        },
    }
    with pytest.raises(ConstraintError):
        engine.generate("x", slow)
    assert engine.generate("x", GREEDY)["meta_info"]["completion_tokens"] == 16


def test_compile_failure_reaches_a_streaming_client(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, grammar_timeout_s=1e-6)
    # a regex: it passes the front door in-process, so the index build is what times out
    slow = {**SAMPLED, "regex": '\\{"z": "[a-z]{0,200}"\\}'}
    chunks = list(engine.generate("x", slow, stream=True))
    assert chunks[-1]["finished"] and chunks[-1]["meta_info"]["finish_reason"]["type"] == "abort"


@pytest.mark.slow
def test_bundled_model_schemas_with_and_without_jump_forward():
    from support import bundled_gguf_path

    from spruce.runtime import Engine

    if bundled_gguf_path() is None:
        pytest.skip("the bundled model is not installed")
    on = Engine(num_threads=1, kv_memory_gb=0.5)
    off = Engine(loaded=on.core.loaded, num_threads=1, kv_memory_gb=0.5, disable_jump_forward=True)
    names = sorted(n for n in ALL_SCHEMAS if n not in OWN_SCHEMAS)
    prompts = [
        on.apply_chat_template(
            [{"role": "user", "content": f"An example {n.replace('_', ' ')} as JSON."}]
        )
        for n in names
    ]
    params = [
        {"json_schema": ALL_SCHEMAS[n], "temperature": 0, "max_new_tokens": 400} for n in names
    ]
    with_jump, without = on.generate(prompts, params), off.generate(prompts, params)
    for name, a, b in zip(names, with_jump, without):
        check_valid(a, ALL_SCHEMAS[name])
        check_valid(b, ALL_SCHEMAS[name])
    same = sum(a["text"] == b["text"] for a, b in zip(with_jump, without))
    jumped = sum(a["meta_info"]["jump_forward_tokens"] for a in with_jump)
    print(
        f"\nidentical texts with and without jump-forward: {same}/{len(names)}; jump-forwarded tokens: {jumped}"
    )
    assert jumped > 0


@pytest.mark.parametrize("name", ["flags", "nested"])
def test_llguidance_outputs_validate_and_jump_forward(tiny_llama_dir, name):
    """Schemas whose values are bounded (booleans, null, enums): random logits end them."""
    engine = make_engine(tiny_llama_dir, kv_memory_gb=0.05, grammar_backend="llguidance")
    schema = ALL_SCHEMAS[name]
    outs = engine.generate(
        ["Fill in:"] * 3, [{**SAMPLED, "json_schema": schema, "seed": s} for s in range(3)]
    )
    for out in outs:
        check_valid(out, schema)
    assert sum(o["meta_info"]["jump_forward_tokens"] for o in outs) > 0
