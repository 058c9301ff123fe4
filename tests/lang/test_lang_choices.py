"""select()'s three scoring methods on hand-made logprobs, and the boundary merge."""

from __future__ import annotations

import pytest
from test_lang_fakes import FakeBackend, FakeTokenizer

import spruce.lang as sl
from spruce.lang.select import choice_token_logprobs, score_choices

CHOICES = ["ab", "cde", "f"]
LOGPROBS = [
    [[-1.0, 1], [-0.5, 2]],  # mean -0.75
    [[-1.0, 3], [-0.2, 4], [-3.0, 5]],  # mean -1.4
    [[-1.2, 6]],  # mean -1.2
]


def call(method, unconditional=None):
    return method(
        choices=CHOICES,
        normalized_prompt_logprobs=[sum(x[0] for x in t) / len(t) for t in LOGPROBS],
        input_token_logprobs=LOGPROBS,
        output_token_logprobs=[[], [], []],
        unconditional_token_logprobs=unconditional,
    )


def test_token_length_normalized_takes_the_best_mean():
    out = call(sl.token_length_normalized)
    assert out.decision == "ab"
    assert out.meta_info["scores"] == pytest.approx([-0.75, -1.4, -1.2])


def test_greedy_token_selection_compares_token_by_token():
    out = call(sl.greedy_token_selection)
    # column 0: -1.0, -1.0, -1.2 -> "ab" and "cde" tie; column 1: -0.5 vs -0.2 -> "cde"
    assert out.decision == "cde"
    assert out.meta_info["greedy_logprob_matrix"] == [
        [-1.0, -0.5, -0.75],
        [-1.0, -0.2, -3.0],
        [-1.2, -1.2, -1.2],
    ]


def test_unconditional_likelihood_normalized_subtracts_the_promptless_logprobs():
    unconditional = [
        [[None, 1], [-0.1, 2]],  # (-1 - 0 + -0.5 + 0.1) / 2 = -0.7
        [[None, 3], [-5.0, 4], [-0.5, 5]],  # (-1 + 4.8 - 2.5) / 3 = 0.4333
        [[None, 6]],  # -1.2
    ]
    out = call(sl.unconditional_likelihood_normalized, unconditional)
    assert out.decision == "cde"
    assert out.meta_info["scores"] == pytest.approx([-0.7, 1.3 / 3, -1.2])


def test_choice_tokens_start_where_the_tokenizations_differ():
    backend = FakeBackend()
    prefix = "The capital of France is "  # ends with a space: " Paris" merges with it
    n_prefix = len(backend.tokenizer.encode(prefix))
    rows = choice_token_logprobs(backend, prefix, ["Paris", "London town"], n_prefix)
    paris = backend.token_logprobs(prefix + "Paris")
    assert rows[0] == paris[n_prefix - 1 :]  # the merged " Paris" replaces the prefix's " "
    assert backend.tokenizer.decode([t for _, t in rows[0]]) == " Paris"
    assert backend.tokenizer.decode([t for _, t in rows[1]]) == " London town"


def test_choice_tokens_with_and_without_a_merge():
    backend = FakeBackend()
    prefix = "Answer:"
    rows = choice_token_logprobs(
        backend, prefix, [" yes", "!"], len(backend.tokenizer.encode(prefix))
    )
    # " yes" starts a new piece; "!" joins the prefix's ":" into one piece ":!"
    assert [backend.tokenizer.decode([t for _, t in r]) for r in rows] == [" yes", ":!"]


class _FarMergeTokenizer(FakeTokenizer):
    """Text ending in "#" is split into single characters after its first two pieces:
    a merge that reaches far back into the prefix."""

    def encode(self, text: str) -> list[int]:
        ids = super().encode(text)
        if not text.endswith("#"):
            return ids
        head = self.decode(ids[:2])
        with self._lock:
            return ids[:2] + [self._id(c) for c in text[len(head) :]]


def test_a_merge_beyond_the_window_widens_it():
    backend = FakeBackend()
    backend.tokenizer = _FarMergeTokenizer()
    prefix = "w1 w2 w3 w4 w5 w6 w7 w8"
    rows = choice_token_logprobs(backend, prefix, ["#"], len(backend.tokenizer.encode(prefix)))
    assert backend.tokenizer.decode([t for _, t in rows[0]]) == " w3 w4 w5 w6 w7 w8#"
    assert [r.logprob_start_len for r in backend.requests] == [4, 0]


def test_select_sends_one_commit_and_one_batched_request():
    backend = FakeBackend()
    out = score_choices(
        backend, "Pick one:", [" red", " green", " blue"], sl.token_length_normalized
    )
    assert out.decision in (" red", " green", " blue")
    commit, batch = backend.requests
    assert commit.sampling_params == {"max_new_tokens": 0} and commit.text == "Pick one:"
    assert batch.text == ["Pick one:", "Pick one: red", "Pick one: green", "Pick one: blue"]
    assert batch.return_logprob and batch.sampling_params == {"max_new_tokens": 0}


def test_unconditional_method_adds_one_batched_request():
    backend = FakeBackend()
    out = score_choices(
        backend, "Pick one:", [" red", " blue"], sl.unconditional_likelihood_normalized
    )
    last = backend.requests[-1]
    assert last.input_ids == [[t for _, t in r] for r in out.meta_info["input_token_logprobs"]]
    assert last.logprob_start_len == 0 and len(backend.requests) == 3


def test_select_at_the_very_start_is_refused():
    with pytest.raises(sl.ProgramError, match="no logprob"):
        score_choices(FakeBackend(), "", ["a", "b"], sl.token_length_normalized)
