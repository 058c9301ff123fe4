"""select(): score every choice with prompt logprobs, sharing the prefix through the cache.

Requests (the prefix is the program text before the select):
  1. commit: the prefix alone, zero output tokens. It fills the radix cache and tells the
     prefix's length in tokens, P.
  2. ONE batched request over [prefix, prefix + choice_1, ..., prefix + choice_n] with
     return_logprob and logprob_start_len = L = P - window: every item reuses the cached
     prefix up to L and recomputes only a few tokens.
  3. (unconditional_likelihood_normalized only) one batched request over the choices'
     token ids alone.

The boundary merge: tokenizing prefix + choice can merge the prefix's last token(s) with
the choice's first ("is " + "Paris" -> "is", " Paris" instead of "is", " "). The batch
returns token ids from position L on for the prefix and for each prefix + choice; a
choice's tokens start where its ids first differ from the prefix's, so the merged token
(which spells the prefix's tail and the choice's head) is scored as part of the choice. If
they differ already at L the merge may reach further back: the window grows and step 2
is repeated. No tokenizer is needed on the client, and the runtime may be remote.
"""

from __future__ import annotations

from typing import Any

from spruce.lang.backend import Backend, new_rid
from spruce.lang.choices import ChoicesDecision, ChoicesMethod
from spruce.lang.errors import ProgramError
from spruce.runtime.protocol.dsl import GenerateMsg

WINDOW_TOKENS = 4  # prefix tokens recomputed per choice to see the boundary merge


def score_choices(
    backend: Backend, prefix: str, choices: list[str], method: ChoicesMethod
) -> ChoicesDecision:
    """Decides between `choices` after `prefix`; the decision's meta_info holds the
    per-choice scores and the logprobs they came from."""
    _check_choices(choices)
    prefix_len = backend.commit(prefix).get("prompt_tokens", 0) if prefix else 0
    token_logprobs = choice_token_logprobs(backend, prefix, choices, prefix_len)
    needs_unconditional = getattr(method, "requires_unconditional_logprobs", False)
    unconditional = unconditional_logprobs(backend, token_logprobs) if needs_unconditional else None
    decision = method(
        choices=choices,
        normalized_prompt_logprobs=[_mean([lp for lp, _ in tokens]) for tokens in token_logprobs],
        input_token_logprobs=token_logprobs,
        output_token_logprobs=[[] for _ in choices],
        unconditional_token_logprobs=unconditional,
    )
    decision.meta_info["prompt_tokens"] = prefix_len
    return decision


def choice_token_logprobs(
    backend: Backend, prefix: str, choices: list[str], prefix_len: int
) -> list[list[list]]:
    """Per choice: [[logprob, token_id], ...] of the tokens that spell it after `prefix`."""
    window = WINDOW_TOKENS
    while True:
        start = max(prefix_len - window, 0)
        window_ids, rows = _logprobs_from(backend, prefix, choices, prefix_len, start)
        splits = [_common_len(window_ids, [token for _, token in row]) for row in rows]
        if start == 0 or all(s > 0 for s in splits):
            break
        window *= 4  # the merge reaches back past the window: look further
    out = [row[s:] for row, s in zip(rows, splits)]
    for choice, tokens in zip(choices, out):
        _check_scorable(choice, tokens)
    return out


def unconditional_logprobs(backend: Backend, token_logprobs: list[list[list]]) -> list[list[list]]:
    """The same tokens' logprobs with no prompt (the first token has none: None)."""
    ids = [[token for _, token in tokens] for tokens in token_logprobs]
    msg = GenerateMsg(
        rid=new_rid(), input_ids=ids, sampling_params={"max_new_tokens": 0},
        return_logprob=True, logprob_start_len=0,
    )  # fmt: skip
    return [r["meta_info"]["input_token_logprobs"] for r in backend.generate(msg).results]


def _logprobs_from(
    backend: Backend, prefix: str, choices: list[str], prefix_len: int, start: int
) -> tuple[list[int], list[list[list]]]:
    """(prefix token ids from `start`, per choice the [logprob, id] of prefix + choice from `start`)."""
    texts = ([prefix] if prefix_len else []) + [prefix + c for c in choices]
    msg = GenerateMsg(
        rid=new_rid(), text=texts, sampling_params={"max_new_tokens": 0},
        return_logprob=True, logprob_start_len=start,
    )  # fmt: skip
    results = backend.generate(msg).results
    rows = [r["meta_info"]["input_token_logprobs"] for r in results]
    window_ids = [token for _, token in rows[0]] if prefix_len else []
    return window_ids, rows[len(rows) - len(choices) :]


def _common_len(a: list[int], b: list[int]) -> int:
    n = 0
    while n < len(a) and n < len(b) and a[n] == b[n]:
        n += 1
    return n


def _check_choices(choices: Any) -> None:
    if (
        isinstance(choices, str)
        or not choices
        or not all(isinstance(c, str) and c for c in choices)
    ):
        raise ProgramError(
            f"select needs a non-empty list of non-empty strings as choices; got {choices!r}"
        )


def _check_scorable(choice: str, tokens: list[list]) -> None:
    if not tokens:
        raise ProgramError(
            f"the choice {choice!r} adds no token after the prompt; it cannot be scored"
        )
    if tokens[0][0] is None:
        raise ProgramError(
            f"the choice {choice!r} starts at the first token of the prompt, which has no logprob; "
            "put some text before the select"
        )


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)
