"""Embeddings through the offline Engine: each pooling equals a transformers reference on
the same tiny weights (the last layer's hidden states, after the final norm), a batch
equals one by one, chunked prompts and a prefix found in the cache give the same vector,
and bad input is refused by the validator."""

from __future__ import annotations

import json
import math

import pytest
import torch
import transformers

from spruce.runtime import Engine, InvalidRequestError
from spruce.runtime.engine.pooling import resolve_pooling

TOLERANCE = 1e-5


def make_engine(folder, **options) -> Engine:
    options = {"kv_memory_gb": 0.02, "num_threads": 1, "kv_cache_dtype": "float32", **options}
    return Engine(str(folder), **options)


@pytest.fixture(scope="module")
def hf(tiny_llama_dir):
    return transformers.LlamaForCausalLM.from_pretrained(tiny_llama_dir).eval()


def reference(hf, ids: list[int], pooling: str) -> list[float]:
    """transformers' final hidden states (the last entry is after the model's norm), pooled
    and normalized."""
    with torch.no_grad():
        states = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0].double()
    vector = {"last": states[-1], "mean": states.mean(0), "cls": states[0]}[pooling]
    return (vector / vector.norm()).tolist()


def close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) < TOLERANCE


PROMPTS = [[5, 9, 17, 33, 2, 80, 41], [7, 7, 12], list(range(20, 70))]


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_each_pooling_equals_transformers_and_a_batch_equals_one_by_one(
    tiny_llama_dir, hf, pooling
):
    engine = make_engine(tiny_llama_dir, pooling=pooling, chunked_prefill_size=16)
    try:
        batch = engine.encode(input_ids=PROMPTS)
        alone = [engine.encode(input_ids=p) for p in PROMPTS]
        again = engine.encode(input_ids=PROMPTS[2])  # its prompt is in the prefix cache now
    finally:
        engine.shutdown()
    for ids, together, single in zip(PROMPTS, batch, alone):
        assert close(together, reference(hf, ids, pooling)), pooling
        assert close(single, together)
    assert close(again, batch[2])
    assert all(math.isclose(sum(x * x for x in v), 1.0, rel_tol=1e-9) for v in batch)


def test_dimensions_and_text_prompts(tiny_llama_dir, hf):
    engine = make_engine(tiny_llama_dir)
    try:
        full = engine.encode("hello world", normalize=False)
        short = engine.encode(["hello world"], dimensions=8)[0]
        ids = engine.tokenizer.encode("hello world")
        with pytest.raises(InvalidRequestError, match="dimensions"):
            engine.encode("x", dimensions=len(full) + 1)
        with pytest.raises(InvalidRequestError, match="prompt"):
            engine.encode("")
        assert engine.generate("hi", {"max_new_tokens": 2})["output_ids"]  # still generates
    finally:
        engine.shutdown()
    with torch.no_grad():
        states = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0, -1]
    assert close(full, states.double().tolist())
    head = torch.tensor(full[:8], dtype=torch.float64)
    assert len(short) == 8 and close(short, (head / head.norm()).tolist())


def test_pooling_comes_from_a_sentence_transformers_folder(tmp_path):
    assert resolve_pooling("auto", str(tmp_path)) == "last"
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(
        json.dumps({"pooling_mode_mean_tokens": True})
    )
    assert resolve_pooling("auto", str(tmp_path)) == "mean"
    assert resolve_pooling("cls", str(tmp_path)) == "cls"
    with pytest.raises(InvalidRequestError, match="pooling"):
        resolve_pooling("max", None)
