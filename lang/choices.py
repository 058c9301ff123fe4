"""How `select` picks a choice from the prompt logprobs of each choice's tokens.

Each method is called (as in SGLang) with keyword arguments:
  choices                       the candidate strings
  normalized_prompt_logprobs    per choice: the mean logprob of its tokens
  input_token_logprobs          per choice: [[logprob, token_id], ...] of its tokens, given
                                the program text before the select
  output_token_logprobs         per choice: [] (select generates nothing)
  unconditional_token_logprobs  per choice: the same tokens' logprobs with no prompt (the
                                first token has none: None), only for methods that set
                                `requires_unconditional_logprobs`
and returns a ChoicesDecision. `meta_info["scores"]` holds what the method ranked by.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass(frozen=True)
class ChoicesDecision:
    decision: str
    meta_info: dict[str, Any]


@dataclass(frozen=True)
class ChoicesMethod:
    """Base class; instances are immutable so they can sit in IR nodes."""

    requires_unconditional_logprobs: ClassVar[bool] = False
    scores_are_scalars: ClassVar[bool] = True

    def __call__(self, **logprobs: Any) -> ChoicesDecision:
        raise NotImplementedError


@dataclass(frozen=True)
class TokenLengthNormalized(ChoicesMethod):
    """The choice with the highest mean token logprob."""

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs,
                 output_token_logprobs, unconditional_token_logprobs=None) -> ChoicesDecision:  # fmt: skip
        scores = list(normalized_prompt_logprobs)
        meta = _base_meta(normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs)
        return ChoicesDecision(choices[_argmax(scores)], {**meta, "scores": scores})


@dataclass(frozen=True)
class GreedyTokenSelection(ChoicesMethod):
    """SGLang's rule: compare choices token by token, keeping those with the highest
    logprob at each position until one is left; a shorter choice is padded with its own
    mean logprob. Ties after the last position go to the first choice."""

    scores_are_scalars: ClassVar[bool] = False

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs,
                 output_token_logprobs, unconditional_token_logprobs=None) -> ChoicesDecision:  # fmt: skip
        matrix = greedy_logprob_matrix(input_token_logprobs)
        remaining = list(range(len(choices)))
        for column in range(len(matrix[0]) if matrix else 0):
            best = max(matrix[i][column] for i in remaining)
            remaining = [i for i in remaining if matrix[i][column] == best]
            if len(remaining) == 1:
                break
        meta = _base_meta(normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs)
        meta.update(greedy_logprob_matrix=matrix, scores=matrix)
        return ChoicesDecision(choices[remaining[0]], meta)


@dataclass(frozen=True)
class UnconditionalLikelihoodNormalized(ChoicesMethod):
    """The choice whose tokens gain the most from the prompt: the mean of (logprob given
    the prompt - logprob given no prompt); the first token's missing unconditional logprob
    counts as 0."""

    requires_unconditional_logprobs: ClassVar[bool] = True

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs,
                 output_token_logprobs, unconditional_token_logprobs=None) -> ChoicesDecision:  # fmt: skip
        if unconditional_token_logprobs is None:
            raise ValueError(
                "unconditional_likelihood_normalized needs unconditional_token_logprobs"
            )
        scores = [
            _mean([c[0] - (u[0] or 0.0) for c, u in zip(cond, uncond)])
            for cond, uncond in zip(input_token_logprobs, unconditional_token_logprobs)
        ]
        meta = _base_meta(normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs)
        meta.update(
            unconditional_token_logprobs=unconditional_token_logprobs,
            normalized_unconditional_prompt_logprobs=scores,
            scores=scores,
        )
        return ChoicesDecision(choices[_argmax(scores)], meta)


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()


def greedy_logprob_matrix(input_token_logprobs: list[list[list]]) -> list[list[float]]:
    width = max(len(tokens) for tokens in input_token_logprobs)
    rows = []
    for tokens in input_token_logprobs:
        values = [t[0] for t in tokens]
        rows.append(values + [_mean(values)] * (width - len(values)))
    return rows


def sample_by_scores(
    choices: list[str], scores: list[float], temperature: float, rng: random.Random
) -> str:
    """A choice drawn with probability softmax(scores / temperature)."""
    top = max(scores)
    weights = [math.exp((s - top) / temperature) for s in scores]
    return rng.choices(choices, weights=weights)[0]


def _base_meta(normalized, input_token_logprobs, output_token_logprobs) -> dict[str, Any]:
    return {
        "normalized_prompt_logprobs": list(normalized),
        "input_token_logprobs": input_token_logprobs,
        "output_token_logprobs": output_token_logprobs,
    }


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _argmax(values: list[float]) -> int:
    return max(range(len(values)), key=lambda i: (values[i], -i))
