"""Embeddings over HTTP on the tiny model: OpenAI's /v1/embeddings through the real openai
client (its default base64 encoding and floats), SGLang's /encode, both equal to the
offline Engine's vectors; batch equals one by one; bad input is a 400 naming the field."""

from __future__ import annotations

import httpx
import openai
import pytest
from test_server import API_KEY, AUTH, start_server, stop_server

from spruce.runtime import Engine

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("embeddings") / "server.log"
    srv = start_server(tiny_llama_dir, log, "--api-key", API_KEY, "--kv-cache-dtype", "float32")
    yield srv
    assert stop_server(srv) == 0, srv.log()


@pytest.fixture(scope="module")
def expected(tiny_llama_dir):
    """The offline Engine's vectors of the texts, the reference (itself checked against
    transformers in tests/runtime/engine/test_embeddings.py)."""
    engine = Engine(str(tiny_llama_dir), kv_memory_gb=0.02, num_threads=1, kv_cache_dtype="float32")
    try:
        return {text: engine.encode(text) for text in TEXTS} | {
            "short": engine.encode(TEXTS[0], dimensions=4)
        }
    finally:
        engine.shutdown()


TEXTS = ["hello world", "the quick brown fox", "a"]


def close(a, b) -> bool:
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) < TOLERANCE


@pytest.fixture()
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def test_the_openai_client_gets_the_engines_vectors(client, expected):
    model = client.models.list().data[0].id
    out = client.embeddings.create(model=model, input=TEXTS)  # base64 on the wire
    assert [d.index for d in out.data] == [0, 1, 2]
    assert all(close(d.embedding, expected[t]) for d, t in zip(out.data, TEXTS))
    floats = client.embeddings.create(model=model, input=TEXTS[1], encoding_format="float")
    assert close(floats.data[0].embedding, expected[TEXTS[1]])
    short = client.embeddings.create(model=model, input=[TEXTS[0]], dimensions=4)
    assert close(short.data[0].embedding, expected["short"])
    assert out.usage.prompt_tokens == out.usage.total_tokens > 3


def test_token_id_input_and_batch_equals_one_by_one(client):
    model = client.models.list().data[0].id
    prompts = [[5, 9, 17, 33], [7, 7, 12, 40, 41, 42]]
    batch = client.embeddings.create(model=model, input=prompts, encoding_format="float").data
    for p, together in zip(prompts, batch):
        alone = client.embeddings.create(model=model, input=p, encoding_format="float").data[0]
        assert close(alone.embedding, together.embedding)


def test_native_encode(server, expected):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as http:
        one = http.post("/encode", json={"text": TEXTS[0]}).json()
        many = http.post("/encode", json={"text": TEXTS[:2], "dimensions": 4}).json()
        bad = http.post("/encode", json={"text": "x", "max_new_tokens": 3})
    assert close(one["embedding"], expected[TEXTS[0]]) and one["meta_info"]["prompt_tokens"] > 0
    assert len(many) == 2 and close(many[0]["embedding"], expected["short"])
    assert bad.status_code == 400 and "max_new_tokens" in bad.text


@pytest.mark.parametrize(
    "body, field",
    [({"input": ""}, "input"), ({"input": "x", "dimensions": 0}, "dimensions"),
     ({"input": "x", "encoding_format": "int8"}, "encoding_format"), ({"input": [[10**9]]}, "input")],
)  # fmt: skip
def test_bad_input_is_a_400_naming_the_field(client, body, field):
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError) as error:
        client.post("/embeddings", body={"model": model, **body}, cast_to=httpx.Response)
    assert error.value.body["param"] == field, error.value.body
