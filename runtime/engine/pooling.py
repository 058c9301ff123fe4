"""Embeddings: a request's prompt pooled into one vector of the model's final hidden states
(after its last norm). `last` takes the last prompt position (decoder models: the default),
`mean` the mean of every position, `cls` the first. A sentence-transformers folder says
which in `1_Pooling/config.json`; `--pooling` overrides it.

The prompt may be computed in chunks, a chunk may be computed again after a retraction,
and under `last` a cached prefix is not computed at all: each chunk's rows are taken in
once, by position (`Req.pooled_upto`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from spruce.runtime.core.request import Req
from spruce.runtime.errors import InvalidRequestError

POOLING_MODES = ("last", "mean", "cls")
# sentence-transformers' 1_Pooling/config.json keys -> our modes
_SENTENCE_TRANSFORMERS = {
    "pooling_mode_lasttoken": "last",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
}


def resolve_pooling(option: str, model_path: str | None) -> str:
    """The pooling `--pooling` names, or under auto the model folder's own (else last)."""
    if option != "auto":
        if option not in POOLING_MODES:
            raise InvalidRequestError(
                f"pooling must be auto or one of {', '.join(POOLING_MODES)}; got {option!r}"
            )
        return option
    config = Path(model_path or "") / "1_Pooling" / "config.json"
    if model_path and config.is_file():
        data = json.loads(config.read_text())
        chosen = [mode for key, mode in _SENTENCE_TRANSFORMERS.items() if data.get(key)]
        if chosen:
            return chosen[0]
    return "last"


def pooled_rows(req: Req, start: int, n: int) -> str:
    """Which hidden states of a step over positions [start, start + n) the request needs
    (ForwardItem.hidden): none, its last, its first, or all of them."""
    if req.pooling is None or start + n <= req.pooled_upto:
        return ""
    end = len(req.prompt_ids)
    if req.pooling == "last":
        return "last" if start + n == end else ""
    if req.pooling == "cls":
        return "first" if start == 0 else ""
    return "all"


def pool(req: Req, start: int, rows: torch.Tensor) -> None:
    """Takes in the hidden states a step computed for the request (`pooled_rows`' rows of
    positions from `start`); rows of positions it has taken in already are skipped."""
    if req.pooling == "mean":
        fresh = rows[max(req.pooled_upto - start, 0) :]
        total = fresh.sum(0)
        req.pooled = total if req.pooled is None else req.pooled + total
        req.pooled_upto = start + rows.shape[0]
    else:  # last / cls: the one row
        req.pooled = rows[-1].clone()
        req.pooled_upto = len(req.prompt_ids)
