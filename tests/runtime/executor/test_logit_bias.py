"""logit_bias in the sampler: OpenAI's semantics (added to the logits, clipped to
[-100, 100]), per row, applied only to the rows that have one."""

from __future__ import annotations

import torch

from spruce.runtime.core.request import Req
from spruce.runtime.core.sampling_params import SamplingParams
from spruce.runtime.executor.sampler import Sampler


def sampler() -> Sampler:
    return Sampler(vocab_size=8, eos_token_ids=frozenset({7}), device=torch.device("cpu"))


def req(**sampling) -> Req:
    return Req("r", [1, 2], SamplingParams(temperature=0, **sampling))


def test_bias_changes_the_greedy_token_of_its_row_only():
    logits = torch.tensor([[0.0, 5.0, 1.0, 0, 0, 0, 0, 0]] * 3)
    rows = [req(), req(logit_bias={"1": -100}), req(logit_bias=[[3, 100], [1, 2.5]])]
    out = sampler().sample(logits.clone(), rows)
    assert out.ids == [1, 2, 3]


def test_bias_is_clipped_and_added():
    logits = torch.zeros(1, 8)
    s = sampler()
    s.process_logits(logits, [req(logit_bias={0: 1e6, 1: -1e6, 2: 0.5})])
    assert logits[0, :3].tolist() == [100.0, -100.0, 0.5]
    assert logits[0, 3:].abs().sum() == 0


def test_logprobs_stay_the_models_own():
    logits = torch.tensor([[0.0, 5.0, 1.0, 0, 0, 0, 0, 0]])
    row = Req("r", [1], SamplingParams(temperature=0, logit_bias={2: 100}))
    row.options = type(row.options)(return_logprob=True)
    out = sampler().sample(logits.clone(), [row])
    expected = torch.log_softmax(logits[0], -1)[2].item()
    assert out.ids == [2] and abs(out.logprobs[0].logprob - expected) < 1e-6
